"""Block-scaled FP8: MXFP8 (1x32 blocks, E8M0 scales) and DeepSeek-V3's 1x128 / 128x128 blocks (fp32 scales).

Every primitive works on the 2-D view ``[rows, cols]`` of its input (leading dimensions folded into rows, as
``cast_transpose`` does), validates like :mod:`fp8core.ops`, picks the backend by device and returns the
caller's array type. The numerics are docs/numerics.md's "Block scaling"; both backends give the same bits.

A block-scaled result is a typed pair: :class:`MXTensor` ``(data, scale)`` with E8M0 scale bytes
(``float8_e8m0fnu`` for NumPy, torch and JAX; uint8 storage for CuPy), or :class:`BlockScaledTensor`
``(data, scale_inv)`` with fp32 scale inverses. Both go straight into :func:`fp8core.gemm`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import args, backends, formats
from ._tensor import Tensor, export, wrap
from .args import cdiv
from .formats import FP8_DTYPES, Encoding, Format

__all__ = ["MXTensor", "BlockScaledTensor", "quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8",
           "quantize_blockwise", "dequantize_blockwise", "transpose_blocks", "MX_BLOCK", "FP32_BLOCK", "E8M0",
           "mx_scale_shape", "mx_layout", "block_scale_shape", "block_layout", "gemm_operands", "gemm_blocks"]

Array = Any
MX_BLOCK = 32
FP32_BLOCK = 128
E8M0 = formats.E8M0.dtype_name  # the scales' dtype: float8_e8m0fnu


class MXTensor(NamedTuple):
    """MXFP8 data and its E8M0 scales.

    data: fp8 (E4M3 or E5M2), the input's shape. scale: E8M0 bytes, ``[rows, ceil(cols/32)]`` when each block
    is 32 consecutive elements of a row (rowwise), ``[ceil(rows/32), cols]`` when 32 of a column (columnwise).
    Element ``data[r, c]`` is ``q * 2^(e - 127)`` with e its block's byte.
    """

    data: Array
    scale: Array


class BlockScaledTensor(NamedTuple):
    """FP8 data and one fp32 scale inverse per 1x128 block (``[rows, ceil(cols/128)]``) or per 128x128 tile
    (``[ceil(rows/128), ceil(cols/128)]``). Element ``data[r, c]`` is ``q * scale_inv[its block]``."""

    data: Array
    scale_inv: Array


def _scale_tensor(obj: Any, arg: str, like: Tensor, dtypes: tuple[str, ...]) -> Tensor:
    t = args.contiguous(wrap(obj, arg), arg)
    args.same_device(t, like, arg, "data")
    if t.dtype not in dtypes:
        raise TypeError(f"{arg}: expected {' or '.join(dtypes)}, got {t.dtype}")
    return t


def _pair(obj: Any, kind: type, arg: str) -> tuple[Any, Any]:
    if not isinstance(obj, tuple) or len(obj) != 2:
        raise TypeError(f"{arg}: expected a {kind.__name__} (data, {kind._fields[1]}), got {type(obj).__name__}")
    return obj[0], obj[1]


# ---- MXFP8 ------------------------------------------------------------------------------------------------

def quantize_mxfp8(x: Array, fmt: Format | str = Format.E4M3, *, scale_mode: str = "rceil",
                   columnwise: bool = False) -> MXTensor:
    """MXFP8 quantization: one E8M0 scale per 32 consecutive elements of a row (or of a column).

    x: float32/bfloat16/float16, any shape (viewed as [rows, cols]). scale_mode: "rceil" (default; the block's
    amax lands at or below fp8_max) or "floor" (OCP). Returns ``MXTensor(data, scale)``: data fp8 in x's
    shape; scale E8M0 [rows, ceil(cols/32)], or [ceil(rows/32), cols] when ``columnwise``.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    mode = args.scale_mode(scale_mode)
    cw = args.flag(columnwise, "columnwise")
    t2 = args.as_2d(t, "x")
    q, s = backends.blocks_for_device(t.device).quantize_mxfp8(t2, f, mode, cw)
    return MXTensor(export(q.reshape(t.shape), f.dtype_name, t), export(s, E8M0, t))


