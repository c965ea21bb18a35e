"""Weight tying combined by MAX whatever JAX traces apart: :func:`combine_calls` and the tie it puts on a layer's
delayed-scaling state.

A layer's state read by several calls gets, from JAX, the *sum* of the calls' cotangents wherever the calls
were traced apart (two ``apply`` of the same variables in one loss, each call under its own ``nn.remat``, one
state broadcast over ``nn.scan``'s iterations). flax's own fp8 op makes that sum a max with a dtype of its own,
``flax.linen.fp8_ops.fp32_max_grad`` (float32 whose cotangents add by ``max``); fp8core uses the same dtype,
but the update of the contract is not a max of updated states (the scale of the largest amax is not the
largest scale, and a zero or non-finite amax keeps the previous scale), so the calls do not each return an
updated state. Instead:

* the tie, at the top of the loss, hands the calls the state in ``fp32_max_grad`` (the same values);
* each call's backward pass returns only its amaxes (input, kernel, grad_output) as row 0 of the history's
  cotangent: JAX's accumulation, in whatever trace, keeps their MAX;
* the tie's backward pass takes the batched update of the contract once, from that MAX, and returns the next
  state (float32) as the state's gradient, as before: the state one call over all the calls' inputs leaves.

A layer the loss never calls gets a zero gradient, tied or not (JAX runs no backward pass for it):
``fp8core.jax.nnx.value_and_grad`` keeps such a layer's state; a Linen loop writes back only the layers it
called.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT, fp32_max_grad
from jax import lax

import fp8core
from fp8core import DelayedScaling

from . import _args
from .primitives import reduce_amax, update

__all__ = ["combine_calls", "MAX_GRAD"]

MAX_GRAD = fp32_max_grad  # float32 values whose cotangents JAX accumulates by max (flax's dtype)
STATE_KEYS = ("amax_history", "scale", "scale_inv")
INTERVAL_KEY = "interval_step"


def formats(recipe: Any) -> tuple[fp8core.Format, fp8core.Format, fp8core.Format]:
    """The state's columns: input and kernel in the forward format, grad_output in the backward one."""
    fmt = recipe.fp8_format
    return fmt.fwd, fmt.fwd, fmt.bwd


def is_tied(value: Any) -> bool:
    return getattr(value, "dtype", None) == MAX_GRAD


def untie(value: Any) -> Any:
    """A state array as float32 (the values the GEMMs use)."""
    return lax.convert_element_type(value, jnp.float32) if is_tied(value) else value


def cotangent(value: Any, like: Any) -> Any:
    """A float32 cotangent in the dtype of the state it belongs to (fp32_max_grad for a tied state)."""
    return lax.convert_element_type(value, MAX_GRAD) if is_tied(like) else value


def advance(state: tuple[Any, ...], row: Any, recipe: DelayedScaling, axis_name: Any) -> tuple[Any, ...]:
    """The state after one step whose amaxes are ``row`` [3] (MAX of the calls'): folded into row 0 of the
    history, MAX-reduced over ``axis_name`` where the recipe says so, then the batched update of the contract
    (with ``interval > 1``, state[3] is ScalingState's steps % interval: the scales move when it is 0)."""
    history, scale, scale_inv = state[:3]
    row0 = jnp.maximum(history[0], row)
    if axis_name is not None and recipe.reduce_amax:
        row0 = reduce_amax(row0, axis_name)
    args = (history.at[0].set(row0), scale, scale_inv, recipe, formats(recipe))
    if len(state) == 3:
        return update(*args)
    step = state[3]
    new = lax.cond(step == 0, lambda: update(*args, update_scale=True), lambda: update(*args, update_scale=False))
    return (*new, jnp.where(step + 1 == recipe.interval, 0.0, step + 1).astype(jnp.float32))


class Tie(NamedTuple):
    recipe: DelayedScaling
    axis_name: Any


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def tie(state: tuple[Any, ...], how: Tie) -> tuple[Any, ...]:
    """The state (float32 arrays: amax_history, scale, scale_inv[, interval_step]) in fp32_max_grad for the
    calls; its gradient is the next state, from the MAX of the calls' amaxes."""
    return tuple(lax.convert_element_type(v, MAX_GRAD) for v in state)


