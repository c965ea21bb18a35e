"""Any array in, the caller's own array type out: the boundary between frameworks and backends.

A :class:`Tensor` is a zero-copy view of the caller's memory. On the CPU its ``data`` is a NumPy array in the
logical dtype (ml_dtypes for fp8 and bf16); on a CUDA device it is a CuPy array in storage dtype (uint8 for
fp8, uint16 for bf16), because CuPy has neither type.

Each array type fp8core knows (NumPy, torch, CuPy, JAX) is read through its own attributes; every other
producer through DLPack (or the array interfaces). The reader is picked once per type (:func:`wrap`), and both
readers give the same views and the same errors (tests/test_fastpath.py reads the same data through each).

JAX placement. Results of a call on a jax.Array follow JAX's own rule for an operation on that array: an array
committed to a device (``jax.device_put(x, device)``, or the result of a computation on committed arrays) gives
results committed to the same device, with x's single-device sharding; an uncommitted array gives uncommitted
results on the default device, where ``x + 1`` would put them. Every CPU device of XLA:CPU reads the same host
memory, so the computation itself runs on the host either way; only the results' placement follows x. Two JAX
arguments committed to different devices are refused, naming the argument (``scale: is on cpu:0 but x is on
cpu:1``), as jax.jit refuses them; an uncommitted JAX argument, a NumPy array or a Python number goes with any
device, as in JAX. A JAX array sharded over several devices is refused: fp8core.jax's primitives run per shard
inside ``shard_map``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

import ml_dtypes
import numpy as np

from ._dlpack import CPU, CUDA, CUDA_HOST, CUDA_MANAGED, DLView, Exporter, import_dlpack
from ._views import Tensor, logical_numpy_dtype, storage_dtype
from .extras import install_hint
from .formats import ENCODINGS, dtype_name

__all__ = ["Tensor", "wrap", "export", "export_all", "storage_dtype", "logical_numpy_dtype"]

_CPU = ("cpu", 0)


# ---- NumPy ------------------------------------------------------------------------------------------------

# dtype.num -> logical name, for native byte order (a big-endian dtype shares its num and is refused first).
_NP_NAMES: dict[int, str] = {
    np.dtype(t).num: np.dtype(t).name
    for t in (np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
              np.uint32, np.uint64, np.bool_, ml_dtypes.bfloat16, *(row.numpy_dtype for row in ENCODINGS.values()))
}


def _numpy_dtype_name(dt: np.dtype, arg: str) -> str:
    if not dt.isnative:
        order = "big-endian" if dt.byteorder == ">" else "non-native"
        raise TypeError(f"{arg}: {order} data (dtype '{dt.str}', byte order '{dt.byteorder}') is not supported; "
                        f"convert it with .astype('{dt.newbyteorder('=').str}')")
    name = _NP_NAMES.get(dt.num)
    return name if name is not None else dtype_name(dt)


def _from_numpy(arr: np.ndarray, arg: str, origin: str = "numpy") -> Tensor:
    if type(arr) is not np.ndarray:
        arr = _plain_ndarray(arr)
    dt = arr.dtype
    name = _NP_NAMES.get(dt.num) if dt.isnative else None
    if name is None:
        name = _numpy_dtype_name(dt, arg)
    return Tensor(arr, name, _CPU, origin, not arr.flags.writeable)


def _plain_ndarray(arr: np.ndarray) -> np.ndarray:
    """An ndarray subclass as the plain ndarray over its memory, as ``np.asarray`` reads it ("numpy in, numpy
    out": np.matrix, np.memmap and masked arrays come back as ndarrays; a mask is not applied, as np.asarray
    does not). np.matrix would stay 2-D under every reshape the primitives make."""
    return arr.view(np.ndarray)


# ---- torch ------------------------------------------------------------------------------------------------

_torch: Any = None
# torch dtype -> (logical name, array-interface typestr of its storage, NumPy view to the logical dtype or None)
_TORCH_INFO: dict[Any, tuple[str, str, Any]] = {}


def _torch_module() -> Any:
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def _torch_info(dt: Any, arg: str) -> tuple[str, str, Any]:
    info = _TORCH_INFO.get(dt)
    if info is not None:
        return info
    torch = _torch_module()
    name = str(dt)[len("torch."):]
    if dt.is_complex:
        raise TypeError(f"{arg}: complex data ({name}) is not supported; pass a real tensor")
    try:
        info = (name, torch.empty(0, dtype=dt).numpy().dtype.str, None)
    except TypeError:  # bfloat16 and fp8: NumPy has them only through ml_dtypes
        logical = getattr(ml_dtypes, name, None)
        if logical is None:
            raise TypeError(f"{arg}: torch dtype {name} is not supported") from None
        logical = np.dtype(logical)
        info = (name, {1: "|u1", 2: "<u2"}[logical.itemsize], logical)
    _TORCH_INFO[dt] = info
    return info


class _TorchMemory:
    """A torch CPU tensor's memory as NumPy sees it, read from its pointer, shape and strides. Not
    ``Tensor.numpy()``: that marks the storage non-resizable for good, a side effect on the caller's tensors
    (and on outputs, which should be ordinary torch tensors); it also needs a dtype view for bf16 and fp8.
    The reference to the tensor keeps the memory alive for as long as the NumPy view lives."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, typestr: str) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "version": 3, "shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
            "strides": None if t.is_contiguous() else tuple(s * t.element_size() for s in t.stride()),
        }


