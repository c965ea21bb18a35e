"""Block scaling on CUDA: one thin launch per primitive over cuda/block_quantize.cu's kernel records, inside
cuda_call's device guard, on the caller's stream read once per call, into the caller's allocator; no host
synchronisation. Arrays are CuPy arrays in storage dtype (uint8 for fp8 and E8M0, uint16
for bf16). Importable without a GPU or CuPy: nothing here touches CUDA before a call.

Also the scale layouts cuBLASLt reads (:func:`gemm_scale`): MXFP8's 128x4 swizzled tiles, 1x128 scales
outer-dimension-major, 128x128 scales with rows padded to 16 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._kernels import (BLOCK_DEQUANTIZE, MX_QUANTIZE, MX_SCALE_SWIZZLE, QUANTIZE_1X128, QUANTIZE_128X128,
                        QUANTIZE_AXISWISE)
from .._views import Tensor, storage_dtype
from ..formats import E8M0, Encoding
from ..layouts import Layout
from .cpu_blocks import cdiv, inv_fp8_max
from .cuda_call import allocate  # noqa: F401 - the core allocates the quantizers' results through it
from .cuda_call import Launch, On, capture_outlives, cupy, empty, ptr, stream_of


# ---- MXFP8 ------------------------------------------------------------------------------------------------

def _mx_launch(x: Tensor, fmt: Encoding, mode: str, q: Any, s: Any, qc: Any, sc: Any) -> tuple[Any, ...]:
    """Writes the rowwise (q, s) and/or the columnwise (qc, sc) outputs given (None: not made)."""
    rows, cols = x.shape
    with Launch(x) as (device, stream):
        if x.size:
            MX_QUANTIZE.launch(device, (x.dtype, fmt.index, mode == "rceil"), (rows, cols), stream,
                               x=x.data.data.ptr, q=ptr(q), s=ptr(s), qc=ptr(qc), sc=ptr(sc), rows=rows, cols=cols,
                               inv_max=float(inv_fp8_max(fmt)), emax=fmt.emax)
        return q, s, qc, sc


def quantize_mxfp8(x: Tensor, fmt: Encoding, scale_mode: str, layout: Layout, out: tuple[Any, Any]
                   ) -> tuple[Any, Any]:
    if layout == Layout.MX_COLUMNWISE:
        _mx_launch(x, fmt, scale_mode, None, None, *out)
    else:
        _mx_launch(x, fmt, scale_mode, *out, None, None)
    return out


def quantize_mxfp8_both(x: Tensor, fmt: Encoding, scale_mode: str, out: tuple[Any, ...]) -> tuple[Any, ...]:
    return _mx_launch(x, fmt, scale_mode, *out)


def dequantize_blocks(q: Tensor, scale: Tensor, fmt: Encoding, layout: Layout, out_dtype: str) -> Any:
    rows, cols = q.shape
    br, bc = layout.block_for(rows, cols)
    with Launch(q) as (device, stream):
        y = empty((rows, cols), storage_dtype(out_dtype), q)
        if q.size:
            BLOCK_DEQUANTIZE.launch(device, (fmt.index, out_dtype, layout.scale is E8M0), q.size, stream,
                                    q=q.data.data.ptr, scale=scale.data.data.ptr, y=y.data.ptr, rows=rows, cols=cols,
                                    br=br, bc=bc, sld=cdiv(cols, bc))
        return y


# ---- fp32 block scales ------------------------------------------------------------------------------------

def quantize_blockwise(x: Tensor, fmt: Encoding, layout: Layout, power_of_2: bool, epsilon: float,
                       out: tuple[Any, Any]) -> tuple[Any, Any]:
    rows, cols = x.shape
    q, s_inv = out
    with Launch(x) as (device, stream):
        if not x.size and s_inv.size:  # rows (columns) of no elements: amax 0, scale 1
            with cupy.cuda.ExternalStream(stream, device):
                s_inv.fill(1.0)
        if x.size:
            args = {"x": x.data.data.ptr, "q": q.data.ptr, "scale_inv": s_inv.data.ptr, "rows": rows, "cols": cols,
                    "fp8_max": float(fmt.max), "power_of_2": int(power_of_2), "epsilon": float(epsilon)}
            if layout.kind == "axiswise":  # a warp per row, or a thread per column, grid-stride
                columnwise = layout == Layout.COLUMNWISE
                QUANTIZE_AXISWISE.launch(device, (x.dtype, fmt.index), cols if columnwise else rows * 32, stream,
                                         **args, columnwise=int(columnwise))
            elif layout == Layout.BLOCK_1X128:  # one warp per 1x128 block, grid-stride over the blocks
                QUANTIZE_1X128.launch(device, (x.dtype, fmt.index), s_inv.size * 32, stream, **args)
            else:
                QUANTIZE_128X128.launch(device, (x.dtype, fmt.index), (rows, cols), stream, **args)
        return q, s_inv


def transpose_scale(scale: Tensor) -> Any:
    """A block-scale array [a, b] as a contiguous [b, a] on the caller's stream, values unchanged."""
    rows, cols = scale.shape
    with Launch(scale) as (device, stream):
        out = empty((cols, rows), scale.data.dtype, scale)
        if out.size:
            with cupy.cuda.ExternalStream(stream, device):
                out[...] = scale.data.T
        return out


