"""Quantization error statistics of one tensor in one recipe: SQNR, underflow, clipped, at +-max, largest
relative error (and strict JSON for them). ``fp8core inspect --recipes`` compares recipes with them, and
``fp8core.torch.record_numerics`` measures the casts of a training run with them (each recipe a
:class:`Recipe`: how to quantize, how to read rows back).

The statistics are computed over row chunks of the dequantized result so that no float64 copy of a whole tensor
exists.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from fp8core._fpenv import ieee
from fp8core.backends.cpu import map_spans
from fp8core.backends.cpu_threads import cpu_threads
from fp8core.formats import Encoding, Format

_CHUNK = 1 << 18  # elements per step of the statistics: its float64 scratch (3 rows, 6 MiB) stays in cache


@dataclass(frozen=True)
class Recipe:
    """One way to quantize a tensor. ``quantize`` takes the tensor as [rows, cols] (float32/bfloat16/float16);
    ``dequantize_part(q, r0, r1, c0, c1)`` gives the part [r0:r1, c0:c1] back as (fp8 data, float32 values);
    ``row_step`` is the row granularity of its scales (r0 is always a multiple of it, and c0 of the block's
    columns); ``block`` the block's (rows, cols), None for one scale per tensor. ``fmt``: the elements' encoding
    (a Format, or an :class:`fp8core.formats.Encoding` row such as E2M1, whose codes come one a byte).
    ``operand``, when given, makes what is measured from the tensor [rows, cols] (nvfp4_rht: the transformed
    wgrad operand), None where the recipe does not apply (its reason in ``not_applicable``).
    ``block_scales(q)``: a block recipe's :class:`fp8core.numerics_blocks.BlockScales` (per-block statistics)."""

    name: str
    what: str
    fmt: Format | Encoding
    quantize: Callable[[np.ndarray], Any]
    dequantize_part: Callable[[Any, int, int, int, int], tuple[np.ndarray, np.ndarray]]
    row_step: int = 1
    block: tuple[int, int] | None = None
    scale_inv: Callable[[Any], float] | None = None
    operand: Callable[[np.ndarray], np.ndarray | None] | None = None
    not_applicable: str = ""
    block_scales: Callable[[Any], Any] | None = None


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


def _sum_of_squares(a: np.ndarray) -> float:
    # einsum, not np.dot: BLAS's dot runs on its own threads, which on a loaded machine wait for cores (measured
    # 100x slower) and busy-wait afterwards, taking cores from fp8core's pool
    return float(np.einsum("i,i->", a, a))


