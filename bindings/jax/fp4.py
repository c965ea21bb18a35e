"""FP4 for JAX, callable inside ``jax.jit``: the NVFP4 and MXFP4 quantizations, their dequantizations and the NVFP4
GEMM of fp8core.fp4 (their output shapes the declarations', fp8core.declarations), and the dense layer of
``NVFP4BlockScaling`` (Transformer Engine's NVFP4 recipe), the same GEMMs as fp8core.torch's, bit for bit.

Stochastic rounding's random state is data, a uint32 [4] array ``(seed lo, seed hi, offset lo, offset hi)``
(the unsigned 64-bit seed and offset of fp8core.quantize_nvfp4; JAX has no 64-bit integers by default): one
program for every step. :func:`fp8core.jax.dense` takes it as the layer's state, ``{"rng": uint32 [4]}``, and
returns the state with the offset advanced by 2 (the step's two gradient quantizations take ``offset`` and
``offset + 1``), as fp8core.torch's ``fp4_rng`` buffer advances. The state is never read to the host: the
quantize callback hands its buffer to fp8core.quantize_nvfp4 as ``rng_state`` (on a GPU the kernel reads the
seed and offset from device memory, on XLA's stream), and the advance is a jnp op.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import NVFP4BlockScaling, args
from fp8core.fp4 import FP4_GEMM_K
from fp8core.declarations import PRIMITIVES
from fp8core.layouts import Layout, MXFP4Tensor, NVFP4Tensor
from fp8core.linear_plan import LinearPlan, Quantization, RolePlan, linear_plan

from . import _args
from .blocks import returning
from .linear_vjp import LinearOps, linear_matmul, output, padded_tokens
from .primitives import jitted, primitive, shapes

__all__ = ["quantize_nvfp4", "quantize_mxfp4", "dequantize_nvfp4", "dequantize_mxfp4", "nvfp4_gemm", "rng_state",
           "advance_rng", "nvfp4_dense", "nvfp4_matmul", "STREAMS"]

Array = jax.Array
STREAMS = 2  # offsets a step takes: grad_output rowwise (offset), columnwise (offset + 1); fp8core.torch's too


def rng_state(seed: int, offset: int = 0) -> Array:
    """The random state ``(seed lo, seed hi, offset lo, offset hi)``, uint32 [4], of unsigned 64-bit seed and
    offset (fp8core.torch's ``fp4_rng`` holds the same two numbers as int64 [2]: ``seed % 2**64``)."""
    s, o = args.uint64(seed, "seed"), args.uint64(offset, "offset")
    return jnp.asarray(np.array([s & 0xFFFFFFFF, s >> 32, o & 0xFFFFFFFF, o >> 32], np.uint32))


def check_rng(rng: Any, arg: str = "rng") -> Array:
    rng = _args.array(rng, arg)
    if tuple(rng.shape) != (4,) or jnp.dtype(rng.dtype) != jnp.uint32:
        raise ValueError(f"{arg}: expected uint32 [4] (seed lo, seed hi, offset lo, offset hi: "
                         f"fp8core.jax.fp4.rng_state(seed)), got {jnp.dtype(rng.dtype).name} {tuple(rng.shape)}")
    return rng


def advance_rng(rng: Array, streams: int = STREAMS) -> Array:
    """rng with its 64-bit offset advanced by ``streams`` (carry into the high word): the next step's state."""
    lo = rng[2] + jnp.uint32(streams)
    hi = rng[3] + (lo < rng[2]).astype(jnp.uint32)
    return rng.at[2].set(lo).at[3].set(hi)


def quantize_nvfp4(x: Array, *, weight_2d: bool = False, hadamard: bool = False, stochastic: bool = False,
                   rng: Array | None = None, stream: int = 0, columnwise: bool = False) -> NVFP4Tensor:
    """:func:`fp8core.quantize_nvfp4` of x [M, K] (float32/bfloat16/float16) under jit: NVFP4Tensor(data uint8
    [R, C/2], scale float8_e4m3fn [R, C/16] or [ceil(R/16), C/16] with ``weight_2d``, global_amax float32 [1]);
    the operand [R, C] is x, or x^T with ``columnwise``. Stochastic rounding takes the seed and the offset +
    ``stream`` from ``rng`` (uint32 [4], :func:`rng_state`), read where it lives by the quantize (on a GPU from
    device memory: no host read)."""
    x = _args.high_precision(x, "x", matrix=True)
    if len(x.shape) != 2:
        raise ValueError(f"x: expected a 2-D [M, K] array, got shape {tuple(x.shape)}")
    flags = tuple(args.flag(v, n) for v, n in ((weight_2d, "weight_2d"), (hadamard, "hadamard"),
                                               (stochastic, "stochastic"), (columnwise, "columnwise")))
    rng = jnp.zeros(4, jnp.uint32) if rng is None else check_rng(rng)
    layout = Layout.NVFP4_16X16 if flags[0] else Layout.NVFP4_1X16
    return NVFP4Tensor(*_quantize_nvfp4(x, rng, flags=flags, stream=args.integer(stream, "stream", 0)), layout)


@jitted("flags", "stream")
def _quantize_nvfp4(x: Array, rng: Array, *, flags: tuple[bool, bool, bool, bool], stream: int) -> tuple:
    weight_2d, hadamard, stochastic, columnwise = flags
    # the declared outputs, and the core's error at trace time rather than from inside the callback
    out = shapes("quantize_nvfp4", x=x, weight_2d=weight_2d, hadamard=hadamard, stochastic=stochastic, rng=rng,
                 stream=stream, columnwise=columnwise)

    def run(t, r):
        # the state's buffer itself, on x's device: the kernel reads it there, nothing waits for XLA's stream
        return tuple(fp8core.quantize_nvfp4(t, weight_2d=weight_2d, hadamard=hadamard,
                                            rounding="stochastic" if stochastic else "nearest",
                                            rng_state=r if stochastic else None, offset=stream if stochastic else 0,
                                            columnwise=columnwise))

    return tuple(primitive(returning(run), out)(x, rng))


def quantize_mxfp4(x: Array, *, rounding: str = "rceil", columnwise: bool = False) -> MXFP4Tensor:
    """:func:`fp8core.quantize_mxfp4` of x [M, K] (float32/bfloat16/float16) under jit: MXFP4Tensor(data uint8
    [R, C/2], scale float8_e8m0fnu [R, C/32]); the operand [R, C] is x, or x^T with ``columnwise``."""
    x = _args.high_precision(x, "x", matrix=True)
    return MXFP4Tensor(*_quantize_mxfp4(x, rounding=args.scale_mode(rounding, "rounding"),
                                        columnwise=args.flag(columnwise, "columnwise")))


@jitted("rounding", "columnwise")
def _quantize_mxfp4(x: Array, *, rounding: str, columnwise: bool) -> tuple:
    named = dict(rounding=rounding, columnwise=columnwise)
    run = returning(lambda t: tuple(PRIMITIVES["quantize_mxfp4"].call(t, **named)))
    return tuple(primitive(run, shapes("quantize_mxfp4", x=x, **named))(x))


def _fp4_parts(t: Any, cls: type, arg: str) -> tuple:
    if not isinstance(t, cls):
        raise TypeError(f"{arg}: expected an {cls.__name__} ({', '.join(cls._fields)}), got {type(t).__name__}")
    return tuple(t)


def dequantize_nvfp4(t: NVFP4Tensor, out_dtype: Any = jnp.float32) -> Array:
    """:func:`fp8core.dequantize_nvfp4` under jit: the operand [R, C] in out_dtype (float32/bfloat16/float16)."""
    return _dequantize_fp4(_fp4_parts(t, NVFP4Tensor, "t"), name="dequantize_nvfp4",
                           out_dtype=_args.out_dtype(out_dtype), layout=t.layout.value)


def dequantize_mxfp4(t: MXFP4Tensor, out_dtype: Any = jnp.float32) -> Array:
    """:func:`fp8core.dequantize_mxfp4` under jit: the operand [R, C] in out_dtype (float32/bfloat16/float16)."""
    return _dequantize_fp4(_fp4_parts(t, MXFP4Tensor, "t"), name="dequantize_mxfp4",
                           out_dtype=_args.out_dtype(out_dtype), layout=None)


@jitted("name", "out_dtype", "layout")
def _dequantize_fp4(parts: tuple, *, name: str, out_dtype: Any, layout: str | None) -> Array:
    p = PRIMITIVES[name]
    named = {"out_dtype": jnp.dtype(out_dtype).name, **({} if layout is None else {"layout": layout})}
    inputs = dict(zip((a.name for a in p.args), parts))
    run = returning(lambda *t: p.call(*t, **named))
    (out,) = shapes(name, **inputs, **named)
    return primitive(run, out)(*parts)


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: Any = jnp.bfloat16) -> Array:
    """``fp8core.gemm(a, b)`` of two NVFP4 operands (TN, blocks along K: a [M, K], b [N, K]) under jit: [M, N]."""
    for arg, t in (("a", a), ("b", b)):
        if not isinstance(t, NVFP4Tensor):
            raise TypeError(f"{arg}: expected an NVFP4Tensor (data, scale, global_amax), got {type(t).__name__}")
    return _nvfp4_gemm(tuple(a), tuple(b), out_dtype=_args.out_dtype(out_dtype),
                       layouts=(a.layout.value, b.layout.value))


