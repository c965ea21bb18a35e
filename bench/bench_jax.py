"""fp8core.jax.quantize under jax.jit against the core call on the same data, same run (issue 16).

Rows, per input size (bf16, quantized to E4M3 with the amax taken): the core call allocating its result, the
core call with ``out=``, fp8core.jax.quantize under jit (the callback writes XLA's buffers in place), and the
same callback writing a temporary and copying it into XLA's buffer (the path before ``out=``), so the copy's cost
is measured, not estimated. Times are wall clock per call including the wait for the result (medians, p20, p80);
GB/s counts bytes read and written (3 per element). Runs on jax's default device: the CPU here, a GPU in the
GPU run. Usage: python bench/bench_jax.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import date

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import fp8core
import fp8core.jax as fj
from fp8core._tensor import wrap


def wall(fn, wait, repeat: int) -> tuple[float, float, float]:
    wait(fn())
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        wait(fn())
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[3]


def quantize_via_copy(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The path before out=: the core result in a temporary, then copied into XLA's output buffers."""
    def callback(ctx, outs, xb, sb):
        t, s = fj.primitives._raw(xb), fj.primitives._raw(sb)
        if t.is_cuda:
            import cupy

            from fp8core.backends.cuda import launch_stream

            with launch_stream(ctx.stream), cupy.cuda.ExternalStream(ctx.stream, t.device[1]):
                slot = cupy.zeros(1, cupy.float32)
                wrap(outs[0]).data[...] = fp8core.quantize(t, s.data, "e4m3", amax_out=slot)
                wrap(outs[1]).data[...] = slot
        else:
            slot = np.zeros(1, np.float32)
            np.asarray(outs[0])[...] = fp8core.quantize(t, s.data, "e4m3", amax_out=slot)
            np.asarray(outs[1])[...] = slot

    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((1,), jnp.float32))
    return buffer_callback(callback, shapes)(x, scale)


def meta() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "date": str(date.today()),
            "commit": commit, "jax": jax.__version__, "fp8core": fp8core.__version__,
            "load_1min": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 and 16 MiB, 10 repeats")
    ap.add_argument("--json")
    args = ap.parse_args()
    info = meta()
    print("# fp8core.jax quantize benchmark", json.dumps(info))
    gpu = info["platform"] == "gpu"
    sizes, repeat = ([1, 16], 10) if args.quick else ([1, 16, 64, 256], 30)
    if gpu:
        import cupy

        def wait(r):
            jax.block_until_ready(r)
            cupy.cuda.Device().synchronize()
    else:
        def wait(r):
            jax.block_until_ready(r)
    rows = []
    rng = np.random.default_rng(0)
    jit_fj = jax.jit(lambda x, s: fj.quantize(x, s, "e4m3"))
    jit_copy = jax.jit(quantize_via_copy)
    for mib in sizes:
        n = mib * 2 ** 20 // 2
        host = rng.standard_normal(n, np.float32).astype(ml_dtypes.bfloat16).reshape(-1, 1024)
        x = jax.device_put(host)
        scale = jnp.asarray([0.5], jnp.float32)
        if gpu:  # the core reads the same jax array zero-copy; its outputs are CuPy arrays
            slot, out = cupy.zeros(1, cupy.float32), cupy.empty(host.shape, cupy.uint8)
        else:
            slot, out = np.zeros(1, np.float32), np.empty(host.shape, ml_dtypes.float8_e4m3fn)
        calls = {
            "core quantize (allocates)": lambda: fp8core.quantize(x, 0.5, "e4m3", amax_out=slot),
            "core quantize out=": lambda: fp8core.quantize(x, 0.5, "e4m3", amax_out=slot, out=out),
            "fp8core.jax.quantize jit": lambda: jit_fj(x, scale),
            "jit, temporary + copy (before)": lambda: jit_copy(x, scale),
        }
        q_ref = np.asarray(jit_fj(x, scale)[0]).view(np.uint8)
        assert (q_ref == np.asarray(jit_copy(x, scale)[0]).view(np.uint8)).all()
        for name, fn in calls.items():
            med, p20, p80 = wall(fn, wait, repeat)
            gbs = 3 * n / med / 1e9
            rows.append({"mib": mib, "case": name, "ms": med * 1e3, "ms_p20": p20 * 1e3, "ms_p80": p80 * 1e3,
                         "gb_s": gbs})
            print(f"{mib:5d} MiB  {name:<32} {med * 1e3:9.3f} ms (p20 {p20 * 1e3:.3f}, p80 {p80 * 1e3:.3f}) "
                  f"{gbs:7.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