@ieee  # the caller's flush-to-zero would read float32 subnormals as 0 in the float64 widening
def _chunk_stats(x: np.ndarray, y32: np.ndarray, codes: np.ndarray, max_code: int, beyond: float,
                 work: np.ndarray, flags: np.ndarray, magnitude: int = 0x7F, of_x: tuple[float, int] | None = None
                 ) -> tuple[list[int], float, float, float, tuple[float, int] | None]:
    """([finite, nonzero, underflow, clipped, at_max, lost], signal, noise, max_rel, of_x) of one flat chunk: the
    values x (float32/bfloat16/float16), their round trip y32 (float32) and its fp8 bytes. ``work``: float64
    [2, >= chunk size], and ``flags``: bool [>= chunk size], the scratch of the counts, both reused from chunk
    to chunk (fresh memory each time costs more in page faults than the arithmetic). ``magnitude``: the code
    bits below the sign. ``of_x``: what depends on x alone, (signal, nonzero) as this function returned them
    for the same chunk in another recipe (returned where all values were finite, else None): not recomputed."""
    v, d = work[0, :x.size], work[1, :x.size]
    np.copyto(v, x)  # exact: every float32/bfloat16/float16 is a float64
    np.copyto(d, y32)  # widened first: a float32 - float64 subtract casts in buffers, at 1.15x the two passes
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, and the masked path below takes over
        np.subtract(d, v, out=d)
    signal = _sum_of_squares(v) if of_x is None else of_x[0]  # f32 squares cannot overflow float64
    noise = _sum_of_squares(d)
    if math.isfinite(signal) and math.isfinite(noise):  # all finite: nothing to gather through masks
        at = np.flatnonzero((codes & magnitude) == max_code)
        clipped = np.count_nonzero(np.abs(v[at]) > np.abs(y32[at].astype(np.float64)) * beyond)
        # a comparison into a bool scratch, then a count of bools: several times faster than counting floats
        flags = flags[:x.size]
        nonzero = np.count_nonzero(np.not_equal(v, 0, out=flags)) if of_x is None else of_x[1]
        # 0 comes back 0, so the nonzero results are a subset of the nonzero inputs
        counts = [v.size, nonzero, nonzero - np.count_nonzero(np.not_equal(y32, 0, out=flags)), clipped, at.size,
                  0]
        with np.errstate(divide="ignore", invalid="ignore"):
            d /= v  # 0/0 where x is 0: NaN, which fmax and fmin pass over
        # the largest |d| from two read-only reductions, not an abs pass that writes d back first; abs() makes
        # a -0.0 (every quotient a zero) the 0.0 that |d| gives
        max_rel = abs(float(np.fmax(np.fmax.reduce(d), -np.fmin.reduce(d)))) if d.size else 0.0
        return counts, signal, noise, 0.0 if math.isnan(max_rel) else max_rel, (signal, nonzero)
    top = (codes & magnitude) == max_code
    v, y = x.astype(np.float64), y32.astype(np.float64)
    fin = np.isfinite(v)
    bad = fin & ~np.isfinite(y)
    ok = fin & ~bad
    nz = ok & (v != 0)
    top &= ok
    counts = [fin.sum(), (fin & (v != 0)).sum(), (nz & (y == 0)).sum(),
              (top & (np.abs(v) > np.abs(y) * beyond)).sum(), top.sum(), bad.sum()]
    signal, noise = float(np.sum(v[fin] ** 2)), float(np.sum((y[ok] - v[ok]) ** 2))
    max_rel = float(np.max(np.abs((y[nz] - v[nz]) / v[nz]))) if nz.any() else 0.0
    return [int(c) for c in counts], signal, noise, max_rel, None


def measure(x: np.ndarray, recipe: Recipe, shared: dict | None = None) -> dict[str, Any]:
    """How x fares in one recipe, over its finite values (x: any shape; :func:`as_rows` is applied).

    sqnr_db: 10 log10(sum x^2 / sum (y - x)^2), inf when exact, None without signal, -inf when a finite value
    came out NaN or inf (an MXFP8 block holding a NaN is NaN throughout: counted in ``lost``). underflow:
    fraction of the nonzero values that become 0. clipped: fraction more than half a step beyond the largest
    magnitude their block represents (they land on it: saturated, where rounding would have gone higher).
    at_max: fraction that land on +-max, clipped ones included. max_rel_error: over the nonzero values.
    padded: a block recipe whose blocks do not tile the shape. scale_inv: a per-tensor recipe's one scale
    inverse. ``shared``: a dict the caller keeps over the recipes of one x (empty at first): the statistics of x
    alone (per chunk, its sum of squares and nonzero count) are then computed once, not once per recipe.
    """
    if recipe.block is not None and x.ndim == 0:
        return {"n/a": "a scalar has no blocks"}
    rows2d, q = prepare(x, recipe)
    if q is None:
        return {"n/a": recipe.not_applicable}
    row = _measure(rows2d, q, recipe, None if recipe.operand is not None else shared)
    if recipe.operand is not None:  # its rows were padded to whole blocks
        row["padded"] = bool(row["padded"] or as_rows(x).shape[0] % recipe.block[1])
    return row


