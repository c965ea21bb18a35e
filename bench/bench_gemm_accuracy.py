"""How far the GPU's FP8 GEMM is from the exact sum: the figure behind _oracle.TENSOR_CORE_EPS.

For each shape, mode and scheme: the worst and the 99th-percentile |D - exact| / sum_k |a||b| over every element
of a float32 output, with the exact D and sum_k |a||b| in float64 from the oracle, next to the bound the tests
allow (``_oracle.accumulation_tolerance``). Hopper's FP8 tensor cores add with about 14 bits, so the worst does
not grow with K; a figure above the bound is a failing GPU test waiting to happen.
Usage: python bench/bench_gemm_accuracy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import math

import ml_dtypes
import numpy as np
import torch

import fp8core
from bench_gpu import meta, write_json
from fp8core import _oracle
from fp8core.blocks import quantize_blockwise

SHAPES = [(128, 128, k) for k in (16, 64, 256, 1024, 4096, 16384)]
BLOCK_SHAPES = [(128, 128, k) for k in (128, 1024, 4096)]


def codes(rng: np.random.Generator, shape: tuple[int, int], fmt: str) -> np.ndarray:
    """fp8 codes of normal values spread over 2^-4..2^4 (both signs), as the GEMM tests draw them."""
    v = rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape)
    return _oracle.encode(v.astype(np.float32), fmt).astype(np.uint8)


def cuda(a: np.ndarray) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.itemsize == 1 and a.dtype != np.uint8:  # fp8 travels as bytes
        return torch.from_numpy(a.view(np.uint8).copy()).cuda().view(getattr(torch, a.dtype.name))
    return torch.from_numpy(a.copy()).cuda()


def measure(label: str, d: torch.Tensor, exact: np.ndarray, absprod: np.ndarray, k: int, fast: bool) -> dict:
    err = np.abs(d.float().cpu().numpy().astype(np.float64) - exact) / np.maximum(absprod, 1e-300)
    worst, p99 = float(err.max()), float(np.quantile(err, 0.99))
    bound = float(_oracle.accumulation_tolerance(np.ones(1), k, "float32", tensor_core=True, fast_accum=fast)[0][0])
    row = {"case": label, "k": k, "fast_accum": fast, "worst": worst, "p99": p99, "bound": bound,
           "worst_log2": math.log2(worst) if worst else None, "margin": bound / worst if worst else None}
    print(f"{label:<34} K={k:<6} worst {worst:.3g} (2^{row['worst_log2'] or 0:.1f}) p99 {p99:.3g}  bound {bound:.3g} "
          f"margin x{row['margin'] or 0:.1f}", flush=True)
    return row


def per_tensor(rng: np.random.Generator) -> list[dict]:
    rows = []
    for fa, fb in (("e4m3", "e4m3"), ("e4m3", "e5m2")):
        for m, n, k in SHAPES:
            ac, bc = codes(rng, (m, k), fa), codes(rng, (n, k), fb)
            exact = _oracle.gemm_reference(ac, fa, bc, fb, 1.0, 1.0)
            absprod = np.abs(_oracle.decode(fa)[ac]) @ np.abs(_oracle.decode(fb)[bc]).T
            a = cuda(ac.view(getattr(ml_dtypes, "float8_e4m3fn" if fa == "e4m3" else "float8_e5m2")))
            b = cuda(bc.view(getattr(ml_dtypes, "float8_e4m3fn" if fb == "e4m3" else "float8_e5m2")))
            one = torch.ones(1, device="cuda")
            for fast in (False, True):
                d = fp8core.gemm(a, b, one, one, out_dtype="float32", use_fast_accum=fast)
                rows.append(measure(f"{fa} x {fb}{' fast' if fast else ''}", d, exact, absprod, k, fast))
    return rows


def blocked(rng: np.random.Generator) -> list[dict]:
    rows = []
    for a_block, b_block in (("1x128", "1x128"), ("128x128", "1x128")):
        for m, n, k in BLOCK_SHAPES:
            x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-6, 6, (m, k))).astype(np.float32)
            w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
            a = quantize_blockwise(x, "e4m3", block=a_block, power_of_2=False)
            b = quantize_blockwise(w, "e4m3", block=b_block, power_of_2=False)
            a64, b64 = _oracle.block_operand64(a), _oracle.block_operand64(b)
            d = fp8core.gemm(type(a)(*(cuda(v) for v in a)), type(b)(*(cuda(v) for v in b)), out_dtype="float32")
            rows.append(measure(f"blocks {a_block} x {b_block}", d, a64 @ b64.T, np.abs(a64) @ np.abs(b64).T, k,
                                False))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    info = meta()
    print(f"# fp8core GEMM accuracy against the exact sum {info}", flush=True)
    rng = np.random.default_rng(20261126)
    rows = per_tensor(rng)
    if torch.cuda.get_device_capability() == (9, 0):  # cuBLASLt's 1x128/128x128 GEMM is Hopper's
        rows += blocked(rng)
    write_json(args.json, info, rows, [])


if __name__ == "__main__":
    main()
