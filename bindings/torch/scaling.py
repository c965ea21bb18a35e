"""The delayed-scaling state of the torch front-end, and ``autocast``.

Invariant: the state belongs to the modules, and nothing else holds any of it between two calls.
Each delayed-scaling :class:`~fp8core.torch.Float8Linear` owns three float32 tensors for its input, weight and
grad_output: ``fp8_amax_history`` [L, 3], ``fp8_scale`` [3], ``fp8_scale_inv`` [3]. They are plain attributes,
not buffers (DDP would broadcast buffers from rank 0 at every forward, over the amaxes another rank has
accumulated; ``.to(dtype)`` would cast them), and the module's ``_apply`` carries them through every module
transform: ``.to(device)``/``.cuda()``/``.cpu()`` move them, ``.to(dtype)``/``.half()``/``.bfloat16()`` keep
them float32, ``share_memory()`` shares them in place, ``to_empty()`` of a meta-device module gives the initial
state (zero history, scales 1), ``copy.deepcopy``/pickling copy them, ``load_state_dict`` (``assign=True``
too) validates, then writes or assigns them.

A :class:`SharedScaling` (one per :func:`convert_to_float8` call) holds no tensor of a module: it knows its
modules by slot (weakly), and at each update it reads their *current* tensors, gathers them into a workspace
of its own on their device, makes one all-reduce (MAX) of row 0 and one batched update there for the whole
model, and writes the results back. So a transform between two steps, whatever it did to the storage, is seen
at the next step, and the batched update never reads freed or stale memory. (Within one step, from a forward
to its backward, the autograd graph holds the tensors that forward used, as it holds the weight.)

Outside :func:`autocast` (and inside ``autocast(enabled=False)``) Float8Linear runs in high precision, as
``nn.Linear`` does: Transformer Engine's rule. fp8 runs only where its scales are kept up to date.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Iterator, Optional

import torch

import fp8core
from fp8core import DelayedScaling, ScalingState

from .block_linear import check_block_recipe

RECIPES = (DelayedScaling, fp8core.Float8CurrentScaling, fp8core.MXFP8BlockScaling, fp8core.Float8BlockScaling)
_NAMES = "DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling or Float8BlockScaling"
SLOTS = 3  # per Float8Linear: input (forward format), weight (forward), grad_output (backward format)
STATE = ("_fp8_history", "_fp8_scale", "_fp8_scale_inv")
_local = threading.local()


def initial_state(history_len: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(history [L, 3] zeros, scale [3] ones, scale_inv [3] ones), float32 on ``device``."""
    return (torch.zeros(history_len, SLOTS, dtype=torch.float32, device=device),
            torch.ones(SLOTS, dtype=torch.float32, device=device),
            torch.ones(SLOTS, dtype=torch.float32, device=device))


