"""fp8core for JAX: the primitives callable inside ``jax.jit`` on CPU and GPU, through
``jax.experimental.buffer_callback`` (XLA's buffers and, on a GPU, XLA's stream; no host copy).

JAX arrays are immutable, so where the core accumulates into an amax slot these functions return the amax
instead; scales and amaxes are float32 [1] arrays. Under ``vmap`` the callbacks run once per batch element
(``vmap_method="sequential"``). Across devices, reduce amaxes with :func:`reduce_amax` inside ``shard_map``.

Placement is XLA's, eager calls included (each is a cached ``jax.jit``): the callback runs on the device the
computation runs on and writes XLA's buffers there, so results land where XLA puts them (x's device for a
committed x, or where ``in_shardings``/``out_shardings`` say), and XLA refuses arguments committed to two
devices with its own error.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import fp8core
from fp8core._tensor import Tensor, wrap
from fp8core.backends import for_device

from . import _direct

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose", "gemm",
           "compute_scale", "update", "reduce_amax"]

Array = jax.Array
_F32_1 = jax.ShapeDtypeStruct((1,), jnp.float32)
# Callbacks hand XLA's output buffers straight to the backend, without the public primitives' out= checks
# (bindings/jax/_direct.py says why they cannot fail there). False: through the public primitives.
TRUSTED_OUTS = True


def _raw(buf: Any) -> Tensor:
    """A core Tensor over an XLA buffer whose results come back as raw NumPy/CuPy arrays, not jax.Arrays."""
    t = wrap(buf)
    t.origin = "cupy" if t.is_cuda else "numpy"
    return t


def _out(buf: Any) -> Tensor:
    """An XLA output buffer as the core's ``out=``: JAX arrays are immutable, but this buffer is handed to the
    callback to be written."""
    t = _raw(buf)
    t.readonly = False
    return t


def _primitive(fn: Callable[..., None], shapes: Any) -> Callable[..., Any]:
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


def _zero(t: Tensor) -> Tensor:
    """An amax slot zeroed before the core accumulates into it (on a GPU, on XLA's stream: CuPy's current)."""
    t.data.fill(0)
    return t


def _f32(v: Any) -> Array:
    return jnp.asarray(v, jnp.float32).reshape(1)


def _scale_arg(v: Any) -> Any:
    """A scale as an argument of the jitted primitives, converted to float32 [1] inside them. A Python int
    beyond int32 would be refused by jit as an argument: it is converted here, as every scale was before."""
    if isinstance(v, (jax.Array, np.ndarray, float)) or (type(v) is int and -2**31 <= v < 2**31):
        return v
    return _f32(v)


def _jitted(*static: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The primitive traced once per shapes and ``static`` arguments (keyword-only in the decorated function):
    an eager call then reuses its trace, compiled program and callback (jit's C++ dispatch, ~10 us) instead of
    building all three again (~20 ms); inside an outer jit it inlines. Static values that cannot be hashed
    (arrays) take the untraced path, which treats them as before."""
    def wrap_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        jitted = jax.jit(fn, static_argnames=static)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                hash(tuple(kwargs.values()))
            except TypeError:
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        call.untraced = fn  # type: ignore[attr-defined]  (tests/test_jax_fastpaths.py compares the two)
        return call

    return wrap_fn


def _fp8_shape(x: Any, fmt: Any, shape: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else shape, fp8core.as_format(fmt).jax_dtype)


def _rows(x: Any) -> int:
    return int(np.prod(x.shape[:-1], dtype=np.int64)) if len(x.shape) > 1 else 1


def amax(x: Array) -> Array:
    """max |x| as float32 [1] (NaN propagates)."""
    return _amax(x)


@_jitted()
def _amax(x: Array) -> Array:
    return _primitive(lambda outs, t: fp8core.multi_amax([t], out=_zero(outs[0])), _F32_1)(x)


def quantize(x: Array, scale: Array | float, fmt: Any = "e4m3") -> tuple[Array, Array]:
    """(q, amax of x): the contract's scaled cast; q has x's shape and fmt's dtype."""
    return _quantize(x, _scale_arg(scale), fmt=fmt)


