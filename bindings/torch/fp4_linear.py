"""Float8Linear's GEMMs under NVFP4BlockScaling (Transformer Engine's NVFP4 recipe), traced by torch.compile through
the FP4 ops (fp8core.torch.fp4_ops). The numerics are docs/numerics.md's "FP4" section.

Each operand of a GEMM is quantized with 16-element blocks along that GEMM's K, so each tensor is quantized twice:
rowwise (x itself) and columnwise (x^T), each with its own rule, as TE's recipe sets them:

  input        rowwise: 1x16, nearest                columnwise (wgrad): Hadamard transform, nearest
  weight       16x16 tiles (1x16 with disable_2d_quantization), nearest, no transform, both usages
  grad_output  rowwise: 1x16, stochastic rounding    columnwise (wgrad): Hadamard transform, stochastic rounding

  forward  y  [M, out] = gemm(x [M, in],   w [out, in])      GEMM K = in_features
  dgrad    dx [M, in]  = gemm(dy [M, out], w.T [in, out])    GEMM K = out_features
  wgrad    dw [out, in] = gemm(dy.T [out, M], x.T [in, M])   GEMM K = M, the token count, zero-padded to 32

Stochastic rounding draws its bytes from Philox keyed by (seed, block, offset): the layer's ``fp4_rng`` buffer
(int64 [2]: seed, offset) is copied at the forward and its offset advanced by :data:`STREAMS` per forward that
records a backward (device ops where it lives), so a run repeated with the same seed, or resumed from a state_dict,
draws the same bytes. The backward's quantizations read the copy where it lives (host memory: by value; the GPU:
the kernel reads it), never to the host.
The two gradient quantizations of one step take offsets ``offset`` and ``offset + 1``: independent bytes.
Zero rows add nothing to the sums and, with or without the transform, leave every other element's bits unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8core import NVFP4BlockScaling
from fp8core.fp4 import FP4_GEMM_K

from . import fp4_ops as fo

STREAMS = 2  # offsets a step takes: grad_output rowwise (offset) and columnwise (offset + 1)
SEED_BITS = 62  # a drawn seed fits int64 with room: the buffer holds it as it is


def fp4_multiple(recipe: NVFP4BlockScaling) -> tuple[int, str]:
    """(the multiple in/out_features must be, and why)."""
    return FP4_GEMM_K, f"the FP4 GEMM's K takes whole multiples of {FP4_GEMM_K}"


def fp4_spec(recipe: NVFP4BlockScaling) -> tuple[bool, bool, bool]:
    """(weight in 16x16 tiles, Hadamard transform on the wgrad operands, stochastic rounding of gradients)."""
    return (not recipe.disable_2d_quantization, not recipe.disable_rht, not recipe.disable_stochastic_rounding)


def initial_rng(device: Any = None) -> torch.Tensor:
    """A fresh (seed, offset = 0), int64 [2], the seed drawn from torch's default generator (torch.manual_seed
    makes it reproducible)."""
    seed = torch.randint(0, 1 << SEED_BITS, (), dtype=torch.int64)
    return torch.stack([seed, torch.zeros((), dtype=torch.int64)]).to(device)


def _padded(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    rows = x2.shape[0]
    pad = -rows % FP4_GEMM_K
    return (F.pad(x2, (0, 0, 0, pad)) if pad else x2).contiguous(), rows




class NVFP4Matmul(torch.autograd.Function):
    """x [..., in] -> [..., out] with NVFP4 GEMMs forward and backward. ``rng``: int64 [2] (seed, offset) of this
    call's gradient quantizations, a copy the layer will not change afterwards."""

    @staticmethod
    def forward(ctx, x, weight, bias, rng, spec):
        weight_2d, rht, _ = spec
        x2, rows = _padded(x.reshape(-1, x.shape[-1]))
        w = weight.contiguous()
        x_q = fo.quantize_nvfp4(x2)
        x_t = fo.quantize_nvfp4(x2, hadamard=rht, columnwise=True)
        w_q = fo.quantize_nvfp4(w, weight_2d=weight_2d)
        w_t = fo.quantize_nvfp4(w, weight_2d=weight_2d, columnwise=True)
        y = fo.nvfp4_gemm(x_q, w_q, x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(*x_t, *w_t, rng)
        ctx.spec, ctx.x_shape = spec, x.shape
        ctx.layouts = (x_t.layout, w_t.layout)
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, grad):
        xd, xs, xa, wd, ws, wa, rng = ctx.saved_tensors
        x_t = fo.NVFP4Tensor(xd, xs, xa, ctx.layouts[0])
        w_t = fo.NVFP4Tensor(wd, ws, wa, ctx.layouts[1])
        _, rht, stochastic = ctx.spec
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2, rows = _padded(grad.reshape(-1, grad.shape[-1]))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g_q = fo.quantize_nvfp4(g2, stochastic=stochastic, rng=rng, stream=0)
            dx = fo.nvfp4_gemm(g_q, w_t, x_dtype)[:rows].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            g_t = fo.quantize_nvfp4(g2, hadamard=rht, stochastic=stochastic, rng=rng, stream=1, columnwise=True)
            dw = fo.nvfp4_gemm(g_t, x_t, w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.double().sum(0).to(b_dtype)  # float64: the same bits whatever order a compiler sums in
        return dx, dw, db, None, None
