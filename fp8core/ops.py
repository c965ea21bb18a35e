"""The public FP8 primitives. Each validates its arguments (fp8core.args), picks the backend by device, and
returns the caller's own array type. The numerics are in docs/numerics.md; the backends implement them bit for bit.

Results have the shapes and dtypes their declaration's rule gives (fp8core.declarations, which the torch fakes and
fp8core.jax read too): a given ``out=`` is checked against them, and the rest is allocated from them here, by the
caller's allocator (torch's, CuPy's on a GPU), before the backend writes it. On the CPU, for a caller whose
results NumPy may allocate (NumPy, JAX, DLPack: not torch), the backend's lookup or copy that computes a result
makes it, in the declared shape and dtype (tests/test_declarations.py holds every primitive to its rule): a
separate allocation and a write through ``out`` cost a 16-element call a tenth of its time.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import args, backends
from ._caches import memo
from ._tensor import Tensor, export, export_all, wrap
from ._views import ALLOCATING
from .declarations import PRIMITIVES
from .declare import Spec
from .formats import Format

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose",
           "compute_scale", "multi_amax", "multi_quantize"]

Array = Any


# for_device's answers: its import statement is most of a 16-element call
_BACKENDS: dict[tuple, Any] = memo("ops.backends", {})


def _backend(t: Tensor) -> Any:
    b = _BACKENDS.get(t.device)
    return b if b is not None else _BACKENDS.setdefault(t.device, backends.for_device(t.device))


_QUANTIZE, _DYNAMIC, _DEQUANTIZE, _TRANSPOSE, _CAST_TRANSPOSE = (  # each call's declared results
    PRIMITIVES[name].results for name in ("quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose"))


def _slot(given: Any, arg: str, spec: Spec, t: Tensor, xarg: str = "x") -> Tensor | None:
    """A given ``out=`` array checked against its declared spec, or None."""
    return None if given is None else args.out_slot(given, arg, spec.shape, spec.dtype, t, xarg)


def _dest(backend: Any, spec: Spec, slot: Tensor | None, t: Tensor) -> Any:
    """Where a result goes, as the backend takes arrays: its checked out= slot, else a new array of its spec."""
    return args.result(backend, spec, t) if slot is None else args.backend_data(slot, spec.dtype)


# ---- the primitives ---------------------------------------------------------------------------------------

def amax(x: Array) -> Array:
    """``max |x|`` as a 1-element float32 array on x's device; NaN propagates, empty gives 0.

    x: float32, bfloat16 or float16, any shape.
    """
    t = args.high_precision(x, "x")
    return export(_backend(t).amax(t), "float32", t)


def quantize(x: Array, scale: Array | float, fmt: Format | str = Format.E4M3, *,
             amax_out: Array | None = None, out: Array | None = None) -> Array:
    """``q = SATFINITE_RTNE(fp32(x) * scale)`` in ``fmt``, same shape as x.

    x: float32/bfloat16/float16. scale: 1-element float32 on x's device (or a Python float).
    amax_out: optional 1-element float32, updated in place to ``max(amax_out, amax(x))``.
    out: optional result array (x's shape, fmt's dtype or uint8 storage), written and returned.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    s, a = args.scalar(scale, t, "scale"), args.amax_slot(amax_out, t)
    backend = _BACKENDS.get(t.device) or _backend(t)
    if out is None:
        if t.device[0] == "cpu" and t.origin not in ALLOCATING:  # NumPy's lookup makes it (the module docstring)
            return export(backend.quantize(t, s, f, a), f.dtype_name, t)
        q = args.result(backend, _QUANTIZE((t.data.shape, t.dtype), None, f)[0], t)
        return export(backend.quantize(t, s, f, a, out=q), f.dtype_name, t)
    (spec,) = _QUANTIZE((t.data.shape, t.dtype), None, f)
    (o,) = args.outs(out, 1)
    ot = _slot(o, "out", spec, t)
    args.no_overlap([("out", ot)], [("x", t), ("scale", s), ("amax_out", a)])
    q = backend.quantize(t, s, f, a, out=_dest(backend, spec, ot, t))
    return o if o is not None else export(q, spec.dtype, t)


