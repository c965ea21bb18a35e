"""A CPU training step of a small HF Llama with fp8core.torch against torchao's emulated float8 step, same process
(issue 37 item 3).

The model: transformers' ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (no download), float32, AdamW,
causal-LM loss on random token ids. Variants, each its own copy of the same initial model: fp8core's
``convert_to_float8`` under delayed scaling (no context: the update at the step boundary) and under current
scaling, torchao's ``convert_to_float8_training`` with ``Float8LinearConfig(emulate=True)`` (tensorwise dynamic
scaling, the GEMMs emulated in high precision: torchao's CPU path), and plain float32. torchao is not an fp8core
dependency: without it that row is skipped, and the output says so.

Threads: torch's own setting (``torch.set_num_threads``, ``--threads``) is the only one made; fp8core's CPU work
follows it (fp8core.cpu_threads: the torch ops enter it with torch.get_num_threads()).

Timing: rounds of ``--steps`` steps per variant, the variants interleaved within every round (a shared VM's speed
drifts: every variant sees the same moments). Per variant: the median step time over rounds with p20/p80, and the
median over rounds of its ratio to torchao's step in the same round.

    python bench/bench_torch_train.py [--rounds 7] [--steps 3] [--threads N] [--context] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import time
import warnings
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import numpy as np
import torch

import fp8core
from fp8core.torch import autocast, convert_to_float8

REFERENCE = "torchao emulated"


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    import transformers
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def torchao_convert() -> Optional[Callable[[torch.nn.Module], torch.nn.Module]]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    return lambda m: convert_to_float8_training(m, config=Float8LinearConfig(emulate=True))


def variants() -> dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    found = {"fp8core delayed": lambda m: convert_to_float8(m, fp8core.DelayedScaling()),
             "fp8core current": lambda m: convert_to_float8(m, fp8core.Float8CurrentScaling()),
             "float32": lambda m: m}
    ao = torchao_convert()
    if ao is not None:
        found[REFERENCE] = ao
    return found


def make_step(model: torch.nn.Module, batch: int, seq: int, context: Callable) -> Callable[[], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)

    def step() -> float:
        with context():
            loss = model(ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def run(rounds: int, steps: int, batch: int, seq: int, context: bool) -> list[dict]:
    base = tiny_llama()
    made = {}
    for name, convert in variants().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps_in = autocast if context and name.startswith("fp8core") else contextlib.nullcontext
            made[name] = make_step(convert(copy.deepcopy(base)), batch, seq, steps_in)
    for step in made.values():  # warm: first calls, allocations
        step()
    times: dict[str, list[float]] = {name: [] for name in made}
    for r in range(rounds):
        order = list(made)[r % len(made):] + list(made)[:r % len(made)]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                made[name]()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    rows = []
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=5, method="inclusive")
        row = {"variant": name, "ms_median": statistics.median(ts), "ms_p20": q[0], "ms_p80": q[3], "ms": ts}
        if REFERENCE in times:
            row["ratio_to_torchao_median"] = statistics.median(a / b for a, b in zip(ts, times[REFERENCE]))
        rows.append(row)
    return rows


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "load_1min": load and load[0], "torch": torch.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
            "blas_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--context", action="store_true",
                   help="fp8core's steps inside fp8core.torch.autocast() (TE's loop; needed by checkouts before "
                        "convert_to_float8 ran fp8 without it)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = run(args.rounds, args.steps, args.batch, args.seq, args.context)
    info = machine()
    print(f"# {info['cpu']}, {info['cores']} cores, load {info['load_1min']}, torch {info['torch']} "
          f"({info['torch_threads']} threads), numpy {info['numpy']}, env {info['blas_env']}, {info['date']}")
    print(f"# tiny Llama, batch {args.batch} x {args.seq} tokens, {args.rounds} interleaved rounds of {args.steps} "
          f"steps{', fp8core inside autocast' if args.context else ''}")
    if not any(r["variant"] == REFERENCE for r in rows):
        print("# torchao is not installed: its row is skipped (torchao is not an fp8core dependency)")
    print(f"{'variant':18s} {'median ms':>10s} {'p20':>8s} {'p80':>8s} {'/ torchao':>10s}")
    for r in rows:
        ratio = r.get("ratio_to_torchao_median")
        print(f"{r['variant']:18s} {r['ms_median']:10.1f} {r['ms_p20']:8.1f} {r['ms_p80']:8.1f} "
              f"{'' if ratio is None else f'{ratio:10.2f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