class SharedScaling:
    """The delayed-scaling group of a set of Float8Linear modules: one all-reduce and one batched update per
    step for all of them. It holds the recipe, the step count and weak references to its modules by slot;
    the state itself stays in the modules (see the module docstring). Pickled or deep-copied, it carries the
    recipe and the step count; the copied modules join the copy as they are rebuilt.
    """

    def __init__(self, recipe: DelayedScaling) -> None:
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"recipe: expected DelayedScaling, got {type(recipe).__name__}")
        self.recipe = recipe
        self.steps = 0
        self._members: dict[int, weakref.ref] = {}
        self._next = 0
        self._engine: Optional[ScalingState] = None

    def __getstate__(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "steps": self.steps, "next": self._next}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.recipe, self.steps, self._next = state["recipe"], state["steps"], state["next"]
        self._members, self._engine = {}, None

    def __repr__(self) -> str:
        return f"SharedScaling({len(self.modules())} modules, steps={self.steps}, recipe={self.recipe})"

    def join(self, module: torch.nn.Module, slot: Optional[int] = None) -> int:
        """Add ``module``; returns its slot (the order of the batched update, the same on every rank)."""
        taken = self._members.get(slot) if slot is not None else None
        if slot is None or (taken is not None and taken() is not None and taken() is not module):
            slot = self._next  # a new module, or a shallow copy of a member: a slot of its own
        self._members[slot] = weakref.ref(module)
        self._next = max(self._next, slot + 1)
        return slot

    def modules(self) -> list[torch.nn.Module]:
        """The live modules, in slot order."""
        found = [(s, r()) for s, r in sorted(self._members.items())]
        for s, m in found:
            if m is None:
                del self._members[s]
        return [m for _, m in found if m is not None]

    def _engine_for(self, device: torch.device, count: int) -> ScalingState:
        """The workspace: a ScalingState of our own over a torch buffer on ``device``, made again when the
        modules moved or their number changed (its contents are gathered from the modules at every update)."""
        n = count * SLOTS
        e = self._engine
        if e is None or e.num_tensors != n or e.buffer.device != device:
            fmt = self.recipe.fp8_format
            buf = torch.empty(self.recipe.amax_history_len * n + 2 * n, dtype=torch.float32, device=device)
            e = self._engine = ScalingState(n, self.recipe, [fmt.fwd, fmt.fwd, fmt.bwd] * count,
                                            device=device_name(device), buffer=buf)
        return e

    @torch.no_grad()
    def update(self, group: Any = None) -> None:
        """MAX-reduce every module's row 0 in one all-reduce over ``group`` (when torch.distributed is
        initialised and the recipe reduces amaxes), then one batched update, written back to the modules."""
        mods = self.modules()
        if not mods:
            return
        hists = [m._fp8_history for m in mods]
        device = hists[0].device
        if device.type == "meta":
            return
        L = self.recipe.amax_history_len
        for m, h in zip(mods, hists):
            if h.device != device:
                raise RuntimeError(f"Float8Linear: the delayed-scaling state of one model is on {device} and "
                                   f"{h.device}; move the whole model with .to()")
            if h.shape != (L, SLOTS):
                raise RuntimeError(f"Float8Linear: fp8_amax_history has shape {tuple(h.shape)}, expected "
                                   f"({L}, {SLOTS}) for amax_history_len {L}")
        e = self._engine_for(device, len(mods))
        M = len(mods)
        torch.cat(hists, dim=1, out=e.amax_history)
        torch.cat([m._fp8_scale for m in mods], out=e.scale)
        torch.cat([m._fp8_scale_inv for m in mods], out=e.scale_inv)
        reduce = None
        if self.recipe.reduce_amax and _distributed(group):
            reduce = functools.partial(torch.distributed.all_reduce, op=torch.distributed.ReduceOp.MAX, group=group)
        e.steps = self.steps
        e.update(reduce)
        self.steps = e.steps
        h = e.amax_history.view(L, M, SLOTS).permute(1, 0, 2).contiguous()
        dst = hists + [m._fp8_scale for m in mods] + [m._fp8_scale_inv for m in mods]
        src = list(h.unbind(0)) + list(e.scale.view(M, SLOTS).unbind(0)) + list(e.scale_inv.view(M, SLOTS).unbind(0))
        torch._foreach_copy_(dst, src)


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    return "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else 0}"


def _distributed(group: Any) -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size(group) > 1


class _Context:
    def __init__(self, recipe: Any, enabled: bool) -> None:
        if recipe is not None:
            _refuse_unsupported(recipe)
        self.recipe = recipe
        self.enabled = bool(enabled)
        self.ran: dict[SharedScaling, None] = {}  # in forward order: the same on every rank


def current_context() -> Optional[_Context]:
    """The innermost enabled autocast context, or None (Float8Linear then runs in high precision)."""
    stack = getattr(_local, "stack", None)
    if not stack or not stack[-1].enabled:
        return None
    return stack[-1]


def fp8_enabled() -> bool:
    """True only inside an enabled :func:`autocast`."""
    return current_context() is not None


@contextlib.contextmanager
def autocast(recipe: Optional[DelayedScaling] = None, enabled: bool = True,
             amax_reduction_group: Any = None) -> Iterator[None]:
    """Transformer Engine's usage: Float8Linear modules run in fp8 inside, in high precision outside.

    At the exit, each delayed-scaling group whose modules ran inside this context (and only those: two models
    in their own contexts keep apart) MAX-reduces its row 0 of amaxes over ``amax_reduction_group`` (default:
    the world, when torch.distributed is initialised) in one all-reduce and takes one batched update.
    Run the backward inside the context too: several forward/backward passes inside one context accumulate
    their amaxes (gradient accumulation); a module that did not run keeps its scale. ``recipe``, when given,
    must be the modules' own recipe (set by :func:`convert_to_float8` or Float8Linear).
    """
    ctx = _Context(recipe, enabled)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield
    finally:
        stack.pop()
    groups = list(ctx.ran)
    for shared in groups:
        if recipe is not None and shared.recipe != recipe:
            raise ValueError(f"recipe: autocast's {recipe} is not the modules' recipe {shared.recipe}")
    for shared in groups:
        shared.update(amax_reduction_group)


def _refuse_unsupported(recipe: Any) -> None:
    if isinstance(recipe, fp8core.NVFP4BlockScaling):
        raise NotImplementedError(f"recipe: {recipe}: {fp8core.recipe.FP4_TRAINING}; train with {_NAMES}")
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"recipe: expected {_NAMES}, got {type(recipe).__name__}")


def check_recipe(recipe: Any) -> Any:
    if recipe is None:
        return DelayedScaling()
    _refuse_unsupported(recipe)
    fp8core.args.gemm_recipe_format(recipe)
    if isinstance(recipe, fp8core.Float8BlockScaling):
        check_block_recipe(recipe)
    return recipe
