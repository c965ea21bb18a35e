"""Block scaling on the CPU reference against a reference written here from docs/numerics.md ("Block scaling"),
one element at a time in Python floats, plus the oracle's fp8 encoder (no fp8core arithmetic)."""

import math
import struct

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format, MXTensor, BlockScaledTensor
from fp8core.blocks import (dequantize_blockwise, dequantize_mxfp8, quantize_blockwise, quantize_mxfp8,
                            quantize_mxfp8_both, transpose_blocks)
from fp8core.formats import ENCODINGS
from oracle import accumulation_tolerance, block_operand64, decode, encode

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e4m3": 8, "e5m2": 15}
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


# ---- the reference, from the contract's text ---------------------------------------------------------------

def f32(v: float) -> float:
    """Round a Python float (exact here) to fp32, RTNE, subnormals kept; beyond fp32's range: +-inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def ref_e8m0(amax: float, fmt: str, mode: str) -> int:
    if math.isnan(amax):
        return 0xFF
    if mode == "rceil":
        v = f32(amax * f32(1.0 / FMAX[fmt]))  # the product of two fp32 values is exact in a double
        if math.isinf(v):
            return 254
        if v == 0 or v <= 2.0 ** -127:
            return 0
        m, ex = math.frexp(v)  # v = m * 2^ex, m in [0.5, 1)
        e = (ex - 1 if m == 0.5 else ex) + 127  # ceil(log2 v) + 127
        return min(e, 254)
    if math.isinf(amax):
        return 254
    if amax == 0:
        return 0
    _, ex = math.frexp(amax)
    return min(max(ex - 1 - EMAX[fmt] + 127, 0), 254)


def ref_mx_rowwise(x: np.ndarray, fmt: str, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale bytes) of x [rows, cols] (fp32) by the contract, block by block."""
    rows, cols = x.shape
    nb = -(-cols // 32)
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((rows, nb), np.uint8)
    for r in range(rows):
        for b in range(nb):
            blk = x[r, 32 * b:32 * b + 32].astype(np.float64)
            amax = math.nan if np.isnan(blk).any() else float(np.abs(blk).max())
            e = ref_e8m0(amax, fmt, mode)
            scales[r, b] = e
            if e == 0xFF:
                codes[r, 32 * b:32 * b + 32] = 0x7F
            else:
                factor = 2.0 ** (127 - e)
                codes[r, 32 * b:32 * b + 32] = encode([f32(float(v) * factor) for v in blk], fmt)
    return codes, scales


def ref_scale(amax: float, fmt: str, power_of_2: bool, epsilon: float) -> float:
    """The per-tensor scale rule (1.0 when there is no scale)."""
    a = max(amax, epsilon) if not math.isnan(amax) else amax
    if a == 0 or math.isinf(a) or math.isnan(a):
        return 1.0
    s = f32(FMAX[fmt] / a)  # correctly rounded: a double division then one rounding is exact enough here
    if math.isinf(s):
        s = f32(3.4028235e38)
    if power_of_2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return s


def ref_blockwise(x: np.ndarray, fmt: str, br: int, power_of_2: bool, epsilon: float = 0.0):
    rows, cols = x.shape
    R, C = -(-rows // br), -(-cols // 128)
    codes = np.zeros((rows, cols), np.uint8)
    s_inv = np.zeros((R, C), np.float32)
    for i in range(R):
        for j in range(C):
            blk = x[i * br:(i + 1) * br, j * 128:(j + 1) * 128].astype(np.float64)
            amax = math.nan if np.isnan(blk).any() else float(np.abs(blk).max())
            s = ref_scale(amax, fmt, power_of_2, epsilon)
            s_inv[i, j] = f32(1.0 / s)
            codes[i * br:(i + 1) * br, j * 128:(j + 1) * 128] = encode(
                np.vectorize(lambda v: f32(v * s))(blk), fmt)
    return codes, s_inv


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


# ---- E8M0 rounding: every case of the contract, both modes ------------------------------------------------

def _amax_cases(fmt: str) -> list[float]:
    inv = f32(1.0 / FMAX[fmt])
    one_ulp = lambda v: np.nextafter(np.float32(v), np.float32(np.inf))  # noqa: E731
    cases = [0.0, 1.0, 2.0, 0.5, 448.0, 57344.0, 3.0, float(one_ulp(1.0)), float(one_ulp(448.0)),
             float(one_ulp(256.0)), 2.0 ** -149, 2.0 ** -126, 2.0 ** -127, float(one_ulp(2.0 ** -127)),
             float(np.nextafter(np.float32(2.0 ** -127), np.float32(0))), 1e-38, 3.4028235e38, 2.0 ** 127,
             float(one_ulp(2.0 ** 127)), math.inf, math.nan]
    # amax values whose v = amax * inv lands exactly on, one ulp above, or just at a power of two
    for k in (-127, -126, -100, 0, 10, 126, 127):
        target = np.float32(2.0 ** k)
        with np.errstate(over="ignore"):
            a = np.float32(target / np.float32(inv))
        for cand in (a, one_ulp(a), np.nextafter(a, np.float32(0))):
            if np.isfinite(cand):
                cases.append(float(cand))
    return cases


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", [f.value for f in ENCODINGS])
def test_e8m0_every_rounding_case_against_the_contract(fmt, mode):
    amaxes = _amax_cases(fmt)
    x = np.zeros((len(amaxes), 32), np.float32)
    x[:, 5] = amaxes
    x[:, 6] = -np.float32(amaxes) / 3  # a smaller element of the block, negative
    got = quantize_mxfp8(x, fmt, scale_mode=mode)
    want_codes, want_scales = ref_mx_rowwise(x, fmt, mode)
    assert got.scale.dtype == E8M0 and got.scale.shape == (len(amaxes), 1)
    np.testing.assert_array_equal(bits(got.scale), want_scales, err_msg=f"amaxes {amaxes}")
    np.testing.assert_array_equal(bits(got.data), want_codes)


def test_e8m0_named_cases():
    """The contract's named cases, written out by hand for E4M3 (1/448 rounds to fp32 once)."""
    def scale_of(amax, mode="rceil"):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = amax
        return int(bits(quantize_mxfp8(x, "e4m3", scale_mode=mode).scale)[0, 0])

    assert scale_of(0.0) == 0 and scale_of(0.0, "floor") == 0                 # amax 0
    assert scale_of(np.nan) == 0xFF and scale_of(np.nan, "floor") == 0xFF     # NaN
    assert scale_of(np.inf) == 254 and scale_of(np.inf, "floor") == 254       # inf
    v448 = np.float32(448) * np.float32(1 / 448)      # 1 up to the rounding of 1/448
    assert scale_of(448.0) == (127 if v448 <= 1 else 128)
    assert scale_of(448.0, "floor") == 8 - 8 + 127    # floor(log2 448) = 8
    assert scale_of(1e-45) == 0                       # v far below 2^-127
    assert scale_of(3.4028235e38) == 120 + 127        # FLT_MAX / 448 = 2^119.2
    assert scale_of(3.4028235e38, "floor") == 127 - 8 + 127
    assert scale_of(2.0 ** -140, "floor") == 0        # clamps at 0


def test_rceil_keeps_the_block_amax_within_fp8_max_and_floor_may_saturate(rng):
    x = (rng.standard_normal((64, 256)) * 2.0 ** rng.uniform(-20, 20, (64, 1))).astype(np.float32)
    r = quantize_mxfp8(x, "e4m3", scale_mode="rceil")
    f = quantize_mxfp8(x, "e4m3", scale_mode="floor")
    # rceil never saturates except by the rounding of v; floor puts amax in [256, 512) -> clips above 448
    assert (np.abs(r.data.astype(np.float32)) < 448).mean() > 0.99
    assert (np.abs(f.data.astype(np.float32)) == 448).any()
    assert (bits(f.scale).astype(int) - bits(r.scale).astype(int) <= 0).all()


# ---- partial blocks, layouts, odd shapes ------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (3, 31), (5, 33), (33, 65), (2, 3, 40), (0, 32), (4, 0)])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_partial_blocks_match_the_reference(rng, shape, mode):
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-8, 8, shape)).astype(np.float32)
    got = quantize_mxfp8(x, "e4m3", scale_mode=mode)
    x2 = x.reshape(-1, shape[-1]) if x.size else x.reshape(int(np.prod(shape[:-1])), shape[-1])
    codes, scales = ref_mx_rowwise(x2, "e4m3", mode)
    assert got.data.shape == x.shape
    np.testing.assert_array_equal(bits(got.data).reshape(x2.shape), codes)
    np.testing.assert_array_equal(bits(got.scale), scales)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 96), (37, 70), (1, 33)])