def _torch_cpu_array(t: Any, typestr: str, logical: Any) -> np.ndarray:
    nbytes = t.nbytes
    if nbytes == 0:
        return np.empty(tuple(t.shape), logical if logical is not None else np.dtype(typestr))
    if t.is_contiguous():
        return _contiguous_view(t, logical if logical is not None else np.dtype(typestr), t.shape, nbytes)
    arr = np.asarray(_TorchMemory(t, typestr))
    return arr if logical is None else arr.view(logical)


def _contiguous_view(t: Any, dtype: np.dtype, shape: Any, nbytes: int) -> np.ndarray:
    """A contiguous, non-empty torch CPU tensor's memory as NumPy ``dtype`` (same element size), zero-copy.
    A ctypes buffer over its bytes is the array's base and holds the tensor: half what the array interface
    costs (_TorchMemory, which strided tensors need)."""
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    buf.tensor = t
    arr = np.frombuffer(buf, dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _from_torch(t: Any, arg: str) -> Tensor:
    if t.is_neg():  # a lazy negation view (torch._neg_view(t), t.conj().imag): read as memory, its opposite
        raise ValueError(f"{arg}: the tensor carries torch's negative bit (a lazy negation view such as "
                         "torch._neg_view(t) or t.conj().imag); call .resolve_neg() on it first")
    name, typestr, logical = _torch_info(t.dtype, arg)  # refuses complex dtypes
    if t.is_cuda:
        return _torch_cuda(t, name, arg)
    if not t.is_cpu:
        raise ValueError(f"{arg}: torch device '{t.device}' is neither CPU nor CUDA")
    try:
        arr = _torch_cpu_array(t, typestr, logical)
    except RuntimeError as e:  # tensor subclasses without storage (DTensor, fake tensors), sparse layouts
        if t.layout is not _torch_module().strided:
            raise TypeError(f"{arg}: a {str(t.layout)[len('torch.'):]} torch tensor is not supported; pass a "
                            "dense (strided) tensor, e.g. .to_dense()")
        raise TypeError(f"{arg}: could not read the torch tensor's memory: {e}") from e
    return Tensor(arr, name, _CPU, "torch")


def _torch_cuda(t: Any, name: str, arg: str) -> Tensor:
    cupy = _cupy_for(arg)
    storage = storage_dtype(name)
    device_id = t.get_device()
    shape = tuple(t.shape)
    if t.numel() == 0:
        with cupy.cuda.Device(device_id):
            return Tensor(cupy.empty(shape, dtype=storage), name, ("cuda", device_id), "torch")
    strides = t.stride()
    extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * storage.itemsize
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), extent, t, device_id)
    arr = cupy.ndarray(shape, dtype=storage, memptr=cupy.cuda.MemoryPointer(mem, 0),
                       strides=tuple(s * storage.itemsize for s in strides))
    return Tensor(arr, name, ("cuda", device_id), "torch")


# ---- CuPy and JAX -----------------------------------------------------------------------------------------

_cupy: Any = None


