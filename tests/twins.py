"""An fp8 model trained beside its high-precision twin on the same batches: shared by the front-end tests."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fp8core.torch import autocast


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
