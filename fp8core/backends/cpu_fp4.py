"""The CPU reference for FP4 (docs/numerics.md, "FP4: E2M1 elements, NVFP4 and MXFP4"), vectorised in NumPy.

Every function quantizes **the operand** ``[R, C]``: x ``[M, K]`` itself (rowwise) or x^T ``[K, M]``
(columnwise), whose rows hold the blocks (16 elements for NVFP4, 32 for MXFP4, along C). The work is done in x's
own layout, in tiles on cpu's thread pool (see "blocks in x's layout" below); nothing depends on the tiling:
maxima are exact, the rest is elementwise or keyed by the element's own place (stochastic rounding's random bytes
come from Philox4x32-10 keyed by (seed, block number, offset), not from a stream), so the bytes are the same
however the work is split. Every public function runs in the IEEE default floating-point environment
(fp8core._fpenv.ieee).

Arrays are NumPy arrays in their logical dtype; E2M1 codes are uint8, one code a byte until packed (two a byte,
element 2j in the low nibble: ``formats.E2M1.pack``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import formats
from .._caches import cached
from .._fpenv import ieee
from .._views import Tensor, logical_numpy_dtype
from .cpu import CANONICAL_NAN, FLT_MAX, amax, map_spans, satfinite_cast
from .cpu_blocks import e8m0_factor, e8m0_floor, e8m0_rceil, f32_bits, gemm_scale as mx_gemm_scale, magnitudes

E2M1 = formats.E2M1
E4M3 = formats.E4M3  # NVFP4's block scales
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
SPAN = 1 << 16  # elements of x per tile (at least one row, or 16 where blocks run down columns): temporaries ~256 KiB

_F32_INF = np.uint32(0x7F800000)
_F32_NAN = np.uint32(0x7FFFFFFF)
_LOW15 = np.array(0x7FFF, np.uint32)
_UINT = {2: np.uint16, 4: np.uint32}
_LOW = {2: np.uint16(0x7FFF), 4: np.uint32(0x7FFFFFFF)}  # |x| as a bit pattern
_FIFTEEN = np.array(15, np.uint32)
_ONE_SIXTH = np.float32(1.0 / 6.0)  # 0x3E2AAAAB, rounded once
_NVFP4_RANGE = np.float32(E4M3.max * E2M1.max)  # 2688, exact


# ---- E2M1 ---------------------------------------------------------------------------------------------------

def e2m1_thresholds() -> np.ndarray:
    """uint32 patterns T (ascending) with ``code(|y|) = #{T_i < bits(|y|)}``: between neighbouring values v_i and
    v_i+1 of the row the midpoint goes to the even code, so T_i is the midpoint's pattern where i is even (ties
    stay at i) and one below it where i is odd (ties go up to i + 1). NaN's pattern is above all: code 7."""
    v = E2M1.values[:1 << (E2M1.bits - 1)].astype(np.float32)
    mid = ((v[:-1] + v[1:]) / np.float32(2)).view(np.uint32)  # exact: a few significant bits each
    return mid - (np.arange(mid.size) % 2).astype(np.uint32)


@cached("cpu_fp4.e2m1_table")
@ieee
def e2m1_table() -> np.ndarray:
    """E2M1(y) for the 2^17 fp32 classes of :func:`e2m1_index` (read only). A threshold is a value of at most 3
    significant bits, or one pattern below it, so the cast depends on the top 16 bits of y and on whether any of
    its low 16 bits is set: each index stands for its class exactly."""
    idx = np.arange(1 << 17, dtype=np.uint32)
    bits = np.left_shift(np.right_shift(idx, 1), 16) | np.bitwise_and(idx, 1)
    mag = bits & _F32_NAN
    codes = np.searchsorted(e2m1_thresholds(), mag, side="left").astype(np.uint8)
    sign = (bits >> 31).astype(np.uint8) & (mag <= _F32_INF)  # a NaN of either sign is +6 (0x7)
    table = codes | (sign << 3)
    table.flags.writeable = False
    return table


def e2m1_index(y: np.ndarray, dtype: Any = np.uint32) -> np.ndarray:
    """(top 16 bits of each fp32 value << 1) | (any of its low 16 bits set), in ``dtype`` (uint32, or intp for a
    lookup: the last shift then writes the wide index itself, where a separate widening pass cost a quarter of the
    cast): the table's index."""
    bits = y.view(np.uint32)
    low = np.bitwise_and(bits, _LOW15)
    np.add(low, _LOW15, out=low)  # bit 15 set iff any of bits 14..0 was
    np.bitwise_or(low, bits, out=low)
    return np.right_shift(low, _FIFTEEN, out=low if dtype == np.uint32 else np.empty(low.shape, dtype))


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """E2M1(y): fp32 -> codes (uint8, one a byte, y's shape), round to nearest even, satfinite, NaN -> 0x7."""
    return _codes(np.ascontiguousarray(y, np.float32))


