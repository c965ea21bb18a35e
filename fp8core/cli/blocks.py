"""How ``fp8core inspect --recipes ... --blocks`` shows the per-block statistics
(:func:`fp8core.numerics_blocks.block_stats`): lines under a tensor's recipe rows, and one chart over every tensor
(OUT.blocks.png: per block recipe, the histogram of its stored block scales with the format's floor and ceiling
marked, beside the histogram of per-block SQNR)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np

from .common import TABLE_WIDTH, label, plot_target, printable


def _position(w: dict) -> str:
    return f"({w['row_block']},{w['col_block']}) {w['sqnr_db']:.1f} dB"


def block_lines(r: dict) -> Iterator[str]:
    """Lines per block recipe of one tensor's row (``r["blocks"]``), TABLE_WIDTH columns at most."""
    for name, b in r.get("blocks", {}).items():
        step = f" (step {b['step']})" if "step" in b else ""  # a record's: the step whose worst block is worst
        head = f"  blocks {printable(name)}{step}: "
        if "n/a" in b:
            yield f"{head}n/a: {printable(str(b['n/a']))}"
            continue
        s = b["scale"]
        spread = (f"log2 {s['log2_min']:.1f}..{s['log2_max']:.1f} (spread {s['spread']:.1f})"
                  if s["spread"] is not None else "no live block")
        limits = ", ".join(f"{k.replace('_', ' ')} {s[k]}" for k in ("at_floor", "at_ceiling", "subnormal", "zero",
                                                                     "nan") if s[k])
        dr = b["dynamic_range_log2"]
        text = (f"{b['blocks']} of {b['block'][0]}x{b['block'][1]}, {b['all_zero']} all zero; {s['format']} scales "
                f"{spread}{'; ' + limits if limits else ''}; flushed elements in {b['flushed']['blocks']} "
                f"(worst {b['flushed']['max_fraction']:.0%})")
        if dr["max"] is not None:
            text += f"; range 2^{dr['median']:.1f} median, 2^{dr['max']:.1f} max"
        if b["worst"]:
            text += "; worst (row,col block): " + ", ".join(_position(w) for w in b["worst"][:3])
        yield from textwrap.wrap(text, TABLE_WIDTH, initial_indent=head, subsequent_indent=" " * 4)


def _summed(hists: list[dict]) -> tuple[int, np.ndarray]:
    """Histograms {lo, counts} of integer bins summed into one: (lo, counts)."""
    hists = [h for h in hists if h["counts"]]
    if not hists:
        return 0, np.zeros(0, np.int64)
    lo = min(h["lo"] for h in hists)
    hi = max(h["lo"] + len(h["counts"]) for h in hists)
    out = np.zeros(hi - lo, np.int64)
    for h in hists:
        out[h["lo"] - lo:h["lo"] - lo + len(h["counts"])] += h["counts"]
    return lo, out


def plot_blocks(rows: dict[str, dict], names: list[str], out: str, title: str | None = None) -> Path:
    """OUT.blocks.png beside the histograms' file: a row per block recipe in ``names``, over every tensor of
    ``rows`` (their ``blocks``)."""
    import matplotlib.pyplot as plt

    first = plot_target(out)
    target = first.with_name(f"{first.stem}.blocks{first.suffix}")
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 2.4 * len(names) + 0.6), squeeze=False)
    for (scales, loss), name in zip(axes, names):
        stats = [r["blocks"][name] for r in rows.values() if "n/a" not in r["blocks"].get(name, {"n/a": 1})]
        if not stats:
            scales.set_title(label(f"{name}: no tensor measured"), fontsize=9)
            continue
        s0 = stats[0]["scale"]
        lo, counts = _summed([b["scale"]["hist"] for b in stats])
        scales.bar(lo + np.arange(len(counts)) + 0.5, counts, width=1.0, color="0.35")
        flagged = {k: sum(b["scale"][k] for b in stats) for k in ("at_floor", "at_ceiling", "subnormal", "zero")}
        # the data's binades and the limits near them: E8M0's 2^-127 and 2^127 would squeeze the data to a line
        left, right = (lo - 3, lo + len(counts) + 3) if len(counts) else (s0["log2_floor"], s0["log2_ceiling"])
        edges = [(s0["log2_floor"], "floor" if s0["format"] != "E4M3" else "smallest subnormal", "tab:red"),
                 (s0["log2_ceiling"], "ceiling", "tab:red")]
        if s0["format"] == "E4M3":
            edges.insert(1, (-6.0, "smallest normal", "tab:orange"))
        off = []
        for x, what, colour in edges:
            if left - 12 <= x <= right + 12 or flagged["at_floor" if what == "floor" else "at_ceiling"]:
                left, right = min(left, x - 1), max(right, x + 1)
                scales.axvline(x, color=colour, linestyle="--", linewidth=1)
                scales.annotate(what, (x, 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                                va="top", ha="right")
            else:
                off.append(f"{what} 2^{x:.0f}")
        if flagged["zero"]:  # a zero scale has no log2: its own red bar left of the axis's data
            left -= 3
            scales.bar(left + 1.5, flagged["zero"], width=1.0, color="tab:red")
            scales.annotate("zero", (left + 1.5, 1), xycoords=("data", "axes fraction"), fontsize=7, va="top",
                            ha="center")
        scales.set_xlim(left, right)
        note = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in flagged.items() if v) or "none at the limits"
        total = sum(b["blocks"] - b["all_zero"] for b in stats)
        scales.set_title(label(f"{name}: {s0['format']} block scales of {total} nonzero blocks ({note})"),
                         fontsize=9)
        scales.set_xlabel("log2 stored block scale" + (f" ({', '.join(off)}: off the axis)" if off else ""))
        scales.set_ylabel("blocks")
        lo, counts = _summed([b["sqnr_hist"] for b in stats])
        loss.bar(lo + np.arange(len(counts)) + 0.5, counts, width=1.0, color="tab:blue")
        worst = min((w for b in stats for w in b["worst"]), key=lambda w: w["sqnr_db"], default=None)
        exact = sum(b["sqnr_hist"]["exact"] for b in stats)
        text = f"{name}: per-block SQNR ({exact} exact blocks not drawn)"
        if worst is not None and math.isfinite(worst["sqnr_db"]):
            loss.axvline(worst["sqnr_db"], color="tab:red", linewidth=1)
            text += f"; worst {worst['sqnr_db']:.1f} dB"
        loss.set_title(label(text), fontsize=9)
        loss.set_xlabel("SQNR dB of a block")
    if title:
        fig.suptitle(label(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target
