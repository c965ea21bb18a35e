"""GPU benchmarks of fp8core's kernels against torch eager, torch.compile, JAX and a device-to-device copy.

Every figure is a median of CUDA-event timings with p20/p80 (each sample times enough back-to-back calls to
last about a millisecond), in GB/s of the bytes each op must move and as a fraction of the device-to-device
copy bandwidth measured in the same run at the same size; ratios are against the peers of the same run.
Inputs below the L2 size stay L2-resident across calls: compare ratios there, not bandwidth. JAX runs on
its own stream, so its times are host-clock times of batches ending in a wait (the batches last a millisecond
or more, so launch gaps hardly count).
The goals of issue 11 that these figures decide are printed met or missed and stored with the rows.
Also the shared helpers of the other GPU benchmarks (timing, metadata, goals, the JSON file).

Usage: python bench/bench_gpu.py [--quick] [--json out.json] [--profile quantize|dynamic|cast_transpose|update]
(--profile runs one op a few times at its goal's size, untimed, for ncu.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from typing import Any, Callable

import cupy as cp
import torch

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX, when it is a peer, shares the GPU

import fp8core
from fp8core.selftest import commit_of_checkout, versions

ISSUE = 11


# ---- shared by the GPU benchmarks -------------------------------------------------------------------------

def cuda_time(fn: Callable[[], Any], repeat: int = 20, target_s: float = 1e-3) -> tuple[float, float, float]:
    """(median, p20, p80) seconds per call, from CUDA events on torch's current stream around batches of
    back-to-back calls (enough for ``target_s`` per batch, so launch gaps do not dominate small ops)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    inner = int(max(1, min(1000, target_s / max(time.perf_counter() - t, 1e-7))))
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[3]


def wall_time(fn: Callable[[], Any], repeat: int = 20, target_s: float = 1e-3) -> tuple[float, float, float]:
    """(median, p20, p80) seconds per call by the host clock around batches of calls that end in a wait
    (``fn`` returns something with ``block_until_ready``): for peers on their own streams, like JAX."""
    fn().block_until_ready()
    t = time.perf_counter()
    fn().block_until_ready()
    inner = int(max(1, min(1000, target_s / max(time.perf_counter() - t, 1e-7))))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner - 1):
            fn()
        fn().block_until_ready()
        times.append((time.perf_counter() - t) / inner)
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[3]


def jax_quantize() -> Callable | None:
    """The peer in JAX (jit: amax and the scaled, clipped cast), or None where JAX has no GPU."""
    try:
        import jax
        import jax.numpy as jnp

        if jax.default_backend() != "gpu":
            return None
    except Exception:
        return None

    @jax.jit
    def quantize(x: Any, s: Any) -> Any:
        amax = jnp.max(jnp.abs(x))
        return jnp.clip(x.astype(jnp.float32) * s, -448, 448).astype(jnp.float8_e4m3fn), amax

    return quantize


