"""``fp8core inspect --recipes all`` on a generated bf16 .safetensors checkpoint: wall time and GB/s of the file,
the peak resident memory of the inspect process against its largest tensor, and each recipe's GB/s on one tensor (its
quantize, dequantize and statistics together, as inspect runs them).

The peak RSS (Linux's VmHWM of the inspect process) is printed beside that of the same command on a file of one
small tensor (the interpreter, NumPy and torch: what any file costs), so what the file's size adds is their
difference. The machine is shared: the load average before and after, and the inspect process's CPU seconds
(user + system), are printed with the time.

The shape row (issue 39): the same float32 data (``--shape-mib``, default 32) as a 1-D .npy and as a [rows, 4096]
.npy, each through ``inspect --recipes all``: the peak RSS and wall time of each (median, p20 and p80 over
``--repeat`` runs, interleaved), so that what a flat tensor costs beyond its matrix twin shows (it was three
float64 copies of the tensor: 258 MiB against 88 MiB at 32 MiB).

Issue 26's bar: a 1 GiB bf16 file through all recipes on the CPU in under a minute on 2 cores. The process is
pinned to ``--cores`` cores (default 2, the bar's machine); the default file is 256 MiB, and the time 1 GiB
would take at the same rate is printed beside it (``--size-mib 1024`` measures it).
The recipe row (issue 36, the FP4 recipes): ``--recipe-rounds N`` times ``measure`` of each recipe on one 4096x4096
bf16 tensor, the recipes interleaved round by round, in process CPU time and wall time per element (median, p20,
p80), and the sum over the FP8 recipes against the sum over the FP4 ones: what ``--recipes all`` costs beyond the
FP8 six, measured in one process under one load (a shared machine's load moves the absolute figures several-fold).
Usage: python bench/bench_inspect.py [--size-mib 256] [--shape-mib 32] [--cores 2] [--repeat 3] [--json out.json]
       [--trees A_TREE B_TREE]  (A/B: the file through each source tree's fp8core, --repeat rounds alternating)
       [--shapes-only] [--recipe-rounds 5 --recipes-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

import numpy as np

import fp8core
from fp8core.cli.recipes import RECIPES, measure
from fp8core.formats import E2M1

_TENSOR = (4096, 4096)  # 32 MiB in bf16: a 7B model's attention projection


def write_checkpoint(path: Path, size_mib: int, rows: int = 0) -> tuple[int, int]:
    """A bf16 checkpoint of about size_mib MiB (one tensor of ``rows`` rows if given): (bytes of tensor data,
    bytes of the largest tensor)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    per = _TENSOR[0] * _TENSOR[1] * 2
    count = 1 if rows else max(1, size_mib * (1 << 20) // per)
    rows = rows or (max(1, size_mib * (1 << 20) // (_TENSOR[1] * 2)) if count == 1 else _TENSOR[0])
    tensors = {}
    for i in range(count):
        scale = 10.0 ** (i % 7 - 3)  # layers whose magnitudes differ, as a checkpoint's do
        tensors[f"layers.{i}.weight"] = (torch.randn(rows, _TENSOR[1], generator=g) * scale).to(torch.bfloat16)
    save_file(tensors, str(path))
    return count * rows * _TENSOR[1] * 2, rows * _TENSOR[1] * 2


# The child's own peak (Linux's VmHWM, of the process image exec made), printed to stderr as it exits: the
# rusage of children counts the parent's pages at the fork as the child's too.
_CHILD = ("import atexit, sys\n"
          "def peak():\n"
          "    with open('/proc/self/status') as f:\n"
          "        print('VmHWM', *[l.split()[1] for l in f if l.startswith('VmHWM')], file=sys.stderr)\n"
          "atexit.register(peak)\n"
          "from fp8core.cli import main\n"
          "sys.exit(main(sys.argv[1:]))\n")


def inspect(path: Path, tree: str | None = None) -> tuple[dict, int]:
    """``fp8core inspect PATH --recipes all --json`` in a child process (fp8core from the source tree ``tree``
    when given): (its tensors' rows, its peak RSS in bytes)."""
    env = None if tree is None else dict(os.environ, PYTHONPATH=tree)
    # run in the tree: "python -c" puts the working directory first on sys.path, before PYTHONPATH, so from a
    # checkout's root every tree's run would import that checkout's fp8core
    run = subprocess.run([sys.executable, "-c", _CHILD, "inspect", str(Path(path).resolve()), "--recipes", "all",
                          "--json"], capture_output=True, text=True, env=env, cwd=tree)
    assert run.returncode == 0, run.stderr
    peak = [line.split()[1] for line in run.stderr.splitlines() if line.startswith("VmHWM")]
    return json.loads(run.stdout)["tensors"], int(peak[-1]) * 1024


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p20": at(0.2), "p80": at(0.8)}


def shape_rows(tmp: Path, mib: int, repeat: int) -> dict[str, dict]:
    """The same float32 data as a 1-D tensor and as a [rows, 4096] one through ``inspect --recipes all``: per
    shape, the tensor's bytes, and the peak RSS (bytes) and wall time (s) as median/p20/p80 over ``repeat``
    interleaved runs."""
    n = mib * (1 << 20) // 4 // 4096 * 4096
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    files = {"flat": tmp / "flat.npy", "matrix": tmp / "matrix.npy"}
    np.save(files["flat"], x)
    np.save(files["matrix"], x.reshape(-1, 4096))
    peaks: dict[str, list[float]] = {k: [] for k in files}
    walls: dict[str, list[float]] = {k: [] for k in files}
    for _ in range(repeat):
        for kind, path in files.items():
            t = time.perf_counter()
            _, peak = inspect(path)
            walls[kind].append(time.perf_counter() - t)
            peaks[kind].append(peak)
    return {kind: {"shape": [n] if kind == "flat" else [n // 4096, 4096], "tensor_bytes": x.nbytes,
                   "peak_rss_bytes": _quantiles(peaks[kind]), "seconds": _quantiles(walls[kind])} for kind in files}


def recipe_rows(rounds: int) -> dict[str, dict]:
    """Per recipe, ns per element of ``measure`` on one 4096x4096 bf16 tensor: process CPU and wall, quantiles over
    ``rounds`` interleaved rounds; and the sums of the medians over the FP8 recipes and over the FP4 ones."""
    import ml_dtypes

    x = (np.random.default_rng(0).standard_normal(_TENSOR) * 0.02).astype(ml_dtypes.bfloat16)
    cpu: dict[str, list[float]] = {n: [] for n in RECIPES}
    wall: dict[str, list[float]] = {n: [] for n in RECIPES}
    for _ in range(rounds):
        for name, recipe in RECIPES.items():
            c, w = time.process_time(), time.perf_counter()
            measure(x, recipe)
            cpu[name].append((time.process_time() - c) / x.size * 1e9)
            wall[name].append((time.perf_counter() - w) / x.size * 1e9)
    out = {n: {"cpu_ns": _quantiles(cpu[n]), "wall_ns": _quantiles(wall[n])} for n in RECIPES}
    fp4 = [n for n, r in RECIPES.items() if r.fmt is E2M1]
    for what in ("cpu_ns", "wall_ns"):
        out.setdefault("sum", {})[what] = {
            "fp8": sum(out[n][what]["median"] for n in RECIPES if n not in fp4),
            "fp4": sum(out[n][what]["median"] for n in fp4)}
    return out


def ab_rows(path: Path, trees: list[str], rounds: int) -> dict[str, Any]:
    """``inspect --recipes all`` of one file with fp8core from each source tree in turn, ``rounds`` times, the order
    reversed every other round (A B, B A, ...): per tree, wall and CPU seconds (median, p20, p80) and the load
    average before each run; and whether every tree printed the same JSON (the figures must not move)."""
    runs: dict[str, dict[str, list[float]]] = {t: {"seconds": [], "cpu_seconds": [], "load": []} for t in trees}
    printed: dict[str, str] = {}
    for i in range(rounds):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            runs[tree]["load"].append(os.getloadavg()[0])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            rows, _ = inspect(path, tree)
            runs[tree]["seconds"].append(time.perf_counter() - t)
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            runs[tree]["cpu_seconds"].append(usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime)
            printed.setdefault(tree, json.dumps(rows, sort_keys=True))
    return {"trees": {t: {k: _quantiles(v) | {"runs": v} for k, v in r.items()} for t, r in runs.items()},
            "same_output": len(set(printed.values())) == 1}


def main_bench() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--cores", type=int, default=2, help="cores the run is pinned to (0: all)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats of the per-recipe timings (median)")
    ap.add_argument("--shape-mib", type=int, default=32, help="float32 MiB of the shape row's tensor (0: none)")
    ap.add_argument("--shapes-only", action="store_true", help="the shape row alone")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--recipe-rounds", type=int, default=0, help="rounds of the per-recipe row (0: none)")
    ap.add_argument("--recipes-only", action="store_true", help="the per-recipe row alone")
    ap.add_argument("--trees", nargs="+", metavar="TREE", help="A/B: the checkpoint through fp8core from each "
                    "source tree in turn, --repeat rounds, order alternating (nothing else is measured)")
    args = ap.parse_args()
    if args.cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])  # the child inherits it
    machine = f"{platform.machine()} {os.cpu_count()} cores, pinned to {len(os.sched_getaffinity(0))}"
    shapes = {}
    if args.shape_mib:
        with tempfile.TemporaryDirectory() as tmp:
            shapes = shape_rows(Path(tmp), args.shape_mib, args.repeat)
        for kind, r in shapes.items():
            rss, secs = r["peak_rss_bytes"], r["seconds"]
            print(f"shape {kind:<6} {tuple(r['shape'])} float32, {r['tensor_bytes'] / 2**20:.0f} MiB: peak RSS "
                  f"{rss['median'] / 2**20:.0f} MiB (p20 {rss['p20'] / 2**20:.0f}, p80 {rss['p80'] / 2**20:.0f}), "
                  f"{secs['median']:.1f} s (p20 {secs['p20']:.1f}, p80 {secs['p80']:.1f}); inspect --recipes all, "
                  f"{args.repeat} runs; {machine}; fp8core from {Path(fp8core.__file__).parent}")
    if args.recipe_rounds:
        load = os.getloadavg()[0]
        rows = recipe_rows(args.recipe_rounds)
        for name, r in rows.items():
            c, w = r["cpu_ns"], r["wall_ns"]
            if name == "sum":
                print(f"  sum of medians: FP8 recipes {c['fp8']:.1f} CPU ns ({w['fp8']:.1f} wall), FP4 recipes "
                      f"{c['fp4']:.1f} CPU ns ({w['fp4']:.1f} wall): all = {1 + c['fp4'] / c['fp8']:.2f}x the FP8 "
                      f"recipes' CPU time")
                continue
            print(f"  {name:<14} {c['median']:6.1f} CPU ns/element (p20 {c['p20']:.1f}, p80 {c['p80']:.1f}), wall "
                  f"{w['median']:.1f} (p20 {w['p20']:.1f}, p80 {w['p80']:.1f})")
        print(f"per recipe: measure() on one 4096x4096 bf16 tensor, {args.recipe_rounds} interleaved rounds; load "
              f"average {load:.2f} before, {os.getloadavg()[0]:.2f} after; {machine}")
        if args.recipes_only:
            if args.json:
                Path(args.json).write_text(json.dumps({"machine": machine, "recipes": rows}, indent=1))
            return
    if args.trees:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "checkpoint.safetensors"
            data_bytes, _ = write_checkpoint(path, args.size_mib)
            ab = ab_rows(path, args.trees, args.repeat)
        for tree, r in ab["trees"].items():
            w, c, ld = r["seconds"], r["cpu_seconds"], r["load"]
            print(f"{tree}: {w['median']:.1f} s wall (p20 {w['p20']:.1f}, p80 {w['p80']:.1f}), {c['median']:.1f} CPU s "
                  f"(p20 {c['p20']:.1f}, p80 {c['p80']:.1f}), load {min(ld['runs']):.1f}-{max(ld['runs']):.1f}; "
                  f"{data_bytes / 2**20:.0f} MiB bf16, inspect --recipes all, {args.repeat} rounds; {machine}")
        print(f"same JSON from every tree: {ab['same_output']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine, "file_bytes": data_bytes, **ab}, indent=1))
        return
    if args.shapes_only:
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine, "shapes": shapes}, indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.safetensors"
        data_bytes, largest = write_checkpoint(path, args.size_mib)
        small = Path(tmp) / "small.safetensors"
        write_checkpoint(small, 0, rows=1)
        _, base_rss = inspect(small)
        load_before = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        rows, peak = inspect(path)
        wall = time.perf_counter() - t
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
        load_after = os.getloadavg()
    import ml_dtypes

    x = (np.random.default_rng(0).standard_normal(_TENSOR) * 0.02).astype(ml_dtypes.bfloat16)
    per_recipe = {}
    for name, recipe in RECIPES.items():
        times = []
        for _ in range(args.repeat):
            s = time.perf_counter()
            measure(x, recipe)
            times.append(time.perf_counter() - s)
        per_recipe[name] = x.nbytes / statistics.median(times) / 1e9
    result = {
        "machine": machine, "shapes": shapes,
        "fp8core": str(Path(fp8core.__file__).parent),
        "file_bytes": data_bytes, "tensors": len(rows),
        "seconds": wall, "cpu_seconds": cpu, "gb_per_s": data_bytes / wall / 1e9, "peak_rss_bytes": peak,
        "peak_rss_small_file_bytes": base_rss, "largest_tensor_bytes": largest, "recipe_gb_per_s": per_recipe,
        "seconds_per_gib": wall * 2**30 / data_bytes, "load_before": load_before, "load_after": load_after,
    }
    print(f"{data_bytes / 2**20:.0f} MiB bf16 in {len(rows)} tensors, all {len(RECIPES)} recipes: {wall:.1f} s "
          f"({result['gb_per_s']:.3f} GB/s of file, the interpreter's start included; {cpu:.1f} CPU s); peak RSS "
          f"{peak / 2**20:.0f} MiB, {(peak - base_rss) / 2**20:.0f} above a one-small-tensor file's "
          f"{base_rss / 2**20:.0f} (largest tensor {largest / 2**20:.0f} MiB); 1 GiB at this rate: "
          f"{result['seconds_per_gib']:.0f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{result['machine']}; fp8core from {result['fp8core']}")
    for name, gbs in per_recipe.items():
        print(f"  {name:<14} {gbs:.3f} GB/s of bf16 input (quantize + dequantize + statistics)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main_bench()
