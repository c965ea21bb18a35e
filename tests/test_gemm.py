"""fp8core.gemm on the CPU emulation: every pair and output against a float64 reference, bias, fp8 output with
amax, and the error table shared with the GPU path (test_gpu_gemm.py runs the same cases on cuBLASLt)."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from gemm_cases import CASES, as_fp8, fp8_codes
from oracle import gemm_reference, gemm_tolerance

def to_float64(d):
    return np.asarray(d).astype(np.float64)


@pytest.mark.parametrize("a_fmt,b_fmt,out_dtype", CASES)
def test_every_pair_and_output_against_float64(rng, a_fmt, b_fmt, out_dtype):
    m, n, k = 37, 48, 96
    ac, bc = fp8_codes(rng, (m, k), a_fmt), fp8_codes(rng, (n, k), b_fmt)
    sa, sb = 0.5, 0.125
    fp8_out = out_dtype.startswith("float8")
    out_scale = 2.0 ** -6 if fp8_out else None
    d = fp8core.gemm(as_fp8(ac, a_fmt), as_fp8(bc, b_fmt), sa, sb, out_dtype=out_dtype, out_scale=out_scale)
    assert d.shape == (m, n) and d.dtype.name == out_dtype
    ref = gemm_reference(ac, a_fmt, bc, b_fmt, sa, sb)
    atol, rtol = gemm_tolerance(ac, a_fmt, bc, b_fmt, sa * sb, out_dtype, out_scale or 1.0)
    if fp8_out:
        fmax = fp8core.as_format(out_dtype).max
        ref = np.clip(ref * out_scale, -fmax, fmax)
    err = np.abs(to_float64(d) - ref)
    assert np.all(err <= atol + rtol * np.abs(ref)), f"max error {err.max()}"


def test_fp8_output_is_quantize_of_the_fp32_result_with_amax_before_the_cast(rng):
    ac, bc = fp8_codes(rng, (64, 32), "e4m3"), fp8_codes(rng, (32, 32), "e5m2")
    a, b = as_fp8(ac, "e4m3"), as_fp8(bc, "e5m2")
    bias = rng.standard_normal(32).astype(ml_dtypes.bfloat16)
    d32 = fp8core.gemm(a, b, 0.25, 2.0, out_dtype="float32", bias=bias)
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        amax = np.zeros(1, np.float32)
        d8 = fp8core.gemm(a, b, 0.25, 2.0, out_dtype=fmt, bias=bias, out_scale=np.float32([3.0]).reshape(1),
                          out_amax=amax)
        expected = fp8core.quantize(d32, 3.0, fmt)
        np.testing.assert_array_equal(d8.view(np.uint8), expected.view(np.uint8))
        assert amax[0] == np.abs(d32).max()


def test_out_amax_accumulates_and_propagates_nan(rng):
    ac, bc = fp8_codes(rng, (16, 16), "e4m3"), fp8_codes(rng, (16, 16), "e4m3")
    a, b = as_fp8(ac, "e4m3"), as_fp8(bc, "e4m3")
    big = np.float32([1e30])
    fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float8_e4m3fn", out_scale=1.0, out_amax=big)
    assert big[0] == np.float32(1e30)
    ac[3, 5] = 0x7F  # an E4M3 NaN operand: its row of D is NaN, and so is the amax
    slot = np.zeros(1, np.float32)
    d = fp8core.gemm(as_fp8(ac, "e4m3"), b, 1.0, 1.0, out_dtype="float8_e4m3fn", out_scale=1.0, out_amax=slot)
    assert np.isnan(slot[0])
    assert np.all(d.view(np.uint8)[3] == 0x7F)


@pytest.mark.parametrize("out_dtype,bias_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float32", ml_dtypes.bfloat16),
                                                  ("float16", np.float16), ("float8_e4m3fn", np.float16)])
def test_bias_is_added_before_the_output_cast(rng, out_dtype, bias_dtype):
    ac, bc = fp8_codes(rng, (20, 64), "e4m3"), fp8_codes(rng, (32, 64), "e4m3")
    bias = (rng.standard_normal(32) * 8).astype(bias_dtype)
    kw = {"out_scale": 1.0} if out_dtype.startswith("float8") else {}
    d = fp8core.gemm(as_fp8(ac, "e4m3"), as_fp8(bc, "e4m3"), 1.0, 0.5, out_dtype=out_dtype, bias=bias, **kw)
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 0.5, bias.astype(np.float64))
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", 0.5, out_dtype)
    ref = np.clip(ref, -448, 448) if out_dtype.startswith("float8") else ref
    assert np.all(np.abs(to_float64(d) - ref) <= atol + rtol * np.abs(ref))


@pytest.mark.parametrize("k", [16, 64, 4096])
def test_float32_output_within_the_k_grown_tolerance(rng, k):
    ac, bc = fp8_codes(rng, (8, k), "e4m3"), fp8_codes(rng, (16, k), "e4m3")
    d = fp8core.gemm(as_fp8(ac, "e4m3"), as_fp8(bc, "e4m3"), 1.0, 1.0, out_dtype="float32")
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 1.0)
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "float32")
    assert np.all(np.abs(d - ref) <= atol + rtol * np.abs(ref))
    if k <= 64:  # where the bound is tight, it sees a result off by one part in 1024
        wrong = ref * (1 + 2.0 ** -10)
        assert not np.all(np.abs(d - wrong) <= atol + rtol * np.abs(wrong))


def test_empty_m_and_preallocated_out(rng):
    b = as_fp8(fp8_codes(rng, (16, 32), "e4m3"), "e4m3")
    empty = fp8core.gemm(np.empty((0, 32), ml_dtypes.float8_e4m3fn), b, 1.0, 1.0, out_dtype="float32")
    assert empty.shape == (0, 16)
    a = as_fp8(fp8_codes(rng, (4, 32), "e4m3"), "e4m3")
    out = np.full((4, 16), np.nan, np.float32)
    result = fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32", out=out)
    assert result is out
    np.testing.assert_array_equal(out, fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32"))


def test_fast_accum_is_accepted_and_exact_on_the_cpu(rng):
    a = as_fp8(fp8_codes(rng, (8, 64), "e4m3"), "e4m3")
    b = as_fp8(fp8_codes(rng, (16, 64), "e4m3"), "e4m3")
    np.testing.assert_array_equal(fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32", use_fast_accum=True),
                                  fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32"))


def test_torch_and_jax_arrays_come_back_in_kind(rng):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    ac, bc = fp8_codes(rng, (16, 32), "e4m3"), fp8_codes(rng, (16, 32), "e4m3")
    expected = fp8core.gemm(as_fp8(ac, "e4m3"), as_fp8(bc, "e4m3"), 1.0, 1.0)
    ta = torch.from_numpy(ac.copy()).view(torch.float8_e4m3fn)
    tb = torch.from_numpy(bc.copy()).view(torch.float8_e4m3fn)
    got = fp8core.gemm(ta, tb, torch.ones(1), torch.ones(1))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), expected.view(np.int16))
    # on the CPU device, as the torch tensors are (JAX's default device is the GPU where there is one): the CPU's
    # bits; a GPU GEMM's are tests/test_gpu_gemm.py's to compare
    cpu = jax.devices("cpu")[0]
    ja, jb = (jax.device_put(as_fp8(c, "e4m3"), cpu) for c in (ac, bc))
    jgot = fp8core.gemm(ja, jb, 1.0, 1.0, out_dtype="float32")
    assert isinstance(jgot, jax.Array) and jgot.dtype == jax.numpy.float32 and jgot.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(jgot), fp8core.gemm(as_fp8(ac, "e4m3"), as_fp8(bc, "e4m3"), 1.0, 1.0,
                                                                 out_dtype="float32"))


def _operands():
    a = np.zeros((8, 32), ml_dtypes.float8_e4m3fn)
    b = np.zeros((16, 32), ml_dtypes.float8_e4m3fn)
    return a, b


def _out_over_amax(a, b):
    buf = np.zeros(64, np.float32)
    return fp8core.gemm(a, b, 1.0, 1.0, out_dtype="e4m3", out_scale=1.0, out_amax=buf[:1],
                        out=buf.view(E4)[:128].reshape(8, 16))


def _misaligned():
    buf = np.zeros(8 * 32 + 1, ml_dtypes.float8_e4m3fn)
    return buf[1:].reshape(8, 32)


E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
ERRORS = [
    ("k_not_16", lambda a, b: fp8core.gemm(np.zeros((8, 24), E4), np.zeros((16, 24), E4), 1.0, 1.0),
     ValueError, "K = 24"),
    ("n_not_16", lambda a, b: fp8core.gemm(a, np.zeros((8, 32), E4), 1.0, 1.0), ValueError, "N = 8"),
    ("e5m2_pair", lambda a, b: fp8core.gemm(a.view(E5), b.view(E5), 1.0, 1.0), ValueError, "E5M2 x E5M2"),
    ("e5m2_out", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_dtype="e5m2", out_scale=1.0), ValueError,
     "E5M2 output"),
    ("k_mismatch", lambda a, b: fp8core.gemm(a, np.zeros((16, 48), E4), 1.0, 1.0), ValueError, "K = 32"),
    ("not_fp8", lambda a, b: fp8core.gemm(np.zeros((8, 32), np.float32), b, 1.0, 1.0), TypeError,
     "a: expected fp8"),
    ("three_d", lambda a, b: fp8core.gemm(a.reshape(2, 4, 32), b, 1.0, 1.0), ValueError, "2-D"),
    ("scale_size", lambda a, b: fp8core.gemm(a, b, np.ones(2, np.float32), 1.0), ValueError,
     "a_scale_inv: expected 1 element"),
    ("scale_dtype", lambda a, b: fp8core.gemm(a, b, 1.0, np.ones(1, np.float64)), TypeError,
     "b_scale_inv: expected float32"),
    ("no_out_scale", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_dtype="e4m3"), ValueError, "out_scale"),
    ("amax_without_fp8", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_amax=np.zeros(1, np.float32)),
     ValueError, "out_amax: only for an fp8"),
    ("bias_dtype", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, bias=np.zeros(16, np.float32)), TypeError,
     "bias: for out_dtype bfloat16"),
    ("bias_shape", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, bias=np.zeros(8, ml_dtypes.bfloat16)), ValueError,
     "bias: expected shape (16,)"),
    ("out_dtype", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_dtype="int8"), ValueError, "out_dtype"),
    ("misaligned", lambda a, b: fp8core.gemm(_misaligned(), b, 1.0, 1.0), ValueError, "16-byte aligned"),
    ("strided", lambda a, b: fp8core.gemm(np.zeros((8, 64), E4)[:, ::2], b, 1.0, 1.0), ValueError,
     "contiguous"),
    ("out_shape", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32", out=np.zeros((8, 8), np.float32)),
     ValueError, "out: expected shape (8, 16)"),
    ("out_dtype_mismatch", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out=np.zeros((8, 16), np.float32)),
     TypeError, "out: expected bfloat16"),
    ("out_is_b", lambda a, b: fp8core.gemm(np.zeros((16, 32), E4), b, 1.0, 1.0, out_dtype="e4m3", out_scale=1.0,
                                           out=b.reshape(-1)[:256].reshape(16, 16)), ValueError,
     "out: overlaps b in memory"),
    ("out_in_a", lambda a, b: fp8core.gemm(a, b, 1.0, 1.0, out_dtype="e4m3", out_scale=1.0,
                                           out=a.reshape(-1)[:128].reshape(8, 16)), ValueError,
     "out: overlaps a in memory"),
    ("out_over_amax", lambda a, b: _out_over_amax(a, b), ValueError, "out: overlaps out_amax in memory"),
]


@pytest.mark.parametrize("case,call,exc,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(case, call, exc, message):
    a, b = _operands()
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(a, b)


def every_finite_pair(fmt):
    """Rows of K = 512 fp8 codes holding every finite code of fmt beside every other one (zero-padded)."""
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[np.isfinite(as_fp8(codes, fmt).astype(np.float32))]
    pairs = np.stack(np.meshgrid(finite, finite, indexing="ij"), -1).reshape(-1)
    return np.concatenate([pairs, np.zeros(-pairs.size % 512, np.uint8)]).reshape(-1, 512)


@pytest.mark.parametrize("a_fmt,b_fmt,out_dtype", [c for c in CASES if not c[2].startswith("float8")])
def test_cpu_emulation_is_the_float64_definition_bit_for_bit(rng, a_fmt, b_fmt, out_dtype):
    """The CPU backend widens operands by a table lookup (not ml_dtypes' cast): operands holding every finite
    code give the bits of the oracle's float64 definition rounded once to fp32, then to the output type; a NaN
    code makes its row or column NaN, and an E5M2 inf gives the definition's infs and NaNs."""
    ac = every_finite_pair(a_fmt)
    bc = np.ascontiguousarray(rng.permutation(every_finite_pair(b_fmt), axis=0)[:48])
    ac[5, 7], bc[3, 9] = 0x7F, 0xFF  # NaN in both formats
    if a_fmt == "e5m2":
        ac[8, 11] = 0x7C  # +inf
    if b_fmt == "e5m2":
        bc[10, 20] = 0xFC  # -inf
    d = fp8core.gemm(as_fp8(ac, a_fmt), as_fp8(bc, b_fmt), 0.5, 3.0, out_dtype=out_dtype)
    with np.errstate(all="ignore"):
        exact = gemm_reference(ac, a_fmt, bc, b_fmt, 0.5, 3.0)
        ref = exact.astype(np.float32).astype(d.dtype)
    nan = np.isnan(d.astype(np.float32))
    assert nan[5].all() and nan[:, 3].all() and (~nan).any()
    assert np.isinf(exact).any() == ("e5m2" in (a_fmt, b_fmt))
    assert np.array_equal(nan, np.isnan(ref.astype(np.float32)))
    storage = np.uint32 if out_dtype == "float32" else np.uint16
    assert np.array_equal(d.view(storage)[~nan], ref.view(storage)[~nan])
