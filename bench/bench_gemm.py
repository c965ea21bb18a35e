"""FP8 GEMM benchmark: fp8core.gemm (cuBLASLt) against torch._scaled_mm and bf16 torch.matmul, same run.

TFLOP/s as medians of CUDA-event timings with p20/p80, for 8192^3 and the projections of Llama-3 8B and 70B
at M in {1024, 4096, 16384}; host time per call at small shapes. The goals of issue 11 are printed met or
missed with their figures and stored with the rows.
Usage: python bench/bench_gemm.py [--quick] [--json out.json] [--profile M,N,K]
(--profile runs fp8core.gemm a few times at that shape, untimed, for ncu.)
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8core
from bench_gpu import cuda_time, goal, host_overhead, meta, stats, write_json

# (model, projection, K, N): y[M, N] = x[M, K] · W[N, K]ᵀ
LLAMA3 = [("8B", "qkv", 4096, 6144), ("8B", "o", 4096, 4096), ("8B", "gate_up", 4096, 28672),
          ("8B", "down", 14336, 4096), ("70B", "qkv", 8192, 10240), ("70B", "o", 8192, 8192),
          ("70B", "gate_up", 8192, 57344), ("70B", "down", 28672, 8192)]


def operands(m: int, n: int, k: int):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, w, a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), torch.ones(1, device="cuda")


def gemm_row(label: str, m: int, n: int, k: int, info: dict) -> dict:
    a, w, a8, w8, one = operands(m, n, k)
    flop = 2.0 * m * n * k
    cases = {
        "fp8core": lambda: fp8core.gemm(a8, w8, one, one, out_dtype="bfloat16"),
        "torch._scaled_mm": lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "bf16 matmul": lambda: torch.matmul(a, w.t()),
    }
    row = {"shape": label, "m": m, "n": n, "k": k, **info}
    for name, fn in cases.items():
        t = cuda_time(fn)
        row[name] = {"tflops": flop / t[0] / 1e12, "tflops_p20": flop / t[2] / 1e12, "tflops_p80": flop / t[1] / 1e12,
                     **stats("us", t)}
    ours = row["fp8core"]["tflops"]
    row["vs_scaled_mm"] = ours / row["torch._scaled_mm"]["tflops"]
    row["vs_bf16"] = ours / row["bf16 matmul"]["tflops"]
    print(f"{label:<22} M={m:<6} N={n:<6} K={k:<6} fp8core {ours:7.1f} TFLOP/s (p20-p80 "
          f"{row['fp8core']['tflops_p20']:.1f}-{row['fp8core']['tflops_p80']:.1f}) | _scaled_mm "
          f"{row['torch._scaled_mm']['tflops']:7.1f} | bf16 {row['bf16 matmul']['tflops']:7.1f} | "
          f"x{row['vs_scaled_mm']:.3f} of _scaled_mm, x{row['vs_bf16']:.2f} of bf16", flush=True)
    return row


def profile(shape: str) -> None:
    m, n, k = (int(v) for v in shape.split(","))
    _, _, a8, w8, one = operands(m, n, k)
    for _ in range(4):
        fp8core.gemm(a8, w8, one, one, out_dtype="bfloat16")
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--profile", metavar="M,N,K")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile)
        return
    info = meta()
    print("# fp8core GEMM benchmark", json.dumps(info), flush=True)
    rows = [gemm_row("square 8192^3", 8192, 8192, 8192, info)]
    for m in ([4096] if args.quick else [1024, 4096, 16384]):
        for model, proj, k, n in LLAMA3:
            rows.append(gemm_row(f"llama3-{model} {proj}", m, n, k, info))
            write_json(args.json, info, rows, [], complete=False)  # a cut-short run keeps what it measured
    overhead = []
    for size in (16, 64, 256):
        _, _, a8, w8, one = operands(size, size, size)
        ours = host_overhead(lambda: fp8core.gemm(a8, w8, one, one))
        theirs = host_overhead(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16))
        overhead.append({"shape": f"host time {size}^3", **stats("fp8core_us", ours),
                         **stats("scaled_mm_us", theirs), "ratio": ours[0] / theirs[0], **info})
        print(f"host time {size}^3: fp8core {ours[0] * 1e6:.1f} us (p20 {ours[1] * 1e6:.1f}, p80 {ours[2] * 1e6:.1f}), "
              f"_scaled_mm {theirs[0] * 1e6:.1f} us (x{ours[0] / theirs[0]:.2f})", flush=True)
    worst = min(rows, key=lambda r: r["vs_scaled_mm"])
    goals = [
        goal("gemm_vs_scaled_mm", f"GEMM vs torch._scaled_mm on 8192^3 and Llama-3 8B/70B projections (worst: "
             f"{worst['shape']} M={worst['m']})", worst["vs_scaled_mm"], 0.98, "x",
             profile=["bench/bench_gemm.py", "--profile", f"{worst['m']},{worst['n']},{worst['k']}"]),
        goal("gemm_vs_bf16", "GEMM 8192^3 vs bf16 matmul", rows[0]["vs_bf16"], 1.6, "x",
             profile=["bench/bench_gemm.py", "--profile", "8192,8192,8192"]),
    ]
    write_json(args.json, info, rows, goals, host_overhead=overhead)


if __name__ == "__main__":
    main()
