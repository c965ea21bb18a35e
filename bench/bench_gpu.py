"""GPU benchmarks of fp8core's kernels against torch eager, torch.compile and a device-to-device copy.

Every figure is a median of CUDA-event timings with p20/p80, in GB/s of the bytes each op must move, and as
a fraction of the copy bandwidth measured in the same run. Writes JSON rows with device and versions.
Usage: python bench/bench_gpu.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from datetime import date

import cupy as cp
import torch

import fp8core


def cuda_time(fn, repeat: int = 20) -> tuple[float, float, float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[3]


def host_overhead(fn, repeat: int = 2000) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(samples)


def torch_quantize(x, s):
    amax = x.abs().max()
    return (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn), amax


def meta() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "date": str(date.today()), "commit": commit,
            "torch": torch.__version__, "cupy": cp.__version__, "cuda": cp.cuda.runtime.runtimeGetVersion(),
            "fp8core": fp8core.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    m = meta()
    print("# fp8core GPU benchmark", json.dumps(m))
    rows = []
    sizes = [1, 64, 1024] if args.quick else [1, 4, 16, 32, 64, 256, 1024]
    compiled = torch.compile(torch_quantize)
    for mib in sizes:
        n = mib * 2 ** 20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor([0.5], device="cuda")
        slot = torch.zeros(1, device="cuda")
        dst = torch.empty_like(x)
        copy = cuda_time(lambda: dst.copy_(x))[0]
        copy_gbps = 2 * x.numel() * 2 / copy / 1e9
        nbytes = n * 3
        cases = {
            "quantize+amax (delayed)": lambda: fp8core.quantize(x, s, "e4m3", amax_out=slot),
            "quantize_dynamic (current)": lambda: fp8core.quantize_dynamic(x, "e4m3"),
            "amax": lambda: fp8core.amax(x),
            "torch eager": lambda: torch_quantize(x, s),
            "torch.compile": lambda: compiled(x, s),
        }
        for name, fn in cases.items():
            med, p20, p80 = cuda_time(fn)
            moved = n * 2 if name == "amax" else nbytes
            row = {"op": name, "mib": mib, "gbps": moved / med / 1e9, "copy_gbps": copy_gbps,
                   "fraction_of_copy": moved / med / 1e9 / copy_gbps, "us": med * 1e6, "us_p20": p20 * 1e6,
                   "us_p80": p80 * 1e6, **m}
            rows.append(row)
            print(f"{name:<28} {mib:>5} MiB {row['gbps']:>8.0f} GB/s {row['fraction_of_copy']:>6.1%} of copy "
                  f"({row['us']:.1f} us, p20 {row['us_p20']:.1f}, p80 {row['us_p80']:.1f})", flush=True)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.5], device="cuda")
    med = cuda_time(lambda: fp8core.cast_transpose(x, s, "e4m3"))[0]
    gbps = x.numel() * 4 / med / 1e9
    rows.append({"op": "cast_transpose 8192x8192", "gbps": gbps, **m})
    print(f"cast_transpose 8192x8192 bf16 {gbps:.0f} GB/s", flush=True)
    for n_t in (10, 100, 1000, 10000):
        st = fp8core.ScalingState(n_t, fp8core.DelayedScaling(amax_history_len=1024), device="cuda")
        st.amax_history[...] = cp.random.random((1024, n_t), dtype=cp.float32) + 0.5
        med = cuda_time(lambda: (st.amax_history[0].fill(1.0), st.update()))[0]
        h = torch.rand(1024, n_t, device="cuda") + 0.5
        stacked = cuda_time(lambda: (448.0 / h.amax(0), h.roll(-1, 0)))[0]
        rows.append({"op": f"update N={n_t} L=1024", "us": med * 1e6, "torch_stacked_us": stacked * 1e6, **m})
        print(f"update N={n_t:<6} L=1024 {med * 1e6:8.1f} us (includes a row-0 fill); torch stacked "
              f"{stacked * 1e6:8.1f} us", flush=True)
    small = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    s1 = torch.tensor([1.0], device="cuda")
    ours = host_overhead(lambda: fp8core.quantize(small, s1, "e4m3"))
    eager = host_overhead(lambda: (small.float() * s1).clamp(-448, 448).to(torch.float8_e4m3fn))
    rows.append({"op": "host overhead small quantize", "us": ours * 1e6, "torch_eager_us": eager * 1e6, **m})
    print(f"host overhead, 1024-element quantize: fp8core {ours * 1e6:.1f} us, torch eager {eager * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
