"""One training step (forward + backward) of a 4096 -> 16384 -> 4096 MLP on 8192 tokens, bf16: fp8core's
Float8Linear against bf16 nn.Linear and torchao's float8 tensorwise recipe (when installed), same run.
Goals on an H100 (issue 5): >= 1.3x bf16, >= 1.0x torchao. Usage: python bench/bench_mlp.py [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import fp8core
from bench_gpu import cuda_time, meta
from fp8core.torch import autocast, convert_to_float8

GOALS = {"vs_bf16": 1.3, "vs_torchao": 1.0}


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
    print("# fp8core MLP training-step benchmark", json.dumps(info))
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
        print("torchao not installed: its column is left out")
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
        rows[name] = {"ms": med * 1e3, "ms_p20": p20 * 1e3, "ms_p80": p80 * 1e3, "tflops": flop / med / 1e12}
        print(f"{name:<28} {med * 1e3:8.2f} ms (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f}) "
              f"{flop / med / 1e12:7.1f} TFLOP/s", flush=True)
    ours = rows["fp8core Float8Linear"]["ms"]
    verdicts = {"vs_bf16": rows["bf16 nn.Linear"]["ms"] / ours}
    if "torchao float8 tensorwise" in rows:
        verdicts["vs_torchao"] = rows["torchao float8 tensorwise"]["ms"] / ours
    for goal, ratio in verdicts.items():
        print(f"goal {goal} >= {GOALS[goal]}: {'met' if ratio >= GOALS[goal] else 'MISSED'} (x{ratio:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "speedup": verdicts, **info}, f, indent=1)


if __name__ == "__main__":
    main()
