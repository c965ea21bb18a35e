"""``out=`` on the core primitives: results written into the caller's arrays bit for bit as without ``out=``,
the same array returned, and every bad slot refused with a named error before anything is written (the same
table on the CPU and, when there is one, on a GPU)."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from conftest import requires_gpu

E4M3, E5M2, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16
_STORAGE = {np.dtype(E4M3): np.uint8, np.dtype(E5M2): np.uint8, np.dtype(BF16): np.uint16}


class Cpu:
    """Arrays as NumPy in their logical dtypes."""

    name = "cpu"

    def put(self, a):
        return np.ascontiguousarray(a)

    def empty(self, shape, dtype):
        return np.full(shape, 0x5A, np.uint8).view(dtype) if np.dtype(dtype).itemsize == 1 else \
            np.full(shape, 7, dtype)

    def raw(self, nbytes):
        return np.full(nbytes, 0x5A, np.uint8)

    def bits(self, a):
        a = np.asarray(a)
        return a.view(np.uint8).copy() if a.size else a.copy()


class Cuda(Cpu):
    """Arrays as CuPy in storage dtypes (CuPy has no fp8 or bf16): fp8 arguments take fmt=."""

    name = "cuda"

    def put(self, a):
        import cupy

        a = np.ascontiguousarray(a)
        return cupy.asarray(a.view(_STORAGE.get(a.dtype, a.dtype)))

    def empty(self, shape, dtype):
        return self.put(super().empty(shape, dtype))

    def raw(self, nbytes):
        return self.put(super().raw(nbytes))

    def bits(self, a):
        import cupy

        return super().bits(cupy.asnumpy(a))


BACKENDS = [pytest.param(Cpu(), id="cpu"), pytest.param(Cuda(), id="cuda", marks=requires_gpu)]


@pytest.fixture
def x(rng):
    v = (rng.standard_normal((37, 24)) * 50).astype(np.float32)
    v.reshape(-1)[:5] = [np.nan, np.inf, -0.0, 1e-40, 1e30]
    return v


# ---- results: the same bits as without out=, in the caller's array ----------------------------------------

@pytest.mark.parametrize("env", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(37, 24), (5, 3, 8), (0, 16), (1, 1)])
def test_each_primitive_writes_the_same_bits_into_out(env, dtype, shape, rng):
    host = (rng.standard_normal(shape) * 30).astype(np.float32).astype(getattr(ml_dtypes, dtype, dtype))
    xd = env.put(host)
    rows = int(np.prod(shape[:-1]))
    fmt = "e5m2"

    q = env.empty(shape, E5M2)
    assert fp8core.quantize(xd, 0.5, fmt, out=q) is q
    want_q = fp8core.quantize(xd, 0.5, fmt)
    np.testing.assert_array_equal(env.bits(q), env.bits(want_q))

    q2, qt = env.empty(shape, E5M2), env.empty((shape[-1], rows), E5M2)
    got = fp8core.cast_transpose(xd, 0.5, fmt, out=(q2, qt))
    assert got[0] is q2 and got[1] is qt
    want = fp8core.cast_transpose(xd, 0.5, fmt)
    np.testing.assert_array_equal(env.bits(q2), env.bits(want[0]))
    np.testing.assert_array_equal(env.bits(qt), env.bits(want[1]))

    t = env.empty((shape[-1], rows), E5M2)
    assert fp8core.transpose(q, fmt=fmt, out=t) is t
    np.testing.assert_array_equal(env.bits(t), env.bits(want[1]))

    y = env.empty(shape, BF16)
    assert fp8core.dequantize(q, 3.0, "bfloat16", fmt=fmt, out=y) is y
    np.testing.assert_array_equal(env.bits(y), env.bits(fp8core.dequantize(q, 3.0, "bfloat16", fmt=fmt)))

    slots = (env.empty(shape, E5M2), env.empty((1,), np.float32), env.empty((1,), np.float32))
    got = fp8core.quantize_dynamic(xd, fmt, margin=1, out=slots)
    assert all(g is s for g, s in zip(got, slots))
    for g, w in zip(got, fp8core.quantize_dynamic(xd, fmt, margin=1)):
        np.testing.assert_array_equal(env.bits(g), env.bits(w))


@pytest.mark.parametrize("env", BACKENDS)
def test_partial_outs_allocate_the_rest(env, x):
    xd = env.put(x)
    qt = env.empty((24, 37), E4M3)
    q, got_t = fp8core.cast_transpose(xd, 2.0, "e4m3", out=(None, qt))
    assert got_t is qt
    np.testing.assert_array_equal(env.bits(qt), env.bits(fp8core.transpose(q, fmt="e4m3")))
    q_only = env.empty(x.shape, E4M3)
    got = fp8core.quantize_dynamic(xd, "e4m3", out=q_only)
    assert got[0] is q_only
    np.testing.assert_array_equal(env.bits(got[2]), env.bits(fp8core.amax(xd)))


@pytest.mark.parametrize("env", BACKENDS)
def test_multi_quantize_into_outs(env, x):
    xs = [env.put(x), env.put(x[:5].astype(BF16))]
    outs = [env.empty(x.shape, E4M3), None]
    scales = env.put(np.array([2.0, 0.25], np.float32))
    got = fp8core.multi_quantize(xs, scales, ["e4m3", "e5m2"], out=outs)
    assert got[0] is outs[0]
    want = fp8core.multi_quantize(xs, scales, ["e4m3", "e5m2"])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(env.bits(g), env.bits(w))


@requires_gpu
def test_cupy_uint16_is_bfloat16(rng):
    """CuPy has no bfloat16: a CuPy uint16 array is bf16 storage, in as out (a bf16 result for CuPy is one), so
    every primitive reads it as the CPU reads the same values in ml_dtypes' bfloat16, bit for bit."""
    cpu, gpu = Cpu(), Cuda()
    host = (rng.standard_normal((37, 24)) * 30).astype(np.float32).astype(BF16)
    host.reshape(-1)[:4] = [np.nan, np.inf, -0.0, 1e-40]
    xd = gpu.put(host)
    scales = np.array([2.0, 0.25], np.float32)
    for name, call in [("quantize", lambda x, s: [fp8core.quantize(x, 0.5, "e5m2")]),
                       ("cast_transpose", lambda x, s: fp8core.cast_transpose(x, 0.5, "e4m3")),
                       ("quantize_dynamic", lambda x, s: fp8core.quantize_dynamic(x, "e4m3", margin=1)),
                       ("amax", lambda x, s: [fp8core.amax(x)]),
                       ("multi_quantize", lambda x, s: fp8core.multi_quantize([x, x[:5]], s, "e4m3"))]:
        for g, w in zip(call(xd, gpu.put(scales)), call(host, scales)):
            np.testing.assert_array_equal(gpu.bits(g), cpu.bits(w), err_msg=name)
    y = fp8core.dequantize(fp8core.quantize(xd, 0.5, "e5m2"), 2.0, "bfloat16", fmt="e5m2")
    assert y.dtype == np.uint16  # a bf16 result for CuPy, which goes back in as bf16
    np.testing.assert_array_equal(gpu.bits(fp8core.quantize(y, 1.0, "e4m3")),
                                  cpu.bits(fp8core.quantize(cpu.put(y.get().view(BF16)), 1.0, "e4m3")))


