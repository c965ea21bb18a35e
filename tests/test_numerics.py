"""The numerics contract on the CPU backend, against the independent oracle in oracle.py."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format
from fp8core.formats import ENCODINGS
from oracle import decode, quantize_bits

FORMATS = [(f.value, f) for f in ENCODINGS]
SCALES = [1.0, 2.0 ** -7, 2.0 ** 10, 3.0, 0.3, 448 / 1000.0, 2.0 ** 60, 2.0 ** -60]


def all_patterns(dtype):
    return np.arange(65536, dtype=np.uint16).view(dtype)


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_every_fp8_pattern_decodes_like_ml_dtypes_and_the_oracle(name, fmt):
    codes = np.arange(256, dtype=np.uint8)
    ours = fp8core.dequantize(codes.view(fmt.numpy_dtype), 1.0, "float32")
    theirs = codes.view(fmt.numpy_dtype).astype(np.float32)
    expected = decode(name).astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(theirs), nan)
    np.testing.assert_array_equal(theirs[~nan], expected[~nan])
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert (ours[nan].view(np.uint32) == 0x7FFFFFFF).all()  # canonical NaN, sign dropped


@pytest.mark.parametrize("name,fmt", FORMATS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", SCALES)
def test_every_16bit_pattern_quantizes_like_the_oracle(name, fmt, dtype, scale):
    x = all_patterns(dtype)
    q = fp8core.quantize(x, scale, fmt)
    expected = quantize_bits(x.astype(np.float32), scale, name)
    mismatch = np.nonzero(q.view(np.uint8) != expected)[0]
    assert mismatch.size == 0, f"first mismatches at patterns {mismatch[:8]}"


@pytest.mark.parametrize("name,fmt", FORMATS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_large_16bit_tensors_take_the_table_path_exactly(name, fmt, dtype):
    x = np.tile(all_patterns(dtype), 5)  # over the size where a lookup table replaces the arithmetic
    slot = np.zeros(1, np.float32)
    q = fp8core.quantize(x, 0.3, fmt, amax_out=slot)
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x.astype(np.float32), 0.3, name))
    assert slot.view(np.uint32)[0] == 0x7FFFFFFF


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_fp32_edge_values(name, fmt):
    tiny = np.array([1.4e-45, -1.4e-45, 1.1754942e-38, -1e-40], np.float32)  # fp32 subnormals
    values = np.concatenate([tiny, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, fmt.max, -fmt.max,
                                             fmt.max * 1.0625, 1e30, -1e30, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10,
                                             3 * 2.0 ** -11, 1.0625, 1.1875, 17.0, -17.0], np.float32)])
    for scale in [1.0, 2.0 ** 140, 2.0 ** 149]:
        q = fp8core.quantize(values, scale, fmt)
        np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(values, scale, name))


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_named_edges(name, fmt):
    q = lambda v, s=1.0: int(fp8core.quantize(np.array([v], np.float32), s, fmt).view(np.uint8)[0])  # noqa
    top = 0x7E if fmt is Format.E4M3 else 0x7B
    assert q(np.inf) == top and q(-np.inf) == 0x80 | top  # +-inf saturate
    assert q(1e30) == top
    assert q(np.nan) == 0x7F and q(-np.nan) == 0x7F
    assert q(-0.0) == 0x80 and q(-1e-30) == 0x80  # negative zero, and negatives that round to zero
    assert q(0.0) == 0x00
    assert q(1e-40, 2.0 ** 140) == quantize_bits(np.array([1e-40], np.float32), 2.0 ** 140, name)[0] != 0
    if fmt is Format.E4M3:
        assert q(1.0625) == 0x38  # tie between 1.0 (0x38, even) and 1.125: to even
        assert q(1.1875) == 0x3A  # tie between 1.125 and 1.25 (0x3A, even)
        assert q(464.0) == top  # would round to 480 without saturation


def test_nan_scale_products():
    x = np.array([np.inf, 0.0, 1.0], np.float32)
    for fmt in ENCODINGS:
        assert fp8core.quantize(x, 0.0, fmt).view(np.uint8)[0] == fmt.nan_cast == 0x7F  # inf * 0 = NaN
        assert fp8core.quantize(x, float("inf"), fmt).view(np.uint8)[1] == 0x7F


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_amax_edges(dtype):
    assert fp8core.amax(np.array([], dtype))[0] == 0
    assert fp8core.amax(np.array([1.0, -3.0, 2.0], dtype))[0] == 3.0
    assert np.isinf(fp8core.amax(np.array([1.0, -np.inf], dtype))[0])
    nan = fp8core.amax(np.array([1.0, -np.nan, np.inf], dtype))
    assert nan.view(np.uint32)[0] == 0x7FFFFFFF
    sub = np.array([1e-42 if dtype == np.float32 else 1e-40 if dtype == ml_dtypes.bfloat16 else 6e-8], dtype)
    assert fp8core.amax(-sub)[0] == np.float32(sub[0].astype(np.float32)) != 0  # subnormals count exactly


def test_amax_accumulates_into_amax_out(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    slot = np.array([100.0], np.float32)
    fp8core.quantize(x, 1.0, "e4m3", amax_out=slot)
    assert slot[0] == 100.0
    slot[0] = 0.5
    fp8core.quantize(x, 1.0, "e4m3", amax_out=slot)
    assert slot[0] == np.abs(x).max()


@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,fmt", FORMATS)
@pytest.mark.parametrize("scale_inv", [1.0, 2.0 ** -20, 3.7, 2.0 ** 100, 0.0])
def test_dequantize_all_codes(name, fmt, out, scale_inv):
    codes = np.arange(256, dtype=np.uint8)
    y = fp8core.dequantize(codes.view(fmt.numpy_dtype), scale_inv, out)
    with np.errstate(all="ignore"):
        exact = decode(name).astype(np.float32) * np.float32(scale_inv)
    target = getattr(ml_dtypes, out) if out == "bfloat16" else np.dtype(out)
    expected = exact.astype(target)
    nan = np.isnan(exact)
    bits = np.uint32 if out == "float32" else np.uint16
    np.testing.assert_array_equal(y[~nan].view(bits), expected[~nan].view(bits))
    assert (y[nan].view(bits) == (0x7FFFFFFF if out == "float32" else 0x7FFF)).all()


def test_round_trip_through_quantize_and_dequantize(rng):
    x = rng.standard_normal((64, 48)).astype(np.float32) * 10
    scale = np.array([4.0], np.float32)
    q = fp8core.quantize(x, scale, "e4m3")
    y = fp8core.dequantize(q, np.array([0.25], np.float32))
    np.testing.assert_allclose(y, x, rtol=2 ** -3)


def test_transpose_and_cast_transpose(rng):
    for shape in [(1, 1), (7, 1), (31, 33), (4097, 1), (1, 65537), (300, 257), (3, 5, 7)]:
        x = rng.standard_normal(shape).astype(np.float32)
        slot = np.zeros(1, np.float32)
        q, qt = fp8core.cast_transpose(x, 3.0, "e5m2", amax_out=slot)
        np.testing.assert_array_equal(q.view(np.uint8), fp8core.quantize(x, 3.0, "e5m2").view(np.uint8))
        flat = q.reshape(-1, shape[-1])
        np.testing.assert_array_equal(qt.view(np.uint8), flat.view(np.uint8).T)
        np.testing.assert_array_equal(fp8core.transpose(q).view(np.uint8), qt.view(np.uint8))
        assert slot[0] == np.abs(x).max()


def test_empty_tensors():
    for shape in [(0,), (0, 5), (5, 0)]:
        x = np.zeros(shape, np.float32)
        assert fp8core.quantize(x, 1.0).shape == shape
        q, qt = fp8core.cast_transpose(x, 1.0, "e4m3")
        assert q.shape == shape and qt.shape == (shape[-1], int(np.prod(shape[:-1])))
        q, s_inv, a = fp8core.quantize_dynamic(x, "e4m3")
        assert a[0] == 0 and s_inv[0] == 1


def test_misaligned_views(rng):
    base = rng.standard_normal(1001).astype(np.float32)
    for off in range(1, 4):
        x = base[off:off + 997]
        np.testing.assert_array_equal(fp8core.quantize(x, 2.0, "e4m3").view(np.uint8),
                                      quantize_bits(x, 2.0, "e4m3"))


def test_large_tensor_uses_chunks_and_matches(rng):
    x = (rng.standard_normal(5 * (1 << 16) + 5) * 100).astype(ml_dtypes.bfloat16)  # the table path
    x[12345] = np.nan
    slot = np.zeros(1, np.float32)
    q = fp8core.quantize(x, 0.5, "e4m3", amax_out=slot)
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x.astype(np.float32), 0.5, "e4m3"))
    assert slot.view(np.uint32)[0] == 0x7FFFFFFF


def test_quantize_dynamic_matches_its_definition(rng):
    x = (rng.standard_normal(5000) * 3).astype(np.float16)
    q, s_inv, a = fp8core.quantize_dynamic(x, "e4m3", margin=1)
    assert a[0] == np.abs(x.astype(np.float32)).max()
    s = np.ldexp(np.float32(448) / a[0], -1).astype(np.float32)
    assert s_inv[0] == np.float32(1) / s
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x.astype(np.float32), s, "e4m3"))
    reduced = []

    def reduce(amax):  # in place, returning None (a returned array would be taken as the reduced amaxes)
        reduced.append(1)
        amax[0] = 448

    q2, _, a2 = fp8core.quantize_dynamic(x, "e4m3", reduce=reduce)
    assert reduced and a2[0] == 448
    np.testing.assert_array_equal(q2.view(np.uint8), quantize_bits(x.astype(np.float32), 1.0, "e4m3"))
