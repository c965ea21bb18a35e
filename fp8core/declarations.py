"""Every primitive the front-ends expose, declared once (:mod:`fp8core.declare`): its arguments, the shapes and
dtypes of its outputs, its call into the core. fp8core.torch makes each a custom op with its fake, fp8core.jax
takes its output shapes from here, and selftest lists them; the numerics are the core's (docs/numerics.md).

Formats are names ("e4m3", "e5m2"), layouts their names ("1x32", "128x128"); scales and amax slots float32 [1].

A new primitive is a row here (its arguments, its rule, ``call=`` the core function, ``backend=`` what it reaches),
then ``custom_ops(PRIMITIVES[name])`` in fp8core.torch and ``primitive(run, shapes(name, ...))`` in fp8core.jax.
"""

from __future__ import annotations

import math
from typing import Any

from . import args, blocks, formats, fp4, ops, rowwise, scaling
from .declare import Arg, Primitive, Spec, declare
from .args import as_format
from .gemm import check_shapes, gemm
from .layouts import BlockScaledTensor, Layout, MXFP4Tensor, MXTensor, NVFP4Tensor, ScaledTensor, layout_of

__all__ = ["PRIMITIVES", "matrix", "check_rng"]

F32_1 = Spec((1,), "float32")
_AMAX_OUT = Arg("amax_out", "Tensor?", None, mutated=True, slot=F32_1)
_RULE = (Arg("margin", "int", 0), Arg("power_of_2", "bool", False), Arg("epsilon", "float", 0.0))


def matrix(x: Spec, arg: str) -> tuple[int, int]:
    """[rows, cols]: the 2-D view [prod(leading), last] the core folds x to (at least 1 dimension)."""
    if len(x.shape) == 0:
        raise ValueError(f"{arg}: expected at least 1 dimension, got a scalar")
    return math.prod(x.shape[:-1]), x.shape[-1]


def _fp8(x: Spec, fmt: Any, shape: tuple | None = None) -> Spec:
    return Spec(x.shape if shape is None else shape, as_format(fmt).dtype_name)


# ---- per-tensor scaling (fp8core.ops, fp8core.scaling) ------------------------------------------------------

@declare("amax", (Arg("x"),), returns=1, call=ops.amax, backend=("multi_amax", "amax"))
def _amax(x: Spec) -> tuple[Spec, ...]:
    """max |x| as float32 [1]."""
    return (F32_1,)


@declare("quantize", (Arg("x"), Arg("scale"), Arg("fmt", "str"), _AMAX_OUT), returns=1, backend=("quantize",),
         call=ops.quantize)
def _quantize(x: Spec, scale: Spec, fmt: str) -> tuple[Spec, ...]:
    """SATFINITE_RTNE(fp32(x) * scale) in fmt; amax_out (float32 [1]) accumulates max |x| in place."""
    return (_fp8(x, fmt),)


@declare("quantize_dynamic", (Arg("x"), Arg("fmt", "str"), *_RULE), returns=3, backend=("quantize_dynamic",),
         call=ops.quantize_dynamic)
def _quantize_dynamic(x: Spec, fmt: str, margin: int = 0, power_of_2: bool = False,
                      epsilon: float = 0.0) -> tuple[Spec, ...]:
    """Current scaling: (q, scale_inv [1], amax [1])."""
    return _fp8(x, fmt), F32_1, F32_1


@declare("dequantize", (Arg("q"), Arg("scale_inv"), Arg("out_dtype", "dtype")), returns=1,
         call=ops.dequantize, backend=("dequantize",))
def _dequantize(q: Spec, scale_inv: Spec, out_dtype: str) -> tuple[Spec, ...]:
    """q · scale_inv in out_dtype, q's shape."""
    return (Spec(q.shape, out_dtype),)


@declare("transpose", (Arg("q"),), returns=1, call=ops.transpose, backend=("transpose",))
def _transpose(q: Spec) -> tuple[Spec, ...]:
    """[prod(leading), last] -> [last, prod(leading)], bits unchanged."""
    rows, cols = matrix(q, "q")
    return (Spec((cols, rows), q.dtype),)


@declare("cast_transpose", (Arg("x"), Arg("scale"), Arg("fmt", "str"), _AMAX_OUT), returns=2,
         backend=("cast_transpose",), call=ops.cast_transpose)
def _cast_transpose(x: Spec, scale: Spec, fmt: str) -> tuple[Spec, ...]:
    """(quantize(x), its [last, prod(leading)] transpose) from one read of x."""
    rows, cols = matrix(x, "x")
    return _fp8(x, fmt), _fp8(x, fmt, (cols, rows))


@declare("compute_scale", (Arg("amax"), Arg("fmt", "str"), *_RULE), returns=2, backend=("compute_scale",),
         call=ops.compute_scale)
def _compute_scale(amax: Spec, fmt: str, margin: int = 0, power_of_2: bool = False,
                   epsilon: float = 0.0) -> tuple[Spec, ...]:
    """(scale, scale_inv) from amax by the contract's scale rule (1.0 where there is no scale); a 0-d amax gives
    [1] results, as every scale in fp8core."""
    shape = Spec(amax.shape if amax.shape else (1,), "float32")
    return shape, shape


@declare("gemm", (Arg("a"), Arg("b"), Arg("a_scale_inv"), Arg("b_scale_inv"), Arg("out_dtype", "dtype"),
                  Arg("bias", "Tensor?"), Arg("out_scale", "Tensor?"),
                  Arg("out_amax", "Tensor?", None, mutated=True, slot=F32_1), Arg("use_fast_accum", "bool")),
         returns=1, backend=("gemm",), call=gemm)
def _gemm(a: Spec, b: Spec, a_scale_inv: Spec, b_scale_inv: Spec, out_dtype: str, bias: Spec | None = None,
          out_scale: Spec | None = None, use_fast_accum: bool = False) -> tuple[Spec, ...]:
    """[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias); see fp8core.gemm."""
    m, _, n = check_shapes(a.shape, b.shape)
    return (Spec((m, n), out_dtype),)


_STATE = ("history", "scale", "scale_inv", "fp8_max", "non_finite")


@declare("update", (*(Arg(n, mutated=n not in ("fp8_max",)) for n in _STATE), Arg("margin", "int"),
                    Arg("algo", "str"), Arg("power_of_2", "bool"), Arg("epsilon", "float"),
                    Arg("update_scale", "bool")),
         returns=0, call=scaling.update_in_place, backend=("update",))
def _update(history: Spec, scale: Spec, scale_inv: Spec, fp8_max: Spec, non_finite: Spec, margin: int, algo: str,
            power_of_2: bool, epsilon: float, update_scale: bool) -> tuple[Spec, ...]:
    """The batched delayed-scaling update of N tensors, in place: history [L, N], scale/scale_inv/fp8_max
    float32 [N], non_finite bool [N], all on one device; margin |m| <= 512, algo 'max' or 'most_recent',
    epsilon finite >= 0. Everything is checked (the core's checks) before the one launch on a GPU."""
    vectors = zip(_STATE[1:], (scale, scale_inv, fp8_max, non_finite), ("float32",) * 3 + ("bool",))
    scaling.check_update_shapes((history.dtype, history.shape), [(n, v.dtype, v.shape, want) for n, v, want in vectors])
    args.amax_algo(algo)
    args.margin(margin)
    args.epsilon(epsilon)
    return ()


# ---- block scaling (fp8core.blocks) -------------------------------------------------------------------------

def _scale(x: Spec, layout: Layout) -> Spec:
    return Spec(layout.scale_shape(*matrix(x, "x")), "float8_e8m0fnu" if layout.kind == "mx" else "float32")


def _mx(columnwise: bool) -> Layout:
    return Layout.MX_COLUMNWISE if columnwise else Layout.MX_ROWWISE


@declare("quantize_mxfp8", (Arg("x"), Arg("fmt", "str"), Arg("scale_mode", "str"), Arg("columnwise", "bool")),
         returns=2, backend=("blocks.quantize_mxfp8",), call=blocks.quantize_mxfp8)
def _quantize_mxfp8(x: Spec, fmt: str, scale_mode: str, columnwise: bool) -> tuple[Spec, ...]:
    """(data in x's shape, E8M0 scale [rows, ceil(cols/32)] or [ceil(rows/32), cols])."""
    return _fp8(x, fmt), _scale(x, _mx(columnwise))


def _both(x: Any, fmt: str, scale_mode: str) -> tuple:
    row, col = blocks.quantize_mxfp8_both(x, fmt, scale_mode=scale_mode)
    return (*row, *col)


