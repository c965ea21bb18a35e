"""Any array in, the caller's own array type out: the boundary between frameworks and backends.

A :class:`Tensor` is a zero-copy view of the caller's memory. On the CPU its ``data`` is a NumPy array in the
logical dtype (ml_dtypes for fp8 and bf16); on a CUDA device it is a CuPy array in storage dtype (uint8 for
fp8, uint16 for bf16), because CuPy has neither type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._dlpack import CPU, CUDA, CUDA_HOST, CUDA_MANAGED, DLView, Exporter, import_dlpack
from .formats import dtype_name

__all__ = ["Tensor", "wrap", "export", "storage_dtype", "logical_numpy_dtype"]

_STORAGE = {"float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "float8_e8m0fnu": np.uint8, "bfloat16": np.uint16}


def storage_dtype(name: str) -> np.dtype:
    """The NumPy/CuPy dtype that holds ``name`` on a CUDA device."""
    return np.dtype(_STORAGE.get(name, name))


def logical_numpy_dtype(name: str) -> np.dtype:
    if name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "bfloat16"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


Device = tuple  # ("cpu", 0) or ("cuda", ordinal)


@dataclass
class Tensor:
    data: Any
    dtype: str
    device: Device
    origin: str
    readonly: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def is_cuda(self) -> bool:
        return self.device[0] == "cuda"

    def device_str(self) -> str:
        return "cpu" if self.device[0] == "cpu" else f"cuda:{self.device[1]}"


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


def _numpy_from_view(view: DLView) -> np.ndarray:
    logical = logical_numpy_dtype(view.dtype) if not view.dtype.startswith("dlpack(") else None
    if logical is None:
        raise TypeError(f"unsupported DLPack dtype {view.dtype}")
    storage = storage_dtype(view.dtype)
    if 0 in view.shape or view.ptr == 0:
        return np.empty(view.shape, dtype=logical)
    arr = np.asarray(_Interface(view, storage.str, storage.itemsize))
    return arr.view(logical) if storage != logical else arr


def _cupy_from_view(view: DLView) -> Any:
    import cupy

    storage = storage_dtype(view.dtype)
    if 0 in view.shape:
        with cupy.cuda.Device(view.device_id):
            return cupy.empty(view.shape, dtype=storage)
    extent = sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + 1
    mem = cupy.cuda.UnownedMemory(view.ptr, extent * storage.itemsize, view.owner, view.device_id)
    ptr = cupy.cuda.MemoryPointer(mem, 0)
    return cupy.ndarray(view.shape, dtype=storage, memptr=ptr,
                        strides=tuple(s * storage.itemsize for s in view.strides))


def _torch_stream(obj: Any) -> int | None:
    if not obj.is_cuda:
        return None
    import torch

    handle = torch.cuda.current_stream(obj.device).cuda_stream
    return handle or 1  # DLPack forbids 0 for CUDA: 1 names the legacy default stream


def wrap(obj: Any, arg: str = "x") -> Tensor:
    """A zero-copy :class:`Tensor` over ``obj`` (numpy, torch, jax, cupy, any DLPack or array-interface object)."""
    if isinstance(obj, Tensor):
        return obj
    origin = _origin(obj)
    if isinstance(obj, np.ndarray):
        return Tensor(obj, dtype_name(obj.dtype), ("cpu", 0), "numpy", not obj.flags.writeable)
    if origin == "cupy" or (not hasattr(obj, "__dlpack__") and hasattr(obj, "__cuda_array_interface__")):
        import cupy

        arr = obj if origin == "cupy" else cupy.asarray(obj)
        return Tensor(arr, dtype_name(arr.dtype), ("cuda", arr.device.id), origin)
    if hasattr(obj, "__dlpack__"):
        stream = None
        if origin == "torch":
            obj = obj.detach()
            stream = _torch_stream(obj)
        try:
            view = import_dlpack(obj, stream=stream, arg=arg)
        except (BufferError, RuntimeError) as e:
            raise TypeError(f"{arg}: could not be read through DLPack: {e}") from e
        readonly = view.readonly or origin == "jax"  # JAX arrays are immutable; legacy capsules carry no flag
        if view.device_type in (CPU, CUDA_HOST):
            return Tensor(_numpy_from_view(view), view.dtype, ("cpu", 0), origin, readonly)
        if view.device_type in (CUDA, CUDA_MANAGED):
            return Tensor(_cupy_from_view(view), view.dtype, ("cuda", view.device_id), origin, readonly)
        raise ValueError(f"{arg}: DLPack device type {view.device_type} is neither CPU nor CUDA")
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        arr = np.asarray(obj)
        return Tensor(arr, dtype_name(arr.dtype), ("cpu", 0), "numpy", not arr.flags.writeable)
    raise TypeError(f"{arg}: expected an array (numpy, torch, jax, cupy or any DLPack producer), "
                    f"got {type(obj).__name__}")


def _pointer(data: Any) -> int:
    if isinstance(data, np.ndarray):
        return data.ctypes.data if data.size else 0
    return data.data.ptr if data.size else 0


def export(data: Any, dtype: str, like: Tensor) -> Any:
    """Return backend output ``data`` (logical ``dtype``) as the same kind of array as ``like``."""
    if like.origin == "numpy" or like.origin == "cupy" or like.origin == "dlpack":
        return data
    on_cuda = not isinstance(data, np.ndarray)
    exporter = Exporter(_pointer(data), tuple(data.shape), dtype, CUDA if on_cuda else CPU,
                        like.device[1] if on_cuda else 0, owner=data,
                        strides=tuple(s // data.itemsize for s in data.strides))
    if like.origin == "torch":
        import torch

        return torch.from_dlpack(exporter)
    import jax.dlpack

    return jax.dlpack.from_dlpack(exporter)