@cached("cpu_fp4.e2m1_f32")
def e2m1_f32() -> np.ndarray:
    """fp32 value of each of the 16 codes (read only)."""
    v = E2M1.values.astype(np.float32)
    v.flags.writeable = False
    return v


_SR_SCALE = np.array([512, 256, 128], np.float32)  # 256 / step for |y| in [0, 2), [2, 4), [4, 6)


@ieee
def e2m1_stochastic(y: np.ndarray, r: np.ndarray) -> np.ndarray:
    """SR(y, r): fp32 values and one random byte each (uint8, y's shape) -> codes. |y| >= 6 and inf give 6, NaN
    0x7, the sign is kept. Below 6, with step 0.5, 1, 2 on [0, 2), [2, 4), [4, 6): n = |y| * 256 / step (exact, a
    power-of-two scaling) truncated, so n >> 8 is lo in steps and n & 255 is f8, the 8 bits below the step; the
    magnitude goes up a step where f8 + r >= 256. The code is then the step count plus 0, 2 or 4 (E2M1's steps
    are 0.5 up to 2, then 1 up to 4, then 2)."""
    y = np.ascontiguousarray(y, np.float32)
    bits = y.view(np.uint32)
    a = np.abs(y)
    inside = a < np.float32(E2M1.max)  # False for NaN too
    a = np.where(inside, a, np.float32(0))
    binade = (a >= np.float32(2)).view(np.uint8) + (a >= np.float32(4)).view(np.uint8)
    n = (a * _SR_SCALE.take(binade)).astype(np.int32)
    steps = (n >> 8) + (((n & 255) + np.asarray(r, np.uint8)) >> 8)
    sign = np.left_shift(np.right_shift(bits, 31).astype(np.uint8), 3)
    codes = np.where(inside, (steps + 2 * binade).astype(np.uint8), np.uint8(E2M1.max_code)) | sign
    codes[np.isnan(y)] = E2M1.nan_cast  # either sign
    return codes


# ---- Philox4x32-10: the stochastic rounding's random bytes ------------------------------------------------

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LO32 = np.uint64(0xFFFFFFFF)
_M0, _M1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
_32 = np.uint64(32)


def philox4x32_10(counter: tuple[Any, Any, Any, Any], key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Random123, curand) of counters (c0, c1, c2, c3) (uint32 values, arrays broadcasting together)
    and key (k0, k1): four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in counter)
    k0, k1 = int(key[0]), int(key[1])
    for i in range(10):
        if i:
            k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
        p0, p1 = c0 * _M0, c2 * _M1  # products of 32-bit numbers: exact in 64 bits
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ np.uint64(k0), p1 & _LO32, (p0 >> _32) ^ c3 ^ np.uint64(k1), p0 & _LO32
    return tuple(np.asarray(c, np.uint32) for c in (c0, c1, c2, c3))


