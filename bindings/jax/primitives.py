"""The primitives of fp8core.jax: each a cached ``jax.jit`` around one ``buffer_callback`` into the core."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import fp8core
from fp8core.backends import for_device
from fp8core.boundary import Tensor, ieee, wrap
from fp8core.declarations import PRIMITIVES

from . import _args

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose", "gemm",
           "compute_scale", "update", "reduce_amax"]

Array = jax.Array


def _raw(buf: Any) -> Tensor:
    """A core Tensor over an XLA buffer whose results come back as raw NumPy/CuPy arrays, not jax.Arrays (the
    origin also picks the caller: NumPy's or CuPy's allocator, CuPy's current stream, which the callback sets to
    XLA's)."""
    t = wrap(buf)
    t.origin = "cupy" if t.is_cuda else "numpy"
    return t


def _out(buf: Any) -> Tensor:
    """An XLA output buffer as the core's ``out=``: JAX arrays are immutable, but this buffer is handed to the
    callback to be written."""
    t = _raw(buf)
    t.readonly = False
    return t


def primitive(fn: Callable[..., None], shapes: Any) -> Callable[..., Any]:
    """``fn(outs, *ins)``, writing XLA's output buffers in place (core Tensors), as a jit-able JAX function."""
    single = not isinstance(shapes, (tuple, list))

    def callback(ctx: Any, out: Any, *bufs: Any) -> None:
        ins = [_raw(b) for b in bufs]
        outs = [_out(o) for o in ([out] if single else out)]
        if ins[0].is_cuda:
            import cupy

            from fp8core.backends.cuda import launch_stream

            with launch_stream(ctx.stream), cupy.cuda.ExternalStream(ctx.stream, ins[0].device[1]):
                fn(outs, *ins)
        else:
            fn(outs, *ins)

    return buffer_callback(callback, shapes, vmap_method="sequential")


def _zero(t: Tensor) -> Any:
    """An amax slot's array, zeroed before the core accumulates into it (on a GPU, on XLA's stream: CuPy's
    current)."""
    t.data.fill(0)
    return t.data


def _f32(v: Any) -> Array:
    return jnp.asarray(v, jnp.float32).reshape(1)


def _scale_arg(v: Any, arg: str = "scale") -> Any:
    """A scale as an argument of the jitted primitives, checked (see _args.scale) and converted to float32 [1]
    inside them. A Python int beyond int32 would be refused by jit as an argument: it is converted here, as
    every scale was before."""
    v = _args.scale(v, arg)
    if not isinstance(v, int) or -2**31 <= v < 2**31:
        return v
    return _f32(float(v))


@functools.cache
def numbers_static() -> bool:
    """Whether margin and epsilon are static (one program per value) rather than traced: on a machine with a
    GPU. The CUDA kernels take them by value at launch, and a traced operand lives in device memory, where
    reading it from the callback would make the host wait for XLA's stream; on the CPU the callback reads the
    operand in place, at no cost."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def jitted(*static: str, numbers: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The primitive traced once per shapes and ``static`` arguments (keyword-only in the decorated function):
    an eager call then reuses its trace, compiled program and callback (jit's C++ dispatch) instead of building
    all three again (milliseconds); inside an outer jit it inlines. Static values that cannot be hashed
    (arrays) take the untraced path, which treats them as before.

    ``numbers`` (margin, epsilon): data, not program. They are checked by the core's rules here and reach the
    decorated function as ``numbers``, a uint32 operand holding their float64 bits (one program for every
    value), or, where they must stay static (:func:`numbers_static`), as ``host_numbers`` (``numbers`` None);
    the callback gets ``operands(numbers)`` and reads them back with :func:`numbers_of`."""
    def wrap_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        jitted = jax.jit(fn, static_argnames=static + (("host_numbers",) if numbers else ()))

        def pack(kwargs: dict[str, Any]) -> dict[str, Any]:
            if numbers:
                values = tuple(_args.NUMBER_RULES[name](kwargs.pop(name)) for name in numbers)
                static = numbers_static()
                kwargs["numbers"] = None if static else _args.pack(values)
                kwargs["host_numbers"] = values if static else None
            return kwargs

        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs = pack(dict(kwargs))
            try:
                hash(tuple(v for k, v in kwargs.items() if k != "numbers"))
            except TypeError:
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        call.untraced = lambda *args, **kwargs: fn(*args, **pack(dict(kwargs)))  # type: ignore[attr-defined]
        call.jitted = jitted  # type: ignore[attr-defined]  (tests count its compiled programs)
        return call

    return wrap_fn


def operands(numbers: Any) -> tuple[Any, ...]:
    return () if numbers is None else (numbers,)


def numbers_of(buf: Tensor | None, host: tuple[float, ...] | None) -> tuple[float, ...]:
    """The callback's numbers: the static values where there are some, else the operand's (host memory: there
    is an operand only where numbers_static() is false, on a machine without a GPU)."""
    return host if host is not None else _args.unpack(buf.data)


def shapes(name: str, slots: bool = True, **inputs: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    """XLA's output buffers for primitive ``name``: its declared outputs (fp8core.declarations), then (``slots``)
    the ones it accumulates into, which a JAX primitive returns."""
    p = PRIMITIVES[name]
    specs = p.functional(**inputs) if slots else p.specs(**inputs)
    return tuple(jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in specs)


def amax(x: Array) -> Array:
    """max |x| as float32 [1] (NaN propagates)."""
    _args.check("amax", x=x)
    return _amax(x)


@jitted()
def _amax(x: Array) -> Array:
    return primitive(lambda outs, t: fp8core.multi_amax([t], out=_zero(outs[0])), shapes("amax", x=x)[0])(x)


def quantize(x: Array, scale: Array | float, fmt: Any = "e4m3") -> tuple[Array, Array]:
    """(q, amax of x): the contract's scaled cast; q has x's shape and fmt's dtype."""
    _args.check("quantize", x=x, scale=scale, fmt=fmt)
    return _quantize(x, _scale_arg(scale), fmt=_args.fmt(fmt))


@jitted("fmt")
def _quantize(x: Array, scale: Any, *, fmt: Any) -> tuple[Array, Array]:
    def run(outs, t, s):
        fp8core.quantize(t, s.data, fmt, amax_out=_zero(outs[1]), out=outs[0])

    scale = _f32(scale)
    return primitive(run, shapes("quantize", x=x, scale=scale, fmt=fmt))(x, scale)


def quantize_dynamic(x: Array, fmt: Any = "e4m3", *, margin: int = 0, power_of_2: bool = False,
                     epsilon: float = 0.0) -> tuple[Array, Array, Array]:
    """Current scaling: (q, scale_inv [1], amax [1]). margin and epsilon are data (traced: one program for
    every value), power_of_2 a bool."""
    _args.check("quantize_dynamic", x=x, fmt=fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)
    return _quantize_dynamic(x, fmt=_args.fmt(fmt), margin=margin, power_of_2=bool(power_of_2), epsilon=epsilon)


@jitted("fmt", "power_of_2", numbers=("margin", "epsilon"))
def _quantize_dynamic(x: Array, *, fmt: Any, power_of_2: Any, numbers: Any,
                      host_numbers: Any) -> tuple[Array, ...]:
    def run(outs, t, nums=None):
        m, epsilon = numbers_of(nums, host_numbers)
        fp8core.quantize_dynamic(t, fmt, margin=int(m), power_of_2=power_of_2, epsilon=epsilon, out=tuple(outs))

    return primitive(run, shapes("quantize_dynamic", x=x, fmt=fmt))(x, *operands(numbers))


def dequantize(q: Array, scale_inv: Array | float, out_dtype: Any = jnp.float32) -> Array:
    """y = q · scale_inv in out_dtype (float32, bfloat16 or float16), q's shape; q fp8."""
    _args.out_dtype(out_dtype)
    _args.check("dequantize", q=q, scale_inv=scale_inv, out_dtype=out_dtype)
    return _dequantize(q, _scale_arg(scale_inv, "scale_inv"), out_dtype=out_dtype)


@jitted("out_dtype")
def _dequantize(q: Array, scale_inv: Any, *, out_dtype: Any) -> Array:
    fmt = fp8core.as_format(q.dtype)
    name = jnp.dtype(out_dtype).name

    def run(outs, t, s):
        fp8core.dequantize(t, s.data, name, fmt=fmt, out=outs[0])

    scale_inv = _f32(scale_inv)
    return primitive(run, shapes("dequantize", q=q, scale_inv=scale_inv, out_dtype=out_dtype)[0])(q, scale_inv)


def transpose(q: Array) -> Array:
    """[prod(leading), last] -> [last, prod(leading)], bits unchanged."""
    _args.check("transpose", q=q)
    return _transpose(q)


@jitted()
def _transpose(q: Array) -> Array:
    fmt = fp8core.as_format(q.dtype)

    def run(outs, t):
        fp8core.transpose(t, fmt=fmt, out=outs[0])

    return primitive(run, shapes("transpose", q=q)[0])(q)


def cast_transpose(x: Array, scale: Array | float, fmt: Any = "e4m3") -> tuple[Array, Array, Array]:
    """(q, q_t [last, prod(leading)], amax of x) from one read of x."""
    _args.check("cast_transpose", x=x, scale=scale, fmt=fmt)
    return _cast_transpose(x, _scale_arg(scale), fmt=_args.fmt(fmt))


@jitted("fmt")
def _cast_transpose(x: Array, scale: Any, *, fmt: Any) -> tuple[Array, Array, Array]:
    def run(outs, t, s):
        fp8core.cast_transpose(t, s.data, fmt, amax_out=_zero(outs[2]), out=(outs[0], outs[1]))

    scale = _f32(scale)
    return primitive(run, shapes("cast_transpose", x=x, scale=scale, fmt=fmt))(x, scale)


def gemm(a: Array, b: Array, a_scale_inv: Array | float, b_scale_inv: Array | float,
         out_dtype: Any = jnp.bfloat16, bias: Array | None = None) -> Array:
    """[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias), per fp8core.gemm's limits;
    out_dtype float32, bfloat16 or float16; bias [N] bfloat16 (float16 for a float16 output).

    Batched: a [..., M, K] and b [..., N, K] with the same leading dims give [..., M, N], each batch element
    the GEMM above with the same two scales (and bias), in one primitive (its callback runs the core's GEMM
    per element, on XLA's stream on a GPU)."""
    _args.out_dtype(out_dtype)
    _args.gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)
    run = _batched_gemm if len(a.shape) > 2 or len(b.shape) > 2 else _gemm
    return run(a, b, _scale_arg(a_scale_inv, "a_scale_inv"), _scale_arg(b_scale_inv, "b_scale_inv"), bias,
               out_dtype=out_dtype)


@jitted("out_dtype")
def _gemm(a: Array, b: Array, a_scale_inv: Any, b_scale_inv: Any, bias: Array | None, *,
          out_dtype: Any) -> Array:
    fa, fb = fp8core.as_format(a.dtype), fp8core.as_format(b.dtype)
    name = jnp.dtype(out_dtype).name

    def run(outs, ta, tb, sa, sb, tbias=None):
        fp8core.gemm(ta, tb, sa.data, sb.data, out_dtype=name, a_fmt=fa, b_fmt=fb, bias=tbias, out=outs[0])

    args = (a, b, _f32(a_scale_inv), _f32(b_scale_inv)) + (() if bias is None else (bias,))
    return primitive(run, _gemm_shape(*args[:4], out_dtype))(*args)


def _gemm_shape(a: Any, b: Any, a_scale_inv: Any, b_scale_inv: Any, out_dtype: Any) -> jax.ShapeDtypeStruct:
    return shapes("gemm", False, a=a, b=b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, out_dtype=out_dtype)[0]


def _elements(t: Tensor) -> list[Tensor]:
    """The views t[i] along the first dim (each contiguous: t is XLA's row-major buffer)."""
    return [Tensor(t.data[i], t.dtype, t.device, t.origin, t.readonly, t.place) for i in range(t.shape[0])]


@jitted("out_dtype")
def _batched_gemm(a: Array, b: Array, a_scale_inv: Any, b_scale_inv: Any, bias: Array | None, *,
                  out_dtype: Any) -> Array:
    fa, fb = fp8core.as_format(a.dtype), fp8core.as_format(b.dtype)
    name = jnp.dtype(out_dtype).name
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-2]
    count = int(np.prod(batch, dtype=np.int64))

    # One callback for the whole batch: the per-element loop costs a core call each, not a callback each
    def run(outs, ta, tb, sa, sb, tbias=None):
        for ai, bi, oi in zip(_elements(ta), _elements(tb), _elements(outs[0])):
            fp8core.gemm(ai, bi, sa.data, sb.data, out_dtype=name, a_fmt=fa, b_fmt=fb, bias=tbias, out=oi)

    args = (a.reshape(count, m, k), b.reshape(count, n, k), _f32(a_scale_inv), _f32(b_scale_inv)) + \
        (() if bias is None else (bias,))
    each = _gemm_shape(jax.ShapeDtypeStruct((m, k), a.dtype), jax.ShapeDtypeStruct((n, k), b.dtype), args[2],
                       args[3], out_dtype)
    return primitive(run, jax.ShapeDtypeStruct((count, *each.shape), each.dtype))(*args).reshape(*batch, m, n)


