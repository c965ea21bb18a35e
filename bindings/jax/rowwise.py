"""torchao's rowwise recipes (Float8RowwiseScaling) for ``dense`` and ``Fp8DotGeneral``: x [M, K] · w [N, K]ᵀ
with rowwise-scaled GEMMs forward and backward (jax.custom_vjp), stateless. The GEMMs and their operands are
those of the torch Linear (bindings/torch/rowwise_linear.py), so both front-ends give the same bits:

  forward  y  = gemm(x per row, w per row)                  K = in
  dgrad    dx = gemm(g per row, w per column, transposed)   K = out  (rowwise_with_gw_hp: w under one scale)
  wgrad    dw = gemm(g per column, x per column, both transposed)  K = M  (rowwise_with_gw_hp: g^T x in x's dtype)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from fp8core import Float8RowwiseScaling
from fp8core.layouts import Layout, RowwiseTensor

from .blocks import block_gemm, quantize_rowwise
from .derivatives import first_order_only
from .primitives import quantize_dynamic

__all__ = ["rowwise_matmul"]


def _rows(t: jax.Array, r: Float8RowwiseScaling) -> RowwiseTensor:
    return quantize_rowwise(t, r.fp8_format.fwd.value, power_of_2=r.power_of_2, epsilon=r.epsilon)


def _columns(t: jax.Array, r: Float8RowwiseScaling) -> RowwiseTensor:
    """Per column of t, as the per-row quantization of t.T (a transpose moves bits, changes none)."""
    q, s = quantize_rowwise(t, r.fp8_format.fwd.value, axis=0, power_of_2=r.power_of_2, epsilon=r.epsilon)
    return RowwiseTensor(q.T, s.T, Layout.ROWWISE)


def _tensorwise_t(w: jax.Array, r: Float8RowwiseScaling) -> RowwiseTensor:
    """w.T under w's one scale, every row carrying it (the per-tensor GEMM's D)."""
    q, s_inv, _ = quantize_dynamic(w, r.fp8_format.fwd.value, power_of_2=r.power_of_2, epsilon=r.epsilon)
    return RowwiseTensor(q.T, jnp.broadcast_to(s_inv.reshape(1, 1), (w.shape[1], 1)), Layout.ROWWISE)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rowwise_matmul(x: jax.Array, w: jax.Array, recipe: Float8RowwiseScaling, out_dtype: Any) -> jax.Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ in ``out_dtype``; M, K and N as the GEMMs take them (K and N multiples of
    16, M too for the wgrad GEMM: the caller pads with zeros)."""
    return _forward(x, w, recipe, out_dtype)[0]


def _forward(x, w, recipe, out_dtype):
    return first_order_only(partial(_forward_once, recipe=recipe, out_dtype=out_dtype), "Float8RowwiseScaling",
                            x, w)


def _forward_once(x, w, recipe, out_dtype):
    y = block_gemm(_rows(x, recipe), _rows(w, recipe), out_dtype)
    w_t = _tensorwise_t(w, recipe) if recipe.wgrad_high_precision else _columns(w, recipe)
    x_saved = x if recipe.wgrad_high_precision else tuple(_columns(x, recipe))
    return y, (tuple(w_t), x_saved, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _bwd(recipe, out_dtype, res, g):
    w_t, x_saved, x_like, w_like = res
    dx = block_gemm(_rows(g, recipe), RowwiseTensor(*w_t, Layout.ROWWISE), x_like.dtype)
    if recipe.wgrad_high_precision:
        dw = (g.T.astype(x_saved.dtype) @ x_saved).astype(w_like.dtype)
    else:
        dw = block_gemm(_columns(g, recipe), RowwiseTensor(*x_saved, Layout.ROWWISE), w_like.dtype)
    return dx, dw


rowwise_matmul.defvjp(_forward, _bwd)