# ---- the error table --------------------------------------------------------------------------------------
# Each row builds (call, arrays that must come out of the failure untouched, exception, message).

def _quantize(env, out, x=None):
    xd = env.put(np.ones((4, 8), np.float32)) if x is None else x
    return (lambda: fp8core.quantize(xd, 1.0, "e4m3", out=out)), [xd, out]


def _overlap_x(env):
    buf = env.raw(256)
    x = buf[:128].view(np.float32).reshape(4, 8)
    x[...] = 1
    return _quantize(env, buf[64:96].reshape(4, 8), x)


def _cast_transpose(env, out):
    xd = env.put(np.ones((4, 8), np.float32))
    return (lambda: fp8core.cast_transpose(xd, 1.0, "e4m3", out=out)), [xd, *(o for o in out if o is not None)] \
        if isinstance(out, tuple) else [xd, out]


def _ct_outs_overlap(env):
    buf = env.raw(64)
    return _cast_transpose(env, (buf[:32].reshape(4, 8), buf[16:48].reshape(8, 4)))


def _dequantize(env, out, q=None):
    qd = env.put(np.full((4, 8), 0x38, np.uint8)) if q is None else q
    return (lambda: fp8core.dequantize(qd, 1.0, "bfloat16", fmt="e4m3", out=out)), [qd, out]


