"""fp8core.jax's argument checks, made while ``jax.jit`` traces: on shapes, dtypes and Python values only, so
they hold eagerly and under an outer jit alike, and every error names the argument as the core's does.

The callbacks check again with the core's own functions, but an error raised there reaches the caller wrapped
in XLA's INTERNAL error, after the program was built: these checks make sure nothing the core would refuse
for its shape, dtype or value gets that far. A primitive's checks are its declaration's rule
(fp8core.declarations, :func:`check`), the functions the core runs, on the abstract values; what is here besides
is fp8core.jax's own (a scale as a Python number, batched GEMMs, the dense layers' state).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import args, declarations
from fp8core.args import as_format, check_update_shapes
from fp8core.declarations import PRIMITIVES
from fp8core.declare import Spec
from fp8core.formats import Format
from fp8core.layouts import BlockScaledTensor, Layout, MXTensor, ScaledTensor, layout_of

# the declared arguments that may also be a Python number (fp8core.jax converts it: see scale)
_SCALES = frozenset({"scale", "scale_inv", "a_scale_inv", "b_scale_inv"})


def _name(x: Any) -> str:
    return jnp.dtype(x.dtype).name


def array(x: Any, arg: str) -> Any:
    """A JAX or NumPy array (or a tracer of one): anything with a shape and a dtype."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, (str, bytes)):
        raise TypeError(f"{arg}: expected a JAX or NumPy array, got {type(x).__name__}")
    return x


def check(name: str, **inputs: Any) -> tuple[Spec, ...]:
    """Declaration ``name``'s rule on ``inputs`` (arrays or tracers; a scale may be a Python number, checked by
    :func:`scale`): the core's checks in the core's order, its errors, and the outputs' specs."""
    p = PRIMITIVES[name]
    for key, value in inputs.items():
        a = p.arg(key)
        if a.tensor and value is not None and not (key in _SCALES and not hasattr(value, "dtype")):
            array(value, a.label or key)
    return p.specs(**inputs)


def high_precision(x: Any, arg: str, matrix: bool = False) -> Any:
    """float32, bfloat16 or float16 data; ``matrix``: viewed as [rows, cols], so at least 1-D."""
    name = _name(array(x, arg))
    args.high_precision_name(name, arg)
    if matrix:
        declarations.matrix(Spec.of(x), arg)
    return x


fmt = args.fmt


