"""Block scaling on the emulated device against the CPU backend, by bits: MXFP8 rowwise, columnwise and both
(rceil and floor), 1x128 and 128x128 blocks, their dequantization, and the scale layouts the GEMM reads."""

import numpy as np
import pytest

import device
import fp8core
from arrays import DTYPES, bits, data, upload
from fp8core import blocks, selftest
from fp8core._tensor import wrap
from fp8core.backends import cpu_blocks, cuda_blocks

SHAPES = [(1, 1), (1, 32), (32, 64), (33, 65), (64, 1), (96, 200), (130, 260), (256, 128)]


def _special_blocks(x: np.ndarray) -> np.ndarray:
    """Whole blocks of NaN, inf, zeros and subnormals (their scales are the edge cases of E8M0)."""
    x = x.copy()
    if x.shape[0] >= 4 and x.shape[1] >= 32:
        x[0, :32] = np.nan
        x[1, :32] = np.inf
        x[2, :32] = 0.0
        x[3, :32] = np.float32(1e-41).astype(x.dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mxfp8(block_dev, dtype, shape, rng):
    x = _special_blocks(data(rng, shape, dtype))
    for fmt, mode in (("e4m3", "rceil"), ("e5m2", "floor"), ("e4m3", "floor")):
        for columnwise in (False, True):
            # x 1 element into its allocation (never 16-byte aligned: the element-wise loads) for the rowwise
            # half, 8 (aligned: the vector loads and qc's 8-byte stores) for the columnwise one
            got = fp8core.quantize_mxfp8(upload(x, 8 if columnwise else 1), fmt, scale_mode=mode,
                                         columnwise=columnwise)
            ref = fp8core.quantize_mxfp8(x, fmt, scale_mode=mode, columnwise=columnwise)
            np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=f"{fmt} {mode} {columnwise}")
            np.testing.assert_array_equal(bits(got.scale), bits(ref.scale), err_msg=f"{fmt} {mode} {columnwise}")
            for out in ("float32", "bfloat16"):
                y = fp8core.dequantize_mxfp8(got, out, fmt=fmt)
                np.testing.assert_array_equal(bits(y), bits(fp8core.dequantize_mxfp8(ref, out)))
        both = fp8core.quantize_mxfp8_both(upload(x), fmt, scale_mode=mode)
        ref_both = fp8core.quantize_mxfp8_both(x, fmt, scale_mode=mode)
        for g, r in zip(both, ref_both):
            np.testing.assert_array_equal(bits(g.data), bits(r.data))
            np.testing.assert_array_equal(bits(g.scale), bits(r.scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_blockwise(block_dev, dtype, shape, block, rng):
    x = _special_blocks(data(rng, shape, dtype))
    for fmt, kw in (("e4m3", {}), ("e5m2", {"power_of_2": False, "epsilon": 1e-4})):
        got = fp8core.quantize_blockwise(upload(x, 1), fmt, block=block, **kw)
        ref = fp8core.quantize_blockwise(x, fmt, block=block, **kw)
        np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=f"{fmt} {kw}")
        np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv), err_msg=f"{fmt} {kw}")
        for out in ("float32", "float16"):
            y = fp8core.dequantize_blockwise(got, out, fmt=fmt)
            np.testing.assert_array_equal(bits(y), bits(fp8core.dequantize_blockwise(ref, out)))


@pytest.mark.parametrize("kind", ["1x32", "1x128", "128x128"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (130, 7), (257, 33)], ids=str)
def test_gemm_scale_layouts(block_dev, kind, shape, rng):
    dtype = np.uint8 if kind == "1x32" else np.float32
    s = rng.integers(0, 255, shape).astype(dtype) if kind == "1x32" else rng.random(shape).astype(dtype)
    got = cuda_blocks.gemm_scale(wrap(upload(s)), kind)
    np.testing.assert_array_equal(bits(got), bits(selftest.gemm_scale_oracle(s, kind)))
    np.testing.assert_array_equal(bits(got), bits(cpu_blocks.gemm_scale(wrap(s), kind)))