def update(amax_history: Array, scale: Array, scale_inv: Array, recipe: fp8core.DelayedScaling,
           formats: Sequence[Any], update_scale: bool = True) -> tuple[Array, Array, Array]:
    """The batched delayed-scaling update, functional: new (amax_history [L, N], scale [N], scale_inv [N]).
    Row 0 holds this step's amaxes (reduce them first with :func:`reduce_amax` when sharded). formats: one per
    tensor (N). The result is fp8core.ScalingState.update's for the same recipe, callable
    ``amax_compute_algo`` / ``scaling_factor_compute_algo`` included: those run in the callback on the state's
    NumPy (CPU) or CuPy (GPU) arrays, as in ScalingState, with its checks (which read results on the host)."""
    fl = _args.update_args(amax_history, scale, scale_inv, recipe, formats, update_scale)
    return _update(amax_history, scale, scale_inv, recipe=recipe, formats=fl, update_scale=update_scale)


@ieee  # XLA:CPU calls back with FTZ/DAZ set: the callables and ScalingState's checks see subnormals as it does
def _callable_update(recipe: fp8core.DelayedScaling, formats: tuple[Any, ...], update_scale: bool,
                     h: Tensor, s: Tensor, si: Tensor, outs: Sequence[Tensor]) -> None:
    """A recipe with a callable algorithm: ScalingState.update itself, on a state of our own (the callables
    see what they see there). ``update_scale`` is ScalingState's ``steps % interval == 0``; where the recipe
    updates every step, a copy with interval 2 skips the scale (the callables then do not run)."""
    if not update_scale and recipe.interval == 1:
        recipe = dataclasses.replace(recipe, interval=2)
    device = "cpu" if not h.is_cuda else f"cuda:{h.device[1]}"
    state = fp8core.ScalingState(len(formats), recipe, list(formats), device=device)
    state.amax_history[...], state.scale[...], state.scale_inv[...] = h.data, s.data, si.data
    state.steps = 0 if update_scale else 1
    state.update()
    for o, r in zip(outs, (state.amax_history, state.scale, state.scale_inv)):
        o.data[...] = r