def test_columnwise_equals_rowwise_of_the_transpose(rng, dtype, shape):
    x = (rng.standard_normal(shape) * 10).astype(np.float32).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    col = quantize_mxfp8(x, "e5m2", columnwise=True)
    row_t = quantize_mxfp8(np.ascontiguousarray(x.T), "e5m2")
    np.testing.assert_array_equal(bits(col.data), bits(row_t.data).T)
    np.testing.assert_array_equal(bits(col.scale), bits(row_t.scale).T)
    both_row, both_col = quantize_mxfp8_both(x, "e5m2")
    np.testing.assert_array_equal(bits(both_row.data), bits(quantize_mxfp8(x, "e5m2").data))
    np.testing.assert_array_equal(bits(both_row.scale), bits(quantize_mxfp8(x, "e5m2").scale))
    np.testing.assert_array_equal(bits(both_col.data), bits(col.data))
    np.testing.assert_array_equal(bits(both_col.scale), bits(col.scale))


@pytest.mark.parametrize("shape", [(64, 96), (37, 70), (1, 33), (2, 3, 40)])
def test_transpose_blocks_gives_the_quantization_of_the_transpose(rng, shape):
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-8, 8, shape)).astype(np.float32)
    x2 = x.reshape(-1, shape[-1])
    xt = np.ascontiguousarray(x2.T)
    for columnwise in (False, True):
        t = transpose_blocks(quantize_mxfp8(x, "e4m3", columnwise=columnwise))
        want = quantize_mxfp8(xt, "e4m3", columnwise=not columnwise)
        assert t.scale.dtype == E8M0
        np.testing.assert_array_equal(bits(t.data), bits(want.data))
        np.testing.assert_array_equal(bits(t.scale), bits(want.scale))
    t = transpose_blocks(quantize_blockwise(x, "e5m2", block="128x128"))
    want = quantize_blockwise(xt, "e5m2", block="128x128")
    np.testing.assert_array_equal(bits(t.data), bits(want.data))
    np.testing.assert_array_equal(t.scale_inv, want.scale_inv)
    if x2.shape[0] > 1:
        with pytest.raises(ValueError, match="t: 1x128 blocks lie along rows"):
            transpose_blocks(quantize_blockwise(x))


