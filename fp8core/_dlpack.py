"""DLPack capsules read and written with ctypes.

fp8core exchanges fp8 and bf16 tensors that ``np.from_dlpack`` and CuPy refuse, so it reads capsules itself
(DLPack 1.x ``dltensor_versioned`` and legacy ``dltensor``) and writes them for torch and JAX to consume.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from .formats import ROWS

__all__ = ["DLView", "import_dlpack", "Exporter", "DTYPE_CODES", "CPU", "CUDA"]

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
_READ_ONLY = 1

# (code, bits) -> logical dtype name
DTYPE_CODES = {
    (2, 32): "float32", (2, 16): "float16", (2, 64): "float64", (4, 16): "bfloat16",
    # the encodings stored one to a byte (E2M1 is packed two to a byte, in 4-bit lanes: not read here)
    **{(row.dlpack_code, row.bits): row.dtype_name for row in ROWS if row.elements_per_byte == 1},
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64", (6, 8): "bool",
}
_CODES_BY_NAME = {name: code for code, name in DTYPE_CODES.items()}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


def _api(name: str, restype: Any, *argtypes: Any) -> Any:
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_get_pointer = _api("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_set_name = _api("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_name = _api("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
# Raw variants for the capsule destructor, which runs while the capsule's refcount is zero.
_is_valid_raw = _api("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_get_pointer_raw = _api("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_new_capsule = _api("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)

_NAME_V = b"dltensor_versioned"
_NAME = b"dltensor"
_USED_V = b"used_dltensor_versioned"
_USED = b"used_dltensor"


@dataclass
class DLView:
    """A borrowed view of a DLPack tensor. ``owner`` keeps the producer's memory alive."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, C-contiguous when the producer gave none
    dtype: str
    device_type: int
    device_id: int
    readonly: bool
    owner: Any


class _CapsuleOwner:
    """Calls the producer's deleter once our view is gone."""

    def __init__(self, managed_ptr: int, deleter: Any, capsule: Any) -> None:
        self._ptr = managed_ptr
        self._deleter = deleter
        self._capsule = capsule  # some producers tie the memory to the capsule object as well

    def __del__(self) -> None:
        if self._deleter:
            self._deleter(self._ptr)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def import_dlpack(obj: Any, *, stream: int | None = None, arg: str = "x") -> DLView:
    """Consume ``obj.__dlpack__`` (versioned first, then legacy) into a :class:`DLView`, zero-copy."""
    kwargs = {} if stream is None else {"stream": stream}
    try:
        capsule = obj.__dlpack__(max_version=(1, 1), **kwargs)
    except TypeError:
        capsule = obj.__dlpack__(**kwargs)
    name = _capsule_name(capsule)
    if name == _NAME_V:
        ptr = _get_pointer(capsule, _NAME_V)
        managed = _ManagedVersioned.from_address(ptr)
        tensor, readonly = managed.dl_tensor, bool(managed.flags & _READ_ONLY)
        _set_name(capsule, _USED_V)
    elif name == _NAME:
        ptr = _get_pointer(capsule, _NAME)
        managed = _Managed.from_address(ptr)
        tensor, readonly = managed.dl_tensor, False
        _set_name(capsule, _USED)
    else:
        raise TypeError(f"{arg}: __dlpack__ returned a capsule named {name!r}, not a DLPack tensor")
    deleter = ctypes.cast(managed.deleter, ctypes.c_void_p).value
    owner = _CapsuleOwner(ptr, _Deleter(deleter) if deleter else None, capsule)
    code = (tensor.dtype.code, tensor.dtype.bits)
    if tensor.dtype.lanes != 1:
        raise TypeError(f"{arg}: vector dtypes (lanes={tensor.dtype.lanes}) are not supported")
    dtype = DTYPE_CODES.get(code, f"dlpack(code={code[0]}, bits={code[1]})")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(tensor.ndim))
    else:
        strides = _contiguous_strides(shape)
    return DLView(ptr=(tensor.data or 0) + tensor.byte_offset, shape=shape, strides=strides, dtype=dtype,
                  device_type=tensor.device.device_type,
                  device_id=tensor.device.device_id, readonly=readonly, owner=owner)


# Exporting: each live capsule's ctypes structures are kept here until the consumer calls the deleter.
_live: dict[int, Any] = {}
# Re-entrant: a garbage collection inside the locked region can run another capsule's deleter on this thread.
_live_lock = threading.RLock()


@_Deleter
def _delete_managed(ptr: int) -> None:
    with _live_lock:
        entry = _live.pop(ptr, None)
    # Dropped outside the lock: the owner may be a tensor whose release runs further deleters.
    del entry


@_Destructor
def _destroy_capsule(capsule: int) -> None:
    # An unconsumed capsule still owns its tensor: release it. A consumed one was renamed "used_...".
    for name in (_NAME_V, _NAME):
        if _is_valid_raw(capsule, name):
            _delete_managed(_get_pointer_raw(capsule, name))
            return


# Consumers (torch, JAX) may free our tensors during interpreter shutdown, after this module's globals are
# cleared: the two C callbacks and the table they use must outlive it, so they are never released.
for _immortal in (_delete_managed, _destroy_capsule, _live, _live_lock):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_immortal))
del _immortal


def _stream_wait(consumer: int, producer: int, device_id: int) -> None:
    """consumer waits (on the device) for the work queued on producer so far."""
    from cupy.cuda import Device
    from cupy_backends.cuda.api import runtime

    with Device(device_id):
        event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        try:
            runtime.eventRecord(event, producer)
            runtime.streamWaitEvent(consumer, event, 0)
        finally:
            runtime.eventDestroy(event)  # released once the wait is done; the wait itself stays queued


class Exporter:
    """An object with ``__dlpack__``/``__dlpack_device__`` exporting memory that ``owner`` keeps alive.

    ``dtype`` is a logical name (fp8 and bf16 included); ``strides`` are in elements. ``stream``: the raw CUDA
    stream the memory was written on, when known; a consumer that names another stream is made to wait for it
    (an event, no host synchronisation), as the DLPack protocol asks of producers.
    """

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: str, device_type: int, device_id: int,
                 owner: Any, strides: tuple[int, ...] | None = None, stream: int | None = None) -> None:
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype
        self.device_type, self.device_id, self.owner = device_type, device_id, owner
        self.strides = tuple(strides) if strides is not None else _contiguous_strides(self.shape)
        self.stream = stream

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: Any = None, copy: bool | None = None) -> Any:
        if copy:
            raise BufferError("fp8core exports without copying; copy=True is not supported")
        if self.stream is not None and stream is not None and stream != -1 and self.device_type == CUDA:
            consumer = 0 if stream == 1 else int(stream)  # DLPack's 1 is the legacy default stream (handle 0)
            if consumer != self.stream:
                _stream_wait(consumer, self.stream, self.device_id)
        code, bits = _CODES_BY_NAME[self.dtype]
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        versioned = max_version is not None and max_version[0] >= 1
        managed = _ManagedVersioned() if versioned else _Managed()
        t = managed.dl_tensor
        t.data = self.ptr or None
        t.device = _Device(self.device_type, self.device_id)
        t.ndim = ndim
        t.dtype = _DType(code, bits, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        managed.deleter = _delete_managed
        if versioned:
            managed.version = _Version(1, 1)
            managed.flags = 0
        address = ctypes.addressof(managed)
        with _live_lock:
            _live[address] = (managed, shape, strides, self.owner)
        return _new_capsule(address, _NAME_V if versioned else _NAME, _destroy_capsule)