def _cupy_module() -> Any:
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def _cupy_for(arg: str) -> Any:
    """CuPy, for the CUDA array ``arg``; a missing CuPy refused by name. Here rather than in a front-end: inside
    a torch custom op it runs when a compiled graph runs, and torch.compile does not trace it."""
    try:
        return _cupy_module()
    except ImportError as e:
        raise RuntimeError(f"{arg}: a CUDA array needs CuPy for fp8core's kernels, and `import cupy` failed ({e}): "
                           f"{install_hint('cuda13', 'cuda12')}, whichever matches the CUDA driver") from e


def _cupy_dtype_name(arr: Any, arg: str) -> str:
    """The logical dtype of a CuPy array (or one made from __cuda_array_interface__). CuPy has no bfloat16: its bf16
    is uint16 storage, as fp8core's own bf16 results for CuPy are (float16 is CuPy's own, and no argument of fp8core
    is 16-bit integer data). fp8's uint8 names no format: fmt= does."""
    name = _numpy_dtype_name(arr.dtype, arg)
    return "bfloat16" if name == "uint16" else name


def _from_cupy(arr: Any, arg: str) -> Tensor:
    return Tensor(arr, _cupy_dtype_name(arr, arg), ("cuda", arr.data.device_id), "cupy")


# jax sharding -> (whether it places a whole array on one CPU device (then the array is one host buffer), the
# placement its committed arrays give their results: Tensor.place)
_JAX_SHARDINGS: dict[Any, tuple[bool, Any]] = {}
# (device, memory kind) -> the one SingleDeviceSharding kept for it
_JAX_PLACES: dict[tuple[Any, Any], Any] = {}


def _jax_sharding(sharding: Any) -> tuple[bool, Any]:
    info = _JAX_SHARDINGS.get(sharding)
    if info is None:
        import jax

        single = type(sharding) is jax.sharding.SingleDeviceSharding
        devices = sharding.device_set
        place = None
        if len(devices) == 1:  # a single-device NamedSharding places its array as a SingleDeviceSharding does
            key = (next(iter(devices)), sharding.memory_kind)
            place = _JAX_PLACES.get(key)
            if place is None:  # setdefault: two threads here at once keep the same one (placements compare by `is`)
                place = _JAX_PLACES.setdefault(key, sharding if single else
                                               jax.sharding.SingleDeviceSharding(key[0], memory_kind=key[1]))
        info = (single and next(iter(devices)).platform == "cpu", place)
        if single:  # one per device: the cache stays small
            _JAX_SHARDINGS[sharding] = info
    return info


def _from_jax(x: Any, arg: str) -> Tensor:
    # One CPU device: the host buffer without asking DLPack where it lives (x.__dlpack_device__ costs more than
    # the read). x.__array__() is np.asarray(x) without NumPy's protocol lookup: a zero-copy read-only view that
    # waits for x to be computed. Deleted arrays take the general path, for its errors; arrays sharded over
    # several devices are refused (DLPack would refuse them with a vaguer message).
    on_cpu, place = _jax_sharding(x.sharding)
    if on_cpu and not x.is_deleted():
        t = _from_numpy(x.__array__(), arg, "jax")
    elif place is None:
        raise ValueError(f"{arg}: is a jax.Array sharded over {len(x.sharding.device_set)} devices; fp8core takes "
                         "one device's array: call fp8core.jax's primitives inside jax.shard_map, on each shard")
    elif x.__dlpack_device__()[0] == CPU:
        t = _from_numpy(np.asarray(x), arg, "jax")  # zero-copy and read-only on the CPU
    else:
        t = _from_dlpack(x, arg)
    if place is not None and x.committed:  # the device is read here once; uncommitted arrays keep None
        t.place = place
    return t


def _jax_tracer(x: Any, arg: str) -> Tensor:
    raise TypeError(f"{arg}: got a JAX tracer: the core primitives need concrete arrays and cannot run inside "
                    "jax.jit, vmap or grad; use the same function from fp8core.jax (e.g. fp8core.jax.quantize), "
                    "which does")


def _from_jax_buffer(b: Any, arg: str) -> Tensor:
    """A buffer that ``jax.experimental.buffer_callback`` hands fp8core.jax's callbacks: XLA's memory."""
    if b.__dlpack_device__()[0] == CPU:
        arr = np.asarray(b)
        return Tensor(arr, _numpy_dtype_name(arr.dtype, arg), _CPU, "jax", not b.writeable)
    # No stream named: the callback runs on XLA's stream, where the buffer is already ordered, and fp8core
    # launches on that same stream (launch_stream); what jaxlib's Buffer does with a stream is unverified.
    return _from_dlpack(b, arg, consumer=False)