@_jitted("fmt")
def _quantize(x: Array, scale: Any, *, fmt: Any) -> tuple[Array, Array]:
    def run(outs, t, s):
        if TRUSTED_OUTS:
            return _direct.quantize((outs[0], _zero(outs[1])), t, s, fmt)
        fp8core.quantize(t, s.data, fmt, amax_out=_zero(outs[1]), out=outs[0])

    return _primitive(run, (_fp8_shape(x, fmt), _F32_1))(x, _f32(scale))


def quantize_dynamic(x: Array, fmt: Any = "e4m3", *, margin: int = 0, power_of_2: bool = False,
                     epsilon: float = 0.0) -> tuple[Array, Array, Array]:
    """Current scaling: (q, scale_inv [1], amax [1])."""
    return _quantize_dynamic(x, fmt=fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)


@_jitted("fmt", "margin", "power_of_2", "epsilon")
def _quantize_dynamic(x: Array, *, fmt: Any, margin: Any, power_of_2: Any, epsilon: Any) -> tuple[Array, ...]:
    def run(outs, t):
        if TRUSTED_OUTS:
            return _direct.quantize_dynamic(outs, t, fmt, margin, power_of_2, epsilon)
        fp8core.quantize_dynamic(t, fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon, out=tuple(outs))

    return _primitive(run, (_fp8_shape(x, fmt), _F32_1, _F32_1))(x)


def dequantize(q: Array, scale_inv: Array | float, out_dtype: Any = jnp.float32) -> Array:
    return _dequantize(q, _scale_arg(scale_inv), out_dtype=out_dtype)


@_jitted("out_dtype")
def _dequantize(q: Array, scale_inv: Any, *, out_dtype: Any) -> Array:
    fmt = fp8core.as_format(q.dtype)
    name = jnp.dtype(out_dtype).name

    def run(outs, t, s):
        if TRUSTED_OUTS:
            return _direct.dequantize(outs, t, s, name, fmt)
        fp8core.dequantize(t, s.data, name, fmt=fmt, out=outs[0])

    return _primitive(run, jax.ShapeDtypeStruct(q.shape, out_dtype))(q, _f32(scale_inv))


def transpose(q: Array) -> Array:
    """[prod(leading), last] -> [last, prod(leading)], bits unchanged."""
    return _transpose(q)


@_jitted()
def _transpose(q: Array) -> Array:
    fmt = fp8core.as_format(q.dtype)

    def run(outs, t):
        if TRUSTED_OUTS:
            return _direct.transpose(outs, t, fmt)
        fp8core.transpose(t, fmt=fmt, out=outs[0])

    return _primitive(run, _fp8_shape(q, fmt, (q.shape[-1], _rows(q))))(q)


def cast_transpose(x: Array, scale: Array | float, fmt: Any = "e4m3") -> tuple[Array, Array, Array]:
    """(q, q_t [last, prod(leading)], amax of x) from one read of x."""
    return _cast_transpose(x, _scale_arg(scale), fmt=fmt)


@_jitted("fmt")
def _cast_transpose(x: Array, scale: Any, *, fmt: Any) -> tuple[Array, Array, Array]:
    def run(outs, t, s):
        if TRUSTED_OUTS:
            return _direct.cast_transpose((outs[0], outs[1], _zero(outs[2])), t, s, fmt)
        fp8core.cast_transpose(t, s.data, fmt, amax_out=_zero(outs[2]), out=(outs[0], outs[1]))

    return _primitive(run, (_fp8_shape(x, fmt), _fp8_shape(x, fmt, (x.shape[-1], _rows(x))), _F32_1))(
        x, _f32(scale))


def gemm(a: Array, b: Array, a_scale_inv: Array | float, b_scale_inv: Array | float,
         out_dtype: Any = jnp.bfloat16, bias: Array | None = None) -> Array:
    """[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias), per fp8core.gemm's limits."""
    return _gemm(a, b, _scale_arg(a_scale_inv), _scale_arg(b_scale_inv), bias, out_dtype=out_dtype)


