"""Block scaling as torch custom ops (``torch.ops.fp8core.*``), CPU and CUDA, each with a fake so that
``torch.compile(fullgraph=True)`` traces through them. The numerics are the core's (fp8core.blocks).

The ops return plain (data, scale) tensor tuples; the wrappers below give the core's typed pairs,
``MXTensor(data, scale)`` (scale float8_e8m0fnu) and ``BlockScaledTensor(data, scale_inv)`` (float32).
Formats are strings ("e4m3", "e5m2"), blocks "1x128" / "128x128".
"""

from __future__ import annotations

import torch

import fp8core
from fp8core import blocks as core
from fp8core.args import block_rows
from fp8core.blocks import BlockScaledTensor, MXTensor, block_layout, mx_layout

from .fake_rules import gemm_shape, matrix, refuse_meta
from .ops import follow_torch_threads

Tensor = torch.Tensor
_LIB = "fp8core"

__all__ = ["quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8", "quantize_blockwise",
           "dequantize_blockwise", "transpose_blocks", "block_gemm"]


def _mx_scale(x: Tensor, columnwise: bool) -> Tensor:
    rows, cols = matrix(x, "x")
    return x.new_empty(core.mx_scale_shape(rows, cols, columnwise), dtype=torch.float8_e8m0fnu)


