"""NVFP4BlockScaling's operations (Transformer Engine's NVFP4 recipe) for the Linear's plan (fp8core.linear_plan,
run by linear_function.py), traced by torch.compile through the FP4 ops (fp8core.torch.fp4_ops). The numerics are
docs/numerics.md's "FP4" section.

Each operand of a GEMM is quantized with 16-element blocks along that GEMM's K, so each tensor is quantized twice:
rowwise (x itself) and columnwise (x^T), each with its own rule, as TE's recipe sets them (the plan's roles):

  input        rowwise: 1x16, nearest                columnwise (wgrad): Hadamard transform, nearest
  weight       16x16 tiles (1x16 with disable_2d_quantization), nearest, no transform, both usages
  grad_output  rowwise: 1x16, stochastic rounding    columnwise (wgrad): Hadamard transform, stochastic rounding

Stochastic rounding draws its bytes from Philox keyed by (seed, block, offset): the layer's ``fp4_rng`` buffer
(int64 [2]: seed, offset) is copied at the forward and its offset advanced by :data:`STREAMS` per forward that
records a backward (device ops where it lives), so a run repeated with the same seed, or resumed from a state_dict,
draws the same bytes. The backward's quantizations read the copy where it lives (host memory: by value; the GPU:
the kernel reads it), never to the host.
The two gradient quantizations of one step take offsets ``offset`` and ``offset + 1``: independent bytes.
Zero rows add nothing to the sums and, with or without the transform, leave every other element's bits unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8core.layouts import Layout, NVFP4Tensor
from fp8core.linear_plan import LinearPlan, Quantization, RolePlan

from . import fp4_ops as fo

STREAMS = 2  # offsets a step takes: grad_output rowwise (offset) and columnwise (offset + 1)
SEED_BITS = 62  # a drawn seed fits int64 with room: the buffer holds it as it is


def initial_rng(device: Any = None) -> torch.Tensor:
    """A fresh (seed, offset = 0), int64 [2], the seed drawn from torch's default generator (torch.manual_seed
    makes it reproducible)."""
    seed = torch.randint(0, 1 << SEED_BITS, (), dtype=torch.int64)
    return torch.stack([seed, torch.zeros((), dtype=torch.int64)]).to(device)


def quantize(t: torch.Tensor, role: RolePlan, plan: LinearPlan, rowwise: bool, columnwise: bool,
             state: tuple) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """(t's operand, t^T's operand), each only where asked, with its usage's rule; stochastic rounding draws from
    ``state`` (the call's (seed, offset) copy) at the usage's stream."""
    t = t.contiguous()
    return tuple(_quantize(t, q, state, usage) if asked else None
                 for q, usage, asked in ((role.rowwise, False, rowwise), (role.columnwise, True, columnwise)))


def _quantize(t: torch.Tensor, q: Quantization, state: tuple, columnwise: bool) -> NVFP4Tensor:
    if q.stochastic:
        return fo.quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard, stochastic=True,
                                 rng=state[0], stream=q.stream, columnwise=columnwise)
    return fo.quantize_nvfp4(t, weight_2d=q.layout is Layout.NVFP4_16X16, hadamard=q.hadamard,
                             columnwise=columnwise)


gemm = fo.nvfp4_gemm
