"""Host time per call of every fp8core primitive, by input type, with torch eager's equivalent in the same run.

Small tensors (16 elements by default) make the figure the cost of the call itself: the bridge, validation,
dispatch and, on the CPU, the reference backend's fixed cost ("backend only" rows call the backend directly,
so the rest is fp8core's Python around it). Medians with p20/p80, in microseconds.

CPU: NumPy, torch and JAX inputs. GPU (``--gpu``, run by a GPU session): torch CUDA, CuPy and JAX inputs, timed
while a long sleep kernel holds the stream, so a launch never waits for the GPU and the figure is host time only.
CPU runs end with fp8core.jax's primitives (eager and under jit) beside jax.numpy's jitted chains and the floor of
a host callback (``--jax-export``: also NumPy -> jax.Array by size).
Usage: python bench/bench_overhead.py [--gpu] [--n 16] [--repeat 2000] [--quick] [--jax-export] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date
from typing import Any, Callable

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_cpu import interleaved  # noqa: E402  (alternating blocks: a drifting machine slows all alike)

import fp8core  # noqa: E402
from fp8core import _tensor  # noqa: E402
from fp8core.backends import for_device  # noqa: E402

Case = Callable[[], Any]


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _fp8_cases(x: Any, s: Any, slot: Any, q: Any, x2: Any) -> dict[str, Case]:
    """fp8core's primitives on one kind of input (x high precision, q fp8, x2 2-D)."""
    out_dtype = "bfloat16"
    q2 = q.reshape(x2.shape)
    return {
        "amax": lambda: fp8core.amax(x),
        "quantize": lambda: fp8core.quantize(x, s, "e4m3"),
        "quantize+amax_out": lambda: fp8core.quantize(x, s, "e4m3", amax_out=slot),
        "quantize_dynamic": lambda: fp8core.quantize_dynamic(x, "e4m3"),
        "dequantize": lambda: fp8core.dequantize(q, s, out_dtype, fmt="e4m3"),
        "transpose": lambda: fp8core.transpose(q2, fmt="e4m3"),
        "cast_transpose": lambda: fp8core.cast_transpose(x2, s, "e4m3"),
        "compute_scale": lambda: fp8core.compute_scale(slot, "e4m3"),
    }


def _backend_cases(x: Any, s: Any, slot: Any, q: Any, x2: Any) -> dict[str, Case]:
    """The same work handed straight to the backend: the floor that fp8core's Python adds to."""
    tx, tx2 = _tensor.wrap(x), _tensor.wrap(x2)
    tq = fp8core.args.fp8(q, "q", "e4m3")[0]
    be = for_device(tx.device)
    st, ss = _tensor.wrap(s).data.reshape(-1), _tensor.wrap(slot).data.reshape(-1)
    e4m3 = fp8core.Format.E4M3
    return {
        "amax": lambda: be.amax(tx),
        "quantize": lambda: be.quantize(tx, st, e4m3, None),
        "quantize+amax_out": lambda: be.quantize(tx, st, e4m3, ss),
        "quantize_dynamic": lambda: be.quantize_dynamic(tx, e4m3, 0, False, 0.0, None),
        "dequantize": lambda: be.dequantize(tq, e4m3, st, "bfloat16"),
        "cast_transpose": lambda: be.cast_transpose(tx2, st, e4m3, None),
        "compute_scale": lambda: be.compute_scale(ss, 448.0, 0, False, 0.0, None),
    }


def _torch_eager(torch: Any, x: Any, s: Any, q: Any, x2: Any) -> dict[str, Case]:
    """torch's own chains for the same results (what a user without fp8core writes)."""
    def quantize(v: Any) -> Any:
        return (v.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)

    def dynamic() -> Any:
        a = x.abs().max().float()
        scale = torch.where(a > 0, 448.0 / a, torch.ones_like(a))
        return (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), 1 / scale, a

    return {
        "amax": lambda: x.abs().max(),
        "quantize": lambda: quantize(x),
        "quantize+amax_out": lambda: (quantize(x), x.abs().max()),
        "quantize_dynamic": dynamic,
        "dequantize": lambda: (q.float() * s).to(torch.bfloat16),
        "transpose": lambda: q.view(x2.shape).t().contiguous(),
        "cast_transpose": lambda: (lambda c: (c, c.t().contiguous()))(quantize(x2)),
        "compute_scale": lambda: torch.where(s > 0, 448.0 / s, torch.ones_like(s)),
    }