def quantize_mxfp8_both(x: Array, fmt: Format | str = Format.E4M3, *,
                        scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """``(rowwise, columnwise)``: both MXFP8 quantizations of x from one read of it (a backward pass needs the
    columnwise one for the transposed GEMM operand). Each equals :func:`quantize_mxfp8` bit for bit."""
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    mode = args.scale_mode(scale_mode)
    q, s, qc, sc = backends.blocks_for_device(t.device).quantize_mxfp8_both(args.as_2d(t, "x"), f, mode)
    return (MXTensor(export(q.reshape(t.shape), f.dtype_name, t), export(s, E8M0, t)),
            MXTensor(export(qc.reshape(t.shape), f.dtype_name, t), export(sc, E8M0, t)))


def mx_scale_shape(rows: int, cols: int, columnwise: bool) -> tuple[int, int]:
    """The E8M0 scale's shape for data viewed as [rows, cols]: one byte per 32 of a row (or of a column)."""
    return (cdiv(rows, MX_BLOCK), cols) if columnwise else (rows, cdiv(cols, MX_BLOCK))


def mx_layout(shape: tuple[int, int], scale_shape: tuple[int, ...], arg: str = "scale") -> bool:
    """True for columnwise scales of a [rows, cols] tensor, False for rowwise; the two shapes coincide only
    where they mean the same blocks (rows <= 1 and cols <= 1)."""
    row, col = mx_scale_shape(*shape, False), mx_scale_shape(*shape, True)
    if tuple(scale_shape) in (row, col):
        return tuple(scale_shape) != row
    raise ValueError(f"{arg}: expected shape {row} (rowwise) or {col} (columnwise) for data viewed as "
                     f"{tuple(shape)}, got {tuple(scale_shape)}")


def _mx_parts(t: Any, arg: str, fmt: Any) -> tuple[Tensor, Tensor, Encoding, bool]:
    data, scale = _pair(t, MXTensor, arg)
    tq, f = args.fp8(data, f"{arg}.data", fmt)
    t2 = args.as_2d(tq, f"{arg}.data")
    ts = _scale_tensor(scale, f"{arg}.scale", tq, (E8M0, "uint8"))
    return t2, ts, f.encoding, mx_layout(t2.shape, ts.shape, f"{arg}.scale")


def dequantize_mxfp8(t: MXTensor, out_dtype: Any = "float32", *, fmt: Format | str | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * 2^(e - 127))`` per block; NaN (and the NaN scale byte) canonical.

    t: an :class:`MXTensor` (rowwise or columnwise, told apart by the scale's shape). out_dtype: float32,
    bfloat16 or float16. fmt names the format of uint8 data (CuPy).
    """
    tq, ts, f, columnwise = _mx_parts(t, "t", fmt)
    name = args.out_dtype(out_dtype)
    y = backends.blocks_for_device(tq.device).dequantize_mxfp8(tq, ts, f, columnwise, name)
    shape = wrap(t[0]).shape
    return export(y.reshape(shape), name, tq)


# ---- fp32 block scales ------------------------------------------------------------------------------------

def quantize_blockwise(x: Array, fmt: Format | str = Format.E4M3, *, block: Any = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """Quantization with one fp32 scale per 1x128 block or 128x128 tile, each from its own amax by the
    per-tensor scale rule (``power_of_2``, ``epsilon``; 1.0 where a block's amax is 0, inf or NaN).

    x: float32/bfloat16/float16, any shape (viewed as [rows, cols]). Returns ``BlockScaledTensor(data,
    scale_inv)``: data fp8 in x's shape, scale_inv float32 [rows, ceil(cols/128)] ("1x128") or
    [ceil(rows/128), ceil(cols/128)] ("128x128").
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    br = args.block_rows(block)
    pow2 = args.flag(power_of_2, "power_of_2")
    q, s_inv = backends.blocks_for_device(t.device).quantize_blockwise(args.as_2d(t, "x"), f, br, pow2,
                                                                       args.epsilon(epsilon))
    return BlockScaledTensor(export(q.reshape(t.shape), f.dtype_name, t), export(s_inv, "float32", t))


def block_scale_shape(rows: int, cols: int, block_rows: int) -> tuple[int, int]:
    """The fp32 scale_inv's shape for data viewed as [rows, cols] in blocks of ``block_rows`` x 128."""
    return cdiv(rows, block_rows), cdiv(cols, FP32_BLOCK)


def block_layout(shape: tuple[int, int], scale_shape: tuple[int, ...], arg: str = "scale_inv") -> int:
    """Block rows (1 or 128) that a scale_inv of ``scale_shape`` means for data viewed as ``shape``; the two
    layouts coincide only for rows <= 1, where a 128x128 tile is a 1x128 block."""
    blocks, tiles = block_scale_shape(*shape, 1), block_scale_shape(*shape, FP32_BLOCK)
    if tuple(scale_shape) in (blocks, tiles):
        return 1 if tuple(scale_shape) == blocks else FP32_BLOCK
    raise ValueError(f"{arg}: expected shape {blocks} (1x128 blocks) or {tiles} (128x128 tiles) for data viewed "
                     f"as {tuple(shape)}, got {tuple(scale_shape)}")


def _block_parts(t: Any, arg: str, fmt: Any) -> tuple[Tensor, Tensor, Encoding, int]:
    data, scale_inv = _pair(t, BlockScaledTensor, arg)
    tq, f = args.fp8(data, f"{arg}.data", fmt)
    t2 = args.as_2d(tq, f"{arg}.data")
    ts = _scale_tensor(scale_inv, f"{arg}.scale_inv", tq, ("float32",))
    return t2, ts, f.encoding, block_layout(t2.shape, ts.shape, f"{arg}.scale_inv")


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: Any = "float32", *,
                         fmt: Format | str | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * scale_inv[block])``; NaN canonical.

    t: a :class:`BlockScaledTensor` (1x128 or 128x128, told apart by the scale_inv's shape).
    """
    tq, ts, f, br = _block_parts(t, "t", fmt)
    name = args.out_dtype(out_dtype)
    y = backends.blocks_for_device(tq.device).dequantize_blockwise(tq, ts, f, br, name)
    return export(y.reshape(wrap(t[0]).shape), name, tq)


# ---- transposes --------------------------------------------------------------------------------------------

def transpose_blocks(t: MXTensor | BlockScaledTensor, *, fmt: Format | str | None = None) -> Any:
    """The block-scaled transpose, bits unchanged: what a backward GEMM takes as its K-major operand.

    An MXTensor of x [rows, cols] (viewed 2-D) becomes the MXTensor of x.T: columnwise scales become rowwise
    ones and back (so ``transpose_blocks(quantize_mxfp8(x, columnwise=True))`` equals
    ``quantize_mxfp8(x.T)`` bit for bit). A BlockScaledTensor of 128x128 tiles becomes that of x.T; 1x128
    blocks have no transpose (quantize x.T instead).
    """
    if isinstance(t, MXTensor):
        tq, ts, f, _ = _mx_parts(t, "t", fmt)
    else:
        tq, ts, f, br = _block_parts(t, "t", fmt)
        if br == 1 and tq.shape[0] > 1:
            raise ValueError("t: 1x128 blocks lie along rows and have no transpose; quantize the transposed "
                             "tensor instead")
    q_t = backends.for_device(tq.device).transpose(tq)
    s_t = backends.blocks_for_device(tq.device).transpose_scale(ts)
    return type(t)(export(q_t, f.dtype_name, tq), export(s_t, ts.dtype, tq))


# ---- operands of fp8core.gemm -----------------------------------------------------------------------------

class GemmBlocks(NamedTuple):
    """Block-scaled GEMM operands, unpacked and validated for :func:`fp8core.gemm` (the same on every backend).

    a_block / b_block: "1x32" (MXFP8), "1x128" or "128x128"; the scales are the operands' own arrays.
    """

    a_data: Any
    b_data: Any
    a_scale: Any
    b_scale: Any
    kind: type


def gemm_operands(a: Any, b: Any, a_scale_inv: Any, b_scale_inv: Any) -> GemmBlocks:
    """Split block-scaled a and b into data and scales; both must be MXTensor or both BlockScaledTensor."""
    for arg, obj in (("a", a), ("b", b)):
        if not isinstance(obj, (MXTensor, BlockScaledTensor)):
            raise TypeError(f"{arg}: with a block-scaled operand, expected an MXTensor or a BlockScaledTensor, "
                            f"got {type(obj).__name__}; quantize both operands with the same scheme")
    if type(a) is not type(b):
        raise ValueError(f"b: a is {type(a).__name__} but b is {type(b).__name__}; a block-scaled GEMM takes "
                         "MXFP8 x MXFP8 or fp32 blocks x fp32 blocks")
    for arg, value in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if value is not None:
            raise ValueError(f"{arg}: block-scaled operands carry their own scales; pass no {arg}")
    return GemmBlocks(a[0], b[0], a[1], b[1], type(a))


def gemm_blocks(mx: bool, m: int, n: int, k: int, a_scale_shape: tuple[int, ...],
                b_scale_shape: tuple[int, ...]) -> tuple[str, str]:
    """(a_block, b_block) of a block-scaled ``a [M, K] · b [N, K]ᵀ`` by cuBLASLt's limits, from shapes alone:
    the one statement of the rule, for the core and the front-ends that check it while tracing."""
    if mx:
        if k % MX_BLOCK:
            raise ValueError(f"a: K = {k}; an MXFP8 GEMM needs K to be a multiple of 32 (whole 1x32 blocks)")
        for arg, shape, rows in (("a.scale", a_scale_shape, m), ("b.scale", b_scale_shape, n)):
            if tuple(shape) != (rows, k // MX_BLOCK):
                raise ValueError(f"{arg}: the GEMM takes rowwise MXFP8 (blocks along K): expected shape "
                                 f"{(rows, k // MX_BLOCK)}, got {tuple(shape)}")
        return "1x32", "1x32"
    if k % FP32_BLOCK:
        raise ValueError(f"a: K = {k}; a 1x128/128x128 block GEMM needs K to be a multiple of 128 (whole blocks)")
    ka = "1x128" if block_layout((m, k), a_scale_shape, "a.scale_inv") == 1 else "128x128"
    kb = "1x128" if block_layout((n, k), b_scale_shape, "b.scale_inv") == 1 else "128x128"
    if ka == kb == "128x128":
        raise ValueError("a, b: cuBLASLt has no 128x128 x 128x128 GEMM; quantize a (activations, gradients) in "
                         "1x128 blocks")
    # cuBLASLt 13.1 on an H200 found no algorithm for M = 1 and M = 130 (run of 2026-11-26) and ran M = 8, 20, 136;
    # Transformer Engine asks a multiple of 8 too ("Caller must pad"). N is a multiple of 16 for every FP8 GEMM.
    if m % 8:
        raise ValueError(f"a: M = {m}; a 1x128/128x128 block GEMM needs M to be a multiple of 8 (as Transformer "
                         "Engine asks; cuBLASLt found no algorithm for M = 1 or 130), on both backends: pad a's rows "
                         "with zeros")
    return ka, kb


def gemm_scales(blocks: GemmBlocks, ta: Tensor, tb: Tensor, k: int, out_name: str) -> tuple[Any, Any, str, str]:
    """(a_scale, b_scale, a_block, b_block): the scales as backend arrays, after the checks cuBLASLt imposes."""
    if out_name in FP8_DTYPES:
        raise ValueError(f"out_dtype: a block-scaled GEMM writes float32, bfloat16 or float16, got {out_name}")
    mx = blocks.kind is MXTensor
    names, dtypes = (("a.scale", "b.scale"), (E8M0, "uint8")) if mx else (("a.scale_inv", "b.scale_inv"), ("float32",))
    sa = _scale_tensor(blocks.a_scale, names[0], ta, dtypes)
    sb = _scale_tensor(blocks.b_scale, names[1], ta, dtypes)
    a_block, b_block = gemm_blocks(mx, ta.shape[0], tb.shape[0], k, sa.shape, sb.shape)
    return sa.data, sb.data, a_block, b_block
