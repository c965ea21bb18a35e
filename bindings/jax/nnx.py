"""flax NNX integration: fp8core's FP8 dot as the ``dot_general`` of ``nnx.Linear`` / ``nnx.LinearGeneral`` and
the ``einsum_op`` of ``nnx.Einsum``, its scaling state in NNX variables of their own type, :class:`Fp8State`::

    layer = nnx.Linear(d_in, d_out, dot_general=fp8core.jax.nnx.Fp8DotGeneral(recipe), rngs=rngs)
    proj = nnx.Einsum("btd,dD->btD", (d, d), einsum_op=fp8core.jax.nnx.Fp8Einsum(recipe), rngs=rngs)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)   # leaves Fp8State alone

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = fp8core.jax.nnx.value_and_grad(loss_fn)(model, x, y)   # grads: the nnx.Param only
        optimizer.update(model, grads)
        return loss

The numerics, shapes (batch dims, any K and N), recipes (delayed scaling with ``interval``, current scaling;
HYBRID or E4M3) and the state's layout (``amax_history`` [L, 3], ``scale`` [3], ``scale_inv`` [3], columns
lhs, rhs, grad_output; ``interval_step`` [] with ``interval > 1``) are those of the Linen op
(:class:`fp8core.jax.Fp8DotGeneral`): the same data gives the same state, bit for bit, step after step.

The state moves in the backward pass (the grad_output's amax is known only there), so the step's gradient
goes through :func:`value_and_grad` / :func:`grad` (``nnx.value_and_grad`` / ``nnx.grad`` with the same
arguments): they differentiate the :class:`Fp8State` too, through a tie (``fp8core.jax.combine_calls``'s)
that makes every call of a layer in the step, however JAX traces them (a module called twice, ``nnx.remat``
per call, ``nnx.scan`` over a shared block), one call over all their inputs, update the state in place from
the MAX of the calls' amaxes, and return the gradients of the differentiated filter (``nnx.Param``) only.
A layer the step does not call keeps its state. Plain ``nnx.grad`` would lose the update: an FP8 layer with
delayed scaling refuses it by name at trace time. Forward passes (evaluation) need nothing.

A Linen checkpoint moves over layer by layer: :func:`linen_state` gives a layer's state in the Linen op's
layout (its ``_overwrite_with_gradient`` entry), :func:`load_linen_state` writes one into a layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from fp8core import DelayedScaling, NVFP4BlockScaling

from .fp4 import advance_rng, rng_state
from .linen import check_precision, check_recipe, dot_general_with_state, einsum_dot
from .tying import Tie, check_state, state_keys, tie

__all__ = ["Fp8State", "Fp4Rng", "Fp8DotGeneral", "Fp8Einsum", "value_and_grad", "grad", "linen_state",
           "load_linen_state"]


class Fp8State(nnx.Variable):
    """A layer's FP8 scaling state (amax history, scale, scale_inv, interval counter): not a parameter (no
    optimizer moves it), filtered as ``nnx.state(model, Fp8State)``, updated by :func:`value_and_grad`."""


class Fp4Rng(nnx.Variable):
    """NVFP4BlockScaling's random state (stochastic rounding of gradients): uint32 [4] (seed lo, seed hi, offset
    lo, offset hi), advanced by each call; neither a parameter nor differentiated (it is no gradient's)."""


def _sharded(y: jax.Array, out_sharding: Any) -> jax.Array:
    """The output with the sharding asked for (flax passes ``out_sharding``; None: XLA's choice)."""
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


class Fp8DotGeneral(nnx.Module):
    """``lax.dot_general`` in fp8 by fp8core's kernels, for ``nnx.Linear(dot_general=...)`` and
    ``nnx.LinearGeneral(dot_general=...)`` (one instance per layer: it holds the layer's state).

    recipe: ``fp8core.DelayedScaling`` (amax_compute_algo "max" or "most_recent", no callable algorithms;
    interval counted in an ``interval_step`` variable) or ``fp8core.Float8CurrentScaling`` (no state);
    fp8_format HYBRID or E4M3. axis_name: the mesh axis (or axes) of ``shard_map`` over which amaxes are
    MAX-reduced. Call: ``(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
    out_sharding=None)``; lhs/rhs float32, bfloat16 or float16 of any shape, batch dims included (one scale per
    operand over all its batch elements), output in ``preferred_element_type`` or the operands' promoted dtype;
    precision None or DEFAULT; ``out_sharding`` (a ``NamedSharding``, or a ``PartitionSpec`` under a mesh) is
    applied to the output.
    """

    def __init__(self, recipe: Any = DelayedScaling(amax_history_len=1024), *, axis_name: Any = None,
                 seed: int = 0) -> None:
        check_recipe(recipe)
        self.recipe = recipe
        self.axis_name = axis_name
        if isinstance(recipe, NVFP4BlockScaling):  # stochastic rounding's (seed, offset), advanced by each call
            self.fp4_rng = Fp4Rng(rng_state(seed))
        if isinstance(recipe, DelayedScaling):
            L = recipe.amax_history_len
            self.amax_history = Fp8State(jnp.zeros((L, 3), jnp.float32))
            self.scale = Fp8State(jnp.ones(3, jnp.float32))
            self.scale_inv = Fp8State(jnp.ones(3, jnp.float32))
            if recipe.interval > 1:
                self.interval_step = Fp8State(jnp.zeros((), jnp.float32))

    def _keys(self) -> tuple[str, ...]:
        return state_keys(self.recipe) if isinstance(self.recipe, DelayedScaling) else ()

    def _state(self) -> dict[str, jax.Array] | None:
        if isinstance(self.recipe, NVFP4BlockScaling):
            rng = self.fp4_rng.get_value()
            self.fp4_rng.set_value(advance_rng(rng))
            return {"rng": rng}
        if not self._keys():
            return None
        state = {k: getattr(self, k).get_value() for k in self._keys()}
        check_state(state, self.recipe)
        return state

    def _tie(self) -> tuple[jax.Array, ...]:
        """Tie the state for one differentiated step (see fp8core.jax.tying); returns the values it replaced."""
        values = tuple(self._state()[k] for k in self._keys())
        self._set_state(tie(values, Tie(self.recipe, self.axis_name)))
        return values

    def _set_state(self, values: tuple[jax.Array, ...]) -> None:
        for k, v in zip(self._keys(), values):
            getattr(self, k).set_value(v)

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
        y = dot_general_with_state(lhs, rhs, dimension_numbers, self._state(), self.recipe, self.axis_name,
                                   preferred_element_type, precision, dot=type(self).__name__ + " (nnx)",
                                   tied_only=True)
        return _sharded(y, out_sharding)


class Fp8Einsum(Fp8DotGeneral):
    """``jnp.einsum(eqn, lhs, rhs)`` of two operands in fp8, as :class:`Fp8DotGeneral` (same recipe, state,
    axis_name), for ``nnx.Einsum(einsum_op=...)`` and attention's ``"bqhd,bkhd->bhqk"`` / ``"bhqk,bkhd->bqhd"``
    written out. Call: ``(eqn, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None)``;
    the state's lhs/rhs columns are the operands in the order jnp.einsum hands them to its dot_general (as
    the Linen ``Fp8Einsum``)."""

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,  # type: ignore[override]
                 preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
        check_precision(precision)

        # taken here, not in the dot: jnp.einsum traces its dot_general under its own jit, where NVFP4's advance
        # of the layer's random state would be a mutation from another trace level
        state = self._state()

        def dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                preferred_element_type: Any = None, **_: Any) -> jax.Array:
            return einsum_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, state=state,
                              recipe=self.recipe, axis_name=self.axis_name, dot=type(self).__name__ + " (nnx)",
                              tied_only=True)

        y = jnp.einsum(eqn, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type,
                       _dot_general=dot)
        return _sharded(y, out_sharding)