@jitted("out_dtype", "layouts")
def _nvfp4_gemm(a: tuple, b: tuple, *, out_dtype: Any, layouts: tuple[str, str]) -> Array:
    name = jnp.dtype(out_dtype).name
    run = returning(lambda *t: fp8core.gemm(NVFP4Tensor(*t[:3], layouts[0]), NVFP4Tensor(*t[3:], layouts[1]),
                                             out_dtype=name))
    names = ("a", "a_scale", "a_amax", "b", "b_scale", "b_amax")
    (out,) = shapes("nvfp4_gemm", **dict(zip(names, (*a, *b))), a_layout=layouts[0], b_layout=layouts[1],
                    out_dtype=name)
    return primitive(run, out)(*a, *b)


# ---- the dense layer ------------------------------------------------------------------------------------

def _quantize(t: Array, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
              state: tuple, transposed: bool = False) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """(t's operand, t^T's operand), each only where asked, with its usage's rule; stochastic rounding draws from
    ``state`` (the call's uint32 [4] random state) at the usage's stream. ``transposed``: t is stored transposed."""
    t = jnp.swapaxes(t, -1, -2) if transposed else t
    return tuple(_one(t, q, state, usage) if asked else None
                 for q, usage, asked in ((role.rowwise, False, rowwise), (role.columnwise, True, columnwise)))


