"""The readers of the array types fp8core knows (NumPy, torch, JAX, through their own attributes; torch outputs
allocated by torch) against its DLPack reader on the same memory (tests/producers.py): identical bits, identical
errors. No host synchronisation on the GPU path, checked in the source. The CPU thread pool survives fork."""

import ast
import gc
import multiprocessing
import pathlib

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import _tensor
from fp8core._tensor import wrap
from producers import DLPackOnly

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax_places import JAX_CPU  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The host readers are the ones under test (torch's tensors here are CPU tensors too): JAX arrays are placed on
# the CPU device, which is not JAX's default on a machine with a GPU.


def _own(a):
    return a


READERS = {"own": _own, "dlpack": DLPackOnly}  # how fp8core is made to read an array: its own reader, DLPack


def _values(n=48, seed=0):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * 100).astype(np.float32)
    v[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40]
    return v


def _make(kind, v, dtype):
    """v (float32 NumPy) as `kind` in `dtype` ('float32' or 'bfloat16')."""
    if kind == "numpy":
        return v.astype(getattr(ml_dtypes, dtype, dtype))
    if kind == "torch":
        return torch.from_numpy(v.copy()).to(getattr(torch, dtype))
    return jax.device_put(v.astype(getattr(ml_dtypes, dtype, dtype)), JAX_CPU)


def _bits(a):
    """The raw bytes and dtype name of any output."""
    if isinstance(a, torch.Tensor):
        return str(a.dtype)[6:], tuple(a.shape), a.contiguous().view(torch.uint8).numpy().tobytes()
    arr = np.asarray(a)
    return arr.dtype.name, arr.shape, arr.tobytes()


def _ops(kind, dtype, read):
    """Each primitive on `kind` arrays, every array argument passed through `read`."""
    v = _values()
    x = _make(kind, v, dtype)
    x2 = x.reshape(6, 8)
    q = fp8core.quantize(_make(kind, v, "float32"), 0.25, "e4m3")
    slot = np.zeros(1, np.float32) if kind != "torch" else torch.zeros(1)
    scale = {"numpy": np.array([0.25], np.float32), "torch": torch.tensor([0.25]),
             "jax": jax.device_put(np.array([0.25], np.float32), JAX_CPU)}[kind]
    return {
        "amax": lambda: fp8core.amax(read(x)),
        "quantize": lambda: fp8core.quantize(read(x), read(scale), "e4m3"),
        "quantize_amax_out": lambda: (fp8core.quantize(read(x), 2.0, "e5m2", amax_out=read(slot)), slot + 0),
        "quantize_dynamic": lambda: fp8core.quantize_dynamic(read(x), "e4m3", margin=1),
        "dequantize": lambda: fp8core.dequantize(read(q), read(scale), "bfloat16"),
        "transpose": lambda: fp8core.transpose(read(q.reshape(6, 8))),
        "cast_transpose": lambda: fp8core.cast_transpose(read(x2), read(scale), "e4m3"),
        "compute_scale": lambda: fp8core.compute_scale(fp8core.amax(read(x)), "e4m3", previous=2.0),
    }


OPS = ["amax", "quantize", "quantize_amax_out", "quantize_dynamic", "dequantize", "transpose", "cast_transpose",
       "compute_scale"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("op", OPS)
def test_own_readers_and_dlpack_give_identical_bits(op, kind, dtype):
    results = {}
    for reader, read in READERS.items():
        out = _ops(kind, dtype, read)[op]()
        outs = out if isinstance(out, tuple) else (out,)
        results[reader] = [_bits(o) for o in outs]
        if reader == "own":  # a producer fp8core does not know gets NumPy arrays back
            assert type(outs[0]).__module__.split(".")[0].replace("jaxlib", "jax") == kind
    assert results["own"] == results["dlpack"]


# A torch CPU scale is read by its 4 bytes: every kind of fp32 value, any offset into its storage, and a caller
# with flush-to-zero/denormals-are-zero set (a float read would see a subnormal as 0).
SCALES = [0.25, -0.0, 1e-40, -3e-39, float("nan"), float("inf"), 3.0e38, 2.0 ** -126]


@pytest.mark.parametrize("flush", [False, True], ids=["ieee", "ftz"])
@pytest.mark.parametrize("scale", SCALES, ids=[repr(s) for s in SCALES])
def test_a_torch_scale_reads_the_same_as_through_dlpack(scale, flush):
    x = torch.from_numpy(_values()).to(torch.bfloat16)
    s = torch.tensor([7.0, scale])[1:]  # an offset view of a 1-element scale
    results = {}
    try:
        torch.set_flush_denormal(flush)
        for reader, read in READERS.items():
            results[reader] = [_bits(fp8core.quantize(x, read(s), "e4m3")), _bits(fp8core.dequantize(
                fp8core.quantize(x, 1.0, "e5m2"), read(s), "float32")),
                _bits(fp8core.cast_transpose(x.reshape(6, 8), read(s))[1])]
    finally:
        torch.set_flush_denormal(False)
    assert results["own"] == results["dlpack"]
    ref = fp8core.quantize(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16), s.numpy().copy(), "e4m3")
    assert results["own"][0][2] == ref.tobytes()


