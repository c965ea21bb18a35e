"""A flax training step with fp8core.jax.Fp8DotGeneral against flax's own fp8 ops and plain Dense, same process
(issue 25 item 6).

The model: a 3-layer MLP (``nn.Dense(width)`` -> gelu -> ``nn.Dense(width)`` -> gelu -> ``nn.Dense(width)``,
activations in ``--dtype``, float32 parameters), mean squared error against a fixed random teacher, optax adam,
``flax.training.train_state.TrainState`` (which writes the fp8 state back from its "gradient"), the whole step
under one ``jax.jit``. Variants, each its own jitted step: fp8core.jax.Fp8DotGeneral (delayed scaling,
amax_history_len 1024 like flax's op), flax's Fp8DotGeneralOp (the op the issue measured) and
Fp8DirectDotGeneralOp, and plain Dense in ``--dtype`` and in float32.

Timing: rounds of ``--steps`` training steps per variant, the variants interleaved within every round (a shared
VM's speed drifts: every variant sees the same moments), the result waited for at the end of each round. Per
variant: the median step time over rounds with p20/p80, and the median over rounds of its ratio to flax's
Fp8DotGeneralOp in the same round. ``--base CHECKOUT`` adds fp8core.jax of another checkout (``git worktree add
/tmp/base <commit>``), imported in the same process as the package fp8core_base, as a further variant.
``--profile`` prints, for fp8core's step, the host callbacks per step and each callback's own time (see
:func:`callback_profile`).

    python bench/bench_flax_train.py [--batch 64 256] [--width 256 1024] [--rounds 7] [--steps 10]
        [--base /tmp/base] [--profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import importlib
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops
from flax.training.train_state import TrainState

import fp8core
import fp8core.jax as fj

REFERENCE = "flax Fp8DotGeneralOp"


def load_base(checkout: str) -> Any:
    """fp8core.jax of another checkout, with that checkout's core, as the package fp8core_base (its jax
    front-end as fp8core_base.jax: the front-end's absolute imports of fp8core renamed)."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="fp8core_base_"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(pathlib.Path(checkout) / "fp8core", root / "fp8core_base")
    shutil.copytree(pathlib.Path(checkout) / "bindings" / "jax", root / "fp8core_base" / "jax")
    for path in (root / "fp8core_base").rglob("*.py"):
        text = path.read_text()
        renamed = re.sub(r"\bfp8core(?=[.\s])", "fp8core_base", text)
        if renamed != text:
            path.write_text(renamed)
    sys.path.insert(0, str(root))
    return importlib.import_module("fp8core_base.jax")


class MLP(nn.Module):
    width: int
    dtype: Any
    dot: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(3):
            x = nn.Dense(self.width, dtype=self.dtype, dot_general_cls=self.dot, name=f"fc{i}")(x)
            if i < 2:
                x = nn.gelu(x)
        return x


