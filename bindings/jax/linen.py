"""flax.linen integration: :class:`Fp8DotGeneral`, fp8core's FP8 matmul in flax's ``dot_general_cls`` slot.

FP8 goes on with one argument, the way flax users (and MaxText-style configs) switch it on::

    nn.Dense(features, dot_general_cls=fp8core.jax.Fp8DotGeneral)
    nn.DenseGeneral(features, axis=..., dot_general_cls=partial(Fp8DotGeneral, recipe=..., axis_name="data"))

and ``jnp.einsum(eqn, x, kernel, _dot_general=Fp8DotGeneral())`` inside a compact module (flax 0.12's
``nn.Einsum`` takes no custom dot_general). The forward pass is two fp8 casts and one fp8 GEMM, the backward
pass one cast and two GEMMs, all fp8core kernels through ``fp8core.jax`` (CPU and GPU, under ``jit``).
``dot_general``'s batch dimensions (attention's ``"bqhd,bkhd->bhqk"``, ``nn.DenseGeneral(batch_dims=...)``) run
as one batched GEMM primitive per product (one callback; inside it a GEMM per batch element, not a
strided-batched cuBLASLt call): each batch element's GEMM the unbatched one, each operand with one scale.

Delayed scaling keeps its state in flax's ``_overwrite_with_gradient`` collection: ``amax_history`` [L, 3],
``scale`` [3] and ``scale_inv`` [3], the columns being lhs (input), rhs (kernel) and grad_output, laid out like
:class:`fp8core.ScalingState` (with ``interval > 1``, ``interval_step`` [], float32: its ``steps % interval``).
The backward pass returns the updated state as the "gradient" of these variables (this step's amaxes in row 0,
MAX-reduced over ``axis_name``, then the batched update of the contract), so
``flax.training.train_state.TrainState.apply_gradients`` writes it back. Take gradients inside ``shard_map``
(every device then holds the same reduced state).

A layer called more than once in a step (weight tying, a shared encoder) updates its state once, from the MAX
of its calls' amaxes: the state one call over all the calls' inputs would leave. JAX adds the gradients of a
variable read twice, and the update is not additive (nor is a max of updated scales the scale of the max amax),
so the calls do not each return an updated state: within one trace, each call hands its amaxes to the call
before it (:func:`_link`), and the first call, the only one reading the variables, updates. Calls JAX traces
apart (two ``apply`` of the same variables, each call under its own ``nn.remat``, one state broadcast over
``nn.scan``'s iterations) would have their updated states added by JAX: ``fp8core.jax.combine_calls`` ties the
state at the top of the loss (fp8core.jax.tying), and a call reading a tied state hands its amaxes to the tie.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.tracers import current_trace
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax import lax

from fp8core import DelayedScaling, Float8RowwiseScaling, NVFP4BlockScaling
from fp8core.fp4 import FP4_GEMM_K
from fp8core.gemm import MULTIPLE
from fp8core.linear_plan import linear_plan, padding

from . import _args
from .fp4 import advance_rng, check_rng, nvfp4_matmul
from .linear_vjp import linear_matmul
from .rowwise import rowwise_matmul
from .tensorwise import Tensorwise
from .tying import advance, check_state, cotangent, is_tied, state_keys

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "fp8_dot_general", "OVERWRITE_WITH_GRADIENT", "FP4_RNG"]

# NVFP4BlockScaling's random state (stochastic rounding of gradients): a collection of its own, mutable in a
# training step as batch_stats are, advanced by each call (its value is not a gradient: uint32)
FP4_RNG = "fp4_rng"

_HIGH = ("float32", "bfloat16", "float16")


class _Config(NamedTuple):
    recipe: Any
    dot: str = "Fp8DotGeneral"  # the dot's name in errors
    tied_only: bool = False  # the state's gradient is taken only through a tie (fp8core.jax.nnx)


_UNTIED = ("{dot}: its scaling state was not differentiated through fp8core.jax.nnx.grad / value_and_grad (plain "
           "nnx.grad takes the nnx.Param only), so the grad_output amax and the update would be lost; take the "
           "gradient with fp8core.jax.nnx.value_and_grad or fp8core.jax.nnx.grad")


def _state_cotangents(cfg: _Config, state: tuple, amaxes: Any) -> tuple[Any, Any, Any]:
    """The state's cotangent from one call (the state (amax_history, scale, scale_inv)): its amaxes in row 0 of
    the history's (for _link or a tie to combine and update), zeros elsewhere; in the history's dtype (a tied
    state is tied whole)."""
    history, scale = state[:2]
    h = jnp.zeros(history.shape, jnp.float32)
    if isinstance(cfg.recipe, DelayedScaling):
        if cfg.tied_only and not is_tied(history):
            raise ValueError(_UNTIED.format(dot=cfg.dot))
        h = h.at[0].set(amaxes)
    zeros = jnp.zeros(scale.shape, jnp.float32)
    return cotangent(h, history), cotangent(zeros, history), cotangent(zeros, history)


class _Link(NamedTuple):
    recipe: Any
    axis_name: Any
    first: bool  # reads the variables themselves: the call that updates


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _link(state, link):
    """(the state for this call's GEMMs, the same state for the layer's next call); state: (amax_history,
    scale, scale_inv) and, with ``interval > 1``, interval_step (ScalingState's steps % interval, float32 []).
    Backward: this call's amaxes (from its GEMMs' cotangent) MAX the later calls' (from the next call's), handed
    on as row 0 of the previous call's cotangent, or, in the first call, folded into row 0 and updated."""
    return state, state


