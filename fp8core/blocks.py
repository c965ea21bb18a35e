"""Block-scaled FP8: MXFP8 (1x32 blocks, E8M0 scales) and DeepSeek-V3's 1x128 / 128x128 blocks (fp32 scales).

Every primitive works on the 2-D view ``[rows, cols]`` of its input (leading dimensions folded into rows, as
``cast_transpose`` does), validates like :mod:`fp8core.ops`, picks the backend by device and returns the
caller's array type. The numerics are docs/numerics.md's "Block scaling"; both backends give the same bits.

A block-scaled result is a :class:`fp8core.layouts.ScaledTensor` that names its layout: an :class:`MXTensor`
``(data, scale)`` with E8M0 scale bytes (``float8_e8m0fnu`` for NumPy, torch and JAX; uint8 storage for CuPy),
or a :class:`BlockScaledTensor` ``(data, scale_inv)`` with fp32 scale inverses. Every function here and
:func:`fp8core.gemm` go by the layout (one built from the pair alone has the one its scale's shape means);
:func:`dequantize_blocks` and the GEMM take FP4's ScaledTensors (:mod:`fp8core.fp4`) too.
"""

from __future__ import annotations

from typing import Any

from . import args, backends, formats, fp4
from .args import FP32_BLOCK, MX_BLOCK, gemm_layouts, gemm_operands, scale_dtypes, transposed_layout
from ._tensor import Tensor, export, export_all, wrap
from .declarations import PRIMITIVES
from .formats import E2M1, FP8_DTYPES, Encoding, Format
from .layouts import BlockScaledTensor, Layout, MXTensor, RowwiseTensor, ScaledTensor, resolve

__all__ = ["MXTensor", "BlockScaledTensor", "quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8",
           "quantize_blockwise", "dequantize_blockwise", "dequantize_blocks", "transpose_blocks", "MX_BLOCK",
           "FP32_BLOCK", "E8M0", "scale_dtypes", "transposed_layout", "gemm_operands", "gemm_scales", "gemm_layouts",
           "dequantize_kind"]

Array = Any
E8M0 = formats.E8M0.dtype_name  # the scales' dtype: float8_e8m0fnu
# the block kinds (rowwise scaling's row-long blocks too), and the names of their pairs
_CLASSES = {"mx": MXTensor, "blocks": BlockScaledTensor, "axiswise": RowwiseTensor}
_FAMILIES = {kind: layout.family for kind, layout in (("mx", Layout.MX_ROWWISE), ("blocks", Layout.BLOCK_1X128),
                                                        ("axiswise", Layout.ROWWISE))}


_MXFP8, _MXFP8_BOTH, _BLOCKWISE = (PRIMITIVES[name].results for name in
                                  ("quantize_mxfp8", "quantize_mxfp8_both", "quantize_blockwise"))


def quantized(backend: Any, t: Tensor, specs: tuple, quantize: Any, *options: Any) -> tuple:
    """A block quantizer's results, allocated from their declared ``specs`` on t's device and written by
    ``quantize(t as [rows, cols], *options, outs)`` of ``backend``, as the caller's arrays."""
    t2 = args.as_2d(t, "x")
    out = tuple(args.result(backend, spec, t) for spec in specs)
    quantize(t2, *options, tuple(o if o.ndim == 2 else o.reshape(t2.shape) for o in out))  # data: x's shape
    return export_all(tuple((o, spec.dtype) for o, spec in zip(out, specs)), t)


def _scale_tensor(obj: Any, arg: str, like: Tensor, dtypes: tuple[str, ...]) -> Tensor:
    t = args.contiguous(wrap(obj, arg), arg)
    args.same_device(t, like, arg, "data")
    if t.dtype not in dtypes:
        raise TypeError(f"{arg}: expected {' or '.join(dtypes)}, got {t.dtype}")
    return t


def _family(named: Layout | None, kind: str, arg: str) -> tuple[Layout, ...]:
    """The block layouts of ``kind`` (MX, fp32 blocks), where ``named`` must be."""
    family = _FAMILIES.get(kind, ())
    if not family or named not in (None, *family):
        have = family or [a for f in _FAMILIES.values() for a in f]  # the kernels' layouts
        raise ValueError(f"{arg}: expected a {' or '.join(have)} layout, got {named or kind}")
    return family


