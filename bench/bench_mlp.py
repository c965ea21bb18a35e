"""One training step (forward + backward) of a 4096 -> 16384 -> 4096 MLP on 8192 tokens, bf16: fp8core's
Float8Linear against bf16 nn.Linear and torchao's float8 tensorwise recipe (when installed), same run.
Medians of CUDA-event timings with p20/p80 and TFLOP/s; goals of issue 11 on an H100: >= 1.3x bf16,
>= 1.0x torchao (eager, its default tensorwise recipe). Usage: python bench/bench_mlp.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import fp8core
from bench_gpu import cuda_time, goal, meta, write_json
from fp8core.torch import autocast, convert_to_float8


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4096, 16384, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(16384, 4096, bias=False)).cuda().to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="2048 tokens")
    args = ap.parse_args()
    if args.quick:
        args.tokens = 2048
    info = meta()
    print("# fp8core MLP training-step benchmark", json.dumps(info), flush=True)
    torch.manual_seed(0)
    base = mlp()
    x = torch.randn(args.tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    models = {"bf16 nn.Linear": (base, False),
              "fp8core Float8Linear": (convert_to_float8(copy.deepcopy(base),
                                                         fp8core.DelayedScaling(amax_history_len=16)), True)}
    try:
        from torchao.float8 import convert_to_float8_training

        models["torchao float8 tensorwise"] = (convert_to_float8_training(copy.deepcopy(base)), False)
    except ImportError:
        print("torchao not installed: its column is left out", flush=True)
    flop = 3 * 2 * 2 * args.tokens * 4096 * 16384  # 2 GEMMs, forward + dgrad + wgrad
    rows = {}
    for name, (model, ours) in models.items():
        def step(model=model, ours=ours):
            if ours:
                with autocast():
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
        med, p20, p80 = cuda_time(step, repeat=10)
        rows[name] = {"ms": med * 1e3, "ms_p20": p20 * 1e3, "ms_p80": p80 * 1e3, "tflops": flop / med / 1e12,
                      "tflops_p20": flop / p80 / 1e12, "tflops_p80": flop / p20 / 1e12}
        print(f"{name:<28} {med * 1e3:8.2f} ms (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f}) "
              f"{flop / med / 1e12:7.1f} TFLOP/s", flush=True)
    ours = rows["fp8core Float8Linear"]["ms"]
    torchao = rows.get("torchao float8 tensorwise")
    for row in rows.values():
        row["vs_bf16"] = rows["bf16 nn.Linear"]["ms"] / row["ms"]
        if torchao:
            row["vs_torchao"] = torchao["ms"] / row["ms"]
    text = f"Float8Linear MLP step (4096->16384->4096, {args.tokens} tokens, fwd+bwd)"
    goals = [goal("mlp_vs_bf16", f"{text} vs bf16", rows["bf16 nn.Linear"]["ms"] / ours, 1.3, "x"),
             goal("mlp_vs_torchao", f"{text} vs torchao float8", torchao["ms"] / ours if torchao else None, 1.0,
                  "x")]
    write_json(args.json, info, [{"case": k, "tokens": args.tokens, **v, **info} for k, v in rows.items()], goals)


if __name__ == "__main__":
    main()
