"""NVFP4 for JAX, callable inside ``jax.jit``: the quantization and GEMM of fp8core.fp4, and the dense layer of
``NVFP4BlockScaling`` (Transformer Engine's NVFP4 recipe), the same GEMMs as fp8core.torch's, bit for bit.

Stochastic rounding's random state is data, a uint32 [4] array ``(seed lo, seed hi, offset lo, offset hi)``
(the unsigned 64-bit seed and offset of fp8core.quantize_nvfp4; JAX has no 64-bit integers by default): one
program for every step. :func:`fp8core.jax.dense` takes it as the layer's state, ``{"rng": uint32 [4]}``, and
returns the state with the offset advanced by 2 (the step's two gradient quantizations take ``offset`` and
``offset + 1``), as fp8core.torch's ``fp4_rng`` buffer advances.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import NVFP4BlockScaling, args
from fp8core.fp4 import FP4_GEMM_K
from fp8core.layouts import Layout, NVFP4Tensor
from fp8core.linear_plan import LinearPlan, Quantization, RolePlan, linear_plan

from . import _args
from .blocks import returning
from .linear_vjp import LinearOps, linear_matmul, output, padded_tokens
from .primitives import jitted, primitive

__all__ = ["quantize_nvfp4", "nvfp4_gemm", "rng_state", "advance_rng", "nvfp4_dense", "nvfp4_matmul", "STREAMS"]

Array = jax.Array
STREAMS = 2  # offsets a step takes: grad_output rowwise (offset), columnwise (offset + 1); fp8core.torch's too
_U32 = np.uint64(0xFFFFFFFF)


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


def _seed_offset(buf: Any, stream: int) -> tuple[int, int]:
    """(seed, offset + stream) from the state's buffer, read on the host: on the CPU a plain read; on a GPU (whose
    FP4 GEMM needs compute capability 10.x-12.x) a copy that waits for XLA's stream, the one host wait of the
    NVFP4 path, not yet removed (the kernels take the seed and offset as arguments)."""
    w = np.asarray(buf.data).astype(np.uint64)
    seed, offset = int(w[0] | (w[1] << np.uint64(32))), int(w[2] | (w[3] << np.uint64(32)))
    return seed, (offset + stream) % (1 << 64)


def quantize_nvfp4(x: Array, *, weight_2d: bool = False, hadamard: bool = False, stochastic: bool = False,
                   rng: Array | None = None, stream: int = 0, columnwise: bool = False) -> NVFP4Tensor:
    """:func:`fp8core.quantize_nvfp4` of x [M, K] (float32/bfloat16/float16) under jit: NVFP4Tensor(data uint8
    [R, C/2], scale float8_e4m3fn [R, C/16] or [ceil(R/16), C/16] with ``weight_2d``, global_amax float32 [1]);
    the operand [R, C] is x, or x^T with ``columnwise``. Stochastic rounding takes the seed and the offset +
    ``stream`` from ``rng`` (uint32 [4], :func:`rng_state`)."""
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
    m, k = x.shape
    rows, cols = (k, m) if columnwise else (m, k)
    if cols % 16:  # at trace time, in the core's words, rather than from inside the callback
        name, what = ("M", "down the columns of x") if columnwise else ("K", "along the rows of x")
        raise ValueError(f"x: quantize_nvfp4{' (columnwise)' if columnwise else ''} takes blocks of 16 {what} "
                         f"viewed as [M, K] = [{m}, {k}]; {name} = {cols} must be a multiple of 16")
    shapes = (jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8),
              jax.ShapeDtypeStruct((-(-rows // 16) if weight_2d else rows, cols // 16), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((1,), jnp.float32))

    def run(t, r):
        seed, offset = _seed_offset(r, stream) if stochastic else (0, 0)
        return tuple(fp8core.quantize_nvfp4(t, weight_2d=weight_2d, hadamard=hadamard,
                                            rounding="stochastic" if stochastic else "nearest", seed=seed,
                                            offset=offset, columnwise=columnwise))

    return tuple(primitive(returning(run), shapes)(x, rng))


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: Any = jnp.bfloat16) -> Array:
    """``fp8core.gemm(a, b)`` of two NVFP4 operands (TN, blocks along K: a [M, K], b [N, K]) under jit: [M, N]."""
    for arg, t in (("a", a), ("b", b)):
        if not isinstance(t, NVFP4Tensor):
            raise TypeError(f"{arg}: expected an NVFP4Tensor (data, scale, global_amax), got {type(t).__name__}")
    if a[0].shape[1] != b[0].shape[1]:
        raise ValueError(f"b: expected packed data [N, K/2] beside a's [M, K/2] = {tuple(a[0].shape)}, got shape "
                         f"{tuple(b[0].shape)}")
    return _nvfp4_gemm(tuple(a), tuple(b), out_dtype=_args.out_dtype(out_dtype),
                       layouts=(a.layout.value, b.layout.value))


@jitted("out_dtype", "layouts")
def _nvfp4_gemm(a: tuple, b: tuple, *, out_dtype: Any, layouts: tuple[str, str]) -> Array:
    name = jnp.dtype(out_dtype).name
    run = returning(lambda *t: fp8core.gemm(NVFP4Tensor(*t[:3], layouts[0]), NVFP4Tensor(*t[3:], layouts[1]),
                                             out_dtype=name))
    return primitive(run, jax.ShapeDtypeStruct((a[0].shape[0], b[0].shape[0]), out_dtype))(*a, *b)


# ---- the dense layer ------------------------------------------------------------------------------------

def _quantize(t: Array, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
              state: tuple) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """(t's operand, t^T's operand), each only where asked, with its usage's rule; stochastic rounding draws from
    ``state`` (the call's uint32 [4] random state) at the usage's stream."""
    return tuple(_one(t, q, state, usage) if asked else None
                 for q, usage, asked in ((role.rowwise, False, rowwise), (role.columnwise, True, columnwise)))


def _one(t: Array, q: Quantization, state: tuple, columnwise: bool) -> NVFP4Tensor:
    if q.stochastic:
        return quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard, stochastic=True,
                              rng=state[0], stream=q.stream, columnwise=columnwise)
    return quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard, columnwise=columnwise)


def _operand(parts: tuple, q: Quantization) -> NVFP4Tensor:
    return NVFP4Tensor(*parts, q.layout)


OPS = LinearOps(_quantize, nvfp4_gemm, _operand)


def nvfp4_matmul(x: Array, w: Array, rng: Array, recipe: NVFP4BlockScaling, out_dtype: Any = None) -> Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ with NVFP4 GEMMs forward and backward (M, N, K multiples of 32), in
    ``out_dtype`` (x's by default); the gradients' stochastic rounding from ``rng`` (uint32 [4])."""
    out = None if out_dtype is None else jnp.dtype(out_dtype).name
    return linear_matmul(x, w, (rng,), linear_plan(recipe), OPS, out, "fp8core.jax.dense")


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
