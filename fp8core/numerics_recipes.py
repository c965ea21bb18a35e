"""The recipes a numerics study compares (``fp8core inspect --recipes``, ``fp8core.torch.record_numerics``'s
``recipes=``), by name, each a :class:`fp8core.numerics_stats.Recipe`: per-tensor current scaling in E4M3 and
E5M2, MXFP8 (rceil and floor scales), 1x128 and 128x128 blocks.

The quantization is the library's (its public functions, whole tensor at a time).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fp8core.blocks import dequantize_blocks, quantize_blockwise, quantize_mxfp8
from fp8core.formats import Format
from fp8core.layouts import Layout, ScaledTensor
from fp8core.numerics_stats import Recipe
from fp8core.ops import dequantize, quantize_dynamic

__all__ = ["RECIPES", "BLOCK_RULE", "select"]


def _current(fmt: Format) -> Recipe:
    def part(q: Any, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale_inv = q
        piece = np.ascontiguousarray(data[r0:r1, c0:c1])  # some columns of several rows: a strided view
        return piece, dequantize(piece, scale_inv)

    return Recipe(fmt.value, f"Float8CurrentScaling, Format.{fmt.name}: one scale per tensor from its amax", fmt,
                  lambda x: quantize_dynamic(x, fmt)[:2], part, scale_inv=lambda q: float(q[1][0]))


def _blocked(name: str, doc: str, layout: Layout, quantize: Any) -> Recipe:
    br, bc = layout.block

    def part(t: ScaledTensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        piece = ScaledTensor(np.ascontiguousarray(t.data[r0:r1, c0:c1]),
                             np.ascontiguousarray(t.scale[r0 // br:-(-r1 // br), c0 // bc:-(-c1 // bc)]), layout)
        return piece.data, dequantize_blocks(piece)

    return Recipe(name, doc, Format.E4M3, quantize, part, row_step=br, block=layout.block)


def _mxfp8(mode: str) -> Recipe:
    return _blocked(f"mxfp8_{mode}", f"MXFP8BlockScaling, E4M3, scale_mode {mode}: an E8M0 scale per 1x32 block",
                    Layout.MX_ROWWISE, lambda x: quantize_mxfp8(x, Format.E4M3, scale_mode=mode))


def _blockwise(layout: Layout) -> Recipe:
    return _blocked(f"block_{layout.value}", f"Float8BlockScaling, E4M3: a power-of-2 fp32 scale per {layout.value} "
                    "block", layout, lambda x: quantize_blockwise(x, Format.E4M3, block=layout))


# A tie in SQNR goes to the recipe listed first: one scale per tensor before any block recipe, which has
# scales to keep per block.
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _current(Format.E4M3), _current(Format.E5M2), _mxfp8("rceil"), _mxfp8("floor"),
    _blockwise(Layout.BLOCK_1X128), _blockwise(Layout.BLOCK_128X128))}

BLOCK_RULE = ("block recipes run along the last dimension (a tensor is viewed as [rows, last dim]; 1-D is one "
              "row); a partial block at an edge is zero-padded in effect (its scale comes from its own elements); "
              "a scalar has no blocks: n/a")


def select(names: str | Sequence[str], arg: str = "recipes") -> list[Recipe]:
    """``"all"``, or names from :data:`RECIPES` (a sequence, or one string of comma-separated names), in the
    order given, repeats dropped. ValueError naming ``arg`` for an unknown or empty name."""
    if isinstance(names, str):
        if names.strip() == "all":
            return list(RECIPES.values())
        names = [n.strip() for n in names.split(",")]
    elif not isinstance(names, (list, tuple)):
        raise TypeError(f"{arg}: expected 'all', a comma-separated string or a list of recipe names, got "
                        f"{type(names).__name__}")
    valid = ", ".join(RECIPES)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{arg}: expected recipe names (str), got {type(n).__name__}")
        if n not in RECIPES:
            what = "an empty name" if not n else f"unknown recipe {n!r}"
            raise ValueError(f"{arg}: {what}; expected 'all' or a comma-separated list of {valid}")
    return [RECIPES[n] for n in dict.fromkeys(names)]