def _link_fwd(state, link):
    return (state, state), state


def _link_bwd(link, state, cts):
    history = state[0]
    mine, later = cts
    row = jnp.maximum(mine[0][0], later[0][0])  # amaxes >= 0, and 0 where no later call; NaN propagates
    if not link.first:
        return ((jnp.zeros_like(history).at[0].set(row), *(jnp.zeros_like(v) for v in state[1:])),)
    return (advance(state, row, link.recipe, link.axis_name),)


_link.defvjp(_link_fwd, _link_bwd)

# The layers' state chains within one apply (flax's root scope: one per apply, per trace of a lifted
# transform), by the root's identity (a Scope's hash and equality follow its variables) and dropped with it:
# {id(root): (weakref to root, {scope path: ((variables read, trace), next call's state)})}
_CHAINS: dict[int, tuple[Any, dict[tuple[str, ...], Any]]] = {}


def _chains(root: Any) -> dict[tuple[str, ...], Any]:
    entry = _CHAINS.get(id(root))
    if entry is None or entry[0]() is not root:
        entry = _CHAINS[id(root)] = (weakref.ref(root), {})
        weakref.finalize(root, _CHAINS.pop, id(root), None)
    return entry[1]


_KEYS = ("amax_history", "scale", "scale_inv")


# interval_step is float32 state (its next value comes back as its gradient, which an int cannot carry):
# exact up to 2**24
_MAX_INTERVAL = 2**24


def check_recipe(recipe: Any, functional: bool = False) -> None:
    if isinstance(recipe, NVFP4BlockScaling):
        return
    _args.dense_recipe(recipe)
    if isinstance(recipe, DelayedScaling):
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise ValueError("recipe: Fp8DotGeneral's functional update takes amax_compute_algo 'max' or "
                             "'most_recent' and no scaling_factor_compute_algo")
        if functional and recipe.interval != 1:
            raise ValueError(f"recipe: fp8_dot_general's state has no step count, so it updates the scales every "
                             f"step (interval 1), got interval {recipe.interval}; Fp8DotGeneral keeps the count")
        if recipe.interval > _MAX_INTERVAL:
            raise ValueError(f"recipe: Fp8DotGeneral counts an interval's steps in float32: interval at most "
                             f"2**24, got {recipe.interval}")


