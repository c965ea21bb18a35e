"""The FP4 GEMM's CPU emulation (NUMERICS.md "FP4", GEMM): NVFP4 x NVFP4 and MXFP4 x MXFP4, TN, against a float64
reference built here from the operands' codes and scales, with alpha = S_dec_a * S_dec_b; 16x16 weight tiles,
NaN blocks, bias and output types, and the arguments it refuses by name."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
import fp4_reference as ref
from fp8core.fp4 import quantize_mxfp4, quantize_nvfp4

F32 = np.float32


def _operand64(t, block: int) -> np.ndarray:
    """float64 values of an FP4 operand [R, K]: each code's value times its block's scale (exact)."""
    codes = ref.unpack(np.asarray(t.data))
    q = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    s = np.asarray(t.scale).view(np.uint8)
    if block == 16:
        f = np.array([ref.e4m3_value(c) for c in range(256)], np.float64)[s]
        f = np.repeat(f, 16, axis=0)[:q.shape[0]] if f.shape[0] != q.shape[0] else f
    else:
        f = np.where(s == 0xFF, np.nan, 2.0 ** (s.astype(np.float64) - 127))
    return q * np.repeat(f, block, axis=1)


def _reference(a, b, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 D, its bound of fp32 rounding): (A . B^T) * alpha, alpha = S_dec_a *rn S_dec_b (NVFP4)."""
    alpha = 1.0
    if block == 16:
        alpha = float(F32(ref.global_scales(F32(a.global_amax[0]))[1] * ref.global_scales(F32(b.global_amax[0]))[1]))
    A, B = _operand64(a, block), _operand64(b, block)
    return (A @ B.T) * alpha, (np.abs(A) @ np.abs(B).T) * alpha * 2.0 ** -23


@pytest.mark.parametrize("block, quantize", [(16, quantize_nvfp4), (32, quantize_mxfp4)], ids=["nvfp4", "mxfp4"])
def test_fp4_gemm_matches_the_reference(rng, block, quantize):
    x = (rng.standard_normal((48, 256)) * 2.0 ** rng.integers(-8, 8, (48, 1))).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((32, 256)).astype(ml_dtypes.bfloat16)
    a, b = quantize(x), quantize(w)
    d = fp8core.gemm(a, b, out_dtype="float32")
    expected, bound = _reference(a, b, block)
    assert d.dtype == F32 and d.shape == (48, 32)
    assert np.all(np.abs(d - expected) <= bound + 1e-45)
    for dt in (ml_dtypes.bfloat16, np.float16):
        np.testing.assert_array_equal(fp8core.gemm(a, b, out_dtype=dt).view(np.uint16), d.astype(dt).view(np.uint16))
    # the dequantized operands' product: the same numbers, TE's alpha = amax_a * amax_b / (6 * 6 * 448 * 448)
    # equal up to rounding
    rel = np.abs(d - np.asarray(fp8core.dequantize_nvfp4(a) @ fp8core.dequantize_nvfp4(b).T if block == 16 else
                                fp8core.dequantize_mxfp4(a) @ fp8core.dequantize_mxfp4(b).T))
    assert rel.max() <= 1e-5 * np.abs(d).max()


def test_fp4_gemm_with_16x16_weight_tiles_a_columnwise_operand_and_bias(rng):
    x = rng.standard_normal((64, 128)).astype(F32)
    w = rng.standard_normal((48, 128)).astype(F32)
    a = quantize_nvfp4(np.ascontiguousarray(x.T), columnwise=True)  # the operand x again, from x^T
    b = quantize_nvfp4(w, weight_2d=True)
    bias = rng.standard_normal(48).astype(ml_dtypes.bfloat16)
    d = fp8core.gemm(a, b, out_dtype="float32", bias=bias)
    expected, bound = _reference(a, b, 16)
    expected += bias.astype(np.float64)
    assert np.all(np.abs(d - expected) <= bound + 2.0 ** -23 * np.abs(expected) + 1e-45)


def test_fp4_gemm_nan_blocks_reach_their_row_and_column(rng):
    x = rng.standard_normal((32, 64)).astype(F32)
    x[3, 40] = np.nan
    w = rng.standard_normal((16, 64)).astype(F32)
    d = fp8core.gemm(quantize_mxfp4(x), quantize_mxfp4(w), out_dtype="float32")
    assert np.all(np.isnan(d[3])) and not np.isnan(np.delete(d, 3, axis=0)).any()
    assert np.all(d[3].view(np.uint32) == 0x7FFFFFFF)
    d = fp8core.gemm(quantize_nvfp4(x), quantize_nvfp4(w), out_dtype="float32")
    assert np.all(np.isnan(d[3])) and not np.isnan(np.delete(d, 3, axis=0)).any()  # G NaN: S_dec 1, alpha finite


def test_fp4_gemm_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal((32, 64)).astype(F32))
    d = fp8core.gemm(quantize_nvfp4(x), quantize_nvfp4(x[:16].contiguous()), out_dtype=torch.bfloat16)
    assert isinstance(d, torch.Tensor) and d.dtype == torch.bfloat16 and d.shape == (32, 16)