# ---- the scale layouts cuBLASLt reads ---------------------------------------------------------------------

def mx_swizzled_size(rows: int, kgroups: int) -> int:
    """Bytes of the swizzled E8M0 scales of a [rows, kgroups] array: whole 128 x 4 tiles."""
    return cdiv(rows, 128) * 128 * cdiv(kgroups, 4) * 4


def gemm_scale(scale: Tensor, layout: Layout) -> Any:
    """One GEMM operand's block scales ``[rows or row-tiles, K-blocks]`` in the layout cuBLASLt reads (see
    :func:`layout_for_cublaslt`), on the scale's device and the caller's stream: uint8 for "1x32", else float32."""
    with On(scale.device[1]):
        return layout_for_cublaslt(scale.data, layout, scale, stream_of(scale), temporary=False)


def layout_for_cublaslt(scale: Any, layout: Layout, like: Tensor, stream: int, *, temporary: bool = True) -> Any:
    """:func:`gemm_scale` inside the caller's device guard, on the raw stream handle ``stream``.

    "1x32": 128 x 4 swizzled tiles (cuBLAS's "1D block scaling factors layout"), zero padding; flat uint8.
    "1x128": outer-dimension-major, ``[KB, rows]`` contiguous.
    "128x128": row-major ``[row-tiles, KB]`` with each row padded with zeros to a multiple of 4 floats (16 bytes).
    temporary: the result is the GEMM's own (dropped after the call), not the caller's.
    """
    rows, kgroups = scale.shape
    device = like.device[1]
    if temporary and capture_outlives(like, stream):
        # The captured GEMM would read the layouts after they are freed, and nothing the caller holds could own
        # them (the output may be the caller's out=, and its memory is not ours to extend): refuse.
        raise ValueError("a, b: a block-scaled GEMM lays its block scales out for cuBLASLt in device temporaries "
                         "that a graph captured with CuPy would read after they are freed; capture it with "
                         "torch.cuda.graph on torch tensors, or make the call outside the capture")
    if layout == Layout.MX_ROWWISE:
        out = empty((mx_swizzled_size(rows, kgroups),), np.uint8, like)
        if out.size:
            MX_SCALE_SWIZZLE.launch(device, (), out.size, stream, s=scale.data.ptr, out=out.data.ptr, rows=rows,
                                    kgroups=kgroups, tile_rows=1)
        return out
    tiles = layout == Layout.BLOCK_128X128
    shape = (rows, cdiv(kgroups, 4) * 4) if tiles else (kgroups, rows)
    out = empty(shape, np.float32, like)
    if out.size:
        with cupy.cuda.ExternalStream(stream, device):
            if tiles:
                out.fill(0)
                out[:, :kgroups] = scale
            else:
                out[...] = scale.T
    return out
