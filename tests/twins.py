"""An fp8 model trained beside its high-precision twin on the same batches: shared by the front-end tests."""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch

from fp8core.torch import autocast, convert_to_float8


def train_beside(ref: torch.nn.Module, fp8: torch.nn.Module, teacher: torch.nn.Module,
                 sample: Callable[[], torch.Tensor], steps: int, lr: float) -> np.ndarray:
    """Losses [steps, 2] (ref, fp8): each model fits teacher's outputs with Adam, the same inputs at each step
    (``sample()``), forward and backward under ``autocast``."""
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in (ref, fp8)]
    losses = np.empty((steps, 2))
    for step in range(steps):
        x = sample()
        with torch.no_grad():
            target = teacher(x)
        for k, (model, opt) in enumerate(zip((ref, fp8), opts)):
            with autocast():
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step, k] = loss.item()
    return losses


def mlp(seed: int) -> torch.nn.Sequential:
    """A 128-256-128 GELU MLP, its weights drawn after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))


def fp32_and_converted_losses(recipe: object) -> tuple[np.ndarray, np.ndarray]:
    """(first, last): mean losses (fp32, converted) over the first 5 and the last 10 of 50 steps, mlp(3) and its
    copy converted under ``recipe`` fitting mlp(5) on the same batches (the front-ends' training test)."""
    teacher, ref = mlp(5), mlp(3)
    converted = convert_to_float8(copy.deepcopy(ref), recipe)
    g = torch.Generator().manual_seed(0)
    losses = train_beside(ref, converted, teacher, lambda: torch.randn(64, 128, generator=g), steps=50, lr=2e-3)
    return np.mean(losses[:5], axis=0), np.mean(losses[-10:], axis=0)
