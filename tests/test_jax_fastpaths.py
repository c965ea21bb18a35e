"""JAX's shortcuts against the paths they shortcut: identical bits and identical errors.

- jax CPU arrays read by ``_from_jax`` without asking DLPack for the device (against the general path);
- NumPy results handed back to JAX through a jitted identity, or jax.device_put above the size where export
  switches (against the DLPack import), with every fp8/16-bit code and float32 NaN payloads; outliving the NumPy result;
- eager ``fp8core.jax`` primitives through their cached jit (against the untraced primitive they wrap);
- fp8core.jax's callbacks handing XLA's buffers straight to the backend (against the public primitives with
  ``out=``, ``fp8core.jax.TRUSTED_OUTS = False``).
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


def _general_read(monkeypatch):
    """Every jax.Array read through DLPack's device query, as if its sharding were not one CPU device."""
    sharding = _tensor._jax_sharding
    monkeypatch.setattr(_tensor, "_jax_sharding", lambda s: (False, sharding(s)[1]))


@pytest.fixture(params=["shortcut", "general"])
def jax_read(request, monkeypatch):
    if request.param == "general":
        _general_read(monkeypatch)
    return request.param


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
def test_jax_cpu_read_gives_the_general_paths_view(case, make, jax_read):
    x = make()
    t = _tensor.wrap(x, "x")
    assert t.origin == "jax" and t.device == ("cpu", 0) and t.readonly
    assert t.dtype == np.dtype(x.dtype).name and t.data.shape == x.shape
    assert not t.data.flags.writeable
    assert t.data.tobytes() == np.asarray(x).tobytes()


OPS = {
    "amax": lambda x, s: fp8core.amax(x),
    "quantize": lambda x, s: fp8core.quantize(x, s, "e4m3"),
    "quantize_dynamic": lambda x, s: fp8core.quantize_dynamic(x, "e5m2", margin=1),
    "dequantize": lambda x, s: fp8core.dequantize(fp8core.quantize(x, s, "e4m3"), s, "bfloat16"),
    "cast_transpose": lambda x, s: fp8core.cast_transpose(x.reshape(4, -1), s, "e4m3"),
    "transpose": lambda x, s: fp8core.transpose(fp8core.quantize(x, 1.0, "e5m2").reshape(-1, 4)),
}


@pytest.mark.parametrize("op", list(OPS))
def test_generic_api_on_jax_arrays_same_bits_both_ways(op, monkeypatch):
    v = _every_code(ml_dtypes.bfloat16)[::7][:9360].copy()  # every exponent, NaNs, infs, subnormals, -0
    x, s = jnp.asarray(v), jnp.asarray([0.25], jnp.float32)
    got = {}
    for mode in ("shortcut", "general"):
        if mode == "general":
            _general_read(monkeypatch)
            monkeypatch.setattr(_tensor, "FAST_PATHS", False)
        out = OPS[op](x, s)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(isinstance(o, jax.Array) for o in outs)
        got[mode] = [_bits(o) for o in outs]
    assert got["shortcut"] == got["general"]


def test_deleted_and_sharded_arrays_keep_the_general_paths_errors(monkeypatch):
    x = jnp.ones(4)
    x.delete()
    messages = []
    for mode in ("shortcut", "general"):
        if mode == "general":
            _general_read(monkeypatch)
        with pytest.raises(Exception) as info:
            fp8core.amax(x)
        messages.append((type(info.value), str(info.value)))
    assert messages[0] == messages[1]


# Sizes around the switch from the jitted identity to DLPack, in bytes.
SIZES = [0, 1, 16, _tensor._JAX_COPY_MAX, _tensor._JAX_COPY_MAX + 1]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_export_to_jax_same_bits_as_dlpack(dtype, nbytes, monkeypatch):
    np_dtype = _tensor.logical_numpy_dtype(dtype)
    codes = _every_code(np_dtype)
    n = nbytes // np_dtype.itemsize
    data = np.resize(codes, n) if n else codes[:0]
    like = _tensor.wrap(jnp.zeros(1))
    got = {}
    for mode in ("fast", "dlpack"):
        monkeypatch.setattr(_tensor, "FAST_PATHS", mode == "fast")
        out = _tensor.export(data.copy(), dtype, like)
        assert isinstance(out, jax.Array) and not out.weak_type
        assert out.devices() == {jax.devices()[0]}
        got[mode] = _bits(out)
    assert got["fast"] == got["dlpack"] == (np_dtype.name, (n,), data.tobytes())