def _parts(t: Any, arg: str, fmt: Any, kind: str | None = None) -> tuple[Tensor, Tensor, Encoding, Layout]:
    """(data viewed 2-D, scale, encoding, layout) of a ScaledTensor, or of a plain (data, scale) pair of
    ``kind``, checked: fp8 data, scales of the kind's dtype on its device, in a layout of the kind."""
    cls = _CLASSES[kind] if kind else type(t) if isinstance(t, ScaledTensor) else ScaledTensor
    if isinstance(t, ScaledTensor) and t.encoding is E2M1:
        raise TypeError(f"{arg}: expected fp8 data, got {type(t).__name__} of E2M1 (FP4) data, which fp8core.fp4 "
                        "dequantizes (dequantize_blocks too) and has no transpose of (quantize with columnwise=True)")
    if not isinstance(t, tuple if kind else ScaledTensor) or len(t) != 2:
        raise TypeError(f"{arg}: expected a {cls.__name__} (data, {cls._fields[1]}), got {type(t).__name__}")
    named = t._layout if isinstance(t, ScaledTensor) else None
    kind = kind or t.kind
    family = _family(named, kind, arg)
    if fmt is None and isinstance(t, ScaledTensor) and t.encoding is not None:
        fmt = t.encoding.dtype_name
    tq, f = args.fp8(t[0], f"{arg}.data", fmt)
    t2 = args.as_2d(tq, f"{arg}.data")
    name = f"{arg}.{cls._fields[1]}"
    ts = _scale_tensor(t[1], name, tq, scale_dtypes(kind))
    return t2, ts, f.encoding, resolve(named, family, t2.shape, ts.shape, name)


def dequantize_blocks(t: ScaledTensor, out_dtype: Any = "float32", *, fmt: Format | str | None = None) -> Array:
    """:func:`dequantize_mxfp8` or :func:`dequantize_blockwise`, by t's layout; FP4 (E2M1 data) as
    :func:`fp8core.dequantize_nvfp4` or :func:`fp8core.dequantize_mxfp4`.

    t: a ScaledTensor of fp8 data and E8M0 scales in 1x32 or 32x1 blocks, or fp32 scale inverses in 1x128
    blocks, 128x128 tiles, or one per row or column (:class:`RowwiseTensor`); or an NVFP4Tensor or
    MXFP4Tensor. out_dtype: float32, bfloat16 or float16. Returns data's shape
    in out_dtype (FP4: [R, C], its packed data unpacked). fmt names the format of uint8 fp8 data (CuPy).
    """
    if isinstance(t, ScaledTensor) and t.encoding is E2M1:
        if fmt is not None:
            raise ValueError(f"fmt: t names its data's encoding, E2M1; pass no fmt (got {fmt!r})")
        return (fp4.dequantize_nvfp4 if t.kind == "nvfp4" else fp4.dequantize_mxfp4)(t, out_dtype)
    return dequantize_kind(t, None, out_dtype, fmt)


def dequantize_kind(t: Any, kind: str | None, out_dtype: Any, fmt: Any) -> Array:
    """:func:`dequantize_blocks` of a ScaledTensor, or of a plain (data, scale) pair, whose layout must be of
    ``kind`` ("mx", "blocks", "axiswise"; None: any block kind)."""
    tq, ts, f, layout = _parts(t, "t", fmt, kind)
    name = args.out_dtype(out_dtype)
    y = backends.blocks_for_device(tq.device).dequantize_blocks(tq, ts, f, layout, name)
    return export(y.reshape(wrap(t[0]).shape), name, tq)


# ---- MXFP8 ------------------------------------------------------------------------------------------------

def quantize_mxfp8(x: Array, fmt: Format | str = Format.E4M3, *, scale_mode: str = "rceil",
                   columnwise: bool = False) -> MXTensor:
    """MXFP8 quantization: one E8M0 scale per 32 consecutive elements of a row (or of a column).

    x: float32/bfloat16/float16, any shape (viewed as [rows, cols]). scale_mode: "rceil" (default; the block's
    amax lands at or below fp8_max) or "floor" (OCP). Returns ``MXTensor(data, scale)``: data fp8 in x's
    shape; scale E8M0 [rows, ceil(cols/32)] (layout ``1x32``), or [ceil(rows/32), cols] (``32x1``) when
    ``columnwise``.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    mode = args.scale_mode(scale_mode)
    cw = args.flag(columnwise, "columnwise")
    layout = Layout.MX_COLUMNWISE if cw else Layout.MX_ROWWISE
    backend = backends.blocks_for_device(t.device)
    specs = _MXFP8((t.data.shape, t.dtype), f, mode, cw)
    return MXTensor(*quantized(backend, t, specs, backend.quantize_mxfp8, f, mode, layout), layout, f)


def quantize_mxfp8_both(x: Array, fmt: Format | str = Format.E4M3, *,
                        scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """``(rowwise, columnwise)``: both MXFP8 quantizations of x from one read of it (a backward pass needs the
    columnwise one for the transposed GEMM operand). Each equals :func:`quantize_mxfp8` bit for bit."""
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    mode = args.scale_mode(scale_mode)
    backend = backends.blocks_for_device(t.device)
    q, s, qc, sc = quantized(backend, t, _MXFP8_BOTH((t.data.shape, t.dtype), f, mode), backend.quantize_mxfp8_both,
                             f, mode)
    return MXTensor(q, s, Layout.MX_ROWWISE, f), MXTensor(qc, sc, Layout.MX_COLUMNWISE, f)


def dequantize_mxfp8(t: MXTensor, out_dtype: Any = "float32", *, fmt: Format | str | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * 2^(e - 127))`` per block; NaN (and the NaN scale byte) canonical.

    t: an :class:`MXTensor` (rowwise or columnwise: its layout, else told apart by the scale's shape).
    out_dtype: float32, bfloat16 or float16. fmt names the format of uint8 data (CuPy).
    """
    return dequantize_kind(t, "mx", out_dtype, fmt)


