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


LENGTHS = range(1, 41)
MX_BLOCK = 32


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_heads_and_tails(dev, dtype, offset, rng):
    """quantize of every length 1-40 from x ``offset`` elements in, into q at every byte offset in turn (the length's
    own, so that each offset meets each head and tail): the 0-7 elements before x's first 16-byte vector and after
    its last go in pieces of up to 8 codes stored by store_partial8 (a byte, 16-, 32- or 64-bit store at q's
    alignment), and a range too short for a vector is one or two such pieces; quantize_dynamic (the same loop walked
    in reverse) likewise. Specials included; the amax slot too."""
    x = data(rng, (40,), dtype)
    for n in LENGTHS:
        q_offset = (offset + 5 * n) % 16
        slot = device.asarray(np.float32([-0.0]))
        got = fp8core.quantize(upload(x[:n], offset), device.asarray(np.float32([0.37])), "e4m3", amax_out=slot,
                               out=_out((n,), np.uint8, q_offset))
        ref_slot = np.float32([-0.0])
        ref = fp8core.quantize(x[:n], np.float32([0.37]), "e4m3", amax_out=ref_slot)
        label = f"n={n} x+{offset} q+{q_offset}"
        np.testing.assert_array_equal(bits(got), bits(ref), err_msg=label)
        np.testing.assert_array_equal(bits(slot), bits(ref_slot), err_msg=label)
        got = fp8core.quantize_dynamic(upload(x[:n], offset), "e5m2", out=(_out((n,), np.uint8, q_offset), None, None))
        for g, r in zip(got, fp8core.quantize_dynamic(x[:n], "e5m2")):
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=f"dynamic {label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blockwise_row_tails(block_dev, dtype, rng):
    """1x128 and 128x128 over rows of every length 1-40 (3 rows, so that each row starts at its own alignment in q),
    x ``cols % 16`` elements in: a row's last 1-7 codes go by store_partial8 at their address's alignment."""
    for cols in LENGTHS:
        x = data(rng, (3, cols), dtype)
        xd = upload(x, cols % 16)
        for block in ("1x128", "128x128"):
            got = fp8core.quantize_blockwise(xd, "e4m3", block=block)
            ref = fp8core.quantize_blockwise(x, "e4m3", block=block)
            np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=f"{block} cols={cols}")
            np.testing.assert_array_equal(bits(got.scale_inv), bits(ref.scale_inv), err_msg=f"{block} cols={cols}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_row_tails(block_dev, dtype, rng):
    """MXFP8 rowwise and both over rows whose last block holds every length 1-31 (cols n and 32 + n, 16 rows: a row
    starts at r cols bytes into q and qc, so an odd cols puts the partial block at each of the 16 alignments in
    turn, an even one at its own few), x ``cols % 16`` elements in: each code of the partial block stored once and
    none past the row, whatever its address's alignment (the guard for a word-stored partial block: a variant that
    stored its last piece as 8 bytes wrote past the row and ASan caught it here)."""
    for n in range(1, MX_BLOCK):
        for cols in (n, MX_BLOCK + n):
            x = data(rng, (16, cols), dtype)
            xd = upload(x, cols % 16)
            label = f"n={n} cols={cols}"
            got = fp8core.quantize_mxfp8(xd, "e4m3")
            ref = fp8core.quantize_mxfp8(x, "e4m3")
            np.testing.assert_array_equal(bits(got.data), bits(ref.data), err_msg=label)
            np.testing.assert_array_equal(bits(got.scale), bits(ref.scale), err_msg=label)
            for g, r in zip(fp8core.quantize_mxfp8_both(xd, "e5m2"), fp8core.quantize_mxfp8_both(x, "e5m2")):
                np.testing.assert_array_equal(bits(g.data), bits(r.data), err_msg=f"both {label}")
                np.testing.assert_array_equal(bits(g.scale), bits(r.scale), err_msg=f"both {label}")