def _one(t: Array, q: Quantization, state: tuple, columnwise: bool) -> NVFP4Tensor:
    if t.ndim == 3:  # [B, ., K]: quantized once with its batch flattened into its rows, then cut per element
        return _per_element(_one(t.reshape(-1, t.shape[-1]), q, state, columnwise), t.shape[0], int(columnwise))
    if q.stochastic:
        return quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard, stochastic=True,
                              rng=state[0], stream=q.stream, columnwise=columnwise)
    return quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard, columnwise=columnwise)


def _per_element(t: NVFP4Tensor, parts: int, axis: int) -> NVFP4Tensor:
    """A tensor quantized with its batch elements one after another along its rows (rowwise: axis 0) or along its
    operand's columns (columnwise, the operand x^T: axis 1) as each element's operand stacked: data and scales
    cut into ``parts`` equal pieces there (every piece whole blocks and whole 16x16 tiles: the GEMM's dimensions
    are multiples of 32), data [B, R, C/2] and its scales as the tensor checks them, [B * scale rows, .]. The
    global amax is the whole tensor's: one per operand, as one scale per tensor is in the FP8 recipes, and
    stochastic rounding's block numbers run on across the batch."""
    data, scale, g = t
    scale = jnp.stack(jnp.split(scale, parts, axis))
    return NVFP4Tensor(jnp.stack(jnp.split(data, parts, axis)), scale.reshape(-1, scale.shape[-1]), g, t.layout)


