"""The view the backends work on (:class:`Tensor`), and its caller: where results come from and which stream runs.

A :class:`Tensor` is a zero-copy view of the caller's memory, made by the boundary (fp8core._tensor). On the CPU
its ``data`` is a NumPy array in the logical dtype (ml_dtypes for fp8 and bf16); on a CUDA device it is a CuPy
array in storage dtype (uint8 for fp8, uint16 for bf16), because CuPy has neither type.

Its :class:`Caller` follows from the framework the boundary read the array from (``origin``): torch callers get
torch's allocator and current stream, everyone else NumPy's or CuPy's. The backends ask the caller and never the
framework.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - registers its dtype names with NumPy
import numpy as np

__all__ = ["Tensor", "Caller", "storage_dtype", "logical_numpy_dtype"]


def storage_dtype(name: str) -> np.dtype:
    """The NumPy/CuPy dtype that holds ``name`` on a CUDA device: an unsigned integer of its size for the
    ml_dtypes types (fp8, E8M0, bf16), which CuPy does not have."""
    dt = np.dtype(name)
    return np.dtype(f"u{dt.itemsize}") if dt.type.__module__ == "ml_dtypes" else dt


def logical_numpy_dtype(name: str) -> np.dtype:
    return np.dtype(name)  # importing ml_dtypes registers its types' names with NumPy


Device = tuple  # ("cpu", 0) or ("cuda", ordinal)


@functools.cache
def _cupy() -> Any:
    import cupy  # on a GPU call's path: an import statement costs about a microsecond

    return cupy


class Caller:
    """NumPy's and CuPy's allocators and CuPy's current stream: every caller but torch (NumPy, CuPy, JAX, DLPack)."""

    # Whether a device temporary made during a CUDA graph capture stays allocated as long as the graph. CuPy's
    # pool does nothing special during a capture: a block freed after the call goes to the next allocation while
    # every replay of the graph still reads or writes it.
    graph_safe = False
    # Whether results must come from :meth:`empty`: False when an array NumPy allocates (e.g. by a lookup) will do.
    allocates = False

    def stream(self, device: int) -> int:
        """The raw handle of the caller's current stream on CUDA ``device``."""
        return _cupy().cuda.get_current_stream(device).ptr

    def empty(self, shape: Any, dtype: Any, device: Device) -> Any:
        """Uninitialised memory for a result on ``device`` (on a GPU: call inside the device guard)."""
        if device[0] == "cpu":
            return np.empty(shape, dtype)
        return _cupy().empty(shape, dtype=dtype)


class _TorchCaller(Caller):
    """torch's caching allocator (stream-ordered, and torch.cuda.graph keeps its capture's allocations in the
    graph's private pool until the graph is freed) and torch's current stream. A result is a NumPy or CuPy view
    whose memory owner is a torch tensor of the same bytes, which the boundary gives back as it is: an ordinary
    resizable torch tensor, no DLPack round trip."""

    graph_safe = True
    allocates = True

    def __init__(self) -> None:
        self._torch: Any = None
        self._current: Any = None
        self._devices: dict[int, Any] = {}
        self._dtypes: dict[Any, tuple[Any, np.dtype]] = {}

    def _module(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def stream(self, device: int) -> int:
        current = self._current
        if current is None:
            torch = self._module()
            # what torch's own compiled code calls: the handle without making a Stream object
            current = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda d: torch.cuda.current_stream(d).cuda_stream)
            self._current = current
        return current(device)

    def empty(self, shape: Any, dtype: Any, device: Device) -> Any:
        spec = self._dtypes.get(dtype)  # on every torch CPU call: np.dtype() and getattr cost microseconds
        if spec is None:
            dt = np.dtype(dtype)
            spec = self._dtypes[dtype] = (getattr(self._module(), dt.name), dt)
        torch_dtype, dt = spec
        torch = self._torch
        if device[0] == "cpu":
            t = torch.empty(shape, dtype=torch_dtype)
            nbytes = t.nbytes
            if not nbytes:
                return np.empty(shape, dt)
            buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
            buf.tensor = t  # the owner the boundary finds to give the tensor back
            arr = np.frombuffer(buf, dt)
            return arr if len(t.shape) == 1 else arr.reshape(t.shape)
        cupy = _cupy()

        ordinal = device[1]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if not nbytes:
            return cupy.empty(shape, dtype=dt)
        torch_device = self._devices.get(ordinal)
        if torch_device is None:
            torch_device = self._devices[ordinal] = torch.device("cuda", ordinal)
        owner = torch.empty(nbytes, dtype=torch.uint8, device=torch_device)
        mem = cupy.cuda.UnownedMemory(owner.data_ptr(), nbytes, owner, ordinal)
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0))


_PLAIN = Caller()
_CALLERS = {"torch": _TorchCaller()}
# The origins whose caller allocates every result (Caller.allocates), as a set: the core and the CPU backend ask on
# every small call, where a property's frame is a measurable part of it.
ALLOCATING = frozenset(origin for origin, caller in _CALLERS.items() if caller.allocates)


@dataclass(slots=True)  # slots: built on every call, several times
class Tensor:
    data: Any
    dtype: str
    device: Device
    origin: str
    readonly: bool = False
    # A jax.Array committed to one device: its SingleDeviceSharding (one object per device and memory kind, so
    # `is` compares placements), where its results are committed. None for everything else.
    place: Any = None

    @property
    def caller(self) -> Caller:
        return _CALLERS.get(self.origin, _PLAIN)

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
        if self.place is not None:
            name = str(next(iter(self.place.device_set)))  # JAX's name: cpu:1, cuda:0
            kind = self.place.memory_kind  # arrays in one device's two memories are also refused: tell them apart
            return name if kind in (None, "device") else f"{name} ({kind} memory)"
        return "cpu" if self.device[0] == "cpu" else f"cuda:{self.device[1]}"