def _amax_sweep(rng) -> np.ndarray:
    """One block amax per row: every fp32 binade from the subnormals to the top, each with random mantissas and
    its ends (the smallest and largest value), then 0, the largest subnormal and the largest float."""
    bits = []
    for e in range(0, 255):
        mant = [0, 0x7FFFFF, *rng.integers(1, 0x7FFFFF, 3)]
        bits += [(e << 23) | int(m) for m in mant]
    bits += [0, 0x007FFFFF, 0x7F7FFFFF, 1, 2, 3]
    return np.array(bits, np.uint32).view(np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_block_scales_over_every_binade(block_dev, fmt, rng):
    """The 1x128 and 128x128 scales (two fp32 divisions, div.rn.f32) against the CPU's fp64 rule, by bits, for a
    block amax in every fp32 binade, subnormal to FLT_MAX, with and without power-of-2 scales and a subnormal
    epsilon: the fp32 quotient equals fp32(fp64 quotient) there (the argument in common.cuh)."""
    amax = _amax_sweep(rng)
    x = (rng.random((amax.size, 128)) * amax[:, None]).astype(np.float32)
    x[np.arange(amax.size), rng.integers(0, 128, amax.size)] = amax * np.where(rng.random(amax.size) < 0.5, -1, 1)
    tiles = amax[::40]  # 128x128: one tile per amax of a sparser sweep, its peak at a random place
    t = (rng.random((128, 128 * tiles.size)) * np.repeat(tiles, 128)[None, :]).astype(np.float32)
    t[rng.integers(0, 128, tiles.size), 128 * np.arange(tiles.size) + rng.integers(0, 128, tiles.size)] = tiles
    for kw in ({"power_of_2": False}, {"power_of_2": True}, {"power_of_2": False, "epsilon": 1e-40}):
        for block, xs in (("1x128", x), ("128x128", t)):
            got = fp8core.quantize_blockwise(upload(xs), fmt, block=block, **kw)
            ref = fp8core.quantize_blockwise(xs, fmt, block=block, **kw)
            np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv), err_msg=f"{block} {kw}")
            np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=f"{block} {kw}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (37, 40)], ids=str)
def test_axiswise(block_dev, dtype, shape, rng):
    """One scale per row and per column (quantize_rowwise): a warp per row, a thread per column, against the CPU
    reference by bits, with NaN, inf, zero and subnormal rows and columns."""
    x = data(rng, shape, dtype)
    if shape[0] >= 4 and shape[1] >= 4:
        x[0, 1], x[1, 0], x[2, :], x[:, 2] = np.nan, np.inf, 0.0, np.float32(1e-41).astype(x.dtype)
    for fmt, kw in (("e4m3", {}), ("e5m2", {"power_of_2": False, "epsilon": 1e-4})):
        for axis in (-1, 0):
            got = fp8core.quantize_rowwise(upload(x, 1), fmt, axis=axis, **kw)
            ref = fp8core.quantize_rowwise(x, fmt, axis=axis, **kw)
            np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=f"{fmt} {kw} {axis}")
            np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv), err_msg=f"{fmt} {kw} {axis}")
            y = fp8core.dequantize_rowwise(got, "bfloat16", fmt=fmt)
            np.testing.assert_array_equal(bits(y), bits(fp8core.dequantize_rowwise(ref, "bfloat16")))


@pytest.mark.parametrize("axis", [-1, 0])
def test_axiswise_empty_rows_and_columns_get_scale_one(block_dev, axis):
    x = np.zeros((0, 5) if axis == 0 else (5, 0), np.float32)
    got = fp8core.quantize_rowwise(upload(x), axis=axis)
    assert got.scale_inv.shape == ((1, 5) if axis == 0 else (5, 1))
    np.testing.assert_array_equal(bits(got.scale_inv), bits(np.ones(got.scale_inv.shape, np.float32)))