def _gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: Any) -> Array:
    """a · bᵀ, or [B, ., .] of each batch element's where the operands are stacked (:func:`_per_element`)."""
    if a[0].ndim == 2:
        return nvfp4_gemm(a, b, out_dtype)

    def element(t: NVFP4Tensor, i: int) -> NVFP4Tensor:
        data, scale, g = t
        return NVFP4Tensor(data[i], scale.reshape(data.shape[0], -1, scale.shape[-1])[i], g, t.layout)

    return jnp.stack([nvfp4_gemm(element(a, i), element(b, i), out_dtype) for i in range(a[0].shape[0])])


def _operand(parts: tuple, q: Quantization) -> NVFP4Tensor:
    return NVFP4Tensor(*parts, q.layout)


OPS = LinearOps(_quantize, _gemm, _operand)


def nvfp4_matmul(x: Array, w: Array, rng: Array, recipe: NVFP4BlockScaling, out_dtype: Any = None) -> Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ with NVFP4 GEMMs forward and backward (M, N, K multiples of 32), in
    ``out_dtype`` (x's by default); the gradients' stochastic rounding from ``rng`` (uint32 [4]). Batched: x
    [B, M, K] and w [B, N, K] give y [B, M, N], each batch element's GEMMs the unbatched ones of operands
    quantized with the batch flattened into their rows (one global amax per operand over all its elements)."""
    if x.ndim != w.ndim or x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[0] != w.shape[0]):
        raise ValueError(f"w: expected [N, K] beside x [M, K], or [B, N, K] beside x [B, M, K], got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    out = None if out_dtype is None else jnp.dtype(out_dtype).name
    return linear_matmul(x, w, (rng,), linear_plan(recipe), OPS, out, "fp8core.jax.dense")[0]


def nvfp4_dense(x: Array, w: Array, state: Any, recipe: NVFP4BlockScaling, bias: Array | None = None
                ) -> tuple[Array, dict[str, Array]]:
    """x [..., K] · w[N, K]ᵀ (+ bias) with NVFP4 GEMMs: (y [..., N] in x's dtype, the state with its offset
    advanced). K and N multiples of 32; the token count is zero-padded to one of 32 (the wgrad GEMM's K)."""
    if not isinstance(state, dict) or "rng" not in state:
        raise TypeError(f"state: expected NVFP4BlockScaling's state {{'rng': uint32 [4]}} "
                        f"(fp8core.jax.init_state(recipe, seed=...)), got {type(state).__name__}")
    rng = check_rng(state["rng"], "state['rng']")
    k, n = x.shape[-1], w.shape[0]
    if k % FP4_GEMM_K or n % FP4_GEMM_K or w.shape[1] != k:
        raise ValueError(f"w: expected [N, K] with K = {k} and N, K multiples of {FP4_GEMM_K} under "
                         f"NVFP4BlockScaling (the FP4 GEMM's K), got {tuple(w.shape)}")
    if bias is not None and tuple(_args.array(bias, "bias").shape) != (n,):
        raise ValueError(f"bias: expected shape ({n},) (N), got {tuple(bias.shape)}")
    x2, rows = padded_tokens(x, FP4_GEMM_K)
    return output(nvfp4_matmul(x2, w, rng, recipe), x, rows, bias), dict(state, rng=advance_rng(jax.lax.stop_gradient(rng)))
