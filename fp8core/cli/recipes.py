"""The recipes ``fp8core inspect --recipes`` compares, and how one tensor fares in each.

The quantization is the library's (its public functions, whole tensor at a time); only the error statistics
are computed here, over row chunks of the dequantized result so that no float64 copy of a whole tensor exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import fp8core
from fp8core import BlockScaledTensor, Format, MXTensor

from .common import CliError

_CHUNK = 1 << 20  # elements per step of the statistics


@dataclass(frozen=True)
class Recipe:
    """One way to quantize a tensor. ``quantize`` takes the tensor as [rows, cols] (float32/bfloat16/float16);
    ``dequantize_rows(q, r0, r1)`` gives rows r0:r1 back as (fp8 data, float32 values); ``row_step`` is the row
    granularity of its scales (r0 is always a multiple of it); ``block`` the block's (rows, cols), None for
    one scale per tensor."""

    name: str
    what: str
    fmt: Format
    quantize: Callable[[np.ndarray], Any]
    dequantize_rows: Callable[[Any, int, int], tuple[np.ndarray, np.ndarray]]
    row_step: int = 1
    block: tuple[int, int] | None = None


def _current(fmt: Format) -> Recipe:
    def rows(q: Any, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale_inv = q
        return data[r0:r1], fp8core.dequantize(data[r0:r1], scale_inv)

    return Recipe(fmt.value, f"Float8CurrentScaling, Format.{fmt.name}: one scale per tensor from its amax", fmt,
                  lambda x: fp8core.quantize_dynamic(x, fmt)[:2], rows)


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


# Cheapest first: a tie in SQNR goes to the recipe listed first.
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


def as_rows(x: np.ndarray) -> np.ndarray:
    """x as [rows, last dim] in a dtype the quantizers take: float32/bfloat16/float16 as they are (native byte
    order, C order), anything else converted to float32."""
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if x.dtype.name not in ("float32", "bfloat16", "float16"):
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)
    x = np.ascontiguousarray(x)
    return x.reshape(1, x.size) if x.ndim <= 1 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def measure(x: np.ndarray, recipe: Recipe) -> dict[str, Any]:
    """How x fares in one recipe, over its finite values (x: any shape; :func:`as_rows` is applied).

    sqnr_db: 10 log10(sum x^2 / sum (y - x)^2), inf when exact, None without signal, -inf when a finite value
    came out NaN or inf (an MXFP8 block holding a NaN is NaN throughout: counted in ``lost``). underflow:
    fraction of the nonzero values that become 0. clipped: fraction more than half a step beyond the largest
    magnitude their block represents (they land on it: saturated, where rounding would have gone higher). at_max: fraction that land on +-max, clipped ones included.
    max_rel_error: over the nonzero values. padded: a block recipe whose blocks do not tile the shape.
    """
    if recipe.block is not None and x.ndim == 0:
        return {"n/a": "a scalar has no blocks"}
    rows2d = as_rows(x)
    q = recipe.quantize(rows2d)
    max_code = int(np.array(recipe.fmt.max, np.float32).astype(recipe.fmt.numpy_dtype).view(np.uint8))
    below_max = float(np.array(max_code - 1, np.uint8).view(recipe.fmt.numpy_dtype))
    # Within half a step above max a value rounds onto max like any other value; beyond it, it saturates.
    beyond = 1 + (recipe.fmt.max - below_max) / (2 * recipe.fmt.max)
    n_rows, n_cols = rows2d.shape
    step = max(1, _CHUNK // max(n_cols, 1) // recipe.row_step) * recipe.row_step
    signal = noise = max_rel = 0.0
    finite = nonzero = under = clipped = at_max = lost = 0
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        codes, y32 = recipe.dequantize_rows(q, r0, r1)
        v = rows2d[r0:r1].astype(np.float64)
        y = np.asarray(y32, np.float64)
        fin = np.isfinite(v)
        bad = fin & ~np.isfinite(y)
        ok = fin & ~bad
        lost += int(bad.sum())
        finite += int(fin.sum())
        signal += float(np.sum(v[fin] ** 2))
        noise += float(np.sum((y[ok] - v[ok]) ** 2))
        nz = ok & (v != 0)
        nonzero += int((fin & (v != 0)).sum())
        under += int((nz & (y == 0)).sum())
        top = ok & ((codes.view(np.uint8) & 0x7F) == max_code)
        at_max += int(top.sum())
        clipped += int((top & (np.abs(v) > np.abs(y) * beyond)).sum())
        if nz.any():
            max_rel = max(max_rel, float(np.max(np.abs((y[nz] - v[nz]) / v[nz]))))
    if lost:
        sqnr: float | None = -math.inf
        max_rel = math.inf
    elif signal > 0:
        sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise)
    else:
        sqnr = None
    row: dict[str, Any] = {
        "sqnr_db": sqnr,
        "underflow": under / nonzero if nonzero else 0.0,
        "clipped": clipped / finite if finite else 0.0,
        "at_max": at_max / finite if finite else 0.0,
        "max_rel_error": max_rel,
        "lost": lost / finite if finite else 0.0,
    }
    if recipe.block is not None:
        row["padded"] = bool(n_cols % recipe.block[1] or (recipe.block[0] > 1 and n_rows % recipe.block[0]))
    return row


def winner(results: dict[str, dict]) -> str | None:
    """The recipe with the highest SQNR (the first listed on a tie), None when no recipe has one."""
    best, name = None, None
    for n, r in results.items():
        s = r.get("sqnr_db")
        if s is not None and (best is None or s > best):
            best, name = s, n
    return name


def summary(per_tensor: list[dict[str, dict]], names: list[str]) -> dict[str, Any]:
    """Over the tensors that have a winner: per recipe, how many it wins and how many it serves within 1 dB of
    that tensor's best SQNR."""
    out: dict[str, Any] = {"tensors": 0, "recipes": {n: {"best": 0, "within_1db": 0} for n in names}}
    for results in per_tensor:
        top = winner(results)
        if top is None:
            continue
        out["tensors"] += 1
        out["recipes"][top]["best"] += 1
        best = results[top]["sqnr_db"]
        for n, r in results.items():
            s = r.get("sqnr_db")
            if s is not None and s >= best - 1.0:
                out["recipes"][n]["within_1db"] += 1
    return out