def _dequantize_overlap(env):
    buf = env.raw(96)
    return _dequantize(env, buf[:64].view(np.uint16).reshape(4, 8), buf[32:64].reshape(4, 8))


def _transpose(env, out):
    qd = env.put(np.full((4, 8), 0x38, np.uint8))
    return (lambda: fp8core.transpose(qd, fmt="e4m3", out=out)), [qd, out]


def _dynamic(env, out):
    xd = env.put(np.ones((4, 8), np.float32))
    return (lambda: fp8core.quantize_dynamic(xd, "e4m3", out=out)), [xd, *(o for o in out if o is not None)]


def _multi(env, outs):
    xs = [env.put(np.ones((4, 8), np.float32)), env.put(np.ones((2, 16), np.float32))]
    scales = env.put(np.ones(2, np.float32))
    return (lambda: fp8core.multi_quantize(xs, scales, "e4m3", out=outs)), \
        [*xs, scales, *(o for o in outs if o is not None)]


def _multi_overlap(env):
    buf = env.raw(160)
    x1 = buf[:128].view(np.float32).reshape(2, 16)
    x1[...] = 1
    xs = [env.put(np.ones((4, 8), np.float32)), x1]
    scales = env.put(np.ones(2, np.float32))
    out0 = buf[96:128].reshape(4, 8)
    return (lambda: fp8core.multi_quantize(xs, scales, "e4m3", out=[out0, None])), [buf]


def _device(env, make):
    """An out on the other device than the input."""
    other = Cpu() if env.name == "cuda" else None
    return make(env, other.empty((4, 8), E4M3))


TABLE = [
    # id, builder(env), exception, message; "cpu" in the id: NumPy-only dtypes or flags
    ("quantize-shape", lambda e: _quantize(e, e.empty((5, 8), E4M3)), ValueError,
     r"out: expected shape \(4, 8\), got \(5, 8\)"),
    ("quantize-dtype", lambda e: _quantize(e, e.empty((4, 8), np.float32)), TypeError,
     r"out: expected float8_e4m3fn \(or uint8 storage\), got float32"),
    ("quantize-format-cpu", lambda e: _quantize(e, e.empty((4, 8), E5M2)), TypeError,
     r"out: expected float8_e4m3fn \(or uint8 storage\), got float8_e5m2"),
    ("quantize-strided", lambda e: _quantize(e, e.empty((4, 16), E4M3)[:, ::2]), ValueError,
     r"out: expected a contiguous \(row-major\) array"),
    ("quantize-readonly-cpu", lambda e: _quantize(e, np.frombuffer(bytes(32), E4M3).reshape(4, 8)), ValueError,
     r"out: is read-only"),
    ("quantize-overlaps-x", _overlap_x, ValueError, r"out: overlaps x in memory"),
    ("quantize-two-outs", lambda e: _quantize(e, (e.empty((4, 8), E4M3), e.empty((4, 8), E4M3))), ValueError,
     r"out: expected an array or a tuple of 1 arrays"),
    ("quantize-not-an-array", lambda e: _quantize(e, "q"), TypeError, r"out: expected an array"),
    ("cast_transpose-shape-of-q_t", lambda e: _cast_transpose(e, (e.empty((4, 8), E4M3), e.empty((4, 8), E4M3))),
     ValueError, r"out\[1\]: expected shape \(8, 4\), got \(4, 8\)"),
    ("cast_transpose-dtype-of-q", lambda e: _cast_transpose(e, (e.empty((4, 8), np.float16), None)), TypeError,
     r"out\[0\]: expected float8_e4m3fn"),
    ("cast_transpose-outs-overlap", _ct_outs_overlap, ValueError, r"out\[0\]: overlaps out\[1\] in memory"),
    ("cast_transpose-one-array", lambda e: _cast_transpose(e, e.empty((4, 8), E4M3)), ValueError,
     r"out: expected a tuple of 2 arrays"),
    ("dequantize-dtype", lambda e: _dequantize(e, e.empty((4, 8), np.float16)), TypeError,
     r"out: expected bfloat16 \(or uint16 storage\), got float16"),
    ("dequantize-shape", lambda e: _dequantize(e, e.empty((32,), BF16)), ValueError,
     r"out: expected shape \(4, 8\), got \(32,\)"),
    ("dequantize-overlaps-q", _dequantize_overlap, ValueError, r"out: overlaps q in memory"),
    ("transpose-shape", lambda e: _transpose(e, e.empty((4, 8), E4M3)), ValueError,
     r"out: expected shape \(8, 4\), got \(4, 8\)"),
    ("transpose-strided", lambda e: _transpose(e, e.empty((8, 8), E4M3)[:, ::2]), ValueError,
     r"out: expected a contiguous"),
    ("quantize_dynamic-scale_inv-shape",
     lambda e: _dynamic(e, (e.empty((4, 8), E4M3), e.empty((2,), np.float32), None)), ValueError,
     r"out\[1\]: expected shape \(1,\), got \(2,\)"),
    ("quantize_dynamic-amax-dtype",
     lambda e: _dynamic(e, (e.empty((4, 8), E4M3), None, e.empty((1,), np.float16))), TypeError,
     r"out\[2\]: expected float32, got float16"),
    ("quantize_dynamic-arity", lambda e: _dynamic(e, (e.empty((4, 8), E4M3), None)), ValueError,
     r"out: expected a tuple of 3 arrays"),
    ("multi_quantize-shape", lambda e: _multi(e, [e.empty((4, 8), E4M3), e.empty((4, 8), E4M3)]), ValueError,
     r"out\[1\]: expected shape \(2, 16\), got \(4, 8\)"),
    ("multi_quantize-count", lambda e: _multi(e, [e.empty((4, 8), E4M3)]), ValueError,
     r"out: expected a tuple of 2 arrays"),
    ("multi_quantize-overlaps-an-input", _multi_overlap, ValueError, r"out\[0\]: overlaps xs\[1\] in memory"),
]