@_jitted("out_dtype")
def _gemm(a: Array, b: Array, a_scale_inv: Any, b_scale_inv: Any, bias: Array | None, *,
          out_dtype: Any) -> Array:
    fa, fb = fp8core.as_format(a.dtype), fp8core.as_format(b.dtype)
    name = jnp.dtype(out_dtype).name
    shape = jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype)

    def run(outs, ta, tb, sa, sb, tbias=None):
        fp8core.gemm(ta, tb, sa.data, sb.data, out_dtype=name, a_fmt=fa, b_fmt=fb, bias=tbias, out=outs[0])

    args = (a, b, _f32(a_scale_inv), _f32(b_scale_inv)) + (() if bias is None else (bias,))
    return _primitive(run, shape)(*args)


def update(amax_history: Array, scale: Array, scale_inv: Array, recipe: fp8core.DelayedScaling,
           formats: Sequence[Any], update_scale: bool = True) -> tuple[Array, Array, Array]:
    """The batched delayed-scaling update, functional: new (amax_history [L, N], scale [N], scale_inv [N]).
    Row 0 holds this step's amaxes (reduce them first with :func:`reduce_amax` when sharded)."""
    return _update(amax_history, scale, scale_inv, recipe=recipe, formats=tuple(formats), update_scale=update_scale)


@_jitted("recipe", "formats", "update_scale")
def _update(amax_history: Array, scale: Array, scale_inv: Array, *, recipe: Any, formats: Any,
            update_scale: Any) -> tuple[Array, Array, Array]:
    fp8_max = jnp.asarray([fp8core.as_format(f).max for f in formats], jnp.float32)

    def run(outs, h, s, si, fm):
        h2, s2, si2 = (o.data for o in outs)
        h2[...], s2[...], si2[...] = h.data, s.data, si.data  # the update works in place: on XLA's outputs
        for_device(h.device).update(h2, s2, si2, fm.data, int(recipe.margin), recipe.amax_compute_algo,
                                    recipe.power_of_2, float(recipe.epsilon), update_scale, None)

    shapes = (jax.ShapeDtypeStruct(amax_history.shape, jnp.float32), jax.ShapeDtypeStruct(scale.shape, jnp.float32),
              jax.ShapeDtypeStruct(scale_inv.shape, jnp.float32))
    return _primitive(run, shapes)(amax_history, scale, scale_inv, fp8_max)


def compute_scale(amax: Array, fmt: Any, *, margin: int = 0, power_of_2: bool = False,
                  epsilon: float = 0.0) -> tuple[Array, Array]:
    """(scale, scale_inv), float32 like amax, by the contract's scale rule (1.0 where there is no scale): with
    :func:`cast_transpose`, current scaling from an amax reduced across devices first."""
    return _compute_scale(amax, fmt=fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)


@_jitted("fmt", "margin", "power_of_2", "epsilon")
def _compute_scale(amax: Array, *, fmt: Any, margin: Any, power_of_2: Any, epsilon: Any) -> tuple[Array, Array]:
    def run(outs, a):
        for o, r in zip(outs, fp8core.compute_scale(a, fmt, margin=margin, power_of_2=power_of_2,
                                                    epsilon=epsilon)):
            o.data[...] = r  # [N] floats: no out= on the core's scale rule

    shape = jax.ShapeDtypeStruct(amax.shape, jnp.float32)
    return _primitive(run, (shape, shape))(amax)


def reduce_amax(amax: Array, axis_name: Any) -> Array:
    """MAX over the devices of ``axis_name`` (inside ``shard_map``/``pmap``): every device gets the same scales."""
    return jax.lax.pmax(amax, axis_name)


from .dense import dense, init_state, next_state  # noqa: E402  (dense is built on the primitives above)

__all__ += ["dense", "init_state", "next_state"]
from . import blocks  # noqa: E402,F401  (block scaling, fp8core.jax.blocks: MXFP8 and 1x128/128x128 under jit)


def __getattr__(name: str) -> Any:
    if name in ("Fp8DotGeneral", "Fp8Einsum", "fp8_dot_general"):  # flax is an optional extra: imported on first use
        from . import linen

        return getattr(linen, name)
    raise AttributeError(f"module 'fp8core.jax' has no attribute {name!r}")