@declare("quantize_mxfp8_both", (Arg("x"), Arg("fmt", "str"), Arg("scale_mode", "str")), returns=4, call=_both,
         backend=("blocks.quantize_mxfp8_both",))
def _quantize_mxfp8_both(x: Spec, fmt: str, scale_mode: str) -> tuple[Spec, ...]:
    """(rowwise data, its scale, columnwise data, its scale) from one read of x."""
    return _fp8(x, fmt), _scale(x, _mx(False)), _fp8(x, fmt), _scale(x, _mx(True))


def _dequantized(cls: type, data: Spec, scale: Spec, out_dtype: str) -> tuple[Spec, ...]:
    matrix(data, "t.data")
    layout_of(cls(data, scale))
    return (Spec(data.shape, out_dtype),)


_T_DATA = Arg("data", label="t.data")


@declare("dequantize_mxfp8", (_T_DATA, Arg("scale", label="t.scale"), Arg("out_dtype", "dtype")), returns=1,
         call=lambda data, scale, out_dtype: blocks.dequantize_mxfp8(MXTensor(data, scale), out_dtype),
         backend=("blocks.dequantize_blocks",))
def _dequantize_mxfp8(data: Spec, scale: Spec, out_dtype: str) -> tuple[Spec, ...]:
    """y = data · 2^(scale - 127) per block, in out_dtype, data's shape."""
    return _dequantized(MXTensor, data, scale, out_dtype)


@declare("quantize_blockwise", (Arg("x"), Arg("fmt", "str"), Arg("block", "str"), Arg("power_of_2", "bool"),
                                Arg("epsilon", "float")), returns=2, backend=("blocks.quantize_blockwise",),
         call=blocks.quantize_blockwise)
def _quantize_blockwise(x: Spec, fmt: str, block: Any, power_of_2: bool, epsilon: float) -> tuple[Spec, ...]:
    """(data in x's shape, float32 scale_inv [rows or ceil(rows/128), ceil(cols/128)])."""
    return _fp8(x, fmt), _scale(x, args.block(block))


@declare("quantize_rowwise", (Arg("x"), Arg("fmt", "str"), Arg("axis", "int"), Arg("power_of_2", "bool"),
                              Arg("epsilon", "float")), returns=2, backend=("blocks.quantize_blockwise",),
         call=rowwise.quantize_rowwise)
def _quantize_rowwise(x: Spec, fmt: str, axis: int, power_of_2: bool, epsilon: float) -> tuple[Spec, ...]:
    """(data in x's shape, float32 scale_inv [rows, 1] (axis -1) or [1, cols] (axis 0))."""
    return _fp8(x, fmt), _scale(x, rowwise.axis_layout(axis))


@declare("dequantize_blockwise", (_T_DATA, Arg("scale_inv", label="t.scale_inv"), Arg("out_dtype", "dtype")),
         returns=1, backend=("blocks.dequantize_blocks",),
         call=lambda data, scale_inv, out_dtype: blocks.dequantize_blockwise(BlockScaledTensor(data, scale_inv),
                                                                             out_dtype))
def _dequantize_blockwise(data: Spec, scale_inv: Spec, out_dtype: str) -> tuple[Spec, ...]:
    """y = data · scale_inv[its block] in out_dtype, data's shape."""
    return _dequantized(BlockScaledTensor, data, scale_inv, out_dtype)


@declare("transpose_blocks", (_T_DATA, Arg("scale", label="t.scale"), Arg("layout", "str")), returns=2,
         may_alias=True, backend=("transpose", "blocks.transpose_scale"),
         call=lambda data, scale, layout: blocks.transpose_blocks(ScaledTensor(data, scale, layout)))
def _transpose_blocks(data: Spec, scale: Spec, layout: str) -> tuple[Spec, ...]:
    """The block-scaled transpose (fp8core.blocks.transpose_blocks): (data [cols, rows], its scales)."""
    rows, cols = matrix(data, "t.data")
    blocks.transposed_layout(layout_of(ScaledTensor(data, scale, layout)), rows)
    return Spec((cols, rows), data.dtype), Spec(tuple(scale.shape[::-1]), scale.dtype)


def _block_operands(a: Spec, a_scale: Spec, b: Spec, b_scale: Spec, a_layout: str, b_layout: str,
                    out_dtype: str) -> None:
    blocks.gemm_operands(ScaledTensor(a, a_scale, a_layout), ScaledTensor(b, b_scale, b_layout), None, None)


