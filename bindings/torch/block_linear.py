"""The block-scaling recipes' operations (MXFP8BlockScaling, Float8BlockScaling) for the Linear's plan
(fp8core.linear_plan, run by linear_function.py): stateless, like current scaling, traced by torch.compile through
the block ops (fp8core.torch.block_ops).

Each operand of a GEMM is quantized with blocks along that GEMM's K, so every tensor is quantized twice: as it
is and transposed. MXFP8 makes both from one read (``quantize_mxfp8_both``; the columnwise half, block-
transposed, is the transpose's rowwise quantization, bit for bit). 128x128 tiles are transposed as they are;
1x128 blocks lie along rows and have no transpose, so the transposed tensor is quantized again (1x128 blocks
of x.T are 128x1 blocks of x, Transformer Engine's columnwise usage). Both quantizations happen where the tensor
is made (the forward for input and weight, the backward for grad_output) and only fp8 is saved for backward.
"""

from __future__ import annotations

import torch

from fp8core import Float8BlockScaling, MXFP8BlockScaling
from fp8core.layouts import ScaledTensor
from fp8core.linear_plan import LinearPlan, RolePlan, check_plan, linear_plan

from . import block_ops as bo

BLOCK_RECIPES = (MXFP8BlockScaling, Float8BlockScaling)


def check_block_recipe(recipe: Float8BlockScaling) -> None:
    """cuBLASLt has no 128x128 x 128x128 GEMM: no two operands of one GEMM may both be tiles."""
    check_plan(linear_plan(recipe))


def quantize(t: torch.Tensor, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
             state: tuple) -> tuple[ScaledTensor, ScaledTensor]:
    """(t, t.T) of a 2-D tensor, each block-quantized along its rows (a GEMM's K), as the role's plan says; both
    whatever is asked (the backward's grad_output too)."""
    t = t.contiguous()
    q, rule = role.rowwise, plan.scale
    if q.layout.kind == "mx":
        row, col = bo.quantize_mxfp8_both(t, q.encoding, rule.scale_mode)
        return row, bo.transpose_blocks(col)
    row = bo.quantize_blockwise(t, q.encoding, q.layout, rule.power_of_2, rule.epsilon)
    if q.layout.transposed is not None:
        return row, bo.transpose_blocks(row)
    return row, bo.quantize_blockwise(t.t().contiguous(), q.encoding, q.layout, rule.power_of_2, rule.epsilon)


gemm = bo.block_gemm
