"""Host time of fp8core's torch front-end on 16 elements against a base checkout, beside torch's own eager chain:
``fp8core.torch.ops.quantize`` (the typed front door Float8Linear calls), ``torch.ops.fp8core.quantize`` (the
custom op by its packet, overload resolution included; with an amax slot: ``quantize_amax``), ``fp8core.quantize``
on torch tensors (the core alone) and torch eager's ``(x.float() * scale).clamp(-448, 448).to(float8_e4m3fn)``.

The two checkouts cannot share one process (both register ``torch.ops.fp8core``): each runs in a worker process
of its own (its fp8core and fp8core.torch staged as one package), and this process asks them for blocks of calls
in turn, base and this alternating, each worker's torch chain beside its fp8core calls, so that a shared VM's
drift slows every candidate alike, and each round starts with another case. ``x eager`` is the median over rounds
of a call / the same worker's torch chain in the same round (with an amax slot, the chain that updates one too:
``torch.maximum(slot, x.abs().max(), out=slot)`` beside the cast).

    git archive <commit> fp8core bindings | tar -x -C /tmp/base && python bench/bench_torch_host.py /tmp/base \
        [--repeat 150] [--block 100] [--json out.json]

``--stages`` (no base): where this checkout's op call goes, in one process, each stage timed in shuffled rounds:
torch's chain, the core alone, the op's body called from Python (the core inside ``cpu_threads``), the floor of a
Python kernel (an op whose Autograd kernel returns its input), the op, and the same body behind
``torch.library.custom_op`` (the wrapper fp8core's ops used before, in a scratch namespace).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The worker: the cases, then "case block" lines on stdin answered with the block's seconds.
WORKER = r"""
import os, sys, time
import torch
torch.set_num_threads(os.cpu_count() or 1)
import fp8core, fp8core.torch
x = torch.from_numpy(__import__("numpy").random.default_rng(0).standard_normal(16).astype("float32")).bfloat16()
s, slot = torch.tensor([0.5]), torch.zeros(1)
cases = {
    "ops.quantize": lambda: fp8core.torch.ops.quantize(x, s, "e4m3"),
    "op": lambda: torch.ops.fp8core.quantize(x, s, "e4m3"),
    "op+amax_out": lambda: torch.ops.fp8core.quantize_amax(x, s, "e4m3", slot),
    "core": lambda: fp8core.quantize(x, s, "e4m3"),
    "eager": lambda: (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn),
    "eager+amax": lambda: (torch.maximum(slot, x.abs().max().float(), out=slot),
                           (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)),
}
codes = {k: f().view(torch.uint8).tolist() for k, f in cases.items() if not k.startswith("eager")}
assert len({str(v) for v in codes.values()}) == 1, codes  # one answer whatever the path
print(fp8core.__file__, flush=True)
for line in sys.stdin:
    case, block = line.split()
    f = cases[case]
    t = time.perf_counter()
    for _ in range(int(block)):
        f()
    print(time.perf_counter() - t, flush=True)
"""

CASES = ("ops.quantize", "op", "op+amax_out", "core", "eager", "eager+amax")
# each case's torch chain: with an amax slot, torch's chain updates one too
REFERENCE = {"op+amax_out": "eager+amax"}


def stage(checkout: pathlib.Path) -> pathlib.Path:
    """The checkout's fp8core with its bindings inside it (fp8core.torch, fp8core.jax), as the wheel lays them
    out, in a temporary folder the worker puts first on its path."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="fp8core_stage_"))
    shutil.copytree(checkout / "fp8core", root / "fp8core")
    for front in ("torch", "jax"):
        shutil.copytree(checkout / "bindings" / front, root / "fp8core" / front)
    return root


