"""torchao's rowwise recipes' operations (Float8RowwiseScaling: ``rowwise`` and ``rowwise_with_gw_hp``) for the
Linear's plan (fp8core.linear_plan, run by linear_function.py): stateless, like current scaling, traced by
torch.compile through the block ops (fp8core.torch.block_ops).

Each operand is quantized with one scale per row of the GEMM operand it becomes, i.e. along that GEMM's K: input
per token (fprop) and per input channel (wgrad), weight per output channel (fprop) and per input channel (dgrad),
grad_output per token (dgrad) and per output channel (wgrad). A tensor's columnwise usage is its per-column
quantization (axis=0), which ``transpose_blocks`` turns into the per-row quantization of its transpose, bits
unchanged. ``rowwise_with_gw_hp``: dgrad takes the weight under one power-of-two scale (torchao's tensorwise cast
of it; the plan's TENSORWISE columnwise usage), wgrad runs in the caller's dtype on the unquantized tensors.
"""

from __future__ import annotations

import torch

from fp8core import Float8RowwiseScaling
from fp8core.layouts import Layout, RowwiseTensor
from fp8core.linear_plan import LinearPlan, RolePlan, ScaleRule

from . import block_ops as bo
from . import ops

__all__ = ["quantize", "gemm", "is_rowwise"]


def is_rowwise(recipe: object) -> bool:
    return isinstance(recipe, Float8RowwiseScaling)


def _rows(t: torch.Tensor, enc: str, rule: ScaleRule) -> RowwiseTensor:
    """One scale per row of t (its GEMM's K along the columns)."""
    return bo.quantize_rowwise(t, enc, -1, rule.power_of_2, rule.epsilon)


def _columns(t: torch.Tensor, enc: str, rule: ScaleRule) -> RowwiseTensor:
    """One scale per column of t, as the per-row quantization of t.T (the operand of a GEMM reducing over t's
    rows)."""
    return bo.transpose_blocks(bo.quantize_rowwise(t, enc, 0, rule.power_of_2, rule.epsilon))


def _tensorwise_t(w: torch.Tensor, enc: str, rule: ScaleRule) -> RowwiseTensor:
    """w.T [in, out] under w's one scale (power of two as the recipe says), as a rowwise operand whose rows all
    carry that scale: the same D as the per-tensor GEMM."""
    s, s_inv = ops.compute_scale(ops.amax(w), enc, 0, rule.power_of_2, rule.epsilon)
    _, q_t = ops.cast_transpose(w, s, enc)
    return RowwiseTensor(q_t, s_inv.reshape(1, 1).expand(q_t.shape[0], 1).contiguous(), Layout.ROWWISE)


def quantize(t: torch.Tensor, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
             state: tuple) -> tuple[RowwiseTensor | None, RowwiseTensor | None]:
    """(per row of t, per row of t.T), each only where asked."""
    t, rule = t.contiguous(), plan.scale
    row = _rows(t, role.rowwise.encoding, rule) if rowwise else None
    col = None
    if columnwise:
        q = role.columnwise
        col = (_tensorwise_t if q.layout is Layout.TENSORWISE else _columns)(t, q.encoding, rule)
    return row, col


gemm = bo.block_gemm
