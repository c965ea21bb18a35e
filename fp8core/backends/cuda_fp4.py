"""FP4 on CUDA: NVFP4 and MXFP4 over cuda/fp4_quantize.cu's kernel records, the same functions and signatures as
backends/cpu_fp4.py (the reference, bit for bit). One thin launch per pass inside cuda_call's device guard, on the
caller's stream read once per call, into the caller's allocator; no host synchronisation: NVFP4's global amax is
a device pass of its own (zeroed slot, one atomic per CTA) that the quantize launch reads on the device.

Arrays are CuPy arrays in storage dtype: uint8 for E2M1 data and for E4M3/E8M0 scales, float32 [1] for amaxes.
Importable without a GPU or CuPy: nothing here touches CUDA before a call.

The FP4 GEMM goes through cuBLASLt (backends/cublaslt.py) on the GPUs whose cuBLASLt has block-scaled FP4
(compute capability 10.x, 11.x, 12.x; refused by name elsewhere): the scales laid out in its 128x4 tiles and NVFP4's
alpha computed on the device (cuda/fp4_gemm.cu), both on the caller's stream, then one cublasLtMatmul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._kernels import FP4_DEQUANTIZE, MX_SCALE_SWIZZLE, MXFP4_QUANTIZE, NVFP4_GEMM_ALPHA, NVFP4_QUANTIZE
from .._views import Tensor, storage_dtype
from . import cublaslt
from .cpu_fp4 import MXFP4_BLOCK, NVFP4_BLOCK
from .cuda_blocks import mx_swizzled_size
from .cuda_call import Launch, capture_outlives, empty, ptr

try:
    from cupy_backends.cuda.api import runtime as _runtime
except ImportError:  # pragma: no cover - fp8core[cuda12|cuda13] brings it
    _runtime = None

_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _operand_shape(x: Tensor, columnwise: bool) -> tuple[int, int]:
    rows, cols = x.shape
    return (cols, rows) if columnwise else (rows, cols)


def _codes(shape: tuple[int, int], x: Tensor, kernel: Any) -> Any:
    """The operand's packed codes, uint8 ``shape``: always this launcher's own allocation (the quantizers take no
    caller memory for them), because ``kernel`` stores codes by 8- and 16-byte words only (DATA_ALIGNMENT in
    cuda/fp4_quantize.cu). An allocator that gave a less aligned address is refused before any launch."""
    data = empty(shape, np.uint8, x)
    align = kernel.constant("DATA_ALIGNMENT")
    if data.data.ptr % align:
        raise RuntimeError(f"data: {x.origin}'s allocator gave an address {data.data.ptr % align} bytes past a "
                           f"{align}-byte boundary; the FP4 quantizers store their codes by {align}-byte-aligned "
                           "words")
    return data


def quantize_nvfp4(x: Tensor, weight_2d: bool, hadamard: bool, stochastic: bool, seed: int, offset: int,
                   rng_state: Tensor | None, global_amax: Any | None, columnwise: bool) -> tuple[Any, Any, Any]:
    """x [M, K] -> (data uint8 [R, C/2], scale uint8 (E4M3) [R, C/16] or [ceil(R/16), C/16], global amax float32
    [1]) for the operand [R, C] (x, or x^T when columnwise); global_amax: the caller's fp32 G on x's device, or
    None (then G is taken on the device, after the transform). rng_state: None (seed and offset by value) or the
    caller's state on x's device, whose pointer the kernel reads (its seed, its offset + ``offset``): never read
    here."""
    rows, cols = x.shape
    r_op, c_op = _operand_shape(x, columnwise)
    with Launch(x) as (device, stream):
        data = _codes((r_op, c_op // 2), x, NVFP4_QUANTIZE)
        scale = empty((-(-r_op // NVFP4_BLOCK) if weight_2d else r_op, c_op // NVFP4_BLOCK), np.uint8, x)
        g = empty((1,), np.float32, x)
        args = {"x": x.data.data.ptr, "data": data.data.ptr, "scale": scale.data.ptr, "global_amax": g.data.ptr,
                "rows": rows, "cols": cols, "columnwise": int(columnwise), "hadamard": int(hadamard),
                "stochastic": int(stochastic), "seed": seed, "offset": offset}
        if global_amax is None:
            _runtime.memsetAsync(g.data.ptr, 0, 4, stream)  # the amax of an empty operand is 0
            if x.size:
                NVFP4_QUANTIZE.launch(device, (x.dtype,), r_op * (c_op // NVFP4_BLOCK), stream, **args,
                                      amax_out=g.data.ptr, tiles=0, rng_state=0)
        else:
            _runtime.memcpyAsync(g.data.ptr, global_amax.data.ptr, 4, _DEVICE_TO_DEVICE, stream)
        if x.size:
            items = (-(-r_op // NVFP4_BLOCK) * NVFP4_BLOCK if weight_2d else r_op) * (c_op // NVFP4_BLOCK)
            NVFP4_QUANTIZE.launch(device, (x.dtype,), items, stream, **args, amax_out=0, tiles=int(weight_2d),
                                  rng_state=rng_state.data.data.ptr if stochastic and rng_state is not None else 0)
        return data, scale, g


def quantize_mxfp4(x: Tensor, mode: str, columnwise: bool) -> tuple[Any, Any]:
    """x [M, K] -> (data uint8 [R, C/2], scale uint8 (E8M0) [R, C/32]) for the operand [R, C]; mode "rceil" or
    "floor"."""
    rows, cols = x.shape
    r_op, c_op = _operand_shape(x, columnwise)
    with Launch(x) as (device, stream):
        data = _codes((r_op, c_op // 2), x, MXFP4_QUANTIZE)
        scale = empty((r_op, c_op // MXFP4_BLOCK), np.uint8, x)
        if x.size:
            MXFP4_QUANTIZE.launch(device, (x.dtype, mode == "rceil"), r_op * (c_op // MXFP4_BLOCK), stream,
                                  x=x.data.data.ptr, data=data.data.ptr, scale=scale.data.ptr, rows=rows, cols=cols,
                                  columnwise=int(columnwise))
        return data, scale


def _dequantize(data: Tensor, scale: Tensor, global_amax: Any | None, out_dtype: str) -> Any:
    rows, cols = data.shape[0], 2 * data.shape[1]
    nvfp4 = global_amax is not None
    with Launch(data) as (device, stream):
        y = empty((rows, cols), storage_dtype(out_dtype), data)
        if y.size:
            FP4_DEQUANTIZE.launch(device, (out_dtype, nvfp4), data.size, stream, data=data.data.data.ptr,
                                  scale=scale.data.data.ptr, global_amax=ptr(global_amax), y=y.data.ptr, rows=rows,
                                  cols=cols, tile_rows=NVFP4_BLOCK if scale.shape[0] != rows else 1)
        return y


def dequantize_nvfp4(data: Tensor, scale: Tensor, global_amax: Any, out_dtype: str) -> Any:
    """y [R, C] (out_dtype's storage) = ROUND_TO(out_dtype, (fp32(q) * fp32(s_b)) *rn S_dec) from data [R, C/2],
    scale [R, C/16] or 16x16 tiles [ceil(R/16), C/16] and global_amax (float32 [1] on the device)."""
    return _dequantize(data, scale, global_amax, out_dtype)


def dequantize_mxfp4(data: Tensor, scale: Tensor, out_dtype: str) -> Any:
    """y [R, C] = ROUND_TO(out_dtype, fp32(q) *rn 2^(e - 127)) from data [R, C/2] and scale [R, C/32]."""
    return _dequantize(data, scale, None, out_dtype)


def gemm_scale(scale: Tensor, rows: int) -> Any:
    """An FP4 operand's scale bytes ([rows or 16-row tiles, K-blocks]) in cuBLASLt's 128x4 tiles, flat uint8 on
    the scale's device: 16x16 tiles expanded to their rows as they are laid out."""
    tiles, kgroups = scale.shape
    with Launch(scale) as (device, stream):
        out = empty((mx_swizzled_size(rows, kgroups),), np.uint8, scale)
        if out.size:
            MX_SCALE_SWIZZLE.launch(device, (), out.size, stream, s=scale.data.data.ptr, out=out.data.ptr, rows=rows,
                                    kgroups=kgroups, tile_rows=NVFP4_BLOCK if tiles != rows else 1)
        return out


def gemm_alpha(amax_a: Tensor, amax_b: Tensor) -> Any:
    """float32 [2] on the amaxes' device: (alpha, beta) = (S_dec_a *rn S_dec_b, 0) from the two global amaxes
    (float32, 1 element each), as cuBLASLt's device pointer mode reads them; computed there, no host sync."""
    with Launch(amax_a) as (device, stream):
        out = empty((2,), np.float32, amax_a)
        NVFP4_GEMM_ALPHA.launch(device, (), 1, stream, amax_a=amax_a.data.data.ptr, amax_b=amax_b.data.data.ptr,
                                alpha_beta=out.data.ptr)
        return out


def gemm(spec: Any, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
         global_amaxes: tuple[Tensor, Tensor] | None, bias: Tensor | None) -> Any:
    """D [M, N] (spec.out_dtype's storage) = alpha * a . b^T with block scales, through cuBLASLt: a [M, K/2] and
    b [N, K/2] E2M1 packed (TN, blocks along K), their scales as quantized ([rows or 16-row tiles, K/block]);
    global_amaxes: NVFP4's two (alpha computed on the device) or None (MXFP4). The device is checked before any
    launch; the scale layouts and alpha are temporaries of the caller's allocator, so a CuPy capture is refused."""
    cublaslt.check_fp4_device(a.device[1])
    with Launch(a) as (_, stream):
        if capture_outlives(a, stream):
            raise ValueError("a, b: an FP4 GEMM lays its block scales out for cuBLASLt (and computes NVFP4's alpha) "
                             "in device temporaries that a graph captured with CuPy would read after they are freed; "
                             "capture it with torch.cuda.graph on torch tensors, or make the call outside the "
                             "capture")
        alpha = gemm_alpha(*global_amaxes) if global_amaxes is not None else None
        a_tiles, b_tiles = gemm_scale(a_scale, spec.m), gemm_scale(b_scale, spec.n)
        return cublaslt.gemm(spec, a, b, a_tiles, b_tiles, bias, None, None, None, stream, alpha=alpha)