# ---- DLPack: every other producer -------------------------------------------------------------------------

def _origin(obj: Any) -> str:
    module = type(obj).__module__.split(".")[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


class _Interface:
    def __init__(self, view: DLView, typestr: str, itemsize: int) -> None:
        self.owner = view.owner
        self.__array_interface__ = {
            "version": 3, "shape": view.shape, "typestr": typestr,
            "strides": tuple(s * itemsize for s in view.strides),
            "data": (view.ptr, view.readonly),
        }


def _numpy_from_view(view: DLView, arg: str = "x") -> np.ndarray:
    if view.dtype.startswith("dlpack("):
        raise TypeError(f"{arg}: unsupported DLPack dtype {view.dtype}")
    logical = logical_numpy_dtype(view.dtype)
    storage = storage_dtype(view.dtype)
    if 0 in view.shape or view.ptr == 0:
        return np.empty(view.shape, dtype=logical)
    arr = np.asarray(_Interface(view, storage.str, storage.itemsize))
    return arr.view(logical) if storage != logical else arr


def _cupy_from_view(view: DLView, arg: str) -> Any:
    cupy = _cupy_for(arg)
    storage = storage_dtype(view.dtype)
    if 0 in view.shape:
        with cupy.cuda.Device(view.device_id):
            return cupy.empty(view.shape, dtype=storage)
    extent = sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + 1
    mem = cupy.cuda.UnownedMemory(view.ptr, extent * storage.itemsize, view.owner, view.device_id)
    ptr = cupy.cuda.MemoryPointer(mem, 0)
    return cupy.ndarray(view.shape, dtype=storage, memptr=ptr,
                        strides=tuple(s * storage.itemsize for s in view.strides))


def _consumer_stream(obj: Any) -> int | None:
    """For an array on a CUDA device, the stream fp8core's kernels will read it on, so that its producer orders
    its pending work before them on the GPU. With no stream named, the DLPack convention is a producer that
    synchronises with the legacy default stream, and JAX blocks the host until the array is ready: a hidden
    host synchronisation on every call."""
    try:
        device_type, device = obj.__dlpack_device__()
    except Exception:  # no such method, or one that fails: import_dlpack reports the object as it is
        return None
    if device_type not in (CUDA, CUDA_MANAGED):
        return None
    try:
        cupy = _cupy_module()
    except ImportError:  # no CuPy, no stream to name: the import goes on to the general error
        return None
    # CuPy's current stream is the one the CUDA backend launches on for non-torch arrays; the front-ends that
    # name another (launch_stream) make it CuPy's current stream too.
    try:
        return cupy.cuda.get_current_stream(device).ptr or 1  # DLPack forbids 0 for CUDA: 1, the legacy default
    except cupy.cuda.runtime.CUDARuntimeError:  # no usable driver: no kernel will read it; the call fails later
        return None                             # with the backend's own error (or a device check's)


def _from_dlpack(obj: Any, arg: str, consumer: bool = True) -> Tensor:
    """``consumer``: name fp8core's stream to a CUDA producer (see _consumer_stream)."""
    origin = _origin(obj)
    stream = _consumer_stream(obj) if consumer else None
    try:
        view = import_dlpack(obj, stream=stream, arg=arg)
    except (BufferError, RuntimeError) as e:
        raise TypeError(f"{arg}: could not be read through DLPack: {e}") from e
    readonly = view.readonly or origin == "jax"  # JAX arrays are immutable; legacy capsules carry no flag
    if view.device_type in (CPU, CUDA_HOST):
        return Tensor(_numpy_from_view(view, arg), view.dtype, _CPU, origin, readonly)
    if view.device_type in (CUDA, CUDA_MANAGED):
        return Tensor(_cupy_from_view(view, arg), view.dtype, ("cuda", view.device_id), origin, readonly)
    raise ValueError(f"{arg}: DLPack device type {view.device_type} is neither CPU nor CUDA")


def _generic(obj: Any, arg: str) -> Tensor:
    if not hasattr(obj, "__dlpack__") and hasattr(obj, "__cuda_array_interface__"):
        cupy = _cupy_for(arg)
        arr = cupy.asarray(obj)
        return Tensor(arr, _cupy_dtype_name(arr, arg), ("cuda", arr.data.device_id), _origin(obj))
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, arg)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        return _from_numpy(np.asarray(obj), arg)
    raise TypeError(f"{arg}: expected an array (numpy, torch, jax, cupy or any DLPack producer), "
                    f"got {type(obj).__name__}")


