"""JAX at the boundary, each way in against a twin that does not take it: identical bits and identical errors.

- jax CPU arrays on one device read without asking DLPack for the device (against an array placed by a
  one-device NamedSharding, which asks, and against fp8core's DLPack reader of the same memory);
- NumPy results handed back to JAX through a jitted identity, or jax.device_put above the size where export
  switches, with every fp8/16-bit code and float32 NaN payloads (against the bytes and DLPack's import of
  them); outliving the NumPy result;
- eager ``fp8core.jax`` primitives through their cached jit and untraced, under jit and vmap (against the core
  API on NumPy arrays).
"""

import gc

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core import _tensor  # noqa: E402
from fp8core._dlpack import CPU, Exporter  # noqa: E402
from jax_places import JAX_CPU  # noqa: E402
from producers import DLPackOnly  # noqa: E402


# The CPU fast paths are the subject here: their arrays are made on the CPU device, which is not JAX's default
# on a machine with a GPU (there a jax.Array is read through DLPack, as tests/test_gpu*.py do).


def _named(x):
    """x placed by a one-device NamedSharding on its own device: fp8core asks DLPack where it lives (a
    SingleDeviceSharding tells it without asking)."""
    mesh = jax.sharding.Mesh(list(x.devices()), ("d",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@pytest.fixture(params=["single-device sharding", "named sharding"])
def place(request):
    return (lambda x: x) if request.param == "single-device sharding" else _named


def _every_code(dtype):
    """Every bit pattern of a 1- or 2-byte dtype; float32 specials and NaN payloads."""
    dt = np.dtype(dtype)
    if dt.itemsize == 1:
        return np.arange(256, dtype=np.uint8).view(dt)
    if dt.itemsize == 2:
        return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dt)
    bits = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345,
                     0x7FFFFFFF, 0x00800000, 0x3F800000], np.uint32)
    return bits.view(np.float32)


def _bits(a):
    a = np.asarray(a)
    return a.dtype.name, a.shape, a.tobytes()


READS = [
    ("bf16", lambda: jnp.asarray(_every_code(ml_dtypes.bfloat16))),
    ("f16 2-D", lambda: jnp.asarray(_every_code(np.float16)).reshape(256, 256)),
    ("f32 specials", lambda: jnp.asarray(_every_code(np.float32))),
    ("e4m3", lambda: jnp.asarray(_every_code(ml_dtypes.float8_e4m3fn))),
    ("e5m2 3-D", lambda: jnp.asarray(_every_code(ml_dtypes.float8_e5m2)).reshape(4, 8, 8)),
    ("int32", lambda: jnp.arange(7, dtype=jnp.int32)),
    ("bool", lambda: jnp.asarray([True, False, True])),
    ("0-d", lambda: jnp.float32(3.5) + 0),
    ("empty", lambda: jnp.zeros((0, 5), jnp.bfloat16)),
    ("slice of a jitted result", lambda: jax.jit(lambda v: (v * 2)[1:])(jnp.arange(9.0, dtype=jnp.float32))),
]


@pytest.mark.parametrize("case,make", READS, ids=[r[0] for r in READS])
def test_jax_cpu_read_gives_the_general_paths_view(case, make, place):
    with jax.default_device(JAX_CPU):
        x = place(make())
    t = _tensor.wrap(x, "x")
    assert t.origin == "jax" and t.device == ("cpu", 0) and t.readonly
    assert t.dtype == np.dtype(x.dtype).name and t.data.shape == x.shape
    assert not t.data.flags.writeable
    assert t.data.tobytes() == np.asarray(x).tobytes()


# Each primitive, every array argument passed through `r` (how fp8core is made to read it).
OPS = {
    "amax": lambda x, s, r: fp8core.amax(r(x)),
    "quantize": lambda x, s, r: fp8core.quantize(r(x), r(s), "e4m3"),
    "quantize_dynamic": lambda x, s, r: fp8core.quantize_dynamic(r(x), "e5m2", margin=1),
    "dequantize": lambda x, s, r: fp8core.dequantize(r(fp8core.quantize(r(x), r(s), "e4m3")), r(s), "bfloat16"),
    "cast_transpose": lambda x, s, r: fp8core.cast_transpose(r(x.reshape(4, -1)), r(s), "e4m3"),
    "transpose": lambda x, s, r: fp8core.transpose(r(fp8core.quantize(r(x), 1.0, "e5m2").reshape(-1, 4))),
}


