"""Arrays from numpy, torch and jax in, the same kind out, zero-copy; bad inputs get clear errors."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core._dlpack import CPU, Exporter
from fp8core._tensor import _pointer, wrap
from oracle import quantize_bits

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy


def test_torch_in_torch_out_with_fp8_and_bf16():
    x = torch.randn(33, 17, dtype=torch.bfloat16)
    q = fp8core.quantize(x, 2.0, "e4m3")
    assert isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    expected = quantize_bits(x.float().numpy(), 2.0, "e4m3")
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), expected)
    y = fp8core.dequantize(q, 0.5, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    a = fp8core.amax(x)
    assert a.dtype == torch.float32 and a.shape == (1,) and a.item() == x.float().abs().max().item()


def test_torch_scale_and_amax_out_tensors_are_used_in_place():
    x = torch.randn(100)
    scale = torch.tensor([4.0])
    slot = torch.zeros(1)
    fp8core.quantize(x, scale, torch.float8_e5m2, amax_out=slot)
    assert slot.item() == x.abs().max().item()


def test_jax_in_jax_out():
    x = jnp.linspace(-500, 500, 64, dtype=jnp.bfloat16).reshape(8, 8)
    q = fp8core.quantize(x, 1.0, "e4m3")
    assert isinstance(q, jax.Array) and q.dtype == jnp.float8_e4m3fn
    expected = quantize_bits(np.asarray(x.astype(jnp.float32)), 1.0, "e4m3")
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected)
    q2, qt = fp8core.cast_transpose(x, 1.0, "e4m3")
    np.testing.assert_array_equal(np.asarray(qt).view(np.uint8), expected.T)
    y = fp8core.dequantize(q, 1.0, "float32")
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32


def test_numpy_in_numpy_out():
    x = np.ones((4, 4), ml_dtypes.bfloat16)
    q = fp8core.quantize(x, 1.0, "e5m2")
    assert isinstance(q, np.ndarray) and q.dtype == np.dtype(ml_dtypes.float8_e5m2)


def test_inputs_are_zero_copy_views():
    t = torch.randn(10, 10, dtype=torch.bfloat16)
    assert wrap(t).data.ctypes.data == t.data_ptr()
    f8 = torch.zeros(16, dtype=torch.float8_e4m3fn)
    w = wrap(f8)
    assert w.dtype == "float8_e4m3fn" and w.data.ctypes.data == f8.data_ptr()
    offset = t[3:]
    assert wrap(offset).data.ctypes.data == offset.data_ptr()
    for device in {jax.devices("cpu")[0], jax.devices()[0]}:  # and the GPU's memory where JAX's default is one
        j = jax.device_put(np.arange(8, dtype=np.float32), device)
        assert _pointer(wrap(j).data) == j.unsafe_buffer_pointer()
    n = np.zeros(8, np.float16)
    assert wrap(n).data is n


def test_outputs_are_zero_copy_exports():
    arr = np.arange(16, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    t = torch.from_dlpack(Exporter(arr.ctypes.data, arr.shape, "float8_e4m3fn", CPU, 0, owner=arr))
    assert t.dtype == torch.float8_e4m3fn and t.data_ptr() == arr.ctypes.data
    bf = np.zeros(64, ml_dtypes.bfloat16)
    tb = torch.from_dlpack(Exporter(bf.ctypes.data, bf.shape, "bfloat16", CPU, 0, owner=bf))
    assert tb.dtype == torch.bfloat16 and tb.data_ptr() == bf.ctypes.data
    round_trip = wrap(tb)
    assert round_trip.data.ctypes.data == bf.ctypes.data


def test_exported_memory_outlives_the_producer_array():
    q = fp8core.quantize(torch.full((1000,), 3.0), 1.0)
    import gc

    gc.collect()
    assert (q.float() == 3.0).all()


def test_inputs_are_never_written(rng):
    x = rng.standard_normal(300).astype(np.float32)
    before = x.copy()
    fp8core.cast_transpose(x.reshape(10, 30), 7.0, "e4m3")
    fp8core.quantize_dynamic(x, "e5m2")
    np.testing.assert_array_equal(x, before)


F32 = np.float32
BAD = [
    ("int data", lambda: fp8core.quantize(np.arange(4), 1.0), TypeError, "x: expected float32, bfloat16 or float16"),
    ("float64 data", lambda: fp8core.amax(np.zeros(4)), TypeError, "got float64"),
    ("fp8 where high precision", lambda: fp8core.quantize(np.zeros(4, ml_dtypes.float8_e4m3fn), 1.0), TypeError,
     "got fp8"),
    ("high precision where fp8", lambda: fp8core.dequantize(np.zeros(4, F32), 1.0), TypeError,
     "q: expected fp8 data"),
    ("uint8 without fmt", lambda: fp8core.transpose(np.zeros((2, 2), np.uint8)), TypeError, "fmt="),
    ("fmt mismatch", lambda: fp8core.dequantize(np.zeros(2, ml_dtypes.float8_e5m2), 1.0, fmt="e4m3"), ValueError,
     "does not match"),
    ("scale with 2 elements", lambda: fp8core.quantize(np.zeros(4, F32), np.ones(2, F32)), ValueError,
     "scale: expected 1 element"),
    ("scale float64", lambda: fp8core.quantize(np.zeros(4, F32), np.ones(1)), TypeError, "scale: expected float32"),
    ("unknown format", lambda: fp8core.quantize(np.zeros(4, F32), 1.0, "e3m4"), ValueError, "unknown FP8 format"),
    ("hybrid is no encoding", lambda: fp8core.quantize(np.zeros(4, F32), 1.0, fp8core.Format.HYBRID), ValueError,
     "HYBRID"),
    ("bad out_dtype", lambda: fp8core.dequantize(np.zeros(4, ml_dtypes.float8_e4m3fn), 1.0, "int8"), ValueError,
     "out_dtype"),
    ("non-contiguous", lambda: fp8core.quantize(np.zeros((4, 4), F32).T, 1.0), ValueError, "contiguous"),
    ("read-only amax_out", lambda: fp8core.quantize(np.zeros(4, F32), 1.0, amax_out=jax.device_put(
        np.zeros(1, F32), jax.devices("cpu")[0])), ValueError, "read-only"),  # on x's device, as a GPU's default is not
    ("negative epsilon", lambda: fp8core.quantize_dynamic(np.zeros(4, F32), epsilon=-1.0), ValueError, "epsilon"),
    ("not an array", lambda: fp8core.amax("hello"), TypeError, "x: expected"),
    ("mismatched devices", lambda: fp8core.quantize(np.zeros(4, F32), _FakeCudaScale()), ValueError,
     "scale: is on cuda:0 but x is on cpu"),
]


class _FakeCudaScale:
    """A float32 DLPack producer that claims to live on cuda:0 (never dereferenced: the check comes first)."""

    def __init__(self):
        self._arr = np.ones(1, F32)

    def __dlpack__(self, **kw):
        return Exporter(self._arr.ctypes.data, (1,), "float32", 2, 0, owner=self._arr).__dlpack__(**kw)

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("case,call,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(case, call, exc, message, monkeypatch):
    import fp8core._tensor as tensor_mod

    monkeypatch.setattr(tensor_mod, "_cupy_from_view", lambda view, arg: _FakeCupy(view))
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


class _FakeCupy:
    """Stands in for a CuPy view where the machine has no GPU; only its metadata is ever read (shape, dtype, its
    address for the alignment check)."""

    def __init__(self, view):
        self.shape, self.size = view.shape, int(np.prod(view.shape))
        self.dtype = np.dtype(view.dtype)

        class _Flags:
            c_contiguous = True

        class _Pointer:
            ptr = view.ptr

        self.flags, self.data = _Flags(), _Pointer()

    def reshape(self, *a):
        return self