def scale(value: Any, arg: str) -> Any:
    """A scale: a Python number (converted to float32 as the core converts it) or a 1-element float32 array.
    Strings, booleans and None are refused (the core's rule), not read as numbers."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{arg}: expected a 1-element float32 array or a Python number, got {type(value).__name__}")
    if isinstance(value, (int, float)):
        if isinstance(value, int):
            try:
                float(value)
            except OverflowError:
                raise ValueError(f"{arg}: {value.bit_length()}-bit int is too large for a float32 scale") from None
        return value
    array(value, arg)
    args.float32_name(_name(value), arg)
    args.one_element(tuple(value.shape), arg)
    return value


def out_dtype(value: Any, arg: str = "out_dtype") -> Any:
    """float32, bfloat16 or float16 (a dtype or its name)."""
    try:
        name = jnp.dtype(value).name if value is not None else None  # jnp.dtype(None) is float64
    except TypeError:
        name = None
    args.out_dtype(name if name is not None else value, arg)
    return value


def scaled(t: Any, kind: str, out_dtype: Any) -> Layout:
    """The layout of a ScaledTensor (or a plain (data, scale) pair) of ``kind`` ("mx" or "blocks") to dequantize
    to ``out_dtype``, by the dequantize declaration's rule: fp8 data, scales of the kind's dtype in a layout of it
    (the one named, else the one the scale's shape means)."""
    cls = {"mx": MXTensor, "blocks": BlockScaledTensor}[kind]
    if not isinstance(t, tuple) or len(t) != 2:
        raise TypeError(f"t: expected a {cls.__name__} (data, {cls._fields[1]}), got {type(t).__name__}")
    name = "dequantize_mxfp8" if kind == "mx" else "dequantize_blockwise"
    check(name, **dict(zip(("data", PRIMITIVES[name].args[1].name), t)), out_dtype=out_dtype)
    return layout_of(t if isinstance(t, ScaledTensor) else cls(*t))


def gemm(a: Any, b: Any, a_scale_inv: Any, b_scale_inv: Any, out_dtype: Any, bias: Any) -> None:
    """fp8core.gemm's rules for fp8 a [M, K] and b [N, K] (the gemm declaration's), or for a [..., M, K] and
    b [..., N, K] with the same leading (batch) dims, each batch element's GEMM by them."""
    if len(array(a, "a").shape) > 2 or len(array(b, "b").shape) > 2:
        for arg, x, dims in (("a", a, "[..., M, K]"), ("b", b, "[..., N, K]")):
            args.fp8_name(_name(x), arg)
            if len(x.shape) < 2:
                raise ValueError(f"{arg}: expected a {dims} array, got shape {tuple(x.shape)}")
        batch = tuple(a.shape[:-2])
        if tuple(b.shape[:-2]) != batch:
            raise ValueError(f"b: expected batch dims {batch} (a's leading dims, a {tuple(a.shape)}), got shape "
                             f"{tuple(b.shape)}")
        a, b = (Spec(tuple(x.shape[-2:]), _name(x)) for x in (a, b))
    check("gemm", a=a, b=b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, out_dtype=out_dtype, bias=bias)


def block_gemm_operands(a: Any, b: Any) -> tuple[Layout, Layout]:
    """The layouts of scaled GEMM operands, by the block_gemm declaration's rules: both MX (rowwise, K a
    multiple of 32) or both fp32 blocks (K a multiple of 128, not both 128x128)."""
    args.gemm_operands(a, b, None, None)  # both ScaledTensors of one kind: the core's rule
    # the declaration sees data and scale alone: a rowwise tensor's kind is its type's, so its layout is named
    named = [t._layout or (layout_of(t, arg) if t.kind == "axiswise" else None) for arg, t in (("a", a), ("b", b))]
    check("block_gemm", a=a[0], a_scale=a[1], b=b[0], b_scale=b[1], a_layout=named[0], b_layout=named[1],
          out_dtype=None)  # out_dtype: fp8core.jax's own rule, checked by the caller
    return layout_of(a, "a"), layout_of(b, "b")


def delayed(recipe: Any, arg: str = "recipe") -> fp8core.DelayedScaling:
    if not isinstance(recipe, fp8core.DelayedScaling):
        raise TypeError(f"{arg}: expected DelayedScaling (the delayed-scaling state and update), got "
                        f"{type(recipe).__name__}")
    return recipe  # its amax_history_len is bounded by DelayedScaling itself (fp8core.args.MAX_HISTORY_LEN)


def update_args(history: Any, scale_: Any, scale_inv: Any, recipe: Any, formats: Any,
                update_scale: Any) -> tuple[Format, ...]:
    """The functional update's arguments, by fp8core.scaling.check_update_args' rules: the formats, one per
    column of history."""
    delayed(recipe)
    args.flag(update_scale, "update_scale")
    h = (_name(array(history, "amax_history")), tuple(history.shape))
    n = check_update_shapes(h, [], "amax_history")
    for arg, v in (("scale", scale_), ("scale_inv", scale_inv)):  # one by one, in the core's order
        check_update_shapes(h, [(arg, _name(array(v, arg)), tuple(v.shape), "float32")], "amax_history")
    return format_list(formats, n)


def format_list(formats: Any, n: int, arg: str = "formats") -> tuple[Format, ...]:
    """One fp8 format per tensor: a list or tuple of n (one format is not broadcast)."""
    if isinstance(formats, (str, Format)) or not isinstance(formats, Sequence):
        raise TypeError(f"{arg}: expected a list or tuple of {n} formats (one per tensor), got "
                        f"{type(formats).__name__} {formats!r}")
    fl = tuple(as_format(f, arg=arg) for f in formats)
    if len(fl) != n:
        raise ValueError(f"{arg}: expected {n} formats (one per column of amax_history), got {len(fl)}")
    return fl


# The numbers that are data, by the core's rules; margin as an exact float (they travel as float64 bits)
NUMBER_RULES = {"margin": lambda v: float(args.margin(v)), "epsilon": args.epsilon}


def pack(values: tuple[float, ...]) -> np.ndarray:
    """Python floats as uint32 words of their float64 bits: a jit operand carrying them exactly, with or
    without jax_enable_x64."""
    return np.array(values, np.float64).view(np.uint32)


def unpack(words: Any) -> tuple[float, ...]:
    """The inverse of :func:`pack`, on the host copy of the operand (bits moved, no arithmetic)."""
    return tuple(float(v) for v in np.ascontiguousarray(words).view(np.float64))


def dense_recipe(recipe: Any, arg: str = "recipe") -> Any:
    """DelayedScaling, Float8CurrentScaling or Float8RowwiseScaling whose GEMMs exist (no E5M2 x E5M2);
    NVFP4BlockScaling goes its own way (fp8core.jax.fp4) before this check, and is named among what is taken."""
    if not isinstance(recipe, (fp8core.DelayedScaling, fp8core.Float8CurrentScaling, fp8core.Float8RowwiseScaling)):
        raise TypeError(f"{arg}: expected DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling or "
                        f"NVFP4BlockScaling, got "
                        f"{type(recipe).__name__}")
    args.gemm_recipe_format(recipe, arg)
    return recipe


def layer_state(state: Any, recipe: Any, arg: str = "state") -> None:
    """A dense layer's delayed-scaling state (init_state's): amax_history [amax_history_len, 3], scale [3],
    scale_inv [3], float32."""
    if not isinstance(recipe, fp8core.DelayedScaling):
        return
    if not isinstance(state, Mapping):
        raise TypeError(f"{arg}: expected the delayed-scaling state (a dict of amax_history, scale, scale_inv: "
                        f"fp8core.jax.init_state(recipe)), got {type(state).__name__}")
    L = recipe.amax_history_len
    for key, shape in (("amax_history", (L, 3)), ("scale", (3,)), ("scale_inv", (3,))):
        if key not in state:
            raise KeyError(f"{arg}: missing key {key!r} (expected amax_history, scale, scale_inv)")
        v = array(state[key], f"{arg}[{key!r}]")
        if _name(v) != "float32":
            raise TypeError(f"{arg}[{key!r}]: expected float32, got {_name(v)}")
        if tuple(v.shape) != shape:
            hint = (f" (amax_history_len {v.shape[0]} in the state, {L} in the recipe)"
                    if key == "amax_history" and len(v.shape) == 2 and v.shape[1:] == (3,) else "")
            raise ValueError(f"{arg}[{key!r}]: expected shape {shape}, got {tuple(v.shape)}{hint}")
