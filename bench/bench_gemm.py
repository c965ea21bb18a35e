"""FP8 GEMM benchmark: fp8core.gemm (cuBLASLt) against torch._scaled_mm and bf16 torch.matmul, same run.

TFLOP/s as medians of CUDA-event timings with p20/p80, for 8192^3 and the projections of Llama-3 8B and 70B
at M in {1024, 4096, 16384}; host overhead per call at small shapes. Each goal of issue 4 is printed met or
missed with its figure. Usage: python bench/bench_gemm.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8core
from bench_gpu import cuda_time, host_overhead, meta

# (model, projection, K, N): y[M, N] = x[M, K] · W[N, K]ᵀ
LLAMA3 = [("8B", "qkv", 4096, 6144), ("8B", "o", 4096, 4096), ("8B", "gate_up", 4096, 28672),
          ("8B", "down", 14336, 4096), ("70B", "qkv", 8192, 10240), ("70B", "o", 8192, 8192),
          ("70B", "gate_up", 8192, 57344), ("70B", "down", 28672, 8192)]
GOALS = {"vs_scaled_mm": 0.98, "vs_bf16_8192": 1.6, "host_overhead_ratio": 1.2}


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
        med, p20, p80 = cuda_time(fn)
        row[name] = {"tflops": flop / med / 1e12, "us": med * 1e6, "us_p20": p20 * 1e6, "us_p80": p80 * 1e6}
    ours = row["fp8core"]["tflops"]
    row["vs_scaled_mm"] = ours / row["torch._scaled_mm"]["tflops"]
    row["vs_bf16"] = ours / row["bf16 matmul"]["tflops"]
    print(f"{label:<22} M={m:<6} N={n:<6} K={k:<6} fp8core {ours:7.1f} TFLOP/s | _scaled_mm "
          f"{row['torch._scaled_mm']['tflops']:7.1f} | bf16 {row['bf16 matmul']['tflops']:7.1f} | "
          f"x{row['vs_scaled_mm']:.3f} of _scaled_mm, x{row['vs_bf16']:.2f} of bf16", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    info = meta()
    print("# fp8core GEMM benchmark", json.dumps(info))
    rows = [gemm_row("square 8192^3", 8192, 8192, 8192, info)]
    for m in ([4096] if args.quick else [1024, 4096, 16384]):
        for model, proj, k, n in LLAMA3:
            rows.append(gemm_row(f"llama3-{model} {proj}", m, n, k, info))
    overhead = []
    for size in (16, 64, 256):
        _, _, a8, w8, one = operands(size, size, size)
        ours = host_overhead(lambda: fp8core.gemm(a8, w8, one, one))
        theirs = host_overhead(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16))
        overhead.append({"shape": f"host overhead {size}^3", "fp8core_us": ours * 1e6,
                         "scaled_mm_us": theirs * 1e6, "ratio": ours / theirs, **info})
        print(f"host overhead {size}^3: fp8core {ours * 1e6:.1f} us, _scaled_mm {theirs * 1e6:.1f} us "
              f"(x{ours / theirs:.2f})", flush=True)
    worst = min(r["vs_scaled_mm"] for r in rows)
    square = rows[0]["vs_bf16"]
    host = max(o["ratio"] for o in overhead)
    verdicts = {
        "throughput >= 0.98x torch._scaled_mm on every shape": (worst >= GOALS["vs_scaled_mm"], f"worst x{worst:.3f}"),
        "8192^3 >= 1.6x bf16 matmul": (square >= GOALS["vs_bf16_8192"], f"x{square:.2f}"),
        "host overhead <= 1.2x torch._scaled_mm": (host <= GOALS["host_overhead_ratio"], f"worst x{host:.2f}"),
    }
    for goal, (met, figure) in verdicts.items():
        print(f"goal: {goal}: {'met' if met else 'MISSED'} ({figure})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "host_overhead": overhead,
                       "goals": {g: {"met": m, "figure": f} for g, (m, f) in verdicts.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
