"""Float8Linear's GEMMs under the block-scaling recipes (MXFP8BlockScaling, Float8BlockScaling): stateless, like
current scaling, and traced by torch.compile through the block ops (fp8core.torch.block_ops).

Each operand of a GEMM is quantized with blocks along that GEMM's K, so every tensor is quantized twice: as it
is and transposed. MXFP8 makes both from one read (``quantize_mxfp8_both``; the columnwise half, block-
transposed, is the transpose's rowwise quantization, bit for bit). 128x128 tiles are transposed as they are;
1x128 blocks lie along rows and have no transpose, so the transposed tensor is quantized again (1x128 blocks
of x.T are 128x1 blocks of x, Transformer Engine's columnwise usage). Both quantizations happen where the tensor
is made (the forward for input and weight, the backward for grad_output) and only fp8 is saved for backward.

  forward  y  [M, out] = gemm(x [M, in],   w [out, in])      GEMM K = in_features
  dgrad    dx [M, in]  = gemm(dy [M, out], w.T [in, out])    GEMM K = out_features
  wgrad    dw [out, in] = gemm(dy.T [out, M], x.T [in, M])   GEMM K = M, the token count, zero-padded

Zero rows add nothing to the sums and leave every block's amax (so every other element's bits) unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8core import Float8BlockScaling, MXFP8BlockScaling
from fp8core.blocks import FP32_BLOCK, MX_BLOCK
from fp8core.layouts import Layout, ScaledTensor

from . import block_ops as bo

BLOCK_RECIPES = (MXFP8BlockScaling, Float8BlockScaling)


def block_multiple(recipe: Any) -> tuple[int, str]:
    """(the multiple in/out_features and the padded token count must be, and why)."""
    if isinstance(recipe, MXFP8BlockScaling):
        return MX_BLOCK, "the MXFP8 GEMM's K takes whole 1x32 blocks"
    return FP32_BLOCK, "the 1x128/128x128 block GEMM's K takes whole 128-element blocks"


def check_block_recipe(recipe: Float8BlockScaling) -> None:
    """cuBLASLt has no 128x128 x 128x128 GEMM: no two operands of one GEMM may both be tiles."""
    dims = {"x": recipe.x_block_scaling_dim, "w": recipe.w_block_scaling_dim, "grad": recipe.grad_block_scaling_dim}
    for a, b, gemm in (("x", "w", "forward"), ("grad", "w", "dgrad"), ("grad", "x", "wgrad")):
        if dims[a] == dims[b] == 2:
            raise ValueError(f"recipe: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2 (128x128 tiles), "
                             f"which makes the {gemm} GEMM 128x128 x 128x128 (cuBLASLt has none); set one to 1")


def block_spec(recipe: Any) -> tuple:
    """The recipe as a tuple of constants (what the autograd.Function and torch.compile take): the formats,
    the (input, weight, grad_output) layouts, and the scale rule's settings."""
    fmt = recipe.fp8_format
    if isinstance(recipe, MXFP8BlockScaling):
        return fmt.fwd.value, fmt.bwd.value, (Layout.MX_ROWWISE,) * 3, recipe.scale_mode
    return fmt.fwd.value, fmt.bwd.value, recipe.layouts, recipe.power_of_2, float(recipe.epsilon)


def _quantize_both(t: torch.Tensor, fmt: str, spec: tuple, which: int) -> tuple[Any, Any]:
    """(t, t.T) of a 2-D tensor, each block-quantized along its rows (a GEMM's K); ``which`` indexes the
    recipe's layouts: 0 input, 1 weight, 2 grad_output."""
    layout = spec[2][which]
    if layout.kind == "mx":
        row, col = bo.quantize_mxfp8_both(t, fmt, spec[3])
        return row, bo.transpose_blocks(col)
    q = bo.quantize_blockwise(t, fmt, layout, *spec[3:])
    if layout.transposed is not None:
        return q, bo.transpose_blocks(q)
    return q, bo.quantize_blockwise(t.t().contiguous(), fmt, layout, *spec[3:])


def _padded(x2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    rows = x2.shape[0]
    pad = -rows % multiple
    return (F.pad(x2, (0, 0, 0, pad)) if pad else x2).contiguous(), rows


class BlockMatmul(torch.autograd.Function):
    """x [..., in] -> [..., out] with block-scaled GEMMs forward and backward; no state."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec):
        multiple = MX_BLOCK if spec[2][0].kind == "mx" else FP32_BLOCK
        x2, rows = _padded(x.reshape(-1, x.shape[-1]), multiple)
        x_q, x_t = _quantize_both(x2, spec[0], spec, 0)
        w_q, w_t = _quantize_both(weight.contiguous(), spec[0], spec, 1)
        y = bo.block_gemm(x_q, w_q, x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(*x_t, *w_t)
        ctx.spec, ctx.x_shape, ctx.multiple = spec, x.shape, multiple
        ctx.layouts = (x_t.layout, w_t.layout)
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, grad):
        xd, xs, wd, ws = ctx.saved_tensors
        x_t, w_t = ScaledTensor(xd, xs, ctx.layouts[0]), ScaledTensor(wd, ws, ctx.layouts[1])
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2, rows = _padded(grad.reshape(-1, grad.shape[-1]), ctx.multiple)
        g_q, g_t = _quantize_both(g2, ctx.spec[1], ctx.spec, 2)
        dx = bo.block_gemm(g_q, w_t, x_dtype)[:rows].reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = bo.block_gemm(g_t, x_t, w_dtype) if ctx.needs_input_grad[1] else None
        db = g2.double().sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None
