"""An FP8 oracle written from the format definitions alone (no fp8core, no ml_dtypes casts)."""

from __future__ import annotations

import numpy as np

# (exponent bits, mantissa bits, bias, max finite, has inf)
SPECS = {"e4m3": (4, 3, 7, 448.0, False), "e5m2": (5, 2, 15, 57344.0, True)}


def decode(fmt: str) -> np.ndarray:
    """float64 value of every code 0..255 (NaN for NaN codes, +-inf for E5M2's)."""
    eb, mb, bias, _, has_inf = SPECS[fmt]
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> mb) & ((1 << eb) - 1), code & ((1 << mb) - 1)
        if has_inf and e == (1 << eb) - 1:
            out[code] = sign * np.inf if m == 0 else np.nan
        elif not has_inf and (code & 0x7F) == 0x7F:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * m * 2.0 ** (1 - bias - mb)
        else:
            out[code] = sign * (1 + m / 2 ** mb) * 2.0 ** (e - bias)
    return out


def encode(v: np.ndarray, fmt: str) -> np.ndarray:
    """SATFINITE round-to-nearest-even of fp32 values ``v`` into codes; NaN -> 0x7F; sign of zero kept."""
    v = np.asarray(v, np.float64)
    _, _, _, fmax, _ = SPECS[fmt]
    values = decode(fmt)[:128]
    codes = np.arange(128)
    finite = np.isfinite(values) & (values <= fmax)
    values, codes = values[finite], codes[finite]  # ascending positive values, code order = value order
    a = np.minimum(np.abs(np.nan_to_num(v, nan=0.0, posinf=np.inf)), fmax)
    hi = np.clip(np.searchsorted(values, a, side="left"), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    pick_hi |= values[hi] == a
    out = np.where(pick_hi, codes[hi], codes[lo]).astype(np.uint8)
    out |= np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    out[np.isnan(v)] = 0x7F
    return out


def quantize_bits(x_f32: np.ndarray, scale: float, fmt: str) -> np.ndarray:
    """The contract's quantize: one fp32 multiply (IEEE, round-to-nearest-even), then :func:`encode`."""
    with np.errstate(all="ignore"):
        y = np.asarray(x_f32, np.float32) * np.float32(scale)
    return encode(y, fmt)


# ---- gemm: float64 reference and the tolerance the GPU's fp32 accumulation earns --------------------------

# Output rounding: one ulp relative (2^-mantissa bits) and the format's smallest step near zero.
OUT_ROUNDING = {"float32": (2.0 ** -23, 2.0 ** -149), "bfloat16": (2.0 ** -7, 2.0 ** -133),
                "float16": (2.0 ** -10, 2.0 ** -24), "float8_e4m3fn": (2.0 ** -3, 2.0 ** -9),
                "float8_e5m2": (2.0 ** -2, 2.0 ** -16)}


def gemm_reference(a_codes: np.ndarray, a_fmt: str, b_codes: np.ndarray, b_fmt: str, a_scale_inv: float,
                   b_scale_inv: float, bias: np.ndarray | None = None) -> np.ndarray:
    """float64 D = (a · bᵀ) · a_scale_inv · b_scale_inv (+ bias), from the oracle's decoding of the codes."""
    a = decode(a_fmt)[a_codes]
    b = decode(b_fmt)[b_codes]
    d = (a @ b.T) * a_scale_inv * b_scale_inv
    return d if bias is None else d + np.asarray(bias, np.float64)


def gemm_tolerance(a_codes: np.ndarray, a_fmt: str, b_codes: np.ndarray, b_fmt: str, scale: float,
                   out_dtype: str, out_scale: float = 1.0, accumulation_eps: float = 2.0 ** -23
                   ) -> tuple[np.ndarray, float]:
    """(atol per element, rtol) in the output's domain (D times out_scale): fp32 accumulation errs by at most
    about K * eps * sum_k |a||b| (growing with K), plus one ulp of the output format."""
    absprod = np.abs(decode(a_fmt)[a_codes]) @ np.abs(decode(b_fmt)[b_codes]).T * abs(scale * out_scale)
    k = a_codes.shape[1]
    rtol, step = OUT_ROUNDING[out_dtype]
    return k * accumulation_eps * absprod + step, rtol
