"""``fp8core inspect record.json``: a record of ``fp8core.torch.record_numerics`` (``rec.save(path)``), per layer
and operand over its steps: each recipe's worst step (the layer's own cast and the recipes compared while
recording), the winner starred, how often each recipe serves an operand within 1 dB of the best, and with
``--plot`` the SQNR chart. Per cast and step the rows are the record itself (and ``rec.by_tensor()``)."""

from __future__ import annotations

import itertools
import json
import textwrap
from typing import Any, Iterator

from fp8core.extras import install_hint
from fp8core.numerics_recipes import BLOCK_RULE, RECIPES
from fp8core.numerics_record import per_operand, read
from fp8core.numerics_stats import strict_json, summary

from .blocks import block_lines
from .common import TABLE_WIDTH, CliError, cell, printable
from .compare import name_width, plot_recipes, recipe_head, recipe_lines, recipe_notes, summary_lines

SUFFIX = ".json"  # what inspect reads as a record
AGGREGATE = ("per layer and operand, each recipe's worst over the steps: least SQNR, most underflow, clipped, at "
             "±max, largest relative error (best_steps: the steps in which it had the best SQNR); the winner has "
             "the highest least SQNR")


def read_record(path: str, max_bytes: int) -> list[dict[str, Any]]:
    """The checked rows of a saved record (:func:`fp8core.numerics_record.read`, NumericsRecord.load's reader).
    CliError naming the file and what a record is."""
    try:
        return read(path, max_bytes)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None


def _what(name: str) -> str:
    """A contender's description: a compared recipe's, or (every other name a record may hold) a layer's own."""
    if name in RECIPES:
        return RECIPES[name].what
    return f"the layer's own cast ({name}, the scale it used)"


def _lines(entries: dict[str, dict[str, Any]]) -> Iterator[str]:
    width = name_width(n for e in entries.values() for n in e["recipes"])
    head = recipe_head(width)
    yield "layer.operand  the layer's cast  steps  amax"
    yield head
    yield "-" * min(len(head), TABLE_WIDTH)
    for key, e in entries.items():
        yield (f"{printable(key)}  {printable(e['recipe'])} {printable(e['format'])}  {e['steps']} step(s)  amax "
               f"{cell(e['amax_min'], '.4g', 0)}..{cell(e['amax_max'], '.4g', 0)}")
        yield from recipe_lines(e)
        yield from block_lines(e)  # recorded with blocks=True: the step whose worst block is the worst
        for note in recipe_notes(e):
            yield f"  note: {note}"


def inspect_records(files: list[str], as_json: bool, plot: str | None, max_bytes: int) -> None:
    """Print (or write as JSON, or plot) the records in ``files``; several are keyed ``path:layer.operand``."""
    entries: dict[str, dict[str, Any]] = {}
    for path in files:
        rows = read_record(path, max_bytes)
        for key, e in per_operand(rows).items():
            key = f"{path}:{key}" if len(files) > 1 else key
            if key in entries:  # one record named twice: both shown
                key = next(f"{key}#{n}" for n in itertools.count(2) if f"{key}#{n}" not in entries)
            entries[key] = e
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
        out = {"recipes": {n: _what(n) for n in names}, "aggregate": AGGREGATE, "padded": BLOCK_RULE,
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
