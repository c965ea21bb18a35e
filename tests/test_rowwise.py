"""Rowwise (axiswise) scaling on the CPU reference against a reference written here from docs/numerics.md
("Rowwise (axiswise) scaling"), one row at a time in Python floats plus the oracle's fp8 encoder, and the
rowwise GEMM against float64."""

import math

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Layout, RowwiseTensor, dequantize_rowwise, quantize_rowwise, transpose_blocks
from oracle import accumulation_tolerance, encode
from test_blocks import bits, f32, ref_scale


def ref_rowwise(x: np.ndarray, fmt: str = "e4m3", power_of_2: bool = True, epsilon: float = 0.0):
    """(codes uint8, scale_inv [rows, 1]) of x [rows, cols], each row by the per-tensor scale rule."""
    codes = np.zeros(x.shape, np.uint8)
    s_inv = np.zeros((x.shape[0], 1), np.float32)
    for r, row in enumerate(x.astype(np.float64)):
        amax = math.nan if np.isnan(row).any() else float(np.abs(row).max(initial=0.0))
        s = ref_scale(amax, fmt, power_of_2, epsilon)
        s_inv[r, 0] = f32(1.0 / s)
        codes[r] = encode(np.vectorize(lambda v: f32(v * s), otypes=[np.float64])(row), fmt)
    return codes, s_inv


def check(t, x, **kw):
    codes, s_inv = ref_rowwise(x, **kw)
    np.testing.assert_array_equal(bits(t.data).reshape(codes.shape), codes)
    np.testing.assert_array_equal(np.asarray(t.scale_inv).view(np.uint32), s_inv.view(np.uint32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 300), (130, 33)])
