"""Block scaling for JAX, callable inside ``jax.jit``: MXFP8 and 1x128 / 128x128 blocks (fp8core.blocks).

Results are the core's scaled tensors of jax.Arrays: ``MXTensor(data, scale)`` with float8_e8m0fnu scales,
``BlockScaledTensor(data, scale_inv)`` with float32 scale inverses; both go into :func:`block_gemm`. Through
``jax.jit`` they travel as (data, scale) pairs, their layout read back from the scale's shape.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import args
from fp8core import blocks as core
from fp8core.boundary import Tensor
from fp8core.declarations import PRIMITIVES
from fp8core.layouts import BlockScaledTensor, Layout, MXTensor, RowwiseTensor, ScaledTensor

from . import _args
from .primitives import jitted, numbers_of, operands, primitive, shapes

__all__ = ["quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8", "quantize_blockwise",
           "dequantize_blockwise", "quantize_rowwise", "block_gemm"]

Array = jax.Array


def returning(fn: Callable[..., Any]) -> Callable[..., None]:
    """``fn(*ins) -> result or results`` as the ``fn(outs, *ins)`` that primitive takes: the block primitives
    have no ``out=``, so their results are copied byte for byte into XLA's buffers (on a GPU on XLA's stream,
    CuPy's current one inside the callback)."""
    def run(outs: list[Tensor], *ins: Tensor) -> None:
        results = fn(*ins)
        for out, result in zip(outs, results if isinstance(results, tuple) else (results,)):
            src = result.data if isinstance(result, Tensor) else result
            out.data.reshape(-1).view(np.uint8)[...] = src.reshape(-1).view(np.uint8)
    return run


def quantize_mxfp8(x: Array, fmt: Any = "e4m3", *, scale_mode: str = "rceil", columnwise: bool = False) -> MXTensor:
    """MXTensor(data in x's shape, E8M0 scale [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    _args.check("quantize_mxfp8", x=x, fmt=fmt, scale_mode=scale_mode, columnwise=columnwise)
    return _quantize_mxfp8(x, fmt=_args.fmt(fmt), scale_mode=scale_mode, columnwise=bool(columnwise))


@jitted("fmt", "scale_mode", "columnwise")
def _quantize_mxfp8(x: Array, *, fmt: Any, scale_mode: Any, columnwise: Any) -> MXTensor:
    args.scale_mode(scale_mode)
    named = dict(fmt=fmt, scale_mode=scale_mode, columnwise=columnwise)
    run = returning(lambda t: PRIMITIVES["quantize_mxfp8"].call(t, **named))
    return MXTensor(*primitive(run, shapes("quantize_mxfp8", x=x, **named))(x))


def quantize_mxfp8_both(x: Array, fmt: Any = "e4m3", *, scale_mode: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """(rowwise, columnwise) from one read of x."""
    _args.check("quantize_mxfp8_both", x=x, fmt=fmt, scale_mode=scale_mode)
    return _quantize_mxfp8_both(x, fmt=_args.fmt(fmt), scale_mode=scale_mode)


@jitted("fmt", "scale_mode")
def _quantize_mxfp8_both(x: Array, *, fmt: Any, scale_mode: Any) -> tuple[MXTensor, MXTensor]:
    args.scale_mode(scale_mode)
    run = returning(lambda t: PRIMITIVES["quantize_mxfp8_both"].call(t, fmt, scale_mode))
    q, s, qc, sc = primitive(run, shapes("quantize_mxfp8_both", x=x, fmt=fmt, scale_mode=scale_mode))(x)
    return MXTensor(q, s), MXTensor(qc, sc)


def dequantize_mxfp8(t: MXTensor, out_dtype: Any = jnp.float32) -> Array:
    """y = data · 2^(scale - 127) per block, in out_dtype (float32, bfloat16 or float16), data's shape."""
    _args.out_dtype(out_dtype)
    return _dequantize(tuple(t), out_dtype=out_dtype, layout=_args.scaled(t, "mx", out_dtype).value)


@jitted("out_dtype", "layout")
def _dequantize(t: tuple[Array, Array], *, out_dtype: Any, layout: str) -> Array:
    data, scale = t
    fmt = fp8core.as_format(data.dtype)
    run = returning(lambda q, s: core.dequantize_blocks(ScaledTensor(q, s, layout), jnp.dtype(out_dtype).name,
                                                         fmt=fmt))
    name = "dequantize_mxfp8" if Layout(layout).kind == "mx" else "dequantize_blockwise"
    (shape,) = shapes(name, data=data, **{PRIMITIVES[name].args[1].name: scale}, out_dtype=out_dtype)
    return primitive(run, shape)(data, scale)


