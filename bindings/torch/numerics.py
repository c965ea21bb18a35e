"""``record_numerics``: what the fp8 casts of a model's Float8Linear layers do to their operands, measured
during real forward and backward passes.

Recording is a flag on each recorded layer, set on entry to the context and cleared on exit: a forward outside
it reaches nothing of the recorder (the backward of a forward recorded inside still records). At the end of its
fp8 forward, before any forward hook, a flagged layer hands its input and output to the recorder, which measures
the input and weight the layer just cast (delayed scaling: with the scale the layer's state held, which a forward
does not change; current scaling: with the scale the cast computed, by the same op from the same amax) and, when
the output takes part in a backward, puts a hook on the output's gradient, which is the grad_output the layer's
backward casts next. The flag is a plain bool that torch.compile guards on, and the hand-over runs outside the
graph (a graph break): a model compiled before the context, or inside it, records the rows of its eager twin.
The recorder and the gradient hooks read; they return nothing, so nothing they do reaches the results. The statistics are :mod:`fp8core.numerics_stats`'s (``fp8core inspect --recipes``'s),
computed on the host: each measured operand is copied there (on CUDA that synchronises; it is a study tool).
With ``recipes=``, each operand is also quantized in those recipes (:mod:`fp8core.numerics_recipes`, as
``fp8core inspect --recipes`` does), from the same high-precision values: what the layer would see in each.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

import fp8core
from fp8core import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, Format
from fp8core.numerics_blocks import block_stats
from fp8core.numerics_record import MAX_BYTES, OPERANDS, contender_names, contenders, per_cast, per_operand, read
from fp8core.numerics_recipes import layer_recipe, rowwise_recipe, select
from fp8core.numerics_stats import Recipe, measure, strict_json, winner
from fp8core.text import printable

from . import ops
from .fsdp import Float8AllGatherWeight, Float8GatheredWeight
from .linear import RECORDERS, Float8Linear

__all__ = ["NumericsRecord", "record_numerics"]

class NumericsRecord:
    """The rows :func:`record_numerics` collected, in the order the casts ran: one per Float8Linear (``module``:
    its qualified name in the model, "" for the model itself), per ``operand`` (input, weight, grad_output), per
    ``step`` (the layer's n-th forward while recording, from 0; a grad_output row carries its forward's step).
    Each row: ``recipe`` (the layer's: DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling
    or NVFP4BlockScaling), ``format`` (E4M3/E5M2/E2M1), ``amax`` (max |x| of the operand), ``scale`` and
    ``scale_inv`` (the cast's; null for a block recipe's), then :func:`fp8core.numerics_stats.measure`'s
    statistics against the high-precision operand: ``sqnr_db``, ``underflow``, ``clipped`` (saturated),
    ``at_max``, ``max_rel_error``, ``lost``. With ``record_numerics(..., recipes=...)`` also ``recipes``: per
    compared recipe, the same statistics of the operand quantized in it (``scale_inv`` for a per-tensor recipe,
    ``padded`` for a block recipe whose blocks do not tile the operand, viewed as [rows, last dim]), and
    ``winner``: the best SQNR among the layer's cast (under its recipe's name) and those recipes.
    """

    def __init__(self, rows: Optional[list[dict[str, Any]]] = None) -> None:
        self.rows: list[dict[str, Any]] = [] if rows is None else rows

    def to_json(self, **kwargs: Any) -> str:
        """The rows as strict JSON (inf and NaN as the strings "inf", "-inf", "nan", as ``fp8core inspect
        --json`` writes them); ``kwargs`` go to :func:`json.dumps`."""
        return json.dumps(strict_json(self.rows), allow_nan=False, **kwargs)

    def save(self, path: Union[str, Path]) -> Path:
        """Write :meth:`to_json` to ``path`` (what ``fp8core inspect path`` reads); returns the path."""
        target = Path(path)
        target.write_text(self.to_json(indent=1) + "\n", encoding="utf-8")
        return target

    @classmethod
    def load(cls, path: Union[str, Path], max_bytes: int = MAX_BYTES) -> "NumericsRecord":
        """A record :meth:`save` wrote (:func:`fp8core.numerics_record.read`: a regular file of at most
        ``max_bytes`` bytes, checked as ``fp8core inspect`` checks it). ValueError naming the file when it holds no
        record; FileNotFoundError when there is none."""
        return cls(read(path, max_bytes))

    def recipes(self) -> list[str]:
        """Every recipe of the rows: the recorded layers' own, in the order they first cast, then the compared
        ones."""
        return contender_names(self.rows)

    def by_tensor(self) -> dict[str, dict[str, Any]]:
        """The rows in ``fp8core inspect --recipes``'s shape, one per cast, keyed ``"module.operand@step"``:
        ``{"recipes": {recipe: statistics, other recipe: {"n/a": ...}}, "winner": recipe}`` (the layer's own
        cast under its recipe's name, and each compared recipe), which its table lines
        (``fp8core.cli.compare.recipe_lines``) and its SQNR chart (``plot_recipes``, with :meth:`recipes` as the
        series) take."""
        return per_cast(self.rows)

    def by_operand(self) -> dict[str, dict[str, Any]]:
        """Per layer and operand, keyed ``"module.operand"``, every recipe's worst over the steps (least SQNR,
        most underflow/clipped/at_max) and the ``winner``: the one whose least SQNR is the highest (what
        ``fp8core inspect`` prints for a saved record; :func:`fp8core.numerics_record.per_operand`)."""
        return per_operand(self.rows)

    def summary(self) -> list[dict[str, Any]]:
        """Per layer and operand, over its steps: how many, the SQNR range, the worst underflow, clipped and
        at_max fractions, the last step's amax and scale, and the ``winner`` of :meth:`by_operand`."""
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in self.rows:
            groups.setdefault((r["module"], r["operand"]), []).append(r)
        out = []
        winners = {(e["module"], e["operand"]): e["winner"] for e in per_operand(self.rows).values()}
        for (module, operand), rows in groups.items():
            sqnr = [r["sqnr_db"] for r in rows if r["sqnr_db"] is not None]
            last = max(rows, key=lambda r: r["step"])
            out.append({"module": module, "operand": operand, "format": last["format"], "steps": len(rows),
                        "sqnr_db_min": min(sqnr, default=None), "sqnr_db_max": max(sqnr, default=None),
                        "underflow_max": max(r["underflow"] for r in rows),
                        "clipped_max": max(r["clipped"] for r in rows),
                        "at_max_max": max(r["at_max"] for r in rows),
                        "amax_last": last["amax"], "scale_last": last["scale"],
                        "winner": winners[(module, operand)]})
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        summary = self.summary()
        # every name whole (model.layers.0.self_attn.q_proj and layer 1's differ at the front), escaped: a loaded
        # record's names come from its file
        names = [printable(s["module"] or "<model>") for s in summary]
        width = max([5, *map(len, names)])
        lines = [f"{'layer':<{width}} {'operand':<11} {'fmt':<4} {'steps':>5} {'SQNR dB min':>11} {'max':>7} "
                 f"{'underflow':>9} {'clipped':>8} {'at max':>8} {'amax':>9} {'scale':>9}"]
        for name, s in zip(names, summary):
            lines.append(f"{name:<{width}} {s['operand']:<11} {s['format']:<4} "
                         f"{s['steps']:>5} {_cell(s['sqnr_db_min'], 11)} {_cell(s['sqnr_db_max'], 7)} "
                         f"{s['underflow_max']:>9.2%} {s['clipped_max']:>8.2%} {s['at_max_max']:>8.2%} "
                         f"{s['amax_last']:>9.3g} " + (f"{'n/a':>9}" if s["scale_last"] is None
                                                        else f"{s['scale_last']:>9.3g}"))  # a block recipe's row
        lines.append("(worst over the steps: least SQNR, most underflow/clipped/at max; amax and scale of the last)")
        compared = [n for n in self.recipes() if n not in {r["recipe"] for r in self.rows}]
        if compared:
            entries = list(per_operand(self.rows).values())
            width = max([5, *(len(printable(e["module"] or "<model>")) for e in entries)])
            lines += ["", "least SQNR dB over the steps in each recipe (cast: the layer's own), * the best:"]
            lines.append(f"{'layer':<{width}} {'operand':<11}{'cast':>7} " + "".join(
                f"{printable(n):>{max(7, len(printable(n)))}} " for n in compared).rstrip())
            for e in entries:
                cells = [_best(e, e["recipe"], 7)] + [_best(e, n, max(7, len(printable(n)))) for n in compared]
                lines.append(f"{printable(e['module'] or '<model>'):<{width}} {e['operand']:<11}"
                             + "".join(cells).rstrip())
        return "\n".join(lines)


