"""torchao's rowwise recipes (Float8RowwiseScaling) for ``dense`` and ``Fp8DotGeneral``: x [M, K] · w [N, K]ᵀ
with rowwise-scaled GEMMs forward and backward, stateless: the Linear's plan (fp8core.linear_plan) run by
linear_vjp.py with the operations below, those of the torch Linear (bindings/torch/rowwise_linear.py), so both
front-ends give the same bits. Each operand takes one scale per row of the GEMM operand it becomes (along the GEMM's
K); rowwise_with_gw_hp: dgrad takes the weight under one scale, wgrad runs in x's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8core import Float8RowwiseScaling
from fp8core.layouts import Layout, RowwiseTensor
from fp8core.linear_plan import LinearPlan, Quantization, RolePlan, ScaleRule, linear_plan

from .blocks import block_gemm, quantize_rowwise
from .linear_vjp import LinearOps, linear_matmul
from .primitives import quantize_dynamic

__all__ = ["rowwise_matmul", "OPS"]


def _rows(t: jax.Array, enc: str, rule: ScaleRule) -> RowwiseTensor:
    return quantize_rowwise(t, enc, power_of_2=rule.power_of_2, epsilon=rule.epsilon)


def _columns(t: jax.Array, enc: str, rule: ScaleRule) -> RowwiseTensor:
    """Per column of t, as the per-row quantization of t.T (a transpose moves bits, changes none)."""
    q, s = quantize_rowwise(t, enc, axis=0, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    return RowwiseTensor(q.T, s.T, Layout.ROWWISE)


def _tensorwise_t(w: jax.Array, enc: str, rule: ScaleRule) -> RowwiseTensor:
    """w.T under w's one scale, every row carrying it (the per-tensor GEMM's D)."""
    q, s_inv, _ = quantize_dynamic(w, enc, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    return RowwiseTensor(q.T, jnp.broadcast_to(s_inv.reshape(1, 1), (w.shape[1], 1)), Layout.ROWWISE)


def _quantize(t: jax.Array, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
              state: tuple) -> tuple[RowwiseTensor | None, RowwiseTensor | None]:
    row = _rows(t, role.rowwise.encoding, plan.scale) if rowwise else None
    col = None
    if columnwise:
        q = role.columnwise
        col = (_tensorwise_t if q.layout is Layout.TENSORWISE else _columns)(t, q.encoding, plan.scale)
    return row, col


def _operand(parts: tuple, q: Quantization) -> RowwiseTensor:
    return RowwiseTensor(*parts, Layout.ROWWISE)  # a tensorwise usage too: its rows all carry the one scale


OPS = LinearOps(_quantize, block_gemm, _operand)


def rowwise_matmul(x: jax.Array, w: jax.Array, recipe: Float8RowwiseScaling, out_dtype: Any) -> jax.Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ in ``out_dtype``; M, K and N as the GEMMs take them (K and N multiples of
    16, M too for the wgrad GEMM: the caller pads with zeros)."""
    return linear_matmul(x, w, (), linear_plan(recipe), OPS, jnp.dtype(out_dtype).name, "Float8RowwiseScaling")