def _layout(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """Permutations that put lhs as [free..., contracting...] and rhs as [contracting..., free...], and K, N."""
    (lc, rc), _ = dimension_numbers  # no batch dims: dot_general_with_state sends those to _batched_dot_general
    lc, rc = _dims(lc, lhs, "lhs", "contracting"), _dims(rc, rhs, "rhs", "contracting")
    for arg, x, c in (("lhs", lhs, lc), ("rhs", rhs, rc)):
        if len(set(c)) != len(c):
            raise ValueError(f"dimension_numbers: {arg}'s contracting dims {c} repeat a dimension (shape "
                             f"{tuple(x.shape)})")
    if len(lc) != len(rc) or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(lc, rc)):
        raise ValueError(f"dimension_numbers: contracting dims {lc} of lhs {lhs.shape} and {rc} of rhs "
                         f"{rhs.shape} do not match")
    lfree = tuple(d for d in range(lhs.ndim) if d not in lc)
    rfree = tuple(d for d in range(rhs.ndim) if d not in rc)
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    n = int(np.prod([rhs.shape[d] for d in rfree], dtype=np.int64))
    return lfree + lc, rc + rfree, k, n


def _dtype_name(dtype: Any, arg: str) -> str:
    name = jnp.dtype(dtype).name
    if name not in _HIGH:
        raise TypeError(f"{arg}: expected float32, bfloat16 or float16, got {name}")
    return name


def check_precision(precision: Any) -> None:
    """None or DEFAULT (per operand too): the GEMM is fp8 with float32 accumulation whatever is asked, so a
    request for more (HIGH, HIGHEST, an algorithm) is refused rather than ignored."""
    pair = isinstance(precision, (tuple, list))
    for p in (precision if pair else (precision,)):
        try:
            ok = p is None or (isinstance(p, (str, lax.Precision)) and lax.Precision(p) == lax.Precision.DEFAULT)
        except ValueError:
            ok = False
        if not ok or (pair and len(precision) != 2):
            raise ValueError(f"precision: fp8 GEMMs take None or lax.Precision.DEFAULT (fp8 operands, float32 "
                             f"accumulation), got {precision!r}; use a plain dot_general where a layer needs more")


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, state: dict[str, jax.Array] | None,
                    recipe: Any, axis_name: Any = None, preferred_element_type: Any = None,
                    precision: Any = None) -> jax.Array:
    """``lax.dot_general`` (batch dimensions too) in fp8 by fp8core's kernels; the functional core of
    :class:`Fp8DotGeneral`. ``state`` (delayed scaling): ``{"amax_history", "scale", "scale_inv"}``; its
    gradient is its next value (a state passed to several calls gets the sum of theirs: JAX adds the gradients
    of a value used twice; :class:`Fp8DotGeneral` combines its calls by MAX). Any K and N: the GEMMs' operands
    are zero-padded to their multiples of 16 and the results cut back; ``precision`` None or
    ``lax.Precision.DEFAULT``. Batch dims anywhere (as dot_general allows): moved to the front by transposes
    in JAX, each batch element's GEMMs those of the unbatched op with the operand's one per-tensor scale (its
    amax over the whole operand, batch included), all elements in one batched GEMM primitive, the output in
    dot_general's layout (batch, lhs free, rhs free)."""
    check_recipe(recipe, functional=True)
    if isinstance(recipe, DelayedScaling) and isinstance(state, Mapping) and any(map(is_tied, state.values())):
        check_state(state, recipe)  # tied (combine_calls): the tie combines this call's amaxes and updates
        return dot_general_with_state(lhs, rhs, dimension_numbers, state, recipe, axis_name, preferred_element_type,
                                      precision)
    _args.layer_state(state, recipe)
    if isinstance(recipe, DelayedScaling):
        linked, _ = _link(tuple(state[k] for k in _KEYS), _Link(recipe, axis_name, True))
        state = dict(zip(_KEYS, linked))
    return dot_general_with_state(lhs, rhs, dimension_numbers, state, recipe, axis_name, preferred_element_type,
                                  precision)