def test_special_values_in_blocks():
    x = np.zeros((4, 64), np.float32)
    x[0, :32] = np.nan                         # a NaN block: every element 0x7F, scale 0xFF
    x[0, 32] = -0.0
    x[1, 3], x[1, 4] = np.inf, 5.0              # inf: scale 254, inf saturates, 5 * 2^-127 rounds to 0
    x[2, :32] = 2.0 ** -130                     # fp32 subnormals keep their value: e = 0 scales by 2^127
    x[3, 40] = -np.inf
    q = quantize_mxfp8(x, "e4m3")
    b, s = bits(q.data), bits(q.scale)
    assert (b[0, :32] == 0x7F).all() and s[0, 0] == 0xFF
    assert b[0, 32] == 0x80 and s[0, 1] == 0            # -0 kept; an all-zero block has scale 0
    assert s[1, 0] == 254 and b[1, 3] == 0x7E and b[1, 4] == 0
    assert s[2, 0] == 0 and (b[2, :32] == 0x20).all()     # 2^-130 * 2^127 = 2^-3
    assert b[3, 40] == 0xFE
    y = dequantize_mxfp8(q)
    assert np.isnan(y[0, :32]).all() and y.view(np.uint32)[0, 0] == 0x7FFFFFFF
    np.testing.assert_array_equal(y[2, :32], x[2, :32])   # 2^-140 comes back exactly