def _inputs_cpu(kind: str, n: int, torch: Any) -> tuple[Any, Any, Any, Any, Any]:
    rng = np.random.default_rng(0)
    xf = rng.standard_normal(n, dtype=np.float32)
    rows = 4 if n % 4 == 0 else 1
    if kind == "numpy":
        x = xf.astype(ml_dtypes.bfloat16)
        s, slot = np.array([0.5], np.float32), np.ones(1, np.float32)
    elif kind == "torch":
        x = torch.from_numpy(xf).to(torch.bfloat16)
        s, slot = torch.tensor([0.5]), torch.ones(1)
    else:
        import jax
        import jax.numpy as jnp

        with jax.default_device(jax.devices("cpu")[0]):  # JAX's default device is a GPU where one is
            x = jnp.asarray(xf, dtype=jnp.bfloat16)
            s, slot = jnp.asarray([0.5], jnp.float32), np.ones(1, np.float32)  # JAX arrays are immutable
    q = fp8core.quantize(x, s, "e4m3")
    return x, s, slot, q, x.reshape(rows, -1)


def _torch_twins(torch: Any, x: Any, s: Any, q: Any, x2: Any) -> tuple[Any, Any, Any, Any]:
    """torch tensors over NumPy inputs' memory: torch eager's chain on the same data, beside NumPy's rows."""
    def t(a: Any) -> Any:
        a = np.asarray(a)
        return torch.from_numpy(a.view(f"u{a.itemsize}") if a.dtype.kind == "V" or a.itemsize < 4 and
                                a.dtype.name.startswith(("bfloat", "float8")) else a)

    tx = t(x).view(torch.bfloat16)
    return tx, t(s), t(q).view(torch.float8_e4m3fn), tx.view(x2.shape)


def _inputs_gpu(kind: str, n: int, torch: Any) -> tuple[Any, Any, Any, Any, Any]:
    if kind == "cupy":  # CuPy has no bfloat16: float32 data
        import cupy

        x = cupy.random.standard_normal(n, dtype=cupy.float32)
        s, slot = cupy.full(1, 0.5, cupy.float32), cupy.ones(1, cupy.float32)
    elif kind == "jax-cuda":
        import cupy
        import jax.numpy as jnp

        x = jnp.asarray(np.random.default_rng(0).standard_normal(n, dtype=np.float32), jnp.bfloat16)
        s, slot = jnp.asarray([0.5], jnp.float32), cupy.ones(1, cupy.float32)  # JAX arrays are immutable
    else:
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        s, slot = torch.tensor([0.5], device="cuda"), torch.ones(1, device="cuda")
    q = fp8core.quantize(x, s, "e4m3")
    rows = 4 if n % 4 == 0 else 1
    return x, s, slot, q, x.reshape(rows, -1)


def _busy_sampler(torch: Any, repeat: int) -> Callable[[Case], tuple[float, float, float]]:
    """Host time per call with the stream held by a sleep kernel: launches queue instead of waiting."""
    def sample(fn: Case) -> tuple[float, float, float]:
        import statistics
        import time

        fn()
        torch.cuda.synchronize()
        times: list[float] = []
        while len(times) < repeat:
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: longer than a batch of 200 calls on the host
            for _ in range(200):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        q = statistics.quantiles(times, n=5)
        return statistics.median(times), q[0], q[3]

    return sample


# ---- fp8core.jax: the jit-able primitives beside jax.numpy's own chains -------------------------------------

