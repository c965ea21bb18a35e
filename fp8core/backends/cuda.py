"""The CUDA backend: one thin launch per primitive over the kernels of cuda/ (see _kernels.KERNELS).

Arrays here are CuPy arrays in storage dtype (uint8 fp8, uint16 bf16). Every call:
- makes the tensor's device current for its duration (tensors on cuda:1 with cuda:0 current work);
- reads the caller's stream once — the stream a front-end set with :func:`launch_stream`, else torch's
  current stream for torch tensors, else CuPy's current stream — and launches everything on it, including
  the upload of a Python-float scale (a kernel parameter of ``fill_kernel``, never a host-to-device copy);
- launches through the driver with the arguments packed once (``_Plan``: the function, its argument layout
  and its occupancy-limited grid are cached per device, kernel and conversion path). A device that refuses
  quantize_dynamic's cooperative grid (MPS limits, green contexts) takes its two-launch path from then on.
Nothing synchronises with the host, and nothing a call leaves behind is shared between streams or threads,
so calls can run concurrently and be captured in CUDA graphs. Inside CuPy's own capture no device temporary may
be made (CuPy's pool would hand it to the next allocation while the graph still reads it): such calls take a
path without one or are refused by name (:func:`_cupy_capture`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import struct
from typing import Any, Callable, Iterator

import numpy as np

try:
    import cupy
    from cupy_backends.cuda.api import driver as _driver
    from cupy_backends.cuda.api import runtime as _runtime

    xp = cupy
except ImportError:  # pragma: no cover - fp8core[cuda12|cuda13] brings it
    cupy = xp = _driver = _runtime = None

from .. import _kernels
from .._tensor import Tensor
from ..formats import Format

name = "cuda"
_THREADS = 256
_T = {"float32": "float", "bfloat16": "fp8core::bf16", "float16": "fp8core::f16"}
_stream_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("fp8core_stream", default=None)

MIN_COMPUTE_CAPABILITY = 80  # every primitive but the FP8 GEMM (which needs 89, see cublaslt.py)
MULTI_CHUNK = 64             # tensors per multi-tensor launch: MultiArgs in quantize.cu
_MULTI_FORMAT = f"@{4 * MULTI_CHUNK}Q{MULTI_CHUNK}q{MULTI_CHUNK + 1}Ii"  # sizeof(MultiArgs) = 2824 bytes


@contextlib.contextmanager
def launch_stream(handle: int) -> Iterator[None]:
    """Launch on the raw CUDA stream ``handle`` inside this block (used by the JAX and torch front-ends)."""
    token = _stream_override.set(handle)
    try:
        yield
    finally:
        _stream_override.reset(token)


class _On:
    """The device guard: ``device`` current inside, the caller's device restored after.

    cudaSetDevice is called even when the device is already current: it also makes the device's primary
    context current on this thread, which the driver-API launches below need in a fresh thread.
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


def _stream(t: Tensor) -> int:
    """The raw handle of the stream this call launches on (read once per call, inside the device guard)."""
    override = _stream_override.get()
    if override is not None:
        return override
    if t.origin == "torch":
        global _torch_stream
        if _torch_stream is None:
            _torch_stream = _torch_current_stream()
        return _torch_stream(t.device[1])
    return cupy.cuda.get_current_stream().ptr


_torch_stream: Callable[[int], int] | None = None


def consumer_stream(device: int) -> int:
    """The raw handle of the stream a call on a non-torch array of CUDA ``device`` launches on (see _stream):
    what fp8core names as the consumer's stream when it imports such an array through DLPack."""
    override = _stream_override.get()
    if override is not None:
        return override
    return cupy.cuda.get_current_stream(device).ptr