@pytest.mark.parametrize("op", list(OPS))
def test_generic_api_on_jax_arrays_same_bits_every_way_in(op):
    v = _every_code(ml_dtypes.bfloat16)[::7][:9360].copy()  # every exponent, NaNs, infs, subnormals, -0
    got = {}
    with jax.default_device(JAX_CPU):
        x, s = jnp.asarray(v), jnp.asarray([0.25], jnp.float32)
        for way, read in (("single", lambda a: a), ("named", _named), ("dlpack", DLPackOnly)):
            out = OPS[op](x, s, read)
            outs = out if isinstance(out, tuple) else (out,)
            assert all(isinstance(o, jax.Array if way != "dlpack" else np.ndarray) for o in outs)
            got[way] = [_bits(o) for o in outs]
    assert got["single"] == got["named"] == got["dlpack"]


def test_deleted_arrays_give_the_same_error_however_placed():
    messages = []
    for place in (lambda x: x, _named):
        x = place(jnp.ones(4))
        x.delete()
        with pytest.raises(Exception) as info:
            fp8core.amax(x)
        messages.append((type(info.value), str(info.value)))
    assert messages[0] == messages[1]


# Sizes around the switch from the jitted identity to DLPack, in bytes.
SIZES = [0, 1, 16, _tensor._JAX_COPY_MAX, _tensor._JAX_COPY_MAX + 1]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_export_to_jax_keeps_every_bit(dtype, nbytes):
    np_dtype = _tensor.logical_numpy_dtype(dtype)
    codes = _every_code(np_dtype)
    n = nbytes // np_dtype.itemsize
    data = np.resize(codes, n) if n else codes[:0]
    out = _tensor.export(data.copy(), dtype, _tensor.wrap(jnp.zeros(1)))
    assert isinstance(out, jax.Array) and not out.weak_type
    assert out.devices() == {jax.devices()[0]}
    twin = jax.dlpack.from_dlpack(Exporter(data.ctypes.data if n else 0, data.shape, dtype, CPU, 0, owner=data))
    assert _bits(out) == _bits(twin) == (np_dtype.name, (n,), data.tobytes())


@pytest.mark.parametrize("nbytes", [16, 4096, _tensor._JAX_COPY_MAX, 4 * _tensor._JAX_COPY_MAX])
def test_export_to_jax_outlives_the_numpy_result(nbytes):
    """jit copies a large NumPy argument asynchronously, holding the array until the copy is done (DLPack
    holds it for good): the result must not depend on anyone else keeping it."""
    data = np.arange(nbytes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    out = _tensor.export(data, "float8_e4m3fn", _tensor.wrap(jnp.zeros(1)))
    del data
    gc.collect()
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.arange(nbytes) % 256)


# ---- eager fp8core.jax: the cached jit and the untraced primitive against the core on NumPy arrays -----------

def _x():
    v = _every_code(ml_dtypes.bfloat16)[::64].copy()  # 1024 values: every exponent, NaN, inf, -0
    return jnp.asarray(v).reshape(-1, 16)


# (True and float64 arrays are refused as scales, as the core refuses them: tests/test_hostile_jax.py)
SCALES = [0.25, 1e-40, 3, 2**40, np.float64(1e-40), np.array([0.5], np.float32), np.float32(2.0),
          jnp.asarray([4.0], jnp.float32)]
