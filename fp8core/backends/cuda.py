"""The CUDA backend: one thin launch per primitive over the kernels of cuda/ (see _kernels.KERNELS).

Arrays here are CuPy arrays in storage dtype (uint8 fp8, uint16 bf16). Kernels run on the caller's
stream (torch's current stream for torch tensors, CuPy's current stream otherwise, or the stream a
front-end sets with :func:`launch_stream`); nothing synchronises with the host.
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

try:
    import cupy

    xp = cupy
except ImportError:  # pragma: no cover - fp8core[cuda12|cuda13] brings it
    cupy = xp = None

from .._kernels import get_function
from .._tensor import Tensor
from ..formats import Format

name = "cuda"
_THREADS = 256
_T = {"float32": "float", "bfloat16": "fp8core::bf16", "float16": "fp8core::f16"}
_NULL = np.uint64(0)
_stream_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("fp8core_stream", default=None)


@contextlib.contextmanager
def launch_stream(handle: int) -> Iterator[None]:
    """Launch on the raw CUDA stream ``handle`` inside this block (used by the JAX front-end)."""
    token = _stream_override.set(handle)
    try:
        yield
    finally:
        _stream_override.reset(token)


def _stream(t: Tensor) -> Any:
    override = _stream_override.get()
    if override is not None:
        return cupy.cuda.ExternalStream(override, t.device[1])
    if t.origin == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device[1]).cuda_stream, t.device[1])
    return cupy.cuda.get_current_stream()


@lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _grid(device_id: int, work_items: int) -> int:
    """Blocks for a grid-stride loop: enough to fill the GPU, no more than there is work."""
    return max(1, min(_sm_count(device_id) * 8, -(-work_items // _THREADS)))


def _ptr(a: Any) -> np.uint64:
    return _NULL if a is None else np.uint64(a.data.ptr)


def _launch(t: Tensor, filename: str, expr: str, grid: Any, block: Any, args: tuple, stream: Any,
            cooperative: bool = False) -> None:
    fn = get_function(filename, expr, t.device[1])
    with cupy.cuda.Device(t.device[1]):
        fn(grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple) else (block,), args,
           stream=stream, enable_cooperative_groups=cooperative)


def _empty(shape: Any, dtype: Any, t: Tensor, stream: Any) -> Any:
    """Outputs for torch callers come from torch's caching allocator (stream-ordered, CUDA-graph aware);
    everyone else's from CuPy's pool on the launch stream."""
    if t.origin == "torch":
        import torch

        from .._tensor import wrap

        storage = {1: torch.uint8, 2: torch.int16, 4: torch.float32}[np.dtype(dtype).itemsize]
        return wrap(torch.empty(shape, dtype=storage, device=f"cuda:{t.device[1]}")).data.view(dtype)
    with cupy.cuda.Device(t.device[1]), stream:
        return cupy.empty(shape, dtype=dtype)


def _zeros(shape: Any, dtype: Any, t: Tensor, stream: Any) -> Any:
    out = _empty(shape, dtype, t, stream)
    with cupy.cuda.Device(t.device[1]), stream:
        out.fill(0)
    return out


# ---- amax and quantize ------------------------------------------------------------------------------------

def amax(x: Tensor) -> Any:
    stream = _stream(x)
    out = _zeros((1,), np.float32, x, stream)
    if x.size:
        _launch(x, "quantize.cu", f"fp8core::amax_kernel<{_T[x.dtype]}>", _grid(x.device[1], x.size // 8 + 1),
                _THREADS, (x.data, out, np.int64(x.size)), stream)
    return out


def quantize(x: Tensor, scale: Any, fmt: Format, amax_out: Any | None, *, amax_in: Any | None = None,
             scale_inv_out: Any | None = None, margin: int = 0, power_of_2: bool = False,
             epsilon: float = 0.0, out: Any | None = None) -> Any:
    stream = _stream(x)
    q = _empty(x.shape, np.uint8, x, stream) if out is None else out
    if x.size or amax_in is not None:
        _launch(x, "quantize.cu", f"fp8core::quantize_kernel<{_T[x.dtype]}, {fmt.index}>",
                _grid(x.device[1], x.size // 8 + 1), _THREADS,
                (x.data, q, _ptr(scale), _ptr(amax_in), _ptr(amax_out), _ptr(scale_inv_out), np.int64(x.size),
                 np.float32(fmt.max), np.int32(margin), np.int32(power_of_2), np.float32(epsilon)), stream)
    return q


_workspaces: dict[tuple[int, int], Any] = {}


def _workspace(x: Tensor, stream: Any, blocks: int) -> Any:
    """Per (device, stream): the grid barrier's two words and one amax partial per block."""
    key = (x.device[1], stream.ptr)
    ws = _workspaces.get(key)
    if ws is None or ws.size < 2 + blocks:
        ws = _zeros(2 + max(blocks, 4096), np.uint32, x, stream)
        _workspaces[key] = ws
    return ws