def test_dequantize_mx_matches_the_contract(rng):
    x = (rng.standard_normal((8, 100)) * 2.0 ** rng.uniform(-30, 30, (8, 1))).astype(np.float32)
    for columnwise in (False, True):
        q = quantize_mxfp8(x, "e4m3", columnwise=columnwise)
        y = dequantize_mxfp8(q, "float32")
        vals = decode("e4m3")[bits(q.data)]
        e = bits(q.scale).astype(np.int64)
        e_full = np.repeat(e, 32, axis=0)[:8] if columnwise else np.repeat(e, 32, axis=1)[:, :100]
        want = np.vectorize(f32)(vals * 2.0 ** (e_full - 127)).astype(np.float32)
        np.testing.assert_array_equal(y, want)
        for out in ("bfloat16", "float16"):
            yo = dequantize_mxfp8(q, out)
            with np.errstate(over="ignore"):  # large blocks overflow float16 to inf, as RTNE says
                narrow = want.astype(getattr(ml_dtypes, out, out))
            np.testing.assert_array_equal(yo.view(np.uint16), narrow.view(np.uint16))


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", [f.value for f in ENCODINGS])
def test_mx_round_trip_error_bound_per_block(rng, fmt, mode):
    """|dequantize(quantize(x)) - x| <= half a step of the fp8 grid at the block's scale; floor may clip."""
    x = (rng.standard_normal((16, 256)) * 2.0 ** rng.uniform(-10, 10, (16, 8)).repeat(32, 1)).astype(np.float32)
    q = quantize_mxfp8(x, fmt, scale_mode=mode)
    y = dequantize_mxfp8(q).astype(np.float64)
    e = np.repeat(bits(q.scale).astype(np.int64), 32, axis=1)
    mant = 3 if fmt == "e4m3" else 2
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-300))) - mant)  # ulp at |x|, normal range
    bound = np.maximum(step / 2, 2.0 ** (e - 127) * decode(fmt)[1] / 2)  # subnormal step of the scaled grid
    clipped = np.abs(x) * 2.0 ** (127 - e) > FMAX[fmt]
    assert (np.abs(y - x) <= bound)[~clipped].all()
    if mode == "rceil":
        assert not clipped.any()


# ---- fp32 block scales ------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,br", [("1x128", 1), ("128x128", 128)])
@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("shape", [(3, 130), (130, 257), (1, 5)])
def test_blockwise_matches_the_reference(rng, block, br, power_of_2, shape):
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-12, 12, shape)).astype(np.float32)
    x.flat[7 % x.size] = 0.0
    got = quantize_blockwise(x, "e4m3", block=block, power_of_2=power_of_2)
    codes, s_inv = ref_blockwise(x, "e4m3", br, power_of_2)
    np.testing.assert_array_equal(bits(got.data), codes)
    np.testing.assert_array_equal(got.scale_inv, s_inv)
    y = dequantize_blockwise(got)
    full = np.repeat(np.repeat(s_inv, br, 0)[:shape[0]], 128, 1)[:, :shape[1]].astype(np.float64)
    np.testing.assert_array_equal(y, np.vectorize(f32)(decode("e4m3")[codes] * full).astype(np.float32))


def test_blockwise_specials_and_epsilon():
    x = np.ones((2, 256), np.float32)
    x[0, 0] = np.nan          # NaN block: scale 1, NaN -> 0x7F, the rest at scale 1
    x[1, :128] = 0.0          # zero block: scale 1
    x[1, 130] = np.inf        # inf block: scale 1, inf saturates
    q = quantize_blockwise(x, "e4m3", power_of_2=False)
    assert q.scale_inv[0, 0] == 1 and q.scale_inv[1, 0] == 1 and q.scale_inv[1, 1] == 1
    assert bits(q.data)[0, 0] == 0x7F and bits(q.data)[1, 130] == 0x7E
    assert q.scale_inv[0, 1] == np.float32(1) / np.float32(448)
    tiny = np.full((1, 128), 1e-30, np.float32)
    qe = quantize_blockwise(tiny, "e4m3", power_of_2=False, epsilon=1.0)
    assert qe.scale_inv[0, 0] == np.float32(1) / np.float32(448)  # amax floored at epsilon


@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_blockwise_round_trip_error_bound_per_block(rng, block):
    x = (rng.standard_normal((256, 384)) * 2.0 ** rng.uniform(-8, 8, (256, 1))).astype(np.float32)
    q = quantize_blockwise(x, "e4m3", block=block)
    y = dequantize_blockwise(q).astype(np.float64)
    br = 1 if block == "1x128" else 128
    s_inv = np.repeat(np.repeat(q.scale_inv.astype(np.float64), br, 0), 128, 1)
    # amax * scale <= 448 (no clipping); error <= half an fp8 step at |x|, or the scaled subnormal step
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-300))) - 3)
    assert (np.abs(y - x) <= np.maximum(step / 2, s_inv * 2.0 ** -10)).all()


