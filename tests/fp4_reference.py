"""An independent reference of NUMERICS.md's FP4 section, block by block, for tests: ml_dtypes' casts (float4_e2m1fn,
float8_e4m3fn) clipped first, NumPy float32 scalars for every *rn operation, explicit transposes and loops, the
Hadamard butterfly element by element, Philox from Python integers. Slow; small tensors only."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(3.4028235e38)
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # NUMERICS.md's S, written out


def e2m1(y: np.float32) -> int:
    """E2M1(y) by ml_dtypes: clipped to +-6, RTNE; NaN of either sign 0x7."""
    if np.isnan(y):
        return 0x7
    return int(np.array([np.clip(F32(y), F32(-6), F32(6))], F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0])


def e4m3(d: np.float32) -> int:
    if np.isnan(d):
        return 0x7F
    return int(np.array([min(F32(d), F32(448))], F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0])


def e4m3_value(code: int) -> np.float32:
    return F32(np.array([code], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)[0])


def philox(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 on Python integers, as Random123 writes it."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
    return c0, c1, c2, c3


def sr_bytes(g: int, seed: int, offset: int) -> list[int]:
    w = philox((g & 0xFFFFFFFF, g >> 32, offset & 0xFFFFFFFF, offset >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    return [(w[j >> 2] >> (8 * (j & 3))) & 0xFF for j in range(16)]


def sr(y: np.float32, r: int) -> int:
    """SR(y, r) from exact rationals."""
    if np.isnan(y):
        return 0x7
    sign = 8 if math.copysign(1.0, float(y)) < 0 else 0
    a = abs(float(y))
    if a >= 6:
        return sign | 0x7
    step = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)
    lo = step * math.floor(a / step)
    f8 = math.floor(256 * (a - lo) / step)  # exact: a, lo and step are binary fractions
    v = lo + step if f8 + r >= 256 else lo
    return sign | [0, 0.5, 1, 1.5, 2, 3, 4, 6].index(v)


def hadamard_block(x: np.ndarray) -> np.ndarray:
    """The contract's butterfly of one 16-element block, element by element in fp32, rounded to x's dtype."""
    v = [F32(SIGNS[i]) * F32(x[i]) for i in range(16)]
    with np.errstate(all="ignore"):
        for h in (1, 2, 4, 8):
            for i in range(16):
                if i & h == 0:
                    v[i], v[i + h] = F32(v[i] + v[i + h]), F32(v[i] - v[i + h])
        return np.array([F32(vi * F32(0.25)) for vi in v], F32).astype(x.dtype)


def amax(a: np.ndarray) -> np.float32:
    f = np.abs(np.asarray(a, F32))
    if f.size == 0:
        return F32(0)
    return F32(np.nan) if np.isnan(f).any() else F32(f.max())


def global_scales(g: np.float32) -> tuple[np.float32, np.float32]:
    with np.errstate(all="ignore"):
        if g == 0 or not np.isfinite(g):
            s_enc = F32(1)
        else:
            s_enc = F32(F32(2688) / F32(g))
            if np.isinf(s_enc):
                s_enc = FLT_MAX
        return s_enc, F32(F32(1) / s_enc)


def nvfp4(x: np.ndarray, *, weight_2d: bool = False, hadamard: bool = False, stochastic: bool = False,
          seed: int = 0, offset: int = 0, global_amax: float | None = None, columnwise: bool = False
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [R, C] one a byte, scale codes, G float32 [1]) of x [M, K] by the contract, block by block."""
    op = np.ascontiguousarray(x.T if columnwise else x)
    R, C = op.shape
    if hadamard:
        op = np.concatenate([np.stack([hadamard_block(op[r, b:b + 16]) for b in range(0, C, 16)]).reshape(-1)
                             for r in range(R)]).reshape(R, C) if R and C else op.copy()
    g = amax(op) if global_amax is None else F32(global_amax)
    s_enc, s_dec = global_scales(g)
    m = F32(s_enc * F32(1 / 6))
    br = 16 if weight_2d else 1
    scales = np.zeros((-(-R // br), C // 16), np.uint8)
    codes = np.zeros((R, C), np.uint8)
    with np.errstate(all="ignore"):
        for tr in range(scales.shape[0]):
            for b in range(C // 16):
                rows = slice(tr * br, min(R, (tr + 1) * br))
                s = e4m3(F32(amax(op[rows, 16 * b:16 * b + 16]) * m))
                scales[tr, b] = s
                e = F32(F32(1) / F32(e4m3_value(s) * s_dec))
                if np.isinf(e):
                    e = FLT_MAX
                for r in range(rows.start, rows.stop):
                    rb = sr_bytes(r * (C // 16) + b, seed, offset) if stochastic else None
                    for j in range(16):
                        y = F32(F32(op[r, 16 * b + j]) * e)
                        codes[r, 16 * b + j] = sr(y, rb[j]) if stochastic else e2m1(y)
    return codes, scales, np.array([g], F32)


def e8m0(a: np.float32, rule: str) -> int:
    if np.isnan(a):
        return 0xFF
    if rule == "floor":
        if a == 0:
            return 0
        if np.isinf(a):
            return 254
        mant, exp = math.frexp(float(a))  # a = mant * 2^exp, mant in [0.5, 1): floor(log2 a) = exp - 1
        return min(max(exp - 1 - 2 + 127, 0), 254)
    v = F32(a * F32(1 / 6))
    if np.isinf(v):
        return 254
    if v == 0 or v <= 2.0 ** -127:
        return 0
    mant, exp = math.frexp(float(v))
    e = exp - 1 + 127 + (mant != 0.5)  # ceil(log2 v), biased
    return min(e, 254)


def mxfp4(x: np.ndarray, rule: str = "rceil", columnwise: bool = False) -> tuple[np.ndarray, np.ndarray]:
    op = np.ascontiguousarray(x.T if columnwise else x)
    R, C = op.shape
    scales = np.zeros((R, C // 32), np.uint8)
    codes = np.zeros((R, C), np.uint8)
    with np.errstate(all="ignore"):
        for r in range(R):
            for b in range(C // 32):
                e = e8m0(amax(op[r, 32 * b:32 * b + 32]), rule)
                scales[r, b] = e
                f = F32(np.nan) if e == 0xFF else F32(2.0 ** (127 - e))
                for j in range(32):
                    codes[r, 32 * b + j] = e2m1(F32(F32(op[r, 32 * b + j]) * f))
    return codes, scales


def unpack(data: np.ndarray) -> np.ndarray:
    """Packed bytes [R, B] -> codes [R, 2B]: the low nibble is the even element."""
    out = np.zeros((data.shape[0], 2 * data.shape[1]), np.uint8)
    for j in range(data.shape[1]):
        out[:, 2 * j] = data[:, j] & 0xF
        out[:, 2 * j + 1] = data[:, j] >> 4
    return out
