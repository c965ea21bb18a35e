"""``fp8core inspect``: per tensor, its amax and how it fares in E4M3 and E5M2 (or in each recipe of
``--recipes``), as a table, JSON or a plot."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

import fp8core
from fp8core import Format
from fp8core.backends.cpu import map_spans, pool_threads
from fp8core.backends.cpu_threads import cpu_threads
from fp8core.extras import install_hint
from fp8core.formats import E2M1, ENCODINGS, FP8_DTYPES, HIGH_PRECISION_DTYPES
from fp8core.numerics_blocks import block_stats
from fp8core.numerics_stats import strict_json
from fp8core.selftest.gpu import one_line

from .blocks import block_lines, plot_blocks
from .common import TABLE_WIDTH, CliError, cell, label, plot_target, printable, progress, status
from .compare import plot_recipes, recipe_head, recipe_lines, recipe_notes, summary_lines
from .files import iter_tensors
from .record import SUFFIX as RECORD_SUFFIX
from .record import inspect_records
from .recipes import BLOCK_RULE, Recipe, measure, parse_recipes, summary, winner

_CHUNK = 1 << 20  # elements per step of the statistics
BLOCK_POSITIONS = ("a block is named (row_block, col_block) in the tensor viewed as [rows, last dim] (nvfp4_rht: in "
                   "x^T); its statistics are of its finite values")
# fp8core's own scaling state as its front-ends write it into checkpoints: the state_dict entries of a torch
# Float8Linear (fp8core.torch's te.Linear too), and fp8core.jax's collection (flax's, which its layers share).
# Not model tensors: listed apart, never measured, in no summary or chart.
FP8_STATE_KEYS = ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_steps")
FP8_STATE_COLLECTION = "_overwrite_with_gradient"
FP8_STATE = ("fp8core's delayed-scaling state (a Float8Linear's fp8_amax_history, fp8_scale, fp8_scale_inv, "
             "fp8_steps; fp8core.jax's _overwrite_with_gradient collection): not a model tensor, not measured")
RAW_FP8 = {f.value: f.dtype_name for f in ENCODINGS}  # --raw-fp8: what 1-byte raw data is read as
_HIST_BINS = np.linspace(-152.0, 130.0, 565)  # log2|x| of every finite fp32/fp64-in-fp32-range value, 0.5 wide


def _raw_bytes_dtype(x: np.ndarray, raw_fp8: str) -> tuple[np.ndarray, str | None]:
    """ml_dtypes arrays saved to .npy come back as raw bytes (|V1, |V2): the header names no float type."""
    if x.dtype.kind != "V" or x.dtype.fields is not None:
        return x, None
    import ml_dtypes

    if x.dtype.itemsize == 1:
        name = RAW_FP8[raw_fp8]
        others = " or ".join(n for n in RAW_FP8 if n != raw_fp8)
        note = f"raw 1-byte data (|V1) read as {name}; --raw-fp8 {others} for the other"
        return x.view(getattr(ml_dtypes, name)), note
    if x.dtype.itemsize == 2:
        return x.view(ml_dtypes.bfloat16), "raw 2-byte data (|V2) read as bfloat16 (how ml_dtypes saves it)"
    return x, None


def _measurable(x: np.ndarray, raw_fp8: str) -> tuple[np.ndarray | None, str | None]:
    """The data in a dtype fp8core's amax and quantize take, or None; and a note on what was done to it."""
    x, note = _raw_bytes_dtype(x, raw_fp8)
    name = x.dtype.name
    if not x.dtype.isnative and x.dtype.itemsize > 1:  # converted chunk by chunk (_chunk_f32)
        note = f"big-endian {name} data: read in native byte order"
    if name in HIGH_PRECISION_DTYPES:
        return x, note
    if name in FP8_DTYPES:
        return x, note or f"{name} data: statistics of re-quantizing its values"
    if x.dtype.kind == "f":
        return x, f"{name} data: rounded to float32 first" + (f" ({note})" if note else "")
    if x.dtype.kind in "iub":
        return x, f"integer data ({name}): statistics of its float32 conversion" + (f" ({note})" if note else "")
    return None, None


def _chunk_f32(x: np.ndarray, a: int, b: int) -> np.ndarray:
    c = x[a:b]
    if not c.dtype.isnative:  # a file's byte order is the file's business: read it in ours
        c = c.astype(c.dtype.newbyteorder("="))
    if c.dtype.name in HIGH_PRECISION_DTYPES:
        return np.ascontiguousarray(c)
    with np.errstate(over="ignore"):
        return c.astype(np.float32)