# ---- why block scaling exists: an outlier -----------------------------------------------------------------

def sqnr_db(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float(10 * np.log10(np.sum(x * x) / np.sum((x - y) ** 2)))


def test_outliers_block_scaling_beats_per_tensor_sqnr(rng):
    """Activations with a few huge outliers (as LLM activations have): one per-tensor scale is set by the
    outlier, so every other element lands in E4M3's subnormals or flushes to zero; a scale per block only
    sacrifices the outlier's own block. The GEMM against the float64 product shows the same."""
    m, k, n = 64, 512, 64
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[3, 17] = 3e5
    x[40, 300] = -2e5
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)

    q, s_inv, _ = fp8core.quantize_dynamic(x, "e4m3")
    per_tensor = fp8core.dequantize(q, s_inv)
    mx = dequantize_mxfp8(quantize_mxfp8(x, "e4m3"))
    b128 = dequantize_blockwise(quantize_blockwise(x, "e4m3"))
    s_pt, s_mx, s_128 = sqnr_db(x, per_tensor), sqnr_db(x, mx), sqnr_db(x, b128)
    # The outliers dominate sum(x^2), so the per-tensor SQNR is fine overall; what breaks is everyone else:
    normal = np.ones_like(x, bool)
    normal[3, :], normal[40, :] = False, False
    n_pt, n_mx, n_128 = (sqnr_db(x[normal], y[normal]) for y in (per_tensor, mx, b128))
    # Measured (seed 1234): per-tensor 8.5 dB on the ordinary elements, 31.5 dB with MXFP8 or 1x128 blocks;
    # the GEMM below: 8.2 dB per-tensor, 28.3 dB with 1x128 x 128x128 blocks.
    assert n_pt < 12.0, n_pt            # most elements are E4M3 subnormals at scale 448/3e5 (~3 bits left)
    assert n_mx > 28.0 and n_128 > 28.0, (n_mx, n_128)  # E4M3's ~31 dB with a scale fitted to each block
    assert min(s_mx, s_128) > s_pt - 1.0

    ref = x[normal.all(1)].astype(np.float64) @ w.T.astype(np.float64)
    wq = quantize_blockwise(w, "e4m3", block="128x128")
    rows = normal.all(1)
    xb = quantize_blockwise(x, "e4m3")
    d_block = fp8core.gemm(BlockScaledTensor(xb.data, xb.scale_inv), wq, out_dtype="float32")[rows]
    wq_pt, w_sinv, _ = fp8core.quantize_dynamic(w, "e4m3")
    d_pt = fp8core.gemm(q, wq_pt, s_inv, w_sinv, out_dtype="float32")[rows]
    assert sqnr_db(ref, d_block) > 25.0 and sqnr_db(ref, d_pt) < 12.0


# ---- validation: the same errors for every backend --------------------------------------------------------