# ---- dispatch by type -------------------------------------------------------------------------------------

Handler = Callable[[Any, str], Tensor]
_HANDLERS: dict[type, Handler] = {np.ndarray: _from_numpy, Tensor: lambda t, arg: t}


def _handler_for(tp: type) -> Handler:
    """The reader for an array type, decided once per type from its base classes (a subclass of torch.Tensor
    defined anywhere is torch's: DLPack would drop its negative bit) and, for JAX, its module."""
    module = tp.__module__.split(".")[0]
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")  # an object of theirs means they are imported
    handler: Handler = _generic
    if issubclass(tp, np.ndarray):
        handler = _from_numpy
    elif torch is not None and issubclass(tp, torch.Tensor):
        handler = _from_torch
    elif cupy is not None and issubclass(tp, cupy.ndarray):
        handler = _from_cupy
    elif module in ("jax", "jaxlib"):
        import jax

        if issubclass(tp, jax.core.Tracer):
            handler = _jax_tracer
        elif issubclass(tp, jax.Array):
            handler = _from_jax
        elif tp.__module__ == "jax.experimental.buffer_callback":
            handler = _from_jax_buffer
    _HANDLERS[tp] = handler
    return handler


def wrap(obj: Any, arg: str = "x") -> Tensor:
    """A zero-copy :class:`Tensor` over ``obj`` (numpy, torch, jax, cupy, any DLPack or array-interface object).

    Refused with an error naming ``arg``: non-native byte order, complex data, torch tensors carrying the
    negative bit, JAX tracers, devices other than CPU and CUDA.
    """
    tp = type(obj)
    if tp is np.ndarray:
        dt = obj.dtype
        name = _NP_NAMES.get(dt.num) if dt.isnative else None
        if name is not None:
            return Tensor(obj, name, _CPU, "numpy", not obj.flags.writeable)
    handler = _HANDLERS.get(tp)
    if handler is None:
        handler = _handler_for(tp)
    return handler(obj, arg)


# ---- outputs ----------------------------------------------------------------------------------------------

def _pointer(data: Any) -> int:
    if isinstance(data, np.ndarray):
        return data.ctypes.data if data.size else 0
    return data.data.ptr if data.size else 0


