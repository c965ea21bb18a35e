"""Where the CPU time of NVFP4 with the Hadamard transform goes: each step of the reference's two passes, timed on
the calling thread alone (``fp8core.cpu_threads(1)``) over every tile the backend uses, against the whole of
``quantize_mxfp8`` and of the NVFP4 calls on the same input. CPU ns per input element, the median of ``--rounds``
rounds (all steps once per round, in turn, so a busy machine slows them alike) [20th-80th percentile].

The steps are the backend's own functions (fp8core.backends.cpu_fp4), called on its own tiles (``_tiles``):
  transform pass, per tile: ``_rht`` (sign flip and widening, the four fp32 butterfly stages, v *rn 0.25 rounded
  to the input dtype) and the block maxima (``_fold`` of the magnitudes);
  quantize pass, per tile: ``_scaled`` (widening, times each block's multiplier), ``e2m1_index`` (the cast
  table's index), the table lookup, ``_pack_columns``; then ``_words_transposed`` (columnwise: the packed
  operand's 8-byte words transposed; rowwise there is nothing to move).
Rowwise, the transform first gathers each tile's blocks position-major (the ``gather`` row).
Usage: python bench/bench_fp4_steps.py [--rows 2048] [--cols 4096] [--dtype bfloat16] [--rounds 9] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import ml_dtypes  # noqa: F401 - registers the name bfloat16 with NumPy
import numpy as np

import fp8core
from fp8core.backends import cpu_fp4 as c

B = c.NVFP4_BLOCK


def steps(x: np.ndarray, columnwise: bool) -> dict[str, float]:
    """CPU seconds of each step of quantize_nvfp4(x, hadamard=True, columnwise=columnwise) on x [M, K], the
    backend's functions called tile by tile in its order, each step timed on its tile (in cache, as in the
    backend) and summed over the tiles. NumPy's warnings must be off."""
    m, k = x.shape
    took: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t = time.process_time()
        r = fn()
        took[name] = took.get(name, 0.0) + time.process_time() - t
        return r

    # transform pass: x's tiles (rowwise: whole rows, gathered position-major first)
    n = x.size // B
    data = np.empty(x.shape if columnwise else (B, n), x.dtype)
    maxima = np.empty((m // B, k) if columnwise else (1, n), np.uint32)
    uint = {2: np.uint16, 4: np.uint32}[x.itemsize]
    low = np.array(0x7FFF if x.itemsize == 2 else 0x7FFFFFFF, uint)
    scratch = np.empty(2 * c.SPAN, np.float32)
    per = k // B
    for m0, m1, k0, k1 in c._tiles(m, k, B if columnwise else 1, columnwise):
        if columnwise:
            src = x[m0:m1, k0:k1].reshape(-1, B, k1 - k0)
            dst, top = data[m0:m1, k0:k1].reshape(src.shape), maxima[m0 // B:m1 // B, k0:k1]
        else:
            src = timed("gather (rowwise)", lambda: np.ascontiguousarray(
                x[m0:m1].astype(np.float32).reshape(-1, B).T)[None])
            dst, top = data[None, :, m0 * per:m1 * per], maxima[:, m0 * per:m1 * per]
        timed("rht: flip, widen, butterfly, *0.25, round", lambda: c._rht(src, dst, scratch))
        top[...] = timed("block maxima", lambda: c.f32_bits(c._fold(np.bitwise_and(dst.view(uint), low), False),
                                                             x.dtype))
    s_enc, s_dec = c.global_scales(np.array([maxima.max()], np.uint32).view(np.float32))
    _, mult = timed("block scales", lambda: c.nvfp4_block_scales(maxima, s_enc, s_dec))
    # quantize pass: the operand's blocks down the columns of ``data`` (rowwise: x's blocks, one a column)
    r, cols = data.shape
    packed = np.empty((r // B, cols, 8), np.uint8)
    for m0, m1, k0, k1 in c._tiles(r, cols, B, True):
        y = timed("scaled: widen, *e_b", lambda: c._scaled(data[m0:m1, k0:k1], mult[m0 // B:m1 // B, k0:k1], B,
                                                          True, False))
        i = timed("E2M1 index", lambda: c.e2m1_index(y, np.intp))
        q = timed("E2M1 lookup", lambda: c.e2m1_table().take(i, mode="clip"))
        timed("pack", lambda: c._pack_columns(q, packed[m0 // B:m1 // B, k0:k1]))
    timed("word transpose", lambda: c._words_transposed(packed))
    return took


def wholes(x: np.ndarray) -> dict[str, Callable[[], Any]]:
    return {
        "mxfp8 rowwise": lambda: fp8core.quantize_mxfp8(x),
        "nvfp4 rowwise": lambda: fp8core.quantize_nvfp4(x),
        "nvfp4 columnwise": lambda: fp8core.quantize_nvfp4(x, columnwise=True),
        "nvfp4 rowwise hadamard": lambda: fp8core.quantize_nvfp4(x, hadamard=True),
        "nvfp4 columnwise hadamard": lambda: fp8core.quantize_nvfp4(x, hadamard=True, columnwise=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.dtype(args.dtype))
    loads = [os.getloadavg()[0]]
    cpu: dict[str, list[float]] = {}
    with fp8core.cpu_threads(1), np.errstate(all="ignore"):
        todo = wholes(x)
        for fn in todo.values():
            fn()
        for _ in range(args.rounds):
            for columnwise in (False, True):
                for name, sec in steps(x, columnwise).items():
                    key = f"hadamard {'columnwise' if columnwise else 'rowwise'}: {name}"
                    cpu.setdefault(key, []).append(sec * 1e9 / x.size)
            for name, fn in todo.items():
                t = time.process_time()
                fn()
                cpu.setdefault(f"whole: {name}", []).append((time.process_time() - t) * 1e9 / x.size)
            loads.append(os.getloadavg()[0])
    where = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {min(loads):.1f}-"
             f"{max(loads):.1f}, fp8core.cpu_threads(1)")
    print(f"# bench_fp4_steps on the CPU ({where}); {x.shape} {x.dtype}; CPU ns per input element, median of "
          f"{args.rounds} rounds [20th-80th percentile]")
    rows = []
    for name, ts in cpu.items():
        q = statistics.quantiles(ts, n=5)
        rows.append({"step": name, "cpu_ns_per_element": statistics.median(ts), "p20": q[0], "p80": q[3]})
        print(f"{name:<62} {rows[-1]['cpu_ns_per_element']:6.2f} [{q[0]:6.2f}-{q[3]:6.2f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": where, "shape": list(x.shape), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
