"""What a hand-written custom op's fake checks, so that torch.compile (fake tensors) and eager agree (the declared
ops get theirs from custom_ops.py): the core's error where the core refuses an argument for its device or its
shape.

A fake also runs in eager mode, as the op's Meta kernel, whenever one argument is on the meta device: left
unchecked it would hand back uninitialised memory (or, for an in-place op, do nothing). So an argument on meta
beside real ones is refused with the core's error. All arguments on meta is shape inference, which the meta
device is for: meta results, no data.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8core import declarations
from fp8core.declare import Spec

__all__ = ["refuse_meta", "matrix"]


def refuse_meta(*named: tuple[str, Optional[torch.Tensor]]) -> None:
    """Raise the core's error for the first argument on the meta device, unless every tensor is there.
    ``named``: (argument name, tensor or None) in the core's order of checks."""
    tensors = [(arg, t) for arg, t in named if t is not None]
    on_meta = [t.is_meta for _, t in tensors]
    if any(on_meta) and not all(on_meta):
        arg, t = tensors[on_meta.index(True)]
        raise ValueError(f"{arg}: torch device 'meta' is neither CPU nor CUDA")  # the core's words


def matrix(t: torch.Tensor, arg: str) -> tuple[int, int]:
    """[rows, cols]: the 2-D view [prod(leading), last] the core folds t to (at least 1 dimension)."""
    return declarations.matrix(Spec.of(t), arg)