def dot_general_with_state(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                           state: dict[str, jax.Array] | None, recipe: Any, axis_name: Any, preferred_element_type: Any,
                           precision: Any, *, dot: str = "Fp8DotGeneral", tied_only: bool = False) -> jax.Array:
    """fp8_dot_general over a state already linked or tied (its cotangent is this call's amaxes, see _link and
    fp8core.jax.tying); ``dot`` names the dot in errors, ``tied_only`` refuses a state's gradient taken untied."""
    check_precision(precision)
    for arg, t in (("lhs", lhs), ("rhs", rhs)):
        if len(_args.array(t, arg).shape) == 0:
            raise ValueError(f"{arg}: expected at least 1 dimension, got a scalar")
    if isinstance(recipe, NVFP4BlockScaling) or any(len(tuple(d)) for d in dimension_numbers[1]):
        if isinstance(recipe, Float8RowwiseScaling):
            raise ValueError(f"dimension_numbers: {dot} runs Float8RowwiseScaling without batch dimensions; "
                             "fold them into the rows, or use a per-tensor recipe")
        return _batched_dot_general(lhs, rhs, dimension_numbers, state, recipe, axis_name, preferred_element_type,
                                    dot, tied_only)
    lperm, rperm, k, n = _layout(lhs, rhs, dimension_numbers)
    _dtype_name(lhs.dtype, "lhs")
    _dtype_name(rhs.dtype, "rhs")
    out = _dtype_name(preferred_element_type if preferred_element_type is not None
                      else jnp.promote_types(lhs.dtype, rhs.dtype), "preferred_element_type")
    ncontract = len(dimension_numbers[0][0])
    out_shape = tuple(lhs.shape[d] for d in lperm[:lhs.ndim - ncontract]) + \
        tuple(rhs.shape[d] for d in rperm[ncontract:])
    rows = int(np.prod(out_shape[:lhs.ndim - ncontract], dtype=np.int64))  # not reshape's -1: K may be 0
    x = (lhs if lperm == tuple(range(lhs.ndim)) else jnp.transpose(lhs, lperm)).reshape(rows, k)
    w = (rhs if rperm == tuple(range(rhs.ndim)) else jnp.transpose(rhs, rperm)).reshape(k, n)
    # Every GEMM dimension (K, N, and the tokens, which the wgrad GEMM contracts over) padded to the GEMM's
    # multiple of 16 with zeros, an empty one to 16 (the GEMMs need each > 0): they change no amax and add
    # nothing, and the padded outputs are cut off, so the result is the unpadded definition's
    pad_rows, pad_k, pad_n = _pad(rows), _pad(k), _pad(n)
    if pad_rows or pad_k:
        x = jnp.pad(x, ((0, pad_rows), (0, pad_k)))
    if pad_k or pad_n:
        w = jnp.pad(w, ((0, pad_k), (0, pad_n)))
    if isinstance(recipe, Float8RowwiseScaling):  # stateless; w [K, N] as the GEMM's [N, K] operand
        y = rowwise_matmul(x, w.T, recipe, jnp.dtype(out))
        return y[:rows, :n].reshape(out_shape)
    y = _per_tensor(x, w, state, out, _Config(recipe, dot, tied_only), axis_name)
    return y[:rows, :n].reshape(out_shape)


def _pad(size: int) -> int:
    """The zeros that take one GEMM dimension to the GEMM's multiple of 16, and an empty one to 16: a
    contraction over nothing is zeros, an empty output is cut from the padded one."""
    return padding(size, MULTIPLE)


