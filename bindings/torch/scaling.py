"""The delayed-scaling state the torch front-end shares between modules, and ``autocast``.

One :class:`SharedScaling` holds a :class:`fp8core.ScalingState` for every fp8 tensor of a set of modules
(3 per Float8Linear: input, weight, grad_output) in one torch buffer, so that one all-reduce of row 0 and
one batched update serve them all.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import Any, Iterator, Optional

import torch

import fp8core
from fp8core import DelayedScaling, Format, ScalingState

SLOTS = 3  # per Float8Linear: input (forward format), weight (forward), grad_output (backward format)
_live: "weakref.WeakSet[SharedScaling]" = weakref.WeakSet()
_local = threading.local()


class SharedScaling:
    """``num_modules * 3`` fp8 tensors' delayed-scaling state in ``buffer`` (a float32 torch tensor)."""

    def __init__(self, num_modules: int, recipe: DelayedScaling, device: torch.device) -> None:
        fmt = recipe.fp8_format
        n = num_modules * SLOTS
        self.recipe = recipe
        self.num_tensors = n
        self.history_len = recipe.amax_history_len
        self.buffer = torch.zeros(self.history_len * n + 2 * n, dtype=torch.float32, device=device)
        self.formats = [fmt.fwd, fmt.fwd, fmt.bwd] * num_modules
        self.state = ScalingState(n, recipe, self.formats, device=_device_name(device), buffer=self.buffer)
        self._claimed = 0
        _live.add(self)

    def __deepcopy__(self, memo: dict) -> "SharedScaling":
        """A copy over the copied buffer (copy.deepcopy of a model copies its state with it)."""
        new = SharedScaling.__new__(SharedScaling)
        new.recipe, new.num_tensors, new.history_len = self.recipe, self.num_tensors, self.history_len
        new.formats, new._claimed = self.formats, self._claimed
        new.buffer = copy.deepcopy(self.buffer, memo)
        new.state = ScalingState(self.num_tensors, self.recipe, self.formats, device=_device_name(new.buffer.device),
                                 buffer=new.buffer)
        new.buffer.copy_(self.buffer)
        new.state.steps = self.state.steps
        _live.add(new)
        return new

    def claim(self) -> int:
        """The first of the next module's 3 slots."""
        if self._claimed + SLOTS > self.num_tensors:
            raise RuntimeError("SharedScaling: every slot is taken")
        first = self._claimed
        self._claimed += SLOTS
        return first

    @property
    def row0(self) -> torch.Tensor:
        return self.buffer[: self.num_tensors]

    def update(self, group: Any = None, reduce: bool = True) -> None:
        """MAX-reduce row 0 over ``group`` (when torch.distributed is initialised), then one batched update."""
        if reduce and self.recipe.reduce_amax and _distributed(group):
            torch.distributed.all_reduce(self.row0, op=torch.distributed.ReduceOp.MAX, group=group)
        if self.buffer.is_cuda:
            from fp8core.backends.cuda import launch_stream

            with launch_stream(torch.cuda.current_stream(self.buffer.device).cuda_stream):
                self.state.update()
        else:
            self.state.update()


def _device_name(device: torch.device) -> str:
    device = torch.device(device)
    return "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else 0}"


def _distributed(group: Any) -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size(group) > 1


def fp8_enabled() -> bool:
    """False only inside ``autocast(enabled=False)``: there Float8Linear runs in high precision."""
    stack = getattr(_local, "stack", None)
    return not stack or stack[-1].enabled


@contextlib.contextmanager
def autocast(recipe: Optional[DelayedScaling] = None, enabled: bool = True,
             amax_reduction_group: Any = None) -> Iterator[None]:
    """Transformer Engine's usage: Float8Linear modules run in fp8 inside; at the exit, every live
    delayed-scaling state MAX-reduces its row 0 of amaxes over ``amax_reduction_group`` (default: the
    world, when torch.distributed is initialised; NCCL on GPU, gloo on CPU) and takes one batched update.

    Several forward/backward passes inside one context accumulate their amaxes (gradient accumulation);
    a module that did not run keeps its scale. ``recipe``, when given, must be the modules' own recipe
    (set by :func:`convert_to_float8` or Float8Linear).
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
    if not enabled:
        return
    for shared in list(_live):
        if recipe is not None and shared.recipe != recipe:
            raise ValueError(f"recipe: autocast's {recipe} is not the modules' recipe {shared.recipe}")
        shared.update(amax_reduction_group)


class _Context:
    def __init__(self, recipe: Optional[DelayedScaling], enabled: bool) -> None:
        if recipe is not None and not isinstance(recipe, (DelayedScaling, fp8core.Float8CurrentScaling)):
            raise TypeError(f"recipe: expected DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
        self.recipe = recipe
        self.enabled = bool(enabled)


def check_recipe(recipe: Any) -> Any:
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, fp8core.Float8CurrentScaling)):
        raise TypeError(f"recipe: expected DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
    if recipe.fp8_format is Format.E5M2:
        raise ValueError("recipe: fp8_format E5M2 would make E5M2 x E5M2 GEMMs, which have no FP8 kernel; "
                         "use Format.HYBRID (E4M3 forward, E5M2 backward) or Format.E4M3")
    return recipe