def quantize_blockwise(x: Array, fmt: Any = "e4m3", *, block: Any = "1x128", power_of_2: bool = True,
                       epsilon: float = 0.0) -> BlockScaledTensor:
    """BlockScaledTensor(data in x's shape, float32 scale_inv [rows or ceil(rows/128), ceil(cols/128)]).
    epsilon is data (traced: one program for every value)."""
    _args.check("quantize_blockwise", x=x, fmt=fmt, block=block, power_of_2=power_of_2, epsilon=epsilon)
    return _quantize_blockwise(x, fmt=_args.fmt(fmt), block=tuple(block) if isinstance(block, list) else block,
                               power_of_2=bool(power_of_2), epsilon=epsilon)


@jitted("fmt", "block", "power_of_2", numbers=("epsilon",))
def _quantize_blockwise(x: Array, *, fmt: Any, block: Any, power_of_2: Any, numbers: Any,
                        host_numbers: Any) -> BlockScaledTensor:
    named = dict(fmt=fmt, block=block, power_of_2=power_of_2)

    def run(t, nums=None):
        (epsilon,) = numbers_of(nums, host_numbers)
        return PRIMITIVES["quantize_blockwise"].call(t, epsilon=epsilon, **named)

    out = shapes("quantize_blockwise", x=x, epsilon=0.0, **named)  # epsilon is data: no part of the shapes
    return BlockScaledTensor(*primitive(returning(run), out)(x, *operands(numbers)))


def quantize_rowwise(x: Array, fmt: Any = "e4m3", *, axis: int = -1, power_of_2: bool = True,
                     epsilon: float = 0.0) -> RowwiseTensor:
    """RowwiseTensor(data in x's shape, float32 scale_inv [rows, 1], or [1, cols] for axis=0), as
    :func:`fp8core.quantize_rowwise`. epsilon is data (traced: one program for every value)."""
    _args.check("quantize_rowwise", x=x, fmt=fmt, axis=axis, power_of_2=power_of_2, epsilon=epsilon)
    return _quantize_rowwise(x, fmt=_args.fmt(fmt), axis=axis, power_of_2=bool(power_of_2), epsilon=epsilon,
                             layout=args.axis_layout(axis).value)


@jitted("fmt", "axis", "power_of_2", "layout", numbers=("epsilon",))
def _quantize_rowwise(x: Array, *, fmt: Any, axis: Any, power_of_2: Any, layout: Any, numbers: Any,
                      host_numbers: Any) -> RowwiseTensor:
    named = dict(fmt=fmt, axis=axis, power_of_2=power_of_2)

    def run(t, nums=None):
        (epsilon,) = numbers_of(nums, host_numbers)
        return PRIMITIVES["quantize_rowwise"].call(t, epsilon=epsilon, **named)

    out = shapes("quantize_rowwise", x=x, epsilon=0.0, **named)  # epsilon is data: no part of the shapes
    return RowwiseTensor(*primitive(returning(run), out)(x, *operands(numbers)), Layout(layout))


def dequantize_blockwise(t: BlockScaledTensor, out_dtype: Any = jnp.float32) -> Array:
    """y = data · scale_inv[its block] in out_dtype (float32, bfloat16 or float16), data's shape."""
    _args.out_dtype(out_dtype)
    return _dequantize(tuple(t), out_dtype=out_dtype, layout=_args.scaled(t, "blocks", out_dtype).value)


def block_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: Any = jnp.bfloat16) -> Array:
    """[M, N] = sum over K-blocks of the block-scaled products, as :func:`fp8core.gemm` with scaled operands."""
    la, lb = _args.block_gemm_operands(a, b)
    return _block_gemm(tuple(a), tuple(b), out_dtype=_args.out_dtype(out_dtype), layouts=(la.value, lb.value))


@jitted("out_dtype", "layouts")
def _block_gemm(a: tuple[Array, Array], b: tuple[Array, Array], *, out_dtype: Any, layouts: tuple[str, str]) -> Array:
    fa, fb = fp8core.as_format(a[0].dtype), fp8core.as_format(b[0].dtype)
    name = jnp.dtype(out_dtype).name
    run = returning(lambda ad, asc, bd, bsc: fp8core.gemm(ScaledTensor(ad, asc, layouts[0]),
                                                           ScaledTensor(bd, bsc, layouts[1]), out_dtype=name,
                                                           a_fmt=fa, b_fmt=fb))
    (shape,) = shapes("block_gemm", a=a[0], a_scale=a[1], b=b[0], b_scale=b[1], a_layout=layouts[0],
                      b_layout=layouts[1], out_dtype=out_dtype)
    return primitive(run, shape)(a[0], a[1], b[0], b[1])
