"""fp8core.jax's argument checks, made while ``jax.jit`` traces: on shapes, dtypes and Python values only, so
they hold eagerly and under an outer jit alike, and every error names the argument as the core's does.

The callbacks check again with the core's own functions, but an error raised there reaches the caller wrapped
in XLA's INTERNAL error, after the program was built: these checks make sure nothing the core would refuse
for its shape, dtype or value gets that far. The rules are the core's (fp8core.args, fp8core.blocks'
layouts); where the core has a rule only inside a function that takes real arrays, it is restated here and
the message is the core's.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import args
from fp8core.args import as_format
from fp8core.blocks import gemm_layouts, scale_dtypes
from fp8core.blocks import gemm_operands as split_block_operands
from fp8core.formats import Format
from fp8core.gemm import check_bias, check_shapes
from fp8core.layouts import BlockScaledTensor, Layout, MXTensor, ScaledTensor, layout_of
from fp8core.scaling import check_update_shapes


def _name(x: Any) -> str:
    return jnp.dtype(x.dtype).name


def array(x: Any, arg: str) -> Any:
    """A JAX or NumPy array (or a tracer of one): anything with a shape and a dtype."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, (str, bytes)):
        raise TypeError(f"{arg}: expected a JAX or NumPy array, got {type(x).__name__}")
    return x


def high_precision(x: Any, arg: str, matrix: bool = False) -> Any:
    """float32, bfloat16 or float16 data; ``matrix``: viewed as [rows, cols], so at least 1-D."""
    name = _name(array(x, arg))
    args.high_precision_name(name, arg)
    if matrix:
        at_least_1d(x, arg)
    return x


fmt = args.fmt


def at_least_1d(x: Any, arg: str) -> None:
    if len(x.shape) == 0:
        raise ValueError(f"{arg}: expected at least 1 dimension, got a scalar")


def fp8(q: Any, arg: str, matrix: bool = False) -> Format:
    """fp8 data (float8_e4m3fn or float8_e5m2; JAX has the dtypes, so no uint8 storage): its format."""
    name = _name(array(q, arg))
    args.fp8_name(name, arg)
    if matrix:
        at_least_1d(q, arg)
    return as_format(name)


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
    name = _name(value)
    if name != "float32":
        raise TypeError(f"{arg}: expected float32, got {name}")
    if math.prod(value.shape) != 1:
        raise ValueError(f"{arg}: expected 1 element, got shape {tuple(value.shape)}")
    return value


def out_dtype(value: Any, arg: str = "out_dtype") -> Any:
    """float32, bfloat16 or float16 (a dtype or its name)."""
    try:
        name = jnp.dtype(value).name if value is not None else None  # jnp.dtype(None) is float64
    except TypeError:
        name = None
    args.out_dtype(name if name is not None else value, arg)
    return value


def scaled(t: Any, kind: str | None, arg: str = "t") -> tuple[Format, Layout]:
    """(format, layout) of a ScaledTensor (or a plain (data, scale) pair of ``kind``, "mx" or "blocks"): fp8
    data, scales of the kind's dtype in a layout of it (the one named, else the one the scale's shape means)."""
    cls = {"mx": MXTensor, "blocks": BlockScaledTensor}[kind] if kind else type(t)
    if not isinstance(t, tuple) or len(t) != 2:
        raise TypeError(f"{arg}: expected a {cls.__name__} (data, {cls._fields[1]}), got {type(t).__name__}")
    data, s = t
    f = fp8(data, f"{arg}.data", matrix=True)
    name, dtypes = f"{arg}.{cls._fields[1]}", scale_dtypes(kind or t.kind)
    got = _name(array(s, name))
    if got not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(dtypes)}, got {got}")
    return f, layout_of(t if isinstance(t, ScaledTensor) else cls(data, s), arg)


def gemm_operands(a: Any, b: Any) -> tuple[Format, Format, int, int]:
    """(a's format, b's format, K, N) of fp8 a [M, K] and b [N, K], by cuBLASLt's FP8 limits (fp8core.gemm)."""
    fa, fb = fp8(a, "a"), fp8(b, "b")
    _, k, n = check_shapes(tuple(a.shape), tuple(b.shape), fa, fb)
    return fa, fb, k, n


def batched_gemm_operands(a: Any, b: Any) -> tuple[tuple[int, ...], int]:
    """(the batch shape, N) of fp8 a [..., M, K] and b [..., N, K] with the same leading (batch) dims, each
    batch element's GEMM by cuBLASLt's FP8 limits (fp8core.gemm)."""
    fa, fb = fp8(a, "a"), fp8(b, "b")
    for arg, x, dims in (("a", a, "[..., M, K]"), ("b", b, "[..., N, K]")):
        if len(x.shape) < 2:
            raise ValueError(f"{arg}: expected a {dims} array, got shape {tuple(x.shape)}")
    batch = tuple(a.shape[:-2])
    if tuple(b.shape[:-2]) != batch:
        raise ValueError(f"b: expected batch dims {batch} (a's leading dims, a {tuple(a.shape)}), got shape "
                         f"{tuple(b.shape)}")
    _, _, n = check_shapes(tuple(a.shape[-2:]), tuple(b.shape[-2:]), fa, fb)
    return batch, n


def bias(b: Any, n: int, out_name: str) -> None:
    if b is not None:
        check_bias(_name(array(b, "bias")), tuple(b.shape), n, out_name)


def block_gemm_operands(a: Any, b: Any) -> tuple[Layout, Layout]:
    """The layouts of scaled GEMM operands, by fp8core.blocks' rules: both MX (rowwise, K a multiple of 32) or
    both fp32 blocks (K a multiple of 128, not both 128x128)."""
    split_block_operands(a, b, None, None)  # both ScaledTensors of one kind: the core's rule
    _, _, k, n = gemm_operands(a[0], b[0])
    la, lb = scaled(a, None, "a")[1], scaled(b, None, "b")[1]
    gemm_layouts(la, lb, a[0].shape[0], n, k)
    return la, lb


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