@lru_cache(maxsize=None)
def _cooperative_blocks(device_id: int, expr: str) -> int:
    fn = get_function("quantize.cu", expr, device_id)
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, _THREADS, 0)
    return max(1, min(per_sm, 8)) * _sm_count(device_id)


def quantize_dynamic(x: Tensor, fmt: Format, margin: int, power_of_2: bool, epsilon: float,
                     reduce: Callable | None, *, out: tuple = (None, None, None)) -> tuple[Any, Any, Any]:
    stream = _stream(x)
    q_out, s_inv_out, a_out = out
    if a_out is None:
        a = _zeros((1,), np.float32, x, stream)
    else:
        a = a_out
        with cupy.cuda.Device(x.device[1]), stream:
            a.fill(0)
    s_inv = _empty((1,), np.float32, x, stream) if s_inv_out is None else s_inv_out
    if reduce is not None or x.size == 0:
        # Distributed: amax, the group's MAX-reduce, then one quantize that makes the scale in every block.
        if x.size:
            with cupy.cuda.Device(x.device[1]), stream:
                a[...] = amax(x)
        if reduce is not None:
            reduce(a)
        q = quantize(x, None, fmt, None, amax_in=a, scale_inv_out=s_inv, margin=margin, power_of_2=power_of_2,
                     epsilon=epsilon, out=q_out)
        return q, s_inv, a
    expr = f"fp8core::quantize_dynamic_kernel<{_T[x.dtype]}, {fmt.index}>"
    blocks = min(_cooperative_blocks(x.device[1], expr), _grid(x.device[1], x.size // 8 + 1))
    ws = _workspace(x, stream, blocks)
    q = _empty(x.shape, np.uint8, x, stream) if q_out is None else q_out
    _launch(x, "quantize.cu", expr, blocks, _THREADS,
            (x.data, q, ws[2:], ws[:2], a, s_inv, np.int64(x.size), np.float32(fmt.max), np.int32(margin),
             np.int32(power_of_2), np.float32(epsilon)), stream, cooperative=True)
    return q, s_inv, a


def _pointer_table(values: list[int], t: Tensor, stream: Any, dtype: Any = np.uint64) -> Any:
    with cupy.cuda.Device(t.device[1]), stream:
        return cupy.asarray(np.asarray(values, dtype=dtype))


def _groups(xs: list[Tensor], key: Callable[[int], Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i in range(len(xs)):
        groups.setdefault(key(i), []).append(i)
    return groups


def _multi_grid(t: Tensor, sizes: list[int]) -> tuple[int, int]:
    """(blocks per tensor, tensors): the GPU filled once across all tensors, sized by the largest."""
    per_tensor = _grid(t.device[1], max(sizes) // 8 + 1) // max(1, len(sizes) // 8)
    return (max(1, per_tensor), len(sizes))


def multi_amax(xs: list[Tensor], out: Any) -> None:
    t0 = xs[0]
    stream = _stream(t0)
    for dtype, idx in _groups(xs, lambda i: xs[i].dtype).items():
        sizes = [xs[i].size for i in idx]
        ptrs = _pointer_table([xs[i].data.data.ptr if xs[i].size else 0 for i in idx], t0, stream)
        slots = out if len(idx) == len(xs) else None
        dst = slots if slots is not None else _zeros((len(idx),), np.float32, t0, stream)
        _launch(t0, "quantize.cu", f"fp8core::multi_amax_kernel<{_T[dtype]}>",
                _multi_grid(t0, sizes), _THREADS,
                (ptrs, _pointer_table(sizes, t0, stream, np.int64), dst), stream)
        if slots is None:
            with stream:
                out[idx] = cupy.maximum(out[idx].view(np.uint32), dst.view(np.uint32)).view(np.float32)


def multi_quantize(xs: list[Tensor], scales: list[Any], fmts: list[Format],
                   amax_outs: list[Any | None], *, outs: list[Any | None] | None = None) -> list[Any]:
    t0 = xs[0]
    stream = _stream(t0)
    outs = outs if outs is not None else [None] * len(xs)
    qs = [_empty(x.shape, np.uint8, t0, stream) if o is None else o for x, o in zip(xs, outs)]
    for (dtype, fmt), idx in _groups(xs, lambda i: (xs[i].dtype, fmts[i])).items():
        sizes = [xs[i].size for i in idx]
        table = lambda vals, dt=np.uint64: _pointer_table(vals, t0, stream, dt)  # noqa: E731
        _launch(t0, "quantize.cu", f"fp8core::multi_quantize_kernel<{_T[dtype]}, {fmt.index}>",
                _multi_grid(t0, sizes), _THREADS,
                (table([xs[i].data.data.ptr if sizes[k] else 0 for k, i in enumerate(idx)]),
                 table([qs[i].data.ptr if sizes[k] else 0 for k, i in enumerate(idx)]),
                 table(sizes, np.int64), table([scales[i].data.ptr for i in idx]),
                 table([int(_ptr(amax_outs[i])) for i in idx])), stream)
    return qs


# ---- dequantize, transpose, cast_transpose ----------------------------------------------------------------

_OUT_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}
_OUT_T = {"float32": "float", "bfloat16": "fp8core::bf16", "float16": "fp8core::f16"}


def dequantize(q: Tensor, fmt: Format, scale_inv: Any, out_dtype: str, *, out: Any | None = None) -> Any:
    stream = _stream(q)
    y = _empty(q.shape, _OUT_STORAGE[out_dtype], q, stream) if out is None else out
    if q.size:
        _launch(q, "dequantize.cu", f"fp8core::dequantize_kernel<{fmt.index}, {_OUT_T[out_dtype]}>",
                _grid(q.device[1], q.size // 8 + 1), _THREADS, (q.data, y, scale_inv, np.int64(q.size)), stream)
    return y


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    n = -(-rows // 64) * -(-cols // 64)
    return (min(n, 65535), -(-n // 65535))


def transpose(q: Tensor, *, out: Any | None = None) -> Any:
    rows, cols = q.shape
    stream = _stream(q)
    out = _empty((cols, rows), np.uint8, q, stream) if out is None else out
    if q.size:
        _launch(q, "cast_transpose.cu", "fp8core::cast_transpose_kernel<fp8core::Passthrough, 0, false>",
                _tiles(rows, cols), _THREADS,
                (q.data, _NULL, out, _NULL, _NULL, np.int64(rows), np.int64(cols)), stream)
    return out


def cast_transpose(x: Tensor, scale: Any, fmt: Format, amax_out: Any | None, *,
                   out: tuple = (None, None)) -> tuple[Any, Any]:
    rows, cols = x.shape
    stream = _stream(x)
    q = _empty((rows, cols), np.uint8, x, stream) if out[0] is None else out[0]
    qt = _empty((cols, rows), np.uint8, x, stream) if out[1] is None else out[1]
    if x.size:
        _launch(x, "cast_transpose.cu", f"fp8core::cast_transpose_kernel<{_T[x.dtype]}, {fmt.index}, true>",
                _tiles(rows, cols), _THREADS,
                (x.data, q, qt, scale, _ptr(amax_out), np.int64(rows), np.int64(cols)), stream)
    return q, qt


# ---- the scale rule and the batched update ----------------------------------------------------------------

def _array_tensor(a: Any) -> Tensor:
    return Tensor(a, "float32", ("cuda", a.device.id), "cupy")


def _scale_launch(amax: Any, fp8_max: Any, margin: int, power_of_2: bool, epsilon: float, previous: Any | None,
                  ok: Any | None) -> tuple[Any, Any]:
    t = _array_tensor(amax)
    stream = _stream(t)
    s = _empty(amax.shape, np.float32, t, stream)
    s_inv = _empty(amax.shape, np.float32, t, stream)
    n = amax.size
    if n:
        _launch(t, "update.cu", "fp8core::compute_scale_kernel", -(-n // _THREADS), _THREADS,
                (amax, fp8_max, s, s_inv, _ptr(ok), _ptr(previous),
                 np.int64(0 if previous is None else previous.size), np.int64(n), np.int32(margin),
                 np.int32(power_of_2), np.float32(epsilon)), stream)
    return s, s_inv


def compute_scale(amax: Any, fp8_max: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: Any | None) -> tuple[Any, Any]:
    with cupy.cuda.Device(amax.device.id):
        maxes = cupy.full(amax.shape, fp8_max, dtype=np.float32)
    return _scale_launch(amax, maxes, margin, power_of_2, epsilon, previous, None)


def scale_rule(amax: Any, fp8_max: Any, margin: int, power_of_2: bool, epsilon: float) -> tuple[Any, Any, Any]:
    """(scale, scale_inv, ok) elementwise, for the array path of callable recipes."""
    ok = cupy.empty(amax.shape, dtype=cupy.bool_)
    s, s_inv = _scale_launch(amax, fp8_max, margin, power_of_2, epsilon, None, ok)
    return s, s_inv, ok


def update(history: Any, scale: Any, scale_inv: Any, fp8_max: Any, margin: int, algo: str, power_of_2: bool,
           epsilon: float, update_scale: bool, flags: Any | None) -> None:
    L, n = history.shape
    t = _array_tensor(history)
    warps = max(1, min(16, (L - 1 + 63) // 64))
    _launch(t, "update.cu", f"fp8core::update_kernel<{'true' if algo == 'max' else 'false'}>", -(-n // 32),
            (32, warps),
            (history, scale, scale_inv, fp8_max, _ptr(flags), np.int64(n), np.int32(L), np.int32(margin),
             np.int32(power_of_2), np.float32(epsilon), np.int32(update_scale)), _stream(t))


# ---- gemm -------------------------------------------------------------------------------------------------

def gemm(spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
         out_scale: Any | None, out_amax: Any | None, out: Any | None) -> Any:
    from . import cublaslt

    return cublaslt.gemm(spec, a, b, a_scale_inv, b_scale_inv, bias, out_scale, out_amax, out, _stream(a), _empty)
