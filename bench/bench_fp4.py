"""FP4 quantization on the CPU reference against the CPU MXFP8 path: nanoseconds per input element.

The bar (issue 35): NVFP4 quantize, with and without the Hadamard transform, at least as fast per element as
fp8core.quantize_mxfp8 on the same input. Every case runs once per round, rounds interleaved, so a busy machine
slows them alike; each row gives the wall time's median [20th-80th percentile] and its ratio to MXFP8 rowwise's
median, and the same of the process's CPU time (every thread's: the pool's too), which other processes on a
shared machine disturb far less than the wall time.
``--threads N`` runs every case inside ``fp8core.cpu_threads(N)`` (1: each path on the calling thread alone, so that
a path's use of the pool, MXFP8's cast on it, NVFP4's whole pass on it, takes no part in the ratio).
``--base CHECKOUT``: an A/B run instead; every case of this checkout and of CHECKOUT's fp8core (imported in the same
process, bench_ab.load_base) runs once per round, the two interleaved, and each row gives this checkout's CPU time
over the base's, the median of the per-round ratios [20th-80th percentile] (a loaded machine slows both alike).
Usage: python bench/bench_fp4.py [--sizes-mib 16 64] [--dtypes bfloat16 float32] [--rounds 9] [--threads N]
       [--base CHECKOUT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import ml_dtypes  # noqa: F401 - registers the name bfloat16 with NumPy
import numpy as np

import fp8core

BAR = "mxfp8 rowwise"


def cases(x: np.ndarray, fc: Any = fp8core) -> dict[str, Callable[[], Any]]:
    """name -> one call of module ``fc`` (fp8core, or a base checkout's) on x [M, K]."""
    nv, mx = fc.quantize_nvfp4(x), fc.quantize_mxfp4(x)
    return {
        BAR: lambda: fc.quantize_mxfp8(x),
        "mxfp8 columnwise": lambda: fc.quantize_mxfp8(x, columnwise=True),
        "nvfp4 rowwise": lambda: fc.quantize_nvfp4(x),
        "nvfp4 rowwise hadamard": lambda: fc.quantize_nvfp4(x, hadamard=True),
        "nvfp4 columnwise": lambda: fc.quantize_nvfp4(x, columnwise=True),
        "nvfp4 columnwise hadamard (TE's wgrad operand)": lambda: fc.quantize_nvfp4(x, columnwise=True,
                                                                                     hadamard=True),
        "nvfp4 weight_2d": lambda: fc.quantize_nvfp4(x, weight_2d=True),
        "nvfp4 rowwise stochastic": lambda: fc.quantize_nvfp4(x, rounding="stochastic", seed=1),
        "mxfp4 rowwise": lambda: fc.quantize_mxfp4(x),
        "nvfp4 dequantize": lambda: fc.dequantize_nvfp4(nv, x.dtype),
        "mxfp4 dequantize": lambda: fc.dequantize_mxfp4(mx, x.dtype),
    }


def summary(ts: list[float], bar: list[float]) -> tuple[float, float, float, float]:
    """(median, 20th, 80th percentile, median over the bar's median)."""
    q = statistics.quantiles(ts, n=5) if len(ts) >= 5 else [min(ts)] * 4
    med = statistics.median(ts)
    return med, q[0], q[3], med / statistics.median(bar)


def run(x: np.ndarray, rounds: int) -> list[dict[str, Any]]:
    """Per case: wall and CPU ns per element over ``rounds`` interleaved rounds."""
    todo = cases(x)
    for fn in todo.values():  # caches (tables, the pool's threads) are not the path's time
        fn()
    wall: dict[str, list[float]] = {name: [] for name in todo}
    cpu: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(rounds):
        for name, fn in todo.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            c, t = time.process_time() - c, time.perf_counter() - t
            wall[name].append(t * 1e9 / x.size)
            cpu[name].append(c * 1e9 / x.size)
    rows = []
    for name in todo:
        row: dict[str, Any] = {"case": name, "shape": list(x.shape), "dtype": str(x.dtype)}
        for kind, times in (("wall", wall), ("cpu", cpu)):
            med, p20, p80, ratio = summary(times[name], times[BAR])
            row.update({f"{kind}_ns_per_element": med, f"{kind}_p20": p20, f"{kind}_p80": p80,
                        f"{kind}_over_mxfp8": ratio})
        rows.append(row)
    return rows


def run_ab(x: np.ndarray, base: Any, rounds: int) -> list[dict[str, Any]]:
    """Per case: this checkout's and the base's CPU ns per element (medians) and the median [p20-p80] of the
    per-round ratios ours / base, the two called back to back in every round (their order alternating)."""
    pair = {"ours": cases(x), "base": cases(x, base)}
    for todo in pair.values():
        for fn in todo.values():
            fn()
    cpu: dict[tuple[str, str], list[float]] = {(who, name): [] for who in pair for name in pair["ours"]}
    for r in range(rounds):
        for name in pair["ours"]:
            for who in (("ours", "base") if r % 2 == 0 else ("base", "ours")):
                c = time.process_time()
                pair[who][name]()
                cpu[who, name].append((time.process_time() - c) * 1e9 / x.size)
    rows = []
    for name in pair["ours"]:
        ratios = [a / b for a, b in zip(cpu["ours", name], cpu["base", name])]
        q = statistics.quantiles(ratios, n=5) if len(ratios) >= 5 else [min(ratios)] * 4
        rows.append({"case": name, "shape": list(x.shape), "dtype": str(x.dtype),
                     "ours_cpu_ns_per_element": statistics.median(cpu["ours", name]),
                     "base_cpu_ns_per_element": statistics.median(cpu["base", name]),
                     "cpu_ratio": statistics.median(ratios), "cpu_ratio_p20": q[0], "cpu_ratio_p80": q[3]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16], help="input sizes, as bf16 MiB")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, help="run inside fp8core.cpu_threads(N)")
    ap.add_argument("--base", help="a base checkout: A/B against its fp8core (CPU-time ratios)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    base = None
    if args.base:
        from bench_ab import load_base

        base = load_base(args.base)
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    if args.threads:
        where += f", fp8core.cpu_threads({args.threads})"
    if base is not None:
        where += f", A/B against {args.base}"
        print(f"# bench_fp4 on the CPU ({where}); CPU ns per input element (medians of {args.rounds} rounds), "
              f"ours / base: the median [20th-80th percentile] of the per-round ratios")
    else:
        print(f"# bench_fp4 on the CPU ({where}); ns per input element, median of {args.rounds} interleaved rounds "
              f"[20th-80th percentile] and the median over {BAR}'s: wall time, then the process's CPU time")
    out = []
    for mib in args.sizes_mib:
        n = mib * (1 << 20) // 2
        shape = (n // args.cols, args.cols)
        for name in args.dtypes:
            x = np.random.default_rng(0).standard_normal(shape).astype(np.dtype(name))
            with fp8core.cpu_threads(args.threads), (base or fp8core).cpu_threads(args.threads):
                rows = run(x, args.rounds) if base is None else run_ab(x, base, args.rounds)
            out += rows
            print(f"\n## {shape} {name}")
            if base is not None:
                for r in rows:
                    print(f"{r['case']:<48}  ours {r['ours_cpu_ns_per_element']:6.2f}  base "
                          f"{r['base_cpu_ns_per_element']:6.2f}  ratio {r['cpu_ratio']:5.3f} "
                          f"[{r['cpu_ratio_p20']:5.3f}-{r['cpu_ratio_p80']:5.3f}]")
                continue
            for r in rows:
                print(f"{r['case']:<48}" + "".join(
                    f"  {k} {r[k + '_ns_per_element']:6.2f} [{r[k + '_p20']:6.2f}-{r[k + '_p80']:6.2f}] "
                    f"{r[k + '_over_mxfp8']:4.2f}x" for k in ("wall", "cpu")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": where, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
