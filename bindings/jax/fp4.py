"""NVFP4 for JAX, callable inside ``jax.jit``: the quantization and GEMM of fp8core.fp4, and the dense layer of
``NVFP4BlockScaling`` (Transformer Engine's NVFP4 recipe), the same GEMMs as fp8core.torch's, bit for bit.

Stochastic rounding's random state is data, a uint32 [4] array ``(seed lo, seed hi, offset lo, offset hi)``
(the unsigned 64-bit seed and offset of fp8core.quantize_nvfp4; JAX has no 64-bit integers by default): one
program for every step. :func:`fp8core.jax.dense` takes it as the layer's state, ``{"rng": uint32 [4]}``, and
returns the state with the offset advanced by 2 (the step's two gradient quantizations take ``offset`` and
``offset + 1``), as fp8core.torch's ``fp4_rng`` buffer advances.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp8core
from fp8core import NVFP4BlockScaling, args
from fp8core.fp4 import FP4_GEMM_K
from fp8core.layouts import Layout, NVFP4Tensor

from . import _args
from .blocks import returning
from .derivatives import first_order_only
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

def _spec(recipe: NVFP4BlockScaling, out_dtype: str | None = None) -> tuple[bool, bool, bool, str | None]:
    """(weight in 16x16 tiles, the Hadamard transform on the wgrad operands, stochastic rounding of gradients,
    the output's dtype name: None for x's)."""
    return (not recipe.disable_2d_quantization, not recipe.disable_rht, not recipe.disable_stochastic_rounding,
            out_dtype)


def _per_element(t: NVFP4Tensor, parts: int, axis: int) -> list[NVFP4Tensor]:
    """The operand of each batch element of a tensor quantized with its batch elements one after another along
    its rows (rowwise: axis 0) or along its operand's columns (columnwise, the operand x^T: axis 1): data and
    scales cut into ``parts`` equal pieces there (every piece whole blocks and whole 16x16 tiles: the GEMM's
    dimensions are multiples of 32); the global amax is the whole tensor's."""
    data, scale, g = t
    return [NVFP4Tensor(d, s, g, t.layout) for d, s in zip(jnp.split(data, parts, axis), jnp.split(scale, parts, axis))]


def _gemms(a: NVFP4Tensor, a_axis: int, b: NVFP4Tensor, b_axis: int, parts: int, out_dtype: Any) -> Array:
    """[B, ., .]: nvfp4_gemm of each batch element's operands (:func:`_per_element`)."""
    return jnp.stack([nvfp4_gemm(pa, pb, out_dtype)
                      for pa, pb in zip(_per_element(a, parts, a_axis), _per_element(b, parts, b_axis))])


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _nvfp4_matmul(x, w, rng, spec):
    return _forward(x, w, rng, spec)[0]


def _forward(x, w, rng, spec):
    return first_order_only(partial(_forward_once, spec=spec), "fp8core.jax.dense", x, w, rng)


def _forward_once(x, w, rng, spec):
    # x [B, M, K], w [B, N, K]: each operand quantized once with its batch elements flattened into its rows
    # (tokens, or the weight's N): one global amax per operand, as one scale per tensor is in the FP8 recipes,
    # and stochastic rounding's block numbers running on across the batch
    weight_2d, rht, _, out = spec
    parts, m, k = x.shape
    x2, w2 = x.reshape(-1, k), w.reshape(-1, k)
    x_q, x_t = quantize_nvfp4(x2), quantize_nvfp4(x2, hadamard=rht, columnwise=True)
    w_q = quantize_nvfp4(w2, weight_2d=weight_2d)
    w_t = quantize_nvfp4(w2, weight_2d=weight_2d, columnwise=True)
    y = _gemms(x_q, 0, w_q, 0, parts, x.dtype if out is None else out)
    # layouts are static (the spec); dtypes travel as empty arrays: residuals must be JAX values
    return y, (tuple(x_t), tuple(w_t), rng, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _fwd(x, w, rng, spec):
    return _forward(x, w, rng, spec)


def _bwd(spec, res, g):
    x_t, w_t, rng, x_like, w_like = res
    weight_2d, rht, stochastic, _ = spec
    w_layout = Layout.NVFP4_16X16 if weight_2d else Layout.NVFP4_1X16
    x_t, w_t = NVFP4Tensor(*x_t, Layout.NVFP4_1X16), NVFP4Tensor(*w_t, w_layout)
    parts = g.shape[0]
    g2 = g.reshape(-1, g.shape[-1])
    g_q = quantize_nvfp4(g2, stochastic=stochastic, rng=rng, stream=0)
    g_t = quantize_nvfp4(g2, hadamard=rht, stochastic=stochastic, rng=rng, stream=1, columnwise=True)
    dx = _gemms(g_q, 0, w_t, 1, parts, x_like.dtype)  # [B, M, K]: each g [M, N] . w^T [K, N]
    dw = _gemms(g_t, 1, x_t, 1, parts, w_like.dtype)  # [B, N, K]: each g^T [N, M] . x^T [K, M]
    return dx, dw, np.zeros(rng.shape, jax.dtypes.float0)


_nvfp4_matmul.defvjp(_fwd, _bwd)


def nvfp4_matmul(x: Array, w: Array, rng: Array, recipe: NVFP4BlockScaling, out_dtype: Any = None) -> Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ with NVFP4 GEMMs forward and backward (M, N, K multiples of 32), in
    ``out_dtype`` (x's by default); the gradients' stochastic rounding from ``rng`` (uint32 [4]). Batched: x
    [B, M, K] and w [B, N, K] give y [B, M, N], each batch element's GEMMs the unbatched ones of operands
    quantized with the batch flattened into their rows (one global amax per operand over all its elements)."""
    if x.ndim != w.ndim or x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[0] != w.shape[0]):
        raise ValueError(f"w: expected [N, K] beside x [M, K], or [B, N, K] beside x [B, M, K], got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    spec = _spec(recipe, None if out_dtype is None else jnp.dtype(out_dtype).name)
    if x.ndim == 2:
        return _nvfp4_matmul(x[None], w[None], rng, spec)[0]
    return _nvfp4_matmul(x, w, rng, spec)


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
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    pad = -rows % FP4_GEMM_K or (FP4_GEMM_K if rows == 0 else 0)
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    y = nvfp4_matmul(x2, w, rng, recipe)[:rows].reshape(*x.shape[:-1], n)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, dict(state, rng=advance_rng(jax.lax.stop_gradient(rng)))