GPU_ONLY = [
    ("quantize-device", lambda e: _device(e, _quantize), ValueError, r"out: is on cpu but x is on cuda:0"),
    ("transpose-device", lambda e: _device(e, lambda e2, o: _transpose(e2, o.reshape(8, 4))), ValueError,
     r"out: is on cpu but q is on cuda:0"),
]


def _rows():
    for env in (Cpu(), Cuda()):
        marks = [requires_gpu] if env.name == "cuda" else []
        for rid, build, exc, msg in TABLE + (GPU_ONLY if env.name == "cuda" else []):
            if env.name == "cuda" and rid.endswith("-cpu"):
                continue  # CuPy has no fp8 dtypes and no read-only arrays
            yield pytest.param(env, build, exc, msg, id=f"{env.name}-{rid}", marks=marks)


@pytest.mark.parametrize("env, build, exc, msg", list(_rows()))
def test_bad_out_is_refused_before_anything_is_written(env, build, exc, msg):
    call, arrays = build(env)
    # a tuple given as out is its arrays (CuPy has no implicit conversion of a tuple of arrays to one array)
    arrays = [a for x in arrays for a in (x if isinstance(x, tuple) else (x,)) if not isinstance(a, str)]
    before = [env.bits(a) for a in arrays]
    with pytest.raises(exc, match=msg):
        call()
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(env.bits(a), b)


@pytest.mark.parametrize("env", BACKENDS)
def test_overlap_is_by_byte_ranges(env):
    """An out that ends where x begins shares no memory with it and is written; one byte further is refused."""
    buf = env.raw(160)
    x = buf[32:160].view(np.float32).reshape(4, 8)
    x[...] = 1.5
    ref = env.bits(fp8core.quantize(env.put(np.full((4, 8), 1.5, np.float32)), 1.0, "e4m3"))
    out = buf[:32].reshape(4, 8)
    assert fp8core.quantize(x, 1.0, "e4m3", out=out) is out
    assert (env.bits(out) == ref).all()
    with pytest.raises(ValueError, match=r"^out: overlaps x in memory"):
        fp8core.quantize(x, 1.0, "e4m3", out=buf[1:33].reshape(4, 8))
