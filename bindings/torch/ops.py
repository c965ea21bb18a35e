"""fp8core's primitives as torch custom ops (namespace ``fp8core``), CPU and CUDA, each with a fake so that
``torch.compile(fullgraph=True)`` traces through them: made from their declarations (fp8core.declarations) by
custom_ops.py. The numerics are the core's: each op calls fp8core.

Formats are passed as strings ("e4m3", "e5m2"); scales and amax slots are 1-element float32 tensors.
An argument on the meta device beside real ones is refused as the core refuses it; with every argument on meta
an op infers shapes only (custom_ops.py says why).
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8core.declarations import PRIMITIVES

from .custom_ops import custom_ops, follow_torch_threads

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose", "compute_scale",
           "gemm", "update", "follow_torch_threads"]

Tensor = torch.Tensor

(amax,) = custom_ops(PRIMITIVES["amax"])
(quantize_dynamic,) = custom_ops(PRIMITIVES["quantize_dynamic"])
(dequantize,) = custom_ops(PRIMITIVES["dequantize"])
(transpose,) = custom_ops(PRIMITIVES["transpose"])
(compute_scale,) = custom_ops(PRIMITIVES["compute_scale"])
(update,) = custom_ops(PRIMITIVES["update"])
_quantize, _quantize_amax = custom_ops(PRIMITIVES["quantize"])
_cast_transpose, _cast_transpose_amax = custom_ops(PRIMITIVES["cast_transpose"])
_gemm, _gemm_amax = custom_ops(PRIMITIVES["gemm"])


def quantize(x: Tensor, scale: Tensor, fmt: str, amax_out: Optional[Tensor] = None) -> Tensor:
    """SATFINITE_RTNE(fp32(x) * scale) in fmt; amax_out (float32 [1]) accumulates max |x| in place."""
    if amax_out is None:
        return _quantize(x, scale, fmt)
    return _quantize_amax(x, scale, fmt, amax_out)


def cast_transpose(x: Tensor, scale: Tensor, fmt: str, amax_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(quantize(x), its [last, prod(leading)] transpose) from one read of x."""
    if amax_out is None:
        return _cast_transpose(x, scale, fmt)
    return _cast_transpose_amax(x, scale, fmt, amax_out)


def gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
         bias: Optional[Tensor] = None, out_scale: Optional[Tensor] = None, out_amax: Optional[Tensor] = None,
         use_fast_accum: bool = False) -> Tensor:
    """[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias); see fp8core.gemm."""
    if out_amax is None:
        return _gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, out_scale, use_fast_accum)
    return _gemm_amax(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, out_scale, out_amax, use_fast_accum)