@jitted("recipe", "formats", "update_scale")
def _update(amax_history: Array, scale: Array, scale_inv: Array, *, recipe: Any, formats: Any,
            update_scale: Any) -> tuple[Array, Array, Array]:
    fp8_max = jnp.asarray([f.max for f in formats], jnp.float32)
    by_callable = callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None

    def run(outs, h, s, si, fm):
        if by_callable:
            return _callable_update(recipe, formats, update_scale, h, s, si, outs)
        h2, s2, si2 = (o.data for o in outs)
        h2[...], s2[...], si2[...] = h.data, s.data, si.data  # the update works in place: on XLA's outputs
        for_device(h.device).update(h2, s2, si2, fm.data, int(recipe.margin), recipe.amax_compute_algo,
                                    recipe.power_of_2, float(recipe.epsilon), update_scale, None)

    shapes = (jax.ShapeDtypeStruct(amax_history.shape, jnp.float32), jax.ShapeDtypeStruct(scale.shape, jnp.float32),
              jax.ShapeDtypeStruct(scale_inv.shape, jnp.float32))
    return primitive(run, shapes)(amax_history, scale, scale_inv, fp8_max)


def compute_scale(amax: Array, fmt: Any, *, margin: int = 0, power_of_2: bool = False,
                  epsilon: float = 0.0) -> tuple[Array, Array]:
    """(scale, scale_inv), float32 like amax ([1] for a 0-d amax, as the core), by the contract's scale rule
    (1.0 where there is no scale): with :func:`cast_transpose`, current scaling from an amax reduced across
    devices first. margin and epsilon are data (traced)."""
    _args.check("compute_scale", amax=amax, fmt=fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)
    return _compute_scale(amax, fmt=_args.fmt(fmt), margin=margin, power_of_2=bool(power_of_2), epsilon=epsilon)


@jitted("fmt", "power_of_2", numbers=("margin", "epsilon"))
def _compute_scale(amax: Array, *, fmt: Any, power_of_2: Any, numbers: Any, host_numbers: Any
                   ) -> tuple[Array, Array]:
    def run(outs, a, nums=None):
        m, epsilon = numbers_of(nums, host_numbers)
        for o, r in zip(outs, fp8core.compute_scale(a, fmt, margin=int(m), power_of_2=power_of_2,
                                                    epsilon=epsilon)):
            o.data[...] = r.reshape(o.data.shape)  # [N] floats: no out= on the core's scale rule

    return primitive(run, shapes("compute_scale", amax=amax, fmt=fmt))(amax, *operands(numbers))


def reduce_amax(amax: Array, axis_name: Any) -> Array:
    """MAX over the devices of ``axis_name`` (inside ``shard_map``/``pmap``): every device gets the same scales."""
    return jax.lax.pmax(amax, axis_name)
