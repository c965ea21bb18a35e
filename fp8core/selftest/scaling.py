"""Checks of scaling: current scaling, the scale rule, the batched delayed-scaling update, and the multi-tensor
amax and quantize that feed it."""

from __future__ import annotations

from typing import Any

import numpy as np

import fp8core
from fp8core import Format, _oracle

from .harness import BF16, F16, FORMATS, HIGH, ORACLE_MAX, Recorder, Target, check, f32, name_of, sample


@check("quantize_dynamic: current scaling, both algorithms of the grid", covers=("quantize_dynamic",))
def _dynamic(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    sizes = (0, 1, 37, 4099, 1 << 17) + (() if quick else (1 << 22, (1 << 22) + 5))
    options = ((0, False, 0.0), (2, True, 0.0), (-3, False, 1e3))
    for dtype in HIGH:
        for n in sizes:
            for fmt in FORMATS:
                for margin, pow2, eps in options[:1] if n > ORACLE_MAX else options:
                    x = sample(rng, (n,), dtype, specials=False)
                    if n > 9:
                        x[n // 2] = -1e4 if dtype != F16 else -6e4
                    label = f"{name_of(dtype)} ({n},) {fmt.name} margin {margin} pow2 {pow2} eps {eps:g}"
                    with t.ref():
                        q_ref, si_ref, a_ref = fp8core.quantize_dynamic(x, fmt, margin=margin, power_of_2=pow2,
                                                                        epsilon=eps)
                    amax = np.abs(x.astype(np.float32)).max() if n else np.float32(0)
                    s, s_inv, _ = _oracle.scale_rule(amax, fmt.max, margin, pow2, eps)
                    r.equal(f"{label} scale_inv vs oracle", f32([s_inv]), si_ref)
                    if n <= ORACLE_MAX:
                        r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), s, fmt.value),
                                q_ref, x)
                    with t.dut():
                        q, si, a = fp8core.quantize_dynamic(t.put(x), fmt, margin=margin, power_of_2=pow2,
                                                            epsilon=eps)
                    r.equal(label, q_ref, q, x)
                    r.equal(f"{label} scale_inv", si_ref, si)
                    r.equal(f"{label} amax", a_ref, a)
    for dtype in HIGH:  # no scale (all zeros, a NaN, an inf) gives scale 1; a reduce hook doubles amax
        for fill in (0.0, np.nan, np.inf):
            x = sample(rng, (4099,), dtype, specials=False)
            if fill == 0.0:
                x[:] = 0
            else:
                x[7] = fill
            _dynamic_parts(t, r, f"{name_of(dtype)} with {fill}", x, Format.E4M3)

        def double(a: Any) -> None:
            a *= 2

        x = sample(rng, (4099,), dtype, specials=False)
        _dynamic_parts(t, r, f"{name_of(dtype)} with reduce", x, Format.E5M2, margin=1, reduce=double)


def _dynamic_parts(t: Target, r: Recorder, label: str, x: np.ndarray, fmt: Format, **kw: Any) -> None:
    with t.ref():
        ref = fp8core.quantize_dynamic(x, fmt, **kw)
    with t.dut():
        got = fp8core.quantize_dynamic(t.put(x), fmt, **kw)
    for part, e, g in zip(("q", "scale_inv", "amax"), ref, got):
        r.equal(f"{label} ({part})", e, g)


_AMAX_VALUES = np.array([0.0, -0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-6, 0.5, 1.0, 3.0, 448.0, 57344.0, 1e30, 3e38,
                         np.inf, np.nan], np.float32)


