"""Bad input, as a table: every case raises the named exception with a message that starts with the argument's
name, before anything is written. The same table runs on each backend ("cuda" rows need a GPU: torch CUDA
tensors there; cases about host memory, like NumPy's byte order, hold on both since the check comes first)."""

import importlib
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


# ---- arrays not aligned to their own elements ------------------------------------------------------------------

def misaligned(values, dtype, by=1):
    """``values`` as a NumPy array of ``dtype`` whose data starts ``by`` bytes past a multiple of its element size
    (an ndarray over a byte buffer, as a file's map or a packed record gives): NumPy reads it, a GPU would fault."""
    a = np.asarray(values, dtype)
    buf = np.zeros(a.nbytes + 2 * a.itemsize, np.uint8)
    start = (by - buf.ctypes.data) % a.itemsize
    out = np.ndarray(a.shape, a.dtype, buf, offset=start)
    out[...] = a
    assert out.ctypes.data % a.itemsize == by and not out.flags.aligned
    return out


BF16, E4 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
X = np.linspace(-3, 3, 64, dtype=F32).reshape(2, 32)
# (id, call, argument, its element size, its dtype's name, bytes past the boundary): every kind of array argument
MISALIGNED = [
    ("amax x bf16", lambda: fp8core.amax(misaligned(X, BF16)), "x", 2, "bfloat16", 1),
    ("quantize x f32", lambda: fp8core.quantize(misaligned(X, F32, 2), 1.0), "x", 4, "float32", 2),
    ("quantize x f16", lambda: fp8core.quantize(misaligned(X, np.float16), 1.0, "e5m2"), "x", 2, "float16", 1),
    ("quantize scale", lambda: fp8core.quantize(X, misaligned([2.0], F32, 3)), "scale", 4, "float32", 3),
    ("quantize amax_out", lambda: fp8core.quantize(X, 1.0, amax_out=misaligned([0.0], F32)), "amax_out", 4,
     "float32", 1),
    ("quantize_dynamic x", lambda: fp8core.quantize_dynamic(misaligned(X, BF16)), "x", 2, "bfloat16", 1),
    ("quantize_dynamic out[1]", lambda: fp8core.quantize_dynamic(X, out=(None, misaligned([0.0], F32), None)),
     "out[1]", 4, "float32", 1),
    ("dequantize scale_inv", lambda: fp8core.dequantize(X.astype(E4), misaligned([1.0], F32, 2)), "scale_inv", 4,
     "float32", 2),
    ("dequantize out", lambda: fp8core.dequantize(X.astype(E4), 1.0, "bfloat16", out=misaligned(X, BF16)), "out", 2,
     "bfloat16", 1),
    ("cast_transpose x", lambda: fp8core.cast_transpose(misaligned(X, F32, 1), 1.0), "x", 4, "float32", 1),
    ("compute_scale amax", lambda: fp8core.compute_scale(misaligned([3.0], F32), "e4m3"), "amax", 4, "float32", 1),
    ("multi_amax xs[1]", lambda: fp8core.multi_amax([X, misaligned(X, BF16)]), "xs[1]", 2, "bfloat16", 1),
    ("quantize_mxfp8 x", lambda: fp8core.quantize_mxfp8(misaligned(X, BF16)), "x", 2, "bfloat16", 1),
    ("quantize_blockwise x", lambda: fp8core.quantize_blockwise(misaligned(X, F32, 2)), "x", 4, "float32", 2),
    ("quantize_rowwise x", lambda: fp8core.quantize_rowwise(misaligned(X, np.float16)), "x", 2, "float16", 1),
    ("dequantize_blockwise scale_inv", lambda: fp8core.dequantize_blockwise(fp8core.BlockScaledTensor(
        X.astype(E4), misaligned([[1.0]] * 2, F32))), "t.scale_inv", 4, "float32", 1),
    ("quantize_nvfp4 x", lambda: fp8core.quantize_nvfp4(misaligned(X, BF16)), "x", 2, "bfloat16", 1),
    ("quantize_nvfp4 rng_state", lambda: fp8core.quantize_nvfp4(X, rounding="stochastic", rng_state=misaligned(
        [5, 6], np.int64, 4)), "rng_state", 8, "int64", 4),
    ("quantize_mxfp4 x", lambda: fp8core.quantize_mxfp4(misaligned(X, F32, 3)), "x", 4, "float32", 3),
    ("dequantize_nvfp4 global_amax", lambda: fp8core.dequantize_nvfp4(fp8core.NVFP4Tensor(
        np.zeros((2, 16), np.uint8), np.ones((2, 2), E4), misaligned([6.0], F32))), "t.global_amax", 4, "float32", 1),
    ("gemm bias", lambda: fp8core.gemm(np.ones((16, 32), E4), np.ones((16, 32), E4), 1.0, 1.0,
                                       bias=misaligned(np.ones(16), BF16)), "bias", 2, "bfloat16", 1),
    ("update history", lambda: fp8core.scaling.update_in_place(misaligned(np.ones((2, 2)), F32), np.ones(2, F32),
                                                                np.ones(2, F32), np.full(2, 448, F32),
                                                                np.zeros(2, bool), 0, "max", False, 0.0, True),
     "history", 4, "float32", 1),
]