ERRORS = [
    (lambda: quantize_mxfp8(np.zeros(4, np.float64)), TypeError, "x: expected float32, bfloat16 or float16"),
    (lambda: quantize_mxfp8(np.zeros(4, np.float32), scale_mode="up"), ValueError, "scale_mode: expected"),
    (lambda: quantize_mxfp8(np.zeros(4, np.float32), "e3m4"), ValueError, "fmt: unknown FP8 format"),
    (lambda: quantize_mxfp8(np.zeros((4, 4), np.float32)[:, ::2]), ValueError, "x: expected a contiguous"),
    (lambda: quantize_mxfp8(np.float32(1)), ValueError, "x: expected at least 1 dimension"),
    (lambda: quantize_blockwise(np.zeros(4, np.float32), block="32x32"), ValueError, "block: expected '1x128'"),
    (lambda: quantize_blockwise(np.zeros(4, np.float32), epsilon=-1), ValueError, "epsilon: expected a finite"),
    (lambda: quantize_blockwise(np.zeros(4, np.float32), power_of_2=1), TypeError, "power_of_2: expected a bool"),
    (lambda: dequantize_mxfp8(np.zeros(4, np.float32)), TypeError, "t: expected a MXTensor"),
    (lambda: dequantize_mxfp8(MXTensor(np.zeros((2, 64), np.float32), np.zeros((2, 2), np.uint8))), TypeError,
     "t.data: expected fp8 data"),
    (lambda: dequantize_mxfp8(MXTensor(np.zeros((2, 64), ml_dtypes.float8_e4m3fn), np.zeros((2, 3), E8M0))),
     ValueError, r"t.scale: expected shape \(2, 2\) \(rowwise\) or \(1, 64\) \(columnwise\)"),
    (lambda: dequantize_mxfp8(MXTensor(np.zeros((2, 64), ml_dtypes.float8_e4m3fn), np.zeros((2, 2), np.float32))),
     TypeError, "t.scale: expected float8_e8m0fnu or uint8"),
    (lambda: dequantize_mxfp8(MXTensor(np.zeros((2, 64), ml_dtypes.float8_e4m3fn), np.zeros((2, 2), E8M0)),
                              "float64"), ValueError, "out_dtype: expected float32"),
    (lambda: dequantize_blockwise(BlockScaledTensor(np.zeros((2, 64), ml_dtypes.float8_e4m3fn),
                                                    np.zeros((2, 2), np.float32))),
     ValueError, r"t.scale_inv: expected shape \(2, 1\) \(1x128 blocks\) or \(1, 1\)"),
    (lambda: dequantize_blockwise(BlockScaledTensor(np.zeros((2, 64), ml_dtypes.float8_e4m3fn),
                                                    np.zeros((2, 1), np.float16))),
     TypeError, "t.scale_inv: expected float32"),
    (lambda: fp8core.MXFP8BlockScaling(scale_mode="ceil"), ValueError, "scale_mode: expected"),
    (lambda: fp8core.MXFP8BlockScaling(fp8_format="e3m4"), ValueError, "fp8_format: unknown"),
    (lambda: fp8core.Float8BlockScaling(epsilon=-1.0), ValueError, "epsilon: expected a finite"),
    (lambda: fp8core.Float8BlockScaling(power_of_2="yes"), TypeError, "power_of_2: expected a bool"),
    (lambda: fp8core.Float8BlockScaling(w_block_scaling_dim=3), ValueError, "w_block_scaling_dim: expected 1"),
]


@pytest.mark.parametrize("call,exc,message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_recipe_defaults_are_transformer_engines():
    mx = fp8core.MXFP8BlockScaling()
    assert mx.fp8_format is Format.E4M3 and mx.scale_mode == "rceil"
    fb = fp8core.Float8BlockScaling()
    assert fb.fp8_format is Format.E4M3 and fb.power_of_2 is True and fb.epsilon == 0.0
    assert (fb.x_block_scaling_dim, fb.w_block_scaling_dim, fb.grad_block_scaling_dim) == (1, 2, 1)
    assert fp8core.MXFP8BlockScaling("hybrid", "floor").fp8_format is Format.HYBRID


def test_torch_and_jax_arrays_come_back_in_kind(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    t = quantize_mxfp8(torch.from_numpy(x))
    assert t.data.dtype == torch.float8_e4m3fn and t.scale.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(t.scale.view(torch.uint8).numpy(), bits(quantize_mxfp8(x).scale))
    assert torch.equal(dequantize_mxfp8(t), torch.from_numpy(dequantize_mxfp8(quantize_mxfp8(x))))
    b = quantize_blockwise(torch.from_numpy(x), block="128x128")
    assert b.scale_inv.dtype == torch.float32 and b.scale_inv.shape == (1, 1)
    jnp = pytest.importorskip("jax.numpy")
    j = quantize_mxfp8(jnp.asarray(x), columnwise=True)
    assert j.scale.dtype == jnp.float8_e8m0fnu and j.scale.shape == (1, 64)
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp8(j)), dequantize_mxfp8(quantize_mxfp8(x, columnwise=True)))


# ---- the block-scaled GEMM emulation ----------------------------------------------------------------------

dequantized_operand = block_operand64


def block_gemm_tolerance(a, b, out_dtype: str, tensor_core: bool = False) -> tuple[np.ndarray, float]:
    """The oracle's accumulation tolerance of a block-scaled GEMM (``tensor_core`` for the GPU's result)."""
    absprod = np.abs(dequantized_operand(a)) @ np.abs(dequantized_operand(b)).T
    return accumulation_tolerance(absprod, a.data.shape[1], out_dtype, tensor_core=tensor_core)