def make_step(dot: Any, batch: int, width: int, dtype: Any) -> tuple[Callable, TrainState, tuple]:
    """A jitted training step for the MLP with ``dot`` as every layer's dot_general_cls, its initial state and
    one batch (x [batch, width], target [batch, width])."""
    model = MLP(width, dtype, dot)
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (batch, width), jnp.float32)
    target = jnp.tanh(x @ (jax.random.normal(kw, (width, width)) / np.sqrt(width)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Fp8DotGeneralOp's: it is the op being compared
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))

    @jax.jit
    def step(state: TrainState, x: jax.Array, t: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(params):
            y = state.apply_fn(params, x)
            return jnp.mean((y.astype(jnp.float32) - t) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, state, (x, target)


def variants(base: Any, dtype: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (dot_general_cls, activation dtype): the fp8 variants and plain Dense in ``dtype``, and plain Dense
    in float32."""
    out = {"fp8core Fp8DotGeneral": (fj.Fp8DotGeneral, dtype)}
    if base is not None:
        out["fp8core (base) Fp8DotGeneral"] = (base.Fp8DotGeneral, dtype)
    out.update({REFERENCE: (fp8_ops.Fp8DotGeneralOp, dtype),
                "flax Fp8DirectDotGeneralOp": (fp8_ops.Fp8DirectDotGeneralOp, dtype),
                f"plain Dense {jnp.dtype(dtype).name}": (None, dtype), "plain Dense float32": (None, jnp.float32)})
    return out


def run_config(batch: int, width: int, dtype: Any, rounds: int, steps: int, base: Any) -> list[dict]:
    runs = {}
    for name, (dot, dt) in variants(base, dtype).items():
        step, state, data = make_step(dot, batch, width, dt)
        state, loss = step(state, *data)  # compile
        jax.block_until_ready(loss)
        runs[name] = [step, state, data, []]
    for _ in range(rounds):
        for name, run in runs.items():
            step, state, data, times = run
            t = time.perf_counter()
            for _ in range(steps):
                state, loss = step(state, *data)
            jax.block_until_ready((state, loss))
            times.append((time.perf_counter() - t) / steps)
            run[1] = state
    ref = runs[REFERENCE][3]
    rows = []
    for name, (_, state, data, times) in runs.items():
        q = statistics.quantiles(times, n=5, method="inclusive")
        ratio = statistics.median(a / b for a, b in zip(times, ref))
        _, loss = runs[name][0](state, *data)
        rows.append({"batch": batch, "width": width, "variant": name,
                     "ms_per_step": statistics.median(times) * 1e3, "ms_p20": q[0] * 1e3, "ms_p80": q[3] * 1e3,
                     "ratio_to_flax_op": ratio, "final_loss": float(loss)})
    return rows


def _step_with(callbacks: Callable, batch: int, width: int, dtype: Any, steps: int,
               warmed: Callable = lambda: None) -> float:
    """fp8core's step time (seconds) with every primitive's callback replaced by ``callbacks(callback, label)``
    (label: the primitive's name); ``warmed()`` runs after the warm-up steps."""
    from fp8core.jax import primitives

    original = primitives.buffer_callback

    def patched(callback, shapes, **kw):
        label = sys._getframe(1).f_back.f_code.co_name  # primitive() is called from the primitive's jitted body
        return original(callbacks(callback, label), shapes, **kw)

    primitives.buffer_callback = patched
    jax.clear_caches()  # the primitives' inner jits keep their traces: retrace them with these callbacks
    try:
        step, state, data = make_step(fj.Fp8DotGeneral, batch, width, dtype)
        for _ in range(2):
            state, loss = step(state, *data)
        jax.block_until_ready(loss)
        warmed()
        t = time.perf_counter()
        for _ in range(steps):
            state, loss = step(state, *data)
        jax.block_until_ready((state, loss))
        return (time.perf_counter() - t) / steps
    finally:
        primitives.buffer_callback = original
        jax.clear_caches()


def callback_profile(batch: int, width: int, dtype: Any, steps: int) -> dict:
    """fp8core's training step: the host callbacks one step runs (counted as they run) and the time spent
    inside them (the callback's Python body, from entry to return, by primitive), against the step's wall time;
    and the step with callbacks that do nothing (its outputs garbage): what XLA's own work (gelu, adam, the
    layers' glue) and the callbacks' launches cost without the core's work."""
    spent: dict[str, list[float]] = collections.defaultdict(list)

    def timed(callback, label):
        def run(ctx, out, *bufs):
            t = time.perf_counter()
            callback(ctx, out, *bufs)
            spent[label].append(time.perf_counter() - t)
        return run

    def nothing(callback, label):
        return lambda ctx, out, *bufs: None

    noop = _step_with(nothing, batch, width, dtype, steps)
    wall = _step_with(timed, batch, width, dtype, steps, spent.clear)
    per = {k: {"calls_per_step": len(v) / steps, "us_per_call": statistics.median(v) * 1e6,
               "ms_per_step": sum(v) / steps * 1e3} for k, v in spent.items()}
    return {"batch": batch, "width": width, "step_ms": wall * 1e3, "noop_callbacks_step_ms": noop * 1e3,
            "callbacks": per, "inside_callbacks_ms": sum(p["ms_per_step"] for p in per.values())}


def meta() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent).stdout.strip()
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "jax": jax.__version__, "flax": flax.__version__, "numpy": np.__version__, "fp8core": fp8core.__version__,
            "load_1min": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--width", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=7, help="0: --profile only")
    ap.add_argument("--steps", type=int, default=10, help="training steps per variant per round")
    ap.add_argument("--base", help="another checkout whose fp8core.jax runs as a further variant")
    ap.add_argument("--profile", action="store_true", help="callbacks per step and their own time")
    ap.add_argument("--json")
    args = ap.parse_args()
    info = meta()
    info.update(dtype=args.dtype, openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
                xla_flags=os.environ.get("XLA_FLAGS"))
    print("# flax training step, 3-layer MLP, same process, interleaved", json.dumps(info), flush=True)
    base = load_base(args.base) if args.base else None
    dtype = jnp.dtype(args.dtype)
    rows, profiles = [], []
    for batch in args.batch:
        for width in args.width:
            if args.profile:
                p = callback_profile(batch, width, dtype, args.steps)
                profiles.append(p)
                print(f"## profile batch {batch} width {width}: step {p['step_ms']:.2f} ms, inside callbacks "
                      f"{p['inside_callbacks_ms']:.2f} ms; the step with callbacks doing nothing "
                      f"{p['noop_callbacks_step_ms']:.2f} ms", flush=True)
                for k, v in sorted(p["callbacks"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                    print(f"   {k:<20} {v['calls_per_step']:4.0f}/step  {v['us_per_call']:9.1f} us/call  "
                          f"{v['ms_per_step']:8.2f} ms/step", flush=True)
            if not args.rounds:
                continue
            load0 = os.getloadavg()[0]
            for r in run_config(batch, width, dtype, args.rounds, args.steps, base):
                rows.append(r)
                print(f"batch {batch:4d} width {width:5d} {r['variant']:<30} "
                      f"{r['ms_per_step']:9.2f} ms/step (p20 {r['ms_p20']:.2f}, p80 {r['ms_p80']:.2f})  "
                      f"x{r['ratio_to_flax_op']:.2f} of flax op  loss {r['final_loss']:.4f}", flush=True)
            print(f"   load (1 min) {load0:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": info, "end_load_1min": os.getloadavg()[0], "rows": rows, "profiles": profiles},
                      f, indent=1)


if __name__ == "__main__":
    main()
