"""amax, quantize (delayed and current scaling), dequantize and the multi-tensor forms: the emulated CUDA path
against the CPU backend, by bits, over sizes (empty, 1, odd, prime, several blocks), misaligned heads (1-15
elements), tails and special values."""

import numpy as np
import pytest

import device
import fp8core
from fp8core.formats import ENCODINGS
from arrays import DTYPES, bits, data, upload

SIZES = [0, 1, 7, 16, 31, 257, 4099, 65537]


def f32(*v):
    return np.array(v, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_and_amax(dev, dtype, n, rng):
    for offset in (0, 1, 3, 15) if n > 16 else (0, 5):
        x = data(rng, (n,), dtype)
        for fmt in (f.value for f in ENCODINGS):
            slot, ref_slot = device.asarray(f32(-0.0)), f32(-0.0)
            q = fp8core.quantize(upload(x, offset), device.asarray(f32(0.37)), fmt, amax_out=slot)
            r = fp8core.quantize(x, f32(0.37), fmt, amax_out=ref_slot)
            np.testing.assert_array_equal(bits(q), bits(r), err_msg=f"{fmt} offset={offset}")
            np.testing.assert_array_equal(bits(slot), bits(ref_slot))
        np.testing.assert_array_equal(bits(fp8core.amax(upload(x, offset))), bits(fp8core.amax(x)))


@pytest.mark.parametrize("offset", range(16))
def test_every_misaligned_head(dev, offset, rng):
    x = data(rng, (1000,), np.float16)
    q = fp8core.quantize(upload(x, offset), 3.0, "e5m2")  # a Python number: the fill kernel makes the scale
    np.testing.assert_array_equal(bits(q), bits(fp8core.quantize(x, 3.0, "e5m2")))


@pytest.mark.parametrize("start", [0.0, -0.0, -1.0, 1e30, float("nan")])
def test_amax_slot_merges(dev, start, rng):
    x = data(rng, (3000,), np.float32, specials=False)
    for xs in (x, x[:0]):
        slot, ref = device.asarray(f32(start)), f32(start)
        fp8core.quantize(upload(xs), 1.0, "e4m3", amax_out=slot)
        fp8core.quantize(xs, 1.0, "e4m3", amax_out=ref)
        np.testing.assert_array_equal(bits(slot), bits(ref))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 33, 5000, 100003])
def test_quantize_dynamic(dev, dtype, n, rng):
    x = data(rng, (n,), dtype)
    for kw in ({}, {"margin": 2, "power_of_2": True}, {"epsilon": 1e-3}):
        got = fp8core.quantize_dynamic(upload(x, 1), "e4m3", **kw)
        ref = fp8core.quantize_dynamic(x, "e4m3", **kw)
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=str(kw))


def test_quantize_dynamic_with_reduce(dev, rng):
    x = data(rng, (7777,), np.float32, specials=False)
    doubled = lambda a: a.__setitem__(..., a * 2)  # noqa: E731 (a MAX-reduce that found a larger amax elsewhere)
    got = fp8core.quantize_dynamic(upload(x), "e5m2", reduce=doubled)
    ref = fp8core.quantize_dynamic(x, "e5m2", reduce=doubled)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(bits(g), bits(r))


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", [f.value for f in ENCODINGS])
def test_dequantize_every_code(dev, fmt, out_dtype):
    codes = np.tile(np.arange(256, dtype=np.uint8), 9)[:2049]
    q = codes.view(fp8core.as_format(fmt).numpy_dtype)
    for offset in (0, 3):
        for s in (f32(1.0), f32(2.0 ** -130), f32(3e38)):
            got = fp8core.dequantize(upload(codes, offset), device.asarray(s), out_dtype, fmt=fmt)
            np.testing.assert_array_equal(bits(got), bits(fp8core.dequantize(q, s, out_dtype)))


def test_a_cupy_uint16_array_is_bfloat16(dev, rng):
    """CuPy has no bfloat16: a bare CuPy uint16 array (no Tensor naming it) is bf16 storage, as fp8core's own bf16
    results for CuPy are: read as the CPU reads ml_dtypes' bfloat16, and a bf16 result goes back in."""
    x = data(rng, (37, 24), DTYPES[1])
    xd = upload(x).data  # the bare storage array
    assert type(xd) is device.ndarray and xd.dtype == np.uint16
    for got, ref in [([fp8core.quantize(xd, 0.37, "e5m2")], [fp8core.quantize(x, 0.37, "e5m2")]),
                     (fp8core.cast_transpose(xd, 2.0, "e4m3"), fp8core.cast_transpose(x, 2.0, "e4m3")),
                     (fp8core.quantize_dynamic(xd, "e4m3"), fp8core.quantize_dynamic(x, "e4m3")),
                     ([fp8core.amax(xd)], [fp8core.amax(x)])]:
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(bits(g), bits(r))
    y = fp8core.dequantize(fp8core.quantize(xd, 0.37, "e5m2"), 0.5, "bfloat16", fmt="e5m2")
    assert type(y) is device.ndarray and y.dtype == np.uint16
    np.testing.assert_array_equal(bits(fp8core.quantize(y, 1.0, "e4m3")),
                                  bits(fp8core.quantize(y.get().view(DTYPES[1]), 1.0, "e4m3")))
    with pytest.raises(TypeError, match=r"^q: expected fp8 data .*, got bfloat16; quantize it first"):
        fp8core.dequantize(xd, 1.0)


