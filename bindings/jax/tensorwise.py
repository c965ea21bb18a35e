"""The per-tensor recipes' cast of one role (DelayedScaling, Float8CurrentScaling) for ``dense`` and the flax dots,
as the Linear's plan (fp8core.linear_plan) states it: the role's encoding, its delayed-scaling slot (None: current
scaling, by the tensor's own amax under the plan's scale rule, MAX-reduced over ``axis_name`` first when given).
"""

from __future__ import annotations

from typing import Any

import jax

from fp8core.linear_plan import RolePlan, ScaleRule

from .primitives import amax, cast_transpose, compute_scale, quantize, quantize_dynamic, reduce_amax, transpose

__all__ = ["cast", "cast_whole"]


def _scale(x: jax.Array, enc: str, rule: ScaleRule, axis_name: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    a = reduce_amax(amax(x), axis_name)
    s, s_inv = compute_scale(a, enc, margin=rule.margin, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    return s, s_inv, a


def cast(x: jax.Array, role: RolePlan, rule: ScaleRule, scale: jax.Array, scale_inv: jax.Array,
         axis_name: Any = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(q, q_t, scale_inv [1], amax [1]) of a 2-D operand: its delayed scale (``scale``/``scale_inv`` [3] at the
    role's slot), or its own amax."""
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


def cast_whole(x: jax.Array, role: RolePlan, rule: ScaleRule, scale: jax.Array, scale_inv: jax.Array,
               axis_name: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, scale_inv, amax) of an operand of any shape, as :func:`cast` but with no 2-D transpose (the batched
    GEMMs transpose each element's fp8 matrix in JAX instead: bits moved, not changed)."""
    enc, slot = role.rowwise.encoding, role.slot
    if slot is not None:
        q, a = quantize(x, scale[slot:slot + 1], enc)
        return q, scale_inv[slot:slot + 1], a
    if axis_name is None:
        return quantize_dynamic(x, enc, margin=rule.margin, power_of_2=rule.power_of_2, epsilon=rule.epsilon)
    s, s_inv, a = _scale(x, enc, rule, axis_name)
    return quantize(x, s, enc)[0], s_inv, a