def host_overhead(fn: Callable[[], Any], repeat: int = 2000) -> tuple[float, float, float]:
    """(median, p20, p80) seconds of host time per call (the GPU runs behind, never waited for)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if i % 256 == 255:
            torch.cuda.synchronize()  # keep the launch queue from filling; outside the timed region
    torch.cuda.synchronize()
    q = statistics.quantiles(samples, n=5)
    return statistics.median(samples), q[0], q[3]


def kernels_per_call(fn: Callable[[], Any], calls: int = 20) -> tuple[float, float, list[str]] | None:
    """(kernel launches per call, median device µs of one call's kernels, their names) by the torch profiler
    (CUPTI sees every kernel of the process, CuPy's too); None where the profiler saw no kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()]
    if not kernels:
        return None
    per_call = len(kernels) / calls
    names = sorted({e.name[:80] for e in kernels})
    total = sum(e.time_range.elapsed_us() for e in kernels) / calls
    return per_call, total, names


def meta() -> dict[str, Any]:
    """Device, date, commit and versions: stored with every row."""
    return {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit_of_checkout(), **{f"version_{k}": v for k, v in versions().items()}}


def goal(goal_id: str, text: str, figure: float | None, target: float, unit: str, higher_is_better: bool = True,
         profile: list[str] | None = None) -> dict[str, Any]:
    """One goal of the issue with its figure; ``profile`` is the command (after ``python``) that runs the
    kernels behind it for ncu, used by gpu_run.py when the goal is missed."""
    met = None if figure is None else (figure >= target if higher_is_better else figure <= target)
    shown = "not measured" if figure is None else f"{figure:.3g} {unit}"
    print(f"goal {goal_id}: {text}: {'met' if met else 'MISSED' if met is not None else 'NOT MEASURED'} "
          f"({shown}; target {'>=' if higher_is_better else '<='} {target:g} {unit})", flush=True)
    return {"issue": ISSUE, "id": goal_id, "goal": text, "figure": figure, "target": target, "unit": unit,
            "higher_is_better": higher_is_better, "met": met, "profile": profile}


def write_json(path: str | None, info: dict[str, Any], rows: list[dict[str, Any]], goals: list[dict[str, Any]],
               **extra: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"meta": info, "rows": rows, "goals": goals, **extra}, f, indent=1)


def stats(prefix: str, t: tuple[float, float, float], scale: float = 1e6) -> dict[str, float]:
    """{prefix: median, prefix_p20, prefix_p80} in µs (scale 1e6) or ms (1e3)."""
    return {prefix: t[0] * scale, f"{prefix}_p20": t[1] * scale, f"{prefix}_p80": t[2] * scale}


# ---- the kernels --------------------------------------------------------------------------------------------

def torch_quantize(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The peer of quantize with fused amax: the same math in torch."""
    amax = x.abs().max()
    return (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn), amax


def torch_cast_transpose(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, q.t().contiguous(), x.abs().max()


def copy_bandwidth(x: torch.Tensor) -> float:
    """Device-to-device copy of x, bytes read plus written per second."""
    dst = torch.empty_like(x)
    med = cuda_time(lambda: dst.copy_(x))[0]
    return 2 * x.numel() * x.element_size() / med


def quantize_rows(sizes: list[int], info: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    compiled = torch.compile(torch_quantize)
    jq = jax_quantize()
    for mib in sizes:
        n = mib * 2 ** 20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor([0.5], device="cuda")
        slot = torch.zeros(1, device="cuda")
        copy = copy_bandwidth(x)
        cases = {
            "fp8core quantize+amax (delayed)": (lambda: fp8core.quantize(x, s, "e4m3", amax_out=slot), 3 * n),
            "fp8core quantize_dynamic (current)": (lambda: fp8core.quantize_dynamic(x, "e4m3"), 3 * n),
            "fp8core amax": (lambda: fp8core.amax(x), 2 * n),
            "torch eager quantize+amax": (lambda: torch_quantize(x, s), 3 * n),
            "torch.compile quantize+amax": (lambda: compiled(x, s), 3 * n),
        }
        if jq is not None:
            import jax
            import jax.numpy as jnp

            xj = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
            sj = jnp.float32(0.5)
            cases["JAX jit quantize+amax"] = (lambda: jq(xj, sj)[0], 3 * n)
        measured = {}
        for name, (fn, moved) in cases.items():
            t = wall_time(fn) if name.startswith("JAX") else cuda_time(fn)
            measured[name] = t[0]
            row = {"op": name, "mib": mib, "bytes": moved, "gbps": moved / t[0] / 1e9, "copy_gbps": copy / 1e9,
                   "fraction_of_copy": moved / t[0] / copy, **stats("us", t), **info}
            rows.append(row)
        ours = measured["fp8core quantize+amax (delayed)"]
        for row in rows[-len(cases):]:
            if row["op"].startswith("fp8core quantize"):
                row["vs_torch_eager"] = measured["torch eager quantize+amax"] / (row["us"] / 1e6)
                row["vs_torch_compile"] = measured["torch.compile quantize+amax"] / (row["us"] / 1e6)
                if "JAX jit quantize+amax" in measured:
                    row["vs_jax"] = measured["JAX jit quantize+amax"] / (row["us"] / 1e6)
            if row["op"].startswith("fp8core quantize_dynamic"):
                row["vs_delayed"] = ours / (row["us"] / 1e6)
            extra = "".join(f" x{row[k]:.2f} {k[3:]}" for k in ("vs_torch_eager", "vs_torch_compile", "vs_jax",
                                                                "vs_delayed")
                            if k in row)
            print(f"{row['op']:<36} {mib:>5} MiB {row['gbps']:>7.0f} GB/s {row['fraction_of_copy']:>6.1%} of copy "
                  f"{row['us']:>9.1f} us (p20 {row['us_p20']:.1f}, p80 {row['us_p80']:.1f}){extra}", flush=True)
        del x, cases
        xj = None
    return rows


def cast_transpose_rows(info: dict[str, Any]) -> list[dict[str, Any]]:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.5], device="cuda")
    slot = torch.zeros(1, device="cuda")
    copy = copy_bandwidth(x)
    moved = x.numel() * 4  # read 2 bytes, write q and q_t
    compiled = torch.compile(torch_cast_transpose)
    cases = {"fp8core cast_transpose+amax": lambda: fp8core.cast_transpose(x, s, "e4m3", amax_out=slot),
             "torch eager cast+transpose+amax": lambda: torch_cast_transpose(x, s),
             "torch.compile cast+transpose+amax": lambda: compiled(x, s)}
    rows, times = [], {}
    for name, fn in cases.items():
        t = cuda_time(fn)
        times[name] = t[0]
        rows.append({"op": name, "shape": [8192, 8192], "gbps": moved / t[0] / 1e9, "copy_gbps": copy / 1e9,
                     "fraction_of_copy": moved / t[0] / copy, **stats("us", t), **info})
    ours = times["fp8core cast_transpose+amax"]
    rows[0]["vs_torch_eager"] = times["torch eager cast+transpose+amax"] / ours
    rows[0]["vs_torch_compile"] = times["torch.compile cast+transpose+amax"] / ours
    for row in rows:
        print(f"{row['op']:<36} 8192x8192 bf16 {row['gbps']:>7.0f} GB/s {row['fraction_of_copy']:>6.1%} of copy "
              f"{row['us']:>9.1f} us (p20 {row['us_p20']:.1f}, p80 {row['us_p80']:.1f})", flush=True)
    return rows


def update_rows(counts: list[int], info: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n_t in counts:
        st = fp8core.ScalingState(n_t, fp8core.DelayedScaling(amax_history_len=1024), device="cuda")
        st.amax_history[...] = cp.random.random((1024, n_t), dtype=cp.float32) + 0.5
        row0 = st.amax_history[0]

        def step() -> None:
            row0.fill(1.0)  # every tensor ran this step: the full update, not the did-not-run shortcut
            st.update()

        t = cuda_time(step)
        fill = cuda_time(lambda: row0.fill(1.0))
        h = torch.rand(1024, n_t, device="cuda") + 0.5
        stacked = cuda_time(lambda: (448.0 / h.amax(0), h.roll(-1, 0)))
        prof, prof_fill = kernels_per_call(step), kernels_per_call(lambda: row0.fill(1.0))
        row = {"op": f"update N={n_t} L=1024", "n": n_t, "L": 1024, **stats("us_with_fill", t),
               "fill_us": fill[0] * 1e6, **stats("torch_stacked_us", stacked), **info}
        if prof is not None and prof_fill is not None:  # the update's own kernels: less the fill's
            row["launches"] = prof[0] - prof_fill[0]
            row["kernel_us"] = prof[1] - prof_fill[1]
            row["kernels"] = sorted(set(prof[2]) - set(prof_fill[2]))
        rows.append(row)
        print(f"update N={n_t:<6} L=1024 {row['us_with_fill']:8.1f} us with a row-0 fill ({row['fill_us']:.1f} us "
              f"alone); kernels {row.get('kernel_us', float('nan')):.1f} us in {row.get('launches', '?')} launch(es) "
              f"+ the fill; torch stacked {row['torch_stacked_us']:8.1f} us", flush=True)
    return rows


def overhead_rows(info: dict[str, Any]) -> list[dict[str, Any]]:
    small = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    s1 = torch.tensor([1.0], device="cuda")
    ours = host_overhead(lambda: fp8core.quantize(small, s1, "e4m3"))
    eager = host_overhead(lambda: (small.float() * s1).clamp(-448, 448).to(torch.float8_e4m3fn))
    row = {"op": "host time, 1024-element bf16 quantize (torch CUDA tensors)", **stats("us", ours),
           **stats("torch_eager_us", eager), "vs_torch_eager": eager[0] / ours[0], **info}
    print(f"host time, 1024-element quantize: fp8core {row['us']:.1f} us (p20 {row['us_p20']:.1f}, p80 "
          f"{row['us_p80']:.1f}), torch eager {row['torch_eager_us']:.1f} us", flush=True)
    return [row]


def goals_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    big = [r for r in rows if r.get("mib", 0) >= 64 and r["op"] == "fp8core quantize+amax (delayed)"]
    small_dyn = [r for r in rows if 0 < r.get("mib", 0) <= 32 and r["op"].startswith("fp8core quantize_dynamic")]
    ct = next((r for r in rows if r["op"] == "fp8core cast_transpose+amax"), None)
    upd = next((r for r in rows if r["op"] == "update N=1000 L=1024"), None)
    host = next((r for r in rows if r["op"].startswith("host time")), None)
    worst = lambda rs, k: min(r[k] for r in rs) if rs else None  # noqa: E731
    prof = lambda op: ["bench/bench_gpu.py", "--profile", op]  # noqa: E731
    return [
        goal("quantize_copy", "quantize bf16->E4M3 with fused amax, >= 64 MiB: fraction of copy bandwidth (worst size)",
             worst(big, "fraction_of_copy"), 0.90, "of copy", profile=prof("quantize")),
        goal("quantize_vs_compile", "quantize bf16->E4M3 with fused amax, >= 64 MiB: speed vs torch.compile",
             worst(big, "vs_torch_compile"), 1.3, "x", profile=prof("quantize")),
        goal("quantize_vs_eager", "quantize bf16->E4M3 with fused amax, >= 64 MiB: speed vs torch eager",
             worst(big, "vs_torch_eager"), 3.0, "x", profile=prof("quantize")),
        goal("cast_transpose_copy", "cast_transpose 8192x8192 bf16: fraction of copy bandwidth",
             ct["fraction_of_copy"] if ct else None, 0.85, "of copy", profile=prof("cast_transpose")),
        goal("dynamic_vs_delayed", "current scaling (quantize_dynamic) <= 32 MiB: speed vs delayed quantize (worst)",
             worst(small_dyn, "vs_delayed"), 0.85, "x", profile=prof("dynamic")),
        goal("update_launches", "batched update, 1000 tensors x history 1024: kernel launches",
             upd.get("launches") if upd else None, 1, "launches", higher_is_better=False, profile=prof("update")),
        goal("update_us", "batched update, 1000 tensors x history 1024: device time",
             upd.get("kernel_us") if upd else None, 15.0, "us", higher_is_better=False, profile=prof("update")),
        goal("host_small_quantize", "host time of one small quantize with torch CUDA tensors",
             host["us"] if host else None, 15.0, "us", higher_is_better=False),
    ]


def profile(op: str) -> None:
    """Run ``op`` a few times at its goal's size, untimed (for ncu)."""
    s = torch.tensor([0.5], device="cuda")
    slot = torch.zeros(1, device="cuda")
    if op == "quantize":
        x = torch.randn(64 * 2 ** 19, device="cuda", dtype=torch.bfloat16)
        fn = lambda: fp8core.quantize(x, s, "e4m3", amax_out=slot)  # noqa: E731
    elif op == "dynamic":
        x = torch.randn(32 * 2 ** 19, device="cuda", dtype=torch.bfloat16)
        fn = lambda: fp8core.quantize_dynamic(x, "e4m3")  # noqa: E731
    elif op == "cast_transpose":
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        fn = lambda: fp8core.cast_transpose(x, s, "e4m3", amax_out=slot)  # noqa: E731
    elif op == "update":
        st = fp8core.ScalingState(1000, fp8core.DelayedScaling(amax_history_len=1024), device="cuda")
        st.amax_history[...] = 1.0
        fn = lambda: (st.amax_history[0].fill(1.0), st.update())  # noqa: E731 (every tensor ran: the full update)
    else:
        raise SystemExit(f"--profile: expected quantize, dynamic, cast_transpose or update, got {op!r}")
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--profile")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile)
        return
    info = meta()
    print("# fp8core GPU benchmark", json.dumps(info), flush=True)
    sizes = [1, 32, 64, 256] if args.quick else [1, 4, 16, 32, 64, 256, 1024]
    rows: list[dict[str, Any]] = []
    parts = (lambda: quantize_rows(sizes, info), lambda: cast_transpose_rows(info),
             lambda: update_rows([1000] if args.quick else [10, 100, 1000, 10000], info), lambda: overhead_rows(info))
    for i, part in enumerate(parts):
        rows += part()
        last = i == len(parts) - 1
        write_json(args.json, info, rows, goals_of(rows) if last else [], complete=last)  # a cut-short run keeps rows


if __name__ == "__main__":
    main()
