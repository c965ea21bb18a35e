"""The rows of a numerics record (``fp8core.torch.record_numerics``): one per cast a layer ran, per layer
(``module``), ``operand`` and ``step``, with the statistics of the layer's own cast and, when other recipes
were compared, theirs. Here: the rows read back from their JSON (checked), and the rows in ``fp8core inspect
--recipes``'s shape, per cast or per layer and operand over the steps. No framework: ``fp8core inspect`` reads
a saved record without torch.

A row is a dict: ``module`` (str), ``operand`` (``input``, ``weight`` or ``grad_output``), ``step`` (int),
``recipe`` (the layer's: ``DelayedScaling`` or ``Float8CurrentScaling``), ``format`` (``E4M3``/``E5M2``),
``amax``, ``scale``, ``scale_inv``, the statistics of :func:`fp8core.numerics_stats.measure` (:data:`STATS`),
and optionally ``recipes`` (name -> statistics, or ``{"n/a": why}``) with ``winner`` (the best SQNR among the
layer's cast and those recipes; None when none has one), and ``blocks`` (block recipe name -> the per-block
statistics of :func:`fp8core.numerics_blocks.block_stats`, or ``{"n/a": why}``). The layer recipe names include
the block recipes' (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling) and torchao's rowwise
(Float8RowwiseScaling), whose rows have no per-tensor scale (``scale``/``scale_inv`` null), and the formats E2M1.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Union

from fp8core.numerics_recipes import RECIPES
from fp8core.numerics_stats import winner

__all__ = ["BLOCK_LAYER_RECIPES", "FORMATS", "LAYER_RECIPES", "MAX_BYTES", "OPERANDS", "STATS", "contender_names",
           "contenders", "from_json", "per_cast", "per_operand", "read"]

OPERANDS = ("input", "weight", "grad_output")  # in the order of a Float8Linear's state slots (fp8_scale[0:3])
# a recorded layer's own recipe, by its class's name; the block and rowwise recipes' rows have no per-tensor scale
LAYER_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                 "NVFP4BlockScaling", "Float8RowwiseScaling")
BLOCK_LAYER_RECIPES = LAYER_RECIPES[2:]
FORMATS = ("E4M3", "E5M2", "E2M1")
MAX_BYTES = 1 << 30  # what :func:`read` takes of a file by default (``fp8core inspect --max-bytes``'s default)
STATS = ("sqnr_db", "underflow", "clipped", "at_max", "max_rel_error", "lost")
_NUMBERS = ("amax", "scale", "scale_inv") + STATS
_WORST_MAX = ("underflow", "clipped", "at_max", "max_rel_error", "lost")  # the worst over steps is the largest
_EXPECTED = ("expected a JSON list of rows as NumericsRecord.save and .to_json() write them (each an object with "
             "module, operand, step, recipe, format, amax, scale, scale_inv, " + ", ".join(STATS) + ")")


def contenders(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The layer's own cast (under its recipe's name) and the compared recipes of one row, each its statistics."""
    return {row["recipe"]: {k: row[k] for k in STATS}, **row.get("recipes", {})}


def contender_names(rows: list[dict[str, Any]]) -> list[str]:
    """Every contender's name, in the order first seen: the layers' recipes, then the compared ones."""
    own = dict.fromkeys(r["recipe"] for r in rows)
    return list(own) + [n for n in dict.fromkeys(n for r in rows for n in r.get("recipes", {})) if n not in own]


def _filled(row: dict[str, Any], names: list[str], own: set[str]) -> dict[str, dict[str, Any]]:
    """Every name of the record for one row; those the row lacks n/a, saying why."""
    mine = contenders(row)
    return {n: mine.get(n, {"n/a": "not this layer's recipe" if n in own else "not compared at this cast"})
            for n in names}


