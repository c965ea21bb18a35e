"""Block scaling as torch custom ops (``torch.ops.fp8core.*``), CPU and CUDA, each with a fake so that
``torch.compile(fullgraph=True)`` traces through them. The numerics are the core's (fp8core.blocks).

The ops return plain (data, scale) tensor tuples; the wrappers below give the core's scaled tensors,
``MXTensor(data, scale)`` (scale float8_e8m0fnu) and ``BlockScaledTensor(data, scale_inv)`` (float32), with
their layouts, and ``RowwiseTensor(data, scale_inv)`` (one fp32 scale per row or column, fp8core.rowwise).
Formats are strings ("e4m3", "e5m2"), layouts their names ("1x32", "32x1", "1x128", "128x128", "rowwise",
"columnwise").
"""

from __future__ import annotations

import torch

import fp8core
from fp8core import args
from fp8core import blocks as core
from fp8core import rowwise
from fp8core.layouts import BlockScaledTensor, Layout, MXTensor, RowwiseTensor, ScaledTensor, layout_of

from .fake_rules import gemm_shape, matrix, refuse_meta
from .ops import follow_torch_threads

Tensor = torch.Tensor
_LIB = "fp8core"

__all__ = ["quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8", "quantize_blockwise",
           "dequantize_blockwise", "quantize_rowwise", "transpose_blocks", "block_gemm"]


def _scale(x: Tensor, layout: Layout) -> Tensor:
    dtype = torch.float8_e8m0fnu if layout.kind == "mx" else torch.float32
    return x.new_empty(layout.scale_shape(*matrix(x, "x")), dtype=dtype)


