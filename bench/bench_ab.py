"""A change's effect on host time: the public primitives of this checkout against a base checkout of fp8core,
both imported in one process and timed in alternating blocks (bench_cpu.interleaved), 16 elements, NumPy and
torch CPU inputs. On a VM whose speed drifts 2x within a minute, only such a same-moment ratio measures a change.
``--large``: instead, NumPy inputs at a flax training step's shapes and beyond (GEMMs of a 3-layer MLP at width 256
and 1024, batch 64; transposes up to 4096x4096). ``--blocks``: instead, block scaling's calls on small NumPy inputs
(quantizers, dequantizers, transpose_blocks, the block-scaled GEMMs): its host overhead.

    git worktree add /tmp/base <commit> && python bench/bench_ab.py /tmp/base [--repeat 80] [--large] [--json out.json]
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


def large_calls() -> dict:
    """op -> f(module) at training shapes: GEMM [M, K] x [N, K] with a bf16 result (out=), transpose of fp8 and
    cast_transpose of the float32 weight / bf16 activations (out=)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    one = np.ones(1, np.float32)
    ops = {}
    for m, n, k in [(64, 256, 256), (256, 256, 64), (64, 1024, 1024), (1024, 1024, 64), (1024, 1024, 1024)]:
        a = rng.standard_normal((m, k)).astype(ml_dtypes.float8_e4m3fn)
        b = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn)
        out = np.empty((m, n), ml_dtypes.bfloat16)
        ops[f"gemm {m}x{n}x{k}"] = lambda fc, a=a, b=b, out=out: fc.gemm(a, b, one, one, out_dtype="bfloat16", out=out)
    for r, c in [(256, 256), (1024, 1024), (1000, 3000), (4096, 64), (4096, 4096)]:
        q = rng.standard_normal((r, c)).astype(ml_dtypes.float8_e4m3fn)
        qt = np.empty((c, r), q.dtype)
        ops[f"transpose {r}x{c}"] = lambda fc, q=q, qt=qt: fc.transpose(q, out=qt)
    for r, c, dt in [(64, 1024, ml_dtypes.bfloat16), (1024, 1024, np.float32)]:
        x = rng.standard_normal((r, c)).astype(dt)
        outs = (np.empty((r, c), ml_dtypes.float8_e4m3fn), np.empty((c, r), ml_dtypes.float8_e4m3fn))
        slot = np.zeros(1, np.float32)
        ops[f"cast_transpose {r}x{c} {np.dtype(dt).name}"] = (
            lambda fc, x=x, outs=outs, slot=slot: fc.cast_transpose(x, one, amax_out=slot, out=outs))
    return ops


def block_calls() -> dict:
    """op -> f(module): one block-scaling call on a small NumPy input; its operands quantized once per module
    (each module takes its own scaled tensors)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 128)).astype(np.float32), rng.standard_normal((16, 128)).astype(np.float32)
    made: dict = {}

    def once(fc, name: str, make):
        if (fc, name) not in made:
            made[fc, name] = make(fc)
        return made[fc, name]

    mx = lambda fc: fc.quantize_mxfp8(x)  # noqa: E731
    mx_pair = lambda fc: (fc.quantize_mxfp8(x), fc.quantize_mxfp8(w))  # noqa: E731
    blocks = lambda fc: fc.quantize_blockwise(x)  # noqa: E731
    block_pair = lambda fc: (fc.quantize_blockwise(x), fc.quantize_blockwise(w, block="128x128"))  # noqa: E731
    return {
        "quantize_mxfp8 16x128": mx,
        "quantize_mxfp8_both 16x128": lambda fc: fc.quantize_mxfp8_both(x),
        "quantize_blockwise 16x128": blocks,
        "dequantize_mxfp8 16x128": lambda fc: fc.dequantize_mxfp8(once(fc, "mx", mx)),
        "dequantize_blockwise 16x128": lambda fc: fc.dequantize_blockwise(once(fc, "blocks", blocks)),
        "transpose_blocks 16x128 mx": lambda fc: fc.transpose_blocks(once(fc, "mx", mx)),
        "gemm mx 16x16x128": lambda fc: fc.gemm(*once(fc, "mx_pair", mx_pair), out_dtype="float32"),
        "gemm 1x128 x 128x128 16x16x128": lambda fc: fc.gemm(*once(fc, "block_pair", block_pair), out_dtype="float32"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="a checkout (git worktree) of the fp8core to compare with")
    ap.add_argument("--repeat", type=int, default=80, help="blocks per candidate")
    ap.add_argument("--block", type=int, default=200, help="calls per block")
    ap.add_argument("--large", action="store_true", help="training-step shapes (NumPy) instead of 16 elements")
    ap.add_argument("--blocks", action="store_true", help="block scaling's calls (NumPy) instead of 16 elements")
    ap.add_argument("--json")
    args = ap.parse_args()
    base = load_base(args.base)
    x = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    inputs = [("numpy", x, np.array([2.0], np.float32), np.zeros(1, np.float32))]
    try:
        import torch

        if not (args.large or args.blocks):  # NumPy only
            inputs.append(("torch", torch.from_numpy(x.copy()), torch.tensor([2.0]), torch.zeros(1)))
    except ImportError:
        pass
    commit = lambda path: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],  # noqa: E731
                                         capture_output=True, text=True).stdout.strip() or "?"
    here = str(pathlib.Path(__file__).resolve().parents[1])
    print(f"# host time per call (us), this checkout ({commit(here)}) vs {args.base} ({commit(args.base)}), "
          f"numpy {np.__version__}; interleaved blocks of {args.block} calls; this/base = median over blocks")
    print(f"{'op':32s} {'input':6s} {'base':>8s} {'this':>8s} {'this/base':>10s}")
    rows = []
    for name, xin, scale, slot in inputs:
        ops = large_calls() if args.large else block_calls() if args.blocks else calls(xin, scale, slot)
        for op, f in ops.items():
            stats, r = interleaved({"base": lambda: f(base), "this": lambda: f(fp8core)}, args.repeat, args.block,
                                   ratio=("this", "base"))
            rows.append({"op": op, "input": name, "base_us": stats["base"][0] * 1e6,
                         "this_us": stats["this"][0] * 1e6, "this_over_base": r,
                         **{f"{k}_p{p}_us": stats[k][i] * 1e6 for k in ("base", "this") for i, p in ((1, 20), (2, 80))}})
            print(f"{op:32s} {name:6s} {rows[-1]['base_us']:8.1f} {rows[-1]['this_us']:8.1f} {r:10.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