def _layers(tree: Any) -> list[tuple[tuple[Any, ...], Fp8DotGeneral]]:
    """The delayed-scaling FP8 layers of a graph, each once, with its path."""
    return [(path, node) for path, node in nnx.iter_graph(tree)
            if isinstance(node, Fp8DotGeneral) and node._keys()]


def value_and_grad(f: Callable[..., Any], argnums: int | nnx.DiffState = 0, *,
                   has_aux: bool = False) -> Callable[..., Any]:
    """``nnx.value_and_grad(f, argnums, has_aux=has_aux)`` that also moves the FP8 layers' scaling state of
    the differentiated argument, in place: every :class:`Fp8DotGeneral` / :class:`Fp8Einsum` with delayed
    scaling called in ``f`` ends the step with the state one call over all its calls' inputs leaves (MAX of
    their amaxes, one update), bit for bit the Linen op's. Returns ``(value, grads)`` (``((value, aux),
    grads)`` with has_aux) as nnx's, grads of ``argnums``' filter (default ``nnx.Param``) only."""
    diff = argnums if isinstance(argnums, nnx.DiffState) else nnx.DiffState(argnums, nnx.Param)
    if isinstance(diff.argnum, bool) or not isinstance(diff.argnum, int):
        raise TypeError(f"argnums: expected an int or an nnx.DiffState (one differentiated argument), got {argnums!r}")

    def tied(*args: Any) -> Any:
        layers = [layer for _, layer in _layers(args[diff.argnum])]
        saved = [layer._tie() for layer in layers]
        try:
            return f(*args)
        finally:  # the step's outputs carry the state as it was; its next value comes back as its gradient
            for layer, values in zip(layers, saved):
                layer._set_state(values)

    inner = nnx.value_and_grad(tied, argnums=nnx.DiffState(diff.argnum, nnx.Any(diff.filter, Fp8State)),
                               has_aux=has_aux)

    def step(*args: Any) -> Any:
        if not -len(args) <= diff.argnum < len(args):
            raise ValueError(f"argnums: {diff.argnum} is not an argument of the {len(args)} given")
        value, grads = inner(*args)
        flat = dict(nnx.to_flat_state(nnx.filter_state(grads, Fp8State)))
        for path, layer in _layers(args[diff.argnum]):
            new = [flat[path + (k,)] for k in layer._keys()]
            new = [v.get_value() if isinstance(v, nnx.Variable) else v for v in new]
            called = jnp.any(new[1] != 0)  # a next scale is > 0; zeros: no call reached the layer
            for k, v in zip(layer._keys(), new):
                old = getattr(layer, k)
                old.set_value(jnp.where(called, v, old.get_value()))
        return value, nnx.filter_state(grads, diff.filter)

    return step