def quantize_dynamic(x: Array, fmt: Format | str = Format.E4M3, *, margin: int = 0, power_of_2: bool = False,
                     epsilon: float = 0.0, reduce: Callable[[Array], None] | None = None,
                     out: Array | tuple[Array | None, ...] | None = None) -> tuple[Array, Array, Array]:
    """Current scaling: amax of x, the scale rule (1.0 when there is no scale), then quantize.

    ``reduce``, when given, MAX-reduces the 1-element amax across a process group before the scale is taken:
    in place, or by returning the reduced amax (:func:`fp8core.args.reduce_amaxes`' rule, as
    ``ScalingState.update``); a negative reduced amax is refused. Returns ``(q, scale_inv, amax)``; scale_inv and amax are 1-element
    float32 on x's device.
    out: optional ``q`` array, or a tuple ``(q, scale_inv, amax)`` with None for any to allocate.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    rule = (args.margin(margin), args.flag(power_of_2, "power_of_2"), args.epsilon(epsilon), args.reduce_hook(reduce))
    backend = _BACKENDS.get(t.device) or _backend(t)
    # q from its spec; scale_inv and amax, unless given, are the backend's (on a GPU its kernel's workspace)
    if out is None:
        if t.device[0] == "cpu" and t.origin not in ALLOCATING:
            q, s_inv, a = backend.quantize_dynamic(t, f, *rule)
        else:
            q = args.result(backend, _DYNAMIC((t.data.shape, t.dtype), f)[0], t)
            q, s_inv, a = backend.quantize_dynamic(t, f, *rule, out=(q, None, None))
        return export_all(((q, f.dtype_name), (s_inv, "float32"), (a, "float32")), t)
    specs = _DYNAMIC((t.data.shape, t.dtype), f)
    o = args.outs(out, 3) if isinstance(out, tuple) else (out, None, None)
    names = ("out[0]", "out[1]", "out[2]")
    slots = [_slot(v, arg, spec, t) for v, arg, spec in zip(o, names, specs)]
    args.no_overlap(list(zip(names, slots)), [("x", t)])
    outs = [None if v is None else args.backend_data(v, spec.dtype) for v, spec in zip(slots, specs)]
    outs[0] = _dest(backend, specs[0], slots[0], t)
    results = backend.quantize_dynamic(t, f, *rule, out=tuple(outs))
    return tuple(given if given is not None else export(r, spec.dtype, t)  # type: ignore[return-value]
                 for given, r, spec in zip(o, results, specs))


def dequantize(q: Array, scale_inv: Array | float, out_dtype: Any = "float32", *,
               fmt: Format | str | None = None, out: Array | None = None) -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) * scale_inv)``; NaN comes out canonical.

    q: fp8 (or uint8 storage with ``fmt``). out_dtype: float32, bfloat16 or float16.
    out: optional result array (q's shape, out_dtype; bfloat16 may be uint16 storage), written and returned.
    """
    t, f = args.fp8(q, "q", fmt)
    name = args.out_dtype(out_dtype)
    s = args.scalar(scale_inv, t, "scale_inv", "q")
    backend = _BACKENDS.get(t.device) or _backend(t)
    if out is None:
        if t.device[0] == "cpu" and t.origin not in ALLOCATING:
            return export(backend.dequantize(t, f.encoding, s, name), name, t)
        y = args.result(backend, _DEQUANTIZE((t.data.shape, f.dtype_name), None, name)[0], t)
        return export(backend.dequantize(t, f.encoding, s, name, out=y), name, t)
    (spec,) = _DEQUANTIZE((t.data.shape, f.dtype_name), None, name)
    (o,) = args.outs(out, 1)
    ot = _slot(o, "out", spec, t, "q")
    args.no_overlap([("out", ot)], [("q", t), ("scale_inv", s)])
    y = backend.dequantize(t, f.encoding, s, name, out=_dest(backend, spec, ot, t))
    return o if o is not None else export(y, name, t)


