"""Block scaling's CPU reference under flush-to-zero / denormals-are-zero (torch.set_flush_denormal(True), as
XLA:CPU's callbacks run): the same bits as in the default mode, on inputs, scales and outputs that are subnormal."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core.blocks import (BlockScaledTensor, MXTensor, dequantize_blockwise, dequantize_mxfp8, quantize_blockwise,
                            quantize_mxfp8, quantize_mxfp8_both)
from fp8core.formats import ENCODINGS

torch = pytest.importorskip("torch")


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]).copy()


def _subnormal_blocks(rng, shape) -> np.ndarray:
    """Blocks whose amax is an fp32 subnormal (E8M0 v far below 2^-127, scales near 2^127), mixed with normal ones."""
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-149, -127, shape)).astype(np.float32)
    x[::3] *= np.float32(2.0 ** 120)  # every third row normal
    x.reshape(-1)[:4] = [1e-45, -1e-45, 2.0 ** -127, -0.0]
    return x


def _run_all(x: np.ndarray, codes: np.ndarray, e: np.ndarray, s_inv: np.ndarray) -> list[np.ndarray]:
    out = []
    for fmt in (f.value for f in ENCODINGS):
        for mode in ("rceil", "floor"):
            for t in (*quantize_mxfp8_both(x, fmt, scale_mode=mode),
                      quantize_mxfp8(x.astype(ml_dtypes.bfloat16), fmt, scale_mode=mode)):
                out += [_bits(t.data), _bits(t.scale)]
        for block in ("1x128", "128x128"):
            for pow2 in (True, False):
                t = quantize_blockwise(x, fmt, block=block, power_of_2=pow2, epsilon=0.0)
                out += [_bits(t.data), _bits(t.scale_inv)]
        q = codes.view(fp8core.as_format(fmt).numpy_dtype)
        for dt in ("float32", "bfloat16", "float16"):
            out.append(_bits(dequantize_mxfp8(MXTensor(q, e), dt)))
            out.append(_bits(dequantize_blockwise(BlockScaledTensor(q, s_inv), dt)))
    k = np.ascontiguousarray(x[:, :256])
    out.append(_bits(fp8core.gemm(quantize_mxfp8(k), quantize_mxfp8(k[:16]), out_dtype="float32")))
    return out


def test_block_reference_gives_the_same_bits_under_flush_to_zero(rng):
    x = _subnormal_blocks(rng, (130, 320))
    x_big = np.tile(np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16), 8).reshape(256, 2048)
    codes = rng.integers(0, 256, (130, 320), dtype=np.uint8)
    e = rng.integers(0, 40, (130, 10), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)  # 2^-127 .. 2^-88
    s_inv = (2.0 ** rng.integers(-149, -120, (130, 3))).astype(np.float32)
    want = _run_all(x, codes, e, s_inv)
    want_big = [_bits(t) for t in quantize_mxfp8(x_big)]  # the 16-bit table path
    assert any((w.view(np.uint8) != 0).any() for w in want)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert np.float32(1e-39) * np.float32(1) == 0, "torch.set_flush_denormal(True) did not flush"
        got = _run_all(x, codes, e, s_inv)
        got_big = [_bits(t) for t in quantize_mxfp8(x_big)]
    finally:
        torch.set_flush_denormal(False)
    assert np.float32(1e-39) * np.float32(1) != 0
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got + got_big, want + want_big)):
        np.testing.assert_array_equal(g, w, err_msg=f"result {i}")