def per_cast(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One entry per row, keyed ``"module.operand@step"`` (``<model>`` for the model itself):
    ``{"recipes": {name: statistics or {"n/a": why}}, "winner": name}`` over every contender of the record."""
    names, own = contender_names(rows), {r["recipe"] for r in rows}
    out = {}
    for r in rows:
        recipes = _filled(r, names, own)
        out[f"{r['module'] or '<model>'}.{r['operand']}@{r['step']}"] = {"recipes": recipes,
                                                                      "winner": winner(recipes)}
    return out


def _worst(stats: list[dict[str, Any]], won: int) -> dict[str, Any]:
    """One contender over the steps: the least SQNR (None where no step had a signal), the largest fractions and
    relative error, padded if any step was; ``best_steps``: in how many steps it had the best SQNR."""
    measured = [s for s in stats if "n/a" not in s]
    if not measured:
        return {"n/a": stats[0]["n/a"]}
    sqnr = [s["sqnr_db"] for s in measured if s["sqnr_db"] is not None]
    out: dict[str, Any] = {"sqnr_db": min(sqnr) if sqnr else None}
    out.update({k: max(s[k] for s in measured) for k in _WORST_MAX})
    if any("padded" in s for s in measured):
        out["padded"] = any(s.get("padded", False) for s in measured)
    out["best_steps"] = won
    return out


def per_operand(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One entry per layer and operand, keyed ``"module.operand"``, over its steps: ``module``, ``operand``,
    ``recipe`` and ``format`` (the layer's cast), ``steps``, ``amax_min``/``amax_max``, and per contender the
    worst over the steps (least SQNR; largest underflow, clipped, at_max, max_rel_error, lost; ``best_steps``: the
    steps it won), with ``winner``: the contender whose least SQNR is the highest, the one that serves every step
    best."""
    names, own = contender_names(rows), {r["recipe"] for r in rows}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["module"], r["operand"]), []).append(r)
    out = {}
    for (module, operand), group in groups.items():
        casts = [_filled(r, names, own) for r in group]
        wins = [winner(c) for c in casts]
        recipes = {n: _worst([c[n] for c in casts], wins.count(n)) for n in names}
        amax = [r["amax"] for r in group if not math.isnan(r["amax"])]
        out[f"{module or '<model>'}.{operand}"] = {
            "module": module, "operand": operand, "recipe": group[-1]["recipe"], "format": group[-1]["format"],
            "steps": len(group),
            "amax_min": min(amax, default=math.nan), "amax_max": max(amax, default=math.nan),
            "recipes": recipes, "winner": winner(recipes)}
        blocks = _worst_blocks(group)
        if blocks:
            out[f"{module or '<model>'}.{operand}"]["blocks"] = blocks
    return out


def _worst_blocks(group: list[dict[str, Any]]) -> dict[str, Any]:
    """Per block recipe of the rows' ``blocks``: the per-block statistics of the step whose worst block is the
    worst (least per-block SQNR; the first such step), with that ``step``; n/a where no step has any."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(n for r in group for n in r.get("blocks", {})):
        steps = [(r["step"], r["blocks"][name]) for r in group if name in r.get("blocks", {})]
        measured = [(step, b) for step, b in steps if "n/a" not in b]
        if not measured:
            out[name] = steps[0][1]
            continue
        least = lambda sb: math.inf if sb[1]["sqnr_db"]["min"] is None else sb[1]["sqnr_db"]["min"]  # noqa: E731
        step, b = min(measured, key=least)
        out[name] = {**b, "step": step}
    return out


def _number(v: Any, where: str) -> float:
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):  # strict JSON's infinities and NaN
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where} is {_short(v)}, not a number")
    try:
        return float(v)
    except OverflowError:  # an integer past float64's range
        raise ValueError(f"{where} is an integer of about 10^{int(v.bit_length() * math.log10(2))}, beyond "
                         "float64") from None


def _short(v: Any) -> str:
    """``repr(v)``, cut: an error quotes what it refuses, not a megabyte of it."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _stats(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not an object ({type(d).__name__})")
    if "n/a" in d:
        return {"n/a": str(d["n/a"])}
    out: dict[str, Any] = {}
    for k in STATS:
        if k not in d:
            raise ValueError(f"{where} has no {k!r}")
        out[k] = None if k == "sqnr_db" and d[k] is None else _number(d[k], f"{where}'s {k!r}")
    for k, v in d.items():
        if k == "padded" and not isinstance(v, bool):  # what the table and chart print as a flag
            raise ValueError(f"{where}'s 'padded' is {v!r}, not true or false")
        if k not in out:
            out[k] = v if isinstance(v, bool) else _number(v, f"{where}'s {k!r}")
    return out