@pytest.mark.parametrize("case,call,arg,size,dtype,by", MISALIGNED, ids=[c[0] for c in MISALIGNED])
def test_an_array_not_aligned_to_its_elements_is_refused_by_name(case, call, arg, size, dtype, by):
    """A GPU's 2-, 4- and 8-byte loads fault on an address that is not a multiple of the element size: such an array
    is refused by name on the CPU too (one rule, one error: tests/emulation/test_quantize.py has the CUDA path's),
    naming the argument, its element size and how far past the boundary it starts."""
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == (
        f"{arg}: its data pointer must be aligned to its {size}-byte {dtype} elements (a GPU's loads fault "
        f"otherwise; refused on every backend), got an address {by} byte{'s' if by > 1 else ''} past a {size}-byte "
        "boundary; pass a fresh copy")


def test_a_torch_tensor_not_aligned_to_its_elements_is_refused_as_numpys():
    """torch.frombuffer makes a bf16 CPU tensor at an odd address (torch's own .view(dtype) refuses to); it is
    refused as the NumPy array over the same bytes is, and a copy of it passes."""
    raw = bytearray(2 * 64 + 2)
    t = torch.frombuffer(raw, dtype=torch.bfloat16, offset=1, count=64)
    assert t.data_ptr() % 2 == 1
    with pytest.raises(ValueError, match=r"^x: its data pointer must be aligned to its 2-byte bfloat16 elements "
                                         r".* got an address 1 byte past a 2-byte boundary"):
        fp8core.quantize(t, 1.0)
    with pytest.raises(ValueError, match=r"^out: its data pointer .* 4-byte float32 elements"):
        fp8core.dequantize(torch.zeros(4, dtype=torch.float8_e4m3fn), 1.0, "float32",
                           out=torch.frombuffer(raw, dtype=torch.float32, offset=2, count=4))
    importlib.import_module("fp8core.torch")  # registers the custom ops: the same error through them
    with pytest.raises(ValueError, match=r"^x: its data pointer must be aligned to its 2-byte bfloat16 elements"):
        torch.ops.fp8core.quantize(t, torch.ones(1), "e4m3")
    assert torch.equal(fp8core.quantize(t.clone(), 1.0).view(torch.uint8),
                       fp8core.quantize(t.float(), 1.0).view(torch.uint8))


def test_arrays_aligned_to_their_elements_but_not_to_16_bytes_still_pass():
    """Only the element's own alignment is asked: views 1-7 elements into a buffer quantize as a copy does (the
    kernels take their scalar paths there), and 1-byte fp8 data is aligned at every address."""
    base = np.linspace(-5, 5, 80, dtype=F32)
    for k in range(1, 8):
        x = base.astype(BF16)[k:k + 64]
        np.testing.assert_array_equal(fp8core.quantize(x, 2.0).view(np.uint8),
                                      fp8core.quantize(x.copy(), 2.0).view(np.uint8))
        q = fp8core.quantize(base, 1.0)[k:k + 64]
        np.testing.assert_array_equal(fp8core.dequantize(q, 1.0), fp8core.dequantize(q.copy(), 1.0))
