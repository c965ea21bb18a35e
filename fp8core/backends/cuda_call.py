"""What every CUDA call does around its launches: the device guard, the caller's stream read once, the caller's
allocator, and whether a capture would outlive a temporary. Shared by cuda.py, cuda_blocks.py and cublaslt.py;
importable without CuPy (``cupy`` is then None)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

try:
    import cupy
    from cupy_backends.cuda.api import runtime as _runtime
except ImportError:  # pragma: no cover - fp8core[cuda12|cuda13] brings it
    cupy = _runtime = None

from .._kernels import AMAX
from .._views import Tensor

_stream_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("fp8core_stream", default=None)


@contextlib.contextmanager
def launch_stream(handle: int) -> Iterator[None]:
    """Launch on the raw CUDA stream ``handle`` inside this block (used by the JAX and torch front-ends).

    A front-end whose block may read a GPU array through DLPack also makes ``handle`` CuPy's current stream
    (``cupy.cuda.ExternalStream``): the boundary names CuPy's current stream to DLPack producers."""
    token = _stream_override.set(handle)
    try:
        yield
    finally:
        _stream_override.reset(token)


class On:
    """The device guard: ``device`` current inside, the caller's device restored after.

    cudaSetDevice is called even when the device is already current: it also makes the device's primary
    context current on this thread, which the driver-API launches need in a fresh thread.
    """

    __slots__ = ("device", "previous")

    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.previous = _runtime.getDevice()
        _runtime.setDevice(self.device)

    def __exit__(self, *exc: Any) -> None:
        if self.previous != self.device:
            _runtime.setDevice(self.previous)


class Launch(On):
    """The device guard of a call on ``t``: ``with Launch(t) as (device, stream):`` t's device current inside,
    ``stream`` the raw handle of the stream it launches on (:func:`stream_of`, read inside the guard)."""

    __slots__ = ("tensor",)

    def __init__(self, t: Tensor) -> None:
        self.device, self.tensor = t.device[1], t

    def __enter__(self) -> tuple[int, int]:  # type: ignore[override]
        self.previous = _runtime.getDevice()  # On's, written out: no frame more on every launch
        _runtime.setDevice(self.device)
        try:
            return self.device, stream_of(self.tensor)
        except BaseException:  # no __exit__ follows a failed __enter__: the caller's device back here
            self.__exit__()
            raise


def stream_of(t: Tensor) -> int:
    """The raw handle of the stream this call launches on (read once per call, inside the device guard)."""
    override = _stream_override.get()
    return override if override is not None else t.caller.stream(t.device[1])


def empty(shape: Any, dtype: Any, like: Tensor) -> Any:
    """Uninitialised device memory from like's caller's allocator; call inside the device guard."""
    return like.caller.empty(shape, dtype, like.device)


def allocate(shape: Any, dtype: Any, like: Tensor) -> Any:
    """A result the core allocates from its declaration (fp8core.args.result): like's caller's memory, on like's
    device."""
    with On(like.device[1]):
        return empty(shape, dtype, like)


def capture_outlives(t: Tensor, stream: int) -> bool:
    """Whether a device temporary made now for ``t`` would be freed while a graph still reads it: ``stream`` is
    capturing and t's caller does not keep a capture's memory (fp8core._views.Caller.graph_safe). Asked only where
    a temporary is about to be made; cudaStreamIsCapturing is a host-side query (no synchronisation). CuPy raises
    on a capture already invalidated (its end_capture would fail anyway)."""
    return not t.caller.graph_safe and bool(_runtime.streamIsCapturing(stream))


def ptr(a: Any) -> int:
    return 0 if a is None else a.data.ptr


def merge_amax(slot: Any, value: Any | None, device: int, stream: int) -> None:
    """slot = max(slot, |value|) for 1-element float32 device arrays, as every amax slot merges (signed order);
    value None merges the amax 0 of an empty tensor. Call inside the device guard."""
    AMAX.launch(device, ("float32",), 1, stream, x=ptr(value), amax_out=slot.data.ptr, n=0 if value is None else 1)
