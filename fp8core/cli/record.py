"""``fp8core inspect record.json``: a record of ``fp8core.torch.record_numerics`` (``rec.save(path)``), per layer
and operand over its steps: each recipe's worst step (the layer's own cast and the recipes compared while
recording), the winner starred, how often each recipe serves an operand within 1 dB of the best, and with
``--plot`` the SQNR chart. Per cast and step the rows are the record itself (and ``rec.by_tensor()``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Iterator

from fp8core.extras import install_hint
from fp8core.numerics_recipes import BLOCK_RULE, RECIPES
from fp8core.numerics_record import from_json, per_operand
from fp8core.numerics_stats import strict_json, summary

from .common import TABLE_WIDTH, CliError, cell, printable
from .compare import name_width, plot_recipes, recipe_head, recipe_lines, recipe_notes, summary_lines

SUFFIX = ".json"  # what inspect reads as a record
AGGREGATE = ("per layer and operand, each recipe's worst over the steps: least SQNR, most underflow, clipped, at "
             "±max, largest relative error (best_steps: the steps in which it had the best SQNR); the winner has "
             "the highest least SQNR")


def read_record(path: str, max_bytes: int) -> list[dict[str, Any]]:
    """The checked rows of a saved record. CliError naming the file and what a record is."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{path}: no such file" if not p.exists() else f"{path}: not a file")
    if p.stat().st_size > max_bytes:
        raise CliError(f"{path}: {p.stat().st_size} bytes, more than --max-bytes {max_bytes} for a record")
    try:
        data = json.loads(p.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: not JSON ({e}); expected a record of fp8core.torch.record_numerics "
                       "(rec.save(path))") from None
    except RecursionError:  # json's decoder recurses per level of nesting
        raise CliError(f"{path}: JSON nested too deeply to be a record of fp8core.torch.record_numerics "
                       "(rec.save(path): a list of flat rows)") from None
    try:
        return from_json(data)
    except ValueError as e:
        raise CliError(f"{path}: {e}") from None


def _what(name: str, rows: list[dict[str, Any]]) -> str:
    if name in RECIPES:
        return RECIPES[name].what
    if any(r["recipe"] == name for r in rows):
        return f"the layer's own cast ({name}, the scale it used)"
    return "as recorded"


def _lines(entries: dict[str, dict[str, Any]]) -> Iterator[str]:
    width = name_width(n for e in entries.values() for n in e["recipes"])
    head = recipe_head(width)
    yield "layer.operand  the layer's cast  steps  amax"
    yield head
    yield "-" * min(len(head), TABLE_WIDTH)
    for key, e in entries.items():
        yield (f"{printable(key)}  {e['recipe']} {e['format']}  {e['steps']} step(s)  amax "
               f"{cell(e['amax_min'], '.4g', 0)}..{cell(e['amax_max'], '.4g', 0)}")
        yield from recipe_lines(e)
        for note in recipe_notes(e):
            yield f"  note: {note}"


def inspect_records(files: list[str], as_json: bool, plot: str | None, max_bytes: int) -> None:
    """Print (or write as JSON, or plot) the records in ``files``; several are keyed ``path:layer.operand``."""
    entries: dict[str, dict[str, Any]] = {}
    rows_all: list[dict[str, Any]] = []
    for path in files:
        rows = read_record(path, max_bytes)
        rows_all += rows
        for key, e in per_operand(rows).items():
            entries[f"{path}:{key}" if len(files) > 1 else key] = e
    names = list(dict.fromkeys(n for e in entries.values() for n in e["recipes"]))
    for e in entries.values():  # every record's names in each entry, in one order (several records)
        e["recipes"] = {n: e["recipes"].get(n, {"n/a": "not in this record"}) for n in names}
    over = summary([e["recipes"] for e in entries.values()], names)
    chart = None
    if plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            raise CliError(f"--plot needs matplotlib ({install_hint('plot')})") from None
        steps = max(e["steps"] for e in entries.values())
        chart = plot_recipes(entries, names, plot, beside=False,
                             title=f"worst over the steps (up to {steps}) per layer and operand", underflow=True)
    if as_json:
        out = {"recipes": {n: _what(n, rows_all) for n in names}, "aggregate": AGGREGATE, "padded": BLOCK_RULE,
               "tensors": entries, "summary": over}
        print(json.dumps(strict_json(out), indent=1, allow_nan=False))
        return
    for line in _lines(entries):
        print(line)
    for line in textwrap.wrap(f"({AGGREGATE})", TABLE_WIDTH):
        print(line)
    for line in summary_lines(over, "layer operand(s)"):
        print(line)
    if chart is not None:
        print(f"recipe plot written to {printable(str(chart))}")
