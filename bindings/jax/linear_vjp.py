"""The Linear's GEMMs as one ``jax.custom_vjp`` run from the recipe's plan (fp8core.linear_plan): which tensor each
GEMM takes, in which usage, what the forward keeps as residuals and which GEMM runs in high precision are the
plan's; the quantize and GEMM operations are the layout kind's (:class:`LinearOps`, from tensorwise.py, rowwise.py
and fp4.py), passed in as a static argument. The same plan runs fp8core.torch's autograd.Function. Delayed scaling
needs two things more of it: the amaxes of the forward's casts (dense folds them into its new state) and a state
differentiated through (its cotangent is what the backward's casts saw, for dense's next_state or flax's
combination of a layer's calls), both given by the kind's operations; flax's kernel, stored [K, N], is taken as
it is (``in_out``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fp8core.linear_plan import Gemm, LinearPlan, Role, padding

from .derivatives import first_order_only

__all__ = ["LinearOps", "linear_matmul", "padded_tokens", "output"]


class LinearOps(NamedTuple):
    """A layout kind's operations (hashable: a static argument). quantize(t, role_plan, plan, rowwise, columnwise,
    state, transposed=False) -> (rowwise operand, columnwise operand), None where not asked (``transposed``: t is
    stored as the role's tensor's transpose, flax's kernel [K, N]); gemm(a, b, out_dtype) -> a · bᵀ;
    operand(parts, quantization) -> the scaled tensor of its parts (residuals travel as plain tuples). Delayed
    scaling's: gemm_t(a, b, out_dtype) -> the GEMM of (b, a), the result transposed (None: (a · bᵀ)ᵀ);
    amax(operand) -> the amax of the tensor it was cast from, [1]; state_cotangent(state, amaxes [3]) -> the
    state's cotangent from this call's amaxes by role (None: the state is not differentiated)."""

    quantize: Callable[..., tuple[Any, Any]]
    gemm: Callable[..., jax.Array]
    operand: Callable[..., Any]
    gemm_t: Optional[Callable[..., jax.Array]] = None
    amax: Optional[Callable[[Any], jax.Array]] = None
    state_cotangent: Optional[Callable[[tuple, jax.Array], tuple]] = None


def linear_matmul(x: jax.Array, w: jax.Array, state: tuple, plan: LinearPlan, ops: LinearOps, out_dtype: Any,
                  dot: str, in_out: bool = False) -> tuple[jax.Array, tuple]:
    """(y [..., M, N] = x [..., M, K] · w [..., N, K]ᵀ with the plan's GEMMs forward and backward, in ``out_dtype``
    (a dtype name; None: x's); the amaxes of x and w, [1] each, where the kind takes them (``ops.amax``), else
    ()). M, K and N as the GEMMs take them (the caller pads); a leading batch dim where the kind takes one.
    ``in_out``: w is stored [..., K, N] (flax's kernel), and so is its gradient. ``state``: the plan's arrays
    (delayed scaling's, differentiated through ``ops.state_cotangent``; NVFP4's uint32 [4] random state, not
    differentiated); ``dot`` names the op in a second derivative's refusal."""
    return _matmul(x, w, state, plan, ops, out_dtype, dot, in_out)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _matmul(x, w, state, plan, ops, out_dtype, dot, in_out):
    return _forward(x, w, state, plan, ops, out_dtype, dot, in_out)[0]


def _forward(x, w, state, plan, ops, out_dtype, dot, in_out):
    return first_order_only(partial(_forward_once, plan=plan, ops=ops, out_dtype=out_dtype, in_out=in_out), dot,
                            x, w, state)


def _swap(t: jax.Array) -> jax.Array:
    return jnp.swapaxes(t, -1, -2)


def _forward_once(x, w, state, plan, ops, out_dtype, in_out):
    hp = {Role.INPUT: x, Role.WEIGHT: _swap(w) if in_out else w}
    made = {Role.INPUT: ops.quantize(x, plan.roles[Role.INPUT.value], plan, *plan.usages(Role.INPUT, plan.gemms),
                                     state),
            Role.WEIGHT: ops.quantize(w, plan.roles[Role.WEIGHT.value], plan, *plan.usages(Role.WEIGHT, plan.gemms),
                                      state, transposed=in_out)}
    y = _run(plan.fprop, ops, made, hp, x.dtype if out_dtype is None else out_dtype)
    amaxes = () if ops.amax is None else tuple(ops.amax(next(o for o in made[r] if o is not None)) for r in hp)
    saved = tuple(hp[op.role] if high else tuple(made[op.role][op.transposed]) for op, high in plan.saved())
    # dtypes travel as empty arrays: residuals must be JAX values
    return (y, amaxes), (saved, state, amaxes, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _fwd(x, w, state, plan, ops, out_dtype, dot, in_out):
    return _forward(x, w, state, plan, ops, out_dtype, dot, in_out)


def _bwd(plan, ops, out_dtype, dot, in_out, res, cts):
    saved, state, amaxes, x_like, w_like = res
    g = cts[0]  # the amaxes' cotangent: they are not differentiated
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
    dw = _run(plan.wgrad, ops, made, hp, dtypes[plan.wgrad.out], transposed=in_out)
    if ops.state_cotangent is None:
        return dx, dw, jax.tree.map(lambda s: np.zeros(s.shape, jax.dtypes.float0), state)
    return dx, dw, ops.state_cotangent(state, jnp.concatenate([*amaxes, ops.amax(made[Role.GRAD_OUTPUT][0])]))


_matmul.defvjp(_fwd, _bwd)


def _run(gemm: Gemm, ops: LinearOps, made: dict, hp: dict, out_dtype: Any, transposed: bool = False) -> jax.Array:
    """One of the plan's GEMMs: fp8 on the operands ``made`` ({role: {transposed: operand}}), or in high precision
    on ``hp`` ({role: array}), in b's dtype (the unquantized tensor the saved one is); ``transposed``: its result's
    transpose."""
    if gemm.high_precision:
        a, b = (_swap(hp[op.role]) if op.transposed else hp[op.role] for op in (gemm.a, gemm.b))
        d = (a.astype(b.dtype) @ _swap(b)).astype(out_dtype)
        return _swap(d) if transposed else d
    a, b = (made[op.role][op.transposed] for op in (gemm.a, gemm.b))
    if transposed:
        return _swap(ops.gemm(a, b, out_dtype)) if ops.gemm_t is None else ops.gemm_t(a, b, out_dtype)
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