def _tie_fwd(state, how):
    return tie(state, how), state


def _tie_bwd(how, state, cts):
    # JAX calls this only where some call reached the state (else the state's gradient is zeros, as untied),
    # and every call puts its amaxes (>= 0 or NaN) in row 0 of the history's cotangent
    row = lax.convert_element_type(cts[0], jnp.float32)[0]
    return (advance(state, row, how.recipe, how.axis_name),)


tie.defvjp(_tie_fwd, _tie_bwd)


def state_keys(recipe: DelayedScaling) -> tuple[str, ...]:
    """The variables of a layer's state under ``recipe`` (interval_step only where the interval is > 1)."""
    return STATE_KEYS + ((INTERVAL_KEY,) if recipe.interval > 1 else ())


def check_state(state: Mapping[str, Any], recipe: DelayedScaling, arg: str = "state") -> tuple[str, ...]:
    """A layer's state (tied or not) against the recipe: its keys, each float32 (or fp32_max_grad) of the
    recipe's shape; returns the keys in order."""
    keys = state_keys(recipe)
    views = {k: jax.ShapeDtypeStruct(tuple(state[k].shape), jnp.float32) if is_tied(state[k]) else state[k]
             for k in keys if k in state}
    _args.layer_state(views, recipe, arg)
    if INTERVAL_KEY in keys:
        if INTERVAL_KEY not in state:
            raise KeyError(f"{arg}: missing key {INTERVAL_KEY!r} (recipe interval {recipe.interval} counts its steps)")
        v = views[INTERVAL_KEY]
        if _args.array(v, f"{arg}['{INTERVAL_KEY}']").shape != () or jnp.dtype(v.dtype) != jnp.float32:
            raise ValueError(f"{arg}['{INTERVAL_KEY}']: expected a float32 scalar, got {jnp.dtype(v.dtype).name} "
                             f"{tuple(v.shape)}")
    return keys


def tie_layer(state: Mapping[str, Any], recipe: DelayedScaling, axis_name: Any = None) -> dict[str, Any]:
    """One layer's state dict, tied (see :func:`tie`)."""
    keys = check_state(state, recipe)
    if any(is_tied(state[k]) for k in keys):
        raise ValueError("state: already tied (combine_calls once, at the top of the loss)")
    return dict(state, **dict(zip(keys, tie(tuple(state[k] for k in keys), Tie(recipe, axis_name)))))


def combine_calls(variables: Mapping[str, Any], recipe: DelayedScaling, axis_name: Any = None) -> dict[str, Any]:
    """``variables`` (a flax variables dict) with every fp8core layer state of its ``_overwrite_with_gradient``
    collection tied, for a loss that applies them more than once however JAX traces the calls::

        def loss(v):
            v = fp8core.jax.combine_calls(v, recipe)
            return f(model.apply(v, x1), model.apply(v, x2))   # or nn.remat per call, nn.scan broadcasting the state

    The gradient of each layer's state is then its next state from the MAX of all its calls' amaxes, bit for
    bit the state one call over all their inputs leaves (``TrainState.apply_gradients`` writes it back as
    before). ``recipe`` and ``axis_name`` are the layers' (one recipe for all of them; a state that does not
    fit it is refused by name). Calls within one ``apply`` combine by MAX without it."""
    _args.delayed(recipe)
    if not isinstance(variables, Mapping) or OVERWRITE_WITH_GRADIENT not in variables:
        raise TypeError(f"variables: expected a flax variables dict with a {OVERWRITE_WITH_GRADIENT!r} collection, "
                        f"got {type(variables).__name__}")

    def walk(tree: Any, path: tuple[str, ...]) -> Any:
        if not isinstance(tree, Mapping):
            raise TypeError(f"variables[{OVERWRITE_WITH_GRADIENT!r}]{''.join(f'[{p!r}]' for p in path)}: expected "
                            f"a dict of layers, got {type(tree).__name__}")
        if "amax_history" in tree:
            return tie_layer(tree, recipe, axis_name)
        return {k: walk(v, path + (k,)) for k, v in tree.items()}

    return dict(variables, **{OVERWRITE_WITH_GRADIENT: walk(variables[OVERWRITE_WITH_GRADIENT], ())})
