"""An FP8 oracle written from the format definitions alone (no other fp8core module, no ml_dtypes casts).

The tests and ``fp8core selftest`` check both backends against it; the GEMM tolerance rule lives here too.
"""

from __future__ import annotations

import math

import numpy as np

# (exponent bits, mantissa bits, bias, max finite, has inf): the oracle's own statement of each format, on purpose not
# read from fp8core.formats (tests/test_formats.py checks that the two agree, and both against ml_dtypes)
SPECS = {"e4m3": (4, 3, 7, 448.0, False), "e5m2": (5, 2, 15, 57344.0, True)}
DTYPES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}  # the ml_dtypes name of each


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


# ---- gemm: float64 reference and the tolerance the hardware's accumulation earns ------------------------------

# fp32 accumulation errs by at most about one fp32 rounding per addition.
FP32_ACCUM_EPS = 2.0 ** -23
# Hopper's FP8 tensor cores add each MMA's products with a significand of about 14 bits (DeepSeek-V3, section
# 3.3.2: "around 14 bits"); cuBLASLt adds those partial sums into fp32 every few MMAs, or, with fast accumulation,
# only at the end. So a GPU result is off the exact sum by a fraction of sum_k |a||b| that does not grow with K.
# bench/bench_gemm_accuracy.py on an H200 (bench/results/gpu-2026-11-26-h200/recheck): worst 2^-10.3 (K = 64) and
# 2^-9.8 with fast accumulation (K = 1024), over K = 16..16384 and the 1x128/128x128 block GEMMs. These bounds,
# for the whole sum, keep a margin of about 5x and still see a wrong scale or layout where |D| ~ sum|a||b| / sqrt(K)
# is well above them (K up to about 2^12; 2^14 with fast accumulation).
TENSOR_CORE_EPS = 2.0 ** -8
TENSOR_CORE_FAST_EPS = 2.0 ** -7

# Output rounding: one ulp relative (2^-mantissa bits) and the format's smallest step near zero.
OUT_ROUNDING = {"float32": (2.0 ** -23, 2.0 ** -149), "bfloat16": (2.0 ** -7, 2.0 ** -133),
                "float16": (2.0 ** -10, 2.0 ** -24),
                **{dtype: (2.0 ** -SPECS[f][1], 2.0 ** (1 - SPECS[f][2] - SPECS[f][1])) for dtype, f in DTYPES.items()}}


def gemm_reference(a_codes: np.ndarray, a_fmt: str, b_codes: np.ndarray, b_fmt: str, a_scale_inv: float,
                   b_scale_inv: float, bias: np.ndarray | None = None) -> np.ndarray:
    """float64 D = (a · bᵀ) · a_scale_inv · b_scale_inv (+ bias), from the oracle's decoding of the codes."""
    a = decode(a_fmt)[a_codes]
    b = decode(b_fmt)[b_codes]
    d = (a @ b.T) * a_scale_inv * b_scale_inv
    return d if bias is None else d + np.asarray(bias, np.float64)


def block_operand64(t: tuple) -> np.ndarray:
    """float64 values of a CPU block-scaled operand, (fp8 data [R, C], scales): an MXTensor's E8M0 bytes [R,
    ceil(C/32)] (0xFF is NaN), a BlockScaledTensor's fp32 scale_inv in 1x128 [R, ceil(C/128)] or 128x128
    [ceil(R/128), ceil(C/128)] blocks, or a rowwise RowwiseTensor's [R, 1]; each code decoded, times its block's
    factor (exact)."""
    data, scale = np.asarray(t[0]), np.asarray(t[1])
    v = decode(DTYPES[data.dtype.name])[data.view(np.uint8)]
    rows, cols = v.shape
    if scale.dtype != np.float32:
        e = scale.view(np.uint8).astype(np.float64)
        f = np.where(e == 0xFF, np.nan, 2.0 ** (e - 127))
        return v * np.repeat(f, 32, 1)[:, :cols]
    f = np.repeat(scale.astype(np.float64), 1 if scale.shape[0] == rows else 128, 0)[:rows]
    # one scale per row (a RowwiseTensor, [R, 1]) spans the row; for C <= 128 that is a 1x128 block too
    return v * np.repeat(f, max(cols, 1) if scale.shape[1] == 1 else 128, 1)[:, :cols]


