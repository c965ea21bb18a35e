"""Rowwise (axiswise) FP8 scaling, torchao's ``rowwise`` recipes: one fp32 scale per row or per column.

A row's (column's) scale is the per-tensor scale rule applied to that row's (column's) own amax, so it is fp32
block scaling with the block a whole row or column: the CPU reference and the CUDA kernel share
:mod:`fp8core.blocks`' validation and backends, and give the same bits. The numerics are docs/numerics.md's
"Rowwise (axiswise) scaling". :func:`fp8core.gemm` takes two rowwise operands (``a [M, K]`` per row, ``b [N, K]``
per output channel) and scales D by the outer product of their scale inverses.
"""

from __future__ import annotations

from typing import Any

from . import args, backends
from .args import axis_layout
from .blocks import dequantize_kind, quantized
from .declarations import PRIMITIVES
from .formats import Format
from .layouts import RowwiseTensor

__all__ = ["RowwiseTensor", "quantize_rowwise", "dequantize_rowwise", "axis_layout"]

Array = Any
_ROWWISE = PRIMITIVES["quantize_rowwise"].results


def quantize_rowwise(x: Array, fmt: Format | str = Format.E4M3, *, axis: int = -1, power_of_2: bool = True,
                     epsilon: float = 0.0) -> RowwiseTensor:
    """Quantization with one fp32 scale per row (``axis=-1``) or per column (``axis=0``) of x viewed as
    [rows, cols], each from its own amax by the per-tensor scale rule (``power_of_2`` — torchao's default for its
    rowwise recipes —, ``epsilon``; 1.0 where the amax is 0, inf or NaN).

    x: float32/bfloat16/float16, any shape (leading dimensions folded into rows). Returns
    ``RowwiseTensor(data, scale_inv)``: data fp8 in x's shape, scale_inv float32 [rows, 1] (layout "rowwise") or
    [1, cols] ("columnwise"), as the caller's array type. For a GEMM operand ``a [M, K]`` the rowwise scales run
    along K; the columnwise ones become rowwise scales of x.T through :func:`fp8core.transpose_blocks`.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    layout = axis_layout(axis)
    pow2 = args.flag(power_of_2, "power_of_2")
    eps = args.epsilon(epsilon)
    backend = backends.blocks_for_device(t.device)
    specs = _ROWWISE((t.data.shape, t.dtype), f, axis, pow2, eps)
    return RowwiseTensor(*quantized(backend, t, specs, backend.quantize_blockwise, f, layout, pow2, eps), layout, f)


def dequantize_rowwise(t: RowwiseTensor, out_dtype: Any = "float32", *, fmt: Format | str | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) *rn scale_inv[its row or column])``; NaN canonical.

    t: a :class:`RowwiseTensor` (rowwise or columnwise: its layout, else told apart by the scale_inv's shape).
    out_dtype: float32, bfloat16 or float16. fmt names the format of uint8 data (CuPy).
    """
    return dequantize_kind(t, "axiswise", out_dtype, fmt)