def tensor_stats(x: np.ndarray, raw_fp8: str = "e4m3", hist: np.ndarray | None = None,
                 scale: float | None = None,
                 formats: tuple[Format, ...] = tuple(ENCODINGS)) -> dict[str, Any]:
    """How x fares in E4M3 and E5M2 under current scaling with a power-of-2 scale.

    Per format: scale (from the amax of the finite values), sqnr_db (over the finite values; inf when exact,
    None when there is no signal), underflow (nonzero values that become 0), clipped (values with
    |x * scale| > max before the cast, which saturate), at_max (values that land on +-max, clipped ones
    included), max_rel_error. Fractions are of the finite values. nan and inf count the non-finite inputs.
    ``scale``, when given, replaces the per-format scale. ``hist``, when given, accumulates a histogram of
    log2|x| over :data:`_HIST_BINS`. ``formats``: those measured (none under ``--recipes``, whose rows
    replace them).
    """
    row: dict[str, Any] = {"shape": list(x.shape), "dtype": str(x.dtype)}
    data, note = _measurable(x, raw_fp8)
    if note:
        row["note"] = note
    if data is None:
        row["skipped"] = f"not real-valued numbers ({x.dtype})"
        return row
    row["dtype"] = str(data.dtype if data.dtype.isnative else data.dtype.newbyteorder("="))
    flat = data.reshape(-1, order="A") if data.flags.f_contiguous else data.reshape(-1)
    n = flat.size
    bounds = [(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]
    amax_bits, finite_amax, nans, infs = 0, 0.0, 0, 0
    for a, b in bounds:
        c = _chunk_f32(flat, a, b)
        bits = int(fp8core.amax(c).view(np.uint32)[0])
        amax_bits = max(amax_bits, bits)
        if bits < 0x7F800000 and hist is None:  # all finite: nothing to count, the amax is the finite amax
            finite_amax = max(finite_amax, float(np.array([bits], np.uint32).view(np.float32)[0]))
            continue
        v = c.astype(np.float64)
        fin = np.isfinite(v)
        nans += int(np.isnan(v).sum())
        infs += int((~fin).sum()) - int(np.isnan(v).sum())
        if fin.any():
            av = np.abs(v[fin])
            finite_amax = max(finite_amax, float(av.max()))
            if hist is not None:
                nz = av[av > 0]
                hist += np.histogram(np.log2(nz), bins=_HIST_BINS)[0]
    row["amax"] = float(np.array([amax_bits], np.uint32).view(np.float32)[0])
    row["elements"], row["nan"], row["inf"] = n, nans, infs
    amax = np.array([finite_amax], np.float32)
    for fmt in formats:
        if scale is None:
            scales = fp8core.compute_scale(amax, fmt, power_of_2=True)
        else:
            scales = (np.array([scale], np.float32), np.array([1 / np.float32(scale)], np.float32))
        s32 = np.float32(scales[0][0])
        max_code = fmt.max_code
        signal = noise = 0.0
        finite = nonzero = under = clipped = at_max = 0
        max_rel = 0.0
        for a, b in bounds:
            c = _chunk_f32(flat, a, b)
            q = fp8core.quantize(c, scales[0], fmt)
            y = fp8core.dequantize(q, scales[1], "float32").astype(np.float64)
            v = c.astype(np.float64)
            fin = np.isfinite(v)
            err = y[fin] - v[fin]
            signal += float(np.sum(v[fin] ** 2))
            noise += float(np.sum(err ** 2))
            finite += int(fin.sum())
            nz = fin & (v != 0)
            nonzero += int(nz.sum())
            under += int((nz & (y == 0)).sum())
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = np.abs(c.astype(np.float32) * s32)  # the contract's one fp32 multiply
            clipped += int((fin & (scaled > np.float32(fmt.max))).sum())
            at_max += int((fin & ((q.view(np.uint8) & 0x7F) == max_code)).sum())
            if nz.any():
                max_rel = max(max_rel, float(np.max(np.abs((y[nz] - v[nz]) / v[nz]))))
        if signal > 0:
            sqnr: float | None = math.inf if noise == 0 else 10 * math.log10(signal / noise)
        else:
            sqnr = None
        row[fmt.name] = {
            "scale": float(s32), "sqnr_db": sqnr,
            "underflow": under / nonzero if nonzero else 0.0,
            "clipped": clipped / finite if finite else 0.0,
            "at_max": at_max / finite if finite else 0.0,
            "max_rel_error": max_rel,
        }
    return row


def is_fp8_state(name: str) -> bool:
    """Whether a checkpoint's tensor ``name`` is fp8core's scaling state (see :data:`FP8_STATE_KEYS`)."""
    parts = re.split(r"[./]", name)
    return parts[-1] in FP8_STATE_KEYS or FP8_STATE_COLLECTION in parts


def _strip_scale(row: dict, fmt: Format) -> float | None:
    """The scale a format's range strip is drawn at: the format's own row, or under --recipes its current-scaling
    recipe's (None where that recipe was not asked for)."""
    if fmt.name in row:
        return row[fmt.name]["scale"]
    recipe = row.get("recipes", {}).get(fmt.value, {})
    return 1 / recipe["scale_inv"] if "scale_inv" in recipe else None


def _plot(stats: dict[str, tuple[np.ndarray, dict]], out: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(f"--plot needs matplotlib ({install_hint('plot')})") from None
    target = plot_target(out)
    n = len(stats)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n), squeeze=False)
    # Each format's range is its own opaque strip along the top, so no colour is a blend of two and the
    # legend's swatches are what is drawn; dashed lines carry the range edges down over the histogram.
    ranges = {f: (f.smallest, f.max, f"tab:{colour}", (0.93 - 0.07 * i, 1.0 - 0.07 * i))
              for i, (f, colour) in enumerate(zip(ENCODINGS, ("blue", "orange", "green", "red")))}
    centers = (_HIST_BINS[:-1] + _HIST_BINS[1:]) / 2
    for ax, (name, (hist, row)) in zip(axes[:, 0], stats.items()):
        if hist.any():
            used = np.nonzero(hist)[0]
            lo, hi = used[0], used[-1] + 1
            ax.bar(centers[lo:hi], hist[lo:hi], width=_HIST_BINS[1] - _HIST_BINS[0], color="0.3")
        ax.set_ylim(0, max(1, int(hist.max())) * 1.25)  # headroom: the strips cover no bar
        for fmt, (lo_v, hi_v, color, (y0, y1)) in ranges.items():
            s = _strip_scale(row, fmt)
            if s is None:
                continue
            edges = (math.log2(lo_v / s), math.log2(hi_v / s))
            ax.axvspan(*edges, ymin=y0, ymax=y1, color=color, label=f"{fmt.name} range (scale {s:.4g})")
            for edge in edges:
                ax.axvline(edge, ymax=y1, color=color, linestyle="--", linewidth=0.8)
        ax.set_title(label(f"{name}  {row['dtype']} {tuple(row['shape'])}  amax {row['amax']:.4g}"), fontsize=9)
        ax.set_xlabel("log2 |x|")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the plot: covers no bar
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def _fit(text: str, width: int = TABLE_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(rows: dict[str, dict], recipes: bool = False) -> Iterator[str]:
    """The inspect table, TABLE_WIDTH columns at most: a line naming each tensor, then a line per format (per
    recipe with ``recipes``, the best one starred)."""
    if recipes:
        head = recipe_head()
    else:
        fields = f"{'scale':>10} {'SQNR dB':>8} {'underflow':>9} {'clipped':>8} {'at ±max':>8} {'max rel err':>11}"
        head = f"  {'fmt':<4} {fields}"
    yield "tensor  shape  dtype  amax"
    yield head
    yield "-" * len(head)
    state = [key for key, r in rows.items() if "fp8_state" in r]
    yield from _tensor_lines({k: r for k, r in rows.items() if "fp8_state" not in r}, recipes)
    if state:
        yield ""
        yield from textwrap.wrap(f"{len(state)} tensor(s) of {FP8_STATE}:", TABLE_WIDTH)
        for key in state:
            yield from _named(printable(key), f"  {tuple(rows[key]['shape'])} {rows[key]['dtype']}")


def _named(name: str, rest: str) -> Iterator[str]:
    """A tensor's line: its name whole, on lines of its own where it is long (any part of it may be what tells
    tensors apart), then ``rest``."""
    if len(name) + len(rest) <= TABLE_WIDTH:
        yield name + rest
    else:
        yield from (name[i:i + TABLE_WIDTH] for i in range(0, len(name), TABLE_WIDTH))
        yield _fit(rest)


def _tensor_lines(rows: dict[str, dict], recipes: bool) -> Iterator[str]:
    for key, r in rows.items():
        shape = str(tuple(r["shape"]))
        rest = f"  {shape} {r['dtype']}  " + (f"skipped: {r['skipped']}" if "skipped" in r else f"amax {r['amax']:.4g}")
        yield from _named(printable(key), rest)
        if "skipped" in r:
            continue
        notes = [r["note"]] if "note" in r else []
        if recipes:
            yield from recipe_lines(r)
            yield from block_lines(r)
            notes += recipe_notes(r)
        else:
            for fmt in (f.name for f in ENCODINGS):
                f = r[fmt]
                yield (f"  {fmt:<4} {f['scale']:>10.4g} {cell(f['sqnr_db'], '.2f', 8)} {f['underflow']:>9.2%} "
                       f"{f['clipped']:>8.2%} {f['at_max']:>8.2%} {f['max_rel_error']:>11.3g}")
        if r["nan"] or r["inf"]:
            notes.append(f"{r['nan']} NaN and {r['inf']} inf of {r['elements']} values: the statistics are of the "
                         "finite values")
        for note in notes:
            yield from textwrap.wrap(printable(note), TABLE_WIDTH, initial_indent="  note: ",
                                     subsequent_indent=" " * 8)


def cmd_inspect(args: argparse.Namespace) -> None:
    try:
        _inspect(args)
    except CliError as e:  # messages name members and keys from the files
        raise CliError(printable(str(e))) from None
    except (ValueError, TypeError, OSError) as e:  # main's own handler, but the text escaped (paths, names)
        raise CliError(printable(one_line(e, kind=False))) from None


SIDE_BY_SIDE = 2  # recipes of a tensor measured at once (memory: each holds its own copies of x)


def _cost_rank(recipe: Recipe) -> int:
    """Which recipes go to the threads first: the dearest (a transformed operand, then FP4, then the block
    recipes; one scale per tensor last), so the cheap ones fill the gaps at the end of a tensor."""
    if recipe.operand is not None:
        return 0
    if recipe.fmt is E2M1:
        return 1
    return 2 if recipe.block is not None else 3


def _with_recipes(row: dict, x: np.ndarray, raw_fp8: str, recipes: list[Recipe], blocks: bool = False) -> None:
    data, _ = _measurable(x, raw_fp8)
    shared: dict = {}  # x's own statistics, computed once for all its recipes (the same values whoever computes them)
    order = sorted(range(len(recipes)), key=lambda i: _cost_rank(recipes[i]))

    # Two recipes at a time, each on half of fp8core's CPU pool (on 2 cores: each on a thread alone): a recipe's
    # serial steps (its amax and scales, the block quantizers' tile loop, nvfp4_rht's transpose) then leave no core
    # idle. Two, not one a thread: each recipe holds its own float32 copy, codes and operand of x, so the peak
    # memory is about twice one recipe's whatever the cores. The figures are the same whoever measures a recipe.
    held = [data]  # emptied once measured: a pool task cancelled unstarted keeps `one` until a thread drops it
    side = min(SIDE_BY_SIDE, pool_threads())
    each = max(1, pool_threads() // side)
    # The error raised is the one a run in the order asked would raise: the first failing recipe in that order. The
    # threads take them dearest first, so a failure is kept rather than raised (an interrupt still stops everything):
    # the recipes asked before it still run, those asked after it no longer start. Only the earliest-asked failure is
    # kept: each error's traceback holds its recipe's copies of x.
    first: list[tuple[int, Exception] | None] = [None]  # (position asked, error)
    lock = threading.Lock()

    def one(i: int, _: int) -> tuple[dict, dict | None] | None:
        asked, failed = order[i], first[0]
        if failed is not None and failed[0] < asked:
            return None
        r, x = recipes[asked], held[0]
        try:
            with cpu_threads(each):
                stats = measure(x, r, shared)
                return stats, block_stats(x, r) if blocks and r.block_scales is not None else None
        except Exception as e:
            with lock:
                if first[0] is None or asked < first[0][0]:
                    first[0] = (asked, e)
            return None

    try:
        with cpu_threads(side):
            got = dict(zip(order, map_spans(len(recipes), 1, one)))
    finally:
        held.clear()
    if first[0] is not None:
        raise first[0][1]
    row["recipes"] = {r.name: got[i][0] for i, r in enumerate(recipes)}
    row["winner"] = winner(row["recipes"])
    if blocks:
        row["blocks"] = {r.name: got[i][1] for i, r in enumerate(recipes) if r.block_scales is not None}


def _inspect(args: argparse.Namespace) -> None:
    records = [f for f in args.files if Path(f).suffix.lower() == RECORD_SUFFIX]
    if records:
        if len(records) < len(args.files):
            raise CliError(f"{records[0]}: a record (.json) is inspected on its own, not with tensor files")
        if args.recipes is not None:
            raise CliError("--recipes: not with a record (it holds the recipes compared while recording: "
                           "record_numerics(model, recipes=...))")
        if args.blocks:
            raise CliError("--blocks: not with a record (a record made with record_numerics(..., blocks=True) "
                           "shows its per-block statistics without the flag)")
        if args.scale is not None:
            raise CliError("--scale: not with a record (its casts used their own scales)")
        inspect_records(records, args.json, args.plot, args.max_bytes)
        return
    recipes = parse_recipes(args.recipes) if args.recipes is not None else None
    blocks = [r.name for r in recipes or () if r.block_scales is not None] if args.blocks else []
    if args.blocks and not recipes:
        raise CliError("--blocks: with --recipes (the block recipes among them are measured per block)")
    if args.blocks and not blocks:
        raise CliError(f"--blocks: --recipes {args.recipes} has no block recipe")
    if recipes and args.scale is not None:
        raise CliError("--scale: not with --recipes (each recipe makes its own scales)")
    rows: dict[str, dict] = {}
    hists: dict[str, np.ndarray] = {}
    files = list(args.files)
    for i, path in enumerate(files):
        count = 0
        try:
            for name, x in iter_tensors(path, args.max_bytes):
                key = f"{path}:{name}" if len(files) > 1 else name
                if key in rows:  # one name twice (a .pt's "a.b" and "a": {"b"}, a file named twice): both shown
                    key = next(f"{key}#{n}" for n in itertools.count(2) if f"{key}#{n}" not in rows)
                status(f"file {i + 1}/{len(files)}, tensor {count + 1}: {key} {tuple(x.shape)}")
                count += 1
                if is_fp8_state(name):
                    rows[key] = {"shape": list(x.shape), "dtype": str(x.dtype), "fp8_state": FP8_STATE}
                    continue
                hist = np.zeros(len(_HIST_BINS) - 1, np.int64) if args.plot else None
                formats = () if recipes else tuple(ENCODINGS)
                rows[key] = tensor_stats(x, args.raw_fp8, hist, args.scale, formats)
                if recipes and "skipped" not in rows[key]:
                    _with_recipes(rows[key], x, args.raw_fp8, recipes, bool(blocks))
                if hist is not None and "skipped" not in rows[key]:
                    hists[key] = hist
                del x  # one tensor at a time
        except CliError:
            raise
        except MemoryError:
            raise CliError(f"{path}: not enough memory to measure it") from None
        if not count:
            raise CliError(f"{path}: holds no tensors")
        progress(i + 1, len(files), "files")
    written = _plot({k: (hists[k], rows[k]) for k in hists}, args.plot) if args.plot and hists else None
    names = [r.name for r in recipes] if recipes else []
    measured = {k: r for k, r in rows.items() if "recipes" in r}
    chart = plot_recipes(measured, names, args.plot) if recipes and args.plot and measured else None
    block_chart = plot_blocks(measured, blocks, args.plot) if blocks and args.plot and measured else None
    if args.json:  # json escapes control characters itself: strict JSON, names intact
        out: Any = rows
        if recipes:
            out = {"recipes": {r.name: r.what for r in recipes}, "padded": BLOCK_RULE,
                   **({"blocks": {"recipes": blocks, "positions": BLOCK_POSITIONS}} if blocks else {}),
                   "tensors": {k: r for k, r in rows.items() if "fp8_state" not in r},
                   "fp8_state": {k: r for k, r in rows.items() if "fp8_state" in r},
                   "summary": summary([r["recipes"] for r in measured.values()], names)}
        print(json.dumps(strict_json(out), indent=1, allow_nan=False))
        return
    for line in _table(rows, bool(recipes)):
        print(line)
    if recipes:
        for line in summary_lines(summary([r["recipes"] for r in measured.values()], names)):
            print(line)
    for what, target in (("plot", written), ("recipe plot", chart), ("block plot", block_chart)):
        if target is not None:
            print(f"{what} written to {printable(str(target))}")
