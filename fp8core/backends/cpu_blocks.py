"""The CPU reference for block scaling (NUMERICS.md, "Block scaling"), vectorised in NumPy.

Arrays are 2-D NumPy views ``[rows, cols]`` in their logical dtype; block amaxes are fp32 bit patterns
(unsigned order is float order, NaN canonical above inf), so every step is an exact integer or single IEEE
fp32 operation. Blocks at the edges are partial: the tensor is padded with zeros to whole blocks, which
changes no amax and no quantized value. Every public function runs in the IEEE default floating-point
environment (fp8core._fpenv.ieee), so a caller that flushes subnormals gets the contract's bits too.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._fpenv import ieee
from .._tensor import Tensor, logical_numpy_dtype
from ..formats import Format
from .cpu import _CANONICAL_NAN, _canonical_nan_fp8, _map, _quantize_table, _to_f32, scale_rule

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E8M0_NAN = 0xFF
MX_BLOCK = 32
FP32_BLOCK = 128

_F32_NAN = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)
_EMAX = {Format.E4M3: 8, Format.E5M2: 15}  # exponent of the largest power of two below fp8_max


def inv_fp8_max(fmt: Format) -> np.float32:
    """fp32(1 / fp8_max), rounded once: what rceil multiplies by."""
    return np.float32(1.0 / fmt.max)


def _padded(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """``a`` as ``[R, br, C, bc]`` whole blocks (a view when the shape allows, else a zero-padded copy)."""
    rows, cols = a.shape
    R, C = -(-rows // br), -(-cols // bc)
    if (R * br, C * bc) != (rows, cols):
        p = np.zeros((R * br, C * bc), a.dtype)
        p[:rows, :cols] = a
        a = p
    return a.reshape(R, br, C, bc)


def _unpadded(blocks: np.ndarray, rows: int, cols: int) -> np.ndarray:
    R, br, C, bc = blocks.shape
    return blocks.reshape(R * br, C * bc)[:rows, :cols]


def abs_bits(f: np.ndarray) -> np.ndarray:
    """|f| of fp32 data as uint32 patterns, NaN canonicalised to 0x7FFFFFFF (above inf)."""
    b = np.bitwise_and(f.view(np.uint32), np.uint32(0x7FFFFFFF))
    b[b > _F32_INF] = _F32_NAN
    return b


@ieee
def block_amax_bits(x: np.ndarray, br: int, bc: int) -> np.ndarray:
    """The amax of every br x bc block of ``x[rows, cols]`` as fp32 bits, ``[ceil(rows/br), ceil(cols/bc)]``.

    bf16 and fp16 reduce on their own 16-bit |x| patterns (unsigned order is their float order too, NaN above
    inf), widened once per block: no fp32 copy of the tensor.
    """
    if x.dtype == np.float32:
        return _padded(abs_bits(x), br, bc).max(axis=(1, 3))
    m = _padded(np.bitwise_and(x.view(np.uint16), np.uint16(0x7FFF)), br, bc).max(axis=(1, 3))
    if x.dtype == np.float16:
        bits = m.view(np.float16).astype(np.float32).view(np.uint32)
        bits[m > 0x7C00] = _F32_NAN
        return bits
    bits = np.left_shift(m.astype(np.uint32), 16)  # bfloat16
    bits[m > 0x7F80] = _F32_NAN
    return bits


def _highest_bit(m: np.ndarray) -> np.ndarray:
    """Position of the highest set bit of each nonzero uint32 (exact: frexp of an exactly representable int)."""
    return (np.frexp(m.astype(np.float64))[1] - 1).astype(np.int64)


@ieee
def e8m0_rceil(amax_bits: np.ndarray, fmt: Format) -> np.ndarray:
    """E8M0 scale bytes by "rceil": v = amax *rn fp32(1/fp8_max), its exponent rounded toward +inf."""
    with np.errstate(all="ignore"):
        v = amax_bits.view(np.float32) * inv_fp8_max(fmt)
    vb = v.view(np.uint32)
    exp = np.right_shift(vb, 23).astype(np.int64)  # v >= 0: no sign bit
    mant = np.bitwise_and(vb, np.uint32(0x7FFFFF))
    # v subnormal: 2^-127 (mantissa 0x400000) and below round up to 2^-127 (e = 0); above it to 2^-126 (e = 1).
    e = np.where(exp == 0, (mant > 0x400000).astype(np.int64), exp + (mant != 0))
    e = np.minimum(e, 254)  # inf (exp 255) and the top binade (would be 255) saturate
    e[np.isnan(v)] = E8M0_NAN
    return e.astype(np.uint8)


@ieee
def e8m0_floor(amax_bits: np.ndarray, fmt: Format) -> np.ndarray:
    """E8M0 scale bytes by the OCP rule: clamp(floor(log2(amax)) - emax + 127, 0, 254)."""
    exp = np.right_shift(amax_bits, 23).astype(np.int64)
    mant = np.bitwise_and(amax_bits, np.uint32(0x7FFFFF))
    log2 = np.where(exp != 0, exp - 127, np.where(mant != 0, _highest_bit(mant) - 149, 0))
    e = np.clip(log2 - _EMAX[fmt] + 127, 0, 254)
    e[amax_bits == 0] = 0
    e[amax_bits == _F32_INF] = 254
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
    f = pow2_f32(sign * (e.astype(np.int64) - 127))
    f[e == E8M0_NAN] = np.float32(np.nan)
    return f


TABLE_MIN = 1 << 18  # 16-bit inputs from this size quantize by table lookup
TABLE_MAX_SCALES = 16  # ... when their blocks use at most this many distinct scales (cpu's table cache size)


def _scaled_cast(x: np.ndarray, factor: np.ndarray, br: int, bc: int, fmt: Format) -> np.ndarray:
    """SATFINITE_RTNE(fp32(x) *rn factor[block]) into ``fmt``; x is [rows, cols], factor fp32, one per block."""
    rows, cols = x.shape
    if x.dtype.itemsize == 2 and x.size >= TABLE_MIN:
        scales = np.unique(factor.view(np.uint32))
        if scales.size <= TABLE_MAX_SCALES:
            return _table_cast(x, factor, scales, br, bc, fmt)
    blocks = _padded(_to_f32(x), br, bc)
    with np.errstate(all="ignore"):
        np.multiply(blocks, factor[:, None, :, None], out=blocks)
    fmax = np.float32(fmt.max)
    np.clip(blocks, -fmax, fmax, out=blocks)  # finite overflow and +-inf saturate; NaN passes
    q = _unpadded(blocks, rows, cols).astype(fmt.numpy_dtype)  # RTNE
    _canonical_nan_fp8(q.view(np.uint8), fmt)
    return q


def _table_cast(x: np.ndarray, factor: np.ndarray, scales: np.ndarray, br: int, bc: int, fmt: Format) -> np.ndarray:
    """The same cast for bf16/fp16 as lookups: cpu's quantize table of all 65,536 patterns for each distinct
    block scale (made by the direct path, so the bits are the same), indexed by (scale, pattern), in
    cache-sized chunks on cpu's thread pool."""
    rows, cols = x.shape
    name = "bfloat16" if x.dtype == ml_dtypes.bfloat16 else "float16"
    tables = np.concatenate([_quantize_table(name, int(s), fmt) for s in scales])
    which = np.searchsorted(scales, factor.view(np.uint32)).astype(np.intp) << 16  # [R, C]
    codes = x.view(np.uint16).reshape(-1)
    q = np.empty(rows * cols, np.uint8)

    def chunk(a: int, b: int) -> None:  # flat elements [a, b): the offsets of the rows they touch
        r0, r1 = a // cols, -(-b // cols)
        rows_which = np.repeat(which[r0 // br:-(-r1 // br)], br, axis=0)[r0 % br:r0 % br + r1 - r0]
        offs = np.repeat(rows_which, bc, axis=1)[:, :cols].reshape(-1)[a - r0 * cols:b - r0 * cols]
        np.take(tables, offs + codes[a:b], out=q[a:b])

    _map(q.size, chunk)
    return q.reshape(rows, cols).view(fmt.numpy_dtype)


def _scaled_widen(q: np.ndarray, factor: np.ndarray, br: int, bc: int, out_dtype: str) -> np.ndarray:
    """ROUND_TO(out_dtype, fp32(q) *rn factor[block]), NaN canonical."""
    rows, cols = q.shape
    blocks = _padded(q.astype(np.float32), br, bc)  # fp8 -> fp32 is exact
    with np.errstate(all="ignore"):
        np.multiply(blocks, factor[:, None, :, None], out=blocks)
    y32 = _unpadded(blocks, rows, cols)
    with np.errstate(all="ignore"):
        y = y32.astype(logical_numpy_dtype(out_dtype))
    storage, nan = _CANONICAL_NAN[out_dtype]
    y.view(storage)[np.isnan(y32)] = nan
    return y


# ---- MXFP8 ------------------------------------------------------------------------------------------------

def _mx_shape(columnwise: bool) -> tuple[int, int]:
    return (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)


@ieee
def quantize_mxfp8(x: Tensor, fmt: Format, scale_mode: str, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] -> (q [rows, cols] fmt, scale E8M0 [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    br, bc = _mx_shape(columnwise)
    bits = block_amax_bits(x.data, br, bc)
    e = e8m0_rceil(bits, fmt) if scale_mode == "rceil" else e8m0_floor(bits, fmt)
    return _scaled_cast(x.data, e8m0_factor(e, -1), br, bc, fmt), e.view(E8M0)


@ieee
def quantize_mxfp8_both(x: Tensor, fmt: Format, scale_mode: str) -> tuple[np.ndarray, ...]:
    """(q_rowwise, scale_rowwise, q_columnwise, scale_columnwise)."""
    return (*quantize_mxfp8(x, fmt, scale_mode, False), *quantize_mxfp8(x, fmt, scale_mode, True))


@ieee
def dequantize_mxfp8(q: Tensor, scale: Tensor, fmt: Format, columnwise: bool, out_dtype: str) -> np.ndarray:
    br, bc = _mx_shape(columnwise)
    return _scaled_widen(q.data.view(fmt.numpy_dtype), e8m0_factor(scale.data.view(np.uint8), 1), br, bc,
                         out_dtype)


# ---- fp32 block scales (1x128, 128x128) -------------------------------------------------------------------

@ieee
def quantize_blockwise(x: Tensor, fmt: Format, br: int, power_of_2: bool,
                       epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] -> (q, scale_inv fp32 [ceil(rows/br), ceil(cols/128)]), each block by the scale rule."""
    bits = block_amax_bits(x.data, br, FP32_BLOCK)
    amax = bits.view(np.float32)
    s, s_inv, _ = scale_rule(amax.reshape(-1), np.float32(fmt.max), 0, power_of_2, epsilon)
    q = _scaled_cast(x.data, s.reshape(amax.shape), br, FP32_BLOCK, fmt)
    return q, s_inv.reshape(amax.shape)


@ieee
def dequantize_blockwise(q: Tensor, scale_inv: Tensor, fmt: Format, br: int, out_dtype: str) -> np.ndarray:
    return _scaled_widen(q.data.view(fmt.numpy_dtype), scale_inv.data, br, FP32_BLOCK, out_dtype)


def transpose_scale(scale: Tensor) -> np.ndarray:
    """A block-scale array [a, b] as a new contiguous [b, a] (E8M0 bytes or fp32), values unchanged; always a
    copy, never a view of the input (a or b of 1 makes .T contiguous already)."""
    return np.array(scale.data.T, order="C", copy=True)


# ---- the scale layouts cuBLASLt reads (the reference of cuda_blocks.gemm_scale) ---------------------------

def gemm_scale(scale: Tensor, kind: str) -> np.ndarray:
    """One GEMM operand's block scales ``[rows or row-tiles, K-blocks]`` as cuBLASLt reads them.

    "1x32": flat uint8, 128 x 4 tiles of 512 bytes row-major over the tiles, element (r, c) of a tile at byte
    ``(r % 32) * 16 + (r // 32) * 4 + c`` (cuBLAS's "1D block scaling factors layout"), zero padding.
    "1x128": float32 ``[KB, rows]`` (outer-dimension-major). "128x128": float32 ``[row-tiles, 4 * ceil(KB/4)]``,
    each row padded with zeros to 16 bytes.
    """
    s = scale.data
    rows, kgroups = s.shape
    if kind == "1x32":
        R, C = -(-rows // 128), -(-kgroups // 4)
        padded = np.zeros((R * 128, C * 4), np.uint8)
        padded[:rows, :kgroups] = s.view(np.uint8)
        # [R, 4 (r // 32), 32 (r % 32), C, 4 (c)] -> [R, C, r % 32, r // 32, c]
        return np.ascontiguousarray(padded.reshape(R, 4, 32, C, 4).transpose(0, 3, 2, 1, 4)).reshape(-1)
    f = s.view(np.float32)
    if kind == "1x128":
        return np.ascontiguousarray(f.T)
    out = np.zeros((rows, -(-kgroups // 4) * 4), np.float32)
    out[:, :kgroups] = f
    return out


# ---- the block-scaled GEMM emulation ----------------------------------------------------------------------

BLOCK_ROWS = {"1x32": 1, "1x128": 1, "128x128": 128}


def _factors(scale: np.ndarray, kind: str, rows: int) -> np.ndarray:
    """float64 factor of every operand row for every K-block, [rows, KB]: E8M0 bytes as 2^(e-127) (the NaN byte
    NaN), fp32 scale inverses as they are; a 128x128 tile's factor spread over its 128 rows."""
    if kind == "1x32":
        f = e8m0_factor(np.asarray(scale).view(np.uint8), 1).astype(np.float64)
    else:
        f = np.asarray(scale, np.float32).astype(np.float64)
    return np.repeat(f, BLOCK_ROWS[kind], axis=0)[:rows]


@ieee
def gemm(spec: Any, a: Tensor, b: Tensor, a_scale: np.ndarray, b_scale: np.ndarray) -> np.ndarray:
    """D[m, n] = sum_kb fa[m, kb] * fb[n, kb] * (sum_{k in kb} a[m, k] * b[n, k]), all in float64.

    Products of fp8 values and their sums over one K-block are exact in float64, so the only roundings are
    the block factors' products and the sum over K-blocks: deterministic, far inside the GPU's tolerance.
    """
    bk = MX_BLOCK if spec.a_block == "1x32" else FP32_BLOCK
    a64 = a.data.view(spec.a_fmt.numpy_dtype).astype(np.float64)
    b64 = b.data.view(spec.b_fmt.numpy_dtype).astype(np.float64)
    fa = _factors(a_scale, spec.a_block, spec.m)
    fb = _factors(b_scale, spec.b_block, spec.n)
    d = np.zeros((spec.m, spec.n), np.float64)
    with np.errstate(all="ignore"):
        for kb in range(-(-spec.k // bk)):
            part = a64[:, kb * bk:(kb + 1) * bk] @ b64[:, kb * bk:(kb + 1) * bk].T
            d += part * fa[:, kb:kb + 1] * fb[:, kb][None, :]
    return d