# ---- fp32 block scales ------------------------------------------------------------------------------------

def quantize_blockwise(x: Array, fmt: Format | str = Format.E4M3, *, block: Any = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """Quantization with one fp32 scale per 1x128 block or 128x128 tile, each from its own amax by the
    per-tensor scale rule (``power_of_2``, ``epsilon``; 1.0 where a block's amax is 0, inf or NaN).

    x: float32/bfloat16/float16, any shape (viewed as [rows, cols]). block: "1x128" or "128x128" (or a Layout,
    or (1, 128) / (128, 128)). Returns ``BlockScaledTensor(data, scale_inv)``: data fp8 in x's shape, scale_inv
    float32 [rows, ceil(cols/128)] ("1x128") or [ceil(rows/128), ceil(cols/128)] ("128x128").
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    layout = args.block(block)
    pow2 = args.flag(power_of_2, "power_of_2")
    eps = args.epsilon(epsilon)
    backend = backends.blocks_for_device(t.device)
    specs = _BLOCKWISE((t.data.shape, t.dtype), f, layout, pow2, eps)
    return BlockScaledTensor(*quantized(backend, t, specs, backend.quantize_blockwise, f, layout, pow2, eps), layout, f)


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: Any = "float32", *,
                         fmt: Format | str | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * scale_inv[block])``; NaN canonical.

    t: a :class:`BlockScaledTensor` (1x128 or 128x128: its layout, else told apart by the scale_inv's shape).
    """
    return dequantize_kind(t, "blocks", out_dtype, fmt)


# ---- transposes --------------------------------------------------------------------------------------------

def transpose_blocks(t: ScaledTensor, *, fmt: Format | str | None = None) -> ScaledTensor:
    """The block-scaled transpose, bits unchanged: what a backward GEMM takes as its K-major operand.

    A ScaledTensor of x [rows, cols] (viewed 2-D) becomes the one of x.T, of the same type, in the transposed
    layout: MX's columnwise scales become rowwise ones and back (so ``transpose_blocks(quantize_mxfp8(x,
    columnwise=True))`` equals ``quantize_mxfp8(x.T)`` bit for bit), 128x128 tiles stay tiles. 1x128 blocks have
    no transpose (quantize x.T instead).
    """
    tq, ts, f, layout = _parts(t, "t", fmt)
    layout_t = transposed_layout(layout, tq.shape[0])
    q_t = backends.for_device(tq.device).transpose(tq)
    s_t = backends.blocks_for_device(tq.device).transpose_scale(ts)
    return type(t)(export(q_t, f.dtype_name, tq), export(s_t, ts.dtype, tq), layout_t, f)


# ---- operands of fp8core.gemm -----------------------------------------------------------------------------

def gemm_scales(a: ScaledTensor, b: ScaledTensor, ta: Tensor, tb: Tensor, k: int,
                out_name: str) -> tuple[Tensor, Tensor, Layout, Layout]:
    """(a's scales, b's, a's layout, b's), after the checks cuBLASLt imposes on a scaled GEMM of a [M, K] (ta)
    and b [N, K] (tb)."""
    if out_name in FP8_DTYPES:
        raise ValueError(f"out_dtype: a block-scaled GEMM writes float32, bfloat16 or float16, got {out_name}")
    scales = []
    for arg, t, data in (("a", a, ta), ("b", b, tb)):
        name = f"{arg}.{t._fields[1]}"
        family = _family(t._layout, t.kind, arg)
        ts = _scale_tensor(t[1], name, ta, scale_dtypes(t.kind))
        scales += [ts, resolve(t._layout, family, data.shape, ts.shape, name)]
    sa, la, sb, lb = scales
    gemm_layouts(la, lb, ta.shape[0], tb.shape[0], k)
    return sa, sb, la, lb
