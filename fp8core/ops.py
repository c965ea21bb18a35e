"""The public FP8 primitives. Each validates its arguments, picks the backend by device, and returns the
caller's own array type. The numerics are in docs/numerics.md; the backends implement them bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from . import _checks, _tensor, backends
from ._fpenv import ieee
from ._tensor import Tensor, export, export_all, logical_numpy_dtype, storage_dtype, wrap
from .backends import cpu as _cpu
from .formats import FP8_DTYPES, HIGH_PRECISION_DTYPES, Format, as_format

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose",
           "compute_scale", "multi_amax", "multi_quantize"]

Array = Any
MAX_MARGIN = _checks.MAX_MARGIN
_HP = frozenset(HIGH_PRECISION_DTYPES)
_F32_MAX = 3.4028234663852886e38
_F32_MIN_NORMAL = 1.1754943508222875e-38
_F32 = np.dtype(np.float32)  # NumPy's one native float32 dtype object (a byte-swapped one is another object)


# ---- argument checks shared by every primitive; the same errors on every backend ---------------------------
# The hot path: the cheap test first, the message only when it fails. Scalar rules live in _checks.

def _contiguous(t: Tensor, arg: str) -> Tensor:
    data = t.data
    if not data.flags.c_contiguous and data.size > 1:
        raise ValueError(f"{arg}: expected a contiguous (row-major) array, got strides {data.strides} for "
                         f"shape {data.shape}; make it contiguous first")
    return t


def _high_precision(obj: Any, arg: str) -> Tensor:
    t = _contiguous(wrap(obj, arg), arg)
    if t.dtype not in _HP:
        _checks.high_precision_name(t.dtype, arg)
    return t


# Format lookups without as_format's parsing: every spelling seen once is remembered.
_FORMATS: dict[Any, Format] = {Format.E4M3: Format.E4M3, Format.E5M2: Format.E5M2}
_FP8_NAME = {Format.E4M3: "float8_e4m3fn", Format.E5M2: "float8_e5m2"}


def _format(fmt: Any) -> Format:
    try:
        f = _FORMATS.get(fmt)
    except TypeError:  # unhashable: as_format names the problem
        return as_format(fmt)
    if f is None:
        f = as_format(fmt)
        if isinstance(fmt, str) or type(fmt).__module__.split(".")[0] in ("torch", "numpy", "jax", "ml_dtypes"):
            _FORMATS[fmt] = f
    return f


def _fp8(obj: Any, arg: str, fmt: Any) -> tuple[Tensor, Format]:
    """An fp8 tensor: a native fp8 dtype, or uint8 storage (CuPy) with ``fmt`` naming the format."""
    t = _contiguous(wrap(obj, arg), arg)
    if t.dtype in FP8_DTYPES:
        found = _format(t.dtype)
        if fmt is not None and _format(fmt) is not found:
            raise ValueError(f"fmt: {_format(fmt).name} does not match {arg}'s dtype {t.dtype}")
        return t, found
    if t.dtype == "uint8":
        if fmt is None:
            raise TypeError(f"{arg}: uint8 data is fp8 storage only with fmt= naming its format")
        return t, _format(fmt)
    if t.dtype in _HP:
        raise TypeError(f"{arg}: expected fp8 data (float8_e4m3fn, float8_e5m2), got {t.dtype}; quantize it first")
    raise TypeError(f"{arg}: expected fp8 data (float8_e4m3fn, float8_e5m2), got {t.dtype}")


def _same_device(t: Tensor, x: Tensor, arg: str, xarg: str = "x") -> None:
    # JAX arrays committed to two devices are refused (an uncommitted one goes anywhere): _tensor says why
    if t.device != x.device or (t.place is not x.place and t.place is not None and x.place is not None):
        raise ValueError(f"{arg}: is on {t.device_str()} but {xarg} is on {x.device_str()}; "
                         "put them on the same device")


@ieee  # a Python float's fp32 rounding must not flush a subnormal (FTZ set by the caller)
def _host_f32(values: Any) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float32).reshape(-1)


def _new_f32(values: Any, like: Tensor, arg: str | None = None) -> Any:
    """``arg``: the argument whose Python number this is (a device temporary: refused inside a CuPy capture)."""
    host = _host_f32(values)
    if not like.is_cuda:
        return host
    return _backend(like).device_f32(host, like, arg)  # on the caller's stream


def _scalar(obj: Any, x: Tensor, arg: str, xarg: str = "x", copy: bool = False) -> Any:
    """A 1-element float32 array on x's device (a Python float becomes one). ``copy``: a torch CPU scalar may
    come back as a copy of its value (not where an ``out=`` must be checked against the scale's memory)."""
    tp = type(obj)
    if tp is float or tp is int or (isinstance(obj, (float, int)) and not isinstance(obj, bool)):
        # fp32 normals (and 0) convert the same in any floating-point mode; the rest go through the guard
        if (_F32_MIN_NORMAL <= abs(obj) <= _F32_MAX or obj == 0) and x.device[0] == "cpu":
            return np.array([obj], np.float32)
        return _new_f32([_checks.real(obj, arg)], x, arg)
    if tp is np.ndarray and obj.dtype is _F32 and obj.size == 1 and x.device[0] == "cpu":
        return obj if obj.ndim == 1 else obj.reshape(-1)  # a native fp32 element: nothing the checks would refuse
    torch = _tensor._torch
    if copy and torch is not None and tp is torch.Tensor and x.device[0] == "cpu" \
            and obj.is_cpu and obj.dtype is torch.float32 and obj.numel() == 1 and not obj.is_neg():
        try:
            ptr = obj.data_ptr()
        except RuntimeError:  # no storage (sparse): the general path says so
            ptr = 0
        if ptr:  # its 4 bytes, read as bits (a float read would flush a subnormal under DAZ): a third of a view
            return np.array([ctypes.c_uint32.from_address(ptr).value], np.uint32).view(np.float32)
    data = _f32_vector(obj, x, arg, xarg).data
    if data.size != 1:
        raise ValueError(f"{arg}: expected 1 element, got shape {tuple(data.shape)}")
    return data if data.ndim == 1 else data.reshape(-1)


def _f32_vector(obj: Any, x: Tensor, arg: str, xarg: str = "x") -> Tensor:
    t = _contiguous(wrap(obj, arg), arg)
    if t.dtype != "float32":
        raise TypeError(f"{arg}: expected float32, got {t.dtype}")
    if t.device != x.device or t.place is not x.place:
        _same_device(t, x, arg, xarg)
    return t


def _amax_slot(obj: Any, x: Tensor) -> Any:
    if obj is None:
        return None
    if type(obj) is np.ndarray and obj.dtype is _F32 and obj.size == 1 and x.device[0] == "cpu" \
            and obj.flags.writeable:
        return obj if obj.ndim == 1 else obj.reshape(-1)  # nothing the checks below would refuse
    t = _f32_vector(obj, x, "amax_out")
    if t.data.size != 1:
        raise ValueError(f"amax_out: expected 1 element, got shape {t.shape}")
    if t.readonly:
        raise ValueError("amax_out: is read-only (JAX arrays are immutable: fp8core.jax returns amax instead)")
    data = t.data
    return data if data.ndim == 1 else data.reshape(-1)


_margin = _checks.margin
_epsilon = _checks.epsilon


def _as_2d(t: Tensor, arg: str) -> Tensor:
    shape = t.data.shape
    if len(shape) == 0:
        raise ValueError(f"{arg}: expected at least 1 dimension, got a scalar")
    if len(shape) == 2:
        return t
    rows = math.prod(shape[:-1])
    return Tensor(t.data.reshape(rows, shape[-1]), t.dtype, t.device, t.origin, t.readonly, t.place)


_OUT_DTYPES: dict[Any, str] = {}


def _out_dtype(out_dtype: Any) -> str:
    try:
        name = _OUT_DTYPES.get(out_dtype)
    except TypeError:
        return _checks.out_dtype(out_dtype)
    if name is None:
        name = _OUT_DTYPES[out_dtype] = _checks.out_dtype(out_dtype)
    return name


def _backend(t: Tensor) -> Any:
    if t.device[0] == "cpu":
        return _cpu
    global _cuda
    if _cuda is None:
        _cuda = backends.for_device(t.device)
    return _cuda


_cuda: Any = None  # imported on the first CUDA call (it imports CuPy)


def _reduce(reduce: Any) -> Any:
    """The backend's hook: ``reduce`` run by :func:`reduce_amaxes`'s rule on the 1-element amax."""
    if reduce is None:
        return None
    if not callable(reduce):
        raise TypeError(f"reduce: expected a callable or None, got {type(reduce).__name__}")
    return lambda a: reduce_amaxes(reduce, a, a)


def reduce_amaxes(reduce: Callable[[Any], Any], given: Any, data: Any) -> None:
    """The one rule of every ``reduce`` hook (:func:`quantize_dynamic`, ``ScalingState.update``).

    ``reduce(given)`` MAX-reduces the float32 amaxes ``given`` [n] across a group, either in place (returning
    None, ``given`` itself, or an async handle with ``wait()``, which is waited on: torch.distributed.all_reduce)
    or by returning the reduced amaxes (n float32 values on their device: a functional all-reduce), which are
    then copied into ``given``. ``data`` is ``given``'s memory as a backend array (NumPy or CuPy), flat.

    The reduced amaxes are checked where they lie in host memory (a GPU array is not read back: that would
    synchronise): a negative amax (-0.0 too: a MAX of amaxes >= +0 never gives one) is refused naming
    ``reduce``, and ``given`` is put back as it was, so a refused reduce leaves nothing written.
    """
    n = data.size
    saved = data.copy() if isinstance(data, np.ndarray) else None
    result = reduce(given)
    if result is not None and result is not given:
        if callable(getattr(result, "wait", None)):
            result.wait()
        else:
            try:
                got = _contiguous(wrap(result, "reduce's result"), "reduce's result")
            except TypeError as e:
                raise TypeError(f"reduce: returned {type(result).__name__}; expected None (reduced in place) or "
                                f"the reduced amaxes as an array of {n} float32 values") from e
            if got.dtype != "float32" or got.size != n:
                raise ValueError(f"reduce: returned {got.size} {got.dtype} values; expected None (reduced in "
                                 f"place) or the reduced amaxes as {n} float32 values")
            _same_device(got, wrap(data, "amax"), "reduce's result", "the amaxes")
            data[...] = got.data.reshape(-1)  # float32 to float32: a copy of bits in any mode
    if saved is not None:
        neg = _checks.negative_amax_mask(data)
        if bool(neg.any()):
            i = int(np.flatnonzero(neg)[0])
            value = _checks.f32_text(data[i])
            data[...] = saved
            raise ValueError(f"reduce: gave a negative amax ({value}) for tensor {i}; amaxes are >= +0 (a MAX "
                             f"all-reduce of amaxes keeps them so); nothing was written")


# ---- out=: the caller's memory for the results (NumPy's convention); checked in full before any write -----

def _outs(out: Any, n: int) -> tuple[Any, ...]:
    """``out`` as n entries (None: allocate that one); one array is accepted where there is one result."""
    if out is None:
        return (None,) * n
    if not isinstance(out, tuple):
        out = (out,)
    if len(out) != n:
        raise ValueError(f"out: expected {'an array or ' if n == 1 else ''}a tuple of {n} arrays (None for any "
                         f"to allocate), got a tuple of {len(out)}")
    return out


def _out(obj: Any, arg: str, shape: tuple, dtype: str, x: Tensor, xarg: str = "x") -> Tensor:
    """One output slot: contiguous, writable, on x's device, ``shape``, and ``dtype`` or its storage dtype
    (uint8 for fp8, uint16 for bfloat16: the format is already named by the call)."""
    t = _contiguous(wrap(obj, arg), arg)
    _same_device(t, x, arg, xarg)
    if t.dtype != dtype and t.dtype != _storage_name(dtype):
        storage = _storage_name(dtype)
        also = f" (or {storage} storage)" if storage != dtype else ""
        raise TypeError(f"{arg}: expected {dtype}{also}, got {t.dtype}")
    if t.shape != tuple(shape):
        raise ValueError(f"{arg}: expected shape {tuple(shape)}, got {t.shape}")
    if t.readonly:
        raise ValueError(f"{arg}: is read-only")
    return t


_storage_name = functools.cache(lambda dtype: storage_dtype(dtype).name)  # np.dtype(...).name: microseconds


def _overlap(a: Any, b: Any) -> bool:
    """Whether two arrays' memory ranges meet (every argument is contiguous by now)."""
    if isinstance(a, np.ndarray):
        return np.may_share_memory(a, b)  # the bounds only, without a pointer read (.ctypes costs more)
    if not a.size or not b.size:
        return False
    pa, pb = a.data.ptr, b.data.ptr
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def _no_overlap(outs: Sequence[tuple[str, Tensor | None]], ins: Sequence[tuple[str, Any]]) -> None:
    """No output may share memory with an input or another output: a kernel would read what it wrote."""
    named = [(a, t.data) for a, t in outs if t is not None]
    others = [(a, d.data if isinstance(d, Tensor) else d) for a, d in ins if d is not None]
    for i, (arg, data) in enumerate(named):
        for other, odata in named[i + 1:] + others:
            if _overlap(data, odata):
                raise ValueError(f"{arg}: overlaps {other} in memory; pass a separate array")


def _backend_data(t: Tensor | None, dtype: str, shape: tuple | None = None) -> Any:
    """The slot as its backend takes arrays: logical dtype on the CPU, storage dtype on a GPU."""
    if t is None:
        return None
    data = t.data.view(storage_dtype(dtype) if t.is_cuda else logical_numpy_dtype(dtype))
    return data if shape is None else data.reshape(shape)


# ---- the primitives ---------------------------------------------------------------------------------------

def amax(x: Array) -> Array:
    """``max |x|`` as a 1-element float32 array on x's device; NaN propagates, empty gives 0.

    x: float32, bfloat16 or float16, any shape.
    """
    t = _high_precision(x, "x")
    return export(_backend(t).amax(t), "float32", t)


def quantize(x: Array, scale: Array | float, fmt: Format | str = Format.E4M3, *,
             amax_out: Array | None = None, out: Array | None = None) -> Array:
    """``q = SATFINITE_RTNE(fp32(x) * scale)`` in ``fmt``, same shape as x.

    x: float32/bfloat16/float16. scale: 1-element float32 on x's device (or a Python float).
    amax_out: optional 1-element float32, updated in place to ``max(amax_out, amax(x))``.
    out: optional result array (x's shape, fmt's dtype or uint8 storage), written and returned.
    """
    t = _high_precision(x, "x")
    f = _format(fmt)
    s, a = _scalar(scale, t, "scale", copy=out is None), _amax_slot(amax_out, t)
    if out is None:
        return export(_backend(t).quantize(t, s, f, a), _FP8_NAME[f], t)
    (o,) = _outs(out, 1)
    ot = None if o is None else _out(o, "out", t.shape, f.dtype_name, t)
    _no_overlap([("out", ot)], [("x", t), ("scale", s), ("amax_out", a)])
    q = _backend(t).quantize(t, s, f, a, out=_backend_data(ot, f.dtype_name))
    return o if o is not None else export(q, f.dtype_name, t)


def quantize_dynamic(x: Array, fmt: Format | str = Format.E4M3, *, margin: int = 0, power_of_2: bool = False,
                     epsilon: float = 0.0, reduce: Callable[[Array], None] | None = None,
                     out: Array | tuple[Array | None, ...] | None = None) -> tuple[Array, Array, Array]:
    """Current scaling: amax of x, the scale rule (1.0 when there is no scale), then quantize.

    ``reduce``, when given, MAX-reduces the 1-element amax across a process group before the scale is taken:
    in place, or by returning the reduced amax (the rule of :func:`reduce_amaxes`, as ``ScalingState.update``);
    a negative reduced amax is refused. Returns ``(q, scale_inv, amax)``; scale_inv and amax are 1-element
    float32 on x's device.
    out: optional ``q`` array, or a tuple ``(q, scale_inv, amax)`` with None for any to allocate.
    """
    t = _high_precision(x, "x")
    f = _format(fmt)
    if out is None:
        q, s_inv, a = _backend(t).quantize_dynamic(
            t, f, _margin(margin), _checks.flag(power_of_2, "power_of_2"), _epsilon(epsilon), _reduce(reduce))
        return export_all(((q, _FP8_NAME[f]), (s_inv, "float32"), (a, "float32")), t)
    margin, epsilon = _margin(margin), _epsilon(epsilon)
    o = _outs(out, 3) if isinstance(out, tuple) else (out, None, None)
    slots = [None if v is None else _out(v, arg, shape, dtype, t) for v, arg, shape, dtype in
             zip(o, ("out[0]", "out[1]", "out[2]"), (t.shape, (1,), (1,)), (f.dtype_name, "float32", "float32"))]
    _no_overlap(list(zip(("out[0]", "out[1]", "out[2]"), slots)), [("x", t)])
    q, s_inv, a = _backend(t).quantize_dynamic(
        t, f, margin, _checks.flag(power_of_2, "power_of_2"), epsilon, _reduce(reduce),
        out=tuple(_backend_data(v, d) for v, d in zip(slots, (f.dtype_name, "float32", "float32"))))
    return tuple(given if given is not None else export(r, d, t)  # type: ignore[return-value]
                 for given, r, d in zip(o, (q, s_inv, a), (f.dtype_name, "float32", "float32")))


def dequantize(q: Array, scale_inv: Array | float, out_dtype: Any = "float32", *,
               fmt: Format | str | None = None, out: Array | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * scale_inv)``; NaN comes out canonical.

    q: fp8 (or uint8 storage with ``fmt``). out_dtype: float32, bfloat16 or float16.
    out: optional result array (q's shape, out_dtype; bfloat16 may be uint16 storage), written and returned.
    """
    t, f = _fp8(q, "q", fmt)
    name = _out_dtype(out_dtype)
    s = _scalar(scale_inv, t, "scale_inv", "q", copy=out is None)
    if out is None:
        return export(_backend(t).dequantize(t, f, s, name), name, t)
    (o,) = _outs(out, 1)
    ot = None if o is None else _out(o, "out", t.shape, name, t, "q")
    _no_overlap([("out", ot)], [("q", t), ("scale_inv", s)])
    y = _backend(t).dequantize(t, f, s, name, out=_backend_data(ot, name))
    return o if o is not None else export(y, name, t)


def transpose(q: Array, *, fmt: Format | str | None = None, out: Array | None = None) -> Array:
    """``q_t[N, M]`` of fp8 ``q[M, N]`` (more dims are viewed as [prod(leading), last]), bits unchanged.

    out: optional [N, M] result array (q's fp8 dtype or uint8 storage), written and returned.
    """
    t, f = _fp8(q, "q", fmt)
    t = _as_2d(t, "q")
    if out is None:
        return export(_backend(t).transpose(t), _FP8_NAME[f], t)
    (o,) = _outs(out, 1)
    ot = None if o is None else _out(o, "out", t.shape[::-1], f.dtype_name, t, "q")
    _no_overlap([("out", ot)], [("q", t)])
    qt = _backend(t).transpose(t, out=_backend_data(ot, f.dtype_name))
    return o if o is not None else export(qt, f.dtype_name, t)


def cast_transpose(x: Array, scale: Array | float, fmt: Format | str = Format.E4M3, *,
                   amax_out: Array | None = None,
                   out: tuple[Array | None, Array | None] | None = None) -> tuple[Array, Array]:
    """``(q, q_t)``: ``quantize(x, scale, fmt)`` and its transpose from one read of x.

    x: [M, N] (more dims are viewed as [prod(leading), last]); q has x's shape, q_t is [N, M].
    out: optional ``(q, q_t)`` result arrays (None for either to allocate), written and returned.
    """
    t = _high_precision(x, "x")
    f = _format(fmt)
    s, a = _scalar(scale, t, "scale", copy=out is None), _amax_slot(amax_out, t)
    if out is None:
        q, qt = _backend(t).cast_transpose(_as_2d(t, "x"), s, f, a)
        name = _FP8_NAME[f]
        return export_all(((q.reshape(t.data.shape), name), (qt, name)), t)
    t2 = _as_2d(t, "x")
    o = _outs(out, 2)
    oq = None if o[0] is None else _out(o[0], "out[0]", t.shape, f.dtype_name, t)
    oqt = None if o[1] is None else _out(o[1], "out[1]", t2.shape[::-1], f.dtype_name, t)
    _no_overlap([("out[0]", oq), ("out[1]", oqt)], [("x", t), ("scale", s), ("amax_out", a)])
    q, qt = _backend(t).cast_transpose(
        t2, s, f, a, out=(_backend_data(oq, f.dtype_name, t2.shape), _backend_data(oqt, f.dtype_name)))
    return (o[0] if o[0] is not None else export(q.reshape(t.shape), f.dtype_name, t),
            o[1] if o[1] is not None else export(qt, f.dtype_name, t))


def compute_scale(amax: Array | float, fmt: Format | str, *, margin: int = 0, power_of_2: bool = False,
                  epsilon: float = 0.0, previous: Array | float | None = None) -> tuple[Array, Array]:
    """``(scale, scale_inv)`` from amax by the one scale rule of the contract, elementwise.

    Where there is no new scale (amax 0, inf or NaN after the epsilon floor) the result is ``previous``
    (delayed scaling) or 1.0 (current scaling, ``previous=None``). ``previous`` must hold finite scales > 0;
    it is checked when it is a number or host memory (a GPU array is not read back: that would synchronise).
    A 0-d amax gives [1] results, like every scale in fp8core; otherwise the results have amax's shape.
    """
    f = _format(fmt)
    if isinstance(amax, (float, int)) and not isinstance(amax, bool):
        amax = _host_f32([_checks.real(amax, "amax")])
    t = _contiguous(wrap(amax, "amax"), "amax")
    if t.dtype != "float32":
        raise TypeError(f"amax: expected float32, got {t.dtype}")
    if t.data.ndim == 0:
        t = Tensor(t.data.reshape(1), t.dtype, t.device, t.origin, t.readonly, t.place)
    m, p2, eps = _margin(margin), _checks.flag(power_of_2, "power_of_2"), _epsilon(epsilon)
    prev = None
    if previous is not None:
        if isinstance(previous, (float, int, np.floating, np.integer)) and not isinstance(previous, bool):
            host = _host_f32([_checks.scale_value(previous, "previous")])
            if not _checks.scale_mask(host).all():  # 1e-46 is 0 in float32, 1e39 is inf: no scale either
                raise ValueError(f"previous: {previous!r} is {_checks.f32_text(host)} in float32; expected a finite "
                                 f"scale > 0")
            prev = _new_f32(host, t, "previous")
        else:
            pt = _f32_vector(previous, t, "previous", "amax")
            prev = pt.data
            if not pt.is_cuda:
                _checks.scale_values(prev, "previous")
        if prev.size not in (1, t.size):
            raise ValueError(f"previous: expected 1 or {t.size} elements, got {prev.size}")
    s, s_inv = _backend(t).compute_scale(t if t.is_cuda else t.data, f.max, m, p2, eps, prev)
    return export(s, "float32", t), export(s_inv, "float32", t)


def multi_amax(xs: Sequence[Array], out: Array | None = None) -> Array:
    """amax of each tensor of ``xs`` into ``out[i] = max(out[i], amax(xs[i]))`` (one launch per dtype on a GPU).

    ``out`` (float32 [len(xs)], e.g. row 0 of a ScalingState history) is created zeroed when omitted.
    """
    ts = [_high_precision(x, f"xs[{i}]") for i, x in enumerate(_checks.array_sequence(xs))]
    for i, t in enumerate(ts[1:], 1):
        _same_device(t, ts[0], f"xs[{i}]", "xs[0]")
    if out is None:
        o = Tensor(_new_f32(np.zeros(len(ts)), ts[0]), "float32", ts[0].device, ts[0].origin)
    else:
        o = _f32_vector(out, ts[0], "out", "xs[0]")
        if o.size != len(ts):
            raise ValueError(f"out: expected {len(ts)} elements, got {o.size}")
        if o.readonly:
            raise ValueError("out: is read-only")
    _backend(ts[0]).multi_amax(ts, o.data.reshape(-1))
    return out if out is not None else export(o.data, "float32", ts[0])


def multi_quantize(xs: Sequence[Array], scales: Array, fmts: Format | str | Sequence[Format | str], *,
                   amax_out: Array | None = None, out: Sequence[Array | None] | None = None) -> list[Array]:
    """Quantize every tensor of ``xs`` with ``scales[i]`` (float32 [len(xs)]) into ``fmts[i]``.

    ``amax_out`` (float32 [len(xs)]) accumulates each tensor's amax, like :func:`quantize` does.
    out: optional sequence of len(xs) result arrays (None for any to allocate), written and returned.
    """
    ts = [_high_precision(x, f"xs[{i}]") for i, x in enumerate(_checks.array_sequence(xs))]
    n = len(ts)
    fl = [_format(fmts)] * n if isinstance(fmts, (Format, str)) else [_format(f) for f in fmts]
    if len(fl) != n:
        raise ValueError(f"fmts: expected {n} formats, got {len(fl)}")
    for i, t in enumerate(ts[1:], 1):
        _same_device(t, ts[0], f"xs[{i}]", "xs[0]")
    sc = _f32_vector(scales, ts[0], "scales", "xs[0]").data.reshape(-1)
    if sc.size != n:
        raise ValueError(f"scales: expected {n} elements, got {sc.size}")
    am = None
    if amax_out is not None:
        at = _f32_vector(amax_out, ts[0], "amax_out", "xs[0]")
        if at.size != n:
            raise ValueError(f"amax_out: expected {n} elements, got {at.size}")
        if at.readonly:
            raise ValueError("amax_out: is read-only")
        am = at.data.reshape(-1)
    if out is None:
        qs = _backend(ts[0]).multi_quantize(
            ts, [sc[i:i + 1] for i in range(n)], fl, [None if am is None else am[i:i + 1] for i in range(n)])
        return [export(q, _FP8_NAME[f], t) for q, f, t in zip(qs, fl, ts)]
    o = _outs(None if out is None else tuple(out), n)
    slots = [None if v is None else _out(v, f"out[{i}]", t.shape, f.dtype_name, ts[0], "xs[0]")
             for i, (v, t, f) in enumerate(zip(o, ts, fl))]
    _no_overlap([(f"out[{i}]", v) for i, v in enumerate(slots)],
                [(f"xs[{i}]", t) for i, t in enumerate(ts)] + [("scales", sc), ("amax_out", am)])
    qs = _backend(ts[0]).multi_quantize(
        ts, [sc[i:i + 1] for i in range(n)], fl, [None if am is None else am[i:i + 1] for i in range(n)],
        outs=[_backend_data(v, f.dtype_name) for v, f in zip(slots, fl)])
    return [given if given is not None else export(q, f.dtype_name, t) for given, q, f, t in zip(o, qs, fl, ts)]
