"""Block scaling on CUDA: one thin launch per primitive over cuda/block_quantize.cu, on the caller's stream,
no host synchronisation. Arrays are CuPy arrays in storage dtype (uint8 for fp8 and E8M0, uint16 for bf16).

Also the scale layouts cuBLASLt reads (:func:`gemm_scales`): MXFP8's 128x4 swizzled tiles, 1x128 scales
outer-dimension-major, 128x128 scales with rows padded to 16 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._tensor import Tensor
from ..formats import Format
from .cpu_blocks import FP32_BLOCK, MX_BLOCK, inv_fp8_max
from .cuda import _OUT_STORAGE, _OUT_T, _T, _THREADS, _empty, _grid, _launch, _stream, cupy

_FILE = "block_quantize.cu"
_EMAX = {Format.E4M3: 8, Format.E5M2: 15}


def _tiles(rows: int, cols: int, tr: int, tc: int) -> tuple[int, int]:
    n = -(-rows // tr) * -(-cols // tc)
    return (min(n, 65535), -(-n // 65535))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- MXFP8 ------------------------------------------------------------------------------------------------

def _mx_launch(x: Tensor, fmt: Format, mode: str, rowwise: bool, columnwise: bool) -> tuple[Any, ...]:
    rows, cols = x.shape
    stream = _stream(x)
    q = _empty((rows, cols), np.uint8, x, stream) if rowwise else None
    s = _empty((rows, _cdiv(cols, MX_BLOCK)), np.uint8, x, stream) if rowwise else None
    qc = _empty((rows, cols), np.uint8, x, stream) if columnwise else None
    sc = _empty((_cdiv(rows, MX_BLOCK), cols), np.uint8, x, stream) if columnwise else None
    if x.size:
        ptr = lambda a: np.uint64(0) if a is None else a  # noqa: E731
        _launch(x, _FILE, f"fp8core::mx_quantize_kernel<{_T[x.dtype]}, {fmt.index}, "
                f"{'true' if mode == 'rceil' else 'false'}>", _tiles(rows, cols, 32, 64), _THREADS,
                (x.data, ptr(q), ptr(s), ptr(qc), ptr(sc), np.int64(rows), np.int64(cols), inv_fp8_max(fmt),
                 np.int32(_EMAX[fmt])), stream)
    return q, s, qc, sc


def quantize_mxfp8(x: Tensor, fmt: Format, scale_mode: str, columnwise: bool) -> tuple[Any, Any]:
    q, s, qc, sc = _mx_launch(x, fmt, scale_mode, not columnwise, columnwise)
    return (qc, sc) if columnwise else (q, s)


def quantize_mxfp8_both(x: Tensor, fmt: Format, scale_mode: str) -> tuple[Any, ...]:
    return _mx_launch(x, fmt, scale_mode, True, True)


def _dequantize(q: Tensor, scale: Tensor, fmt: Format, out_dtype: str, br: int, bc: int, sld: int,
                e8m0: bool) -> Any:
    rows, cols = q.shape
    stream = _stream(q)
    y = _empty((rows, cols), _OUT_STORAGE[out_dtype], q, stream)
    if q.size:
        _launch(q, _FILE, f"fp8core::block_dequantize_kernel<{fmt.index}, {_OUT_T[out_dtype]}, "
                f"{'true' if e8m0 else 'false'}>", _grid(q.device[1], q.size // 8 + 1), _THREADS,
                (q.data, scale.data, y, np.int64(rows), np.int64(cols), np.int32(br), np.int32(bc), np.int64(sld)),
                stream)
    return y


def dequantize_mxfp8(q: Tensor, scale: Tensor, fmt: Format, columnwise: bool, out_dtype: str) -> Any:
    rows, cols = q.shape
    if columnwise:
        return _dequantize(q, scale, fmt, out_dtype, MX_BLOCK, 1, cols, True)
    return _dequantize(q, scale, fmt, out_dtype, 1, MX_BLOCK, _cdiv(cols, MX_BLOCK), True)


# ---- fp32 block scales ------------------------------------------------------------------------------------

def quantize_blockwise(x: Tensor, fmt: Format, br: int, power_of_2: bool, epsilon: float) -> tuple[Any, Any]:
    rows, cols = x.shape
    stream = _stream(x)
    q = _empty((rows, cols), np.uint8, x, stream)
    s_inv = _empty((_cdiv(rows, br), _cdiv(cols, FP32_BLOCK)), np.float32, x, stream)
    if x.size:
        args = (x.data, q, s_inv, np.int64(rows), np.int64(cols), np.float32(fmt.max), np.int32(power_of_2),
                np.float32(epsilon))
        if br == 1:
            warps = rows * _cdiv(cols, FP32_BLOCK)
            _launch(x, _FILE, f"fp8core::quantize_1x128_kernel<{_T[x.dtype]}, {fmt.index}>",
                    _grid(x.device[1], warps * 32), _THREADS, args, stream)
        else:
            _launch(x, _FILE, f"fp8core::quantize_128x128_kernel<{_T[x.dtype]}, {fmt.index}>",
                    _tiles(rows, cols, FP32_BLOCK, FP32_BLOCK), _THREADS, args, stream)
    return q, s_inv


def dequantize_blockwise(q: Tensor, scale_inv: Tensor, fmt: Format, br: int, out_dtype: str) -> Any:
    return _dequantize(q, scale_inv, fmt, out_dtype, br, FP32_BLOCK, _cdiv(q.shape[1], FP32_BLOCK), False)


def transpose_scale(scale: Tensor) -> Any:
    """A block-scale array [a, b] as a contiguous [b, a] on the caller's stream, values unchanged."""
    stream = _stream(scale)
    rows, cols = scale.shape
    out = _empty((cols, rows), scale.data.dtype, scale, stream)
    with cupy.cuda.Device(scale.device[1]), stream:
        out[...] = scale.data.T
    return out


# ---- the scale layouts cuBLASLt reads ---------------------------------------------------------------------

def mx_swizzled_size(rows: int, kgroups: int) -> int:
    return _cdiv(rows, 128) * 128 * _cdiv(kgroups, 4) * 4


def gemm_scale(scale: Any, kind: str, like: Tensor, stream: Any) -> Any:
    """One operand's block scales [rows or row-tiles, K-blocks] in the layout cuBLASLt reads, on ``stream``.

    "1x32": 128 x 4 swizzled tiles (cuBLAS's "1D block scaling factors layout"), zero padding.
    "1x128": outer-dimension-major, ``[KB][rows]`` contiguous.
    "128x128": row-major ``[row-tiles][KB]`` with each row padded to a multiple of 4 floats (16 bytes).
    """
    rows, kgroups = scale.shape
    if kind == "1x32":
        out = _empty((mx_swizzled_size(rows, kgroups),), np.uint8, like, stream)
        _launch(like, _FILE, "fp8core::mx_scale_swizzle_kernel", _grid(like.device[1], out.size), _THREADS,
                (scale.view(np.uint8), out, np.int64(rows), np.int64(kgroups)), stream)
        return out
    with cupy.cuda.Device(like.device[1]), stream:
        if kind == "1x128":
            return cupy.ascontiguousarray(scale.T)
        padded = cupy.zeros((rows, _cdiv(kgroups, 4) * 4), np.float32)
        padded[:, :kgroups] = scale
        return padded