def test_rowwise_matches_the_reference(rng, fmt, power_of_2, shape):
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, (shape[0], 1)))).astype(np.float32)
    t = quantize_rowwise(x, fmt, power_of_2=power_of_2)
    assert isinstance(t, RowwiseTensor) and t.layout is Layout.ROWWISE and t.scale_inv.shape == (shape[0], 1)
    check(t, x, fmt=fmt, power_of_2=power_of_2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_columnwise_is_rowwise_of_the_transpose(rng, dtype):
    x = rng.standard_normal((37, 20)).astype(np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    c = quantize_rowwise(x, axis=0)
    assert c.layout is Layout.COLUMNWISE and c.scale_inv.shape == (1, 20) and c.data.shape == (37, 20)
    r = quantize_rowwise(np.ascontiguousarray(x.T))
    np.testing.assert_array_equal(bits(c.data).T, bits(r.data))
    np.testing.assert_array_equal(c.scale_inv.T, r.scale_inv)
    t = transpose_blocks(c)
    assert t.layout is Layout.ROWWISE
    np.testing.assert_array_equal(bits(t.data), bits(r.data))
    np.testing.assert_array_equal(t.scale_inv, r.scale_inv)


def test_zero_row_gets_scale_one_and_keeps_signed_zeros():
    x = np.array([[0.0, -0.0, 0.0, -0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    t = quantize_rowwise(x)
    assert t.scale_inv[0, 0] == 1.0 and bits(t.data)[0].tolist() == [0x00, 0x80, 0x00, 0x80]
    assert t.scale_inv[1, 0] == 2.0 ** -6  # 448 / 4 = 112 rounded down to 64
    check(t, x)
    e = quantize_rowwise(x, epsilon=1.0)  # the floor comes first: 448 / 1, rounded down to 256
    assert e.scale_inv[0, 0] == 2.0 ** -8
    check(e, x, epsilon=1.0)


def test_nan_row_is_cast_unscaled_and_other_rows_untouched():
    x = np.array([[np.nan, 1.0, -600.0, 2.0 ** -10], [-np.nan, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    t = quantize_rowwise(x)
    assert t.scale_inv[0, 0] == t.scale_inv[1, 0] == 1.0
    assert bits(t.data)[0].tolist() == [0x7F, 0x38, 0xFE, 0x00]  # NaN, 1.0, -448 (saturated), 2^-10 -> 0
    assert bits(t.data)[1, 0] == 0x7F  # -NaN -> 0x7F too
    check(t, x)


def test_inf_row_saturates_unscaled():
    x = np.array([[np.inf, 1.0, -3.0, 500.0], [-np.inf, 0.5, 0.0, 0.0]], np.float32)
    t = quantize_rowwise(x)
    assert t.scale_inv.tolist() == [[1.0], [1.0]]
    assert bits(t.data)[0].tolist() == [0x7E, 0x38, 0xC4, 0x7E] and bits(t.data)[1, 0] == 0xFE
    check(t, x)


def test_subnormal_rows_count_at_their_exact_value():
    x = np.array([[1e-40, -3e-41, 0.0, 2e-45]], np.float32)  # fp32 subnormals: no flush to zero
    t = quantize_rowwise(x)
    assert t.scale_inv[0, 0] != 1.0 and bits(t.data)[0, 0] != 0
    check(t, x)


def test_saturation_and_ties_within_a_row():
    """Without power_of_2 the scale brings the row's amax to 448 exactly; a tie goes to the even code."""
    x = np.array([[448.0, 17.0, 18.0, 19.0, -448.0]], np.float32)  # 17 and 19 are ties between 16/18 and 18/20
    t = quantize_rowwise(x, power_of_2=False)
    assert t.scale_inv[0, 0] == 1.0
    assert fp8core.dequantize_rowwise(t).tolist() == [[448.0, 16.0, 18.0, 20.0, -448.0]]
    check(t, x, power_of_2=False)


def test_empty_and_zero_width():
    t = quantize_rowwise(np.zeros((0, 8), np.float32))
    assert t.data.shape == (0, 8) and t.scale_inv.shape == (0, 1)
    z = quantize_rowwise(np.zeros((3, 0), np.float32))
    assert z.data.shape == (3, 0) and z.scale_inv.tolist() == [[1.0]] * 3
    c = quantize_rowwise(np.zeros((0, 4), np.float32), axis=0)
    assert c.scale_inv.tolist() == [[1.0] * 4]


def test_leading_dimensions_fold_into_rows_and_misaligned_views(rng):
    x = rng.standard_normal((2, 3, 48)).astype(np.float32)
    t = quantize_rowwise(x)
    assert t.data.shape == (2, 3, 48) and t.scale_inv.shape == (6, 1)
    check(t, x.reshape(6, 48))
    view = rng.standard_normal(5 * 48 + 1).astype(np.float32)[1:].reshape(5, 48)  # 4 bytes off a 16-byte boundary
    check(quantize_rowwise(view), view.copy())
    with pytest.raises(ValueError, match="x: expected a contiguous"):  # as every block quantizer: no hidden copy
        quantize_rowwise(rng.standard_normal((5, 49)).astype(np.float32)[:, 1:])


def test_dequantize_is_codes_times_the_row_scale(rng):
    x = (rng.standard_normal((9, 40)) * np.exp2(np.arange(9))[:, None]).astype(np.float32)
    for axis in (-1, 0):
        t = quantize_rowwise(x, axis=axis)
        codes = t.data.astype(np.float32)
        np.testing.assert_array_equal(dequantize_rowwise(t), codes * t.scale_inv)
        np.testing.assert_array_equal(fp8core.blocks.dequantize_blocks(t, "bfloat16"),
                                      (codes * t.scale_inv).astype(dequantize_rowwise(t, "bfloat16").dtype))


def test_a_pair_alone_reads_its_layout_from_the_scale_shape(rng):
    t = quantize_rowwise(rng.standard_normal((4, 16)).astype(np.float32), axis=0)
    assert RowwiseTensor(t.data, t.scale_inv).layout is Layout.COLUMNWISE
    assert RowwiseTensor(t.data.T, t.scale_inv.T).layout is Layout.ROWWISE


@pytest.mark.parametrize("call,exc,message", [
    (lambda x: quantize_rowwise(x, axis=2), ValueError, r"axis: expected -1 or 1 .* or 0 .*, got 2"),
    (lambda x: quantize_rowwise(x, axis=True), ValueError, "axis: expected"),
    (lambda x: quantize_rowwise(x.astype(np.int32)), TypeError, "x: "),
    (lambda x: quantize_rowwise(x, "e3m4"), ValueError, "fmt"),
    (lambda x: quantize_rowwise(x, epsilon=-1.0), ValueError, "epsilon"),
    (lambda x: dequantize_rowwise(fp8core.quantize_blockwise(x)), ValueError, "expected a rowwise or columnwise "
                                                                             "layout, got 1x128"),
    (lambda x: dequantize_rowwise(RowwiseTensor(quantize_rowwise(x).data, np.ones((3, 1), np.float32))),
     ValueError, r"t.scale_inv: expected shape \(4, 1\)"),
])
def test_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call(np.ones((4, 16), np.float32))


# ---- the rowwise GEMM -------------------------------------------------------------------------------------

def _operands(rng, m, n, k):
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, (m, 1)))).astype(np.float32)
    b = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-8, 8, (n, 1)))).astype(np.float32)
    return quantize_rowwise(a), quantize_rowwise(b)


def _exact(ta, tb):
    """D of the contract in exact arithmetic (float64 holds every sum of E4M3 products exactly here)."""
    a64 = ta.data.astype(np.float64) * ta.scale_inv.astype(np.float64)
    b64 = tb.data.astype(np.float64) * tb.scale_inv.astype(np.float64)
    return a64 @ b64.T, np.abs(a64) @ np.abs(b64).T


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (5, 32, 48), (33, 16, 256)])
def test_rowwise_gemm_is_the_contracts_float32_result(rng, m, n, k):
    ta, tb = _operands(rng, m, n, k)
    d = fp8core.gemm(ta, tb, out_dtype="float32")
    exact, _ = _exact(ta, tb)
    # power-of-2 scales: each product of the exact sum and the two scales is exact, so one rounding to fp32
    np.testing.assert_array_equal(d, exact.astype(np.float32))


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_rowwise_gemm_with_bias_and_arbitrary_scales(rng, out_dtype):
    a = rng.standard_normal((8, 64)).astype(np.float32)
    b = rng.standard_normal((32, 64)).astype(np.float32)
    ta, tb = quantize_rowwise(a, power_of_2=False), quantize_rowwise(b, power_of_2=False)
    bias = rng.standard_normal(32).astype(np.float16 if out_dtype == "float16" else ml_dtypes.bfloat16)
    d = fp8core.gemm(ta, tb, out_dtype=out_dtype, bias=bias)
    exact, absprod = _exact(ta, tb)
    want = exact + bias.astype(np.float64)
    atol, rtol = accumulation_tolerance(absprod + np.abs(bias.astype(np.float64)), 64, out_dtype)
    assert (np.abs(d.astype(np.float64) - want) <= atol + rtol * np.abs(want)).all()