def grad(f: Callable[..., Any], argnums: int | nnx.DiffState = 0, *, has_aux: bool = False) -> Callable[..., Any]:
    """``nnx.grad`` with the FP8 layers' state moved in place, as :func:`value_and_grad`: returns grads (and
    aux with has_aux)."""
    vg = value_and_grad(f, argnums, has_aux=has_aux)

    def step(*args: Any) -> Any:
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return step


def linen_state(layer: Fp8DotGeneral) -> dict[str, jax.Array]:
    """A layer's state in the Linen op's layout: its entry of ``_overwrite_with_gradient``
    (``{"amax_history", "scale", "scale_inv"[, "interval_step"]}``), for a Linen model or checkpoint."""
    if not isinstance(layer, Fp8DotGeneral):
        raise TypeError(f"layer: expected a fp8core.jax.nnx.Fp8DotGeneral or Fp8Einsum, got {type(layer).__name__}")
    if not layer._keys():
        raise ValueError(f"layer: {type(layer).__name__} with {type(layer.recipe).__name__} keeps no state")
    return dict(layer._state())


def load_linen_state(layer: Fp8DotGeneral, state: Mapping[str, Any]) -> None:
    """Write a Linen op's layer state (its ``_overwrite_with_gradient`` entry, e.g. from
    ``fp8core.jax.from_flax_fp8_state`` or a Linen checkpoint) into ``layer``, checked against the layer's
    recipe first (a state that does not fit is refused by name and nothing is written)."""
    linen_state(layer)  # the layer's own checks
    if not isinstance(state, Mapping):
        raise TypeError(f"state: expected a Linen layer state (a dict of amax_history, scale, scale_inv), got "
                        f"{type(state).__name__}")
    keys = check_state(state, layer.recipe)
    extra = sorted(set(state) - set(keys))
    if extra:
        raise ValueError(f"state: keys {extra} are not the recipe's (expected {list(keys)})")
    for k in keys:
        getattr(layer, k).set_value(jnp.asarray(state[k], jnp.float32))
