"""CPU throughput of fp8core's reference backend against torch CPU eager and plain ml_dtypes.

GB/s counts the bytes each primitive must read and write. Prints a table; --json writes the rows.
Usage: python bench/bench_cpu.py [--sizes-mib 1 16 64 256] [--sizes-kib 64 256] [--quick] [--json out.json]
       [--crossover | --gemm-crossover]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import ml_dtypes
import numpy as np

import fp8core


def timeit(fn, repeat: int) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) >= 2 else times * 4  # within [min, max]
    return statistics.median(times), q[0], q[3]


def interleaved(fns: dict, repeat: int, block: int = 1, ratio: tuple[str, str] = ("ours", "eager")
                ) -> tuple[dict, float]:
    """Each callable timed in alternating blocks of ``block`` calls (``repeat`` blocks each, after one warm-up
    call), so that a machine whose speed drifts (a shared VM: here torch eager's 16-element quantize ran 18-34 us
    within a minute) slows every candidate alike. Returns {name: (median, p20, p80)} of the blocks' per-call
    seconds, and the median over blocks of fns[ratio[0]] / fns[ratio[1]] (nan without both)."""
    for fn in fns.values():
        fn()
    per = {k: [] for k in fns}
    for _ in range(max(5, repeat)):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(block):
                fn()
            per[k].append((time.perf_counter() - t) / block)
    stats = {}
    for k, v in per.items():
        q = statistics.quantiles(v, n=5, method="inclusive")
        stats[k] = (statistics.median(v), q[0], q[3])
    top, bottom = ratio
    r = statistics.median(a / b for a, b in zip(per[top], per[bottom])) if top in per and bottom in per \
        else float("nan")
    return stats, r


def _torch_dynamic(torch, tx):
    a = tx.abs().max().float()
    scale = torch.where(a > 0, 448.0 / a, torch.ones_like(a))
    return (tx.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), 1 / scale, a


def cases(x: np.ndarray, torch):
    n = x.size
    hp = x.dtype.itemsize
    s = np.array([0.5], np.float32)
    q = fp8core.quantize(x, s, "e4m3")
    rows = 1024
    x2 = x.reshape(rows, -1)
    out = {
        "quantize": (n * (hp + 1), lambda: fp8core.quantize(x, s, "e4m3")),
        "quantize+amax": (n * (hp + 1), lambda: fp8core.quantize(x, s, "e4m3", amax_out=np.zeros(1, np.float32))),
        "amax": (n * hp, lambda: fp8core.amax(x)),
        "dequantize": (n * (1 + hp), lambda: fp8core.dequantize(q, s, "bfloat16" if hp == 2 else "float32")),
        "cast_transpose": (n * (hp + 2), lambda: fp8core.cast_transpose(x2, s, "e4m3")),
        # current scaling: a new scale every call, so no per-scale table is reused
        "quantize_dynamic": (n * (hp + 1), lambda: fp8core.quantize_dynamic(x, "e4m3")),
    }
    peers = {"ml_dtypes": {
        "quantize": lambda: np.clip(x.astype(np.float32) * s[0], -448, 448).astype(ml_dtypes.float8_e4m3fn),
        "amax": lambda: np.abs(x.astype(np.float32)).max(),
        "dequantize": lambda: (q.astype(np.float32) * s[0]).astype(x.dtype),
    }}
    if torch is not None:
        tdt = torch.bfloat16 if x.dtype == ml_dtypes.bfloat16 else torch.float32
        tx = torch.from_numpy(x.view(np.uint16)).view(tdt) if hp == 2 else torch.from_numpy(x)
        tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        ts = torch.tensor(0.5)
        peers["torch eager"] = {
            "quantize": lambda: (tx.float() * ts).clamp(-448, 448).to(torch.float8_e4m3fn),
            "quantize+amax": lambda: ((tx.float() * ts).clamp(-448, 448).to(torch.float8_e4m3fn), tx.abs().max()),
            "amax": lambda: tx.abs().max(),
            "dequantize": lambda: (tq.float() * ts).to(tdt),
            "quantize_dynamic": lambda: _torch_dynamic(torch, tx),
            "cast_transpose": lambda: ((tx.float() * ts).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, -1),
                                       (tx.float() * ts).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, -1)
                                       .t().contiguous()),
        }
    return out, peers


def _min_interleaved(fns: list, repeat: int) -> list[float]:
    """Fastest of ``repeat`` calls of each, the calls interleaved: on a shared machine the load then falls on
    all of them alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def crossover(repeat: int) -> list[dict]:
    """The CPU backend with its thread pool forced off and on, by size and kind of work: where the pool pays.

    quantize float32 is the direct cast (``_POOL_MIN["cast"]``); quantize bfloat16 (a scale seen before: the
    per-scale table) and dequantize are lookups (``_POOL_MIN["lookup"]``); amax runs on the calling thread, and
    its row shows what two threads would do (the array in four pieces, two per thread).
    """
    from fp8core.backends import cpu
    from fp8core._tensor import wrap

    print(f"# thread-pool crossover (backend only, us per call, min of {repeat} interleaved; "
          f"_POOL_MIN = {cpu._POOL_MIN}, CHUNK = {cpu.CHUNK}, _MIN_SHARE = {cpu._MIN_SHARE})")
    print(f"{'op':<12} {'dtype':<9} {'kind':<7} {'elements':>9} {'serial us':>10} {'pool us':>9} {'pool/serial':>12}")
    rows, saved = [], (dict(cpu._POOL_MIN), cpu.CHUNK)
    rng = np.random.default_rng(0)
    s = np.array([0.5], np.float32)
    e4m3 = fp8core.Format.E4M3
    try:
        for k in range(14, 23):
            n = 1 << k
            base = rng.standard_normal(n, dtype=np.float32)
            xb, xf = wrap(base.astype(ml_dtypes.bfloat16)), wrap(base)
            q = wrap(cpu.quantize(xb, s, e4m3, None))

            def amax2(x=xb.data):
                cpu.CHUNK = 1 << 62  # pieces of n / (2 * threads)
                try:
                    return max(cpu.map_chunks(n, lambda a, b: cpu._amax_bits(x[a:b]), "amax"))
                finally:
                    cpu.CHUNK = saved[1]

            ops = [("quantize", "float32", "cast", lambda: cpu.quantize(xf, s, e4m3, None)),
                   ("quantize", "bfloat16", "lookup", lambda: cpu.quantize(xb, s, e4m3, None)),
                   ("dequantize", "bfloat16", "lookup", lambda: cpu.dequantize(q, e4m3, s, "bfloat16")),
                   ("amax", "bfloat16", "amax", amax2)]
            for op, dtype, kind, fn in ops:
                def serial(fn=fn):
                    cpu._POOL_MIN = dict.fromkeys(saved[0], 1 << 62) | {"amax": 1 << 62}
                    fn()

                def pooled(fn=fn):
                    cpu._POOL_MIN = dict.fromkeys(saved[0], 0) | {"amax": 0}
                    fn()

                t_serial, t_pool = _min_interleaved([serial, pooled], repeat)
                rows.append({"op": op, "dtype": dtype, "kind": kind, "elements": n, "serial_us": t_serial * 1e6,
                             "pool_us": t_pool * 1e6})
                print(f"{op:<12} {dtype:<9} {kind:<7} {n:>9} {t_serial * 1e6:>10.0f} {t_pool * 1e6:>9.0f} "
                      f"{t_pool / t_serial:>12.2f}", flush=True)
    finally:
        cpu._POOL_MIN, cpu.CHUNK = saved
    return rows


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gemm_transpose_crossover(repeat: int) -> list[dict]:
    """The CPU GEMM and transpose with their choices forced each way, by shape (backend calls, medians of
    ``repeat`` interleaved, each timed call right after an untimed one of the same variant, which leaves the
    caches as that variant does (data the pool's thread wrote sits in the other core's cache); p20/p80: a page
    fault costs some calls and not others, so no minimum; page faults per call): the GEMM in one span or split
    into column spans (``_GEMM_POOL_MIN``, forced either way whatever BLAS's threads); the transpose's strips
    (32 rows against :func:`cpu._strip_rows`) and its pool (``_TRANSPOSE_POOL_MIN``)."""
    from fp8core.backends import cpu
    from fp8core.gemm import GemmSpec
    from fp8core._tensor import wrap

    saved = (cpu._GEMM_POOL_MIN, cpu._TRANSPOSE_POOL_MIN, cpu._strip_rows)
    rng = np.random.default_rng(0)
    e4m3, one = fp8core.Format.E4M3, np.ones(1, np.float32)
    rows = []

    def variant(**settings):
        def run(fn):
            def call():
                for name, value in settings.items():
                    setattr(cpu, name, value)
                f0 = _faults()
                fn()
                call.faults += _faults() - f0
            call.faults = 0
            return call
        return run

    def measure(label, shape, fn, variants):
        calls = {name: variant(**v)(fn) for name, v in variants.items()}
        names = list(calls)
        times = {name: [] for name in names}
        for i in range(repeat):
            for name in names:
                calls[name]()  # untimed: the timed call finds the caches as its own variant leaves them
                t = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t)
        row = {"op": label, "shape": shape}
        for name, call in calls.items():
            q = statistics.quantiles(times[name], n=5, method="inclusive")
            row.update({name + "_us": statistics.median(times[name]) * 1e6, name + "_p20_us": q[0] * 1e6,
                        name + "_p80_us": q[3] * 1e6, name + "_faults": call.faults / (2 * repeat)})
        rows.append(row)
        print(f"{label:<10} {shape:<14}" + "".join(
            f"  {name} {row[name + '_us']:6.0f} us ({row[name + '_p20_us']:.0f}-{row[name + '_p80_us']:.0f}) "
            f"{row[name + '_faults']:4.0f} faults" for name in variants), flush=True)

    try:
        print(f"# CPU GEMM (bf16 out) and transpose, choices forced (us per call: median (p20-p80) of {repeat} "
              f"interleaved calls, each after an untimed one of its own; page faults per call)")
        for m, n, k in [(64, 256, 256), (256, 256, 64), (128, 256, 256), (64, 512, 512), (256, 256, 256),
                        (128, 512, 512), (64, 1024, 1024), (256, 1024, 1024), (1024, 1024, 256)]:
            a = wrap(rng.standard_normal((m, k)).astype(ml_dtypes.float8_e4m3fn))
            b = wrap(rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn))
            spec = GemmSpec(m, n, k, e4m3, e4m3, "bfloat16", None, False)
            out = np.empty((m, n), ml_dtypes.bfloat16)
            measure("gemm", f"{m}x{n}x{k}", lambda a=a, b=b, spec=spec, out=out:
                    cpu.gemm(spec, a, b, one, one, None, None, None, out),
                    {"one": {"_GEMM_POOL_MIN": 1 << 62}, "split": {"_GEMM_POOL_MIN": 0}})
        for r, c in [(64, 256), (256, 256), (256, 1024), (1024, 256), (1024, 1024), (4096, 64), (4096, 128),
                     (64, 4096), (1000, 3000), (2048, 2048), (4096, 4096), (2048, 8192)]:
            q = wrap(rng.integers(0, 256, (r, c), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn))
            out = np.empty((c, r), ml_dtypes.float8_e4m3fn)
            measure("transpose", f"{r}x{c}", lambda q=q, out=out: cpu.transpose(q, out=out),
                    {"strips32": {"_strip_rows": lambda cols: 32, "_TRANSPOSE_POOL_MIN": 1 << 62},
                     "strips": {"_strip_rows": saved[2], "_TRANSPOSE_POOL_MIN": 1 << 62},
                     "pool": {"_strip_rows": saved[2], "_TRANSPOSE_POOL_MIN": 0}})
    finally:
        cpu._GEMM_POOL_MIN, cpu._TRANSPOSE_POOL_MIN, cpu._strip_rows = saved
    return rows


