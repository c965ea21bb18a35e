"""Block scaling as torch custom ops (``torch.ops.fp8core.*``), CPU and CUDA, each with a fake so that
``torch.compile(fullgraph=True)`` traces through them, made from their declarations (fp8core.declarations). The
numerics are the core's (fp8core.blocks).

The ops return plain (data, scale) tensor tuples; the wrappers below give the core's scaled tensors,
``MXTensor(data, scale)`` (scale float8_e8m0fnu) and ``BlockScaledTensor(data, scale_inv)`` (float32), with
their layouts, and ``RowwiseTensor(data, scale_inv)`` (one fp32 scale per row or column, fp8core.rowwise).
Formats are strings ("e4m3", "e5m2"), layouts their names ("1x32", "32x1", "1x128", "128x128", "rowwise",
"columnwise").
"""

from __future__ import annotations

import torch

from fp8core import args
from fp8core import blocks as core
from fp8core import rowwise
from fp8core.declarations import PRIMITIVES
from fp8core.layouts import BlockScaledTensor, Layout, MXTensor, RowwiseTensor, ScaledTensor, layout_of

from .custom_ops import custom_ops
from .fake_rules import matrix

Tensor = torch.Tensor

__all__ = ["quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8", "quantize_blockwise",
           "dequantize_blockwise", "quantize_rowwise", "transpose_blocks", "block_gemm"]


_ops = {name: custom_ops(PRIMITIVES[name])[0] for name in
        ("quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8", "quantize_blockwise", "dequantize_blockwise",
         "quantize_rowwise", "transpose_blocks", "block_gemm")}


# ---- the typed front doors --------------------------------------------------------------------------------

def quantize_mxfp8(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil", columnwise: bool = False) -> MXTensor:
    """MXTensor(data in x's shape, E8M0 scale [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    layout = Layout.MX_COLUMNWISE if columnwise else Layout.MX_ROWWISE
    return MXTensor(*_ops["quantize_mxfp8"](x, fmt, scale_mode, columnwise), layout)


def quantize_mxfp8_both(x: Tensor, fmt: str = "e4m3", scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """(rowwise, columnwise) from one read of x."""
    q, s, qc, sc = _ops["quantize_mxfp8_both"](x, fmt, scale_mode)
    return MXTensor(q, s, Layout.MX_ROWWISE), MXTensor(qc, sc, Layout.MX_COLUMNWISE)


def dequantize_mxfp8(t: MXTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return _ops["dequantize_mxfp8"](t[0], t[1], out_dtype)


def quantize_blockwise(x: Tensor, fmt: str = "e4m3", block: str = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """BlockScaledTensor(data in x's shape, float32 scale_inv [rows or ceil(rows/128), ceil(cols/128)])."""
    layout = args.block(block)
    return BlockScaledTensor(*_ops["quantize_blockwise"](x, fmt, layout.value, power_of_2, epsilon), layout)


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    return _ops["dequantize_blockwise"](t[0], t[1], out_dtype)


def quantize_rowwise(x: Tensor, fmt: str = "e4m3", axis: int = -1, power_of_2: bool = True,
                     epsilon: float = 0.0) -> RowwiseTensor:
    """RowwiseTensor(data in x's shape, float32 scale_inv [rows, 1], or [1, cols] for axis=0)."""
    layout = rowwise.axis_layout(axis)
    return RowwiseTensor(*_ops["quantize_rowwise"](x, fmt, axis, power_of_2, epsilon), layout)


def transpose_blocks(t: ScaledTensor) -> ScaledTensor:
    """The block-scaled transpose (fp8core.blocks.transpose_blocks), as an op."""
    if not isinstance(t, ScaledTensor):
        core.transpose_blocks(t)  # raises the core's error
    layout = layout_of(t)
    return type(t)(*_ops["transpose_blocks"](t[0], t[1], layout.value),
                   core.transposed_layout(layout, matrix(t[0], "t.data")[0]))


def block_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8core.gemm`` with scaled operands of one kind (both MX or both fp32 blocks), as an op."""
    core.gemm_operands(a, b, None, None)  # the core's type rules
    return _ops["block_gemm"](a[0], a[1], b[0], b[1], layout_of(a, "a").value, layout_of(b, "b").value,
                                        out_dtype)
