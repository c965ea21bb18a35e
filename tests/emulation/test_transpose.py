"""transpose and cast_transpose: 64x64 tiles through shared memory, full, edge, misaligned and 1x1 tiles; the
emulated CUDA path against the CPU backend, by bits."""

import numpy as np
import pytest

import device
import fp8core
from arrays import DTYPES, bits, data, upload

# Full 128 x 128 tiles with every pairing of the stores' vector conditions: (136, 128) stores q by 16 bytes and q_t
# by 8 (its rows 8-byte aligned), (128, 136) the other way round; (128, 128) both vectorised, (200, 200) neither;
# (131, 133) and (130, 129) the stores at odd and 2-byte-aligned addresses (store16's funnel-shifted words).
SHAPES = [(1, 1), (1, 70), (70, 1), (64, 64), (48, 80), (65, 63), (128, 256), (100, 200), (129, 67), (0, 5),
          (136, 128), (128, 136), (128, 128), (200, 200), (131, 133), (130, 129)]


def f32(*v):
    return np.array(v, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cast_transpose(dev, dtype, shape, rng):
    x = data(rng, shape, dtype)
    for offset, fmt in ((0, "e4m3"), (1, "e5m2"), (8, "e4m3")):
        slot, ref_slot = device.asarray(f32(-1.0)), f32(-1.0)
        q, qt = fp8core.cast_transpose(upload(x, offset), device.asarray(f32(0.75)), fmt, amax_out=slot)
        rq, rqt = fp8core.cast_transpose(x, f32(0.75), fmt, amax_out=ref_slot)
        np.testing.assert_array_equal(bits(q), bits(rq), err_msg=f"q {fmt} offset={offset}")
        np.testing.assert_array_equal(bits(qt), bits(rqt), err_msg=f"q_t {fmt} offset={offset}")
        np.testing.assert_array_equal(bits(slot), bits(ref_slot))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose(dev, shape, rng):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    q = codes.view(fp8core.as_format("e4m3").numpy_dtype)
    for offset in (0, 1, 16):
        got = fp8core.transpose(upload(codes, offset), fmt="e4m3")
        np.testing.assert_array_equal(bits(got), bits(fp8core.transpose(q)), err_msg=f"offset={offset}")