@declare("block_gemm", (Arg("a"), Arg("a_scale", label="a.scale"), Arg("b"), Arg("b_scale", label="b.scale"),
                        Arg("a_layout", "str"), Arg("b_layout", "str"), Arg("out_dtype", "dtype")),
         returns=1, precheck=_block_operands, backend=("blocks.gemm_scale",),
         call=lambda a, a_scale, b, b_scale, a_layout, b_layout, out_dtype: gemm(
             ScaledTensor(a, a_scale, a_layout), ScaledTensor(b, b_scale, b_layout), out_dtype=out_dtype))
def _block_gemm(a: Spec, a_scale: Spec, b: Spec, b_scale: Spec, a_layout: str, b_layout: str,
                out_dtype: str) -> tuple[Spec, ...]:
    """fp8core.gemm with scaled operands of one kind (both MX or both fp32 blocks): [M, N] in out_dtype."""
    m, k, n = check_shapes(a.shape, b.shape)
    blocks.gemm_layouts(layout_of(ScaledTensor(a, a_scale, a_layout), "a"),
                        layout_of(ScaledTensor(b, b_scale, b_layout), "b"), m, n, k)
    return (Spec((m, n), out_dtype),)


# ---- FP4 (fp8core.fp4) ---------------------------------------------------------------------------------------

def _fp4_operand(x: Spec, function: str, block: int, columnwise: bool) -> tuple[int, int]:
    """[R, C] of the operand (x as [M, K], or its transpose with ``columnwise``), C a whole number of blocks: the
    core's rule and words (fp8core.fp4)."""
    m, k = matrix(x, "x")
    cols = m if columnwise else k
    if cols % block:
        name, what = ("M", "down the columns of x") if columnwise else ("K", "along the rows of x")
        raise ValueError(f"x: {function}{' (columnwise)' if columnwise else ''} takes blocks of {block} {what} "
                         f"viewed as [M, K] = [{m}, {k}]; {name} = {cols} must be a multiple of {block}")
    return (k, m) if columnwise else (m, k)


def check_rng(rng: Any, x: Any = None) -> None:
    """Stochastic rounding's state, int64 [2] = (seed, offset): its dtype, shape and place (host memory, or x's
    device where the kernel reads it by pointer), from its metadata alone: no read of its values."""
    if str(rng.dtype) not in ("int64", "torch.int64") or tuple(rng.shape) != (2,):
        raise ValueError(f"rng: expected int64 [2] (seed, offset), got {rng.dtype} {tuple(rng.shape)}")
    where, there = str(getattr(rng, "device", "cpu")), str(getattr(x, "device", "cpu"))
    if x is not None and where != there and where != "cpu":
        raise ValueError(f"rng: is on {where} but x is on {there}; keep the (seed, offset) state on x's device "
                         "(read there by the kernel) or in host memory (read by value)")


def _nvfp4(x: Any, weight_2d: bool, hadamard: bool, stochastic: bool, rng: Any, stream: int,
           columnwise: bool) -> NVFP4Tensor:
    check_rng(rng, x)
    return fp4.quantize_nvfp4(x, weight_2d=weight_2d, hadamard=hadamard,
                              rounding="stochastic" if stochastic else "nearest",
                              rng_state=rng if stochastic else None, offset=stream if stochastic else 0,
                              columnwise=columnwise)


@declare("quantize_nvfp4", (Arg("x"), Arg("weight_2d", "bool"), Arg("hadamard", "bool"), Arg("stochastic", "bool"),
                            Arg("rng"), Arg("stream", "int"), Arg("columnwise", "bool")),
         returns=3, call=_nvfp4, backend=("fp4.quantize_nvfp4",))