def _fp8(x: Tensor, fmt: str) -> Tensor:
    return torch.empty_like(x, dtype=fp8core.as_format(fmt).torch_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_mxfp8", mutates_args=())
@follow_torch_threads
def _quantize_mxfp8(x: Tensor, fmt: str, scale_mode: str, columnwise: bool) -> tuple[Tensor, Tensor]:
    return tuple(core.quantize_mxfp8(x, fmt, scale_mode=scale_mode, columnwise=columnwise))


@_quantize_mxfp8.register_fake
def _(x, fmt, scale_mode, columnwise):
    return _fp8(x, fmt), _mx_scale(x, columnwise)


@torch.library.custom_op(f"{_LIB}::quantize_mxfp8_both", mutates_args=())
@follow_torch_threads
def _quantize_mxfp8_both(x: Tensor, fmt: str, scale_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    row, col = core.quantize_mxfp8_both(x, fmt, scale_mode=scale_mode)
    return (*row, *col)


@_quantize_mxfp8_both.register_fake
def _(x, fmt, scale_mode):
    return _fp8(x, fmt), _mx_scale(x, False), _fp8(x, fmt), _mx_scale(x, True)


@torch.library.custom_op(f"{_LIB}::dequantize_mxfp8", mutates_args=())
@follow_torch_threads
def _dequantize_mxfp8(data: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return core.dequantize_mxfp8(MXTensor(data, scale), out_dtype)


@_dequantize_mxfp8.register_fake
def _(data, scale, out_dtype):
    refuse_meta(("t.data", data), ("t.scale", scale))
    mx_layout(matrix(data, "t.data"), scale.shape, "t.scale")
    return torch.empty_like(data, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_blockwise", mutates_args=())
@follow_torch_threads
def _quantize_blockwise(x: Tensor, fmt: str, block: str, power_of_2: bool, epsilon: float) -> tuple[Tensor, Tensor]:
    return tuple(core.quantize_blockwise(x, fmt, block=block, power_of_2=power_of_2, epsilon=epsilon))


@_quantize_blockwise.register_fake
def _(x, fmt, block, power_of_2, epsilon):
    br = block_rows(block)
    rows, cols = matrix(x, "x")
    return _fp8(x, fmt), x.new_empty(core.block_scale_shape(rows, cols, br), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::dequantize_blockwise", mutates_args=())
@follow_torch_threads
def _dequantize_blockwise(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return core.dequantize_blockwise(BlockScaledTensor(data, scale_inv), out_dtype)


@_dequantize_blockwise.register_fake
def _(data, scale_inv, out_dtype):
    refuse_meta(("t.data", data), ("t.scale_inv", scale_inv))
    block_layout(matrix(data, "t.data"), scale_inv.shape, "t.scale_inv")
    return torch.empty_like(data, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::transpose_blocks", mutates_args=())
@follow_torch_threads
def _transpose_blocks(data: Tensor, scale: Tensor, mx: bool) -> tuple[Tensor, Tensor]:
    out = core.transpose_blocks((MXTensor if mx else BlockScaledTensor)(data, scale))
    # the transpose of a single row or column is the input itself; an op's outputs may not alias its inputs
    inputs = {data.untyped_storage().data_ptr(), scale.untyped_storage().data_ptr()}
    return tuple(t.clone() if t.untyped_storage().data_ptr() in inputs else t for t in out)


@_transpose_blocks.register_fake
def _(data, scale, mx):
    refuse_meta(("t.data", data), ("t.scale", scale))
    rows, cols = matrix(data, "t.data")
    return data.new_empty((cols, rows)), scale.new_empty((scale.shape[1], scale.shape[0]))


@torch.library.custom_op(f"{_LIB}::block_gemm", mutates_args=())
@follow_torch_threads
def _block_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, mx: bool,
                out_dtype: torch.dtype) -> Tensor:
    kind = MXTensor if mx else BlockScaledTensor
    return fp8core.gemm(kind(a, a_scale), kind(b, b_scale), out_dtype=out_dtype)


@_block_gemm.register_fake
def _(a, a_scale, b, b_scale, mx, out_dtype):
    """The core's shape rules (fp8core.gemm, then fp8core.blocks.gemm_scales), in its order."""
    refuse_meta(("a", a), ("a.scale", a_scale), ("b", b), ("b.scale", b_scale))
    m, n = gemm_shape(a, b)
    core.gemm_blocks(mx, m, n, a.shape[1], tuple(a_scale.shape), tuple(b_scale.shape))
    return a.new_empty((m, n), dtype=out_dtype)


# ---- the typed front doors --------------------------------------------------------------------------------

def quantize_mxfp8(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil", columnwise: bool = False) -> MXTensor:
    """MXTensor(data in x's shape, E8M0 scale [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    return MXTensor(*torch.ops.fp8core.quantize_mxfp8(x, fmt, scale_mode, columnwise))


def quantize_mxfp8_both(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """(rowwise, columnwise) from one read of x."""
    q, s, qc, sc = torch.ops.fp8core.quantize_mxfp8_both(x, fmt, scale_mode)
    return MXTensor(q, s), MXTensor(qc, sc)


def dequantize_mxfp8(t: MXTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.ops.fp8core.dequantize_mxfp8(t[0], t[1], out_dtype)


def quantize_blockwise(x: Tensor, fmt: str = "e4m3", block: str = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """BlockScaledTensor(data in x's shape, float32 scale_inv [rows or ceil(rows/128), ceil(cols/128)])."""
    return BlockScaledTensor(*torch.ops.fp8core.quantize_blockwise(x, fmt, block, power_of_2, epsilon))


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.ops.fp8core.dequantize_blockwise(t[0], t[1], out_dtype)


def transpose_blocks(t: MXTensor | BlockScaledTensor) -> MXTensor | BlockScaledTensor:
    """The block-scaled transpose (fp8core.blocks.transpose_blocks), as an op."""
    return type(t)(*torch.ops.fp8core.transpose_blocks(t[0], t[1], isinstance(t, MXTensor)))


def block_gemm(a: MXTensor | BlockScaledTensor, b: MXTensor | BlockScaledTensor,
               out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8core.gemm`` with block-scaled operands (both MXTensor or both BlockScaledTensor), as an op."""
    if type(a) is not type(b) or not isinstance(a, (MXTensor, BlockScaledTensor)):
        fp8core.blocks.gemm_operands(a, b, None, None)  # raises the core's error
    return torch.ops.fp8core.block_gemm(a[0], a[1], b[0], b[1], isinstance(a, MXTensor), out_dtype)