def _dims(dims: Any, x: jax.Array, arg: str, kind: str) -> tuple[int, ...]:
    """dot_general's dims of one operand, each in range (a negative one counted from the end)."""
    out = []
    for d in tuple(dims):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not -x.ndim <= int(d) < x.ndim:
            raise ValueError(f"dimension_numbers: {kind} dim {d!r} of {arg} is not a dimension of its shape "
                             f"{tuple(x.shape)}")
        out.append(int(d) % x.ndim)
    return tuple(out)


def _batched_layout(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any
                    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int, int, int], tuple[int, ...]]:
    """Permutations that put lhs as [batch..., free..., contracting...] and rhs as [batch..., contracting...,
    free...]; (B, M, K, N), the sizes of the [B, M, K] · [B, K, N] they reshape to; and dot_general's output
    shape (batch..., lhs free..., rhs free...)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = _dims(lc, lhs, "lhs", "contracting"), _dims(rc, rhs, "rhs", "contracting")
    lb, rb = _dims(lb, lhs, "lhs", "batch"), _dims(rb, rhs, "rhs", "batch")
    for arg, x, b, c in (("lhs", lhs, lb, lc), ("rhs", rhs, rb, rc)):
        if len(set(b + c)) != len(b + c):
            raise ValueError(f"dimension_numbers: {arg}'s batch dims {b} and contracting dims {c} repeat a "
                             f"dimension (shape {tuple(x.shape)})")
    for what, ld, rd in (("batch", lb, rb), ("contracting", lc, rc)):
        if len(ld) != len(rd) or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(ld, rd)):
            raise ValueError(f"dimension_numbers: {what} dims {ld} of lhs {tuple(lhs.shape)} and {rd} of rhs "
                             f"{tuple(rhs.shape)} do not match")
    lfree = tuple(d for d in range(lhs.ndim) if d not in lb + lc)
    rfree = tuple(d for d in range(rhs.ndim) if d not in rb + rc)

    def size(x: jax.Array, dims: tuple[int, ...]) -> int:
        return int(np.prod([x.shape[d] for d in dims], dtype=np.int64))

    sizes = (size(lhs, lb), size(lhs, lfree), size(lhs, lc), size(rhs, rfree))
    out_shape = tuple(lhs.shape[d] for d in lb + lfree) + tuple(rhs.shape[d] for d in rfree)
    return lb + lfree + lc, rb + rc + rfree, sizes, out_shape


def _batched_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                         state: dict[str, jax.Array] | None, recipe: Any, axis_name: Any,
                         preferred_element_type: Any, dot: str, tied_only: bool) -> jax.Array:
    """dot_general_with_state with batch dims, and every NVFP4BlockScaling dot (B = 1 without batch dims): the batch
    dims moved to the front (transposes in JAX), lhs as [B, M, K] and rhs as [B, K, N], M, K and N zero-padded to
    the GEMMs' multiple (16; NVFP4's 32), an empty batch to one element of zeros (zeros change no amax, no block
    and no sum; the padded outputs are cut off), each batch element's GEMMs those of the unbatched dot, and the
    output put back in dot_general's order. Each operand is quantized once over all its batch elements: one
    per-tensor scale (the amax over the whole operand); under NVFP4 one global amax, with the batch flattened into
    its rows."""
    nvfp4 = isinstance(recipe, NVFP4BlockScaling)
    if nvfp4 and (not isinstance(state, Mapping) or "rng" not in state):
        raise TypeError(f"state: expected NVFP4BlockScaling's state {{'rng': uint32 [4]}}, got {type(state).__name__}")
    rng = check_rng(state["rng"], "state['rng']") if nvfp4 else None
    lperm, rperm, (b, m, k, n), out_shape = _batched_layout(lhs, rhs, dimension_numbers)
    _dtype_name(lhs.dtype, "lhs")
    _dtype_name(rhs.dtype, "rhs")
    out = _dtype_name(preferred_element_type if preferred_element_type is not None
                      else jnp.promote_types(lhs.dtype, rhs.dtype), "preferred_element_type")
    x = jnp.transpose(lhs, lperm).reshape(b, m, k)
    w = jnp.transpose(rhs, rperm).reshape(b, k, n)
    multiple = FP4_GEMM_K if nvfp4 else MULTIPLE
    pad_b, pad_m, pad_k, pad_n = int(b == 0), *(padding(v, multiple) for v in (m, k, n))
    if pad_b or pad_m or pad_k:
        x = jnp.pad(x, ((0, pad_b), (0, pad_m), (0, pad_k)))
    if pad_b or pad_k or pad_n:
        w = jnp.pad(w, ((0, pad_b), (0, pad_k), (0, pad_n)))
    if nvfp4:
        y = nvfp4_matmul(x, jnp.swapaxes(w, 1, 2), rng, recipe, out)
    else:
        y = _per_tensor(x, w, state, out, _Config(recipe, dot, tied_only), axis_name)
    return y[:b, :m, :n].reshape(out_shape)


def _per_tensor(x: jax.Array, w: jax.Array, state: Any, out: str, cfg: _Config, axis_name: Any) -> jax.Array:
    """y [.., M, N] = x [.., M, K] · w [.., K, N] (the kernel's layout; M, K, N multiples of 16, a leading batch
    dim or none) by the Linear's custom_vjp (fp8core.jax.linear_vjp) under a per-tensor recipe; delayed scaling's
    state cotangent is this call's amaxes (see _link)."""
    if isinstance(cfg.recipe, DelayedScaling):
        ops, state = Tensorwise(axis_name, _state_cotangents, cfg), tuple(state[key] for key in _KEYS)
    else:
        ops, state = Tensorwise(axis_name), ()
    return linear_matmul(x, w, state, linear_plan(cfg.recipe), ops.ops(), out, cfg.dot, in_out=True)[0]