@check("compute_scale: the scale rule on special amax values", covers=("compute_scale",))
def _compute_scale(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    a = _AMAX_VALUES
    for fmt in FORMATS:
        for margin, pow2, eps in ((0, False, 0.0), (1, True, 0.0), (-130, False, 0.0), (130, True, 0.0),
                                  (0, False, 1e-3)):
            for previous in (None, 2.0, "vector"):
                prev = f32(np.arange(1, a.size + 1)) if previous == "vector" else previous
                label = f"{fmt.name} margin {margin} pow2 {pow2} eps {eps:g} previous {previous}"
                with t.ref():
                    s_ref, si_ref = fp8core.compute_scale(a, fmt, margin=margin, power_of_2=pow2, epsilon=eps,
                                                          previous=prev)
                rule = [_oracle.scale_rule(v, fmt.max, margin, pow2, eps) for v in a]
                p = np.broadcast_to(np.float32(1) if prev is None else f32(prev), a.shape)
                with np.errstate(divide="ignore"):
                    s_or = f32([s if ok or previous is None else p[i] for i, (s, _, ok) in enumerate(rule)])
                    si_or = f32([si if ok or previous is None else 1 / p[i] for i, (_, si, ok) in enumerate(rule)])
                r.equal(f"{label} vs oracle (scale)", s_or, s_ref, a)
                r.equal(f"{label} vs oracle (scale_inv)", si_or, si_ref, a)
                pd = t.put(prev) if isinstance(prev, np.ndarray) else prev
                with t.dut():
                    s, si = fp8core.compute_scale(t.put(a), fmt, margin=margin, power_of_2=pow2, epsilon=eps,
                                                  previous=pd)
                r.equal(f"{label} (scale)", s_ref, s, a)
                r.equal(f"{label} (scale_inv)", si_ref, si, a)


def _history(rng: np.random.Generator, L: int, n: int) -> np.ndarray:
    H = rng.uniform(0, 100, size=(L, n)).astype(np.float32)
    H[:, ::11] *= np.float32(1e-39)  # subnormal amaxes
    H[0, ::7] = 0  # did not run this step
    H[0, 3], H[0, 5], H[0, 6] = np.nan, np.inf, 1e-45
    if L > 2:
        H[L // 2, 9] = np.nan  # a NaN deep in the history: "max" keeps the previous scale while it lasts
    return H


@check("batched update: both algorithms, did-not-run, NaN, interval, callable", covers=("update", "scale_rule"))
def _update(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    n = 300 if quick else 1000
    formats = [FORMATS[i % len(FORMATS)] for i in range(n)]
    for algo in ("max", "most_recent"):
        for L in ((1, 2, 31) if quick else (1, 2, 31, 1024)):
            for interval, margin, pow2 in ((1, 0, False), (2, 1, True)):
                recipe = fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo=algo, interval=interval,
                                                margin=margin, power_of_2=pow2)
                H = _history(rng, L, n)
                ref = fp8core.ScalingState(n, recipe, formats)
                dut = fp8core.ScalingState(n, recipe, formats, device=t.state_device())
                ref.amax_history[...] = H
                dut.amax_history[...] = fp8core.backends.for_device(dut.device).xp.asarray(H)
                H_or, s_or, si_or = H.copy(), f32(np.ones(n)), f32(np.ones(n))
                maxes = f32([f.max for f in formats])
                for step in range(3):
                    flags_or = _oracle.update(H_or, s_or, si_or, maxes, margin, algo, pow2, 0.0,
                                              step % interval == 0)
                    with t.ref():
                        ref.update()
                    with t.dut():
                        dut.update()
                    label = f"{algo} L={L} interval {interval} margin {margin} pow2 {pow2} step {step}"
                    r.equal(f"{label} vs oracle", np.concatenate([H_or.reshape(-1), s_or, si_or]), ref.buffer)
                    r.equal(f"{label} flags vs oracle", flags_or, ref.non_finite)
                    r.equal(label, ref.buffer, dut.buffer)
                    r.equal(f"{label} flags", ref.non_finite, dut.non_finite)
                    fresh = rng.uniform(0, 10, n).astype(np.float32)
                    fresh[::5] = 0
                    ref.amax_history[0] = fresh
                    dut.amax_history[0] = fp8core.backends.for_device(dut.device).xp.asarray(fresh)
                    H_or[0] = fresh
    recipe = fp8core.DelayedScaling(amax_history_len=8, amax_compute_algo=lambda h: h.max(axis=0) / 2)
    ref = fp8core.ScalingState(n, recipe)
    dut = fp8core.ScalingState(n, recipe, device=t.state_device())
    H = _history(rng, 8, n)
    ref.amax_history[...] = H
    dut.amax_history[...] = fp8core.backends.for_device(dut.device).xp.asarray(H)
    for step in range(2):
        with t.ref():
            ref.update()
        with t.dut():
            dut.update()
        r.equal(f"callable amax_compute_algo step {step}", ref.buffer, dut.buffer)


@check("multi_amax and multi_quantize: mixed dtypes, formats, empty members", covers=("multi_amax",
                                                                                      "multi_quantize"))
def _multi(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    sizes = (5, 0, 4096, 100003, 1, 65537) + (() if quick else (1 << 21,))
    for mixed in (False, True):
        dtypes = [HIGH[i % 3] if mixed else BF16 for i in range(len(sizes))]
        fmts = [FORMATS[i % len(FORMATS)] if mixed else Format.E4M3 for i in range(len(sizes))]
        xs = [sample(rng, (n,), d) for n, d in zip(sizes, dtypes)]
        xds = [t.put(x, i % 2) for i, x in enumerate(xs)]
        label = f"{len(xs)} tensors{' of mixed dtypes and formats' if mixed else ''}"
        start = f32(np.linspace(0, 100, len(xs)))  # out accumulates: max(out, amax)
        with t.ref():
            out_ref = start.copy()
            fp8core.multi_amax(xs, out_ref)
            singles = np.concatenate([fp8core.amax(x) for x in xs])
        r.truth(f"multi_amax {label} is max(out, amax) of each",
                np.array_equal(out_ref.view(np.uint32), np.maximum(start.view(np.uint32), singles.view(np.uint32))))
        out = t.put(start)
        with t.dut():
            fp8core.multi_amax(xds, out)
        r.equal(f"multi_amax {label}", out_ref, out)
        scales = f32(2.0 ** rng.integers(-8, 8, len(xs)))
        with t.ref():
            amax_ref = f32(np.zeros(len(xs)))
            qs_ref = fp8core.multi_quantize(xs, scales, fmts, amax_out=amax_ref)
            singles = [fp8core.quantize(x, float(s), f) for x, s, f in zip(xs, scales, fmts)]
        for i, (a, b) in enumerate(zip(qs_ref, singles)):
            r.equal(f"multi_quantize {label}: tensor {i} is quantize()", b, a)
        amax_out = t.put(f32(np.zeros(len(xs))))
        with t.dut():
            qs = fp8core.multi_quantize(xds, t.put(scales), fmts, amax_out=amax_out)
        for i, (e, g) in enumerate(zip(qs_ref, qs)):
            r.equal(f"multi_quantize {label}: tensor {i} ({sizes[i]} {name_of(dtypes[i])} -> {fmts[i].name})", e, g,
                    xs[i])
        r.equal(f"multi_quantize {label} amax_out", amax_ref, amax_out)