def block_bytes(g: np.ndarray, seed: int, offset: int) -> np.ndarray:
    """The 16 random bytes of each block number g (uint64 array) -> uint8 [*g.shape, 16]: byte j is bits
    8*(j & 3) .. of W[j >> 2], W = Philox4x32_10((g lo, g hi, offset lo, offset hi), (seed lo, seed hi))."""
    g = np.asarray(g, np.uint64)
    w = philox4x32_10((g & _LO32, g >> _32, offset & 0xFFFFFFFF, offset >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    words = np.empty((*g.shape, 4), "<u4")
    for j, wj in enumerate(w):
        words[..., j] = wj
    return words.view(np.uint8)


def state_seed_offset(words: np.ndarray, offset: int) -> tuple[int, int]:
    """(seed, state's offset + offset mod 2**64) of a random state in memory (int64/uint64 [2] or uint32 [4]),
    read as the kernel reads it: four little-endian u32 words (seed lo, seed hi, offset lo, offset hi)."""
    w = [int(v) for v in np.ascontiguousarray(words).reshape(-1).view("<u4")]
    return w[0] | w[1] << 32, ((w[2] | w[3] << 32) + offset) % (1 << 64)


# ---- blocks in x's layout ----------------------------------------------------------------------------------
# The work is done in x's own layout [M, K], whichever the operand: a rowwise block is 16 (32) consecutive
# elements of a row of x, a columnwise one 16 (32) consecutive elements of a column of x. Viewed as [A, b, B], the
# b positions of every block are the middle axis: rowwise [M * K / b, b, 1], columnwise [M / b, b, K]. Reductions
# and the transform then run over b slices of [A, B] (contiguous rows of K columnwise), never a short last axis;
# only the finished bytes of a columnwise operand are transposed, as 8-byte words (16 elements a word).

def _positions(t: np.ndarray, b: int, columnwise: bool) -> np.ndarray:
    """t [s, K] (s a multiple of b columnwise) as [A, b, B]: the b elements of each block along axis 1."""
    s, k = t.shape
    return t.reshape(s // b, b, k) if columnwise else t.reshape(s * k // b, b, 1)


def _fold(v: np.ndarray, copy: bool) -> np.ndarray:
    """max over axis 1 of [A, b, B] (b a power of two) as [A, B]: the halves of axis 1 folded onto each other,
    log2(b) elementwise maxima over rows of B; in place unless ``copy``."""
    b = v.shape[1]
    while b > 1:
        b //= 2
        v = np.maximum(v[:, :b], v[:, b:2 * b], out=None if copy else v[:, :b])
        copy = False
    return v[:, 0]


def _max_over_positions(v: np.ndarray) -> np.ndarray:
    """max over axis 1 of an [A, b, B] integer array (b a power of two), as [A, B], by folding halves (a reduction
    over a short axis pays NumPy's per-row set-up for every block). Rowwise blocks ([A, b, 1], contiguous) are
    first made position-major, where folding runs over long rows: b strided [A] slices would each sweep the whole
    tile. That transposition moves 8-byte words of 8 / itemsize positions first (cheaper per byte than 2- or
    4-byte elements), folds those, then transposes the [A, 8 / itemsize] maxima left."""
    a, b, n = v.shape
    if n != 1:
        return _fold(v, True)
    per = 8 // v.itemsize
    words = np.ascontiguousarray(v.reshape(a, b).view(np.uint64).T)  # [b / per, A]: word j holds positions of j
    m = _fold(words.view(v.dtype).reshape(1, b // per, a * per), False).reshape(a, per)
    return _fold(np.ascontiguousarray(m.T).reshape(1, per, a), False).reshape(a, 1)


def block_amax_bits(t: np.ndarray, b: int, columnwise: bool, tiles: bool) -> np.ndarray:
    """The amax of every block of t [s, K] (x's layout) as fp32 bits, in x's block grid: [s, K/b] (rowwise),
    [s/b, K] (columnwise), or [ceil(s/16), K/16] for 16x16 tiles (the last one partial when s % 16)."""
    mag = magnitudes(t)
    s, k = t.shape
    if not tiles:
        m = _max_over_positions(_positions(mag, b, columnwise))
        return f32_bits(m if columnwise else m.reshape(s, k // b), t.dtype)
    whole = s // b * b
    rows = mag[:whole].reshape(whole // b, b, k).max(axis=1)  # a tile's 16 rows: reduced over contiguous rows
    if whole < s:
        rows = np.concatenate([rows, mag[whole:].max(axis=0, keepdims=True)])
    return f32_bits(_max_over_positions(_positions(rows, b, False)).reshape(rows.shape[0], k // b), t.dtype)


def _scaled(t: np.ndarray, e: np.ndarray, b: int, columnwise: bool, tiles: bool) -> np.ndarray:
    """fp32(t) *rn e[its block], [s, K]; e in x's block grid (:func:`block_amax_bits`)."""
    y = t.astype(np.float32)  # exact; on a tile ml_dtypes' bf16 widening is a third of a shift's time
    s, k = t.shape
    if columnwise and not tiles:
        y.reshape(s // b, b, k)[...] *= e[:, None, :]
        return y
    # Rowwise and 16x16 tiles (either operand: x's tiles), each block's multiplier is first spread over its b
    # columns: a broadcast over b-element rows pays NumPy's per-row set-up for every block
    f = np.repeat(e, b, axis=1)
    if not tiles:
        y *= f
    elif s % b == 0:
        y.reshape(s // b, b, k)[...] *= f[:, None, :]
    else:  # a partial last tile: each row its tile's multipliers
        y *= np.repeat(f, b, axis=0)[:s]
    return y


def _codes(y: np.ndarray) -> np.ndarray:
    """E2M1(y), uint8 codes of fp32 values (contiguous). The index is intp for the lookup: take's own conversion
    of uint32 indices cost 3-4x the widening and the lookup together."""
    return e2m1_table().take(e2m1_index(y, np.intp), mode="clip")


def _pack_rows(codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out [s, C/2] (new when None) = codes [s, C] (each < 16) packed along rows: E2M1.pack's layout, element 2j
    in the low nibble, read as little-endian pairs (byte 2j + (byte 2j+1 << 8)) folded by one shift: a third of
    pack's passes."""
    if out is None:
        out = np.empty((codes.shape[0], codes.shape[1] // 2), np.uint8)
    if not E2M1.low_nibble_first:
        out[...] = E2M1.pack(codes)
        return out
    pairs = np.ascontiguousarray(codes).view("<u2")
    folded = np.right_shift(pairs, np.uint16(4))
    out[...] = np.bitwise_or(pairs, folded, out=folded)  # the low byte of each pair: the assignment casts
    return out


def _pack_columns(codes: np.ndarray, out: np.ndarray) -> None:
    """out [s/16, K, 8] = codes [s, K] (s a multiple of 16) packed down the columns, row 2j in the low nibble:
    out[t, k] holds rows 16t .. 16t+15 of column k, the 8 bytes of the transposed operand's row k from byte 8t
    on. Written in place. Byte j of each 8 lands 8 bytes from the next column's, so the transposition left to
    do moves 8-byte words (:func:`_words_transposed`): a byte transpose of the packed operand took as long as
    the packing and the E2M1 lookup together."""
    s, k = codes.shape
    pairs = codes.reshape(s // NVFP4_BLOCK, NVFP4_BLOCK // 2, 2, k)
    lo, hi = (pairs[:, :, 0], pairs[:, :, 1]) if E2M1.low_nibble_first else (pairs[:, :, 1], pairs[:, :, 0])
    np.bitwise_or(np.left_shift(hi, 4, dtype=np.uint8), lo, out=out.transpose(0, 2, 1))


def _words_transposed(packed: np.ndarray) -> np.ndarray:
    """The transposed operand [K, s/2] (uint8) of :func:`_pack_columns`' bytes [s/16, K, 8], by moving 8-byte
    words ([s/16, K] -> [K, s/16]); none to move when s is 16 (NVFP4's position-major Hadamard blocks)."""
    t, k, _ = packed.shape
    words = packed.view(np.uint64).reshape(t, k)
    return np.ascontiguousarray(words.T).view(np.uint8).reshape(k, 8 * t)


def _random_bytes(tile: tuple[int, int, int, int], shape: tuple[int, int], columnwise: bool, seed: int,
                  offset: int) -> np.ndarray:
    """The SR bytes of the tile (m0, m1, k0, k1) of x [M, K] = ``shape``, in x's layout: block g = operand row *
    (C / 16) + its index in the row (rowwise: row m, block k // 16 of C = K; columnwise: row k, block m // 16
    of C = M)."""
    (m0, m1, k0, k1), (m, k), b = tile, shape, NVFP4_BLOCK
    if not columnwise:  # rowwise tiles are whole rows
        g = np.arange(m0, m1, dtype=np.uint64)[:, None] * np.uint64(k // b) + np.arange(k // b, dtype=np.uint64)
        return block_bytes(g, seed, offset).reshape(m1 - m0, k)
    g = np.arange(k0, k1, dtype=np.uint64)[None, :] * np.uint64(m // b) + \
        np.arange(m0 // b, m1 // b, dtype=np.uint64)[:, None]
    return np.ascontiguousarray(block_bytes(g, seed, offset).transpose(0, 2, 1)).reshape(m1 - m0, k1 - k0)


def _tiles(m: int, k: int, step: int, columnwise: bool) -> list[tuple[int, int, int, int]]:
    """(m0, m1, k0, k1) covering x [M, K], about SPAN elements each: whole rows (``step`` of them at least)
    rowwise; columnwise, ``step`` rows or more by as many columns (multiples of 64) as fit, so a tall operand of
    few rows (NVFP4's position-major blocks, [16, n]) is split too."""
    if m == 0 or k == 0:
        return []
    rows = max(1, SPAN // k // step) * step
    cols = k if not columnwise or rows * k <= SPAN else max(64, SPAN // rows // 64 * 64)
    return [(m0, min(m0 + rows, m), k0, min(k0 + cols, k)) for m0 in range(0, m, rows) for k0 in range(0, k, cols)]


def _quantize(x: np.ndarray, b: int, columnwise: bool, tiles: bool, rule: Callable[[np.ndarray], tuple] | None,
              sr: tuple[int, int] | None, known: tuple[np.ndarray, np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """(packed [R, C/2], stored scales) of the operand of x [M, K] (x or x^T): each block's amax bits through
    ``rule`` -> (stored bytes, fp32 multiplier); q = E2M1(fp32(x) *rn multiplier), or SR with ``sr`` = (seed,
    offset). Tiles of x (:func:`_tiles`) on cpu's pool; scales [R, C/b], or [ceil(R/16), C/16] with ``tiles``.
    ``known``: (stored bytes, multipliers) of x's whole block grid already (the transform's pass took the block
    maxima), in place of ``rule``."""
    m, k = x.shape
    grid = (-(-m // b), k // b) if tiles else ((m // b, k) if columnwise else (m, k // b))
    stored = np.empty(grid, np.uint8) if known is None else known[0]
    packed = np.empty((m // NVFP4_BLOCK, k, 8) if columnwise else (m, k // 2), np.uint8)
    step = b if columnwise or tiles else 1
    todo = _tiles(m, k, step, columnwise)

    def work(i0: int, i1: int) -> None:
        for m0, m1, k0, k1 in todo[i0:i1]:
            t = x[m0:m1, k0:k1]
            with np.errstate(all="ignore"):  # here too: the pool's threads do not see the caller's errstate
                g0, c0 = m0 // step, (k0 // b if tiles else k0)
                if known is None:
                    codes, e = rule(block_amax_bits(t, b, columnwise, tiles))
                    stored[g0:g0 + codes.shape[0], c0:c0 + codes.shape[1]] = codes
                else:
                    e = known[1][g0:m1 // step, c0:k1]
                y = _scaled(t, e, b, columnwise, tiles)
                q = _codes(y) if sr is None else \
                    e2m1_stochastic(y, _random_bytes((m0, m1, k0, k1), (m, k), columnwise, *sr))
                if columnwise:
                    _pack_columns(q, packed[m0 // NVFP4_BLOCK:m1 // NVFP4_BLOCK, k0:k1])
                else:
                    _pack_rows(q, packed[m0:m1])

    map_spans(len(todo), 1, work)
    if not columnwise:
        return packed, stored
    return _words_transposed(packed), np.ascontiguousarray(stored.T)


# ---- the random Hadamard transform ------------------------------------------------------------------------
# One pass over x transforms every block into the operand's values (x's dtype) and takes their block maxima; the
# global amax is then the maximum of those, the scale rule runs once over the whole block grid, and _quantize
# reads the transformed values back with the scales known: x and the transformed tensor are each read once.

# TE's get_wgrad_sign_vector: bit i of 0xD7E8 set where S_i = -1
HADAMARD_SIGN_MASK = 0xD7E8
HADAMARD_SIGNS = tuple(-1 if HADAMARD_SIGN_MASK >> i & 1 else 1 for i in range(NVFP4_BLOCK))
_QUARTER = np.float32(0.25)


@cached("cpu_fp4.sign_bits")
def _sign_bits() -> dict[int, np.ndarray]:
    """{itemsize: the sign bit where S_i = -1, else 0, as [1, 16, 1] uint16 or uint32} (read only): S_i * x_i is
    exact, so it is x_i with its sign bit flipped."""
    out = {}
    for size, kind in ((2, np.uint16), (4, np.uint32)):
        bits = np.array([1 << (8 * size - 1) if si < 0 else 0 for si in HADAMARD_SIGNS], kind).reshape(1, -1, 1)
        bits.flags.writeable = False
        out[size] = bits
    return out


def _rht(src: np.ndarray, dst: np.ndarray, scratch: np.ndarray) -> None:
    """dst [A, 16, B] (float32/bfloat16/float16) = the transform of the blocks whose 16 positions are the middle
    axis of src [A, 16, B] (dst's dtype, or float32 holding it exactly): v = S * fp32(x) (sign bits flipped:
    exact), the fp32 butterfly for h = 1, 2, 4, 8, then ROUND_TO(dst's dtype, v *rn 0.25). scratch: float32, at
    least 2 * src.size elements, reused from tile to tile. A stage is two calls: positions i with i & h == 0 are
    [:, :, 0] of the view [A, 16 / 2h, 2, h, B], their partners i + h are [:, :, 1], and (v_i, v_i+h) =
    (v_i +rn v_i+h, v_i -rn v_i+h) goes into the other buffer. NumPy's warnings must be off (inf - inf is a value
    here)."""
    a, _, b = src.shape
    n = src.size
    v, w = scratch[:n].reshape(src.shape), scratch[n:2 * n].reshape(src.shape)
    if src.itemsize == 4:
        np.bitwise_xor(src.view(np.uint32), _sign_bits()[4], out=v.view(np.uint32))
    else:
        flipped = np.bitwise_xor(src.view(np.uint16), _sign_bits()[2],
                                 out=v.reshape(-1).view(np.uint16)[:n].reshape(src.shape))
        v = flipped.view(src.dtype).astype(np.float32)  # exact; a copyto into the scratch took twice as long
    for h in (1, 2, 4, 8):
        pairs, into = v.reshape(a, NVFP4_BLOCK // (2 * h), 2, h, b), w.reshape(a, NVFP4_BLOCK // (2 * h), 2, h, b)
        np.add(pairs[:, :, 0], pairs[:, :, 1], out=into[:, :, 0])
        np.subtract(pairs[:, :, 0], pairs[:, :, 1], out=into[:, :, 1])
        v, w = w, v
    # one call: the fp32 product, rounded to dst's dtype (RTNE) by the ufunc's own output cast (a separate
    # multiply and copyto wrote and read the fp32 products once more)
    np.multiply(v, _QUARTER, out=dst, casting="unsafe")


def _transformed(x: np.ndarray, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """(transformed operand blocks, their maxima as fp32 bits) of x [M, K], in x's dtype: columnwise, x's layout
    [M, K] with maxima [M/16, K]; rowwise, position-major [16, M * K / 16] (column j is block j of x's rows in
    order: x's block numbers), whose columnwise operand is the rowwise one's blocks, one a row, with maxima
    [1, M * K / 16]. Tiles of x on cpu's pool."""
    m, k = x.shape
    n = m * k // NVFP4_BLOCK
    out = np.empty(x.shape if columnwise else (NVFP4_BLOCK, n), x.dtype)
    maxima = np.empty((m // NVFP4_BLOCK, k) if columnwise else (1, n), np.uint32)
    todo = _tiles(m, k, NVFP4_BLOCK if columnwise else 1, columnwise)
    per = k // NVFP4_BLOCK

    def work(i0: int, i1: int) -> None:
        scratch = None
        for m0, m1, k0, k1 in todo[i0:i1]:
            if columnwise:
                src = x[m0:m1, k0:k1].reshape(-1, NVFP4_BLOCK, k1 - k0)
                dst = out[m0:m1, k0:k1].reshape(src.shape)
                top = maxima[m0 // NVFP4_BLOCK:m1 // NVFP4_BLOCK, k0:k1]
            else:  # the tile's blocks position-major, widened first: the sign flip's copy then gathers 4-byte words
                src = x[m0:m1].astype(np.float32).reshape(-1, NVFP4_BLOCK).T[None]
                dst = out[None, :, m0 * per:m1 * per]
                top = maxima[:, m0 * per:m1 * per]
            if scratch is None:
                scratch = np.empty(2 * src.size, np.float32)
            with np.errstate(all="ignore"):  # the pool's threads do not see the caller's errstate
                _rht(src, dst, scratch)
                uint = _UINT[x.itemsize]  # |x'| patterns into the scratch, folded there: the block maxima
                mag = np.bitwise_and(dst.view(uint), _LOW[x.itemsize],
                                     out=scratch[:src.size].view(uint)[:src.size].reshape(src.shape))
                top[...] = f32_bits(_fold(mag, False), x.dtype)

    map_spans(len(todo), 1, work)
    return out, maxima


def hadamard16(t: np.ndarray, columnwise: bool) -> np.ndarray:
    """The RHT of every 16-element block of t [s, K] (x's layout; blocks along rows, or down the columns when
    ``columnwise``): v = S * fp32(x), the fp32 butterfly for h = 1, 2, 4, 8, then ROUND_TO(t.dtype, v *rn 0.25).
    Same shape and dtype as t. S_i * x_i is a sign-bit flip, so a NaN input's sign is flipped where S_i = -1 (a
    NaN's sign is no value of the contract; every block holding one quantizes to NaN's codes)."""
    out, _ = _transformed(t, columnwise)
    if columnwise:
        return out
    rows = np.empty(t.shape, t.dtype)
    rows.reshape(-1, NVFP4_BLOCK)[...] = out.T
    return rows


# ---- NVFP4 ----------------------------------------------------------------------------------------------

@ieee
def global_scales(g: Any) -> tuple[np.float32, np.float32]:
    """(S_enc, S_dec) of a global amax G (fp32): S_enc = 2688 /rn G, FLT_MAX where that is inf, 1.0 where G is 0,
    inf or NaN; S_dec = 1 /rn S_enc."""
    g = np.float32(np.asarray(g, np.float32).reshape(-1)[0])
    with np.errstate(all="ignore"):
        if g == 0 or not np.isfinite(g):
            s_enc = np.float32(1)
        else:
            s_enc = np.float32(np.divide(_NVFP4_RANGE, g, dtype=np.float32))
            if np.isinf(s_enc):
                s_enc = FLT_MAX
        return s_enc, np.float32(np.divide(np.float32(1), s_enc, dtype=np.float32))


@ieee
def gemm_alpha(amax_a: Tensor, amax_b: Tensor) -> np.ndarray:
    """float32 [2]: (alpha, beta) = (S_dec_a *rn S_dec_b, 0), each S_dec from its operand's global amax (float32,
    1 element) by the global scale rule; beta is there because cuBLASLt's device pointer mode reads both."""
    with np.errstate(all="ignore"):
        alpha = np.float32(global_scales(amax_a.data)[1] * global_scales(amax_b.data)[1])
    return np.array([alpha, 0], np.float32)


@cached("cpu_fp4.e4m3_f32")
def _e4m3_f32() -> np.ndarray:
    """fp32 value of each of the 256 E4M3 codes (exact; NaN codes NaN; read only)."""
    v = np.arange(256, dtype=np.uint8).view(E4M3.numpy_dtype).astype(np.float32)
    v.flags.writeable = False
    return v


def nvfp4_block_scales(amax_bits: np.ndarray, s_enc: np.float32, s_dec: np.float32
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(s_b as E4M3 codes uint8, e_b fp32) of each block amax (fp32 bits): d_b = amax_b *rn (S_enc *rn fp32(1/6)),
    s_b = SATFINITE_RTNE_E4M3(d_b), e_b = 1 /rn (fp32(s_b) *rn S_dec) with inf -> FLT_MAX (NaN stays).
    NumPy's warnings must be off."""
    d = amax_bits.view(np.float32) * np.float32(s_enc * _ONE_SIXTH)
    codes = satfinite_cast(d, E4M3)  # >= 448 and inf saturate, NaN is 0x7F
    # e_b depends on s_b alone under one S_dec: computed for the 256 codes, then looked up
    e = np.divide(np.float32(1), _e4m3_f32() * s_dec, dtype=np.float32)
    e[np.isinf(e)] = FLT_MAX
    return codes, e.take(codes)


@ieee
def quantize_nvfp4(x: Tensor, weight_2d: bool, hadamard: bool, stochastic: bool, seed: int, offset: int,
                   rng_state: Tensor | None, global_amax: np.ndarray | None, columnwise: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> (data uint8 [R, C/2], scale float8_e4m3fn [R, C/16] or [ceil(R/16), C/16], global amax
    float32 [1]) for the operand [R, C] (x, or x^T when columnwise); global_amax: the caller's fp32 G or None.
    rng_state: None (seed and offset by value) or the caller's state in memory (:func:`state_seed_offset`: its
    seed, its offset + ``offset``)."""
    if stochastic and rng_state is not None:
        seed, offset = state_seed_offset(rng_state.data, offset)
    m, k = x.data.shape
    sr = (seed, offset) if stochastic else None
    given = None if global_amax is None else np.asarray(global_amax, np.float32).reshape(1).copy()
    if not hadamard:
        g = amax(x) if given is None else given
        s_enc, s_dec = global_scales(g)
        packed, scales = _quantize(x.data, NVFP4_BLOCK, columnwise, weight_2d,
                                   lambda bits: nvfp4_block_scales(bits, s_enc, s_dec), sr)
        return packed, scales.view(E4M3.numpy_dtype), g
    data, maxima = _transformed(x.data, columnwise)
    # the transformed tensor's amax (NaN canonical, empty 0) is the largest of its block maxima
    g = given if given is not None else np.array([maxima.max() if maxima.size else 0], np.uint32).view(np.float32)
    s_enc, s_dec = global_scales(g)
    # Rowwise, the transform left x's blocks position-major: its columnwise operand is x's blocks, one a row
    packed, scales = _quantize(data, NVFP4_BLOCK, True, False, None, sr, nvfp4_block_scales(maxima, s_enc, s_dec))
    if not columnwise:
        packed, scales = packed.reshape(m, k // 2), scales.reshape(m, k // NVFP4_BLOCK)
    return packed, scales.view(E4M3.numpy_dtype), g


@ieee
def dequantize_nvfp4(data: Tensor, scale: Tensor, global_amax: np.ndarray, out_dtype: str) -> np.ndarray:
    """y = ROUND_TO(out_dtype, (fp32(q) * fp32(s_b)) *rn S_dec), [R, C] from data [R, C/2]; scale [R, C/16] or
    16x16 tiles [ceil(R/16), C/16]; S_dec from global_amax by the global scale rule; NaN canonical."""
    q = data.data.view(np.uint8)
    rows, cols = q.shape[0], 2 * q.shape[1]
    s = _e4m3_f32().take(scale.data.view(np.uint8))
    if s.shape[0] != rows:
        s = np.repeat(s, NVFP4_BLOCK, axis=0)[:rows]
    _, s_dec = global_scales(global_amax)
    def scaled(y: np.ndarray) -> None:  # (fp32(q) *rn fp32(s_b)) *rn S_dec
        np.multiply(y, s[:, :, None], out=y)
        np.multiply(y, s_dec, out=y)

    return _widen(q, rows, cols, NVFP4_BLOCK, scaled, out_dtype)


@cached("cpu_fp4.e2m1_pairs")
def _e2m1_pairs() -> np.ndarray:
    """The fp32 values of the two codes of each byte, in E2M1.pack's order, as one 8-byte word per byte value:
    [256] (read only). One lookup a byte widens both codes (an unpack and a lookup a code cost 3x as much)."""
    pairs = np.ascontiguousarray(e2m1_f32().take(E2M1.unpack(np.arange(256, dtype=np.uint8)[:, None])))
    words = pairs.view(np.uint64).reshape(256)
    words.flags.writeable = False
    return words


def _widen(q: np.ndarray, rows: int, cols: int, block: int, scaled: Callable[[np.ndarray], object],
           out_dtype: str) -> np.ndarray:
    """ROUND_TO(out_dtype, fp32 values [R, C/block, block] of the codes, through ``scaled`` (in place)), NaN
    canonical."""
    with np.errstate(all="ignore"):
        y = _e2m1_pairs().take(q).view(np.float32).reshape(rows, cols // block, block)
        scaled(y)
        y = y.reshape(rows, cols)
        out = y if out_dtype == "float32" else y.astype(logical_numpy_dtype(out_dtype))
    if np.isnan(y.max(initial=0.0)):  # max passes NaN on: one reduction where there is none to mend
        storage, nan = CANONICAL_NAN[out_dtype]
        out.view(storage)[np.isnan(y)] = nan
    return out


# ---- MXFP4 ----------------------------------------------------------------------------------------------

@ieee
def quantize_mxfp4(x: Tensor, mode: str, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> (data uint8 [R, C/2], scale E8M0 [R, C/32]) for the operand [R, C] (x or x^T); mode "rceil" or
    "floor" (MXFP8's rules with fp_max 6, emax 2); q = E2M1(fp32(x) *rn 2^(127 - e)), a NaN block all 0x7."""
    scale_rule = e8m0_rceil if mode == "rceil" else e8m0_floor

    def rule(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        e = scale_rule(bits, E2M1)
        return e, e8m0_factor(e, -1)  # the NaN byte's factor is NaN

    packed, scales = _quantize(x.data, MXFP4_BLOCK, columnwise, False, rule, None)
    return packed, scales.view(formats.E8M0.numpy_dtype)


@ieee
def dequantize_mxfp4(data: Tensor, scale: Tensor, out_dtype: str) -> np.ndarray:
    """y = ROUND_TO(out_dtype, fp32(q) *rn 2^(e - 127)), [R, C] from data [R, C/2] and scale [R, C/32]."""
    q = data.data.view(np.uint8)
    rows, cols = q.shape[0], 2 * q.shape[1]
    f = e8m0_factor(scale.data.view(np.uint8), 1)
    return _widen(q, rows, cols, MXFP4_BLOCK, lambda y: np.multiply(y, f[:, :, None], out=y), out_dtype)


# ---- the GEMM emulation ------------------------------------------------------------------------------------

@cached("cpu_fp4.e2m1_f64")
def _e2m1_f64() -> np.ndarray:
    v = E2M1.values.astype(np.float64)
    v.flags.writeable = False
    return v


def _operand64(data: Tensor, scale: Tensor, block: int, nvfp4: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes as float64 [R, K], block factors float64 [R, K / block]) of one operand: E4M3 scales (16x16 tiles
    expanded to their rows) or E8M0 2^(e - 127), NaN bytes NaN; every value exact."""
    q = _e2m1_f64().take(E2M1.unpack(data.data.view(np.uint8)))
    s = scale.data.view(np.uint8)
    if nvfp4:
        f = _e4m3_f32().take(s).astype(np.float64)
        if f.shape[0] != q.shape[0]:
            f = np.repeat(f, NVFP4_BLOCK, axis=0)[:q.shape[0]]
    else:
        f = formats.E8M0.values.take(s)
    return q, f


@ieee
def gemm(spec: Any, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
         global_amaxes: tuple[Tensor, Tensor] | None, bias: Tensor | None) -> np.ndarray:
    """The FP4 GEMM's exact-input emulation, TN (both operands' blocks along K): D[m, n] = alpha * sum over
    K-blocks kb of s_a[m, kb] * s_b[n, kb] * (sum over k in kb of q_a * q_b) (+ bias[n]), a [M, K/2] and b [N, K/2]
    packed, their scales as quantized (16x16 tiles too); global_amaxes (NVFP4: each operand's, alpha from them by
    :func:`gemm_alpha`) or None (MXFP4, alpha 1); spec: fp8core.gemm.GemmSpec (out_dtype). Each K-block's sum and
    its product with the two factors are exact in float64 (E2M1 products are multiples of 1/4 below 36, the
    factors powers of two or E4M3 values); the sum over K-blocks is float64's, then times alpha, rounded once to
    fp32 and cast to out_dtype (RTNE). The GPU's fp32 accumulation is compared with tolerances that grow with K."""
    nvfp4 = global_amaxes is not None
    alpha = gemm_alpha(*global_amaxes)[0] if nvfp4 else np.float32(1)
    out_dtype = spec.out_dtype
    block = NVFP4_BLOCK if nvfp4 else MXFP4_BLOCK
    qa, fa = _operand64(a, a_scale, block, nvfp4)
    qb, fb = _operand64(b, b_scale, block, nvfp4)
    m, k = qa.shape
    n = qb.shape[0]
    d = np.zeros((m, n), np.float64)
    with np.errstate(all="ignore"):
        for kb in range(k // block):
            ks = slice(kb * block, (kb + 1) * block)
            d += (qa[:, ks] @ qb[:, ks].T) * fa[:, kb:kb + 1] * fb[:, kb]
        d *= np.float64(alpha)
        if bias is not None:
            d += bias.data.astype(np.float64)
        d32 = d.astype(np.float32)
    out = d32 if out_dtype == "float32" else d32.astype(logical_numpy_dtype(out_dtype))
    storage, nan = CANONICAL_NAN[out_dtype]
    out.view(storage)[np.isnan(d32)] = nan
    return out


# ---- the scale layout cuBLASLt reads ----------------------------------------------------------------------

def gemm_scale(scale: Tensor, rows: int) -> np.ndarray:
    """An FP4 operand's scale bytes (E4M3 or E8M0, [rows or 16-row tiles, K-blocks]) in cuBLASLt's 128x4 tiles,
    flat uint8: 16x16 tiles first expanded to their rows (row r takes tile r // 16), then laid out as MXFP8's."""
    s = scale.data.view(np.uint8)
    if s.shape[0] != rows:
        s = np.repeat(s, NVFP4_BLOCK, axis=0)[:rows]
    return mx_gemm_scale(Tensor(np.ascontiguousarray(s), "uint8", scale.device, scale.origin), "1x32")
