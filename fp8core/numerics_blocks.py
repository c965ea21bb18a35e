"""Per-block statistics of a block recipe (``fp8core inspect --blocks``; Transformer Engine's issue 2801): the
distribution of the block scales and the blocks at the scale format's floor and ceiling, each block's dynamic
range, the fraction of its nonzero elements flushed to 0, and the blocks where the recipe loses most, by position.

A block's position is (row_block, col_block) in the measured tensor viewed as [rows, last dim] (nvfp4_rht: in its
operand x^T, so row_block is a column of x and col_block a group of 16 rows of x). The statistics are of the finite
values; a block is "all zero" when it has no nonzero finite value, and the floor/ceiling counts are of the other
blocks (an all-zero block's scale says nothing of the recipe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8core._fpenv import ieee
from fp8core.formats import E4M3
from fp8core.numerics_stats import Recipe, parts, prepare

__all__ = ["BlockScales", "e8m0_scales", "e4m3_scales", "fp32_scales", "block_stats", "WORST", "SCALE_BINS"]

WORST = 8  # the worst blocks named per tensor and recipe
SCALE_BINS = (-160, 160)  # integer log2 bins of the stored block scales: every E8M0, E4M3 and fp32 scale fits


@dataclass(frozen=True)
class BlockScales:
    """A block recipe's scales. ``stored``: float64 [row blocks, col blocks], the scale as its format stores it
    (E8M0 2^(e-127); NVFP4's E4M3 s_b; the fp32 scale_inv of 1x128/128x128). ``floor``/``ceiling``/
    ``subnormal``/``zero``/``nan``: bool masks of the same shape (the format's limits), ``limits``: what floor
    and ceiling are, as text, and their log2 values (for the plot)."""

    format: str
    stored: np.ndarray
    floor: np.ndarray
    ceiling: np.ndarray
    subnormal: np.ndarray
    zero: np.ndarray
    nan: np.ndarray
    limits: str
    log2_floor: float
    log2_ceiling: float


def e8m0_scales(scale: Any) -> BlockScales:
    """MXFP8/MXFP4: E8M0 bytes; floor e = 0 (2^-127), ceiling e = 254 (2^127, saturation), NaN e = 255."""
    e = np.asarray(scale).view(np.uint8)
    stored = np.exp2(e.astype(np.float64) - 127)
    none = np.zeros(e.shape, bool)
    return BlockScales("E8M0", stored, e == 0, e == 254, none, none, e == 255,
                       "floor 2^-127 (e = 0), ceiling 2^127 (e = 254)", -127.0, 127.0)


_E4M3_LIMITS = ("subnormal below 2^-6, zero 0, ceiling 448 (0x7E; the block holding the global amax lands on it by "
                "design)")


def e4m3_scales(scale: Any, global_amax: np.ndarray) -> BlockScales:
    """NVFP4: E4M3 s_b bytes; zero (0x00: the block's elements are multiplied by FLT_MAX and come back 0),
    subnormal (2^-9 .. 7*2^-9), ceiling 448 (0x7E), NaN 0x7F."""
    b = np.asarray(scale).view(np.uint8)
    with np.errstate(invalid="ignore"):
        stored = b.view(E4M3.numpy_dtype).astype(np.float64)
    code = b & 0x7F
    return BlockScales("E4M3", stored, np.zeros(b.shape, bool), code == 0x7E, (code >= 1) & (code <= 7),
                       code == 0, code == 0x7F, _E4M3_LIMITS, -9.0, math.log2(448))


def fp32_scales(scale_inv: Any) -> BlockScales:
    """1x128/128x128: fp32 scale_inv; ceiling where the scale saturated at 2^127 (scale_inv 2^-127: the block's
    amax too small for any larger scale)."""
    s = np.asarray(scale_inv, np.float64)
    none = np.zeros(s.shape, bool)
    return BlockScales("fp32", s, none, s <= 2.0 ** -127, none, none, np.isnan(s),
                       "scale ceiling 2^127 (scale_inv 2^-127)", -127.0, 127.0)


def _by_block(a: np.ndarray, block: tuple[int, int], fill: float = 0.0) -> np.ndarray:
    """a [r, c] as [row blocks, br, col blocks, bc], a partial block at an edge filled with ``fill``."""
    br, bc = block
    pr, pc = -a.shape[0] % br, -a.shape[1] % bc
    if pr or pc:
        a = np.pad(a, ((0, pr), (0, pc)), constant_values=fill)
    return a.reshape(a.shape[0] // br, br, a.shape[1] // bc, bc)


@ieee  # subnormal inputs are values here, not zeros
def _accumulate(x: np.ndarray, y: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Per block of one part: amax, smallest nonzero |x|, nonzero count, flushed count, signal, noise (finite x
    only; noise inf where a finite x came back NaN or inf)."""
    v = x.astype(np.float64)
    fin = np.isfinite(v)
    v = np.where(fin, v, 0.0)
    w = y.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(fin, w - v, 0.0)
    d = np.where(fin & ~np.isfinite(w), np.inf, d)
    a = np.abs(v)
    nz = a > 0
    bv, bd = _by_block(v, block), _by_block(d, block)
    amax = _by_block(a, block).max(axis=(1, 3))
    small = _by_block(np.where(nz, a, np.inf), block, np.inf).min(axis=(1, 3))
    nonzero = _by_block(nz, block).sum(axis=(1, 3))
    flushed = _by_block(nz & (w == 0), block).sum(axis=(1, 3))
    with np.errstate(over="ignore", invalid="ignore"):
        signal = np.einsum("ajbk,ajbk->ab", bv, bv)
        noise = np.where(np.isinf(bd).any(axis=(1, 3)), np.inf, np.einsum("ajbk,ajbk->ab", bd, bd))
    return amax, small, nonzero, flushed, signal, noise


def _sqnr(signal: np.ndarray, noise: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(noise == 0, np.inf, 10 * np.log10(signal / noise))


def block_stats(x: np.ndarray, recipe: Recipe, worst: int = WORST) -> dict[str, Any]:
    """Per-block statistics of x (any shape, viewed as [rows, last dim]) in a block recipe.

    Returns ``blocks`` (count), ``grid`` [row blocks, col blocks], ``block`` [rows, cols]; ``all_zero`` (blocks
    with no nonzero finite value); ``scale``: ``format``, ``limits``, log2 of the stored scales over the other
    blocks (``log2_min``, ``log2_median``, ``log2_max``, ``spread`` = max - min), the counts ``at_floor``,
    ``at_ceiling``, ``subnormal``, ``zero``, ``nan``, and ``hist`` (``lo``: the first bin's integer log2,
    ``counts``: blocks per integer log2 bin floor(log2 scale), over SCALE_BINS, trimmed); ``dynamic_range_log2``
    (log2 of amax / smallest nonzero |x| per block: ``median``, ``max``); ``flushed`` (``blocks`` with an element
    flushed to 0, ``max_fraction`` and ``mean_fraction`` of nonzero elements per block); ``sqnr_db`` per block
    (``min``, ``median``) and ``sqnr_hist`` (1 dB bins from ``lo``); ``worst``: up to ``worst`` blocks, lowest
    SQNR first (a tie: the first in row-major order), each ``row_block``, ``col_block``, ``sqnr_db``, ``amax``,
    ``scale``, ``flushed`` (fraction). {"n/a": why} for a scalar or where the recipe does not apply.
    """
    if recipe.block is None or recipe.block_scales is None:
        raise ValueError(f"recipe: {recipe.name} has no blocks")
    if x.ndim == 0:
        return {"n/a": "a scalar has no blocks"}
    rows2d, q = prepare(x, recipe)
    if q is None:
        return {"n/a": recipe.not_applicable}
    br, bc = recipe.block
    grid = (-(-rows2d.shape[0] // br), -(-rows2d.shape[1] // bc))
    acc = [np.zeros(grid), np.full(grid, np.inf), np.zeros(grid, np.int64), np.zeros(grid, np.int64),
           np.zeros(grid), np.zeros(grid)]
    for r0, r1, c0, c1 in parts(rows2d, recipe):
        _, y = recipe.dequantize_part(q, r0, r1, c0, c1)
        got = _accumulate(rows2d[r0:r1, c0:c1], np.asarray(y), recipe.block)
        at = (slice(r0 // br, r0 // br + got[0].shape[0]), slice(c0 // bc, c0 // bc + got[0].shape[1]))
        for a, g in zip(acc, got):
            a[at] = g
    amax, small, nonzero, flushed, signal, noise = acc
    scales = recipe.block_scales(q)
    stored = scales.stored[:grid[0], :grid[1]]
    live = nonzero > 0
    out: dict[str, Any] = {"blocks": int(np.prod(grid)), "grid": list(grid), "block": [br, bc],
                           "all_zero": int((~live).sum())}
    with np.errstate(divide="ignore", invalid="ignore"):
        log2 = np.log2(stored[live & ~scales.nan[:grid[0], :grid[1]] & (stored > 0)])
    counts = {k: int((getattr(scales, m)[:grid[0], :grid[1]] & live).sum())
              for k, m in (("at_floor", "floor"), ("at_ceiling", "ceiling"), ("subnormal", "subnormal"),
                           ("zero", "zero"), ("nan", "nan"))}
    bins = np.clip(np.floor(log2), *SCALE_BINS).astype(np.int64) - SCALE_BINS[0]
    hist = np.bincount(bins, minlength=SCALE_BINS[1] - SCALE_BINS[0] + 1)
    used = np.flatnonzero(hist)
    out["scale"] = {"format": scales.format, "limits": scales.limits,
                    "log2_floor": scales.log2_floor, "log2_ceiling": scales.log2_ceiling,
                    "log2_min": float(log2.min()) if log2.size else None,
                    "log2_median": float(np.median(log2)) if log2.size else None,
                    "log2_max": float(log2.max()) if log2.size else None,
                    "spread": float(log2.max() - log2.min()) if log2.size else None, **counts,
                    "hist": {"lo": int(used[0] + SCALE_BINS[0]) if used.size else 0,
                             "counts": hist[used[0]:used[-1] + 1].tolist() if used.size else []}}
    dr = np.log2(amax[live] / small[live])
    out["dynamic_range_log2"] = {"median": float(np.median(dr)) if dr.size else None,
                                 "max": float(dr.max()) if dr.size else None}
    frac = flushed[live] / nonzero[live]
    out["flushed"] = {"blocks": int((flushed > 0).sum()), "max_fraction": float(frac.max()) if frac.size else 0.0,
                      "mean_fraction": float(frac.mean()) if frac.size else 0.0}
    sqnr = _sqnr(signal, noise)
    finite = sqnr[live & np.isfinite(sqnr)]
    out["sqnr_db"] = {"min": float(sqnr[live].min()) if live.any() else None,
                      "median": float(np.median(sqnr[live])) if live.any() else None}
    lo = math.floor(finite.min()) if finite.size else 0
    out["sqnr_hist"] = {"lo": lo, "counts": np.bincount(np.floor(finite - lo).astype(np.int64)).tolist()
                        if finite.size else [],
                        "exact": int((live & (sqnr == np.inf)).sum()), "lost": int((live & (sqnr == -np.inf)).sum())}
    flat = np.flatnonzero(live.ravel())
    order = flat[np.argsort(sqnr.ravel()[flat], kind="stable")[:worst]]
    out["worst"] = [{"row_block": int(i // grid[1]), "col_block": int(i % grid[1]),
                     "sqnr_db": float(sqnr.flat[i]), "amax": float(amax.flat[i]), "scale": float(stored.flat[i]),
                     "flushed": float(flushed.flat[i] / nonzero.flat[i])} for i in order]
    return out
