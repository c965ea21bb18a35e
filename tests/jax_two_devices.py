"""JAX arrays on the second of two XLA:CPU devices: where every result lands, and what mixing devices does.

Not collected by the suite (the name does not start with ``test_``): JAX fixes its device count when its backend
starts, which the suite's process has done with one device long before. tests/test_jax_devices.py runs this
module in a fresh process with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``.

The rule (fp8core/_tensor.py): results follow JAX's own rule for an operation on x. x committed to cpu:1 gives
results committed to cpu:1 with x's sharding, bit for bit the results of the same call on cpu:0 (the twin); x
uncommitted gives uncommitted results where ``x + 1`` would land. JAX arrays committed to two devices are
refused, naming the argument. fp8core.jax runs under jit, where XLA places everything: its results land where
XLA puts them, on cpu:1 for cpu:1 inputs, or wherever out_shardings says.
"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core import _tensor  # noqa: E402
from fp8core.blocks import BlockScaledTensor, MXTensor  # noqa: E402

CPU = jax.devices("cpu")
if len(CPU) < 2:
    raise RuntimeError("tests/jax_two_devices.py needs 2 CPU devices: tests/test_jax_devices.py runs it with "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=2")
D0, D1 = CPU[:2]
BIG = _tensor._JAX_COPY_MAX  # results above this many bytes take jax.device_put instead of the jitted identity


def _on(v, device):
    return jax.device_put(v, device)


def _codes(n):
    """n bfloat16 values walking every exponent, with NaN, +-inf, +-0 and subnormals among them."""
    v = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)[::7]
    return np.resize(v, n)


def _finite(n):
    v = _codes(n).astype(np.float32)
    return np.where(np.isfinite(v), v, 1.5).astype(ml_dtypes.bfloat16)


def _bits(a):
    a = np.asarray(a)
    return a.dtype.name, a.shape, a.tobytes()


def _leaves(r):
    return jax.tree.leaves(r)


def _assert_placed(r, device, committed=True):
    leaves = _leaves(r)
    assert leaves
    for o in leaves:
        assert isinstance(o, jax.Array)
        assert o.devices() == {device}, (o.devices(), device)
        assert o.committed is committed
        if committed:
            assert o.sharding == jax.sharding.SingleDeviceSharding(device)


# Every generic primitive, as a function of a device: its inputs built there (committed), the call made.
def _args(device, n=1024, finite=False):
    x = _on(jnp.asarray(_finite(n) if finite else _codes(n)), device)
    return x, _on(jnp.asarray([0.25], jnp.float32), device)


def _q(device, n=1024):
    x, s = _args(device, n)
    return fp8core.quantize(x, s, "e4m3"), s


def _gemm(device):
    a = _on(jnp.asarray(np.resize(np.arange(-40, 40, dtype=np.float32), (32, 64)) / 8, jnp.float8_e4m3fn), device)
    b = _on(jnp.asarray(np.resize(np.arange(-30, 30, dtype=np.float32), (16, 64)) / 4, jnp.float8_e4m3fn), device)
    return fp8core.gemm(a, b, _on(jnp.asarray([0.5], jnp.float32), device), 2.0, out_dtype="float32")


GENERIC = {
    "amax": lambda d: fp8core.amax(_args(d)[0]),
    "quantize": lambda d: fp8core.quantize(*_args(d), "e4m3"),
    "quantize float scale": lambda d: fp8core.quantize(_args(d)[0], 0.25, "e5m2"),
    "quantize numpy scale": lambda d: fp8core.quantize(_args(d)[0], np.array([0.25], np.float32), "e4m3"),
    "quantize_dynamic": lambda d: fp8core.quantize_dynamic(_args(d)[0], "e5m2", margin=1),
    "quantize_dynamic above the copy size": lambda d: fp8core.quantize_dynamic(_args(d, BIG + 64)[0]),
    "dequantize": lambda d: fp8core.dequantize(*_q(d), "bfloat16"),
    "dequantize above the copy size": lambda d: fp8core.dequantize(*_q(d, BIG // 2 + 64), "float32"),
    "transpose 2-D": lambda d: fp8core.transpose(_q(d)[0].reshape(32, 32)),
    "transpose 3-D": lambda d: fp8core.transpose(_q(d)[0].reshape(4, 8, 32)),
    "cast_transpose 3-D": lambda d: fp8core.cast_transpose(_args(d)[0].reshape(4, 8, 32), _args(d)[1], "e4m3"),
    "compute_scale": lambda d: fp8core.compute_scale(fp8core.amax(_args(d)[0]), "e4m3", margin=1),
    "compute_scale 0-d amax, previous": lambda d: fp8core.compute_scale(
        _on(jnp.float32(0.0), d), "e5m2", previous=_on(jnp.asarray([3.0], jnp.float32), d)),
    "multi_amax": lambda d: fp8core.multi_amax([_args(d)[0], _args(d, 96)[0]]),
    "multi_quantize": lambda d: fp8core.multi_quantize(
        [_args(d)[0], _args(d, 96)[0]], _on(jnp.asarray([0.25, 4.0], jnp.float32), d), ["e4m3", "e5m2"]),
    "quantize_mxfp8": lambda d: fp8core.quantize_mxfp8(_args(d, finite=True)[0].reshape(32, 32)),
    "quantize_mxfp8 columnwise": lambda d: fp8core.quantize_mxfp8(_args(d, finite=True)[0].reshape(32, 32),
                                                                  columnwise=True),
    "quantize_mxfp8_both": lambda d: fp8core.quantize_mxfp8_both(_args(d, finite=True)[0].reshape(32, 32)),
    "dequantize_mxfp8": lambda d: fp8core.dequantize_mxfp8(
        fp8core.quantize_mxfp8(_args(d, finite=True)[0].reshape(32, 32)), "bfloat16"),
    "quantize_blockwise": lambda d: fp8core.quantize_blockwise(_args(d, finite=True)[0].reshape(8, 128),
                                                               block="128x128"),
    "dequantize_blockwise": lambda d: fp8core.dequantize_blockwise(
        fp8core.quantize_blockwise(_args(d, finite=True)[0].reshape(8, 128)), "float32"),
    "transpose_blocks mxfp8": lambda d: fp8core.transpose_blocks(
        fp8core.quantize_mxfp8(_args(d, finite=True)[0].reshape(32, 32), columnwise=True)),
    "transpose_blocks 128x128": lambda d: fp8core.transpose_blocks(
        fp8core.quantize_blockwise(_args(d, finite=True)[0].reshape(8, 128), block="128x128")),
    "gemm": _gemm,
}


@pytest.mark.parametrize("op", list(GENERIC))
def test_generic_results_on_the_inputs_device_same_bits_as_the_twin(op):
    got1 = GENERIC[op](D1)
    twin = GENERIC[op](D0)
    _assert_placed(got1, D1)
    _assert_placed(twin, D0)  # committed to the default device: committed results there too
    assert [_bits(o) for o in _leaves(got1)] == [_bits(o) for o in _leaves(twin)]


@pytest.mark.parametrize("n", [64, BIG + 64], ids=["jitted identity", "device_put"])
def test_uncommitted_input_gives_uncommitted_results_where_jax_puts_them(n):
    x = jnp.asarray(_codes(n))
    assert not x.committed
    r = fp8core.quantize_dynamic(x)
    _assert_placed(r, D0, committed=False)
    with jax.default_device(D1):  # uncommitted, made on cpu:1
        x1 = jnp.asarray(_codes(n))
        assert x1.devices() == {D1}
        inside = fp8core.quantize_dynamic(x1)
        assert (x1 + 1).devices() == {D1}
    _assert_placed(inside, D1, committed=False)  # where x1 + 1 lands inside the context
    outside = fp8core.quantize_dynamic(x1)
    assert (x1 + 1).devices() == {D0}
    _assert_placed(outside, D0, committed=False)  # and outside it
    assert [_bits(o) for o in r] == [_bits(o) for o in inside] == [_bits(o) for o in outside]


def test_results_on_cpu1_mix_with_cpu1_arrays_in_jax():
    x, s = _args(D1)
    q = fp8core.quantize(x, s)
    y = fp8core.dequantize(q, s) + _on(jnp.ones(1024, jnp.float32), D1)  # jit refuses committed arrays on 2 devices
    assert y.devices() == {D1}


def test_single_device_named_sharding_commits_results_to_that_device():
    mesh = jax.sharding.Mesh(np.array([D1]), ("d",))
    x = jax.device_put(jnp.asarray(_codes(256)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    _assert_placed(fp8core.quantize_dynamic(x), D1)


def test_placement_is_one_object_per_device():
    a = _tensor.wrap(_on(jnp.ones(4), D1))
    b = _tensor.wrap(_on(jnp.zeros((2, 3), jnp.bfloat16), jax.sharding.SingleDeviceSharding(D1)))
    c = _tensor.wrap(_on(jnp.ones(4), D0))
    assert a.place is b.place and a.place is not c.place
    assert a.device == c.device == ("cpu", 0)  # both host memory: the backend's key is unchanged
    assert (a.device_str(), c.device_str()) == ("cpu:1", "cpu:0")
    assert _tensor.wrap(jnp.ones(4)).place is None and _tensor.wrap(np.ones(4)).place is None


def test_sharded_array_refused_by_name():
    mesh = jax.sharding.Mesh(np.array(CPU[:2]), ("d",))
    x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    with pytest.raises(ValueError, match=r"^x: is a jax.Array sharded over 2 devices; fp8core takes one device's "
                                         r"array: call fp8core.jax's primitives inside jax.shard_map"):
        fp8core.amax(x)


# ---- mixing devices ----------------------------------------------------------------------------------------

def _c0(v):
    return _on(jnp.asarray(v, jnp.float32), D0)


def _mx1():
    return fp8core.quantize_mxfp8(_args(D1, finite=True)[0].reshape(32, 32))


def _bs1():
    return fp8core.quantize_blockwise(_args(D1, finite=True)[0].reshape(8, 128))


MIXED = {
    "quantize scale": (lambda: fp8core.quantize(_args(D1)[0], _c0([0.5])), "scale", "x"),
    "quantize amax_out": (lambda: fp8core.quantize(_args(D1)[0], 0.5, amax_out=_c0([0.0])), "amax_out", "x"),
    "quantize out": (lambda: fp8core.quantize(_args(D1)[0], 0.5, out=_on(jnp.zeros(1024, jnp.float8_e4m3fn), D0)),
                     "out", "x"),
    "dequantize scale_inv": (lambda: fp8core.dequantize(_q(D1)[0], _c0([2.0])), "scale_inv", "q"),
    "cast_transpose scale": (lambda: fp8core.cast_transpose(_args(D1)[0].reshape(32, 32), _c0([0.5])), "scale", "x"),
    "compute_scale previous": (lambda: fp8core.compute_scale(_on(jnp.ones(1), D1), "e4m3", previous=_c0([1.0])),
                               "previous", "amax"),
    "multi_amax xs[1]": (lambda: fp8core.multi_amax([_args(D1)[0], _on(jnp.ones(8), D0)]), "xs[1]", "xs[0]"),
    "multi_quantize scales": (lambda: fp8core.multi_quantize([_args(D1)[0]], _c0([1.0]), "e4m3"), "scales",
                              "xs[0]"),
    "dequantize_mxfp8 scale": (lambda: fp8core.dequantize_mxfp8(MXTensor(_mx1().data, _on(_mx1().scale, D0))),
                               "t.scale", "data"),
    "dequantize_blockwise scale_inv": (lambda: fp8core.dequantize_blockwise(
        BlockScaledTensor(_bs1().data, _on(_bs1().scale_inv, D0))), "t.scale_inv", "data"),
    "gemm b": (lambda: fp8core.gemm(_on(jnp.ones((16, 16), jnp.float8_e4m3fn), D1),
                                    _on(jnp.ones((16, 16), jnp.float8_e4m3fn), D0), 1.0, 1.0), "b", "a"),
    "gemm a_scale_inv": (lambda: fp8core.gemm(_on(jnp.ones((16, 16), jnp.float8_e4m3fn), D1),
                                              _on(jnp.ones((16, 16), jnp.float8_e4m3fn), D1), _c0([1.0]), 1.0),
                         "a_scale_inv", "a"),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_jax_arrays_committed_to_two_devices_refused_by_name(case):
    call, arg, xarg = MIXED[case]
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == f"{arg}: is on cpu:0 but {xarg} is on cpu:1; put them on the same device"


def test_the_first_argument_on_cpu0_names_the_devices_the_other_way():
    with pytest.raises(ValueError, match=r"^scale: is on cpu:1 but x is on cpu:0; put them on the same device$"):
        fp8core.quantize(_args(D0)[0], _on(jnp.asarray([0.5], jnp.float32), D1))


ACCEPTED = {
    "uncommitted jax scale": lambda x: fp8core.quantize(x, jnp.asarray([0.25], jnp.float32)),
    "numpy scale": lambda x: fp8core.quantize(x, np.array([0.25], np.float32)),
    "uncommitted previous": lambda x: fp8core.compute_scale(fp8core.amax(x), "e4m3",
                                                            previous=jnp.asarray([1.0], jnp.float32)),
    "uncommitted xs[1]": lambda x: fp8core.multi_amax([x, jnp.ones(8, jnp.bfloat16)]),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_uncommitted_and_host_arguments_go_with_a_committed_x(case):
    """As in JAX, where an uncommitted array joins a committed one's device: results on x's device, the same
    bits as with every argument on cpu:1."""
    x = _args(D1)[0]
    r = ACCEPTED[case](x)
    _assert_placed(r, D1)
    with jax.default_device(D1):
        twin = ACCEPTED[case](x)
    assert [_bits(o) for o in _leaves(r)] == [_bits(o) for o in _leaves(twin)]


def test_numpy_out_with_a_committed_x_is_written_and_returned():
    x, s = _args(D1)
    out = np.zeros(1024, ml_dtypes.float8_e4m3fn)
    assert fp8core.quantize(x, s, out=out) is out
    assert _bits(out) == _bits(fp8core.quantize(*_args(D0)))


# ---- fp8core.jax: XLA places, eager and under jit ------------------------------------------------------------

def _fj_x(device, shape=(32, 32)):
    return _on(jnp.asarray(_finite(int(np.prod(shape)))).reshape(shape), device)


FJ = {
    "amax": lambda x, s: fj.amax(x),
    "quantize": lambda x, s: fj.quantize(x, 0.5, "e4m3"),
    "quantize jax scale": lambda x, s: fj.quantize(x, s),
    "quantize_dynamic": lambda x, s: fj.quantize_dynamic(x, "e5m2", margin=1),
    "dequantize": lambda x, s: fj.dequantize(fj.quantize(x, 1.0)[0], s, jnp.bfloat16),
    "transpose": lambda x, s: fj.transpose(fj.quantize(x, 1.0, "e5m2")[0]),
    "cast_transpose": lambda x, s: fj.cast_transpose(x, 0.125),
    "compute_scale": lambda x, s: fj.compute_scale(fj.amax(x), "e4m3"),
    "update": lambda x, s: fj.update(jnp.abs(x[:4, :3]).astype(jnp.float32), jnp.ones(3, jnp.float32),
                                     jnp.ones(3, jnp.float32), fp8core.DelayedScaling(amax_history_len=4),
                                     ("e4m3", "e4m3", "e5m2")),
    "blocks.quantize_mxfp8": lambda x, s: fj.blocks.quantize_mxfp8(x),
    "blocks.dequantize_blockwise": lambda x, s: fj.blocks.dequantize_blockwise(
        fj.blocks.quantize_blockwise(x.reshape(8, 128))),
    "gemm": lambda x, s: fj.gemm(fj.quantize(x, 1.0)[0], fj.quantize(x[:16], 1.0)[0], s, 2.0,
                                 out_dtype=jnp.float32),
}


@pytest.mark.parametrize("path", ["eager", "jit"])
@pytest.mark.parametrize("op", list(FJ))
def test_fp8core_jax_results_where_xla_puts_them(op, path):
    fn = FJ[op] if path == "eager" else jax.jit(FJ[op])
    got1, twin = (fn(_fj_x(d), _on(jnp.asarray([0.5], jnp.float32), d)) for d in (D1, D0))
    _assert_placed(got1, D1)
    _assert_placed(twin, D0)
    assert [_bits(o) for o in _leaves(got1)] == [_bits(o) for o in _leaves(twin)]


@pytest.mark.parametrize("op", ["quantize_dynamic", "cast_transpose", "blocks.quantize_mxfp8"])
def test_fp8core_jax_under_jit_runs_where_the_shardings_say(op):
    """XLA owns placement under jit: host inputs sent to cpu:1 by in_shardings give results on cpu:1."""
    s1 = jax.sharding.SingleDeviceSharding(D1)
    x = np.asarray(_fj_x(D0))
    r = jax.jit(FJ[op], in_shardings=s1, out_shardings=s1)(x, np.array([0.5], np.float32))
    _assert_placed(r, D1)
    assert [_bits(o) for o in _leaves(r)] == [_bits(o) for o in _leaves(FJ[op](jnp.asarray(x), 0.5))]


def test_fp8core_jax_with_committed_arrays_on_two_devices_refused_by_jax():
    with pytest.raises(ValueError, match="incompatible devices for jitted computation"):
        fj.quantize(_fj_x(D1), _c0([0.5]))
