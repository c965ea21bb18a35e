"""The check of the per-tensor-scaled FP8 GEMM."""

from __future__ import annotations

import numpy as np

import fp8core
from fp8core import Format, _oracle
from fp8core._views import logical_numpy_dtype
from fp8core.extras import install_hint

from .harness import CudaTarget, Recorder, Target, check, f32


def gemm_unavailable(t: Target) -> str:
    if not isinstance(t, CudaTarget):
        return ""
    if t.cc < 89:
        return f"the FP8 GEMM needs compute capability 8.9+, this GPU is {t.cc // 10}.{t.cc % 10}"
    try:
        import nvmath.bindings.cublasLt  # noqa: F401
    except ImportError:
        return f"nvmath-python is not installed ({install_hint('gemm')})"
    return ""


def _codes(rng: np.random.Generator, shape: tuple[int, int], fmt: Format) -> np.ndarray:
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)
    return _oracle.encode(x, fmt.value)


@check("gemm: against the CPU emulation and float64, tolerance growing with K", needs=gemm_unavailable,
       covers=("gemm",))
def _gemm(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    pairs = ((Format.E4M3, Format.E4M3), (Format.E4M3, Format.E5M2), (Format.E5M2, Format.E4M3))
    shapes = ((1, 16, 16), (7, 32, 64), (130, 48, 1024)) + (() if quick else ((64, 128, 8192), (0, 16, 32)))
    fast_modes = (False, True) if isinstance(t, CudaTarget) else (False,)
    for m, n, k in shapes:
        for fa, fb in pairs:
            outs = ["float32", "bfloat16", "float16", "float8_e4m3fn"] + (["float8_e5m2"] if Format.E5M2 in (fa, fb)
                                                                          else [])
            ac, bc = _codes(rng, (m, k), fa), _codes(rng, (n, k), fb)
            a, b = ac.view(fa.numpy_dtype), bc.view(fb.numpy_dtype)
            sa, sb = 0.5, 0.25
            exact = _oracle.gemm_reference(ac, fa.value, bc, fb.value, sa, sb)
            for out in outs:
                fp8_out = out.startswith("float8")
                out_scale = 4.0 if fp8_out else None
                bias_dtype = "bfloat16" if out != "float16" else "float16"
                bias = (rng.standard_normal(n) * 4).astype(logical_numpy_dtype(bias_dtype)) if m % 2 else None
                ref64 = exact if bias is None else exact + bias.astype(np.float64)
                fmax = fp8core.as_format(out).max if fp8_out else None
                want = np.clip(ref64 * out_scale, -fmax, fmax) if fp8_out else ref64
                label = f"{m}x{n}x{k} {fa.name}x{fb.name} -> {out}{' +bias' if bias is not None else ''}"
                with t.ref():
                    amax_ref = f32([0.0]) if fp8_out else None
                    emu = fp8core.gemm(a, b, sa, sb, out_dtype=out, bias=bias, out_scale=out_scale,
                                       out_amax=amax_ref)
                emu64 = emu.astype(np.float64)
                exact_atol, exact_rtol = _oracle.gemm_tolerance(ac, fa.value, bc, fb.value, sa * sb, out,
                                                                out_scale or 1.0)
                r.close(f"{label}: emulation vs float64", want, emu64, exact_atol, exact_rtol)
                for fast in fast_modes:
                    atol, rtol = _oracle.gemm_tolerance(ac, fa.value, bc, fb.value, sa * sb, out, out_scale or 1.0,
                                                        tensor_core=isinstance(t, CudaTarget), fast_accum=fast)
                    label_fast = label + (" fast accum" if fast else "")
                    amax_d = t.put(f32([0.0])) if fp8_out else None
                    bias_d = t.put(bias) if bias is not None else None
                    with t.dut():
                        got = fp8core.gemm(t.put(a), t.put(b), t.put(f32([sa])), t.put(f32([sb])),
                                           out_dtype=out, bias=bias_d, use_fast_accum=fast,
                                           out_scale=None if out_scale is None else t.put(f32([out_scale])),
                                           out_amax=amax_d)
                    got64 = t.bits(got).view(logical_numpy_dtype(out)).astype(np.float64).reshape(want.shape)
                    r.close(f"{label_fast}: vs float64", want, got64, atol, rtol)
                    r.close(f"{label_fast}: vs the emulation", emu64, got64, 2 * atol, 2 * rtol)
                    if fp8_out and m:
                        got_amax = t.bits(amax_d).view(np.float32).astype(np.float64)
                        r.close(f"{label_fast}: out_amax", amax_ref.astype(np.float64), got_amax,
                                2 * atol.max() + 2.0 ** -22 * np.abs(ref64).max(), 0.0)