def _cell(v: Optional[float], width: int) -> str:
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}.2f}"


def _best(entry: dict[str, Any], name: str, width: int) -> str:
    """One recipe's least SQNR in a :func:`per_operand` entry, starred when it is the winner."""
    return _cell(entry["recipes"][name].get("sqnr_db"), width) + ("*" if name == entry["winner"] else " ")


def _given_scale(fmt: Format, scale: np.ndarray, scale_inv: np.ndarray) -> Recipe:
    """The per-tensor cast with a scale already chosen, as :func:`fp8core.numerics_stats.measure` takes it."""
    def part(q: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        piece = np.ascontiguousarray(q[r0:r1, c0:c1])
        return piece, fp8core.dequantize(piece, scale_inv)

    return Recipe("given", f"Format.{fmt.name}, one given scale", fmt, lambda x: fp8core.quantize(x, scale, fmt),
                  part)


class _Recorder:
    """What one :func:`record_numerics` context records, and the rows it writes to. Called by each recorded
    layer at the end of its fp8 forward (linear.py's ``_record``), on whichever thread ran it."""

    def __init__(self, record: NumericsRecord, names: dict[Float8Linear, str], compare: list[Recipe],
                 blocks: bool = False) -> None:
        self.record, self.names, self.compare = record, names, compare
        self.blocks = [r for r in compare if r.block_scales is not None] if blocks else []
        self.steps: dict[str, int] = {}
        self.lock = threading.Lock()  # layers run on several threads at once: one step each, one row list

    def __call__(self, module: Float8Linear, x: torch.Tensor, output: Optional[torch.Tensor]) -> None:
        name = self.names[module]
        if not module.runs_in_fp8() or x.numel() == 0:
            return  # high precision (outside autocast for te.Linear), or nothing cast
        with self.lock:
            step = self.steps.get(name, 0)
            self.steps[name] = step + 1
        r = module.recipe
        blocked = not isinstance(r, (DelayedScaling, Float8CurrentScaling))
        fmt = r.fp8_format
        delayed = isinstance(r, DelayedScaling)
        state = "blocks" if blocked else (module.fp8_scale, module.fp8_scale_inv) if delayed else (None, None)
        self.measure(module, name, step, "input", x, fmt.fwd, state)
        weight = module.weight
        if isinstance(weight, Float8AllGatherWeight):
            weight = weight.high_precision
        if not isinstance(weight, Float8GatheredWeight):  # gathered in fp8 by FSDP2: cast before this layer ran
            self.measure(module, name, step, "weight", weight.t() if blocked and module.in_out else weight, fmt.fwd,
                         state)  # a block recipe's weight operand [out, in]: blocks along in_features
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: self.measure(module, name, step, "grad_output", g, fmt.bwd, state))

    def measure(self, module: Float8Linear, name: str, step: int, operand: str, t: torch.Tensor, fmt: Format,
                state: tuple) -> None:
        """One row: ``t`` cast as the layer casts it. ``state``: (scale [3], scale_inv [3]) of delayed scaling, as
        the cast reads them (the forward's tensors: the backward reads those), or (None, None) for current."""
        t = t.detach().contiguous()  # a gradient may come expanded (the backward of a sum): stride 0
        amax = ops.amax(t)
        x = t.to(torch.float32).cpu().numpy()  # exact from bfloat16/float16: the cast sees the same values
        r = module.recipe
        if isinstance(r, Float8RowwiseScaling) or state == "blocks":
            # one scale per row, or per block: the layer's own cast of the operand, no per-tensor scale to show
            own = (rowwise_recipe(r.power_of_2, r.epsilon, type(r).__name__) if isinstance(r, Float8RowwiseScaling)
                   else layer_recipe(r, operand))
            fmt, s, s_inv = own.fmt, None, None
        else:
            scale, scale_inv = state
            if scale is None:
                scale, scale_inv = ops.compute_scale(amax, fmt.value, r.margin, r.power_of_2, float(r.amax_epsilon))
            else:
                slot = OPERANDS.index(operand)
                scale, scale_inv = scale[slot:slot + 1], scale_inv[slot:slot + 1]
            s = scale.detach().cpu().numpy().copy()
            s_inv = scale_inv.detach().cpu().numpy().copy()
            own = _given_scale(fmt, s, s_inv)
        row: dict[str, Any] = {"module": name, "step": step, "operand": operand, "recipe": type(r).__name__,
                               "format": fmt.name, "amax": float(amax[0]),
                               "scale": None if s is None else float(s[0]),
                               "scale_inv": None if s_inv is None else float(s_inv[0])}
        row.update(measure(x, own))
        if s is None:
            row.pop("padded", None)
        self._compare(row, x)

    def _compare(self, row: dict[str, Any], x: np.ndarray) -> None:
        """The compared recipes' statistics and per-block statistics of the operand ``x``, then the row kept."""
        if self.compare:
            row["recipes"] = {r.name: measure(x, r) for r in self.compare}
            row["winner"] = winner(contenders(row))
        if self.blocks:
            row["blocks"] = {r.name: block_stats(x, r) for r in self.blocks}
        with self.lock:
            self.record.rows.append(row)