def _torch_current_stream() -> Callable[[int], int]:
    """device -> torch's current stream handle. torch._C._cuda_getCurrentRawStream (what torch's own compiled
    code calls) returns the handle without making a Stream object; the public API where it is missing."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


# ---- launch plans -----------------------------------------------------------------------------------------

class _Plan:
    """A kernel ready to launch: its function, the layout of its arguments and the most blocks that run at once."""

    __slots__ = ("fn", "fmt", "size", "offsets", "max_blocks", "function")

    def __init__(self, function: Any, fmt: str, device: int, threads: int) -> None:
        self.function = function  # keeps the module loaded
        self.fn = function.ptr
        self.fmt = fmt
        self.size = struct.calcsize(fmt)
        self.offsets = [offset for offset, _ in arg_layout(fmt)]
        per_sm = _driver.occupancyMaxActiveBlocksPerMultiprocessor(self.fn, threads, 0)
        self.max_blocks = max(1, per_sm) * _sm_count(device)

    def grid(self, elements: int, per_thread: int = 8) -> int:
        """Blocks for a grid-stride loop: no more than run at once, no more than there is work."""
        return max(1, min(self.max_blocks, -(-elements // (per_thread * _THREADS))))

    def launch(self, grid: Any, block: Any, args: tuple, stream: int, cooperative: bool = False) -> None:
        buf = ctypes.create_string_buffer(self.size)
        struct.pack_into(self.fmt, buf, 0, *args)
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self.offsets))(*[base + o for o in self.offsets])
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        bx, by = (block, 1) if isinstance(block, int) else block
        if cooperative:
            _driver.launchCooperativeKernel(self.fn, gx, gy, 1, bx, by, 1, 0, stream, ctypes.addressof(params))
        else:
            _driver.launchKernel(self.fn, gx, gy, 1, bx, by, 1, 0, stream, ctypes.addressof(params), 0)


def arg_layout(fmt: str) -> list[tuple[int, int]]:
    """(offset, size) of each kernel argument packed by ``fmt`` (native alignment, as the kernel's parameter
    buffer lays them out; tests/test_sass.py checks them against every cubin). A by-value struct is one argument."""
    codes = [fmt[1:]] if fmt == _MULTI_FORMAT else list(fmt[1:])
    return [(struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize("@" + codes[i]),
             struct.calcsize("@" + codes[i])) for i in range(len(codes))]


_plans: dict[tuple[int, str, bool], _Plan] = {}
_sm_counts: dict[int, int] = {}
_capability_ok: set[int] = set()

# Argument layouts (struct codes, native alignment): P pointer, q int64, i int32, I uint32, f float.
ARGS = {
    "amax_kernel": "@PPq",
    "quantize_kernel": "@PPPPPPqfiif",
    "quantize_dynamic_kernel": "@PPPPPqfiif",
    "multi_amax_kernel": _MULTI_FORMAT,
    "multi_quantize_kernel": _MULTI_FORMAT,
    "dequantize_kernel": "@PPPq",
    "cast_transpose_kernel": "@PPPPPqq",
    "update_kernel": "@PPPPPqiiifiPi",
    "compute_scale_kernel": "@PPfPPPPqqiif",
    "fill_kernel": "@PIq",
    # block scaling (cuda_blocks.py, cuda/block_quantize.cu)
    "mx_quantize_kernel": "@PPPPPqqfi",
    "quantize_1x128_kernel": "@PPPqqfif",
    "quantize_128x128_kernel": "@PPPqqfif",
    "block_dequantize_kernel": "@PPPqqiiq",
    "mx_scale_swizzle_kernel": "@PPqq",
}


def _sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        n = _sm_counts[device] = _runtime.getDeviceProperties(device)["multiProcessorCount"]
    return n


def _check_capability(device: int) -> None:
    if device in _capability_ok:
        return
    cc = int(cupy.cuda.Device(device).compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"fp8core's CUDA kernels need compute capability 8.0 or newer (Ampere, Ada, Hopper, "
                           f"Blackwell); cuda:{device} is {cc // 10}.{cc % 10}")
    _capability_ok.add(device)


def _plan(device: int, filename: str, expr: str, threads: int = _THREADS) -> _Plan:
    """The cached plan of kernel ``expr``; call inside the device guard."""
    key = (device, expr, _kernels.FORCE_SOFT_FP8)
    plan = _plans.get(key)
    if plan is None:
        _check_capability(device)
        kernel = expr.split("::")[1].split("<")[0]
        # Built outside any lock (get_function compiles once per file and device under its own lock); a thread
        # that races here builds an equal plan over the same function, and the first one stored is kept.
        plan = _plans.setdefault(key, _Plan(_kernels.get_function(filename, expr, device), ARGS[kernel], device,
                                            threads))
    return plan


def _ptr(a: Any) -> int:
    return 0 if a is None else a.data.ptr


# ---- outputs ----------------------------------------------------------------------------------------------

_torch_devices: dict[int, Any] = {}


def _empty(shape: Any, dtype: Any, t: Tensor, stream: Any = None) -> Any:
    """Outputs for torch callers come from torch's caching allocator (stream-ordered, CUDA-graph aware), as a
    CuPy view whose memory owner is the torch tensor (no DLPack round trip); everyone else's from CuPy's pool on
    CuPy's current stream (the JAX front-end makes it XLA's). Call inside the device guard. ``stream`` is unused
    (kept for the GEMM's allocator signature)."""
    if t.origin == "torch":
        device = t.device[1]
        import torch

        torch_device = _torch_devices.get(device)
        if torch_device is None:
            torch_device = _torch_devices[device] = torch.device("cuda", device)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes:
            owner = torch.empty(nbytes, dtype=torch.uint8, device=torch_device)
            mem = cupy.cuda.UnownedMemory(owner.data_ptr(), nbytes, owner, device)
            return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
    return cupy.empty(shape, dtype=dtype)


def _cupy_capture(t: Tensor, stream: int) -> bool:
    """Whether a device temporary made now for ``t`` would be freed while a graph still reads it: ``stream`` is
    capturing and the temporary would come from CuPy's pool. CuPy's pool does nothing special during a capture
    (no graph-owned memory, no refusal): a block freed after the call goes back to the stream's free list and the
    next allocation gets it, and every replay of the graph then reads or writes that array. torch.cuda.graph keeps
    its capture's allocations in the graph's private pool until the graph is freed, so torch callers (whose
    temporaries come from torch, see :func:`_empty`) are safe. Asked only where a temporary is about to be made;
    cudaStreamIsCapturing is a host-side query (no synchronisation). CuPy raises on a capture already invalidated
    (its end_capture would fail anyway)."""
    return t.origin != "torch" and bool(_runtime.streamIsCapturing(stream))


def _fill(out: Any, bits: int, device: int, stream: int) -> None:
    if out.size:
        plan = _plan(device, "update.cu", "fp8core::fill_kernel")
        plan.launch(plan.grid(out.size, 1), _THREADS, (out.data.ptr, bits, out.size), stream)


def device_f32(values: Any, like: Tensor, arg: str | None = None) -> Any:
    """Host values as a float32 device array on like's device, written on the caller's stream.

    One value, or equal values, travel as a kernel parameter (no host-to-device copy, so this can be captured in
    a CUDA graph and is ordered with the caller's work); other lists are copied on the same stream.
    ``arg``: the argument a temporary stands for (a Python-number scale): refused inside a CuPy capture, which
    would outlive it (see :func:`_cupy_capture`). None: the array is the caller's result.
    """
    with np.errstate(over="ignore"):
        host = np.asarray(values, dtype=np.float32).reshape(-1)
    device = like.device[1]
    with _On(device):
        stream = _stream(like)
        if arg is not None and _cupy_capture(like, stream):
            # No owner could keep it alive as long as the graph (a cache keyed by value would grow without
            # bound), and the caller can make the array once and keep it: so refuse.
            raise ValueError(f"{arg}: a Python number becomes a device temporary that a graph captured with CuPy "
                             "would read after it is freed; pass a 1-element float32 CuPy array and keep it as "
                             "long as the graph")
        out = _empty(host.shape, np.float32, like)
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
        plan = _plan(device, "quantize.cu", f"fp8core::amax_kernel<{_T[x.dtype]}>")
        plan.launch(plan.grid(x.size), _THREADS, (x.data.data.ptr, out.data.ptr, x.size), stream)


def amax(x: Tensor) -> Any:
    device = x.device[1]
    with _On(device):
        stream = _stream(x)
        out = _empty((1,), np.float32, x)
        _amax_into(x, out, device, stream)
        return out


def _quantize(x: Tensor, q: Any, scale: Any, fmt: Format, amax_out: Any | None, amax_in: Any | None,
              scale_inv_out: Any | None, margin: int, power_of_2: bool, epsilon: float, stream: int) -> None:
    # An empty x still launches when there is a slot to merge 0 into, or a scale_inv to write.
    if x.size or amax_in is not None or amax_out is not None:
        plan = _plan(x.device[1], "quantize.cu", f"fp8core::quantize_kernel<{_T[x.dtype]}, {fmt.index}>")
        plan.launch(plan.grid(x.size), _THREADS,
                    (_ptr(x.data) if x.size else 0, _ptr(q) if x.size else 0, _ptr(scale), _ptr(amax_in),
                     _ptr(amax_out), _ptr(scale_inv_out), x.size, fmt.max, margin, int(power_of_2), epsilon),
                    stream)


def quantize(x: Tensor, scale: Any, fmt: Format, amax_out: Any | None, *, amax_in: Any | None = None,
             scale_inv_out: Any | None = None, margin: int = 0, power_of_2: bool = False,
             epsilon: float = 0.0, out: Any | None = None) -> Any:
    with _On(x.device[1]):
        stream = _stream(x)
        q = _empty(x.shape, np.uint8, x) if out is None else out
        _quantize(x, q, scale, fmt, amax_out, amax_in, scale_inv_out, margin, power_of_2, epsilon, stream)
        return q


# Devices where the driver refused the cooperative quantize_dynamic (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE): the
# grid is sized by the occupancy API over the device's SMs, but an MPS client limited by an active thread
# percentage, or a green context, has fewer SMs than the device reports, and the driver refuses any grid whose
# blocks cannot all be resident. Such a device then takes the two-launch path for good (a set only ever added to,
# so threads need no lock: at worst two of them each see one refusal).
_COOPERATIVE_TOO_LARGE = 720
_no_cooperative: set[int] = set()


def _dynamic_two_launch(x: Tensor, q: Any, a: Any, s_inv: Any, fmt: Format, margin: int, power_of_2: bool,
                        epsilon: float, reduce: Callable | None, device: int, stream: int) -> None:
    """amax into ``a``, the caller's MAX-reduce of it when distributed, then one quantize making the scale in
    every block (the same bits as the cooperative kernel)."""
    _amax_into(x, a, device, stream)
    if reduce is not None:
        reduce(a)
    _quantize(x, q, None, fmt, None, a, s_inv, margin, power_of_2, epsilon, stream)


def quantize_dynamic(x: Tensor, fmt: Format, margin: int, power_of_2: bool, epsilon: float,
                     reduce: Callable | None, *, out: tuple = (None, None, None)) -> tuple[Any, Any, Any]:
    device = x.device[1]
    q_out, s_inv_out, a_out = out
    with _On(device):
        stream = _stream(x)
        q = _empty(x.shape, np.uint8, x) if q_out is None else q_out
        # The cooperative kernel's workspace (below) is also the storage of the amax and scale_inv it returns, so
        # the caller holds it, unless both are given as out=: then, inside a CuPy capture, it would be a temporary
        # the graph outlives. This path makes none (every array it writes is a result), for one more launch.
        if reduce is not None or x.size == 0 or device in _no_cooperative or (
                a_out is not None and s_inv_out is not None and _cupy_capture(x, stream)):
            a = _empty((1,), np.float32, x) if a_out is None else a_out
            s_inv = _empty((1,), np.float32, x) if s_inv_out is None else s_inv_out
            _dynamic_two_launch(x, q, a, s_inv, fmt, margin, power_of_2, epsilon, reduce, device, stream)
            return q, s_inv, a
        plan = _plan(device, "quantize.cu", f"fp8core::quantize_dynamic_kernel<{_T[x.dtype]}, {fmt.index}>")
        blocks = plan.grid(x.size)
        # One allocation: [amax, scale_inv, barrier count, barrier generation, one partial per block], from the
        # caller's allocator, the barrier's two words zeroed on the launch stream just before the launch.
        # Invariant: nothing of the barrier outlives the launch, so no two launches share it (threads whose
        # per-thread default streams have one handle, concurrent streams), and a captured graph replays the
        # memset node with the kernel. amax and scale_inv are written whole by block 0.
        ws = _empty((4 + blocks,), np.uint32, x)
        _runtime.memsetAsync(ws.data.ptr + 8, 0, 8, stream)
        a = ws[0:1].view(np.float32) if a_out is None else a_out
        s_inv = ws[1:2].view(np.float32) if s_inv_out is None else s_inv_out
        try:
            plan.launch(blocks, _THREADS,
                        (x.data.data.ptr, q.data.ptr, ws.data.ptr + 8, a.data.ptr, s_inv.data.ptr, x.size, fmt.max,
                         margin, int(power_of_2), epsilon), stream, cooperative=True)
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
        want = -(-n // (8 * _THREADS))
        share = -(-budget * n // total) if total else 1
        b += max(1, min(want, share))
    first.append(b)
    return first


def _multi_launch(t0: Tensor, expr: str, entries: list[tuple[int, int, int, int, int]], stream: int) -> None:
    """entries: (x, q, scale, amax, n) per tensor, launched MULTI_CHUNK at a time, the table by value."""
    plan = _plan(t0.device[1], "quantize.cu", expr)
    pad = [0] * MULTI_CHUNK
    for c in range(0, len(entries), MULTI_CHUNK):
        chunk = entries[c:c + MULTI_CHUNK]
        cols = [list(col) + pad[len(chunk):] for col in zip(*chunk)]
        first = _multi_blocks([e[4] for e in chunk], plan.max_blocks)
        first += [first[-1]] * (MULTI_CHUNK + 1 - len(first))
        plan.launch(first[len(chunk)], _THREADS, (*cols[0], *cols[1], *cols[2], *cols[3], *cols[4], *first,
                                                  len(chunk)), stream)


def multi_amax(xs: list[Tensor], out: Any) -> None:
    t0 = xs[0]
    with _On(t0.device[1]):
        stream = _stream(t0)
        base = out.data.ptr
        groups: dict[str, list[tuple[int, int, int, int, int]]] = {}
        for i, x in enumerate(xs):
            groups.setdefault(x.dtype, []).append((_ptr(x.data) if x.size else 0, 0, 0, base + 4 * i, x.size))
        for dtype, entries in groups.items():
            _multi_launch(t0, f"fp8core::multi_amax_kernel<{_T[dtype]}>", entries, stream)


def multi_quantize(xs: list[Tensor], scales: list[Any], fmts: list[Format],
                   amax_outs: list[Any | None], *, outs: list[Any | None] | None = None) -> list[Any]:
    t0 = xs[0]
    outs = outs if outs is not None else [None] * len(xs)
    with _On(t0.device[1]):
        stream = _stream(t0)
        qs = [_empty(x.shape, np.uint8, t0) if o is None else o for x, o in zip(xs, outs)]
        groups: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = {}
        for i, x in enumerate(xs):
            groups.setdefault((x.dtype, fmts[i].index), []).append(
                (_ptr(x.data) if x.size else 0, _ptr(qs[i]) if x.size else 0, _ptr(scales[i]), _ptr(amax_outs[i]),
                 x.size))
        for (dtype, fmt), entries in groups.items():
            _multi_launch(t0, f"fp8core::multi_quantize_kernel<{_T[dtype]}, {fmt}>", entries, stream)
        return qs


# ---- dequantize, transpose, cast_transpose ----------------------------------------------------------------

_OUT_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def dequantize(q: Tensor, fmt: Format, scale_inv: Any, out_dtype: str, *, out: Any | None = None) -> Any:
    device = q.device[1]
    with _On(device):
        stream = _stream(q)
        y = _empty(q.shape, _OUT_STORAGE[out_dtype], q) if out is None else out
        if q.size:
            plan = _plan(device, "dequantize.cu", f"fp8core::dequantize_kernel<{fmt.index}, {_T[out_dtype]}>")
            plan.launch(plan.grid(q.size), _THREADS, (q.data.data.ptr, y.data.ptr, scale_inv.data.ptr, q.size),
                        stream)
        return y


_TILE = 64
_MAX_GRID_Y = 65535


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    """One block per 64x64 tile, the tiles spread over (x, y) so that neither passes its limit."""
    n = -(-rows // _TILE) * -(-cols // _TILE)
    grid = (min(n, 65535), -(-n // 65535))
    if grid[1] > _MAX_GRID_Y:
        raise ValueError(f"x: {rows} x {cols} is too large for one cast_transpose launch")
    return grid


def transpose(q: Tensor, *, out: Any | None = None) -> Any:
    rows, cols = q.shape
    device = q.device[1]
    with _On(device):
        stream = _stream(q)
        out = _empty((cols, rows), np.uint8, q) if out is None else out
        if q.size:
            plan = _plan(device, "cast_transpose.cu", "fp8core::cast_transpose_kernel<fp8core::Passthrough, 0, false>")
            plan.launch(_tiles(rows, cols), _THREADS, (q.data.data.ptr, 0, out.data.ptr, 0, 0, rows, cols), stream)
        return out


def cast_transpose(x: Tensor, scale: Any, fmt: Format, amax_out: Any | None, *,
                   out: tuple = (None, None)) -> tuple[Any, Any]:
    rows, cols = x.shape
    device = x.device[1]
    with _On(device):
        stream = _stream(x)
        q = _empty((rows, cols), np.uint8, x) if out[0] is None else out[0]
        qt = _empty((cols, rows), np.uint8, x) if out[1] is None else out[1]
        if x.size:
            plan = _plan(device, "cast_transpose.cu",
                         f"fp8core::cast_transpose_kernel<{_T[x.dtype]}, {fmt.index}, true>")
            plan.launch(_tiles(rows, cols), _THREADS,
                        (x.data.data.ptr, q.data.ptr, qt.data.ptr, scale.data.ptr, _ptr(amax_out), rows, cols), stream)
        elif amax_out is not None:  # merge amax 0 into the slot, as the CPU does
            plan = _plan(device, "quantize.cu", "fp8core::amax_kernel<float>")
            plan.launch(1, _THREADS, (0, amax_out.data.ptr, 0), stream)
        return q, qt


# ---- the scale rule and the batched update ----------------------------------------------------------------

def _array_tensor(a: Any) -> Tensor:
    if isinstance(a, Tensor):
        return a
    return Tensor(a, "float32", ("cuda", a.device.id), "cupy")


def _scale_launch(t: Tensor, fp8_max: Any, fp8_max_value: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: Any | None, ok: Any | None, stream: int) -> tuple[Any, Any]:
    amax = t.data
    s = _empty(amax.shape, np.float32, t)
    s_inv = _empty(amax.shape, np.float32, t)
    n = amax.size
    if n:
        plan = _plan(t.device[1], "update.cu", "fp8core::compute_scale_kernel")
        plan.launch(-(-n // _THREADS), _THREADS,
                    (amax.data.ptr, _ptr(fp8_max), fp8_max_value, s.data.ptr, s_inv.data.ptr, _ptr(ok),
                     _ptr(previous), 0 if previous is None else previous.size, n, margin, int(power_of_2), epsilon),
                    stream)
    return s, s_inv


def compute_scale(amax: Any, fp8_max: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: Any | None) -> tuple[Any, Any]:
    """amax: a float32 CuPy array, or a Tensor over one (then its origin picks the stream and the allocator)."""
    t = _array_tensor(amax)
    with _On(t.device[1]):
        return _scale_launch(t, None, fp8_max, margin, power_of_2, epsilon, previous, None, _stream(t))


def scale_rule(amax: Any, fp8_max: Any, margin: int, power_of_2: bool, epsilon: float) -> tuple[Any, Any, Any]:
    """(scale, scale_inv, ok) elementwise, for the array path of callable recipes."""
    t = _array_tensor(amax)
    with _On(t.device[1]):
        ok = _empty(amax.shape, np.bool_, t)
        s, s_inv = _scale_launch(t, fp8_max, 0.0, margin, power_of_2, epsilon, None, ok, _stream(t))
        return s, s_inv, ok


def update(history: Any, scale: Any, scale_inv: Any, fp8_max: Any, margin: int, algo: str, power_of_2: bool,
           epsilon: float, update_scale: bool, flags: Any | None, step: Any | None = None,
           interval: int = 1) -> None:
    """The batched delayed-scaling update. ``step`` (int32 [2] on the device: steps % interval, then 0), when
    given, decides update_scale on the device and advances, so a captured graph replays the schedule."""
    L, n = history.shape
    t = _array_tensor(history)
    warps = max(1, min(16, (L - 1 + 63) // 64))
    with _On(t.device[1]):
        plan = _plan(t.device[1], "update.cu", f"fp8core::update_kernel<{'true' if algo == 'max' else 'false'}>",
                     32 * warps)
        plan.launch(-(-n // 32), (32, warps),
                    (history.data.ptr, scale.data.ptr, scale_inv.data.ptr, fp8_max.data.ptr, _ptr(flags), n, L,
                     margin, int(power_of_2), epsilon, int(update_scale), _ptr(step), int(interval)), _stream(t))


def step_counter(step: int, like: Any) -> Any:
    """The device counter of :func:`update` (int32 [step, 0]) on like's device, written on the launch stream.
    like: the state's buffer as a Tensor (a torch buffer's counter then comes from torch, so it can be made inside
    torch.cuda.graph's capture), or a CuPy array. The caller keeps the counter as long as the state."""
    t = _array_tensor(like)
    with _On(t.device[1]):
        stream = _stream(t)
        if _runtime.streamIsCapturing(stream):
            # The fills below would become graph nodes (torch's capture or CuPy's alike): every replay would reset
            # the counter and the interval would never advance. Asked only when a counter is made (rarely).
            raise ValueError("interval: the update's device counter is set from steps at the first update (and "
                             "after steps changes); inside a CUDA graph capture every replay would reset it, so "
                             "call update() once before capturing")
        counter = _empty((2,), np.int32, t)
        _fill(counter[:1].view(np.uint32), int(step), t.device[1], stream)
        _fill(counter[1:].view(np.uint32), 0, t.device[1], stream)
        return counter


# ---- gemm -------------------------------------------------------------------------------------------------

def gemm(spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
         out_scale: Any | None, out_amax: Any | None, out: Any | None) -> Any:
    from . import cublaslt

    # Inside a CuPy capture: no workspace and no amax scratch (cublaslt's docstring); block scales laid out for
    # cuBLASLt are temporaries, refused in cuda_blocks.layout_for_cublaslt.
    with _On(a.device[1]):
        return cublaslt.gemm(spec, a, b, a_scale_inv, b_scale_inv, bias, out_scale, out_amax, out, _stream(a),
                             _empty)


def merge_amax(slot: Any, value: Any | None, device: int, stream: int) -> None:
    """slot = max(slot, |value|) for 1-element float32 device arrays, as every amax slot merges (signed order);
    value None merges the amax 0 of an empty tensor."""
    plan = _plan(device, "quantize.cu", "fp8core::amax_kernel<float>")
    plan.launch(1, _THREADS, (_ptr(value), slot.data.ptr, 0 if value is None else 1), stream)
