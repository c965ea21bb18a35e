"""Block-scaled quantization throughput (GB/s) against per-tensor quantization and torch eager doing the
same math; on a GPU also the block-scaled GEMM (TFLOP/s) against torch._scaled_mm with the same scales.

GB/s counts the bytes each primitive must read and write (input, fp8 output(s), scales). On the CPU, also
each block path's peak memory (tracemalloc, which NumPy reports its buffers to) against its input plus output:
the bound is 2x, on a (rows, 4096) input and on a (1, n) one, where whole-block padding used to cost 128x.
Usage: python bench/bench_blocks.py [--device cpu|cuda] [--sizes-mib 16 64] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

import fp8core
from fp8core.blocks import (dequantize_blockwise, dequantize_mxfp8, quantize_blockwise, quantize_mxfp8,
                            quantize_mxfp8_both)


def timeit(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) seconds; ``sync`` waits for the device before each clock read."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [min(times)] * 4
    return statistics.median(times), q[0], q[3]


def torch_mx_rowwise(torch: Any, x: Any) -> tuple[Any, Any]:
    """MXFP8 rowwise (rceil) in torch eager ops: block amax, E8M0 exponent by frexp, scaled cast."""
    rows, cols = x.shape
    xb = x.float().view(rows, cols // 32, 32)
    v = xb.abs().amax(-1) * (1.0 / 448.0)
    m, e = torch.frexp(v)
    e = (e - (m == 0.5).to(e.dtype) + 127).clamp(0, 254)  # ceil(log2 v), biased
    factor = torch.ldexp(torch.ones_like(v), (127 - e).float())
    q = (xb * factor[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, cols)
    return q, e.to(torch.uint8)


def torch_1x128(torch: Any, x: Any) -> tuple[Any, Any]:
    """1x128 blocks with power-of-two fp32 scales in torch eager ops."""
    rows, cols = x.shape
    xb = x.float().view(rows, cols // 128, 128)
    amax = xb.abs().amax(-1)
    s = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    s = torch.exp2(torch.floor(torch.log2(s)))
    q = (xb * s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, cols)
    return q, 1.0 / s


def quantize_cases(x: Any, torch: Any, tx: Any) -> dict[str, tuple[int, Callable[[], Any]]]:
    rows, cols = x.shape
    n, hp = rows * cols, x.dtype.itemsize
    scale = 0.5
    out = {
        "per-tensor quantize (given scale)": (n * (hp + 1), lambda: fp8core.quantize(x, scale, "e4m3")),
        "per-tensor quantize_dynamic": (n * (hp + 1), lambda: fp8core.quantize_dynamic(x, "e4m3")),
        "mxfp8 rowwise": (n * (hp + 1) + n // 32, lambda: quantize_mxfp8(x)),
        "mxfp8 rowwise+columnwise": (n * (hp + 2) + n // 16, lambda: quantize_mxfp8_both(x)),
        "1x128 fp32": (n * (hp + 1) + n // 32, lambda: quantize_blockwise(x)),
        "128x128 fp32": (n * (hp + 1), lambda: quantize_blockwise(x, block="128x128")),
    }
    if tx is not None:
        out["torch eager mxfp8 rowwise"] = (n * (hp + 1) + n // 32, lambda: torch_mx_rowwise(torch, tx))
        out["torch eager 1x128 fp32"] = (n * (hp + 1) + n // 32, lambda: torch_1x128(torch, tx))
    return out


def nbytes(obj: Any) -> int:
    """Bytes of the arrays in a result (an array, an MXTensor / BlockScaledTensor, or a tuple of them)."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, tuple):
        return sum(nbytes(o) for o in obj)
    return sum(nbytes(getattr(obj, f)) for f in ("data", "scale", "scale_inv") if hasattr(obj, f))


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(the most bytes traced at once while ``fn()`` runs, above what was held before; its result). NumPy
    reports its array buffers to tracemalloc, so this counts the output and every temporary."""
    fn()  # caches (cast tables, kernels) are not the path's memory
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()


def memory_cases(x: np.ndarray) -> dict[str, tuple[Any, Callable[[], Any]]]:
    """Every CPU block path on x: name -> (its input, the call)."""
    mx, mxc = quantize_mxfp8(x), quantize_mxfp8(x, columnwise=True)
    b1, b128 = quantize_blockwise(x), quantize_blockwise(x, block="128x128")
    return {
        "mxfp8 rowwise": (x, lambda: quantize_mxfp8(x)),
        "mxfp8 columnwise": (x, lambda: quantize_mxfp8(x, columnwise=True)),
        "mxfp8 rowwise+columnwise": (x, lambda: quantize_mxfp8_both(x)),
        "1x128 fp32": (x, lambda: quantize_blockwise(x)),
        "128x128 fp32": (x, lambda: quantize_blockwise(x, block="128x128")),
        "dequantize mxfp8 rowwise": (mx, lambda: dequantize_mxfp8(mx, x.dtype)),
        "dequantize mxfp8 columnwise": (mxc, lambda: dequantize_mxfp8(mxc, x.dtype)),
        "dequantize 1x128": (b1, lambda: dequantize_blockwise(b1, x.dtype)),
        "dequantize 128x128": (b128, lambda: dequantize_blockwise(b128, x.dtype)),
    }


def memory_rows(x: np.ndarray) -> list[dict[str, Any]]:
    """Per path: peak bytes and its ratio to input plus output bytes."""
    rows = []
    for name, (arg, fn) in memory_cases(x).items():
        peak, result = peak_bytes(fn)
        io = nbytes(arg) + nbytes(result)
        rows.append({"case": name, "shape": list(x.shape), "dtype": str(x.dtype), "peak_bytes": peak,
                     "in_out_bytes": io, "peak_over_in_out": peak / io})
    return rows


def gemm_cases(torch: Any, m: int, n: int, k: int) -> dict[str, tuple[int, Callable[[], Any]]]:
    """Block-scaled GEMMs this GPU has, fp8core against torch._scaled_mm on the same operands and scales."""
    from fp8core.backends import cuda_blocks
    from fp8core._tensor import wrap

    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    cases: dict[str, tuple[int, Callable[[], Any]]] = {}
    if cc == 90:  # cuBLASLt's 1x128/128x128 scale modes: Hopper only
        a, b = quantize_blockwise(x), quantize_blockwise(w, block="128x128")
        cases["1x128 x 128x128 fp8core.gemm"] = (flops, lambda: fp8core.gemm(a, b, out_dtype="bfloat16"))
        sa, sb = a.scale_inv.t().contiguous().t(), b.scale_inv.t()
        cases["1x128 x 128x128 torch._scaled_mm"] = (flops, lambda: torch._scaled_mm(
            a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    if cc >= 100:
        a, b = quantize_mxfp8(x), quantize_mxfp8(w)

        def swizzled(s: Any) -> Any:
            return torch.from_dlpack(cuda_blocks.gemm_scale(wrap(s), "1x32")).view(torch.float8_e8m0fnu)

        sa, sb = swizzled(a.scale), swizzled(b.scale)
        cases["mxfp8 fp8core.gemm"] = (flops, lambda: fp8core.gemm(a, b, out_dtype="bfloat16"))
        cases["mxfp8 torch._scaled_mm"] = (flops, lambda: torch._scaled_mm(
            a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--gemm", type=int, nargs=3, default=[8192, 8192, 8192], metavar=("M", "N", "K"))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="16 MiB only, 5 repeats, a 4096^3 GEMM")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.sizes_mib, args.repeat, args.gemm = [16], 5, [4096, 4096, 4096]
    try:
        import torch
    except ImportError:
        torch = None
    if args.device == "cuda":
        if torch is None:
            raise SystemExit("--device cuda needs torch (its CUDA tensors carry the inputs)")
        sync: Callable[[], None] = torch.cuda.synchronize
        where = torch.cuda.get_device_name()
    else:
        sync, where = (lambda: None), f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows_out = []
    print(f"# bench_blocks on {args.device} ({where}); bf16 input, E4M3 output; median of {args.repeat} "
          "[20th-80th percentile]")
    for mib in args.sizes_mib:
        n = mib * (1 << 20) // 2
        cols = 4096
        shape = (n // cols, cols)
        if args.device == "cuda":
            tx = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            x = tx
        else:
            import ml_dtypes

            x = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
            tx = torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16) if torch is not None else None
        for name, (nbytes, fn) in quantize_cases(x, torch, tx).items():
            med, lo, hi = timeit(fn, args.repeat, sync)
            gbs = nbytes / med / 1e9
            print(f"{mib:5d} MiB  {name:36s} {gbs:8.2f} GB/s  [{nbytes / hi / 1e9:.2f}-{nbytes / lo / 1e9:.2f}]")
            rows_out.append({"device": args.device, "mib": mib, "case": name, "gb_s": gbs, "median_s": med,
                             "p20_s": lo, "p80_s": hi})
    if args.device == "cpu":
        import ml_dtypes

        mib = args.sizes_mib[0]
        print("# peak memory (tracemalloc) of each CPU block path over its input + output bytes (bound: 2x)")
        for shape in ((mib * (1 << 20) // 4 // 4096, 4096), (1, mib * (1 << 20) // 4)):
            for dtype in (np.float32, ml_dtypes.bfloat16):
                x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
                for row in memory_rows(x):
                    print(f"{str(shape):16s} {row['dtype']:9s} {row['case']:30s} peak "
                          f"{row['peak_bytes'] / 2**20:8.1f} MiB  {row['peak_over_in_out']:5.2f}x in+out")
                    rows_out.append({"device": "cpu", **row})
    if args.device == "cuda":
        m, n_, k = args.gemm
        for name, (flops, fn) in gemm_cases(torch, m, n_, k).items():
            med, lo, hi = timeit(fn, args.repeat, sync)
            print(f"GEMM {m}x{n_}x{k}  {name:36s} {flops / med / 1e12:8.1f} TFLOP/s")
            rows_out.append({"device": "cuda", "case": name, "tflops": flops / med / 1e12, "median_s": med,
                             "m": m, "n": n_, "k": k})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