PRIMS = {
    "amax": lambda x, s, p: p["amax"](x),
    "quantize": lambda x, s, p: p["quantize"](x, s, fmt="e4m3"),
    "quantize_dynamic": lambda x, s, p: p["quantize_dynamic"](x, fmt=fp8core.Format.E5M2, margin=1,
                                                               power_of_2=True, epsilon=0.0),
    "dequantize": lambda x, s, p: p["dequantize"](fj.quantize(x, 1.0)[0], s, out_dtype=jnp.bfloat16),
    "transpose": lambda x, s, p: p["transpose"](fj.quantize(x, 1.0, "e5m2")[0]),
    "cast_transpose": lambda x, s, p: p["cast_transpose"](x, s, fmt="e5m2"),
    "gemm": lambda x, s, p: p["gemm"](fj.quantize(x, 0.01)[0], fj.quantize(x[:16], 0.02)[0], s, 2.0, None,
                                      out_dtype=jnp.float32),
}
# The same through the core API: x NumPy, s a float32 [1] NumPy scale; the GEMM's on x's own device (jax arrays),
# since its bits are the device's (NUMERICS.md: cuBLASLt sums in its own order), the others' the same on every one.
ON_X_DEVICE = {"gemm"}
TWINS = {
    "amax": lambda x, s: fp8core.amax(x),
    "quantize": lambda x, s: (fp8core.quantize(x, s, "e4m3"), fp8core.amax(x)),
    "quantize_dynamic": lambda x, s: fp8core.quantize_dynamic(x, "e5m2", margin=1, power_of_2=True),
    "dequantize": lambda x, s: fp8core.dequantize(fp8core.quantize(x, 1.0), s, "bfloat16"),
    "transpose": lambda x, s: fp8core.transpose(fp8core.quantize(x, 1.0, "e5m2")),
    "cast_transpose": lambda x, s: (*fp8core.cast_transpose(x, s, "e5m2"), fp8core.amax(x)),
    "gemm": lambda x, s: fp8core.gemm(fp8core.quantize(x, 0.01), fp8core.quantize(x[:16], 0.02), s, 2.0,
                                      out_dtype="float32"),
}


def _prims(path):
    jitted = {name: getattr(fj.primitives, "_" + name) for name in PRIMS}
    return jitted if path == "jitted" else {name: f.untraced for name, f in jitted.items()}


def _leaves(out):
    return [_bits(o) for o in jax.tree.leaves(out)]


@pytest.mark.parametrize("scale", SCALES, ids=[repr(s)[:20] for s in SCALES])
@pytest.mark.parametrize("op", list(PRIMS))
def test_eager_primitives_same_bits_as_the_core(op, scale):
    x = _x()
    s32 = np.asarray(scale, np.float32).reshape(1)
    twin = _leaves(TWINS[op](x, jnp.asarray(s32)) if op in ON_X_DEVICE else TWINS[op](np.asarray(x), s32))
    for path in ("jitted", "untraced"):
        s = fj.primitives._scale_arg(scale) if path == "jitted" else scale
        assert _leaves(PRIMS[op](x, s, _prims(path))) == twin


@pytest.mark.parametrize("op", ["quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose"])
def test_primitives_under_jit_and_vmap_same_bits_as_the_core(op):
    x = _x().reshape(4, -1, 16)
    fn = {"quantize": lambda v: fj.quantize(v, 0.5, "e5m2"),
          "quantize_dynamic": lambda v: fj.quantize_dynamic(v, margin=2, epsilon=1e-3),
          "dequantize": lambda v: fj.dequantize(fj.quantize(v, 1.0)[0], 2.0, jnp.float16),
          "transpose": lambda v: fj.transpose(fj.quantize(v, 1.0)[0]),
          "cast_transpose": lambda v: fj.cast_transpose(v, 0.125)}[op]
    twin = {"quantize": lambda v: (fp8core.quantize(v, 0.5, "e5m2"), fp8core.amax(v)),
            "quantize_dynamic": lambda v: fp8core.quantize_dynamic(v, margin=2, epsilon=1e-3),
            "dequantize": lambda v: fp8core.dequantize(fp8core.quantize(v, 1.0), 2.0, "float16"),
            "transpose": lambda v: fp8core.transpose(fp8core.quantize(v, 1.0)),
            "cast_transpose": lambda v: (*fp8core.cast_transpose(v, 0.125), fp8core.amax(v))}[op]
    xn = np.asarray(x)
    per_element = [twin(xn[i]) for i in range(len(xn))]
    batched = per_element[0] if not isinstance(per_element[0], tuple) else \
        tuple(np.stack([r[k] for r in per_element]) for k in range(len(per_element[0])))
    if not isinstance(batched, tuple):
        batched = np.stack(per_element)
    assert _leaves(jax.jit(fn)(x)) == _leaves(twin(xn))
    assert _leaves(jax.jit(jax.vmap(fn))(x)) == _leaves(batched)


