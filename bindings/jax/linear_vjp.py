"""The Linear's GEMMs as one ``jax.custom_vjp`` run from the recipe's plan (fp8core.linear_plan): which tensor each
GEMM takes, in which usage, what the forward keeps as residuals and which GEMM runs in high precision are the
plan's; the quantize and GEMM operations are the layout kind's (:class:`LinearOps`, from rowwise.py and fp4.py),
passed in as a static argument. The same plan runs fp8core.torch's autograd.Function, so both front-ends give the
same bits.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8core.linear_plan import Gemm, LinearPlan, Role, padding

from .derivatives import first_order_only

__all__ = ["LinearOps", "linear_matmul", "padded_tokens", "output"]


class LinearOps(NamedTuple):
    """A layout kind's operations (hashable: a static argument). quantize(t, role_plan, plan, rowwise, columnwise,
    state) -> (rowwise operand, columnwise operand), None where not asked; gemm(a, b, out_dtype) -> a · bᵀ;
    operand(parts, quantization) -> the scaled tensor of its parts (residuals travel as plain tuples)."""

    quantize: Callable[..., tuple[Any, Any]]
    gemm: Callable[..., jax.Array]
    operand: Callable[..., Any]


def linear_matmul(x: jax.Array, w: jax.Array, state: tuple, plan: LinearPlan, ops: LinearOps, out_dtype: Any,
                  dot: str) -> jax.Array:
    """y [M, N] = x [M, K] · w [N, K]ᵀ with the plan's GEMMs forward and backward, in ``out_dtype`` (a dtype name;
    None: x's). M, K and N as the GEMMs take them (the caller pads). ``state``: the plan's arrays (NVFP4: its
    uint32 [4] random state), not differentiated; ``dot`` names the op in a second derivative's refusal."""
    return _matmul(x, w, state, plan, ops, out_dtype, dot)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x, w, state, plan, ops, out_dtype, dot):
    return _forward(x, w, state, plan, ops, out_dtype, dot)[0]


def _forward(x, w, state, plan, ops, out_dtype, dot):
    return first_order_only(partial(_forward_once, plan=plan, ops=ops, out_dtype=out_dtype), dot, x, w, state)


def _forward_once(x, w, state, plan, ops, out_dtype):
    hp = {Role.INPUT: x, Role.WEIGHT: w}
    made = {role: ops.quantize(hp[role], plan.roles[role.value], plan, *plan.usages(role, plan.gemms), state)
            for role in hp}
    y = _run(plan.fprop, ops, made, hp, x.dtype if out_dtype is None else out_dtype)
    saved = tuple(hp[op.role] if high else tuple(made[op.role][op.transposed]) for op, high in plan.saved())
    # dtypes travel as empty arrays: residuals must be JAX values
    return y, (saved, state, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _fwd(x, w, state, plan, ops, out_dtype, dot):
    return _forward(x, w, state, plan, ops, out_dtype, dot)


def _bwd(plan, ops, out_dtype, dot, res, g):
    saved, state, x_like, w_like = res
    hp = {Role.GRAD_OUTPUT: g}
    made = {Role.INPUT: {}, Role.WEIGHT: {}}
    for (op, high), t in zip(plan.saved(), saved):
        if high:
            hp[op.role] = t
        else:
            made[op.role][op.transposed] = ops.operand(t, plan.quantization(op))
    made[Role.GRAD_OUTPUT] = ops.quantize(g, plan.roles[Role.GRAD_OUTPUT.value], plan,
                                          *plan.usages(Role.GRAD_OUTPUT, plan.gemms[1:]), state)
    dtypes = {Role.INPUT: x_like.dtype, Role.WEIGHT: w_like.dtype}
    dx = _run(plan.dgrad, ops, made, hp, dtypes[plan.dgrad.out])
    dw = _run(plan.wgrad, ops, made, hp, dtypes[plan.wgrad.out])
    return dx, dw, jax.tree.map(lambda s: np.zeros(s.shape, jax.dtypes.float0), state)


_matmul.defvjp(_fwd, _bwd)


def _run(gemm: Gemm, ops: LinearOps, made: dict, hp: dict, out_dtype: Any) -> jax.Array:
    """One of the plan's GEMMs: fp8 on the operands ``made`` ({role: {transposed: operand}}), or in high precision
    on ``hp`` ({role: array}), in b's dtype (the unquantized tensor the saved one is)."""
    if gemm.high_precision:
        a, b = (hp[op.role].T if op.transposed else hp[op.role] for op in (gemm.a, gemm.b))
        return (a.astype(b.dtype) @ b.T).astype(out_dtype)
    a, b = (made[op.role][op.transposed] for op in (gemm.a, gemm.b))
    return ops.gemm(a, b, out_dtype)


def padded_tokens(x: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    """(x [..., K] as [tokens, K] zero-padded to the plan's multiple of tokens, the token count)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = padding(rows, multiple)
    return (jnp.pad(x2, ((0, pad), (0, 0))) if pad else x2), rows


def output(y: jax.Array, x: jax.Array, rows: int, bias: jax.Array | None) -> jax.Array:
    """The GEMM's [padded tokens, N] cut back to x's leading shape [..., N], plus bias in y's dtype."""
    y = y[:rows].reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.astype(y.dtype)
