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

Inside ``autocast(enabled=False)`` every Float8Linear runs in high precision. Outside :func:`autocast`, a
Float8Linear built directly (and te.Linear) runs in high precision, as ``nn.Linear`` does: Transformer Engine's
rule. A layer convert_to_float8 made (``autocast_only=False``) runs in fp8 there too, torchao's usage: its group
then updates at the first fp8 forward after an optimizer step (:meth:`SharedScaling.open_step`), so its scales
are kept up to date without a context.
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

RECIPES = (DelayedScaling, fp8core.Float8CurrentScaling, fp8core.MXFP8BlockScaling, fp8core.Float8BlockScaling,
           fp8core.NVFP4BlockScaling, fp8core.Float8RowwiseScaling)
_NAMES = ("DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling, "
          "Float8RowwiseScaling or one of torchao's recipe names 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'")
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
        self._forget_step()

    def _forget_step(self) -> None:
        """No step open (see :meth:`open_step`); no model watched."""
        self._root: Optional[weakref.ref] = None
        self._lead: Optional[int] = None
        self._mark: tuple[int, ...] = ()
        self.backward_ran = False  # set by the members' fp8 backward outside autocast

    def __getstate__(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "steps": self.steps, "next": self._next}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.recipe, self.steps, self._next = state["recipe"], state["steps"], state["next"]
        self._members, self._engine = {}, None
        self._forget_step()

    def watch(self, root: torch.nn.Module) -> None:
        """Read the step boundary outside autocast from ``root``'s trainable parameters (convert_to_float8 passes
        the model it converted: a member frozen under adapters still sees the adapters' steps); without it, from
        the members' own."""
        self._root = weakref.ref(root)

    def _trainable(self) -> tuple[tuple[int, ...], bool]:
        """(the version of each trainable parameter watched, whether any of them holds a gradient)."""
        root = self._root() if self._root is not None else None
        params = root.parameters() if root is not None else \
            (p for m in self.modules() for p in m.parameters(recurse=False))
        trainable = [p for p in params if p.requires_grad]
        return tuple(p._version for p in trainable), any(p.grad is not None for p in trainable)

    @torch.compiler.disable  # Python state and a host read: under torch.compile a graph break; fullgraph=True
    # refuses it, so a fullgraph-compiled delayed-scaling model runs its steps inside autocast (its exit updates)
    def open_step(self, slot: int) -> None:
        """Called by each member's fp8 forward outside autocast, before its casts: close the step that ended, with
        one :meth:`update`, where one did. The member whose forward opened the step (the first to run, usually the
        first layer) looks; the others do nothing more. A step that ran a backward ended when, since it opened, the
        optimizer wrote the parameters (torch counts each in-place write in the tensor's version; torch's fused
        optimizers do not) or their gradients were cleared (``zero_grad()``, which sets them to None by default).
        The micro-batches of gradient accumulation do neither, so their amaxes accumulate into one step, and the
        update runs once per optimizer step. A step with no backward (inference, evaluation) ends at the next
        forward. Not seen: a fused optimizer with ``zero_grad(set_to_none=False)``, a write through ``.data``
        (run those steps inside :func:`autocast`). At the first forward after the group was made, loaded, pickled
        or copied no step is open: it updates where the members hold amaxes of a step not closed (a checkpoint
        saved after an optimizer step carries them; read once, the only time this reads the state's values), so
        a resumed run takes the updates of the run it continues. A forward recomputed inside a backward
        (activation checkpointing) belongs to its step."""
        if (self._lead is not None and slot != self._lead) or torch._C._current_graph_task_id() != -1:
            return
        versions, grads = self._trainable()
        if self._lead is None:
            if any(bool(m._fp8_history[0].any()) for m in self.modules()):
                self.update()
        elif not self.backward_ran or versions != self._mark or not grads:
            self.update()
        self._lead, self._mark, self.backward_ran = slot, versions, False

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
    def __init__(self, recipe: Any, enabled: bool, calibrating: bool = False) -> None:
        if recipe is not None:
            _refuse_unsupported(recipe)
        self.recipe = recipe
        self.enabled = bool(enabled)
        self.calibrating = bool(calibrating) and not self.enabled  # enabled, fp8 runs: nothing to calibrate
        self.ran: dict[SharedScaling, None] = {}  # in forward order: the same on every rank


def current_context() -> Optional[_Context]:
    """The innermost enabled autocast context, or None (Float8Linear then runs in high precision)."""
    stack = getattr(_local, "stack", None)
    if not stack or not stack[-1].enabled:
        return None
    return stack[-1]


def autocast_disabled() -> bool:
    """True inside ``autocast(enabled=False)`` (innermost): every layer runs in high precision there."""
    stack = getattr(_local, "stack", None)
    return bool(stack) and not stack[-1].enabled


def calibrating_context() -> Optional[_Context]:
    """The innermost autocast when it is ``autocast(enabled=False, calibrating=True)``, else None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack and stack[-1].calibrating else None


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Any] = None,
             amax_reduction_group: Any = None) -> Iterator[None]:
    """Transformer Engine's ``te.autocast`` (its arguments, in its order): Float8Linear modules run in fp8 inside;
    te.Linear and a Float8Linear built directly run in high precision outside (a model convert_to_float8 made
    runs in fp8 either way; it needs the context only for ``amax_reduction_group`` or TE's update timing).

    At the exit, each delayed-scaling group whose modules ran inside this context (and only those: two models
    in their own contexts keep apart) MAX-reduces its row 0 of amaxes over ``amax_reduction_group`` (default:
    the world, when torch.distributed is initialised) in one all-reduce and takes one batched update.
    Run the backward inside the context too: several forward/backward passes inside one context accumulate
    their amaxes (gradient accumulation); a module that did not run keeps its scale. ``recipe``, when given,
    must be the modules' own recipe (set by :func:`convert_to_float8` or Float8Linear).
    ``calibrating=True`` with ``enabled=False``: TE's calibration, the layers run in high precision and
    delayed-scaling layers record the amaxes of their input and weight, updated at the exit, so that fp8 starts
    from calibrated scales (with ``enabled=True`` it changes nothing: fp8 runs).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__} (the recipe goes by keyword, "
                        "autocast(recipe=...), as in Transformer Engine)")
    if not isinstance(calibrating, bool):
        raise TypeError(f"calibrating: expected a bool, got {type(calibrating).__name__}")
    ctx = _Context(recipe, enabled, calibrating)
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


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Any] = None,
                 fp8_group: Any = None) -> contextlib.AbstractContextManager:
    """Transformer Engine's older name for :func:`autocast` (``fp8_recipe`` is ``recipe``, ``fp8_group``
    ``amax_reduction_group``), still shipped by TE and called by accelerate's TE path."""
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)


def _refuse_unsupported(recipe: Any) -> None:
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"recipe: expected {_NAMES}, got {type(recipe).__name__}")


def check_recipe(recipe: Any) -> Any:
    if recipe is None:
        return DelayedScaling()
    if isinstance(recipe, str):  # torchao's Float8LinearConfig.from_recipe_name spellings
        recipe = fp8core.recipe.recipe_from_name(recipe)
    _refuse_unsupported(recipe)
    fp8core.args.gemm_recipe_format(recipe)
    if isinstance(recipe, fp8core.Float8BlockScaling):
        check_block_recipe(recipe)
    return recipe