def block_operands(rng, m, n, k, scheme, fmts=("e4m3", "e4m3")):
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-6, 6, (m, k))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
    if scheme == "mx":
        return quantize_mxfp8(x, fmts[0]), quantize_mxfp8(w, fmts[1])
    a_block, b_block = scheme.split(",")
    return (quantize_blockwise(x, fmts[0], block=a_block, power_of_2=False),
            quantize_blockwise(w, fmts[1], block=b_block, power_of_2=False))


SCHEMES = ["mx", "1x128,1x128", "1x128,128x128", "128x128,1x128"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [128, 512, 2048])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_block_gemm_against_float64_with_a_k_grown_tolerance(rng, scheme, k, out_dtype):
    m = 33 if scheme == "mx" else 40  # the 1x128/128x128 GEMM takes M and N in multiples of 8
    a, b = block_operands(rng, m, 144, k, scheme)
    d = fp8core.gemm(a, b, out_dtype=out_dtype)
    ref = dequantized_operand(a) @ dequantized_operand(b).T
    atol, rtol = block_gemm_tolerance(a, b, out_dtype)
    got = np.asarray(d, np.float64)
    assert d.dtype == np.dtype(getattr(ml_dtypes, out_dtype, out_dtype)) and d.shape == (m, 144)
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


@pytest.mark.parametrize("scheme", SCHEMES[1:])
@pytest.mark.parametrize("m", [1, 20, 130])
def test_block_gemm_refuses_m_not_a_multiple_of_8(rng, scheme, m):
    """cuBLASLt found no algorithm for M = 1 and 130 on an H200; Transformer Engine asks a multiple of 8 too."""
    a, b = block_operands(rng, m, 16, 128, scheme)
    with pytest.raises(ValueError, match=f"a: M = {m}; a 1x128/128x128 block GEMM needs M to be a multiple of 8"):
        fp8core.gemm(a, b, out_dtype="float32")


def test_block_gemm_formats_bias_and_block_factors(rng):
    a, b = block_operands(rng, 16, 32, 256, "mx", ("e5m2", "e4m3"))
    bias = rng.standard_normal(32).astype(ml_dtypes.bfloat16)
    d = fp8core.gemm(a, b, out_dtype="float32", bias=bias)
    ref = dequantized_operand(a) @ dequantized_operand(b).T + bias.astype(np.float64)
    atol, rtol = block_gemm_tolerance(a, b, "float32")
    assert (np.abs(d - ref) <= atol + rtol * np.abs(ref)).all()
    # Each K-block's factor applies to its own partial sum only: one block's scale scaled by 2 moves exactly
    # that block's contribution.
    a2 = MXTensor(a.data, (bits(a.scale) + np.uint8(1) * (np.arange(8) == 3)).astype(np.uint8).view(E8M0))
    d2 = fp8core.gemm(a2, b, out_dtype="float32")
    part = dequantized_operand(MXTensor(a.data[:, 96:128], a.scale[:, 3:4])) @ \
        dequantized_operand(MXTensor(b.data[:, 96:128], b.scale[:, 3:4])).T
    np.testing.assert_allclose(d2 - fp8core.gemm(a, b, out_dtype="float32"), part, rtol=1e-5, atol=1e-3)


def test_block_gemm_nan_scale_byte_gives_nan_rows(rng):
    a, b = block_operands(rng, 4, 16, 64, "mx")
    s = bits(a.scale).copy()
    s[2, 1] = 0xFF
    d = fp8core.gemm(MXTensor(a.data, s.view(E8M0)), b, out_dtype="float32")
    assert np.isnan(d[2]).all() and not np.isnan(np.delete(d, 2, 0)).any()