def _fixed(v: float | None, width: int) -> str:
    """A figure with two decimals, or "—" where the peer has no such primitive (or is not installed)."""
    return f"{'—' if v is None else f'{v:.2f}':>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description="CPU throughput of fp8core's reference backend against torch eager (with "
                                 "its intra-op threads pinned and printed) and plain ml_dtypes, in GB/s of the bytes "
                                 "each primitive must read and write; '—' where a peer has no such primitive.")
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--sizes-kib", type=int, nargs="*", default=[64, 256],
                    help="small sizes, run before the MiB sizes (where thread-pool dispatch and call overhead show)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="64 KiB, 1 and 64 MiB, bf16, few repeats")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--crossover", action="store_true", help="only the thread pool's crossover, by size")
    ap.add_argument("--gemm-crossover", action="store_true",
                    help="only the GEMM's scratch and column split, and the transpose's strips and pool, by shape")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch's intra-op threads (default: as many as fp8core's CPU pool uses; 1 compares "
                         "single-threaded code, and on a loaded machine keeps torch's thread team from stalling on "
                         "a busy core)")
    args = ap.parse_args()
    if args.torch_threads < 0:
        ap.error("--torch-threads: expected a number >= 0 (0: as many as fp8core's CPU pool)")
    if args.quick:
        args.sizes_kib, args.sizes_mib, args.dtypes = [64], [1, 64], ["bfloat16"]
    try:
        import torch

        # by default as many threads as fp8core's CPU pool takes (all cores, at most 8): like for like
        torch.set_num_threads(args.torch_threads or max(1, min(os.cpu_count() or 1, 8)))
    except ImportError:
        torch = None
    meta = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "date": str(date.today()),
            "fp8core": fp8core.__version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
            "torch": torch.__version__ if torch else None, "torch_threads": torch.get_num_threads() if torch else None}
    print("# fp8core CPU benchmark", json.dumps(meta))
    print(f"# torch eager runs with {meta['torch_threads']} intra-op threads (--torch-threads to change); "
          if torch else "# torch is not installed: its columns are '—'; ", end="")
    print("'x torch' and 'x ml_dtypes' are fp8core's speed over the peer's (>1: fp8core is faster)")
    if args.crossover or args.gemm_crossover:
        run = gemm_transpose_crossover if args.gemm_crossover else crossover
        rows = [dict(r, **meta) for r in run(5 if args.quick else 21)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    header = f"{'op':<16} {'dtype':<9} {'KiB':>6} {'fp8core GB/s':>13} {'p20-p80':>13} {'torch GB/s':>11} " \
             f"{'x torch':>8} {'ml_dtypes GB/s':>15} {'x ml_dtypes':>11}"
    print(header)
    rows = []
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for kib in [k for k in args.sizes_kib] + [m * 1024 for m in args.sizes_mib]:
            mib = kib / 1024
            itemsize = 2 if dtype == "bfloat16" else 4
            n = kib * 2 ** 10 // itemsize
            x = rng.standard_normal(n, dtype=np.float32).astype(getattr(ml_dtypes, dtype, dtype))
            repeat = 3 if mib >= 256 else 7 if args.quick or mib >= 16 else 31
            ours, peers = cases(x, torch)
            for op, (nbytes, fn) in ours.items():
                # fp8core and its peers interleaved call by call: the ratios survive the machine's drift. A peer
                # without the op's exact work (ml_dtypes' quantize+amax) stands in with the op without "+amax".
                fns = {"ours": fn, **{("eager" if p == "torch eager" else p): f.get(op, f.get(op.replace("+amax", "")))
                                      for p, f in peers.items() if op in f or op.replace("+amax", "") in f}}
                stats, ratio = interleaved(fns, repeat)
                med, p20, p80 = stats["ours"]
                row = {"op": op, "dtype": dtype, "mib": mib, "gbps": nbytes / med / 1e9,
                       "gbps_p20": nbytes / p80 / 1e9, "gbps_p80": nbytes / p20 / 1e9, **meta}
                for peer in peers:
                    key = "eager" if peer == "torch eager" else peer
                    if key in stats:
                        row[f"{peer}_gbps"] = nbytes / stats[key][0] / 1e9
                if "eager" in stats:
                    row["x_torch"] = 1 / ratio  # fp8core's speed over torch's: the inverse of the time ratio
                rows.append(row)
                t, m = row.get("torch eager_gbps"), row.get("ml_dtypes_gbps")
                print(f"{op:<16} {dtype:<9} {kib:>6} {row['gbps']:>13.2f} "
                      f"{row['gbps_p20']:>6.2f}-{row['gbps_p80']:<6.2f} {_fixed(t, 11)} {_fixed(row.get('x_torch'), 8)} "
                      f"{_fixed(m, 15)} {_fixed(row['gbps'] / m if m else None, 11)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