BAD = [
    ("unknown format", lambda: fj.quantize(jnp.ones(16), 1.0, "bogus")),
    ("scale of 2 elements", lambda: fj.quantize(jnp.ones(16), jnp.ones(2))),
    ("int32 x", lambda: fj.amax(jnp.ones(16, jnp.int32))),
    ("fp8 x", lambda: fj.cast_transpose(jnp.ones((4, 4), jnp.float8_e4m3fn), 1.0)),
    ("int32 x quantize", lambda: fj.quantize(jnp.ones(16, jnp.int32), 1.0)),
    ("bf16 q", lambda: fj.transpose(jnp.ones((4, 4), jnp.bfloat16))),
    ("f32 q dequantize", lambda: fj.dequantize(jnp.ones(16), 1.0)),
    ("bad out_dtype", lambda: fj.dequantize(jnp.ones(16, jnp.float8_e4m3fn), 1.0, jnp.int8)),
    ("bad margin", lambda: fj.quantize_dynamic(jnp.ones(16), margin=1000)),
    ("bad power_of_2", lambda: fj.quantize_dynamic(jnp.ones(16), power_of_2="yes")),
    ("unhashable epsilon", lambda: fj.quantize_dynamic(jnp.ones(16), epsilon=np.array(-1.0))),
    ("gemm K", lambda: fj.gemm(fj.quantize(jnp.ones((16, 24)), 1.0)[0], fj.quantize(jnp.ones((16, 24)), 1.0)[0],
                               1.0, 1.0)),
]


@pytest.mark.parametrize("case,call", BAD, ids=[b[0] for b in BAD])
def test_eager_primitives_same_errors_as_untraced(case, call, monkeypatch):
    """The core's message, raised where it was raised before (at trace time, or from the callback)."""
    def first_line(e):
        # a callback's error carries a traceback whose frames differ between the two paths: compare the
        # exception type and the core's message (the last line)
        return type(e), str(e).strip().splitlines()[-1]

    errors = []
    for path in ("jitted", "untraced"):
        prims = _prims(path)
        with monkeypatch.context() as m:
            for name, f in prims.items():
                m.setattr(fj.primitives, "_" + name, f)
            with pytest.raises(Exception) as info:
                jax.block_until_ready(call())
        errors.append(first_line(info.value))
    assert errors[0] == errors[1]


def _jitted_and_untraced(module, name):
    f = getattr(module, "_" + name)
    return {"jitted": f, "untraced": f.untraced}


OTHERS = {
    "compute_scale": lambda x, p: p(fj.amax(x), fmt="e5m2", margin=1, power_of_2=False, epsilon=0.0),
    "update": lambda x, p: p(jnp.abs(x[:4, :3]), jnp.ones(3, jnp.float32), jnp.ones(3, jnp.float32),
                             recipe=fp8core.DelayedScaling(amax_history_len=4, margin=1),
                             formats=(fp8core.Format.E4M3, fp8core.Format.E4M3, fp8core.Format.E5M2),
                             update_scale=True),
    "blocks.quantize_mxfp8": lambda x, p: p(x.reshape(32, 32), fmt="e4m3", scale_mode="rceil", columnwise=True),
    "blocks.quantize_mxfp8_both": lambda x, p: p(x.reshape(32, 32), fmt="e5m2", scale_mode="rceil"),
    "blocks.dequantize:mxfp8": lambda x, p: p(tuple(fj.blocks.quantize_mxfp8(x.reshape(32, 32))),
                                              out_dtype=jnp.bfloat16, layout="1x32"),
    "blocks.quantize_blockwise": lambda x, p: p(x.reshape(8, 128), fmt="e4m3", block="128x128", power_of_2=False,
                                                epsilon=0.0),
    "blocks.dequantize:blockwise": lambda x, p: p(tuple(fj.blocks.quantize_blockwise(x.reshape(8, 128))),
                                                  out_dtype=jnp.float32, layout="1x128"),
}


@pytest.mark.parametrize("op", list(OTHERS))
def test_other_eager_primitives_same_bits_as_untraced(op):
    x = jnp.where(jnp.isfinite(_x()), _x(), 1.0)  # finite: NaN/inf would only give NaN scales here
    # "module.function:case" (one jitted dequantize takes every layout)
    module, name = (fj.blocks, op.split(".")[1].split(":")[0]) if op.startswith("blocks.") else (fj.primitives, op)
    got = {mode: [_bits(o) for o in jax.tree.leaves(OTHERS[op](x, f))]
           for mode, f in _jitted_and_untraced(module, name).items()}
    assert got["jitted"] == got["untraced"]