@contextlib.contextmanager
def record_numerics(model: torch.nn.Module, recipes: Union[None, str, Sequence[str]] = None,
                    blocks: bool = False) -> Iterator[NumericsRecord]:
    """Record, while the context is open, what the fp8 casts of every Float8Linear in ``model`` do: per layer,
    per operand (input, weight, grad_output), per step, the amax, the scale the cast used, underflow, saturation
    and SQNR against the high-precision operand (see :class:`NumericsRecord`). Yields the record; ``print`` it
    for a summary, ``.rows`` for every row, ``.to_json()``.

    ``recipes``: also quantize each operand, from its high-precision values, in these recipes to compare
    (``"all"``, or names of :data:`fp8core.numerics_recipes.RECIPES`: ``e4m3``, ``e5m2``, ``mxfp8_rceil``,
    ``mxfp8_floor``, ``block_1x128``, ``block_128x128``, ``nvfp4``, ``nvfp4_rht``, ``mxfp4``, as a list or one
    comma-separated string; block recipes along the operand's last dimension) and name the ``winner`` per row;
    None (the default): the layers' casts only. ``blocks``: also each compared block recipe's per-block statistics
    (:func:`fp8core.numerics_blocks.block_stats`: block scales at the format's limits, flushed elements, the worst
    blocks by position) in each row's ``blocks``, per layer, operand and step. :meth:`NumericsRecord.save` writes
    the record that ``fp8core inspect record.json`` prints and plots.

    Layers record where they run in fp8 (inside :func:`fp8core.torch.autocast`, and outside it for the layers
    convert_to_float8 made); under ``torch.no_grad`` only
    the forward rows. The backward of a forward recorded here is recorded wherever it runs. Off by default and
    free when off: outside the context a layer's flag is False and nothing runs. The results are the same bits
    with or without it. A model compiled with torch.compile before the context, or inside it, records its eager
    twin's rows (the flag is guarded, and the hand-over to the recorder is a graph break); layers running on
    several threads count their steps under one lock. A layer under a block recipe (MXFP8BlockScaling,
    Float8BlockScaling, NVFP4BlockScaling) records its forward and dgrad operands' casts (blocks along the last
    dimension; the weight as [out, in]) under its recipe's name with no per-tensor scale (``scale`` and
    ``scale_inv`` null); NVFP4's gradient is measured rounded to nearest (numerics_recipes.layer_recipe).
    ``model``: a torch.nn.Module holding Float8Linear layers.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    compare = [] if recipes is None else select(recipes, "recipes")
    blocks = fp8core.args.flag(blocks, "blocks")
    if blocks and not any(r.block_scales is not None for r in compare):
        raise ValueError("blocks: True needs a block recipe in recipes= (mxfp8_rceil, block_1x128, nvfp4, ...): "
                         "the per-block statistics are of the compared block recipes")
    names: dict[Float8Linear, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, Float8Linear):
            continue
        names[m] = name
    if not names:
        raise ValueError(f"model: no Float8Linear in this {type(model).__name__} (convert_to_float8 it first)")
    record = NumericsRecord()
    recorder = _Recorder(record, names, compare, blocks)
    for m in names:  # recorders of the contexts open on the layer: a list, as they nest
        m.__dict__.setdefault(RECORDERS, []).append(recorder)
        m._fp8_recording = True
    try:
        yield record
    finally:
        for m in names:
            mine = m.__dict__.get(RECORDERS, [])
            if recorder in mine:
                mine.remove(recorder)
            if not mine:
                m.__dict__.pop(RECORDERS, None)
                m._fp8_recording = False