def from_json(data: Any) -> list[dict[str, Any]]:
    """The rows of a record from its parsed JSON (``json.loads`` of ``.to_json()``), checked, with "inf", "-inf"
    and "nan" back as floats. ValueError saying what is not a record, and what one is."""
    if not isinstance(data, list):
        kind = {dict: "object", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(data), "null")
        raise ValueError(f"not a record: its top level is a JSON {kind}; " + _EXPECTED)
    if not data:
        raise ValueError("an empty record: no cast was recorded (were the layers run under "
                         "fp8core.torch.autocast inside record_numerics?)")
    rows = []
    for i, r in enumerate(data):
        where = f"row {i}"
        try:
            if not isinstance(r, dict):
                raise ValueError(f"{where} is not an object ({type(r).__name__})")
            missing = [k for k in ("module", "operand", "step", "recipe", "format") + _NUMBERS if k not in r]
            if missing:
                raise ValueError(f"{where} has no {', '.join(map(repr, missing))}")
            for k in ("module", "recipe", "format"):
                if not isinstance(r[k], str):
                    raise ValueError(f"{where}'s {k!r} is {_short(r[k])}, not a string")
            # The names are fp8core's own: what a record may name is known, and each name costs a column of
            # every entry (per_operand fills every name in), so a name from elsewhere is refused, not counted.
            for k, known in (("operand", OPERANDS), ("recipe", LAYER_RECIPES), ("format", FORMATS)):
                if r[k] not in known:
                    raise ValueError(f"{where}'s {k!r} is {_short(r[k])}, not one of {', '.join(known)}")
            if isinstance(r["step"], bool) or not isinstance(r["step"], int) or r["step"] < 0:
                raise ValueError(f"{where}'s 'step' is {_short(r['step'])}, not a count from 0")
            row = dict(r)
            nullable = ("sqnr_db", "scale", "scale_inv") if r["recipe"] in BLOCK_LAYER_RECIPES else ("sqnr_db",)
            row.update({k: None if k in nullable and r[k] is None else _number(r[k], f"{where}'s {k!r}")
                        for k in _NUMBERS})
            if "blocks" in r:
                row["blocks"] = _blocks(r["blocks"], where)
            if "recipes" in r:
                if not isinstance(r["recipes"], dict):
                    raise ValueError(f"{where}'s 'recipes' is not an object of recipe names")
                if r["recipe"] in r["recipes"]:  # contenders() would put it in place of the layer's own cast
                    raise ValueError(f"{where}'s 'recipes' has {r['recipe']!r}, the name of the layer's own cast, "
                                     "whose statistics are the row's")
                unknown = [n for n in r["recipes"] if n not in RECIPES]
                if unknown:
                    raise ValueError(f"{where}'s 'recipes' has {_short(unknown[0])}, not one of {', '.join(RECIPES)}")
                row["recipes"] = {n: _stats(s, f"{where}'s recipe {n!r}") for n, s in r["recipes"].items()}
            rows.append(row)
        except ValueError as e:
            raise ValueError(f"not a record: {e}; {_EXPECTED}") from None
    return rows


