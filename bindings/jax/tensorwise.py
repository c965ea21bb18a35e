"""The per-tensor recipes' operations (DelayedScaling, Float8CurrentScaling) for the Linear's plan
(fp8core.linear_plan), run by linear_vjp.py's custom_vjp for ``dense`` and the flax dots.

A role's cast is the plan's: its encoding, its delayed-scaling slot (the state's ``scale``/``scale_inv`` [3] there),
or, with no slot (current scaling), the tensor's own amax under the plan's scale rule, MAX-reduced over
``axis_name`` first when given. A 2-D tensor's operand and its transpose's come from one ``cast_transpose``; a
batched one [B, R, C] is cast whole and each element's transpose moved in JAX (bits moved, not changed). Every
operand carries the amax of its cast, which delayed scaling's state takes: each front-end says how in
:class:`Tensorwise`'s ``cotangent`` (dense hands the forward's amaxes out and the gradient's back as the state's
gradient, the flax dots all three, combined across a layer's calls).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fp8core.linear_plan import LinearPlan, Quantization, RolePlan, ScaleRule

from .linear_vjp import LinearOps
from .primitives import amax, cast_transpose, compute_scale, gemm, quantize, quantize_dynamic, reduce_amax, transpose
from .tying import untie

__all__ = ["TensorOperand", "Tensorwise"]


class TensorOperand(NamedTuple):
    """An fp8 GEMM operand under one scale: data (fp8, [.., R, C]), scale_inv [1], amax [1] of its cast."""

    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array


def _scale(x: jax.Array, enc: str, rule: ScaleRule, axis_name: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    a = reduce_amax(amax(x), axis_name)
    s, s_inv = compute_scale(a, enc, margin=rule.margin, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    return s, s_inv, a


def _cast(x: jax.Array, role: RolePlan, rule: ScaleRule, scale: Optional[jax.Array], scale_inv: Optional[jax.Array],
          axis_name: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(q, q_t, scale_inv [1], amax [1]) of a 2-D operand: its delayed scale, or its own amax."""
    enc, slot = role.rowwise.encoding, role.slot
    if slot is not None:
        q, qt, a = cast_transpose(x, scale[slot:slot + 1], enc)
        return q, qt, scale_inv[slot:slot + 1], a
    if axis_name is None:
        q, s_inv, a = quantize_dynamic(x, enc, margin=rule.margin, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
        return q, transpose(q), s_inv, a
    s, s_inv, a = _scale(x, enc, rule, axis_name)
    q, qt, _ = cast_transpose(x, s, enc)
    return q, qt, s_inv, a


def _cast_whole(x: jax.Array, role: RolePlan, rule: ScaleRule, scale: Optional[jax.Array],
                scale_inv: Optional[jax.Array], axis_name: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, scale_inv, amax) of an operand of any shape, as :func:`_cast` with no 2-D transpose."""
    enc, slot = role.rowwise.encoding, role.slot
    if slot is not None:
        q, a = quantize(x, scale[slot:slot + 1], enc)
        return q, scale_inv[slot:slot + 1], a
    if axis_name is None:
        return quantize_dynamic(x, enc, margin=rule.margin, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    s, s_inv, a = _scale(x, enc, rule, axis_name)
    return quantize(x, s, enc)[0], s_inv, a


class Tensorwise(NamedTuple):
    """The per-tensor kind's operations for one front-end (hashable: linear_vjp's static argument). ``axis_name``:
    the mesh axes current scaling MAX-reduces its amaxes over; ``cotangent(config, state, amaxes [3])``: delayed
    scaling's state's cotangent from a call's amaxes by role (None: current scaling, no state). The state is
    (amax_history [L, 3], scale [3], scale_inv [3], ...), a tied state's arrays (fp8core.jax.tying) read as
    float32."""

    axis_name: Any = None
    cotangent: Optional[Callable[..., tuple]] = None
    config: Any = None

    def quantize(self, t: jax.Array, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
                 state: tuple, transposed: bool = False) -> tuple[TensorOperand, TensorOperand]:
        """(t's operand, t's transpose's), both whatever is asked (the casts feed the state); ``transposed``: t
        is stored as the role's tensor's transpose (flax's kernel [K, N])."""
        scale, scale_inv = (untie(state[1]), untie(state[2])) if state else (None, None)
        if t.ndim == 2:
            q, qt, s_inv, a = _cast(t, role, plan.scale, scale, scale_inv, self.axis_name)
        else:
            q, s_inv, a = _cast_whole(t, role, plan.scale, scale, scale_inv, self.axis_name)
            qt = jnp.swapaxes(q, -1, -2)
        if transposed:
            q, qt = qt, q
        return TensorOperand(q, s_inv, a), TensorOperand(qt, s_inv, a)

    def gemm(self, a: TensorOperand, b: TensorOperand, out_dtype: Any) -> jax.Array:
        return gemm(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype)

    def gemm_t(self, a: TensorOperand, b: TensorOperand, out_dtype: Any) -> jax.Array:
        """The GEMM of (b, a): flax's kernel-shaped [K, N] weight gradient, as it has always been made."""
        return gemm(b.data, a.data, b.scale_inv, a.scale_inv, out_dtype)

    def operand(self, parts: tuple, q: Quantization) -> TensorOperand:
        return TensorOperand(*parts)

    def amax(self, t: TensorOperand) -> jax.Array:
        return t.amax

    def state_cotangent(self, state: tuple, amaxes: jax.Array) -> tuple:
        return self.cotangent(self.config, state, amaxes)

    def ops(self) -> LinearOps:
        """The LinearOps of these operations."""
        return LinearOps(self.quantize, self.gemm, self.operand, self.gemm_t, self.amax,
                         None if self.cotangent is None else self.state_cotangent)
