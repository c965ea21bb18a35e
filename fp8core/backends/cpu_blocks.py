"""The CPU reference for block scaling (docs/numerics.md, "Block scaling"), vectorised in NumPy.

Arrays are 2-D NumPy views ``[rows, cols]`` in their logical dtype; block amaxes are fp32 bit patterns
(unsigned order is float order, NaN canonical above inf), so every step is an exact integer or single IEEE
fp32 operation. Blocks at the edges are partial and are reduced as they are (never padded: a (1, n) tensor
padded to 128x128 blocks would cost 128 times its size); every path works tile by tile, so its temporaries are
tile-sized whatever the shape. Every public function runs in the IEEE default floating-point
environment (fp8core._fpenv.ieee), so a caller that flushes subnormals gets the contract's bits too.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .. import formats
from .._caches import cached
from .._fpenv import ieee
from .._views import Tensor, logical_numpy_dtype
from ..formats import Encoding
from ..layouts import Layout
from .cpu import CANONICAL_NAN, canonical_nan_fp8, map_chunks, quantize_table, to_f32, scale_rule

SCALE = formats.E8M0  # MXFP8's scale encoding
E8M0 = SCALE.numpy_dtype
E8M0_NAN = SCALE.nan_cast  # its one NaN byte: what a NaN amax gives, and what reads as NaN

_F32_NAN = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def inv_fp8_max(fmt: Encoding) -> np.float32:
    """fp32(1 / fp8_max), rounded once: what rceil multiplies by."""
    return np.float32(1.0 / fmt.max)


TILE = 1 << 18  # elements per tile of the block paths at most: their fp32 temporaries stay near 1 MiB
TILE_BLOCKS = TILE // 32  # blocks per tile at most: the scale rules' temporaries are ~40 bytes a block


def _tiles(rows: int, cols: int, br: int, bc: int, tile: int = 0) -> list[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) rectangles covering ``[rows, cols]``, at most ``tile`` (default TILE) elements and
    TILE_BLOCKS blocks each where a block allows, on block boundaries.

    Along each axis a tile holds whole blocks or is the one partial block at the edge, so its blocks are a
    reshape away and nothing is padded (padding a (1, n) tensor to 128x128 blocks costs 128 times its size).
    """
    def spans(n: int, b: int, step: int) -> list[tuple[int, int]]:  # step: a multiple of b
        whole = n // b * b
        out = [(a, min(a + step, whole)) for a in range(0, whole, step)]
        return out + [(whole, n)] if whole < n else out

    if rows == 0 or cols == 0:
        return []
    tile = tile or TILE
    size = min(tile, max(tile // 16, rows * cols // 4))  # a small input in a few tiles: temporaries well under it
    nblocks = max(1, size * TILE_BLOCKS // TILE)
    cb = -(-cols // bc)
    tiles = []
    for r0, r1 in spans(rows, br, br * max(1, min(size // (br * cols), nblocks // cb))):
        rr, rb = r1 - r0, -(-(r1 - r0) // br)
        if rr * cols <= size and rb * cb <= nblocks:
            width = cb * bc
        else:
            width = bc * max(1, min(size // (rr * bc), nblocks // rb))
        tiles += [(r0, r1, c0, c1) for c0, c1 in spans(cols, bc, width)]
    return tiles


def _blocks(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """A tile ``[rr, cc]`` (contiguous) as ``[R, rr // R, C, cc // C]`` blocks, the edge ones partial."""
    rr, cc = a.shape
    R, C = -(-rr // br), -(-cc // bc)
    return a.reshape(R, rr // R, C, cc // C)


def _tile_amax_bits(t: np.ndarray, br: int, bc: int) -> np.ndarray:
    """The amax of every br x bc block of a tile (see :func:`_tiles`) as fp32 bits, ``[R, C]``.

    Reduced on the |x| bit patterns (unsigned order is float order for fp32, bf16 and fp16 alike, NaN above
    inf); NaN is made canonical per block, after the max, which picks a NaN over anything else. bf16 and fp16
    block maxima are widened once per block: no fp32 copy of the tile.
    """
    return f32_bits(_blocks(magnitudes(t), br, bc).max(axis=(1, 3)), t.dtype)


def magnitudes(t: np.ndarray) -> np.ndarray:
    """|x| bit patterns (uint32 for fp32, uint16 for bf16/fp16): unsigned order is float order, NaN above inf."""
    if t.itemsize == 4:
        return np.bitwise_and(t.view(np.uint32), np.uint32(0x7FFFFFFF))
    return np.bitwise_and(t.view(np.uint16), np.uint16(0x7FFF))


def f32_bits(m: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Block maxima of |x| patterns (of ``dtype``) as fp32 bits, NaN canonical (0x7FFFFFFF)."""
    if m.dtype == np.uint32:
        m[m > _F32_INF] = _F32_NAN
        return m
    if dtype == np.float16:
        out = m.view(np.float16).astype(np.float32).view(np.uint32)
        out[m > 0x7C00] = _F32_NAN
        return out
    out = np.left_shift(m.astype(np.uint32), 16)  # bfloat16
    out[m > 0x7F80] = _F32_NAN
    return out


def _highest_bit(m: np.ndarray) -> np.ndarray:
    """Position of the highest set bit of each nonzero uint32 (exact: frexp of an exactly representable int)."""
    return (np.frexp(m.astype(np.float64))[1] - 1).astype(np.int64)


@ieee
def e8m0_rceil(amax_bits: np.ndarray, fmt: Encoding) -> np.ndarray:
    """E8M0 scale bytes by "rceil": v = amax *rn fp32(1/fp8_max), its exponent rounded toward +inf."""
    with np.errstate(all="ignore"):
        v = amax_bits.view(np.float32) * inv_fp8_max(fmt)
    vb = v.view(np.uint32)
    exp = np.right_shift(vb, 23).astype(np.int64)  # v >= 0: no sign bit
    mant = np.bitwise_and(vb, np.uint32(0x7FFFFF))
    # fp32's biased exponent is the scale byte (both have bias 127). v subnormal: 2^-127 (mantissa 0x400000) and
    # below round up to 2^-127 (e = 0); above it to 2^-126 (e = 1).
    e = np.where(exp == 0, (mant > 0x400000).astype(np.int64), exp + (mant != 0))
    e = np.minimum(e, SCALE.max_code)  # inf (exp 255) and the top binade (would be 255) saturate
    e[np.isnan(v)] = E8M0_NAN
    return e.astype(np.uint8)


@ieee
def e8m0_floor(amax_bits: np.ndarray, fmt: Encoding) -> np.ndarray:
    """E8M0 scale bytes by the OCP rule: clamp(floor(log2(amax)) - emax + 127, 0, 254)."""
    exp = np.right_shift(amax_bits, 23).astype(np.int64)
    mant = np.bitwise_and(amax_bits, np.uint32(0x7FFFFF))
    log2 = np.where(exp != 0, exp - 127, np.where(mant != 0, _highest_bit(mant) - 149, 0))
    e = np.clip(log2 - fmt.emax + SCALE.bias, 0, SCALE.max_code)
    e[amax_bits == 0] = 0
    e[amax_bits == _F32_INF] = SCALE.max_code
    e[amax_bits > _F32_INF] = E8M0_NAN
    return e.astype(np.uint8)


@ieee
def pow2_f32(k: np.ndarray) -> np.ndarray:
    """2^k as fp32 for integer k in [-149, 127], made from its bits (exact, subnormals included)."""
    k = np.asarray(k, np.int64)
    bits = np.where(k >= -126, np.left_shift(np.maximum(k + 127, 0), 23),
                    np.left_shift(1, np.clip(k + 149, 0, 22)))
    return bits.astype(np.uint32).view(np.float32)


@ieee
def e8m0_factor(e: np.ndarray, sign: int) -> np.ndarray:
    """2^(sign * (e - 127)) as fp32 per scale byte; the NaN byte gives NaN."""
    e = np.asarray(e, np.uint8)
    f = pow2_f32(sign * (e.astype(np.int64) - SCALE.bias))
    f[e == E8M0_NAN] = np.float32(np.nan)
    return f


@cached("cpu_blocks.e8m0_factors", maxsize=2)
def _e8m0_factors(sign: int) -> np.ndarray:
    """:func:`e8m0_factor` of all 256 scale bytes, fp32 [256] (read only): the tiles look their factors up
    (a tile's pow2_f32 cost ~2 ns per element of the tile, the lookup a few percent of that)."""
    f = e8m0_factor(np.arange(256, dtype=np.uint8), sign)
    f.flags.writeable = False
    return f


TABLE_MIN = 1 << 18  # 16-bit inputs from this size quantize by table lookup
TABLE_MAX_SCALES = 16  # ... when their blocks use at most this many distinct scales (cpu's table cache size)


def _block_slices(r0: int, r1: int, c0: int, c1: int, br: int, bc: int) -> tuple[slice, slice]:
    """The blocks of a tile, as slices of a per-block array."""
    return slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc))


def _cast(t: np.ndarray, fmt: Encoding) -> np.ndarray:
    """Clipped fp32 -> ``fmt`` by RTNE, NaN canonical."""
    q = t.astype(fmt.numpy_dtype)
    canonical_nan_fp8(q.view(np.uint8), fmt)
    return q


def _cast_tile(x: np.ndarray, q: np.ndarray, tile: tuple[int, int, int, int], factor: np.ndarray, br: int,
               bc: int, fmt: Encoding) -> None:
    r0, r1, c0, c1 = tile
    t = to_f32(x[r0:r1, c0:c1])
    blocks = _blocks(t, br, bc)
    np.multiply(blocks, factor[:, None, :, None], out=blocks)
    fmax = np.float32(fmt.max)
    np.clip(t, -fmax, fmax, out=t)  # finite overflow and +-inf saturate; NaN passes
    q[r0:r1, c0:c1] = _cast(t, fmt)


def _quantize(x: np.ndarray, br: int, bc: int, fmt: Encoding, rule: Any, q: np.ndarray, stored: np.ndarray
              ) -> None:
    """q, stored [R, C] (the stored scales, as ``rule`` gives them) = each block's amax through ``rule`` ->
    (factor fp32, stored), then SATFINITE_RTNE(fp32(x) *rn factor[block]) into ``fmt``; x is [rows, cols].

    Tile by tile (see :func:`_tiles`): the temporaries are tile-sized whatever the shape, and a tile is
    measured and cast while it is in cache. The bits do not depend on the tiling: max is exact and the rest
    is elementwise. Large bf16/fp16 inputs are cast once every factor is known, by table lookup when their
    blocks use few distinct factors; until then a tile keeps its factors, or where blocks are small (a
    partial block per element or few) its distinct factors and a byte per block.
    """
    rows, cols = x.shape
    shape = stored.shape
    table = x.dtype.itemsize == 2 and x.size >= TABLE_MIN
    pending: list[tuple[tuple[int, int, int, int], np.ndarray, np.ndarray | None]] = []
    with np.errstate(all="ignore"):
        for tile in _tiles(rows, cols, br, bc):
            r0, r1, c0, c1 = tile
            rs, cs = _block_slices(r0, r1, c0, c1, br, bc)
            factor, stored[rs, cs] = rule(_tile_amax_bits(x[r0:r1, c0:c1], br, bc))
            if not table:
                _cast_tile(x, q, tile, factor, br, bc, fmt)
            elif factor.size * 16 <= (r1 - r0) * (c1 - c0):
                pending.append((tile, factor.view(np.uint32), None))
            else:
                u, inv = np.unique(factor.view(np.uint32), return_inverse=True)
                pending.append((tile, u, inv.astype(np.uint16 if u.size > 255 else np.uint8).reshape(factor.shape)))
        if not pending:
            return
        scales = np.unique(np.concatenate([f.reshape(-1) for _, f, _ in pending]))
        if scales.size > TABLE_MAX_SCALES:  # too many for tables: cast directly
            for tile, f, inv in pending:
                _cast_tile(x, q, tile, (f if inv is None else f[inv]).view(np.float32), br, bc, fmt)
            return
        which = np.empty(shape, np.uint8)
        for (r0, r1, c0, c1), f, inv in pending:
            w = np.searchsorted(scales, f).astype(np.uint8)
            which[_block_slices(r0, r1, c0, c1, br, bc)] = w if inv is None else w[inv]
        _table_cast(x, which, scales, br, bc, fmt, q.view(np.uint8))


def _block_runs(lo: int, hi: int, b: int) -> list[tuple[int, int]]:
    """[lo, hi) split where blocks of ``b`` start, into at most three runs: each lies within one block or holds
    whole blocks only, so its elements reshape to [blocks, elements of a block]."""
    first, last = min(-(-lo // b) * b, hi), max(hi // b * b, lo)
    if last <= first:  # within one block, or across a single block boundary
        return [(a, z) for a, z in ((lo, first), (first, hi)) if a < z]
    return [(a, z) for a, z in ((lo, first), (first, last), (last, hi)) if a < z]


def _table_cast(x: np.ndarray, which: np.ndarray, scales: np.ndarray, br: int, bc: int, fmt: Encoding,
                q: np.ndarray) -> None:
    """The same cast for bf16/fp16 as lookups: cpu's quantize table of all 65,536 patterns for each distinct
    block scale (made by the direct path, so the bits are the same), indexed by (scale, pattern), in
    cache-sized chunks on cpu's thread pool. ``which`` [R, C]: each block's index into ``scales``."""
    rows, cols = x.shape
    name = "bfloat16" if x.dtype == ml_dtypes.bfloat16 else "float16"
    tables = np.concatenate([quantize_table(name, int(s), fmt) for s in scales])
    codes = x.view(np.uint16).reshape(-1)
    flat = q.reshape(-1)

    def offsets(r0: int, r1: int, c0: int, c1: int) -> np.ndarray:  # of rows [r0, r1), columns [c0, c1)
        # Each block's table index written straight over its elements of the one array of 8-byte offsets a pool
        # thread holds: a repeated copy of the indices would be one more chunk-sized array per thread
        offs = np.empty((r1 - r0, c1 - c0), np.intp)
        for ra, rb in _block_runs(r0, r1, br):
            for ca, cb in _block_runs(c0, c1, bc):
                w = which[ra // br:-(-rb // br), ca // bc:-(-cb // bc)]
                view = offs[ra - r0:rb - r0, ca - c0:cb - c0].view()
                view.shape = (w.shape[0], -1, w.shape[1], (cb - ca) // w.shape[1])  # a view: raises if not
                view[...] = w[:, None, :, None]
        offs <<= 16
        return offs.reshape(-1)

    def chunk(a: int, b: int) -> None:  # flat elements [a, b)
        r0, r1 = a // cols, -(-b // cols)
        if cols <= b - a:  # whole rows, but for the ends: at most two rows more than the chunk
            offs = offsets(r0, r1, 0, cols)[a - r0 * cols:b - r0 * cols]
        elif r1 - r0 == 1:  # within one long row: only the columns the chunk covers
            offs = offsets(r0, r1, a - r0 * cols, b - r0 * cols)
        else:  # across the end of one long row into the next
            offs = np.concatenate([offsets(r, r + 1, max(a - r * cols, 0), min(b - r * cols, cols))
                                   for r in range(r0, r1)])
        # in place, and unbuffered (the indices are in range by construction): no second chunk of offsets
        offs += codes[a:b]
        np.take(tables, offs, out=flat[a:b], mode="clip")

    map_chunks(flat.size, chunk)


@cached("cpu_blocks.fp32_of_code", maxsize=2)
def _fp32_of_code(dtype: np.dtype) -> np.ndarray:
    """fp32 of all 256 codes of an fp8 dtype (exact): a lookup is ~6x faster than ml_dtypes' cast."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _scaled_widen(q: np.ndarray, factor_of: Any, br: int, bc: int, out_dtype: str) -> np.ndarray:
    """ROUND_TO(out_dtype, fp32(q) *rn factor[block]), NaN canonical, tile by tile; ``factor_of(rs, cs)``: the
    fp32 factors of the blocks [rs, cs]."""
    rows, cols = q.shape
    widen = _fp32_of_code(q.dtype)
    y = np.empty((rows, cols), logical_numpy_dtype(out_dtype))
    storage, nan = CANONICAL_NAN[out_dtype]
    with np.errstate(all="ignore"):
        for r0, r1, c0, c1 in _tiles(rows, cols, br, bc, TILE // 4):  # the lookup's indices are 8 bytes each
            codes, part = q[r0:r1, c0:c1].view(np.uint8), y[r0:r1, c0:c1]
            direct = y.dtype == np.float32 and part.flags.c_contiguous  # whole rows: computed in place
            y32 = widen.take(codes, out=part) if direct else widen.take(codes)
            blocks = _blocks(y32, br, bc)
            np.multiply(blocks, factor_of(*_block_slices(r0, r1, c0, c1, br, bc))[:, None, :, None], out=blocks)
            t = y32 if y.dtype == np.float32 else y32.astype(y.dtype)
            if np.isnan(y32.max(initial=0.0)):  # max passes NaN on: one reduction where there is none to mend
                t.view(storage)[np.isnan(y32)] = nan
            if not direct:
                part[...] = t
    return y


# ---- MXFP8 ------------------------------------------------------------------------------------------------

@ieee
def quantize_mxfp8(x: Tensor, fmt: Encoding, scale_mode: str, layout: Layout, out: tuple[np.ndarray, np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] -> out (q [rows, cols] fmt, scale E8M0 [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    def rule(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        e = e8m0_rceil(bits, fmt) if scale_mode == "rceil" else e8m0_floor(bits, fmt)
        return _e8m0_factors(-1).take(e), e

    _quantize(x.data, *layout.block, fmt, rule, out[0], out[1].view(np.uint8))
    return out


@ieee
def quantize_mxfp8_both(x: Tensor, fmt: Encoding, scale_mode: str, out: tuple[np.ndarray, ...]
                        ) -> tuple[np.ndarray, ...]:
    """out (q_rowwise, scale_rowwise, q_columnwise, scale_columnwise)."""
    return (*quantize_mxfp8(x, fmt, scale_mode, Layout.MX_ROWWISE, out[:2]),
            *quantize_mxfp8(x, fmt, scale_mode, Layout.MX_COLUMNWISE, out[2:]))


# ---- fp32 block scales (1x128, 128x128, and a row or column each) ---------------------------------------

@ieee
def quantize_blockwise(x: Tensor, fmt: Encoding, layout: Layout, power_of_2: bool, epsilon: float,
                       out: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] -> out (q, scale_inv fp32 in the layout's shape), each block by the scale rule."""
    def rule(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s, s_inv, _ = scale_rule(bits.view(np.float32).reshape(-1), np.float32(fmt.max), 0, power_of_2, epsilon)
        return s.reshape(bits.shape), s_inv.reshape(bits.shape)

    if not x.size:  # a row (column) of no elements has amax 0: scale 1
        out[1].fill(1.0)
        return out
    _quantize(x.data, *layout.block_for(*x.shape), fmt, rule, *out)
    return out


@ieee
def dequantize_blocks(q: Tensor, scale: Tensor, fmt: Encoding, layout: Layout, out_dtype: str) -> np.ndarray:
    """ROUND_TO(out_dtype, fp32(q) *rn factor[block]): E8M0 scales' powers of two, fp32 scale_inv as they are."""
    if layout.scale is SCALE:
        e = scale.data.view(np.uint8)
        factor_of = lambda rs, cs: _e8m0_factors(1).take(e[rs, cs])  # noqa: E731
    else:
        s_inv = scale.data
        factor_of = lambda rs, cs: s_inv[rs, cs]  # noqa: E731
    return _scaled_widen(q.data.view(fmt.numpy_dtype), factor_of, *layout.block_for(*q.shape), out_dtype)


def transpose_scale(scale: Tensor) -> np.ndarray:
    """A block-scale array [a, b] as a new contiguous [b, a] (E8M0 bytes or fp32), values unchanged; always a
    copy, never a view of the input (a or b of 1 makes .T contiguous already)."""
    return np.array(scale.data.T, order="C", copy=True)


# ---- the scale layouts cuBLASLt reads (the reference of cuda_blocks.gemm_scale) ---------------------------

def gemm_scale(scale: Tensor, layout: Layout) -> np.ndarray:
    """One GEMM operand's block scales ``[rows or row-tiles, K-blocks]`` as cuBLASLt reads them.

    "1x32": flat uint8, 128 x 4 tiles of 512 bytes row-major over the tiles, element (r, c) of a tile at byte
    ``(r % 32) * 16 + (r // 32) * 4 + c`` (cuBLAS's "1D block scaling factors layout"), zero padding.
    "1x128": float32 ``[KB, rows]`` (outer-dimension-major). "128x128": float32 ``[row-tiles, 4 * ceil(KB/4)]``,
    each row padded with zeros to 16 bytes.
    """
    s = scale.data
    rows, kgroups = s.shape
    if layout == Layout.MX_ROWWISE:
        R, C = -(-rows // 128), -(-kgroups // 4)
        padded = np.zeros((R * 128, C * 4), np.uint8)
        padded[:rows, :kgroups] = s.view(np.uint8)
        # [R, 4 (r // 32), 32 (r % 32), C, 4 (c)] -> [R, C, r % 32, r // 32, c]
        return np.ascontiguousarray(padded.reshape(R, 4, 32, C, 4).transpose(0, 3, 2, 1, 4)).reshape(-1)
    f = s.view(np.float32)
    if layout == Layout.BLOCK_1X128:
        return np.ascontiguousarray(f.T)
    out = np.zeros((rows, -(-kgroups // 4) * 4), np.float32)
    out[:, :kgroups] = f
    return out