def test_fp4_gemm_refuses_by_name():
    x = np.ones((32, 64), F32)
    nv, mx = quantize_nvfp4(x), quantize_mxfp4(x)
    cases = [
        (lambda: fp8core.gemm(nv, mx), ValueError, r"^b: a is NVFP4Tensor but b is MXFP4Tensor \(1x16 E2M1 and 1x32 "
                                                    r"E2M1\); a scaled GEMM takes two operands of one scheme"),
        (lambda: fp8core.gemm(mx, nv), ValueError, r"^b: a is MXFP4Tensor but b is NVFP4Tensor \(1x32 E2M1 and 1x16"),
        (lambda: fp8core.gemm(nv, np.ones((32, 64), F32)), TypeError, r"^b: with a block-scaled operand, expected"),
        (lambda: fp8core.gemm(nv, nv, 1.0, 1.0), ValueError, r"^a_scale_inv: block-scaled operands carry their own"),
        (lambda: fp8core.gemm(nv, nv, None, 1.0), ValueError, r"^b_scale_inv: block-scaled operands carry their own"),
        (lambda: fp8core.gemm(nv, nv, out_dtype="e4m3"), ValueError, r"^out_dtype: expected float32"),
        (lambda: fp8core.gemm(nv, nv, out_amax=np.zeros(1, F32)), ValueError, r"^out_amax: an FP4 GEMM"),
        (lambda: fp8core.gemm(nv, nv, use_fast_accum=True), ValueError, r"^use_fast_accum: the FP4 GEMM"),
        (lambda: fp8core.gemm(nv, nv, bias=np.zeros(32, F32), out_dtype="float32"), TypeError,
         r"^bias: for out_dtype float32 expected bfloat16"),
        (lambda: fp8core.gemm(quantize_nvfp4(np.ones((32, 48), F32)), quantize_nvfp4(np.ones((16, 48), F32))),
         ValueError, r"^a: K = 48; the FP4 GEMM needs K to be a multiple of 32"),
        (lambda: fp8core.gemm(nv, quantize_nvfp4(np.ones((8, 64), F32))), ValueError, r"^b: N = 8"),
        (lambda: fp8core.gemm(nv, quantize_nvfp4(np.ones((16, 32), F32))), ValueError, r"^b: expected \[N, K\]"),
        (lambda: fp8core.gemm(nv, fp8core.NVFP4Tensor(np.zeros(32 * 32 + 1, np.uint8)[1:].reshape(32, 32), nv.scale,
                                                      nv.global_amax)),
         ValueError, r"^b: its data pointer must be 16-byte aligned"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_16x16_weight_tiles_are_the_gemm_of_their_1x16_rows(rng):
    """cuBLASLt has no 2D scale mode for FP4: as Transformer Engine does, a 16x16-tiled weight goes to the GEMM as
    1x16 blocks whose scales repeat each tile's on its 16 rows. The tiled operand and that 1x16 operand give the
    same scale layout (gemm_scale, on a partial last tile too) and the same GEMM, bit for bit."""
    x = rng.standard_normal((40, 128)).astype(F32)
    w = (rng.standard_normal((56, 128)) * 2.0 ** rng.integers(-6, 6, (56, 1))).astype(F32)  # 56: a partial tile

    def as_rows(t, n):
        return fp8core.NVFP4Tensor(t.data, np.repeat(t.scale, 16, axis=0)[:n], t.global_amax, "1x16")

    partial = quantize_nvfp4(w, weight_2d=True)
    np.testing.assert_array_equal(fp8core.fp4.gemm_scale(partial), fp8core.fp4.gemm_scale(as_rows(partial, 56)))
    a, tiled = quantize_nvfp4(x), quantize_nvfp4(w[:48], weight_2d=True)  # the GEMM: N a multiple of 16
    for out in ("float32", "bfloat16"):
        np.testing.assert_array_equal(fp8core.gemm(a, tiled, out_dtype=out).view(np.uint8),
                                      fp8core.gemm(a, as_rows(tiled, 48), out_dtype=out).view(np.uint8))
    assert len(np.unique(np.asarray(tiled.scale).view(np.uint8))) > 1  # the tiles' scales differ: a real test


def test_nvfp4_alpha_is_s_dec_a_times_s_dec_b_and_beta_0():
    from fp8core._tensor import wrap
    from fp8core.backends import cpu_fp4

    for ga, gb in ((2688.0, 2688.0), (1.0, 448.0), (0.0, 6.0), (np.inf, np.nan), (1e-40, 3.0)):
        a, b = np.array([ga], F32), np.array([gb], F32)
        ab = cpu_fp4.gemm_alpha(wrap(a), wrap(b))
        expected = F32(ref.global_scales(F32(ga))[1] * ref.global_scales(F32(gb))[1])
        assert ab.dtype == F32 and ab.shape == (2,) and ab[1] == 0
        assert ab[:1].view(np.uint32)[0] == np.array([expected], F32).view(np.uint32)[0], (ga, gb)
