"""Bad input, as a table: every case raises the named exception with a message that starts with the argument's
name, before anything is written. The same table runs on each backend ("cuda" rows need a GPU: torch CUDA
tensors there; cases about host memory, like NumPy's byte order, hold on both since the check comes first)."""

import math

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import args
from conftest import requires_gpu

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
F32 = np.float32


def T(dev, values, dtype=torch.float32):
    """A torch tensor on the backend under test."""
    return torch.tensor(values, dtype=dtype, device=dev)


def neg(dev, values):
    """A tensor carrying torch's negative bit: it reads as -values through torch, as values through raw memory."""
    return torch._neg_view(T(dev, values))


def _state_buffer(dev):
    fp8core.ScalingState(2, fp8core.DelayedScaling(amax_history_len=4), device="cpu",
                         buffer=np.zeros(4 * 2 + 2 * 2, ">f4"))


# (id, call(dev), exception, argument, what the message says after the argument's name)
CASES = [
    # byte order: NumPy arrays in any argument, refused by name and order, never copied silently
    ("big-endian x f4", lambda d: fp8core.amax(np.array([1, -3], ">f4")), TypeError, "x", "big-endian"),
    ("big-endian x f2", lambda d: fp8core.quantize(np.array([1, -3, .5, 96], ">f2"), 1.0), TypeError, "x",
     "big-endian"),
    ("big-endian amax_out", lambda d: fp8core.quantize(T(d, [1.0, 2.0]), 1.0, amax_out=np.zeros(1, ">f4")),
     TypeError, "amax_out", "big-endian"),
    ("big-endian scale", lambda d: fp8core.quantize(T(d, [1.0]), np.ones(1, ">f4")), TypeError, "scale",
     "big-endian"),
    ("big-endian scale_inv", lambda d: fp8core.dequantize(T(d, [1.0]).to(torch.float8_e4m3fn), np.ones(1, ">f4")),
     TypeError, "scale_inv", "big-endian"),
    ("big-endian compute_scale amax", lambda d: fp8core.compute_scale(np.ones(2, ">f4"), "e4m3"), TypeError,
     "amax", "big-endian"),
    ("big-endian state buffer", _state_buffer, TypeError, "buffer", "big-endian"),
    # torch's negative bit and complex data
    ("negative-bit x", lambda d: fp8core.quantize(neg(d, [1.0, -3.0]), 1.0), ValueError, "x", "negative bit"),
    ("negative-bit x amax", lambda d: fp8core.amax(neg(d, [1.0, -3.0])), ValueError, "x", "negative bit"),
    ("conj().imag x", lambda d: fp8core.amax(T(d, [1 + 2j], torch.complex64).conj().imag), ValueError, "x",
     "negative bit"),
    ("negative-bit scale", lambda d: fp8core.quantize(T(d, [1.0]), neg(d, [2.0])), ValueError, "scale",
     "resolve_neg"),
    ("negative-bit amax_out", lambda d: fp8core.quantize(T(d, [1.0]), 1.0, amax_out=neg(d, [0.0])), ValueError,
     "amax_out", "resolve_neg"),
    ("negative-bit q", lambda d: fp8core.dequantize(neg(d, [1.0]), 1.0), ValueError, "q", "negative bit"),
    ("complex x", lambda d: fp8core.amax(T(d, [1 + 2j], torch.complex64)), TypeError, "x", "complex"),
    ("complex scale", lambda d: fp8core.quantize(T(d, [1.0]), T(d, [1 + 0j], torch.complex64)), TypeError,
     "scale", "complex"),
    # sequences
    ("multi_amax 2-D array", lambda d: fp8core.multi_amax(T(d, [[1.0, 2.0], [3.0, 4.0]])), TypeError, "xs",
     "list or tuple"),
    ("multi_quantize 2-D array", lambda d: fp8core.multi_quantize(T(d, [[1.0], [2.0]]), T(d, [1.0, 1.0]), "e4m3"),
     TypeError, "xs", "list or tuple"),
    ("multi_amax empty", lambda d: fp8core.multi_amax([]), ValueError, "xs", "at least one"),
    # compute_scale's previous: a scale, so finite and > 0
    ("previous 0", lambda d: fp8core.compute_scale(T(d, [0.0]), "e4m3", previous=0.0), ValueError, "previous",
     "finite scale > 0"),
    ("previous NaN", lambda d: fp8core.compute_scale(T(d, [0.0]), "e4m3", previous=math.nan), ValueError,
     "previous", "finite scale > 0"),
    ("previous negative", lambda d: fp8core.compute_scale(T(d, [0.0]), "e4m3", previous=-2), ValueError,
     "previous", "finite scale > 0"),
    ("previous inf", lambda d: fp8core.compute_scale(T(d, [0.0]), "e4m3", previous=math.inf), ValueError,
     "previous", "finite scale > 0"),
    ("previous bool", lambda d: fp8core.compute_scale(T(d, [0.0]), "e4m3", previous=True), TypeError,
     "previous", "expected"),
    # scalar arguments: one set of rules (fp8core.args)
    ("margin too large", lambda d: fp8core.quantize_dynamic(T(d, [1.0]), margin=10 ** 6), ValueError, "margin",
     "<= 512"),
    ("margin float", lambda d: fp8core.compute_scale(T(d, [1.0]), "e4m3", margin=1.5), TypeError, "margin",
     "expected an int"),
    ("epsilon inf", lambda d: fp8core.quantize_dynamic(T(d, [1.0]), epsilon=math.inf), ValueError, "epsilon",
     "finite"),
    ("epsilon string", lambda d: fp8core.quantize_dynamic(T(d, [1.0]), epsilon="0"), TypeError, "epsilon",
     "expected a float"),
    ("power_of_2 string", lambda d: fp8core.compute_scale(T(d, [1.0]), "e4m3", power_of_2="False"), TypeError,
     "power_of_2", "expected a bool"),
    ("reduce not callable", lambda d: fp8core.quantize_dynamic(T(d, [1.0]), reduce=3), TypeError, "reduce",
     "callable"),
    ("fmt hybrid", lambda d: fp8core.quantize(T(d, [1.0]), 1.0, "hybrid"), ValueError, "fmt", "HYBRID"),
    ("out_dtype int", lambda d: fp8core.dequantize(T(d, [1.0]).to(torch.float8_e4m3fn), 1.0, torch.int32),
     ValueError, "out_dtype", "expected float32"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,call,exc,arg,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_by_name(case, call, exc, arg, text, device):
    with pytest.raises(exc) as info:
        call(device)
    message = str(info.value)
    assert message.startswith(f"{arg}: "), message
    assert text in message, message


def test_a_jax_tracer_points_to_fp8core_jax():
    jax = pytest.importorskip("jax")
    for fn in (lambda v: fp8core.quantize(v, 1.0), lambda v: fp8core.amax(v),
               lambda v: fp8core.cast_transpose(v.reshape(2, 2), 1.0)):
        with pytest.raises(TypeError, match=r"^x: got a JAX tracer.*fp8core\.jax"):
            jax.jit(fn)(jax.numpy.ones(4))


def test_host_previous_arrays_are_checked_elementwise():
    with pytest.raises(ValueError, match=r"^previous: expected finite scales > 0, got 0.0"):
        fp8core.compute_scale(np.array([0.0, 1.0], F32), "e4m3", previous=np.array([1.0, 0.0], F32))
    s, _ = fp8core.compute_scale(np.array([0.0, 1.0], F32), "e4m3", previous=np.array([3.0, 3.0], F32))
    np.testing.assert_array_equal(s, [3.0, 448.0])


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_is_written_before_the_error(device):
    slot = T(device, [5.0])
    with pytest.raises(ValueError, match="^scale: "):
        fp8core.quantize(T(device, [100.0]), neg(device, [1.0]), amax_out=slot)
    assert slot.item() == 5.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amax", [0.0, 2.0, math.nan])
def test_compute_scale_of_a_0d_amax_gives_1_element_arrays(amax, device):
    a = T(device, amax)
    assert a.dim() == 0
    s, s_inv = fp8core.compute_scale(a, "e4m3")
    assert s.shape == (1,) and s_inv.shape == (1,)
    expected = 1.0 if amax == 0.0 or math.isnan(amax) else 448.0 / amax
    assert s.item() == expected and s_inv.item() == np.float32(1 / np.float32(expected))
    n0 = fp8core.compute_scale(np.float32(amax).reshape(()), "e4m3")[0]
    assert isinstance(n0, np.ndarray) and n0.shape == (1,)


def test_native_and_little_endian_arrays_still_pass():
    x = np.array([1, -3, .5, 96], "<f4")
    q = fp8core.quantize(x.astype("=f2"), 1.0)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert fp8core.amax(np.array([1, -3], ">f4").astype("<f4"))[0] == 3.0


# The scalar rules, as the torch custom ops and fp8core.jax call them (fp8core.args).
RULES = [
    ("amax_algo mean", lambda: args.amax_algo("mean"), ValueError, "algo"),
    ("amax_algo None", lambda: args.amax_algo(None), ValueError, "algo"),
    ("amax_algo named", lambda: args.amax_algo("mean", "amax_compute_algo"), ValueError, "amax_compute_algo"),
    ("flag int", lambda: args.flag(1, "update_scale"), TypeError, "update_scale"),
    ("margin bool", lambda: args.margin(True), TypeError, "margin"),
    ("margin 10000", lambda: args.margin(10000), ValueError, "margin"),
    ("epsilon NaN", lambda: args.epsilon(math.nan), ValueError, "epsilon"),
    ("scale 0", lambda: args.scale_value(0.0, "scale"), ValueError, "scale"),
    ("scale string", lambda: args.scale_value("1", "scale"), TypeError, "scale"),
    ("out_dtype float64", lambda: args.out_dtype(np.float64), ValueError, "out_dtype"),
    ("fmt hybrid", lambda: args.fmt("hybrid"), ValueError, "fmt"),
    ("fmt hybrid named", lambda: args.fmt("hybrid", "fmts"), ValueError, "fmts"),
    ("fmt unhashable", lambda: args.fmt(["e4m3"]), ValueError, "fmt"),
    ("scale_mode", lambda: args.scale_mode("ceil"), ValueError, "scale_mode"),
    ("block rows", lambda: args.block("1x64"), ValueError, "block"),
]


@pytest.mark.parametrize("case,call,exc,arg", RULES, ids=[r[0] for r in RULES])
def test_scalar_rules_refuse_by_name(case, call, exc, arg):
    with pytest.raises(exc, match=f"^{arg}: "):
        call()


def test_scalar_rules_pass_valid_values_through():
    assert args.amax_algo("most_recent") == "most_recent"
    assert args.flag(np.bool_(True), "power_of_2") is True
    assert args.margin(np.int64(-3)) == -3 and type(args.margin(np.int64(-3))) is int
    assert args.epsilon(np.float32(0.5)) == 0.5 and args.epsilon(0) == 0.0
    assert args.scale_value(np.float32(2), "scale") == 2.0
    assert args.out_dtype(torch.bfloat16) == "bfloat16"
    assert args.array_sequence((np.ones(2),))[0].shape == (2,)
    assert args.fmt("E5M2") is fp8core.Format.E5M2 and args.fmt(torch.float8_e4m3fn) is fp8core.Format.E4M3
    assert args.block((128, 128)) is fp8core.Layout.BLOCK_128X128 and args.scale_mode("floor") == "floor"
    assert args.cdiv(0, 32) == 0 and args.cdiv(33, 32) == 2