def transpose(q: Array, *, fmt: Format | str | None = None, out: Array | None = None) -> Array:
    """``q_t[N, M]`` of fp8 ``q[M, N]`` (more dims are viewed as [prod(leading), last]), bits unchanged.

    out: optional [N, M] result array (q's fp8 dtype or uint8 storage), written and returned.
    """
    t, f = args.fp8(q, "q", fmt)
    t = args.as_2d(t, "q")
    backend = _BACKENDS.get(t.device) or _backend(t)
    if out is None:
        if t.device[0] == "cpu" and t.origin not in ALLOCATING:
            return export(backend.transpose(t), f.dtype_name, t)
        qt = args.result(backend, _TRANSPOSE((t.data.shape, f.dtype_name))[0], t)
        return export(backend.transpose(t, out=qt), f.dtype_name, t)
    (spec,) = _TRANSPOSE((t.data.shape, f.dtype_name))
    (o,) = args.outs(out, 1)
    ot = _slot(o, "out", spec, t, "q")
    args.no_overlap([("out", ot)], [("q", t)])
    qt = backend.transpose(t, out=_dest(backend, spec, ot, t))
    return o if o is not None else export(qt, spec.dtype, t)


def cast_transpose(x: Array, scale: Array | float, fmt: Format | str = Format.E4M3, *,
                   amax_out: Array | None = None,
                   out: tuple[Array | None, Array | None] | None = None) -> tuple[Array, Array]:
    """``(q, q_t)``: ``quantize(x, scale, fmt)`` and its transpose from one read of x.

    x: [M, N] (more dims are viewed as [prod(leading), last]); q has x's shape, q_t is [N, M].
    out: optional ``(q, q_t)`` result arrays (None for either to allocate), written and returned.
    """
    t = args.high_precision(x, "x")
    f = args.encoding(fmt)
    s, a = args.scalar(scale, t, "scale"), args.amax_slot(amax_out, t)
    t2 = args.as_2d(t, "x")
    backend = _BACKENDS.get(t.device) or _backend(t)
    if out is None and t.device[0] == "cpu" and t.origin not in ALLOCATING:  # one guarded call, no keyword
        q, qt = backend.cast_transpose(t2, s, f, a)
        return export_all(((q if q.shape == t.data.shape else q.reshape(t.data.shape), f.dtype_name),
                           (qt, f.dtype_name)), t)
    specs = _CAST_TRANSPOSE((t.data.shape, t.dtype), None, f)
    if out is None:
        q, qt = args.result(backend, specs[0], t), args.result(backend, specs[1], t)
        backend.cast_transpose(t2, s, f, a, out=(q.reshape(t2.shape), qt))
        return export_all(((q, specs[0].dtype), (qt, specs[1].dtype)), t)
    o = args.outs(out, 2)
    slots = [_slot(v, arg, spec, t) for v, arg, spec in zip(o, ("out[0]", "out[1]"), specs)]
    args.no_overlap([("out[0]", slots[0]), ("out[1]", slots[1])], [("x", t), ("scale", s), ("amax_out", a)])
    q, qt = (_dest(backend, spec, v, t) for v, spec in zip(slots, specs))
    backend.cast_transpose(t2, s, f, a, out=(q.reshape(t2.shape), qt))
    return (o[0] if o[0] is not None else export(q, specs[0].dtype, t),
            o[1] if o[1] is not None else export(qt, specs[1].dtype, t))


def compute_scale(amax: Array | float, fmt: Format | str, *, margin: int = 0, power_of_2: bool = False,
                  epsilon: float = 0.0, previous: Array | float | None = None) -> tuple[Array, Array]:
    """``(scale, scale_inv)`` from amax by the one scale rule of the contract, elementwise.

    Where there is no new scale (amax 0, inf or NaN after the epsilon floor) the result is ``previous``
    (delayed scaling) or 1.0 (current scaling, ``previous=None``). ``previous`` must hold finite scales > 0;
    it is checked when it is a number or host memory (a GPU array is not read back: that would synchronise).
    A 0-d amax gives [1] results, like every scale in fp8core; otherwise the results have amax's shape.
    """
    f = args.encoding(fmt)
    if isinstance(amax, (float, int)) and not isinstance(amax, bool):
        amax = args.host_f32([args.real(amax, "amax")])
    t = args.contiguous(wrap(amax, "amax"), "amax")
    if t.dtype != "float32":
        args.float32_name(t.dtype, "amax")
    if t.data.ndim == 0:
        t = Tensor(t.data.reshape(1), t.dtype, t.device, t.origin, t.readonly, t.place)
    m, p2, eps = args.margin(margin), args.flag(power_of_2, "power_of_2"), args.epsilon(epsilon)
    prev = None
    if previous is not None:
        if isinstance(previous, (float, int, np.floating, np.integer)) and not isinstance(previous, bool):
            host = args.host_f32([args.scale_value(previous, "previous")])
            if not args.scale_mask(host).all():  # 1e-46 is 0 in float32, 1e39 is inf: no scale either
                raise ValueError(f"previous: {previous!r} is {args.f32_text(host)} in float32; expected a finite "
                                 f"scale > 0")
            prev = args.new_f32(host, t, "previous")
        else:
            pt = args.f32_vector(previous, t, "previous", "amax")
            prev = pt.data
            if not pt.is_cuda:
                args.scale_values(prev, "previous")
        if prev.size not in (1, t.size):
            raise ValueError(f"previous: expected 1 or {t.size} elements, got {prev.size}")
    s, s_inv = _backend(t).compute_scale(t if t.is_cuda else t.data, f.max, m, p2, eps, prev)
    return export(s, "float32", t), export(s_inv, "float32", t)


