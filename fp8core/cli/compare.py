"""How ``fp8core inspect --recipes`` shows its comparison: a tensor's recipe rows, the summary, the SQNR chart."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .common import TABLE_WIDTH, cell, label, plot_target, printable
from .recipes import BLOCK_RULE

_LABELLED = 200  # tensors named on the SQNR chart's axis, at most
_NAME_CHARS = 160  # a tensor's name on the chart's axis: longer ones keep both ends ("model.layers.1…q_proj")


def name_width(names: Iterable[str]) -> int:
    """The recipe column's width: 14, or the longest name (a record's Float8CurrentScaling), as printed."""
    return max([14, *(len(printable(n)) for n in names)])


def recipe_head(width: int = 14) -> str:
    """The header of :func:`recipe_lines`' columns, the recipe column ``width`` wide (see :func:`name_width`)."""
    return (f"  {'recipe':<{width}} {'SQNR dB':>8} {'underflow':>9} {'clipped':>8} {'at ±max':>8} "
            f"{'max rel err':>11} blocks")


def recipe_lines(r: dict) -> Iterator[str]:
    """A line per recipe of one tensor's row (``r["recipes"]``), the winner starred."""
    width = name_width(r["recipes"])
    for name, f in r["recipes"].items():
        mark = "*" if name == r["winner"] else " "
        shown = printable(name)  # a record's names come from its file
        if "n/a" in f:
            yield f" {mark}{shown:<{width}} n/a: {printable(str(f['n/a']))}"
            continue
        yield (f" {mark}{shown:<{width}} {cell(f['sqnr_db'], '.2f', 8)} {f['underflow']:>9.2%} {f['clipped']:>8.2%} "
               f"{f['at_max']:>8.2%} {f['max_rel_error']:>11.3g} {'padded' if f.get('padded') else ''}".rstrip())


def recipe_notes(r: dict) -> Iterator[str]:
    """Notes on one tensor's recipes: the finite values a recipe turned into NaN or inf."""
    lost = [f"{printable(n)} {f['lost']:.2%}" for n, f in r["recipes"].items() if f.get("lost")]
    if lost:
        yield (f"finite values that came out NaN or inf ({', '.join(lost)}): a NaN in an MXFP8 block makes the "
               "whole block NaN; SQNR -inf")


def summary_lines(s: dict, what: str = "tensor(s)") -> Iterator[str]:
    """The summary (:func:`fp8core.numerics_stats.summary`) as a table, then the block rule. ``what``: what it
    counts."""
    yield f"over {s['tensors']} {what} with a signal: how often each recipe is the best (*), or within 1 dB of it"
    width = name_width(s["recipes"])
    yield f"  {'recipe':<{width}} {'best':>6} {'within 1 dB':>12}"
    for name, c in s["recipes"].items():
        yield f"  {printable(name):<{width}} {c['best']:>6} {c['within_1db']:>12}"
    yield from textwrap.wrap(f"padded: {BLOCK_RULE}", TABLE_WIDTH)


def plot_recipes(rows: dict[str, dict], names: list[str], out: str, beside: bool = True,
                 title: str | None = None, underflow: bool = False) -> Path:
    """SQNR per tensor (one row each) per recipe (a marker series each), beside the histograms' file
    (``out``.recipes.png), or with ``beside=False`` at ``out`` itself. ``underflow``: a second panel, the
    fraction of nonzero values each recipe flushes to 0 (which SQNR, weighted by energy, barely shows)."""
    import matplotlib.pyplot as plt  # the histograms were drawn first: matplotlib is there, on the Agg backend

    first = plot_target(out)
    target = first.with_name(f"{first.stem}.recipes{first.suffix}") if beside else first
    fig = recipe_figure(rows, names, title, underflow)
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def axis_name(key: str) -> str:
    """A tensor's name as the chart's axis shows it: whole up to _NAME_CHARS characters, else both ends."""
    name = printable(key)
    if len(name) <= _NAME_CHARS:
        return name
    keep = (_NAME_CHARS - 1) // 2
    return name[:keep] + "…" + name[-keep:]


def recipe_figure(rows: dict[str, dict], names: list[str], title: str | None = None, underflow: bool = False) -> Any:
    """The figure :func:`plot_recipes` saves (a matplotlib Figure): as wide as its tensors' names need, so that
    none is cut at the left edge."""
    import matplotlib.pyplot as plt

    keys = list(rows)
    finite = [s for r in rows.values() for f in r["recipes"].values()
              if isinstance(s := f.get("sqnr_db"), float) and math.isfinite(s)]
    top = max(finite, default=0.0) + 5  # exact (inf) results are drawn here, -inf ones at the left edge
    low = min(finite, default=0.0) - 5
    # Past _LABELLED tensors the picture stops growing (matplotlib refuses images over 2^16 pixels) and every
    # k-th tensor is named: a large checkpoint reads as a profile down its layers.
    every = -(-len(keys) // _LABELLED)
    height = 1.2 + 0.28 * min(len(keys), _LABELLED)
    ticks = [label(axis_name(k)) for k in keys[::every]]
    # The names' column: a name of up to ~40 characters fits the margin tight_layout takes from the panels; the
    # figure grows by what longer ones need (7-point characters are at most about 0.6 em wide), so that the
    # panels keep their width and no name runs off the left edge.
    extra = max(0.0, 0.6 * 7 / 72 * max(map(len, ticks), default=0) - 2.5)
    if underflow:
        fig, (ax, flushed) = plt.subplots(1, 2, figsize=(12 + extra, height), sharey=True, width_ratios=(3, 2))
    else:
        fig, ax = plt.subplots(figsize=(9 + extra, height))
    ys = np.arange(len(keys))
    markers = "osD^vP*X"
    for j, name in enumerate(names):
        xs = []
        for k in keys:
            s = rows[k]["recipes"][name].get("sqnr_db")
            xs.append(np.nan if s is None else top if s == math.inf else low if s == -math.inf else s)
        style = {"linestyle": "none", "marker": markers[j % len(markers)], "markersize": 6 / every ** 0.5,
                 "alpha": 0.85}
        ax.plot(xs, ys, label=label(name), **style)
        if underflow:
            flushed.plot([100 * rows[k]["recipes"][name].get("underflow", np.nan) for k in keys], ys, **style)
    best = [rows[k]["recipes"][rows[k]["winner"]]["sqnr_db"] if rows[k]["winner"] else np.nan for k in keys]
    best = [top if b == math.inf else low if b == -math.inf else b for b in best]
    ax.barh(ys, np.nan_to_num(np.array(best, float) - low, nan=0.0), left=low, height=0.8, color="0.9", zorder=0)
    ax.set_yticks(ys[::every], ticks, fontsize=7)
    ax.set_ylim(len(keys) - 0.5, -0.5)  # the file's first tensor on top
    ax.set_xlim(low - 1, top + 1)
    ax.set_xlabel(f"SQNR dB (grey: the best recipe; exact at {top:.0f}, NaN-poisoned at {low:.0f})")
    ax.grid(axis="x", linewidth=0.5, alpha=0.5)
    legend_at = ax
    if underflow:
        flushed.set_xlabel("underflow % (nonzero values that become 0)")
        flushed.set_xlim(left=-0.5)
        flushed.grid(axis="x", linewidth=0.5, alpha=0.5)
        legend_at = flushed
    handles, labels = ax.get_legend_handles_labels()
    legend_at.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="recipe")
    if title:
        fig.suptitle(label(title), fontsize=9)
    fig.tight_layout()
    return fig