class Worker:
    def __init__(self, checkout: pathlib.Path) -> None:
        self.root = stage(checkout)
        code = f"import sys; sys.path.insert(0, {str(self.root)!r})\n" + WORKER
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.module = self.proc.stdout.readline().strip()
        if not self.module.startswith(str(self.root)):
            raise RuntimeError(f"the worker imported {self.module!r}, not the staged copy under {self.root}")

    def block(self, case: str, calls: int) -> float:
        self.proc.stdin.write(f"{case} {calls}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline()) / calls

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        shutil.rmtree(self.root, True)


def _stats(v: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(v, n=5, method="inclusive")
    return statistics.median(v), q[0], q[3]


def stages(repeat: int, block: int) -> list[dict]:
    """Each stage of a 16-element op call in this process: (name, median, p20, p80, min) in us, and x eager."""
    import random
    import time

    import torch

    import fp8core
    import fp8core.torch  # noqa: F401  (registers the ops)

    torch.set_num_threads(os.cpu_count() or 1)
    x = torch.from_numpy(__import__("numpy").random.default_rng(0).standard_normal(16).astype("float32")).bfloat16()
    s = torch.tensor([0.5])

    def body(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        with fp8core.cpu_threads(torch.get_num_threads()):
            return fp8core.quantize(x, scale, fmt)

    lib = torch.library.Library("fp8core_bench_stages", "FRAGMENT")
    lib.define("floor(Tensor x, Tensor scale, str fmt) -> Tensor")
    lib.impl("floor", lambda keyset, x, scale, fmt: x, "Autograd", with_keyset=True)
    wrapped = torch.library.custom_op("fp8core_bench_stages::custom_op", body, mutates_args=(),
                                      schema="(Tensor x, Tensor scale, str fmt) -> Tensor")
    wrapped.register_fake(lambda x, scale, fmt: torch.empty_like(x, dtype=torch.float8_e4m3fn))
    cases = {
        "torch eager chain": lambda: (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn),
        "core: fp8core.quantize": lambda: fp8core.quantize(x, s, "e4m3"),
        "body from Python": lambda: body(x, s, "e4m3"),
        "floor: a Python kernel": lambda: torch.ops.fp8core_bench_stages.floor.default(x, s, "e4m3"),
        "op: torch.ops.fp8core.quantize": lambda: torch.ops.fp8core.quantize.default(x, s, "e4m3"),
        "body behind custom_op": lambda: torch.ops.fp8core_bench_stages.custom_op.default(x, s, "e4m3"),
    }
    per: dict = {k: [] for k in cases}
    names = list(cases)
    for f in cases.values():
        f()
    for _ in range(repeat):
        random.shuffle(names)
        for k in names:
            f = cases[k]
            t = time.perf_counter()
            for _ in range(block):
                f()
            per[k].append((time.perf_counter() - t) / block)
    eager = per["torch eager chain"]
    rows = []
    for k, v in per.items():
        med, p20, p80 = _stats(v)
        x_eager = _stats([a / b for a, b in zip(v, eager)])[0]
        rows.append({"stage": k, "us": med * 1e6, "us_p20": p20 * 1e6, "us_p80": p80 * 1e6, "us_min": min(v) * 1e6,
                     "x_eager": x_eager})
        print(f"{k:32s} {med * 1e6:8.1f} {p20 * 1e6:6.1f}-{p80 * 1e6:<7.1f} min {min(v) * 1e6:6.1f} {x_eager:8.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", nargs="?", help="a checkout of the fp8core to compare with (git archive <commit> | tar -x)")
    ap.add_argument("--stages", action="store_true", help="instead: this checkout's op call, stage by stage")
    ap.add_argument("--repeat", type=int, default=150, help="rounds (one block of each case in each worker)")
    ap.add_argument("--block", type=int, default=100, help="calls per block")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.stages:
        print(f"# stages of a 16-element torch quantize, us per call (median, p20-p80, min), x eager; shuffled rounds "
              f"of {args.block} calls, {args.repeat} rounds")
        rows = stages(args.repeat, args.block)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    if args.base is None:
        ap.error("base: a checkout to compare with (or --stages)")
    workers = {"base": Worker(pathlib.Path(args.base)), "this": Worker(ROOT)}
    try:
        for w in workers.values():  # warm-up: first calls build tables and caches
            for case in CASES:
                w.block(case, args.block)
        per = {(who, case): [] for who in workers for case in CASES}
        for r in range(args.repeat):
            for who, w in workers.items():
                for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:  # each case first in turn
                    per[who, case].append(w.block(case, args.block))
    finally:
        for w in workers.values():
            w.close()
    import torch

    meta = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "date": str(date.today()),
            "torch": torch.__version__, "python": platform.python_version(), "n": 16, "dtype": "bfloat16",
            "repeat": args.repeat, "block": args.block, "base": args.base}
    print("# host time per call (us), 16 bf16 elements -> e4m3, interleaved rounds", json.dumps(meta))
    print(f"{'case':13s} {'who':5s} {'median':>8s} {'p20-p80':>14s} {'x eager':>8s} {'eager p20-p80':>14s}")
    rows = []
    for case in CASES:
        for who in workers:
            med, p20, p80 = _stats(per[who, case])
            ratios = [a / b for a, b in zip(per[who, case], per[who, REFERENCE.get(case, "eager")])]
            r, r20, r80 = _stats(ratios)
            rows.append({"case": case, "who": who, "us": med * 1e6, "us_p20": p20 * 1e6, "us_p80": p80 * 1e6,
                         "x_eager": r, "x_eager_p20": r20, "x_eager_p80": r80})
            print(f"{case:13s} {who:5s} {med * 1e6:8.1f} {p20 * 1e6:6.1f}-{p80 * 1e6:<7.1f} {r:8.2f} "
                  f"{r20:6.2f}-{r80:<6.2f}")
    for case in CASES[:4]:
        ab = _stats([a / b for a, b in zip(per["this", case], per["base", case])])
        print(f"# {case}: this/base {ab[0]:.2f} (p20-p80 {ab[1]:.2f}-{ab[2]:.2f})")
        rows.append({"case": case, "who": "this/base", "ratio": ab[0], "ratio_p20": ab[1], "ratio_p80": ab[2]})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
