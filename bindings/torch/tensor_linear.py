"""The per-tensor recipes' operations (DelayedScaling, Float8CurrentScaling) for the Linear's plan
(fp8core.linear_plan, run by linear_function.py): one scale per tensor, so ``cast_transpose`` makes a tensor's
rowwise and columnwise operands from one read, under the same scale.

Delayed scaling reads the layer's state (history [L, 3], scale [3], scale_inv [3]) at the role's slot and writes
the cast's amax into row 0 of the history there; current scaling scales by the tensor's own amax under the plan's
scale rule. Every cast runs, whichever GEMMs the plan keeps in high precision (override_linear_precision), so that
the histories see every tensor as Transformer Engine's do. A weight gathered in fp8 by FSDP2, or kept in fp8
(fp8_model_init), is the operand as it is, cast (and its amax taken) where it was made.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8core.layouts import Layout, ScaledTensor
from fp8core.linear_plan import LinearPlan, RolePlan

from . import ops
from .fsdp import Float8AllGatherWeight, Float8GatheredWeight

__all__ = ["quantize", "gemm", "gemm_t", "fuses_bias"]

_BIAS_EPILOGUE = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}  # else added after the GEMM


def quantize(t: torch.Tensor, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool, state: tuple,
             transposed: bool = False, scale_inv: Optional[torch.Tensor] = None
             ) -> tuple[ScaledTensor, ScaledTensor]:
    """(t's operand, t.T's operand) of a 2-D tensor under one scale, both whatever is asked (the casts feed the
    histories). ``state``: delayed scaling's (history, scale, scale_inv), () for current scaling.
    ``transposed``: t is stored as the transpose of the role's tensor (Conv1D's [in, out] weight), and its cast's
    transpose is the role's tensor: no copy is made. ``scale_inv`` [1]: t is already fp8 under it (a weight kept
    in fp8, fp8_model_init), as a Float8GatheredWeight is."""
    if isinstance(t, Float8AllGatherWeight):  # not sharded: the weight itself
        t = t.high_precision
    if isinstance(t, Float8GatheredWeight):
        t, scale_inv = t.codes, t.scale_inv
    if scale_inv is not None:
        q, q_t, s_inv = t, ops.transpose(t), scale_inv.clone()
    elif not state:
        fmt, rule = role.rowwise.encoding, plan.scale
        s, s_inv = ops.compute_scale(ops.amax(t), fmt, rule.margin, rule.power_of_2, rule.epsilon)
        q, q_t = ops.cast_transpose(t, s, fmt)
    else:
        hist, scale, scale_inv = state
        fmt, slot = role.rowwise.encoding, role.slot
        q, q_t = ops.cast_transpose(t, scale[slot:slot + 1], fmt, hist[0, slot:slot + 1])
        s_inv = scale_inv[slot:slot + 1].clone()  # the scale_inv of this cast, whatever updates follow
    if transposed:
        q, q_t = q_t, q
    return ScaledTensor(q, s_inv, Layout.TENSORWISE), ScaledTensor(q_t, s_inv, Layout.TENSORWISE)


def gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    """D [M, N] = a [M, K] · b [N, K]ᵀ · a's scale_inv · b's scale_inv (+ bias, in the GEMM's epilogue)."""
    return ops.gemm(a[0], b[0], a[1], b[1], out_dtype, bias)


def gemm_t(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Dᵀ [N, M] of :func:`gemm`'s D, made as it is: the GEMM of (b, a), with the scales applied in (a, b)'s order,
    rounds as D's does, so it gives D's transpose bit for bit with no pass over it (Conv1D's [in, out] wgrad)."""
    return ops.gemm(b[0], a[0], a[1], b[1], out_dtype)


def fuses_bias(out_dtype: torch.dtype, bias_dtype: torch.dtype) -> bool:
    """Whether the GEMM adds a bias of ``bias_dtype`` in its epilogue (it rounds once there: other bits than
    adding it afterwards); the GEMM's epilogue takes a bias in the output's 16-bit dtype only."""
    return _BIAS_EPILOGUE.get(out_dtype) == bias_dtype
