"""``dense``: y = x · wᵀ with fp8 GEMMs forward and backward (jax.custom_vjp), delayed or current scaling.

The delayed-scaling state is an explicit pytree (flax's functional habit): ``{"amax_history": [L, 3],
"scale": [3], "scale_inv": [3]}`` for input, weight and grad_output. ``dense`` returns the forward amaxes
folded into row 0 of a new state; the grad_output amax, known only in the backward pass, comes back as the
gradient of ``state["amax_history"][0, 2]``. :func:`next_state` merges the two and takes the batched update.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from fp8core import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, NVFP4BlockScaling
from fp8core.gemm import MULTIPLE
from fp8core.linear_plan import linear_plan

from . import _args
from .fp4 import nvfp4_dense, rng_state
from .linear_vjp import linear_matmul, output, padded_tokens
from .primitives import reduce_amax, update
from .rowwise import rowwise_matmul
from .tensorwise import Tensorwise

__all__ = ["init_state", "dense", "next_state"]

_DOT = "fp8core.jax.dense"  # the op's name in a second derivative's refusal



def init_state(recipe: DelayedScaling | NVFP4BlockScaling, seed: int = 0) -> dict[str, jax.Array]:
    """The state of one dense layer: zero history [amax_history_len, 3], unit scales [3]; under
    NVFP4BlockScaling the random state of stochastic rounding, ``{"rng": uint32 [4]}`` (``seed``, offset 0:
    fp8core.jax.fp4.rng_state)."""
    if isinstance(recipe, NVFP4BlockScaling):
        return {"rng": rng_state(seed)}
    L = _args.delayed(recipe).amax_history_len
    return {"amax_history": jnp.zeros((L, 3), jnp.float32), "scale": jnp.ones(3, jnp.float32),
            "scale_inv": jnp.ones(3, jnp.float32)}


def _grad_amax(config: Any, state: tuple, amaxes: jax.Array) -> tuple:
    """dense's state cotangent: the grad_output amax at row 0, column 2 of the history (the forward's come out of
    dense itself, folded into the new state)."""
    history, scale, scale_inv = state
    return jnp.zeros_like(history).at[0, 2].set(amaxes[2]), jnp.zeros_like(scale), jnp.zeros_like(scale_inv)


_CURRENT = Tensorwise().ops()
_DELAYED = Tensorwise(cotangent=_grad_amax).ops()


def dense(x: jax.Array, w: jax.Array, state: dict[str, jax.Array] | None, recipe: Any,
          bias: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """x [..., K] · w[N, K]ᵀ (+ bias) with fp8 GEMMs; returns (y [..., N] in x's dtype, new state).

    K and N must be multiples of 16; the token count is zero-padded to one (an empty batch to 16 rows: the
    weight gradient's GEMM contracts over the tokens and needs K > 0). ``state`` is None under
    Float8CurrentScaling and Float8RowwiseScaling (torchao's rowwise recipes, in
    fp8core.jax.rowwise). Differentiate with respect to ``state`` too, and pass that gradient to
    :func:`next_state`: it carries the grad_output amax.

    NVFP4BlockScaling (fp8core.jax.fp4): K and N multiples of 32, the token count padded to 32; ``state`` is
    ``init_state(recipe, seed)``, and the new state (the offset advanced) is the next step's: no next_state.
    """
    nvfp4 = isinstance(recipe, NVFP4BlockScaling)
    if not nvfp4:
        _args.dense_recipe(recipe)
    _args.high_precision(x, "x", matrix=True)
    _args.high_precision(w, "w")
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D [N, K] array, got shape {tuple(w.shape)}")
    if nvfp4:
        return nvfp4_dense(x, w, state, recipe, bias)
    _args.layer_state(state, recipe)
    k, n = x.shape[-1], w.shape[0]
    if bias is not None and tuple(_args.array(bias, "bias").shape) != (n,):
        raise ValueError(f"bias: expected shape ({n},) (N), got {tuple(bias.shape)}")
    if k % MULTIPLE or n % MULTIPLE or w.shape[1] != k:
        raise ValueError(f"w: expected [N, K] with K = {k} and N, K multiples of 16, got {w.shape}")
    x2, rows = padded_tokens(x, MULTIPLE)
    if isinstance(recipe, Float8RowwiseScaling):
        y, new_state = rowwise_matmul(x2, w, recipe, x.dtype), None
    elif isinstance(recipe, Float8CurrentScaling):
        y, new_state = linear_matmul(x2, w, (), linear_plan(recipe), _CURRENT, None, _DOT)[0], None
    else:
        h = state["amax_history"]
        y, (ax, aw) = linear_matmul(x2, w, (h, state["scale"], state["scale_inv"]), linear_plan(recipe), _DELAYED,
                                    None, _DOT)
        row0 = h[0].at[0].max(jax.lax.stop_gradient(ax[0])).at[1].max(jax.lax.stop_gradient(aw[0]))
        new_state = dict(state, amax_history=h.at[0].set(row0))
    return output(y, x, rows, bias), new_state


def next_state(state: dict[str, jax.Array], state_grad: dict[str, jax.Array], recipe: DelayedScaling,
               axis_name: Any = None, update_scale: bool | None = None) -> dict[str, jax.Array]:
    """Fold the grad_output amax (from ``state_grad``) into row 0, MAX-reduce row 0 over ``axis_name``
    (inside shard_map) when given, then the batched update of the contract. The state keeps no step count:
    with ``recipe.interval > 1`` pass ``update_scale`` (ScalingState's ``steps % interval == 0``, a Python
    bool); with interval 1 it defaults to True."""
    _args.layer_state(state, _args.delayed(recipe))
    if update_scale is None:
        if recipe.interval != 1:
            raise ValueError(f"update_scale: next_state's state has no step count, so recipe interval "
                             f"{recipe.interval} needs update_scale= (steps % interval == 0), got None")
        update_scale = True
    if not isinstance(state_grad, Mapping) or "amax_history" not in state_grad:
        raise TypeError(f"state_grad: expected the gradient of dense's state (a dict with amax_history), got "
                        f"{type(state_grad).__name__}")
    h = state["amax_history"]
    row0 = h[0].at[2].max(jnp.abs(state_grad["amax_history"][0, 2]))
    if axis_name is not None:
        row0 = reduce_amax(row0, axis_name)
    fmt = recipe.fp8_format
    hist, scale, scale_inv = update(h.at[0].set(row0), state["scale"], state["scale_inv"], recipe,
                                    [fmt.fwd, fmt.fwd, fmt.bwd], update_scale)
    return {"amax_history": hist, "scale": scale, "scale_inv": scale_inv}