class Fp8DotGeneral(nn.Module):
    """A ``dot_general`` for flax's ``dot_general_cls`` slot (``nn.Dense``, ``nn.DenseGeneral``) doing the
    matmul in fp8 with fp8core's kernels; call signature of ``lax.dot_general``, batch dimensions included
    (see :func:`fp8_dot_general`: one scale per operand over all its batch elements).

    recipe: ``fp8core.DelayedScaling`` (amax_history_len, amax_compute_algo "max"/"most_recent", margin,
    power_of_2, epsilon, interval: the scales move every interval-th step as in ScalingState, counted by an
    ``interval_step`` variable) or ``fp8core.Float8CurrentScaling``; fp8_format HYBRID (E4M3 forward, E5M2
    gradients) or E4M3. axis_name: the mesh axis (or axes) of ``shard_map`` over which amaxes are
    MAX-reduced, so every device quantizes with the same scales (needs ``recipe.reduce_amax`` for delayed
    scaling). Shapes: any (``nn.Dense(10)`` too): K (contracted), N (rhs free) and the tokens are zero-padded to
    the fp8 GEMM's multiples of 16 inside the op, which changes no amax and no result (the padded rows and
    columns are cut off), per batch element with batch dims (an empty batch too); lhs/rhs float32, bfloat16
    or float16.
    precision: None or ``lax.Precision.DEFAULT`` (the GEMM is fp8 with float32 accumulation; a layer asking
    for HIGH, HIGHEST or a dot algorithm is refused, naming precision).
    """

    recipe: Any = DelayedScaling(amax_history_len=1024)
    axis_name: Any = None

    def _scaling_variables(self) -> dict[str, jax.Array] | None:
        """The state this call's GEMMs use, linked to the layer's previous call in this trace if there was one
        (see _link): the first call reads the variables and updates them, the later ones hand it their amaxes."""
        check_recipe(self.recipe)
        if isinstance(self.recipe, NVFP4BlockScaling):
            return self._fp4_rng()
        if not isinstance(self.recipe, DelayedScaling):
            return None
        L = self.recipe.amax_history_len
        inits = {"amax_history": lambda: jnp.zeros((L, 3), jnp.float32), "scale": lambda: jnp.ones(3, jnp.float32),
                 "scale_inv": lambda: jnp.ones(3, jnp.float32)}
        keys = state_keys(self.recipe)  # interval 1: no count to keep
        inits["interval_step"] = lambda: jnp.zeros((), jnp.float32)
        read = tuple(self.variable(OVERWRITE_WITH_GRADIENT, k, inits[k]).value for k in keys)
        check_state(dict(zip(keys, read)), self.recipe)
        if any(is_tied(v) for v in read):  # combine_calls: the tie combines every call's amaxes and updates
            return dict(zip(keys, read))
        chains = _chains(self.scope.root)
        previous = chains.get(self.scope.path)
        # the same variables read in the same trace: a module bound once (Module.bind) reads the same arrays in
        # every jit it is traced in, and a token of a finished trace must not reach the next one
        here = (read, current_trace())
        first = (previous is None or previous[0][1] != here[1]
                 or any(a is not b for a, b in zip(previous[0][0], read)))
        mine, following = _link(read if first else previous[1], _Link(self.recipe, self.axis_name, first))
        chains[self.scope.path] = (here, following)
        return dict(zip(keys, mine))

    def _fp4_rng(self) -> dict[str, jax.Array]:
        """NVFP4's ``{"rng": uint32 [4]}`` for this call: the :data:`FP4_RNG` variable (its seed drawn from the
        ``params`` key at init), advanced for the next call where the collection is mutable (a training step)."""
        v = self.variable(FP4_RNG, "rng", lambda: jnp.concatenate(
            [jax.random.bits(self.make_rng("params"), (2,), jnp.uint32), jnp.zeros(2, jnp.uint32)]))
        rng = v.value
        if self.is_mutable_collection(FP4_RNG) and not self.is_initializing():
            v.value = advance_rng(rng)
        return {"rng": rng}

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
        if out_sharding is not None:
            raise ValueError("out_sharding: Fp8DotGeneral takes its sharding from shard_map, not out_sharding")
        return dot_general_with_state(lhs, rhs, dimension_numbers, self._scaling_variables(), self.recipe,
                                      self.axis_name, preferred_element_type, precision)


