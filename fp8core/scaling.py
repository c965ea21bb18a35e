"""ScalingState: the delayed-scaling state of N tensors in one contiguous allocation, and its batched update."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import backends
from .formats import Format, as_format
from ._tensor import wrap
from .ops import _contiguous, _margin, quantize
from .recipe import DelayedScaling

__all__ = ["ScalingState"]


def _parse_device(device: Any) -> tuple:
    text = str(device)
    if text == "cpu":
        return ("cpu", 0)
    if text == "cuda":
        import cupy

        return ("cuda", cupy.cuda.Device().id)
    if text.startswith("cuda:") and text[5:].isdigit():
        return ("cuda", int(text[5:]))
    raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _external_buffer(buffer: Any, size: int, device: tuple) -> Any:
    t = _contiguous(wrap(buffer, "buffer"), "buffer")
    if t.dtype != "float32" or t.size != size:
        raise ValueError(f"buffer: expected {size} float32 elements, got {t.size} {t.dtype}")
    if t.device != device:
        raise ValueError(f"buffer: is on {t.device_str()}, expected {device[0]}:{device[1]}")
    if t.readonly:
        raise ValueError("buffer: is read-only")
    return t.data.reshape(-1)


class ScalingState:
    """amax_history [L, N], scale [N] and scale_inv [N], float32, in one buffer on ``device``.

    Row 0 of the history is this step's amax of every tensor, contiguous, so one all-reduce covers all N.
    The arrays are NumPy on the CPU and CuPy on a GPU; scales start at 1.0.
    ``formats``: one Format per tensor (default: the recipe's forward format for all).
    ``buffer``: optionally, memory to hold the state in place (any array fp8core reads zero-copy, e.g. a
    framework's tensor): float32, contiguous, ``L * N + 2 * N`` elements on ``device``; it is initialised here.
    """

    def __init__(self, num_tensors: int, recipe: DelayedScaling | None = None,
                 formats: Sequence[Format | str] | None = None, device: Any = "cpu", buffer: Any = None) -> None:
        if not isinstance(num_tensors, int) or num_tensors < 1:
            raise ValueError(f"num_tensors: expected an int >= 1, got {num_tensors!r}")
        self.recipe = recipe if recipe is not None else DelayedScaling()
        if not isinstance(self.recipe, DelayedScaling):
            raise TypeError(f"recipe: expected DelayedScaling, got {type(self.recipe).__name__}")
        n, L = num_tensors, self.recipe.amax_history_len
        if formats is None:
            self.formats = [self.recipe.fp8_format.fwd] * n
        else:
            self.formats = [as_format(f, arg="formats") for f in formats]
            if len(self.formats) != n:
                raise ValueError(f"formats: expected {n} formats, got {len(self.formats)}")
        self.device = _parse_device(device)
        self._backend = backends.for_device(self.device)
        xp = self._backend.xp
        if self.device[0] == "cuda":
            xp.cuda.Device(self.device[1]).use()
        self.buffer = xp.zeros(L * n + 2 * n, dtype=xp.float32) if buffer is None else \
            _external_buffer(buffer, L * n + 2 * n, self.device)
        self.buffer[...] = 0
        self.amax_history = self.buffer[: L * n].reshape(L, n)
        self.scale = self.buffer[L * n: L * n + n]
        self.scale_inv = self.buffer[L * n + n:]
        self.scale[...] = 1.0
        self.scale_inv[...] = 1.0
        self.fp8_max = xp.asarray(np.array([f.max for f in self.formats], np.float32))
        self.non_finite = xp.zeros(n, dtype=xp.bool_)
        self.steps = 0

    @property
    def num_tensors(self) -> int:
        return self.scale.shape[0]

    def quantize(self, x: Any, index: int) -> Any:
        """Quantize x as tensor ``index``: its scale, its format, its amax into row 0."""
        i = int(index)
        return quantize(x, self.scale[i:i + 1], self.formats[i], amax_out=self.amax_history[0, i:i + 1])

    def update(self, reduce: Callable[[Any], None] | None = None) -> None:
        """The batched update of the contract: optionally ``reduce(row0)`` (MAX, in place), then every tensor's
        scale from its history and the history rolled; one kernel launch on a GPU, no host synchronisation.
        """
        r = self.recipe
        if reduce is not None:
            reduce(self.amax_history[0])
        update_scale = self.steps % r.interval == 0
        self.steps += 1
        if callable(r.amax_compute_algo) or r.scaling_factor_compute_algo is not None:
            self._update_callable(update_scale)
            return
        step: dict[str, Any] = {}
        if self.device[0] == "cuda" and r.interval > 1:
            # The interval's counter lives on the device, so a captured graph replays the schedule; it is made
            # again from self.steps when the host count moved without it (load_state_dict).
            if getattr(self, "_step_counter_at", None) != self.steps - 1:
                self._step_counter = self._backend.step_counter((self.steps - 1) % r.interval, self.amax_history)
            self._step_counter_at = self.steps
            step = {"step": self._step_counter, "interval": r.interval}
        self._backend.update(self.amax_history, self.scale, self.scale_inv, self.fp8_max, _margin(r.margin),
                             r.amax_compute_algo, r.power_of_2, float(r.epsilon), update_scale, self.non_finite,
                             **step)

    def _update_callable(self, update_scale: bool) -> None:
        """The slower array path for callable algorithms: same roll, same did-not-run rule."""
        r, xp, H = self.recipe, self._backend.xp, self.amax_history
        cur = H[0].copy()
        ran = cur != 0
        self.non_finite[...] = ~xp.isfinite(cur)
        if update_scale:
            if callable(r.amax_compute_algo):
                a = xp.asarray(r.amax_compute_algo(H), dtype=xp.float32).reshape(-1)
            else:
                a = H.max(axis=0) if r.amax_compute_algo == "max" else cur
            if r.scaling_factor_compute_algo is not None:
                s = xp.asarray(r.scaling_factor_compute_algo(a, self.scale, self.fp8_max, r), dtype=xp.float32)
                ok = ran & xp.isfinite(s) & (s != 0)
                s_inv = xp.float32(1) / xp.where(ok, s, xp.float32(1))
            else:
                s, s_inv, ok = self._backend.scale_rule(a, self.fp8_max, _margin(r.margin), r.power_of_2,
                                                        float(r.epsilon))
                ok = ran & ok
            self.scale[ok] = s[ok]
            self.scale_inv[ok] = s_inv[ok]
        from .backends.cpu import roll

        roll(H, ran, cur, H.shape[0])

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        src = state["buffer"]
        if tuple(src.shape) != tuple(self.buffer.shape):
            raise ValueError(f"state: buffer shape {tuple(src.shape)} does not match {tuple(self.buffer.shape)}")
        self.buffer[...] = self._backend.xp.asarray(src)
        self.steps = int(state["steps"])