def accumulation_tolerance(absprod: np.ndarray, k: int, out_dtype: str, *, tensor_core: bool = False,
                           fast_accum: bool = False) -> tuple[np.ndarray, float]:
    """(atol per element, rtol) of a GEMM whose exact sum_k |a||b| is ``absprod`` (in the output's domain): K fp32
    additions, on a GPU's tensor cores (``tensor_core``) ``TENSOR_CORE_EPS`` of it besides (``fast_accum``:
    ``TENSOR_CORE_FAST_EPS``), plus one ulp of the output format."""
    rtol, step = OUT_ROUNDING[out_dtype]
    whole = (TENSOR_CORE_FAST_EPS if fast_accum else TENSOR_CORE_EPS) if tensor_core else 0.0
    return (k * FP32_ACCUM_EPS + whole) * absprod + step, rtol


def gemm_tolerance(a_codes: np.ndarray, a_fmt: str, b_codes: np.ndarray, b_fmt: str, scale: float,
                   out_dtype: str, out_scale: float = 1.0, *, tensor_core: bool = False, fast_accum: bool = False
                   ) -> tuple[np.ndarray, float]:
    """:func:`accumulation_tolerance` of the per-tensor-scaled GEMM of these codes, in the output's domain (D times
    out_scale); ``tensor_core`` for a result of the GPU's cuBLASLt."""
    absprod = np.abs(decode(a_fmt)[a_codes]) @ np.abs(decode(b_fmt)[b_codes]).T * abs(scale * out_scale)
    return accumulation_tolerance(absprod, a_codes.shape[1], out_dtype, tensor_core=tensor_core,
                                  fast_accum=fast_accum)


# ---- the scale rule and the batched update, one element at a time ------------------------------------------

def scale_rule(amax: float, fp8_max: float, margin: int = 0, power_of_2: bool = False, epsilon: float = 0.0
               ) -> tuple[np.float32, np.float32, bool]:
    """(scale, scale_inv, ok) of one amax by the contract's rule, in Python floats.

    float64 division then one rounding to fp32 equals fp32's correctly rounded division (53 >= 2 * 24 + 2).
    """
    with np.errstate(all="ignore"):
        a = np.float32(amax)
        if a < np.float32(epsilon):
            a = np.float32(epsilon)
        if a == 0 or not np.isfinite(a):
            return np.float32(1), np.float32(1), False
        s = np.float32(math.ldexp(float(np.float32(float(fp8_max) / float(a))), -margin))
        if np.isinf(s):
            s = np.float32(3.4028234663852886e38)
        if power_of_2 and s != 0:
            s = np.float32(math.ldexp(1.0, math.frexp(float(s))[1] - 1))
        return s, np.float32(1.0 / float(s)) if s != 0 else np.float32(np.inf), True


def update(history: np.ndarray, scale: np.ndarray, scale_inv: np.ndarray, fp8_max: np.ndarray, margin: int,
           algo: str, power_of_2: bool, epsilon: float, update_scale: bool) -> np.ndarray:
    """The batched delayed-scaling update, column by column, in place; returns the non-finite flags.

    A column whose row 0 is 0 did not run this step: nothing of it changes. Otherwise its scale comes from the
    history's max (or row 0), and the column rolls to [0, h2, ..., h_{L-1}, h0].
    """
    L, n = history.shape
    flags = np.zeros(n, bool)
    for j in range(n):
        col = history[:, j].copy()
        cur = col[0]
        flags[j] = not np.isfinite(cur)
        if cur == 0:
            continue
        a = col[0] if algo == "most_recent" else (np.nan if np.isnan(col).any() else col.max())
        if update_scale:
            s, s_inv, ok = scale_rule(a, fp8_max[j], margin, power_of_2, epsilon)
            if ok:
                scale[j], scale_inv[j] = s, s_inv
        history[:, j] = np.concatenate([[0.0], col[2:], [cur]]) if L > 1 else [0.0]
    return flags