def test_multi_tensor_lists(dev, rng):
    """70 tensors (two launches of at most 64), mixed sizes with empty members, mixed dtypes and formats."""
    sizes = [int(s) for s in rng.integers(0, 3000, 70)]
    sizes[3] = sizes[40] = 0
    sizes[7] = 70000
    xs = [data(rng, (n,), DTYPES[i % 3]) for i, n in enumerate(sizes)]
    fmts = ["e4m3" if i % 2 else "e5m2" for i in range(70)]
    scales = (rng.random(70) + 0.5).astype(np.float32)
    got_a = fp8core.multi_amax([upload(x, i % 5) for i, x in enumerate(xs)])
    np.testing.assert_array_equal(bits(got_a), bits(fp8core.multi_amax(xs)))
    slots, ref_slots = device.asarray(np.full(70, -0.0, np.float32)), np.full(70, -0.0, np.float32)
    got = fp8core.multi_quantize([upload(x) for x in xs], device.asarray(scales), fmts, amax_out=slots)
    ref = fp8core.multi_quantize(xs, scales, fmts, amax_out=ref_slots)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(bits(g), bits(r))
    np.testing.assert_array_equal(bits(slots), bits(ref_slots))


def test_compute_scale(dev):
    amax = f32(0, -0.0, 1e-45, 1e-38, 1, 448, 3e38, np.inf, np.nan, 7.5)
    prev = f32(*range(1, 11))
    for kw in ({}, {"margin": 3, "power_of_2": True}, {"epsilon": 1e-6}):
        got = fp8core.compute_scale(device.asarray(amax), "e4m3", previous=device.asarray(prev), **kw)
        ref = fp8core.compute_scale(amax, "e4m3", previous=prev, **kw)
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=str(kw))


def test_an_array_not_aligned_to_its_elements_is_refused_as_on_the_cpu_before_any_launch(dev, rng):
    """A device array whose data starts past a multiple of its element size (a view at an odd byte offset) would
    fault in the kernels' 2-, 4- and 8-byte accesses: every kind of array argument is refused by name, with the
    CPU backend's own message for the same call on host arrays (tests/test_bad_input.py), before any launch (scales
    are given as arrays: a Python number becomes a device array by a launch of its own, before the later arguments
    are read)."""
    import ml_dtypes

    from arrays import misaligned

    x = data(rng, (4, 64), np.float32, specials=False)
    bf16, one = x.astype(ml_dtypes.bfloat16), np.ones(1, np.float32)
    q, f16 = x.astype(ml_dtypes.float8_e4m3fn), data(rng, (4, 64), np.float16, specials=False)
    cases = [  # (argument, call(m)) with m(array, bytes past the boundary) making the call's arrays
        ("x", lambda m: fp8core.amax(m(bf16, 1))),
        ("x", lambda m: fp8core.quantize(m(x, 2), m(one, 0))),
        ("scale", lambda m: fp8core.quantize(m(x, 0), m(one, 3))),
        ("amax_out", lambda m: fp8core.quantize(m(x, 0), m(one, 0), amax_out=m(one, 1))),
        ("x", lambda m: fp8core.quantize_dynamic(m(f16, 1))),
        ("out", lambda m: fp8core.dequantize(m(q, 0), m(one, 0), "bfloat16", out=m(bf16, 1))),
        ("scale_inv", lambda m: fp8core.dequantize(m(q, 0), m(one, 2))),
        ("x", lambda m: fp8core.cast_transpose(m(x, 1), 1.0)),
        ("xs[1]", lambda m: fp8core.multi_amax([m(x, 0), m(bf16, 1)])),
        ("x", lambda m: fp8core.quantize_mxfp8(m(bf16, 1))),
        ("x", lambda m: fp8core.quantize_blockwise(m(x, 2))),
        ("x", lambda m: fp8core.quantize_nvfp4(m(bf16, 1))),
        ("rng_state", lambda m: fp8core.quantize_nvfp4(m(x, 0), rounding="stochastic",
                                                       rng_state=m(np.array([5, 6], np.int64), 4))),
        ("history", lambda m: fp8core.scaling.update_in_place(
            m(np.ones((2, 2), np.float32), 1), *(m(np.ones(2, np.float32), 0) for _ in range(2)),
            m(np.full(2, 448, np.float32), 0), m(np.zeros(2, bool), 0), 0, "max", False, 0.0, True)),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError) as on_cpu:
            call(lambda a, by: misaligned(a, by, host=True))
        before = len(device.state.launches)
        with pytest.raises(ValueError) as on_device:
            call(misaligned)
        assert str(on_device.value) == str(on_cpu.value), arg
        assert str(on_device.value).startswith(f"{arg}: its data pointer must be aligned to its "), arg
        assert len(device.state.launches) == before, arg
