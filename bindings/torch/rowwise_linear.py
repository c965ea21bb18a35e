"""Float8Linear's GEMMs under Float8RowwiseScaling (torchao's ``rowwise`` and ``rowwise_with_gw_hp``): stateless,
like current scaling, traced by torch.compile through the block ops (fp8core.torch.block_ops).

Each operand is quantized with one scale per row of the GEMM operand it becomes, i.e. along that GEMM's K. A
tensor used in two GEMMs along different axes is quantized twice: per row as it is, and per column (axis=0),
which ``transpose_blocks`` turns into the per-row quantization of its transpose, bits unchanged.

  forward  y  [M, out] = gemm(x [M, in] per token,       w [out, in] per output channel)   K = in
  dgrad    dx [M, in]  = gemm(dy [M, out] per token,     w.T [in, out] per input channel)  K = out
  wgrad    dw [out, in] = gemm(dy.T [out, M] per channel, x.T [in, M] per input channel)    K = M, zero-padded

``rowwise_with_gw_hp``: dgrad takes the weight under one power-of-two scale (torchao's tensorwise cast of it),
wgrad runs in the caller's dtype on the unquantized tensors. Zero rows (the padding) add nothing to the sums and
leave every column's amax, so every other element's bits, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8core import Float8RowwiseScaling
from fp8core.gemm import MULTIPLE
from fp8core.layouts import Layout, RowwiseTensor

from . import block_ops as bo
from . import ops

__all__ = ["RowwiseMatmul", "rowwise_spec", "is_rowwise"]


def is_rowwise(recipe: Any) -> bool:
    return isinstance(recipe, Float8RowwiseScaling)


def rowwise_spec(recipe: Float8RowwiseScaling) -> tuple:
    """The recipe as constants (what the autograd.Function and torch.compile take)."""
    return recipe.fp8_format.fwd.value, recipe.power_of_2, float(recipe.epsilon), recipe.wgrad_high_precision


def _rows(t: torch.Tensor, spec: tuple) -> RowwiseTensor:
    """One scale per row of t (its GEMM's K along the columns)."""
    return bo.quantize_rowwise(t, spec[0], -1, spec[1], spec[2])


def _columns(t: torch.Tensor, spec: tuple) -> RowwiseTensor:
    """One scale per column of t, as the per-row quantization of t.T (the operand of a GEMM reducing over t's
    rows)."""
    return bo.transpose_blocks(bo.quantize_rowwise(t, spec[0], 0, spec[1], spec[2]))


def _tensorwise_t(w: torch.Tensor, spec: tuple) -> RowwiseTensor:
    """w.T [in, out] under w's one scale (power of two as the recipe says), as a rowwise operand whose rows all
    carry that scale: the same D as the per-tensor GEMM."""
    fmt, power_of_2, epsilon = spec[:3]
    s, s_inv = ops.compute_scale(ops.amax(w), fmt, 0, power_of_2, epsilon)
    _, q_t = ops.cast_transpose(w, s, fmt)
    return RowwiseTensor(q_t, s_inv.reshape(1, 1).expand(q_t.shape[0], 1).contiguous(), Layout.ROWWISE)


def _padded(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[rows, k] zero-padded to a multiple of 16 rows: the wgrad GEMM's K is the token count."""
    rows = x2.shape[0]
    pad = -rows % MULTIPLE
    return (F.pad(x2, (0, 0, 0, pad)) if pad else x2).contiguous(), rows


class RowwiseMatmul(torch.autograd.Function):
    """x [..., in] -> [..., out] with rowwise-scaled GEMMs forward and backward; no state."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec):
        x2, rows = _padded(x.reshape(-1, x.shape[-1]))
        w = weight.contiguous()
        y = bo.block_gemm(_rows(x2, spec), _rows(w, spec), x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        gw_hp = spec[3]
        w_t = _tensorwise_t(w, spec) if gw_hp else _columns(w, spec)
        if gw_hp:  # wgrad in high precision: the input itself
            ctx.save_for_backward(*w_t, x2)
        else:
            ctx.save_for_backward(*w_t, *_columns(x2, spec))
        ctx.spec, ctx.x_shape = spec, x.shape
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, grad):
        wd, ws, *xs = ctx.saved_tensors
        spec = ctx.spec
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2, rows = _padded(grad.reshape(-1, grad.shape[-1]))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w_t = RowwiseTensor(wd, ws, Layout.ROWWISE)
            dx = bo.block_gemm(_rows(g2, spec), w_t, x_dtype)[:rows].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if spec[3]:  # rowwise_with_gw_hp: dW = dy^T x in the caller's dtype
                dw = (g2.t() @ xs[0].to(g2.dtype)).to(w_dtype)
            else:
                dw = bo.block_gemm(_columns(g2, spec), RowwiseTensor(*xs, Layout.ROWWISE), w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.double().sum(0).to(b_dtype)  # float64: the same bits whatever order a compiler picks
        return dx, dw, db, None