def prepare(x: np.ndarray, recipe: Recipe) -> tuple[np.ndarray, Any]:
    """(what is measured [rows, cols], its quantization): x as rows, or the recipe's operand of them; the
    quantization None where the recipe's operand does not apply."""
    rows2d = as_rows(x)
    if rows2d.size == 0:  # an empty tensor costs nothing, whatever its shape: (10**15, 0) is no rows of work
        rows2d = rows2d[:0]
    if recipe.operand is not None:
        rows2d = recipe.operand(rows2d)
        if rows2d is None:
            return as_rows(x), None
    return rows2d, recipe.quantize(rows2d)


def parts(rows2d: np.ndarray, recipe: Recipe) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) of about _CHUNK elements each, whole blocks each: whole rows where a row is short, a
    row's columns in parts where it is long (a 1-D or one-row tensor is one row), so the float64 scratch and the
    dequantized part stay small whatever the shape."""
    n_rows, n_cols = rows2d.shape
    if not rows2d.size:
        return
    col_block = recipe.block[1] if recipe.block is not None else 1
    width = min(n_cols, max(col_block, _CHUNK // recipe.row_step // col_block * col_block))
    step = max(1, _CHUNK // max(width, 1) // recipe.row_step) * recipe.row_step
    for r0 in range(0, n_rows, step):
        for c0 in range(0, n_cols, width):
            yield r0, min(r0 + step, n_rows), c0, min(c0 + width, n_cols)


def _measure(rows2d: np.ndarray, q: Any, recipe: Recipe, shared: dict | None = None) -> dict[str, Any]:
    n_rows, n_cols = rows2d.shape
    enc = recipe.fmt.encoding if isinstance(recipe.fmt, Format) else recipe.fmt
    magnitude = (1 << (enc.bits - 1)) - 1
    max_code = int(np.array(enc.max, np.float32).astype(enc.numpy_dtype).view(np.uint8))
    below_max = float(enc.values[max_code - 1])
    # Within half a step above max a value rounds onto max like any other value; beyond it, it saturates.
    beyond = 1 + (enc.max - below_max) / (2 * enc.max)
    chunks = list(parts(rows2d, recipe))
    size = max(((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in chunks), default=0)
    scratch: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per thread, reused from chunk to chunk

    def stats(i: int, _: int) -> tuple[list[int], float, float, float, tuple[float, int] | None]:
        work = scratch.get(threading.get_ident())
        if work is None:
            work = scratch[threading.get_ident()] = (np.empty((2, size)), np.empty(size, np.bool_))
        r0, r1, c0, c1 = chunks[i]
        with cpu_threads(1):  # the chunks are the parallel work: a pool task queued from here would sit behind them
            codes, y32 = recipe.dequantize_part(q, r0, r1, c0, c1)
        got = _chunk_stats(rows2d[r0:r1, c0:c1].ravel(), np.asarray(y32).ravel(),
                           np.asarray(codes).view(np.uint8).ravel(), max_code, beyond, *work, magnitude,
                           None if shared is None else shared.get(chunks[i]))
        if shared is not None and got[4] is not None:
            shared[chunks[i]] = got[4]  # keyed by the chunk's bounds: the same elements of x in every recipe
        return got

    # The chunks on fp8core's CPU pool (the dequantize and the statistics were a single thread's: most of a
    # recipe's time), summed here in chunk order: the same float64 sums, whatever thread measured a chunk
    totals = np.zeros(6, np.int64)  # finite, nonzero, underflow, clipped, at_max, lost
    signal = noise = max_rel = 0.0
    for counts, s, n, m, _ in map_spans(len(chunks), 1, stats):
        totals += counts
        signal, noise, max_rel = signal + s, noise + n, max(max_rel, m)
    finite, nonzero, under, clipped, at_max, lost = (int(t) for t in totals)
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
    if recipe.scale_inv is not None:
        row["scale_inv"] = recipe.scale_inv(q)
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


def strict_json(obj: Any) -> Any:
    """JSON has no inf or NaN: infinities become the strings "inf"/"-inf", NaN the string "nan"."""
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [strict_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj
