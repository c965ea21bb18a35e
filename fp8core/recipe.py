"""Scaling recipes, in Transformer Engine's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .formats import Format, as_format

__all__ = ["DelayedScaling", "Float8CurrentScaling"]

_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amax history of earlier steps.

    margin: the scale is divided by 2**margin. interval: steps between scale updates (the history rolls
    every step). amax_history_len: L, rows of the history. amax_compute_algo: "max", "most_recent", or a
    callable ``(history[L, N]) -> amax[N]``. scaling_factor_compute_algo: optional callable
    ``(amax[N], scale[N], fp8_max[N], recipe) -> scale[N]``. power_of_2: round scales down to powers of two.
    reduce_amax: all-reduce (MAX) row 0 across the group before each update.
    """

    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    power_of_2: bool = False
    reduce_amax: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", as_format(self.fp8_format, arg="fp8_format", allow_hybrid=True))
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len: expected an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval: expected an int >= 1, got {self.interval!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise ValueError(f"margin: expected an int, got {self.margin!r}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in _ALGOS:
            raise ValueError(f"amax_compute_algo: expected 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError("scaling_factor_compute_algo: expected a callable or None")
        if not float(self.epsilon) >= 0.0:
            raise ValueError(f"epsilon: expected >= 0, got {self.epsilon!r}")


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Current (dynamic) scaling: each tensor is scaled by its own amax, taken just before the cast."""

    fp8_format: Format = Format.HYBRID
    power_of_2: bool = False
    amax_epsilon: float = 0.0
    margin: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", as_format(self.fp8_format, arg="fp8_format", allow_hybrid=True))
        if not float(self.amax_epsilon) >= 0.0 or self.amax_epsilon == float("inf"):
            raise ValueError(f"amax_epsilon: expected a finite value >= 0, got {self.amax_epsilon!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise ValueError(f"margin: expected an int, got {self.margin!r}")