@pytest.mark.parametrize("nbytes", [16, 4096, _tensor._JAX_COPY_MAX, 4 * _tensor._JAX_COPY_MAX])
def test_export_to_jax_outlives_the_numpy_result(nbytes):
    """jit copies a large NumPy argument asynchronously, holding the array until the copy is done (DLPack
    holds it for good): the result must not depend on anyone else keeping it."""
    data = np.arange(nbytes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    out = _tensor.export(data, "float8_e4m3fn", _tensor.wrap(jnp.zeros(1)))
    del data
    gc.collect()
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.arange(nbytes) % 256)


# ---- eager fp8core.jax: the cached jit against the untraced primitive -----------------------------------

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


# (jitted or untraced, TRUSTED_OUTS): the last is the path before the shortcuts
MODES = [("jitted", True), ("untraced", True), ("jitted", False)]


def _prims(mode, monkeypatch):
    path, trusted = mode
    monkeypatch.setattr(fj, "TRUSTED_OUTS", trusted)
    jitted = {name: getattr(fj, "_" + name) for name in PRIMS}
    return jitted if path == "jitted" else {name: f.untraced for name, f in jitted.items()}


@pytest.mark.parametrize("scale", SCALES, ids=[repr(s)[:20] for s in SCALES])
@pytest.mark.parametrize("op", list(PRIMS))
def test_eager_primitives_same_bits_on_every_path(op, scale, monkeypatch):
    x = _x()
    got = []
    for mode in MODES:
        s = fj._scale_arg(scale) if mode[0] == "jitted" else scale
        got.append([_bits(o) for o in jax.tree.leaves(PRIMS[op](x, s, _prims(mode, monkeypatch)))])
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("op", ["quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose"])
def test_trusted_outputs_under_jit_and_vmap_same_bits_as_the_public_primitives(op, monkeypatch):
    x = _x().reshape(4, -1, 16)
    fn = {"quantize": lambda v: fj.quantize(v, 0.5, "e5m2"),
          "quantize_dynamic": lambda v: fj.quantize_dynamic(v, margin=2, epsilon=1e-3),
          "dequantize": lambda v: fj.dequantize(fj.quantize(v, 1.0)[0], 2.0, jnp.float16),
          "transpose": lambda v: fj.transpose(fj.quantize(v, 1.0)[0]),
          "cast_transpose": lambda v: fj.cast_transpose(v, 0.125)}[op]
    got = []
    for trusted in (True, False):
        monkeypatch.setattr(fj, "TRUSTED_OUTS", trusted)
        got.append([_bits(o) for o in jax.tree.leaves((jax.jit(fn)(x), jax.jit(jax.vmap(fn))(x)))])
    assert got[0] == got[1]


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
    for mode in MODES:
        prims = _prims(mode, monkeypatch)
        with monkeypatch.context() as m:
            for name, f in prims.items():
                m.setattr(fj, "_" + name, f)
            with pytest.raises(Exception) as info:
                jax.block_until_ready(call())
        errors.append(first_line(info.value))
    assert errors[0] == errors[1] == errors[2]


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
    "blocks.dequantize_mxfp8": lambda x, p: p(fj.blocks.quantize_mxfp8(x.reshape(32, 32)), out_dtype=jnp.bfloat16),
    "blocks.quantize_blockwise": lambda x, p: p(x.reshape(8, 128), fmt="e4m3", block="128x128", power_of_2=False,
                                                epsilon=0.0),
    "blocks.dequantize_blockwise": lambda x, p: p(fj.blocks.quantize_blockwise(x.reshape(8, 128)),
                                                  out_dtype=jnp.float32),
}


@pytest.mark.parametrize("op", list(OTHERS))
def test_other_eager_primitives_same_bits_as_untraced(op):
    x = jnp.where(jnp.isfinite(_x()), _x(), 1.0)  # finite: NaN/inf would only give NaN scales here
    module, name = (fj.blocks, op.split(".")[1]) if op.startswith("blocks.") else (fj, op)
    got = {mode: [_bits(o) for o in jax.tree.leaves(OTHERS[op](x, f))]
           for mode, f in _jitted_and_untraced(module, name).items()}
    assert got["jitted"] == got["untraced"]