def _quantize_nvfp4(x: Spec, weight_2d: bool, hadamard: bool, stochastic: bool, rng: Spec, stream: int,
                    columnwise: bool) -> tuple[Spec, ...]:
    """NVFP4 of the operand [R, C] (x as [M, K], or x^T): (data uint8 [R, C/2], scale float8_e4m3fn [R, C/16]
    or [ceil(R/16), C/16] with weight_2d, global_amax float32 [1]). Stochastic rounding takes seed and offset +
    stream from rng, int64 [2] (seed, offset) in host memory or on x's device, read where it lives when the
    primitive runs (on a GPU by the kernel: no host read)."""
    rows, cols = _fp4_operand(x, "quantize_nvfp4", fp4.NVFP4_BLOCK, columnwise)
    scale_rows = -(-rows // fp4.NVFP4_BLOCK) if weight_2d else rows
    return (Spec((rows, cols // 2), "uint8"), Spec((scale_rows, cols // fp4.NVFP4_BLOCK), formats.E4M3.dtype_name), F32_1)


@declare("quantize_mxfp4", (Arg("x"), Arg("rounding", "str"), Arg("columnwise", "bool")),
         returns=2, call=fp4.quantize_mxfp4, backend=("fp4.quantize_mxfp4",))
def _quantize_mxfp4(x: Spec, rounding: str, columnwise: bool) -> tuple[Spec, ...]:
    """MXFP4 of the operand [R, C] (x as [M, K], or x^T): (data uint8 [R, C/2], scale float8_e8m0fnu [R, C/32])."""
    rows, cols = _fp4_operand(x, "quantize_mxfp4", fp4.MXFP4_BLOCK, columnwise)
    return Spec((rows, cols // 2), "uint8"), Spec((rows, cols // fp4.MXFP4_BLOCK), formats.E8M0.dtype_name)


def _unpacked(data: Spec, out_dtype: str) -> tuple[Spec, ...]:
    rows, cols = matrix(data, "t.data")
    return (Spec((rows, 2 * cols), out_dtype),)


@declare("dequantize_nvfp4", (_T_DATA, Arg("scale", label="t.scale"), Arg("global_amax", label="t.global_amax"),
                              Arg("layout", "str"), Arg("out_dtype", "dtype")), returns=1,
         call=lambda data, scale, global_amax, layout, out_dtype: fp4.dequantize_nvfp4(
             NVFP4Tensor(data, scale, global_amax, layout), out_dtype),
         backend=("fp4.dequantize_nvfp4",))
def _dequantize_nvfp4(data: Spec, scale: Spec, global_amax: Spec, layout: str, out_dtype: str) -> tuple[Spec, ...]:
    """The NVFP4 operand [R, C] back in out_dtype, from data uint8 [R, C/2] in layout "1x16" or "16x16"."""
    return _unpacked(data, out_dtype)


@declare("dequantize_mxfp4", (_T_DATA, Arg("scale", label="t.scale"), Arg("out_dtype", "dtype")), returns=1,
         call=lambda data, scale, out_dtype: fp4.dequantize_mxfp4(MXFP4Tensor(data, scale), out_dtype),
         backend=("fp4.dequantize_mxfp4",))
def _dequantize_mxfp4(data: Spec, scale: Spec, out_dtype: str) -> tuple[Spec, ...]:
    """The MXFP4 operand [R, C] back in out_dtype, from data uint8 [R, C/2]."""
    return _unpacked(data, out_dtype)


@declare("nvfp4_gemm", (Arg("a"), Arg("a_scale", label="a.scale"), Arg("a_amax", label="a.global_amax"), Arg("b"),
                        Arg("b_scale", label="b.scale"), Arg("b_amax", label="b.global_amax"), Arg("a_layout", "str"),
                        Arg("b_layout", "str"), Arg("out_dtype", "dtype")),
         returns=1, backend=("fp4.gemm",),
         call=lambda a, a_scale, a_amax, b, b_scale, b_amax, a_layout, b_layout, out_dtype: gemm(
             NVFP4Tensor(a, a_scale, a_amax, a_layout), NVFP4Tensor(b, b_scale, b_amax, b_layout), out_dtype=out_dtype))
def _nvfp4_gemm(a: Spec, a_scale: Spec, a_amax: Spec, b: Spec, b_scale: Spec, b_amax: Spec, a_layout: str,
                b_layout: str, out_dtype: str) -> tuple[Spec, ...]:
    """fp8core.gemm of two NVFP4 operands (TN, blocks along K: a data [M, K/2], b data [N, K/2]): [M, N]."""
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"b: expected packed data [N, K/2] beside a's [M, K/2] = {tuple(a.shape)}, got shape "
                         f"{tuple(b.shape)}")
    return (Spec((a.shape[0], b.shape[0]), out_dtype),)


PRIMITIVES: dict[str, Primitive] = {p.name: p for p in globals().values() if isinstance(p, Primitive)}