def _exporter(data: Any, dtype: str, like: Tensor, stream: int | None = None) -> Exporter:
    on_cuda = not isinstance(data, np.ndarray)
    return Exporter(_pointer(data), tuple(data.shape), dtype, CUDA if on_cuda else CPU,
                    like.device[1] if on_cuda else 0, owner=data,
                    strides=tuple(s // data.itemsize for s in data.strides), stream=stream)


def _torch_owner(data: Any) -> Any:
    """The torch tensor whose memory ``data`` covers exactly, when torch allocated it (the torch caller's
    ``empty``, fp8core._views), else None."""
    torch = _torch
    if type(data) is np.ndarray:
        owner = data.base
        while type(owner) is np.ndarray:
            owner = owner.base
        if type(owner) is _TorchMemory or isinstance(owner, ctypes.Array):
            owner = getattr(owner, "tensor", None)
        # A C-contiguous view as large as a contiguous owner starts where the owner starts.
        if isinstance(owner, torch.Tensor) and data.flags.c_contiguous and data.nbytes == owner.nbytes \
                and owner.is_contiguous():
            return owner
        return None
    mem = getattr(data.data, "mem", None)
    owner = getattr(mem, "_owner", None)
    if isinstance(owner, torch.Tensor) and data.flags.c_contiguous and data.nbytes == owner.nbytes \
            and owner.is_contiguous() and data.data.ptr == owner.data_ptr():
        return owner
    return None


# logical name -> (torch dtype, NumPy dtype torch.from_numpy takes for it)
_TORCH_OUT: dict[str, tuple[Any, np.dtype]] = {}


def _to_torch(data: Any, dtype: str, like: Tensor) -> Any:
    spec = _TORCH_OUT.get(dtype)
    if spec is None:
        torch = _torch_module()
        # torch.from_numpy takes none of the ml_dtypes types: a same-size integer view (e8m0: block scales)
        dt = np.dtype(dtype)
        storage = dt if dt.type.__module__ != "ml_dtypes" else np.dtype(np.int16 if dt.itemsize == 2 else np.uint8)
        spec = _TORCH_OUT[dtype] = (getattr(torch, dtype), storage)
    target, storage = spec
    owner = _torch_owner(data)
    if owner is not None:
        out = owner if owner.dtype == target else owner.view(target)
        return out if out.shape == data.shape else out.view(data.shape)
    if type(data) is np.ndarray:
        flags = data.flags
        if flags.writeable and flags.c_contiguous:
            t = _torch.from_numpy(data if data.dtype == storage else data.view(storage))
            return t if t.dtype == target else t.view(target)
    return _torch_module().from_dlpack(_exporter(data, dtype, like))


def export(data: Any, dtype: str, like: Tensor) -> Any:
    """Return backend output ``data`` (logical ``dtype``) as the same kind of array as ``like``."""
    origin = like.origin
    if origin == "numpy" or origin == "cupy" or origin == "dlpack":
        return data
    if origin == "torch":
        return _to_torch(data, dtype, like)
    place = like.place
    if type(data) is np.ndarray:
        if data.nbytes <= _JAX_COPY_MAX:
            return _jax_put(place)(data)[0]
        import jax

        # Not DLPack's import: that commits its result to the first CPU device (another device takes a second
        # copy), and it is no faster (bench/bench_overhead.py --jax-export).
        return jax.device_put(data, place)
    import jax.dlpack

    # On a GPU the kernels ran on CuPy's current stream (the caller's stream for non-torch arrays); XLA reads on
    # its own (non-blocking) stream, which the exporter makes wait for them. The import lands on the GPU that
    # holds the memory (x's) and commits to it whatever x was: an uncommitted x's results are uncommitted again.
    stream = None if type(data) is np.ndarray else _cupy_module().cuda.get_current_stream().ptr
    out = jax.dlpack.from_dlpack(_exporter(data, dtype, like, stream), device=place)
    return out if place is not None else _jax_uncommitted(out)


def _jax_uncommitted(arr: Any) -> Any:
    """``arr`` (a single-device jax.Array) uncommitted, over the same buffer. JAX has no public call for this
    (jax.device_put with no device keeps a committed array committed): this is the constructor JAX's own
    make_array_from_single_device_arrays calls, with committed=False, as jit gives results of uncommitted
    arguments."""
    return type(arr)(arr.aval, arr.sharding, [arr], committed=False)


# Up to this many bytes a NumPy result goes to JAX as an argument of a jitted identity, copied by jit's C++
# argument path (jax.numpy.asarray and jax.device_put run far more Python); above it, the copy costs more than
# jax.device_put. bench/bench_overhead.py --jax-export measures where they meet.
_JAX_COPY_MAX = 1 << 19
_jax_identity: Any = None
# Tensor.place -> the jitted identity whose results are committed to it
_jax_placed: dict[Any, Any] = {}


def _jax_put(place: Any = None) -> Any:
    """jax.jit of the identity: NumPy arrays in, a tuple of jax.Arrays holding copies out: uncommitted on the
    default device, or committed to ``place`` (a Tensor.place). Large arguments are copied asynchronously, jit
    holding the arrays until then: like DLPack's import, this is for fresh results that nobody writes
    afterwards."""
    global _jax_identity
    if place is not None:
        put = _jax_placed.get(place)
        if put is None:
            import jax

            put = _jax_placed[place] = jax.jit(lambda *arrays: arrays, out_shardings=place)
        return put
    if _jax_identity is None:
        import jax

        _jax_identity = jax.jit(lambda *arrays: arrays)
    return _jax_identity


def export_all(results: Any, like: Tensor) -> tuple:
    """:func:`export` of several ``(data, dtype)`` results of one call; JAX's small ones in one jitted copy (one
    dispatch instead of one per result)."""
    if like.origin == "jax" and all(type(d) is np.ndarray for d, _ in results) \
            and sum(d.nbytes for d, _ in results) <= _JAX_COPY_MAX:
        return _jax_put(like.place)(*(d for d, _ in results))
    return tuple(export(d, name, like) for d, name in results)