def _jax_section(n: int, repeat: int, meta: dict[str, Any], export_sizes: bool) -> list[dict[str, Any]]:
    """fp8core.jax's primitives eager (outside jit) and inside a jitted function called once per iteration,
    with jax.numpy's equivalent chain (jitted) and the floor of any host callback under jit (a no-op
    buffer_callback and a no-op pure_callback) measured in the same run. Every call waits for its result
    (jax.block_until_ready): XLA:CPU dispatches asynchronously, and the callback is part of the call. Median,
    p20-p80 and min of ``repeat`` calls, in microseconds. ``export_sizes``: also the cost of handing a NumPy
    result to JAX by size, jitted identity against DLPack (the crossover behind _tensor._JAX_COPY_MAX)."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    import fp8core.jax as fj

    def sample(fn: Case, calls: int = repeat) -> tuple[float, float, float, float]:
        fn()
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        q = statistics.quantiles(times, n=5, method="inclusive")
        return statistics.median(times) * 1e6, q[0] * 1e6, q[3] * 1e6, min(times) * 1e6

    rng = np.random.default_rng(0)
    rows_n = 4 if n % 4 == 0 else 1
    x = jnp.asarray(rng.standard_normal(n, dtype=np.float32), jnp.bfloat16).reshape(rows_n, -1)
    s = jnp.asarray([0.5], jnp.float32)
    q = fj.quantize(x, s)[0]

    def chain(v: Any, scale: Any) -> Any:
        return (v.astype(jnp.float32) * scale).clip(-448, 448).astype(jnp.float8_e4m3fn)

    def dynamic(v: Any) -> Any:
        a = jnp.max(jnp.abs(v.astype(jnp.float32)))
        scale = jnp.where(a > 0, 448.0 / a, 1.0)
        return chain(v, scale), (1 / scale).reshape(1), a.reshape(1)

    ops: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]] = {
        "amax": (fj.amax, lambda v: jnp.max(jnp.abs(v.astype(jnp.float32))).reshape(1), (x,)),
        "quantize": (fj.quantize, lambda v, sc: (chain(v, sc), jnp.max(jnp.abs(v.astype(jnp.float32)))), (x, s)),
        "quantize_dynamic": (fj.quantize_dynamic, dynamic, (x,)),
        "dequantize": (lambda v, sc: fj.dequantize(v, sc, jnp.bfloat16),
                       lambda v, sc: (v.astype(jnp.float32) * sc).astype(jnp.bfloat16), (q, s)),
        "cast_transpose": (fj.cast_transpose,
                           lambda v, sc: (lambda c: (c, c.T, jnp.max(jnp.abs(v.astype(jnp.float32)))))(chain(v, sc)),
                           (x, s)),
    }
    wait = jax.block_until_ready
    rows: list[dict[str, Any]] = []
    print(f"# fp8core.jax, {n} elements, each call waits for its result (us)")
    print(f"{'op':<18} {'eager':>8} {'jit':>8} {'p20-p80 (jit)':>15} {'min jit':>8} {'jnp jit':>8} {'x jnp':>6}")
    for op, (ours, theirs, args) in ops.items():
        ours_jit, theirs_jit = jax.jit(ours), jax.jit(theirs)
        eager = sample(lambda: wait(ours(*args)))
        jitted = sample(lambda: wait(ours_jit(*args)))
        jnp_jit = sample(lambda: wait(theirs_jit(*args)))
        rows.append({"op": op, "input": "jax", "api": "fp8core.jax", "eager_us": eager[0], "eager_us_min": eager[3],
                     "us": jitted[0], "us_p20": jitted[1], "us_p80": jitted[2], "us_min": jitted[3],
                     "jnp_jit_us": jnp_jit[0], "jnp_jit_us_min": jnp_jit[3], **meta})
        print(f"{op:<18} {eager[0]:>8.1f} {jitted[0]:>8.1f} {jitted[1]:>7.1f}-{jitted[2]:<7.1f} {jitted[3]:>8.1f} "
              f"{jnp_jit[0]:>8.1f} {jitted[0] / jnp_jit[0]:>6.1f}", flush=True)

    f32_1 = jax.ShapeDtypeStruct((1,), jnp.float32)
    floors = {
        "noop buffer_callback under jit": jax.jit(buffer_callback(lambda ctx, out, *bufs: None, f32_1)),
        "noop pure_callback under jit": jax.jit(lambda v: jax.pure_callback(lambda a: np.zeros(1, np.float32),
                                                                            f32_1, v)),
        "jit of the identity": jax.jit(lambda v: v),
    }
    for name, fn in floors.items():
        med, p20, p80, low = sample(lambda: wait(fn(x)))
        rows.append({"op": name, "input": "jax", "api": "floor", "us": med, "us_p20": p20, "us_p80": p80,
                     "us_min": low, **meta})
        print(f"# floor: {name:<32} {med:>8.1f} (p20-p80 {p20:.1f}-{p80:.1f}, min {low:.1f})", flush=True)

    if export_sizes:
        import jax.dlpack

        like = _tensor.wrap(x)
        put = _tensor._jax_put()
        print("# NumPy result -> jax.Array by size (us, min of the calls; the NumPy allocation excluded)")
        for nbytes in (1 << 12, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 22):
            calls = max(20, min(repeat, (1 << 24) // nbytes))
            make = lambda: np.ones(nbytes // 4, np.float32)  # noqa: E731  (a fresh result, as export gets)
            base = sample(make, calls)[3]
            ident = sample(lambda: wait(put(make())), calls)[3] - base
            dl = sample(lambda: wait(jax.dlpack.from_dlpack(_tensor._exporter(make(), "float32", like))), calls)[3]
            rows.append({"op": "export", "bytes": nbytes, "identity_us_min": ident, "dlpack_us_min": dl - base,
                         **meta})
            print(f"# export {nbytes:>8} B: jitted identity {ident:>8.1f}  DLPack {dl - base:>8.1f}", flush=True)
    return rows


def _cprofile(op: str, inputs: tuple[Any, ...], repeat: int) -> None:
    import cProfile
    import pstats

    cases = _fp8_cases(*inputs)
    if op == "gemm":  # fp8core.gemm of the smallest FP8 GEMM (16 x 16 x 16), the host cost alone
        q = fp8core.quantize(inputs[0].reshape(-1)[:1].repeat(256).reshape(16, 16), inputs[1], "e4m3")
        cases["gemm"] = lambda: fp8core.gemm(q, q, inputs[1], inputs[1], out_dtype="bfloat16")
    fn = cases[op]
    for _ in range(20):  # compile and plan outside the profile
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeat):
        fn()
    prof.disable()
    print(f"# cProfile of {repeat} calls of {op}: the functions of most own time (tottime), then of most cumulative")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="torch CUDA and CuPy inputs (needs a GPU)")
    ap.add_argument("--n", type=int, default=16, help="elements per tensor")
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="300 calls per figure")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--jax-export", action="store_true", help="with the JAX section: export cost by size")
    ap.add_argument("--cprofile", metavar="OP", help="instead of timing: where the host time of OP (quantize, "
                    "gemm, ...) on the first input kind goes, by cProfile, the 25 functions of most own time")
    args = ap.parse_args()
    repeat = 300 if args.quick else args.repeat
    torch = _torch()
    if torch is not None and not args.gpu:
        torch.set_num_threads(os.cpu_count() or 1)
    meta = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "date": str(date.today()), "n": args.n, "repeat": repeat, "fp8core": fp8core.__version__,
            "numpy": np.__version__, "torch": torch.__version__ if torch else None}
    if args.gpu:
        meta["device"] = torch.cuda.get_device_name()
        kinds, make = ["torch-cuda", "cupy", "jax-cuda"], _inputs_gpu
        sample = _busy_sampler(torch, repeat)
    else:
        kinds, make = ["numpy", "torch", "jax"], _inputs_cpu
        sample = None
    if args.cprofile:
        _cprofile(args.cprofile, make(kinds[0], args.n, torch), repeat)
        return
    print("# fp8core host time per call (us)", json.dumps(meta))
    if sample is None:
        print("# interleaved: fp8core, the backend alone and torch eager's chain (on the same data, for NumPy inputs "
              "too) timed in alternating blocks; x eager = median over blocks of fp8core / torch eager")
    print(f"{'op':<18} {'input':<11} {'fp8core':>8} {'p20-p80':>13} {'backend':>8} {'torch eager':>12} "
          f"{'x eager':>8}")
    rows = []
    for kind in kinds:
        try:
            x, s, slot, q, x2 = make(kind, args.n, torch)
        except ImportError as e:
            print(f"# {kind}: skipped ({e})")
            continue
        ours = _fp8_cases(x, s, slot, q, x2)
        floor = _backend_cases(x, s, slot, q, x2)
        eager = {}
        if kind.startswith("torch"):
            eager = _torch_eager(torch, x, s, q, x2)
        elif kind == "numpy" and torch is not None:
            tx, ts, tq, tx2 = _torch_twins(torch, x, s, q, x2)
            eager = _torch_eager(torch, tx, ts, tq, tx2)
        for op, fn in ours.items():
            fns = {"ours": fn, **({"backend": floor[op]} if op in floor else {}),
                   **({"eager": eager[op]} if op in eager else {})}
            if sample is None:
                stats, ratio = interleaved(fns, max(5, repeat // 40), block=40)
            else:
                stats = {k: sample(f) for k, f in fns.items()}
                ratio = stats["ours"][0] / stats["eager"][0] if "eager" in stats else float("nan")
            med, p20, p80 = (v * 1e6 for v in stats["ours"])
            row = {"op": op, "input": kind, "us": med, "us_p20": p20, "us_p80": p80, **meta}
            if "backend" in stats:
                row["backend_us"] = stats["backend"][0] * 1e6
            if "eager" in stats:
                e_med, e_p20, e_p80 = (v * 1e6 for v in stats["eager"])
                row.update(torch_eager_us=e_med, torch_eager_us_p20=e_p20, torch_eager_us_p80=e_p80, x_eager=ratio)
            rows.append(row)
            b, e = row.get("backend_us", float("nan")), row.get("torch_eager_us", float("nan"))
            print(f"{op:<18} {kind:<11} {med:>8.1f} {p20:>6.1f}-{p80:<6.1f} {b:>8.1f} {e:>12.1f} "
                  f"{ratio:>8.2f}", flush=True)
    if not args.gpu:
        try:
            rows += _jax_section(args.n, repeat, meta, args.jax_export)
        except ImportError as e:
            print(f"# fp8core.jax: skipped ({e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