def _blocks(d: Any, where: str) -> dict[str, Any]:
    """A row's per-block statistics: block recipe names of :data:`RECIPES`, each an object of JSON values (their
    numbers as numbers, "inf"/"-inf"/"nan" back as floats), or ``{"n/a": why}``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}'s 'blocks' is not an object of block recipe names")
    out = {}
    for name, b in d.items():
        if name not in RECIPES or RECIPES[name].block_scales is None:
            blocky = ", ".join(n for n, r in RECIPES.items() if r.block_scales is not None)
            raise ValueError(f"{where}'s 'blocks' has {_short(name)}, not one of {blocky}")
        if not isinstance(b, dict):
            raise ValueError(f"{where}'s blocks of {name!r} is not an object ({type(b).__name__})")
        out[name] = {"n/a": str(b["n/a"])} if "n/a" in b else _block_schema(_floats(b), f"{where}'s blocks of {name!r}")
    return out


# What a reader of a row's blocks formats (fp8core.cli.blocks), by path: numbers (None allowed where marked), ints,
# strings, and the worst blocks' fields.
_BLOCK_NUMBERS = {("scale", "log2_min"): True, ("scale", "log2_max"): True, ("scale", "spread"): True,
                  ("scale", "log2_floor"): False, ("scale", "log2_ceiling"): False,
                  ("dynamic_range_log2", "median"): True, ("dynamic_range_log2", "max"): True,
                  ("flushed", "max_fraction"): False, ("sqnr_db", "min"): True}
_BLOCK_INTS = [("blocks",), ("all_zero",), ("flushed", "blocks"), ("scale", "at_floor"), ("scale", "at_ceiling"),
               ("scale", "subnormal"), ("scale", "zero"), ("scale", "nan"), ("sqnr_hist", "exact")]
_BLOCK_STRINGS = [("scale", "format"), ("scale", "limits")]
_WORST_FIELDS = ("row_block", "col_block", "sqnr_db", "amax", "scale", "flushed")


def _block_schema(b: dict[str, Any], where: str) -> dict[str, Any]:
    """A row's per-block statistics of one recipe, checked as far as they are read: ValueError naming the field."""
    def at(path: tuple[str, ...]) -> Any:
        v: Any = b
        for k in path:
            if not isinstance(v, dict) or k not in v:
                raise ValueError(f"{where} has no {'.'.join(path)!r}")
            v = v[k]
        return v

    for path, nullable in _BLOCK_NUMBERS.items():
        v = at(path)
        if not (v is None and nullable):
            _number(v, f"{where}'s {'.'.join(path)!r}")
    for path in _BLOCK_INTS:
        v = at(path)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}'s {'.'.join(path)!r} is {_short(v)}, not a count")
    for path in _BLOCK_STRINGS:
        if not isinstance(at(path), str):
            raise ValueError(f"{where}'s {'.'.join(path)!r} is not a string")
    worst = at(("worst",))
    if not isinstance(worst, list) or not all(isinstance(w, dict) and all(k in w for k in _WORST_FIELDS)
                                              for w in worst):
        raise ValueError(f"{where}'s 'worst' is not a list of blocks ({', '.join(_WORST_FIELDS)})")
    for w in worst:
        for k in _WORST_FIELDS:
            _number(w[k], f"{where}'s worst block's {k!r}")
    return b


def _floats(v: Any) -> Any:
    """Strict JSON's "inf", "-inf" and "nan" back as floats, through objects and lists."""
    if isinstance(v, dict):
        return {k: _floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_floats(x) for x in v]
    return float(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v


def read(path: Union[str, Path], max_bytes: int = MAX_BYTES) -> list[dict[str, Any]]:
    """The checked rows of a record file (what ``NumericsRecord.save`` writes): the one reader of records, for
    ``NumericsRecord.load`` and ``fp8core inspect record.json`` alike. A regular file of at most ``max_bytes``
    bytes (no more is read: a link to a device or a FIFO is refused before any byte). OSError or ValueError, the
    message naming the file and, for content, what a record is."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes: expected an int, got {type(max_bytes).__name__}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes: expected a positive number of bytes, got {max_bytes}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without a writer
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # of what was opened, not of what the name pointed at a moment before
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file; expected a record of fp8core.torch.record_numerics "
                             "(rec.save(path))")
        if info.st_size > max_bytes:
            raise ValueError(f"{path}: {info.st_size} bytes, more than the {max_bytes} a record may hold here "
                             "(max_bytes, or fp8core inspect --max-bytes, raises it)")
        data = f.read(max_bytes + 1)  # the file may have grown since
    if len(data) > max_bytes:
        raise ValueError(f"{path}: more than {max_bytes} bytes, more than a record may hold here (max_bytes, or "
                         "fp8core inspect --max-bytes, raises it)")
    try:
        parsed = json.loads(data)
    except RecursionError:  # json's decoder recurses per level of nesting
        raise ValueError(f"{path}: JSON nested too deeply to be a record of fp8core.torch.record_numerics "
                         "(rec.save(path): a list of flat rows)") from None
    except ValueError as e:  # not JSON, not UTF-8, or a number past the interpreter's digit limit
        raise ValueError(f"{path}: not a record: not JSON ({e}); expected a record of "
                         "fp8core.torch.record_numerics (rec.save(path))") from None
    try:
        return from_json(parsed)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
