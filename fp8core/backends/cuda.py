"""The CUDA backend: one thin launch per primitive over the kernel records of fp8core._kernels.

Arrays here are CuPy arrays in storage dtype (uint8 fp8, uint16 bf16). Every call:
- makes the tensor's device current for its duration (tensors on cuda:1 with cuda:0 current work);
- reads the caller's stream once — the stream a front-end set with :func:`launch_stream`, else the current
  stream of the tensor's caller (fp8core._views.Caller: torch's or CuPy's) — and launches everything on it,
  including the upload of a Python-float scale (a kernel parameter of ``fill_kernel``, never a host-to-device
  copy);
- takes its results and temporaries from the caller's allocator.
A device that refuses quantize_dynamic's cooperative grid (MPS limits, green contexts) takes its two-launch path
from then on. Nothing synchronises with the host, and nothing a call leaves behind is shared between streams or
threads, so calls can run concurrently and be captured in CUDA graphs. A capture that would outlive a device
temporary (CuPy's pool) makes none: such calls take a path without one or are refused by name
(:func:`capture_outlives`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

try:
    import cupy
    from cupy_backends.cuda.api import driver as _driver
    from cupy_backends.cuda.api import runtime as _runtime

    xp = cupy
except ImportError:  # pragma: no cover - fp8core[cuda12|cuda13] brings it
    cupy = xp = _driver = _runtime = None

from .._caches import memo
from .._kernels import (AMAX, CAST_TRANSPOSE, COMPUTE_SCALE, DEQUANTIZE, FILL, MULTI_AMAX, MULTI_QUANTIZE, QUANTIZE,
                        QUANTIZE_DYNAMIC, THREADS, UPDATE)
from .._views import Tensor, storage_dtype
from ..formats import Encoding
from . import cublaslt
from .cuda_call import allocate  # noqa: F401 - the core allocates its declared results through it
from .cuda_call import Launch, On, capture_outlives, empty, merge_amax, ptr, stream_of
from .cuda_call import launch_stream  # noqa: F401 - the front-ends' name

name = "cuda"


def _fill(out: Any, bits: int, device: int, stream: int) -> None:
    if out.size:
        FILL.launch(device, (), out.size, stream, out=out.data.ptr, value=bits, n=out.size)


def device_f32(values: Any, like: Tensor, arg: str | None = None) -> Any:
    """Host values as a float32 device array on like's device, written on the caller's stream.

    One value, or equal values, travel as a kernel parameter (no host-to-device copy, so this can be captured in
    a CUDA graph and is ordered with the caller's work); other lists are copied on the same stream.
    ``arg``: the argument a temporary stands for (a Python-number scale): refused inside a capture that would
    outlive it (see :func:`capture_outlives`). None: the array is the caller's result.
    """
    with np.errstate(over="ignore"):
        host = np.asarray(values, dtype=np.float32).reshape(-1)
    with Launch(like) as (device, stream):
        if arg is not None and capture_outlives(like, stream):
            # No owner could keep it alive as long as the graph (a cache keyed by value would grow without
            # bound), and the caller can make the array once and keep it: so refuse.
            raise ValueError(f"{arg}: a Python number becomes a device temporary that a graph captured with CuPy "
                             "would read after it is freed; pass a 1-element float32 CuPy array and keep it as "
                             "long as the graph")
        out = empty(host.shape, np.float32, like)
        bits = host.view(np.uint32)
        if host.size == 0 or (bits == bits[0]).all():
            _fill(out.view(np.uint32), int(bits[0]) if host.size else 0, device, stream)
        else:
            with cupy.cuda.ExternalStream(stream, device):
                out.set(host)
    return out


# ---- amax and quantize ------------------------------------------------------------------------------------

def _amax_into(x: Tensor, out: Any, device: int, stream: int) -> None:
    _runtime.memsetAsync(out.data.ptr, 0, 4, stream)
    if x.size:
        AMAX.launch(device, (x.dtype,), x.size, stream, x=x.data.data.ptr, amax_out=out.data.ptr, n=x.size)


def amax(x: Tensor) -> Any:
    with Launch(x) as (device, stream):
        out = empty((1,), np.float32, x)
        _amax_into(x, out, device, stream)
        return out


def _quantize(x: Tensor, q: Any, scale: Any, fmt: Encoding, amax_out: Any | None, amax_in: Any | None,
              scale_inv_out: Any | None, margin: int, power_of_2: bool, epsilon: float, stream: int) -> None:
    # An empty x still launches when there is a slot to merge 0 into, or a scale_inv to write.
    if x.size or amax_in is not None or amax_out is not None:
        QUANTIZE.launch(x.device[1], (x.dtype, fmt.index), x.size, stream,
                        x=ptr(x.data) if x.size else 0, q=ptr(q) if x.size else 0, scale=ptr(scale),
                        amax_in=ptr(amax_in), amax_out=ptr(amax_out), scale_inv_out=ptr(scale_inv_out), n=x.size,
                        fp8_max=fmt.max, margin=margin, power_of_2=int(power_of_2), epsilon=epsilon)


def quantize(x: Tensor, scale: Any, fmt: Encoding, amax_out: Any | None, *, out: Any | None = None) -> Any:
    with Launch(x) as (_, stream):
        q = empty(x.shape, np.uint8, x) if out is None else out
        _quantize(x, q, scale, fmt, amax_out, None, None, 0, False, 0.0, stream)
        return q


# Devices where the driver refused the cooperative quantize_dynamic (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE): the
# grid is sized by the occupancy API over the device's SMs, but an MPS client limited by an active thread
# percentage, or a green context, has fewer SMs than the device reports, and the driver refuses any grid whose
# blocks cannot all be resident. Such a device then takes the two-launch path for good: a fact learned about the
# device, not a switch (a set only ever added to, so threads need no lock: at worst two of them each see one
# refusal).
_COOPERATIVE_TOO_LARGE = 720
_no_cooperative: set[int] = memo("cuda.no_cooperative", set())


def _dynamic_two_launch(x: Tensor, q: Any, a: Any, s_inv: Any, fmt: Encoding, margin: int, power_of_2: bool,
                        epsilon: float, reduce: Callable | None, device: int, stream: int) -> None:
    """amax into ``a``, the caller's MAX-reduce of it when distributed, then one quantize making the scale in
    every block (the same bits as the cooperative kernel)."""
    _amax_into(x, a, device, stream)
    if reduce is not None:
        reduce(a)
    _quantize(x, q, None, fmt, None, a, s_inv, margin, power_of_2, epsilon, stream)


def quantize_dynamic(x: Tensor, fmt: Encoding, margin: int, power_of_2: bool, epsilon: float,
                     reduce: Callable | None, *, out: tuple = (None, None, None)) -> tuple[Any, Any, Any]:
    q_out, s_inv_out, a_out = out
    with Launch(x) as (device, stream):
        q = empty(x.shape, np.uint8, x) if q_out is None else q_out
        # The cooperative kernel's workspace (below) is also the storage of the amax and scale_inv it returns, so
        # the caller holds it, unless both are given as out=: then, inside a capture that outlives temporaries, it
        # would be one. This path makes none (every array it writes is a result), for one more launch.
        if reduce is not None or x.size == 0 or device in _no_cooperative or (
                a_out is not None and s_inv_out is not None and capture_outlives(x, stream)):
            a = empty((1,), np.float32, x) if a_out is None else a_out
            s_inv = empty((1,), np.float32, x) if s_inv_out is None else s_inv_out
            _dynamic_two_launch(x, q, a, s_inv, fmt, margin, power_of_2, epsilon, reduce, device, stream)
            return q, s_inv, a
        targs = (x.dtype, fmt.index)
        blocks = QUANTIZE_DYNAMIC.grid(device, targs, x.size)
        # One allocation: [amax, scale_inv, barrier count, barrier generation, one partial per block], from the
        # caller's allocator, the barrier's two words zeroed on the launch stream just before the launch.
        # Invariant: nothing of the barrier outlives the launch, so no two launches share it (threads whose
        # per-thread default streams have one handle, concurrent streams), and a captured graph replays the
        # memset node with the kernel. amax and scale_inv are written whole by block 0.
        ws = empty((4 + blocks,), np.uint32, x)
        _runtime.memsetAsync(ws.data.ptr + 8, 0, 8, stream)
        a = ws[0:1].view(np.float32) if a_out is None else a_out
        s_inv = ws[1:2].view(np.float32) if s_inv_out is None else s_inv_out
        try:
            QUANTIZE_DYNAMIC.launch(device, targs, x.size, stream, grid=blocks, cooperative=True,
                                    x=x.data.data.ptr, q=q.data.ptr, workspace=ws.data.ptr + 8, amax_out=a.data.ptr,
                                    scale_inv_out=s_inv.data.ptr, n=x.size, fp8_max=fmt.max, margin=margin,
                                    power_of_2=int(power_of_2), epsilon=epsilon)
        except _driver.CUDADriverError as e:
            if e.status != _COOPERATIVE_TOO_LARGE:
                raise
            # Refused at the launch call, before anything ran: q, amax and scale_inv are untouched, and the
            # two-launch path writes them whole, into the same arrays (no allocation, so also inside a capture;
            # should the driver have invalidated a capture over the refusal, these launches raise its error).
            _no_cooperative.add(device)
            _dynamic_two_launch(x, q, a, s_inv, fmt, margin, power_of_2, epsilon, None, device, stream)
        return q, s_inv, a


def _multi_blocks(sizes: list[int], max_blocks: int) -> list[int]:
    """first_block of each tensor: blocks shared out by elements (at least one each, so an empty tensor still
    merges its amax 0), the total near what runs at once."""
    total = sum(sizes)
    budget = max(max_blocks, len(sizes))
    first, b = [], 0
    for n in sizes:
        first.append(b)
        want = -(-n // (8 * THREADS))
        share = -(-budget * n // total) if total else 1
        b += max(1, min(want, share))
    first.append(b)
    return first


def _multi_launch(kernel: Any, device: int, targs: tuple, entries: list[tuple[int, int, int, int, int]],
                  stream: int) -> None:
    """entries: (x, q, scale, amax, n) per tensor, launched MULTI_CHUNK (quantize.cu's) at a time, the table
    (MultiArgs) by value."""
    per = kernel.constant("MULTI_CHUNK")
    pad = [0] * per
    for c in range(0, len(entries), per):
        chunk = entries[c:c + per]
        x, q, scale, amax, n = (list(col) + pad[len(chunk):] for col in zip(*chunk))
        first = _multi_blocks([e[4] for e in chunk], kernel.max_blocks(device, targs))
        first += [first[-1]] * (per + 1 - len(first))
        kernel.launch(device, targs, None, stream, grid=first[len(chunk)],
                      a={"x": x, "q": q, "scale": scale, "amax": amax, "n": n, "first_block": first,
                         "count": len(chunk)})


def multi_amax(xs: list[Tensor], out: Any) -> None:
    t0 = xs[0]
    with Launch(t0) as (device, stream):
        base = out.data.ptr
        groups: dict[str, list[tuple[int, int, int, int, int]]] = {}
        for i, x in enumerate(xs):
            groups.setdefault(x.dtype, []).append((ptr(x.data) if x.size else 0, 0, 0, base + 4 * i, x.size))
        for dtype, entries in groups.items():
            _multi_launch(MULTI_AMAX, device, (dtype,), entries, stream)


def multi_quantize(xs: list[Tensor], scales: list[Any], fmts: list[Encoding],
                   amax_outs: list[Any | None], *, outs: list[Any | None] | None = None) -> list[Any]:
    t0 = xs[0]
    outs = outs if outs is not None else [None] * len(xs)
    with Launch(t0) as (device, stream):
        qs = [empty(x.shape, np.uint8, t0) if o is None else o for x, o in zip(xs, outs)]
        groups: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = {}
        for i, x in enumerate(xs):
            groups.setdefault((x.dtype, fmts[i].index), []).append(
                (ptr(x.data) if x.size else 0, ptr(qs[i]) if x.size else 0, ptr(scales[i]), ptr(amax_outs[i]),
                 x.size))
        for targs, entries in groups.items():
            _multi_launch(MULTI_QUANTIZE, device, targs, entries, stream)
        return qs


# ---- dequantize, transpose, cast_transpose ----------------------------------------------------------------

def dequantize(q: Tensor, fmt: Encoding, scale_inv: Any, out_dtype: str, *, out: Any | None = None) -> Any:
    with Launch(q) as (device, stream):
        y = empty(q.shape, storage_dtype(out_dtype), q) if out is None else out
        if q.size:
            DEQUANTIZE.launch(device, (fmt.index, out_dtype), q.size, stream, q=q.data.data.ptr, y=y.data.ptr,
                              scale_inv=scale_inv.data.ptr, n=q.size)
        return y


def transpose(q: Tensor, *, out: Any | None = None) -> Any:
    rows, cols = q.shape
    with Launch(q) as (device, stream):
        out = empty((cols, rows), np.uint8, q) if out is None else out
        if q.size:
            CAST_TRANSPOSE.launch(device, ("fp8core::Passthrough", 0, False), (rows, cols), stream,
                                  x=q.data.data.ptr, q=0, q_t=out.data.ptr, scale_p=0, amax_out=0, rows=rows,
                                  cols=cols)
        return out


def cast_transpose(x: Tensor, scale: Any, fmt: Encoding, amax_out: Any | None, *,
                   out: tuple = (None, None)) -> tuple[Any, Any]:
    rows, cols = x.shape
    with Launch(x) as (device, stream):
        q = empty((rows, cols), np.uint8, x) if out[0] is None else out[0]
        qt = empty((cols, rows), np.uint8, x) if out[1] is None else out[1]
        if x.size:
            CAST_TRANSPOSE.launch(device, (x.dtype, fmt.index, True), (rows, cols), stream, x=x.data.data.ptr,
                                  q=q.data.ptr, q_t=qt.data.ptr, scale_p=scale.data.ptr, amax_out=ptr(amax_out),
                                  rows=rows, cols=cols)
        elif amax_out is not None:  # merge amax 0 into the slot, as the CPU does
            merge_amax(amax_out, None, device, stream)
        return q, qt


# ---- the scale rule and the batched update ----------------------------------------------------------------

def _array_tensor(a: Any) -> Tensor:
    if isinstance(a, Tensor):
        return a
    return Tensor(a, "float32", ("cuda", a.device.id), "cupy")


def _scale_launch(t: Tensor, fp8_max: Any, fp8_max_value: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: Any | None, ok: Any | None, stream: int) -> tuple[Any, Any]:
    amax = t.data
    s = empty(amax.shape, np.float32, t)
    s_inv = empty(amax.shape, np.float32, t)
    n = amax.size
    if n:
        COMPUTE_SCALE.launch(t.device[1], (), n, stream, amax=amax.data.ptr, fp8_max=ptr(fp8_max),
                             fp8_max_value=fp8_max_value, scale=s.data.ptr, scale_inv=s_inv.data.ptr, ok=ptr(ok),
                             previous=ptr(previous), previous_size=0 if previous is None else previous.size, n=n,
                             margin=margin, power_of_2=int(power_of_2), epsilon=epsilon)
    return s, s_inv


def compute_scale(amax: Any, fp8_max: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: Any | None) -> tuple[Any, Any]:
    """amax: a float32 CuPy array, or a Tensor over one (then its caller's stream and allocator)."""
    t = _array_tensor(amax)
    with On(t.device[1]):
        return _scale_launch(t, None, fp8_max, margin, power_of_2, epsilon, previous, None, stream_of(t))


def scale_rule(amax: Any, fp8_max: Any, margin: int, power_of_2: bool, epsilon: float) -> tuple[Any, Any, Any]:
    """(scale, scale_inv, ok) elementwise, for the array path of callable recipes."""
    t = _array_tensor(amax)
    with On(t.device[1]):
        ok = empty(t.data.shape, np.bool_, t)
        s, s_inv = _scale_launch(t, fp8_max, 0.0, margin, power_of_2, epsilon, None, ok, stream_of(t))
        return s, s_inv, ok


def update(history: Any, scale: Any, scale_inv: Any, fp8_max: Any, margin: int, algo: str, power_of_2: bool,
           epsilon: float, update_scale: bool, flags: Any | None, step: Any | None = None,
           interval: int = 1) -> None:
    """The batched delayed-scaling update. ``step`` (int32 [2] on the device: steps % interval, then 0), when
    given, decides update_scale on the device and advances, so a captured graph replays the schedule."""
    L, n = history.shape
    t = _array_tensor(history)
    warps = max(1, min(16, (L - 1 + 63) // 64))
    device = t.device[1]
    with On(device):
        UPDATE.launch(device, (algo == "max",), n, stream_of(t), block=(32, warps), history=history.data.ptr,
                      scale=scale.data.ptr, scale_inv=scale_inv.data.ptr, fp8_max=fp8_max.data.ptr,
                      non_finite=ptr(flags), n=n, L=L, margin=margin, power_of_2=int(power_of_2), epsilon=epsilon,
                      update_scale=int(update_scale), step=ptr(step), interval=int(interval))


def step_counter(step: int, like: Any) -> Any:
    """The device counter of :func:`update` (int32 [step, 0]) on like's device, written on the launch stream.
    like: the state's buffer as a Tensor (a torch buffer's counter then comes from torch, so it can be made inside
    torch.cuda.graph's capture), or a CuPy array. The caller keeps the counter as long as the state."""
    t = _array_tensor(like)
    with Launch(t) as (_, stream):
        if _runtime.streamIsCapturing(stream):
            # The fills below would become graph nodes (torch's capture or CuPy's alike): every replay would reset
            # the counter and the interval would never advance. Asked only when a counter is made (rarely).
            raise ValueError("interval: the update's device counter is set from steps at the first update (and "
                             "after steps changes); inside a CUDA graph capture every replay would reset it, so "
                             "call update() once before capturing")
        counter = empty((2,), np.int32, t)
        _fill(counter[:1].view(np.uint32), int(step), t.device[1], stream)
        _fill(counter[1:].view(np.uint32), 0, t.device[1], stream)
        return counter


# ---- gemm -------------------------------------------------------------------------------------------------

def gemm(spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
         out_scale: Any | None, out_amax: Any | None, out: Any | None) -> Any:
    # Inside a capture that outlives temporaries: no workspace and no amax scratch (cublaslt's docstring); block
    # scales laid out for cuBLASLt are temporaries, refused in cuda_blocks.layout_for_cublaslt.
    with On(a.device[1]):
        return cublaslt.gemm(spec, a, b, a_scale_inv, b_scale_inv, bias, out_scale, out_amax, out, stream_of(a))

