"""Scaling recipes, in Transformer Engine's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .formats import Format, as_format

__all__ = ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling"]

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


SCALE_MODES = ("rceil", "floor")


def _scale_mode(mode: Any) -> str:
    if not isinstance(mode, str) or mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected 'rceil' (NVIDIA, Transformer Engine) or 'floor' (OCP), got {mode!r}")
    return mode


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """MXFP8 (OCP Microscaling): one E8M0 scale per 32 consecutive elements, made from the block's own amax.

    Stateless, like current scaling. scale_mode: "rceil" rounds the scale up (the block's amax lands at or
    below fp8_max; NVIDIA's hardware conversion and Transformer Engine), "floor" is the OCP specification's.
    """

    fp8_format: Format = Format.E4M3
    scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", as_format(self.fp8_format, arg="fp8_format", allow_hybrid=True))
        _scale_mode(self.scale_mode)


_BLOCK_DIMS = (1, 2)


@dataclass(frozen=True)
class Float8BlockScaling:
    """DeepSeek-V3's block scaling: fp32 scales per 1x128 block (activations, gradients) and per 128x128 tile
    (weights), each from its block's amax by the per-tensor scale rule. Stateless, like current scaling.

    power_of_2: round every block scale down to a power of two (Transformer Engine's default here).
    epsilon: floor of each block's amax. x/w/grad_block_scaling_dim: 1 = 1x128 blocks, 2 = 128x128 tiles.
    """

    fp8_format: Format = Format.E4M3
    power_of_2: bool = True
    epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", as_format(self.fp8_format, arg="fp8_format", allow_hybrid=True))
        if not isinstance(self.power_of_2, bool):
            raise ValueError(f"power_of_2: expected a bool, got {self.power_of_2!r}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) or \
                not float(self.epsilon) >= 0.0 or self.epsilon == float("inf"):
            raise ValueError(f"epsilon: expected a finite value >= 0, got {self.epsilon!r}")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in _BLOCK_DIMS:
                raise ValueError(f"{name}: expected 1 (1x128 blocks) or 2 (128x128 tiles), got {value!r}")