@pytest.mark.parametrize("make", [lambda v: np.array(v, np.float32), lambda v: np.array([v], np.float32),
                                  lambda v: np.array([[v]], np.float32), lambda v: np.array([0, v], np.float32)[1:],
                                  lambda v: np.array([v, 0, 0], np.float32)[::2][:1]],
                         ids=["0-d", "[1]", "[1,1]", "offset", "strided"])
def test_numpy_scale_and_amax_slot_of_any_one_element_shape(make):
    """A 1-element float32 NumPy scale or amax_out (the shortcut's case) acts as the Python float does."""
    x = _values().astype(ml_dtypes.bfloat16)
    slot, ref_slot = make(-1.0), np.array([-1.0], np.float32)
    q = fp8core.quantize(x, make(0.25), "e4m3", amax_out=slot)
    ref = fp8core.quantize(x, 0.25, "e4m3", amax_out=ref_slot)
    assert q.tobytes() == ref.tobytes() and slot.reshape(-1).tobytes() == ref_slot.tobytes()


@pytest.mark.parametrize("slot,exc,pattern", [
    (np.frombuffer(bytes(4), np.float32), ValueError, r"amax_out: is read-only"),
    (np.zeros(2, np.float32), ValueError, r"amax_out: expected 1 element"),
    (np.zeros(1, ">f4"), TypeError, r"amax_out: big-endian"),
    (np.zeros(1, np.float64), TypeError, r"amax_out: expected float32"),
], ids=["read-only", "two elements", "big-endian", "float64"])
def test_numpy_amax_slots_the_shortcut_must_refuse(slot, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fp8core.quantize(np.ones(4, np.float32), 1.0, amax_out=slot)


def _neg_view():
    return torch._neg_view(torch.ones(4))


# Faults in the data itself: the DLPack reader of the same memory sees them and says the same.
BAD = [
    ("torch int", lambda r: fp8core.quantize(r(torch.arange(4)), 1.0), TypeError, r"x: expected float32"),
    ("torch non-contiguous", lambda r: fp8core.quantize(r(torch.ones(4, 4).t()), 1.0), ValueError,
     r"x: .*contiguous"),
    ("jax fp8 where high precision", lambda r: fp8core.amax(r(jnp.zeros(4, jnp.float8_e4m3fn))), TypeError,
     r"x: .*fp8"),
    ("torch fp8 scale", lambda r: fp8core.quantize(torch.ones(4), r(torch.ones(1, dtype=torch.float8_e4m3fn))),
     TypeError, r"scale: expected float32"),
    ("numpy scale of 2 elements", lambda r: fp8core.quantize(np.ones(4, np.float32), r(np.ones(2, np.float32))),
     ValueError, r"scale: expected 1 element"),
    ("numpy bool x", lambda r: fp8core.amax(r(np.ones(4, bool))), TypeError, r"x: expected float32"),
]
# Faults only the framework's own reader can see (DLPack has no field for them, or the producer refuses to
# export them): refused there with the framework's terms.
OWN_ONLY = [
    ("torch negative bit", lambda: fp8core.quantize(_neg_view(), 1.0), ValueError, r"x: .*negative bit.*resolve_neg"),
    ("torch conj().imag", lambda: fp8core.amax(torch.ones(3, dtype=torch.complex64).conj().imag), ValueError,
     r"x: .*negative bit"),
    ("torch negative-bit scale", lambda: fp8core.quantize(torch.ones(4), _neg_view()[:1]), ValueError,
     r"scale: .*resolve_neg"),
    ("torch complex", lambda: fp8core.amax(torch.ones(3, dtype=torch.complex64)), TypeError, r"x: complex"),
    ("numpy big-endian", lambda: fp8core.amax(np.ones(3, ">f4")), TypeError, r"x: big-endian"),
    ("jax tracer", lambda: jax.jit(lambda v: fp8core.amax(v))(jnp.ones(4)), TypeError, r"x: .*tracer.*fp8core\.jax"),
    ("torch sparse x", lambda: fp8core.amax(torch.ones(4).to_sparse()), TypeError, r"x: a sparse_coo torch tensor"),
    ("torch sparse scale", lambda: fp8core.quantize(torch.ones(4), torch.tensor([2.0]).to_sparse()), TypeError,
     r"scale: a sparse_coo torch tensor .*to_dense"),
]


@pytest.mark.parametrize("case,call,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_own_readers_and_dlpack_give_identical_errors(case, call, exc, pattern):
    messages = []
    for read in READERS.values():
        with pytest.raises(exc, match=pattern) as info:
            call(read)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("case,call,exc,pattern", OWN_ONLY, ids=[b[0] for b in OWN_ONLY])
def test_faults_only_the_own_reader_can_see(case, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(10, 10, dtype=torch.bfloat16),
    lambda: torch.randn(10, 10, dtype=torch.bfloat16)[3:],
    lambda: torch.zeros(16, dtype=torch.float8_e5m2),
    lambda: torch.randn(5, 7).t(),
    lambda: torch.randn(8, requires_grad=True),
    lambda: torch.randn(4, dtype=torch.float16),
], ids=["bf16", "offset", "fp8", "transposed", "requires_grad", "fp16"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_torch_tensor_is_read_as_a_zero_copy_view(make, reader):
    t = make()
    w = wrap(READERS[reader](t.detach() if reader == "dlpack" else t))  # torch exports no tensor needing grad
    assert w.origin == ("torch" if reader == "own" else "dlpack") and w.dtype == str(t.dtype)[6:]
    assert w.data.ctypes.data == t.data_ptr() and w.data.shape == tuple(t.shape)
    assert w.data.strides == tuple(s * t.element_size() for s in t.stride())
    np.testing.assert_array_equal(w.data.view(f"u{t.element_size()}"),
                                  t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
                                  .numpy().view(f"u{t.element_size()}"))


def test_empty_torch_tensors_and_numpy_subclasses():
    assert wrap(torch.zeros(0, 3, dtype=torch.bfloat16)).data.shape == (0, 3)
    assert fp8core.quantize(torch.zeros(0, 3), 1.0).shape == (0, 3)
    m = np.ma.masked_array(np.ones(4, np.float32))
    assert wrap(m).dtype == "float32"


def test_torch_outputs_are_allocated_by_torch_without_dlpack(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a torch CPU result exported through DLPack")

    monkeypatch.setattr(_tensor, "Exporter", refuse)
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    q = fp8core.quantize(x, 2.0)
    q2, qt = fp8core.cast_transpose(x, 2.0)
    y = fp8core.dequantize(q, 0.5, torch.bfloat16)
    for out in (q, q2, qt, y):
        # torch's own allocator: an ordinary storage that can be resized, like any torch.empty result
        assert out.untyped_storage().resizable()
    assert q.dtype == torch.float8_e4m3fn and qt.shape == (6, 4) and y.dtype == torch.bfloat16
    torch.testing.assert_close(q2.view(torch.uint8), q.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(qt.view(torch.uint8), q.view(torch.uint8).t(), rtol=0, atol=0)
    a = fp8core.amax(x)
    assert a.dtype == torch.float32 and a.shape == (1,)


@pytest.mark.parametrize("shape", [(1000,), (10, 100)])
def test_a_torch_view_holds_its_tensor(shape):
    """The NumPy view of a torch CPU tensor keeps the tensor (and so its memory) alive by itself."""
    w = wrap(torch.full(shape, 3.0, dtype=torch.bfloat16))  # the tensor's only reference is the view's
    gc.collect()
    junk = [torch.full(shape, -1.0, dtype=torch.bfloat16) for _ in range(8)]  # would reuse freed memory
    assert w.data.shape == shape and (w.data.astype(np.float32) == 3.0).all()
    del junk


def test_torch_outputs_outlive_everything_else():
    q = fp8core.quantize(torch.full((1000,), 3.0, dtype=torch.bfloat16), 1.0)
    y = fp8core.dequantize(q, 1.0, torch.float32)
    del q
    gc.collect()
    assert (y == 3.0).all()


def test_jax_buffer_callback_buffers_are_read_in_place():
    import fp8core.jax as fj

    x = jnp.asarray(_values(), jnp.bfloat16)
    q, a = jax.jit(fj.quantize)(x, 0.5)
    expected = fp8core.quantize(np.asarray(x), 0.5, "e4m3")
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))


# ---- no host synchronisation on the GPU path ---------------------------------------------------------------

# Modules that run on the GPU path (whole files: a sync in a CPU-only branch of them would be one line away
# from a GPU call).
GPU_PATH = ["fp8core/backends/cuda.py", "fp8core/backends/cublaslt.py", "fp8core/_kernels.py", "fp8core/_tensor.py",
            "fp8core/_dlpack.py", "fp8core/ops.py", "fp8core/gemm.py", "bindings/torch", "bindings/jax",
            "fp8core/backends/cuda_fp4.py", "fp8core/fp4.py", "fp8core/declarations.py"]
SYNC_ATTRIBUTES = {"item", "tolist", "asnumpy", "synchronize", "cpu", "deviceSynchronize", "streamSynchronize",
                   "cudaDeviceSynchronize", "cudaStreamSynchronize", "block_until_ready"}


def _host_syncs(source: str) -> list[str]:
    """Calls that wait for the GPU: .item(), .tolist(), cupy.asnumpy, .get() of an array, any synchronize."""
    tree = ast.parse(source)
    context_vars = {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name) and isinstance(node.value, ast.Call)
                    and "ContextVar" in ast.unparse(node.value.func)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in SYNC_ATTRIBUTES and not (name == "cpu" and node.args):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif name == "get" and isinstance(f, ast.Attribute) and not node.args and not node.keywords:
            # an array's .get() copies to the host; a context variable's .get() does not
            if not (isinstance(f.value, ast.Name) and f.value.id in context_vars):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


# Front-end tools that read to the host by design, say so in their docstrings, and are never on a primitive's path.
HOST_BY_DESIGN = {
    "bindings/torch/numerics.py": "record_numerics measures each cast on the host (opt-in, documented)",
    "bindings/jax/convert.py": "the flax checkpoint converters run on saved states, outside jit",
}


def _gpu_path_files():
    for entry in GPU_PATH:
        p = ROOT / entry
        yield from (f for f in (sorted(p.glob("*.py")) if p.is_dir() else [p])
                    if f.relative_to(ROOT).as_posix() not in HOST_BY_DESIGN)


@pytest.mark.parametrize("name", sorted(HOST_BY_DESIGN))
def test_host_by_design_modules_exist_and_say_they_read_to_the_host(name):
    """The exemptions above name real files, whose docstrings tell users that they work on the host."""
    doc = ast.get_docstring(ast.parse((ROOT / name).read_text())) or ""
    assert "host" in doc, f"{name}: its docstring does not say it works on the host"


@pytest.mark.parametrize("path_", list(_gpu_path_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_host_synchronisation_on_the_gpu_path(path_):
    assert _host_syncs(path_.read_text()) == []


@pytest.mark.parametrize("snippet", ["a.item()", "cupy.asnumpy(a)", "a.get()", "torch.cuda.synchronize()",
                                     "stream.synchronize()", "a.tolist()", "x.cpu()"])
def test_the_sync_scan_sees_each_kind(snippet):
    assert _host_syncs(f"def f(a, x, stream):\n    return {snippet}\n")
    assert not _host_syncs("import contextvars\nv = contextvars.ContextVar('v')\n"
                           "w: contextvars.ContextVar[int] = contextvars.ContextVar('w')\ndef f(d):\n"
                           "    return v.get(), w.get(), d.get('k')\n")


# ---- fork ------------------------------------------------------------------------------------------------

def _child(queue):
    x = np.ones(1 << 21, ml_dtypes.bfloat16)  # above the pool threshold: uses the thread pool
    queue.put(int(np.asarray(fp8core.quantize(x, 1.0)).view(np.uint8).max()))


def test_a_forked_child_can_use_the_thread_pool(monkeypatch):
    from fp8core.backends import cpu

    x = np.ones(max(max(cpu._POOL_MIN.values()), 1 << 21), ml_dtypes.bfloat16)
    fp8core.quantize(x, 1.0)  # the parent's pool exists now
    assert cpu._pool is not None or cpu._THREADS == 1
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    proc.join(timeout=60)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    assert not hung, "the forked child hung on its first pooled call"
    assert proc.exitcode == 0 and queue.get(timeout=5) == 0x38  # 1.0 in e4m3


def test_inputs_stay_resizable():
    """Reading a tensor must not change it: Tensor.numpy() would mark its storage non-resizable for good."""
    xs = [torch.randn(8), torch.randn(8, dtype=torch.bfloat16), torch.ones(1)]
    fp8core.quantize(xs[0], xs[2], amax_out=torch.zeros(1))
    fp8core.amax(xs[1])
    for x in xs:
        assert x.untyped_storage().resizable()
        x.resize_(16)


class _UserTensor(torch.Tensor):
    """A torch.Tensor subclass defined outside torch, as a user's or a library's own."""


def test_a_torch_subclass_defined_elsewhere_is_read_by_torchs_reader() -> None:
    """Read through DLPack, its negative bit would be dropped and its values read negated without a word."""
    with pytest.raises(ValueError, match=r"x: .*negative bit"):
        fp8core.amax(_neg_view().as_subclass(_UserTensor))
    x = torch.tensor([1.0, -3.0, 2.0]).as_subclass(_UserTensor)
    q = fp8core.quantize(x, 1.0)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), fp8core.quantize(torch.tensor([1.0, -3.0, 2.0]), 1.0).view(torch.uint8))
