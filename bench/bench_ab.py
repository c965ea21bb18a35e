"""A change's effect on host time: the public primitives of this checkout against a base checkout of fp8core,
both imported in one process and timed in alternating blocks (bench_cpu.interleaved), 16 elements, NumPy and
torch CPU inputs. On a VM whose speed drifts 2x within a minute, only such a same-moment ratio measures a change.

    git worktree add /tmp/base <commit> && python bench/bench_ab.py /tmp/base [--repeat 80] [--json out.json]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import fp8core
from bench_cpu import interleaved


def load_base(checkout: str):
    """The base checkout's fp8core as the package fp8core_base (its modules import each other relatively)."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="fp8core_base_"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(pathlib.Path(checkout) / "fp8core", root / "fp8core_base")
    sys.path.insert(0, str(root))
    return importlib.import_module("fp8core_base")


def calls(x, scale, slot) -> dict:
    """op -> f(module): one call of that module's primitive on x (16 elements) and a 1-element scale/slot."""
    q, m = fp8core.quantize(x, scale), x.reshape(4, 4)
    return {
        "amax": lambda fc: fc.amax(x),
        "quantize": lambda fc: fc.quantize(x, scale),
        "quantize+amax_out": lambda fc: fc.quantize(x, scale, amax_out=slot),
        "quantize_dynamic": lambda fc: fc.quantize_dynamic(x),
        "dequantize": lambda fc: fc.dequantize(q, 0.5),
        "transpose": lambda fc: fc.transpose(q.reshape(4, 4)),
        "cast_transpose": lambda fc: fc.cast_transpose(m, scale),
        "multi_amax": lambda fc: fc.multi_amax([x, x]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="a checkout (git worktree) of the fp8core to compare with")
    ap.add_argument("--repeat", type=int, default=80, help="blocks per candidate")
    ap.add_argument("--block", type=int, default=200, help="calls per block")
    ap.add_argument("--json")
    args = ap.parse_args()
    base = load_base(args.base)
    x = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    inputs = [("numpy", x, np.array([2.0], np.float32), np.zeros(1, np.float32))]
    try:
        import torch

        inputs.append(("torch", torch.from_numpy(x.copy()), torch.tensor([2.0]), torch.zeros(1)))
    except ImportError:
        pass
    commit = lambda path: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],  # noqa: E731
                                         capture_output=True, text=True).stdout.strip() or "?"
    here = str(pathlib.Path(__file__).resolve().parents[1])
    print(f"# host time per call (us), this checkout ({commit(here)}) vs {args.base} ({commit(args.base)}), "
          f"numpy {np.__version__}; interleaved blocks of {args.block} calls; this/base = median over blocks")
    print(f"{'op':18s} {'input':6s} {'base':>8s} {'this':>8s} {'this/base':>10s}")
    rows = []
    for name, xin, scale, slot in inputs:
        for op, f in calls(xin, scale, slot).items():
            stats, r = interleaved({"base": lambda: f(base), "this": lambda: f(fp8core)}, args.repeat, args.block,
                                   ratio=("this", "base"))
            rows.append({"op": op, "input": name, "base_us": stats["base"][0] * 1e6,
                         "this_us": stats["this"][0] * 1e6, "this_over_base": r})
            print(f"{op:18s} {name:6s} {rows[-1]['base_us']:8.1f} {rows[-1]['this_us']:8.1f} {r:10.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
