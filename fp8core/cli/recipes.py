"""The recipes ``fp8core inspect --recipes`` compares. How one tensor fares in each (the statistics, and the
winner and summary over them) is :mod:`fp8core.numerics_stats`'s, shared with ``fp8core.torch.record_numerics``.

The quantization is the library's (its public functions, whole tensor at a time).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import fp8core
from fp8core import BlockScaledTensor, Format, MXTensor
from fp8core.numerics_stats import Recipe, as_rows, measure, summary, winner

from .common import CliError

__all__ = ["RECIPES", "BLOCK_RULE", "Recipe", "as_rows", "measure", "parse_recipes", "summary", "winner"]


def _current(fmt: Format) -> Recipe:
    def rows(q: Any, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale_inv = q
        return data[r0:r1], fp8core.dequantize(data[r0:r1], scale_inv)

    return Recipe(fmt.value, f"Float8CurrentScaling, Format.{fmt.name}: one scale per tensor from its amax", fmt,
                  lambda x: fp8core.quantize_dynamic(x, fmt)[:2], rows, scale_inv=lambda q: float(q[1][0]))


def _mxfp8(mode: str) -> Recipe:
    def rows(t: MXTensor, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        part = MXTensor(t.data[r0:r1], t.scale[r0:r1])
        return part.data, fp8core.dequantize_mxfp8(part)

    return Recipe(f"mxfp8_{mode}", f"MXFP8BlockScaling, E4M3, scale_mode {mode}: an E8M0 scale per 1x32 block",
                  Format.E4M3, lambda x: fp8core.quantize_mxfp8(x, Format.E4M3, scale_mode=mode), rows,
                  block=(1, 32))


def _blockwise(rows_per_block: int) -> Recipe:
    block = f"{rows_per_block}x128"

    def rows(t: BlockScaledTensor, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        scale = t.scale_inv[r0 // rows_per_block:-(-r1 // rows_per_block)]
        part = BlockScaledTensor(t.data[r0:r1], scale)
        return part.data, fp8core.dequantize_blockwise(part)

    return Recipe(f"block_{block}", f"Float8BlockScaling, E4M3: a power-of-2 fp32 scale per {block} block",
                  Format.E4M3, lambda x: fp8core.quantize_blockwise(x, Format.E4M3, block=block), rows,
                  row_step=rows_per_block, block=(rows_per_block, 128))


# A tie in SQNR goes to the recipe listed first: one scale per tensor before any block recipe, which has
# scales to keep per block.
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _current(Format.E4M3), _current(Format.E5M2), _mxfp8("rceil"), _mxfp8("floor"), _blockwise(1),
    _blockwise(128))}

BLOCK_RULE = ("block recipes run along the last dimension (a tensor is viewed as [rows, last dim]; 1-D is one "
              "row); a partial block at an edge is zero-padded in effect (its scale comes from its own elements); "
              "a scalar has no blocks: n/a")


def parse_recipes(text: str) -> list[Recipe]:
    """``all`` or a comma-separated list of names from :data:`RECIPES`, in the order given, repeats dropped."""
    valid = ", ".join(RECIPES)
    if text.strip() == "all":
        return list(RECIPES.values())
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if n not in RECIPES:
            what = "an empty name" if not n else f"unknown recipe {n!r}"
            raise CliError(f"--recipes: {what}; expected 'all' or a comma-separated list of {valid}")
    return [RECIPES[n] for n in dict.fromkeys(names)]