def multi_amax(xs: Sequence[Array], out: Array | None = None) -> Array:
    """amax of each tensor of ``xs`` into ``out[i] = max(out[i], amax(xs[i]))`` (one launch per dtype on a GPU).

    ``out`` (float32 [len(xs)], e.g. row 0 of a ScalingState history) is created zeroed when omitted.
    """
    ts = [args.high_precision(x, f"xs[{i}]") for i, x in enumerate(args.array_sequence(xs))]
    for i, t in enumerate(ts[1:], 1):
        args.same_device(t, ts[0], f"xs[{i}]", "xs[0]")
    if out is None:
        data = args.new_f32(np.zeros(len(ts)), ts[0])
    else:
        data = args.f32_slots(out, ts[0], "out", "xs[0]", n=len(ts))
    _backend(ts[0]).multi_amax(ts, data)
    return out if out is not None else export(data, "float32", ts[0])


def multi_quantize(xs: Sequence[Array], scales: Array, fmts: Format | str | Sequence[Format | str], *,
                   amax_out: Array | None = None, out: Sequence[Array | None] | None = None) -> list[Array]:
    """Quantize every tensor of ``xs`` with ``scales[i]`` (float32 [len(xs)]) into ``fmts[i]``.

    ``amax_out`` (float32 [len(xs)]) accumulates each tensor's amax, like :func:`quantize` does.
    out: optional sequence of len(xs) result arrays (None for any to allocate), written and returned.
    """
    ts = [args.high_precision(x, f"xs[{i}]") for i, x in enumerate(args.array_sequence(xs))]
    n = len(ts)
    fl = [args.encoding(fmts)] * n if isinstance(fmts, (Format, str)) else [args.encoding(f) for f in fmts]
    if len(fl) != n:
        raise ValueError(f"fmts: expected {n} formats, got {len(fl)}")
    for i, t in enumerate(ts[1:], 1):
        args.same_device(t, ts[0], f"xs[{i}]", "xs[0]")
    sc = args.f32_vector(scales, ts[0], "scales", "xs[0]").data.reshape(-1)
    if sc.size != n:
        raise ValueError(f"scales: expected {n} elements, got {sc.size}")
    am = None if amax_out is None else args.f32_slots(amax_out, ts[0], "amax_out", "xs[0]", n=n)
    if out is None:
        qs = _backend(ts[0]).multi_quantize(
            ts, [sc[i:i + 1] for i in range(n)], fl, [None if am is None else am[i:i + 1] for i in range(n)])
        return [export(q, f.dtype_name, t) for q, f, t in zip(qs, fl, ts)]
    o = args.outs(tuple(out), n)
    slots = [None if v is None else args.out_slot(v, f"out[{i}]", t.shape, f.dtype_name, ts[0], "xs[0]")
             for i, (v, t, f) in enumerate(zip(o, ts, fl))]
    args.no_overlap([(f"out[{i}]", v) for i, v in enumerate(slots)],
                    [(f"xs[{i}]", t) for i, t in enumerate(ts)] + [("scales", sc), ("amax_out", am)])
    qs = _backend(ts[0]).multi_quantize(
        ts, [sc[i:i + 1] for i in range(n)], fl, [None if am is None else am[i:i + 1] for i in range(n)],
        outs=[args.backend_data(v, f.dtype_name) for v, f in zip(slots, fl)])
    return [given if given is not None else export(q, f.dtype_name, t) for given, q, f, t in zip(o, qs, fl, ts)]
