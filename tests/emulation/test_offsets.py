"""Every kernel with an alignment-dependent vector path, its inputs and (where the API takes them) its outputs at
each byte offset 0-15 into their allocations, against the CPU backend by bits: each offset takes its own split
between the peeled head, the vector body and the tail, or its own fallback, and a vector access made at an address
its width does not divide is UBSan's misaligned access (offset 2 catches a 16-byte check slipped to 8)."""

import numpy as np
import pytest

import device
import fp8core
from arrays import DTYPES, bits, data, upload

OFFSETS = range(16)


def _out(shape, storage, offset):
    """An uninitialised result array of ``storage`` dtype, ``offset`` bytes into its allocation."""
    storage = np.dtype(storage)
    assert offset % storage.itemsize == 0
    n = int(np.prod(shape)) * storage.itemsize
    return device.empty(n + offset, np.uint8)[offset:offset + n].view(storage).reshape(shape)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_tensor_kernels(dev, dtype, offset, rng):
    """amax, quantize (into a misaligned q), quantize_dynamic, the multi-tensor forms, dequantize (from and into
    misaligned arrays): x ``offset`` elements in, q ``offset`` bytes in."""
    x = data(rng, (203,), dtype)
    xd = upload(x, offset)
    np.testing.assert_array_equal(bits(fp8core.amax(xd)), bits(fp8core.amax(x)))
    for fmt in ("e4m3", "e5m2"):
        q = fp8core.quantize(xd, device.asarray(np.float32([0.37])), fmt, out=_out((203,), np.uint8, offset))
        ref = fp8core.quantize(x, np.float32([0.37]), fmt)
        np.testing.assert_array_equal(bits(q), bits(ref), err_msg=fmt)
        for g, r in zip(fp8core.quantize_dynamic(xd, fmt), fp8core.quantize_dynamic(x, fmt)):
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=fmt)
        for out_dtype, storage in (("float32", np.float32), ("bfloat16", np.uint16), ("float16", np.float16)):
            y = _out((203,), storage, offset - offset % np.dtype(storage).itemsize)  # as near offset as it can be
            got = fp8core.dequantize(upload(ref, offset), device.asarray(np.float32([3.0])), out_dtype, fmt=fmt,
                                     out=y)
            np.testing.assert_array_equal(bits(got), bits(fp8core.dequantize(ref, np.float32([3.0]), out_dtype)),
                                          err_msg=f"{fmt} {out_dtype}")
    xs = [x, x[:77], x[:9]]
    got = fp8core.multi_amax([upload(v, offset) for v in xs])
    np.testing.assert_array_equal(bits(got), bits(fp8core.multi_amax(xs)))
    scales = np.float32([0.5, 2.0, 7.0])
    got = fp8core.multi_quantize([upload(v, offset) for v in xs], device.asarray(scales), "e4m3",
                                 out=[_out(v.shape, np.uint8, offset) for v in xs])
    for g, r in zip(got, fp8core.multi_quantize(xs, scales, "e4m3")):
        np.testing.assert_array_equal(bits(g), bits(r))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_into_q_off_x(dev, dtype, offset, rng):
    """quantize, quantize_dynamic and multi_quantize from an aligned x into q ``offset`` bytes in: q's vectors then sit
    at every alignment against x's, each stored by store8's widest stores (byte, 16-bit, 32-bit, 64-bit)."""
    x = data(rng, (203,), dtype)
    xd = upload(x)
    for fmt in ("e4m3", "e5m2"):
        q = fp8core.quantize(xd, device.asarray(np.float32([0.37])), fmt, out=_out((203,), np.uint8, offset))
        np.testing.assert_array_equal(bits(q), bits(fp8core.quantize(x, np.float32([0.37]), fmt)), err_msg=fmt)
        got = fp8core.quantize_dynamic(xd, fmt, out=(_out((203,), np.uint8, offset), None, None))
        for g, r in zip(got, fp8core.quantize_dynamic(x, fmt)):
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=fmt)
    xs = [x, x[:77], x[:9]]
    scales = np.float32([0.5, 2.0, 7.0])
    got = fp8core.multi_quantize([upload(v) for v in xs], device.asarray(scales), "e4m3",
                                 out=[_out(v.shape, np.uint8, offset) for v in xs])
    for g, r in zip(got, fp8core.multi_quantize(xs, scales, "e4m3")):
        np.testing.assert_array_equal(bits(g), bits(r))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cast_transpose(dev, dtype, offset, rng):
    """Full 64 x 64 tiles (the tiled path, each stream vectorised where its alignment allows) and an edge."""
    x = data(rng, (128, 144), dtype)
    out = (_out((128, 144), np.uint8, offset), _out((144, 128), np.uint8, offset))
    got = fp8core.cast_transpose(upload(x, offset), device.asarray(np.float32([2.0])), "e4m3", out=out)
    for g, r in zip(got, fp8core.cast_transpose(x, np.float32([2.0]), "e4m3")):
        np.testing.assert_array_equal(bits(g), bits(r))
    q = got[0].get().view(np.uint8)
    qt = fp8core.transpose(upload(q, offset), fmt="e4m3", out=_out((144, 128), np.uint8, offset))
    np.testing.assert_array_equal(bits(qt), q.T)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_kernels(block_dev, dtype, offset, rng):
    """MXFP8 (both halves), 1x128 and 128x128 from x ``offset`` elements in; their dequantization from q ``offset``
    bytes in."""
    x = data(rng, (64, 256), dtype)
    xd = upload(x, offset)
    for g, r in zip(fp8core.quantize_mxfp8_both(xd, "e4m3"), fp8core.quantize_mxfp8_both(x, "e4m3")):
        np.testing.assert_array_equal(bits(g.data), bits(r.data))
        np.testing.assert_array_equal(bits(g.scale), bits(r.scale))
        moved = type(r)(upload(r.data, offset), upload(r.scale))
        np.testing.assert_array_equal(bits(fp8core.dequantize_mxfp8(moved, "float32")),
                                      bits(fp8core.dequantize_mxfp8(r, "float32")))
    for block in ("1x128", "128x128"):
        got = fp8core.quantize_blockwise(xd, "e5m2", block=block)
        ref = fp8core.quantize_blockwise(x, "e5m2", block=block)
        np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=block)
        np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv), err_msg=block)
        moved = type(ref)(upload(ref.data, offset), upload(ref.scale_inv))
        np.testing.assert_array_equal(bits(fp8core.dequantize_blockwise(moved, "bfloat16")),
                                      bits(fp8core.dequantize_blockwise(ref, "bfloat16")), err_msg=block)
