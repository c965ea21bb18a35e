"""Block scaling through the front-ends: fp8core.torch custom ops (eager, torch.compile fullgraph, opcheck)
and fp8core.jax under jit, bit-equal to the core."""

import numpy as np
import pytest

import fp8core
from fp8core.blocks import (dequantize_blockwise, dequantize_mxfp8, quantize_blockwise, quantize_mxfp8,
                            quantize_mxfp8_both)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def tbits(t) -> np.ndarray:
    import torch

    return t.view(torch.uint8).numpy() if t.element_size() == 1 else bits(t.float().numpy())


@pytest.fixture
def x(rng):
    v = (rng.standard_normal((40, 256)) * 2.0 ** rng.uniform(-10, 10, (40, 1))).astype(np.float32)
    v[3, 7] = np.nan
    return v


def test_torch_ops_compile_fullgraph_and_match_the_core(x, rng):
    torch = pytest.importorskip("torch")
    from fp8core.torch import block_ops as bo

    w = rng.standard_normal((32, 256)).astype(np.float32)

    def step(x, w):
        a, b = bo.quantize_mxfp8(x, "e4m3", "floor"), bo.quantize_mxfp8(w)
        row, col = bo.quantize_mxfp8_both(x, "e5m2")
        c, d = bo.quantize_blockwise(x, "e4m3", "1x128", False), bo.quantize_blockwise(w, block="128x128")
        return (a.data, a.scale, row.scale, col.data, col.scale, bo.dequantize_mxfp8(col, torch.bfloat16),
                c.data, c.scale_inv, bo.dequantize_blockwise(d), bo.block_gemm(b, b, torch.float32),
                bo.block_gemm(c, d, torch.float32), *bo.transpose_blocks(col), *bo.transpose_blocks(d))

    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    eager = step(tx, tw)
    compiled = torch.compile(step, fullgraph=True)(tx, tw)
    for e, c in zip(eager, compiled):
        np.testing.assert_array_equal(tbits(e), tbits(c))
    core_col = quantize_mxfp8_both(x, "e5m2")[1]
    np.testing.assert_array_equal(tbits(eager[3]), bits(core_col.data))
    np.testing.assert_array_equal(tbits(eager[4]), bits(core_col.scale))
    np.testing.assert_array_equal(tbits(eager[1]), bits(quantize_mxfp8(x, scale_mode="floor").scale))
    np.testing.assert_array_equal(eager[7].numpy(), quantize_blockwise(x, power_of_2=False).scale_inv)
    d = quantize_blockwise(w, block="128x128")
    np.testing.assert_array_equal(eager[8].numpy(), dequantize_blockwise(d))
    assert eager[5].dtype == torch.bfloat16 and eager[9].shape == (32, 32)
    want_t = quantize_mxfp8(np.ascontiguousarray(x.T), "e5m2")
    np.testing.assert_array_equal(tbits(eager[11]), bits(want_t.data))
    np.testing.assert_array_equal(tbits(eager[12]), bits(want_t.scale))
    assert eager[13].shape == (256, 32) and eager[14].shape == (2, 1)


@pytest.mark.parametrize("op,args", [
    ("quantize_mxfp8", ("e4m3", "rceil", True)),
    ("quantize_mxfp8_both", ("e5m2", "floor")),
    ("quantize_blockwise", ("e4m3", "128x128", True, 0.0)),
])
def test_torch_opcheck(x, op, args):
    torch = pytest.importorskip("torch")
    import fp8core.torch  # noqa: F401

    x[3, 7] = 1.0  # opcheck compares outputs with assert_close, which calls fp8 NaN codes unequal
    torch.library.opcheck(getattr(torch.ops.fp8core, op).default, (torch.from_numpy(x), *args))


def test_jax_under_jit_matches_the_core(x):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fp8core.jax as fj

    jx = jnp.asarray(x)
    r = jax.jit(lambda v: fj.blocks.quantize_mxfp8(v, columnwise=True))(jx)
    want = quantize_mxfp8(x, columnwise=True)
    assert r.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(bits(r.data), bits(want.data))
    np.testing.assert_array_equal(bits(r.scale), bits(want.scale))
    np.testing.assert_array_equal(bits(jax.jit(fj.blocks.dequantize_mxfp8)(r)), bits(dequantize_mxfp8(want)))
    row, col = jax.jit(lambda v: fj.blocks.quantize_mxfp8_both(v, "e5m2", scale_mode="floor"))(jx)
    for got, ref in zip((row, col), quantize_mxfp8_both(x, "e5m2", scale_mode="floor")):
        np.testing.assert_array_equal(bits(got.scale), bits(ref.scale))
    b = jax.jit(lambda v: fj.blocks.quantize_blockwise(v, block="128x128"))(jx)
    np.testing.assert_array_equal(np.asarray(b.scale_inv), quantize_blockwise(x, block="128x128").scale_inv)
    a, b = fj.blocks.quantize_blockwise(jx), fj.blocks.quantize_blockwise(jx[:32])
    for got, ref in zip((a, b), (quantize_blockwise(x), quantize_blockwise(x[:32]))):
        np.testing.assert_array_equal(bits(got.data), bits(ref.data))
        np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv))
    d = jax.jit(lambda a, b: fj.blocks.block_gemm(a, b, jnp.float32))(a, b)
    # the core's GEMM on the same operands on their device: the GEMM's bits are the device's (NUMERICS.md)
    ref = np.asarray(fp8core.gemm(a, b, out_dtype="float32"))
    np.testing.assert_array_equal(np.asarray(d)[~np.isnan(ref)], ref[~np.isnan(ref)])