def test_rowwise_gemm_zero_nan_and_inf_rows(rng):
    a = rng.standard_normal((4, 32)).astype(np.float32)
    a[1] = 0.0
    a[2, 5] = np.nan
    a[3, 7] = np.inf
    ta = quantize_rowwise(a)
    tb = quantize_rowwise(rng.standard_normal((16, 32)).astype(np.float32))
    d = fp8core.gemm(ta, tb, out_dtype="float32")
    assert (d[1] == 0).all() and np.isnan(d[2]).all() and np.isfinite(d[[0, 3]]).all()
    exact, _ = _exact(ta, tb)
    np.testing.assert_array_equal(d[[0, 1, 3]], exact[[0, 1, 3]].astype(np.float32))


def test_rowwise_gemm_refusals(rng):
    ta, tb = _operands(rng, 8, 16, 32)
    with pytest.raises(ValueError, match=r"b.scale_inv: the GEMM takes one scale per row .* transpose_blocks"):
        fp8core.gemm(ta, quantize_rowwise(rng.standard_normal((16, 32)).astype(np.float32), axis=0))
    with pytest.raises(ValueError, match="a is RowwiseTensor but b is BlockScaledTensor"):
        fp8core.gemm(ta, fp8core.quantize_blockwise(rng.standard_normal((16, 128)).astype(np.float32)))
    with pytest.raises(ValueError, match="out_dtype: a block-scaled GEMM writes float32, bfloat16 or float16"):
        fp8core.gemm(ta, tb, out_dtype="float8_e4m3fn", out_scale=1.0)
    with pytest.raises(ValueError, match="a_scale_inv: block-scaled operands carry their own scales"):
        fp8core.gemm(ta, tb, 1.0)
    with pytest.raises(ValueError, match="K = 8; cuBLASLt's FP8 GEMM needs K"):
        fp8core.gemm(*_operands(rng, 8, 16, 8))


def test_torch_and_jax_arrays_come_back_in_kind(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    t = quantize_rowwise(torch.from_numpy(x))
    assert t.data.dtype == torch.float8_e4m3fn and t.scale_inv.dtype == torch.float32
    np.testing.assert_array_equal(t.data.view(torch.uint8).numpy(), bits(quantize_rowwise(x).data))
    jnp = pytest.importorskip("jax.numpy")
    j = quantize_rowwise(jnp.asarray(x), axis=0)
    assert j.data.dtype == jnp.float8_e4m3fn and j.scale_inv.shape == (1, 64)
    np.testing.assert_array_equal(np.asarray(j.scale_inv), quantize_rowwise(x, axis=0).scale_inv)