def einsum_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
               preferred_element_type: Any = None, *, state: Any, recipe: Any, axis_name: Any,
               dot: str = "Fp8Einsum", tied_only: bool = False) -> jax.Array:
    """The dot_general jnp.einsum calls inside :class:`Fp8Einsum` (and the NNX one)."""
    return dot_general_with_state(lhs, rhs, dimension_numbers, state, recipe, axis_name, preferred_element_type,
                                  precision, dot=dot, tied_only=tied_only)


class Fp8Einsum(Fp8DotGeneral):
    """``jnp.einsum(eqn, lhs, rhs)`` of two operands in fp8, as :class:`Fp8DotGeneral` (same recipe, state,
    axis_name; batch dimensions too: attention's ``"bqhd,bkhd->bhqk"`` and ``"bhqk,bkhd->bqhd"``), for modules
    that write their einsums out: ``Fp8Einsum()(eqn, x, kernel)``. jnp.einsum hashes its dot_general, which a
    flax module holding variables cannot be, so this module hands it a plain function over the state instead.
    The state's lhs/rhs columns are the operands in the order jnp.einsum passes them to its dot_general, which
    may be the equation's reverse (jax 0.10 passes ``"bhqk,bkhd->bqhd"``'s v first)."""

    @nn.compact
    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,  # type: ignore[override]
                 preferred_element_type: Any = None) -> jax.Array:
        check_precision(precision)
        dot = partial(einsum_dot, state=self._scaling_variables(), recipe=self.recipe, axis_name=self.axis_name)
        return jnp.einsum(eqn, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type,
                          _dot_general=dot)