def _fp8(x: Tensor, fmt: str) -> Tensor:
    return torch.empty_like(x, dtype=fp8core.as_format(fmt).torch_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_mxfp8", mutates_args=())
@follow_torch_threads
def _quantize_mxfp8(x: Tensor, fmt: str, scale_mode: str, columnwise: bool) -> tuple[Tensor, Tensor]:
    return tuple(core.quantize_mxfp8(x, fmt, scale_mode=scale_mode, columnwise=columnwise))


@_quantize_mxfp8.register_fake
def _(x, fmt, scale_mode, columnwise):
    return _fp8(x, fmt), _scale(x, Layout.MX_COLUMNWISE if columnwise else Layout.MX_ROWWISE)


@torch.library.custom_op(f"{_LIB}::quantize_mxfp8_both", mutates_args=())
@follow_torch_threads
def _quantize_mxfp8_both(x: Tensor, fmt: str, scale_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    row, col = core.quantize_mxfp8_both(x, fmt, scale_mode=scale_mode)
    return (*row, *col)


@_quantize_mxfp8_both.register_fake
def _(x, fmt, scale_mode):
    return _fp8(x, fmt), _scale(x, Layout.MX_ROWWISE), _fp8(x, fmt), _scale(x, Layout.MX_COLUMNWISE)


@torch.library.custom_op(f"{_LIB}::dequantize_mxfp8", mutates_args=())
@follow_torch_threads
def _dequantize_mxfp8(data: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return core.dequantize_mxfp8(MXTensor(data, scale), out_dtype)


@_dequantize_mxfp8.register_fake
def _(data, scale, out_dtype):
    refuse_meta(("t.data", data), ("t.scale", scale))
    matrix(data, "t.data")
    layout_of(MXTensor(data, scale))
    return torch.empty_like(data, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_blockwise", mutates_args=())
@follow_torch_threads
def _quantize_blockwise(x: Tensor, fmt: str, block: str, power_of_2: bool, epsilon: float) -> tuple[Tensor, Tensor]:
    return tuple(core.quantize_blockwise(x, fmt, block=block, power_of_2=power_of_2, epsilon=epsilon))


@_quantize_blockwise.register_fake
def _(x, fmt, block, power_of_2, epsilon):
    return _fp8(x, fmt), _scale(x, args.block(block))


@torch.library.custom_op(f"{_LIB}::dequantize_blockwise", mutates_args=())
@follow_torch_threads
def _dequantize_blockwise(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return core.dequantize_blockwise(BlockScaledTensor(data, scale_inv), out_dtype)


@_dequantize_blockwise.register_fake
def _(data, scale_inv, out_dtype):
    refuse_meta(("t.data", data), ("t.scale_inv", scale_inv))
    matrix(data, "t.data")
    layout_of(BlockScaledTensor(data, scale_inv))
    return torch.empty_like(data, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_rowwise", mutates_args=())
@follow_torch_threads
def _quantize_rowwise(x: Tensor, fmt: str, axis: int, power_of_2: bool, epsilon: float) -> tuple[Tensor, Tensor]:
    return tuple(rowwise.quantize_rowwise(x, fmt, axis=axis, power_of_2=power_of_2, epsilon=epsilon))


@_quantize_rowwise.register_fake
def _(x, fmt, axis, power_of_2, epsilon):
    return _fp8(x, fmt), _scale(x, rowwise.axis_layout(axis))


@torch.library.custom_op(f"{_LIB}::transpose_blocks", mutates_args=())
@follow_torch_threads
def _transpose_blocks(data: Tensor, scale: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    out = core.transpose_blocks(ScaledTensor(data, scale, layout))
    # the transpose of a single row or column is the input itself; an op's outputs may not alias its inputs
    inputs = {data.untyped_storage().data_ptr(), scale.untyped_storage().data_ptr()}
    return tuple(t.clone() if t.untyped_storage().data_ptr() in inputs else t for t in out)


@_transpose_blocks.register_fake
def _(data, scale, layout):
    refuse_meta(("t.data", data), ("t.scale", scale))
    rows, cols = matrix(data, "t.data")
    core.transposed_layout(layout_of(ScaledTensor(data, scale, layout)), rows)
    return data.new_empty((cols, rows)), scale.new_empty((scale.shape[1], scale.shape[0]))


@torch.library.custom_op(f"{_LIB}::block_gemm", mutates_args=())
@follow_torch_threads
def _block_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, a_layout: str, b_layout: str,
                out_dtype: torch.dtype) -> Tensor:
    return fp8core.gemm(ScaledTensor(a, a_scale, a_layout), ScaledTensor(b, b_scale, b_layout), out_dtype=out_dtype)


@_block_gemm.register_fake
def _(a, a_scale, b, b_scale, a_layout, b_layout, out_dtype):
    """The core's shape rules (fp8core.gemm, then fp8core.blocks.gemm_scales), in its order."""
    sa, sb = ScaledTensor(a, a_scale, a_layout), ScaledTensor(b, b_scale, b_layout)
    core.gemm_operands(sa, sb, None, None)
    refuse_meta(("a", a), ("a.scale", a_scale), ("b", b), ("b.scale", b_scale))
    m, n = gemm_shape(a, b)
    core.gemm_layouts(layout_of(sa, "a"), layout_of(sb, "b"), m, n, a.shape[1])
    return a.new_empty((m, n), dtype=out_dtype)


# ---- the typed front doors --------------------------------------------------------------------------------

def quantize_mxfp8(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil", columnwise: bool = False) -> MXTensor:
    """MXTensor(data in x's shape, E8M0 scale [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    layout = Layout.MX_COLUMNWISE if columnwise else Layout.MX_ROWWISE
    return MXTensor(*torch.ops.fp8core.quantize_mxfp8(x, fmt, scale_mode, columnwise), layout)


def quantize_mxfp8_both(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """(rowwise, columnwise) from one read of x."""
    q, s, qc, sc = torch.ops.fp8core.quantize_mxfp8_both(x, fmt, scale_mode)
    return MXTensor(q, s, Layout.MX_ROWWISE), MXTensor(qc, sc, Layout.MX_COLUMNWISE)


def dequantize_mxfp8(t: MXTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.ops.fp8core.dequantize_mxfp8(t[0], t[1], out_dtype)


def quantize_blockwise(x: Tensor, fmt: str = "e4m3", block: str = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """BlockScaledTensor(data in x's shape, float32 scale_inv [rows or ceil(rows/128), ceil(cols/128)])."""
    layout = args.block(block)
    return BlockScaledTensor(*torch.ops.fp8core.quantize_blockwise(x, fmt, layout.value, power_of_2, epsilon), layout)


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.ops.fp8core.dequantize_blockwise(t[0], t[1], out_dtype)


def quantize_rowwise(x: Tensor, fmt: str = "e4m3", axis: int = -1, power_of_2: bool = True,
                     epsilon: float = 0.0) -> RowwiseTensor:
    """RowwiseTensor(data in x's shape, float32 scale_inv [rows, 1], or [1, cols] for axis=0)."""
    layout = rowwise.axis_layout(axis)
    return RowwiseTensor(*torch.ops.fp8core.quantize_rowwise(x, fmt, axis, power_of_2, epsilon), layout)


def transpose_blocks(t: ScaledTensor) -> ScaledTensor:
    """The block-scaled transpose (fp8core.blocks.transpose_blocks), as an op."""
    if not isinstance(t, ScaledTensor):
        core.transpose_blocks(t)  # raises the core's error
    layout = layout_of(t)
    return type(t)(*torch.ops.fp8core.transpose_blocks(t[0], t[1], layout.value),
                   core.transposed_layout(layout, matrix(t[0], "t.data")[0]))


def block_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8core.gemm`` with scaled operands of one kind (both MX or both fp32 blocks), as an op."""
    core.gemm_operands(a, b, None, None)  # the core's type rules
    return torch.ops.fp8core.block_gemm(a[0], a[1], b[0], b[1], layout_of(a, "a").value, layout_of(b, "b").value,
                                        out_dtype)