def _mx(m, k):
    return MXTensor(np.zeros((m, k), ml_dtypes.float8_e4m3fn), np.zeros((m, -(-k // 32)), E8M0))


def _bs(m, k, br=1):
    return BlockScaledTensor(np.zeros((m, k), ml_dtypes.float8_e4m3fn),
                             np.ones((-(-m // br), -(-k // 128)), np.float32))


GEMM_ERRORS = [
    (lambda: fp8core.gemm(_mx(16, 64), np.zeros((16, 64), ml_dtypes.float8_e4m3fn)), TypeError,
     "b: with a block-scaled operand, expected a ScaledTensor \\(MXTensor, BlockScaledTensor, NVFP4Tensor, "
     "MXFP4Tensor\\), got ndarray"),
    (lambda: fp8core.gemm(_mx(16, 128), _bs(16, 128)), ValueError, "b: a is MXTensor but b is BlockScaledTensor"),
    (lambda: fp8core.gemm(_mx(16, 64), _mx(16, 64), 1.0), ValueError, "a_scale_inv: block-scaled operands carry"),
    (lambda: fp8core.gemm(_mx(16, 48), _mx(16, 48)), ValueError, "a: K = 48; an MXFP8 GEMM needs K"),
    (lambda: fp8core.gemm(_mx(16, 64), MXTensor(_mx(16, 64).data, np.zeros((1, 64), E8M0))), ValueError,
     r"b.scale: the GEMM takes rowwise MXFP8 \(blocks along K\): expected shape \(16, 2\)"),
    (lambda: fp8core.gemm(_mx(16, 64), MXTensor(_mx(16, 64).data, np.zeros((16, 2), np.float32))), TypeError,
     "b.scale: expected float8_e8m0fnu or uint8"),
    (lambda: fp8core.gemm(_bs(16, 64), _bs(16, 64)), ValueError, "a: K = 64; a 1x128/128x128 block GEMM"),
    (lambda: fp8core.gemm(_bs(256, 128, 128), _bs(16, 128, 128)), ValueError,
     "a, b: cuBLASLt has no 128x128 x 128x128 GEMM"),
    (lambda: fp8core.gemm(_bs(16, 128), BlockScaledTensor(_bs(16, 128).data, np.ones((3, 1), np.float32))),
     ValueError, r"b.scale_inv: expected shape \(16, 1\) \(1x128 blocks\)"),
    (lambda: fp8core.gemm(_bs(16, 128), _bs(16, 128), out_dtype="e4m3", out_scale=1.0), ValueError,
     "out_dtype: a block-scaled GEMM writes float32, bfloat16 or float16"),
    (lambda: fp8core.gemm(_bs(16, 128), _bs(24, 128)), ValueError, "b: N = 24"),
    (lambda: fp8core.gemm(np.zeros((16, 64), ml_dtypes.float8_e4m3fn), np.zeros((16, 64), ml_dtypes.float8_e4m3fn)),
     TypeError, "a_scale_inv: required for fp8 operands with per-tensor scales"),
]


@pytest.mark.parametrize("call,exc,message", GEMM_ERRORS, ids=[e[2][:40] for e in GEMM_ERRORS])
def test_gemm_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_large_16_bit_inputs_table_path_equals_the_direct_path(rng, monkeypatch, dtype):
    """From 2^18 elements, bf16/fp16 quantize by lookup tables; the bits must be the direct path's."""
    from fp8core.backends import cpu_blocks

    x = (rng.standard_normal((512, 640)) * 2.0 ** rng.uniform(-12, 12, (512, 1))).astype(np.float32)
    x[0, :40] = [np.nan, np.inf, -np.inf, -0.0, 2.0 ** -20, 6e4] + [0.0] * 34
    x = x.astype(dtype)
    assert x.size >= cpu_blocks.TABLE_MIN
    results = []
    for table_min in (cpu_blocks.TABLE_MIN, 1 << 62):
        monkeypatch.setattr(cpu_blocks, "TABLE_MIN", table_min)
        results.append([bits(a) for t in (quantize_mxfp8(x, "e4m3"), quantize_mxfp8(x, "e5m2", columnwise=True),
                                          quantize_blockwise(x, "e4m3"), quantize_blockwise(x, block="128x128"))
                        for a in t])
    for table, direct in zip(*results):
        np.testing.assert_array_equal(table, direct)


def test_the_cuda_block_backend_imports_without_a_gpu():
    """cuda_blocks is imported by the selftest's coverage on every machine (its kernels' argument layouts are
    their records', which tests/test_sass.py and the emulator check against the C++)."""
    import importlib

    cuda_blocks = importlib.import_module("fp8core.backends.cuda_blocks")
    assert cuda_blocks.mx_swizzled_size(130, 6) == 256 * 8
