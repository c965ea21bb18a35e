"""Checks of FP4 (fp8core.fp4): NVFP4 and MXFP4 quantize and dequantize by bits against the CPU reference, the
E2M1 ties and Philox's known answer against values written from the contract, the GEMM's scale layout and NVFP4's
alpha by bits, and the FP4 GEMM (cuBLASLt, compute capability 10.x-12.x) against the CPU emulation."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import formats
from fp8core._views import logical_numpy_dtype
from .blocks import gemm_scale_oracle
from .gemm import gemm_unavailable
from .harness import HIGH, CpuTarget, CudaTarget, Recorder, Target, check, name_of, sample

E2M1 = formats.E2M1
SHAPES = ((16, 32), (17, 48), (48, 64), (0, 32))
FULL_SHAPES = SHAPES + ((256, 512),)
# E2M1's midpoints and their negatives under a block amax of 6 and G = 2688 (block scale 1, multiplier 1): each
# reaches the cast exactly and goes to the even code
TIES = (6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0)
TIE_CODES = (0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0x8)
# Philox4x32-10 of counter 0, key 0 (Random123's known answer): block 0's random bytes with seed = offset = 0
PHILOX_ZERO = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
NVFP4_OPTIONS = ({}, {"weight_2d": True}, {"hadamard": True}, {"rounding": "stochastic", "seed": 3, "offset": 5},
                 {"hadamard": True, "rounding": "stochastic", "seed": 2 ** 40}, {"global_amax": 1000.0})
# stochastic rounding's (seed, offset) held in the target's memory, as fp8core.torch (int64 [2]) and fp8core.jax
# (uint32 [4]) hold it; + 1 carries into the offset's high word
RNG_SEED, RNG_OFFSET = 2 ** 63 + 9, 2 ** 32 - 1
RNG_STATES = (np.array([RNG_SEED, RNG_OFFSET], np.uint64).view(np.int64),
              np.array([RNG_SEED & 0xFFFFFFFF, RNG_SEED >> 32, RNG_OFFSET & 0xFFFFFFFF, RNG_OFFSET >> 32], np.uint32))


def _backend(t: Target) -> Any:
    """The FP4 backend module under test, looked up at each call (the coverage wraps its attributes)."""
    import importlib

    return importlib.import_module(f"fp8core.backends.{t.backend_name}_fp4")


def _inputs(rng: np.random.Generator, quick: bool) -> Any:
    for dtype in HIGH:
        for shape in SHAPES if quick else FULL_SHAPES:
            yield f"{name_of(dtype)} {shape}", sample(rng, shape, dtype)
            yield f"{name_of(dtype)} {shape} finite", sample(rng, shape, dtype, specials=False)


def _equal_parts(r: Recorder, name: str, ref: tuple, got: tuple, x: np.ndarray) -> None:
    for part, a, b in zip(("data", "scale", "global_amax"), ref, got):
        r.equal(f"{name} ({part})", a, b, x if part == "data" else None)


def _equal_quantized(t: Target, r: Recorder, name: str, quantize: Any, dequantize: Any, x: np.ndarray,
                     offset: int) -> None:
    """quantize(x) on the target against the reference by parts, then dequantize of each to every output dtype."""
    with t.ref():
        ref = quantize(x)
    with t.dut():
        got = quantize(t.put(x, offset))
    _equal_parts(r, name, ref, got, x)
    for out in ("float32", "bfloat16", "float16"):
        with t.ref():
            y_ref = dequantize(ref, out)
        with t.dut():
            y = dequantize(got, out)
        r.equal(f"{name} dequantized to {out}", y_ref, y)


@check("fp4: NVFP4 quantize (rowwise, columnwise, 16x16 tiles, Hadamard, stochastic by value and from memory) and "
       "dequantize",
       covers=("fp4.quantize_nvfp4", "fp4.dequantize_nvfp4"))
def _nvfp4(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import fp4

    with t.ref():
        tie = fp4.quantize_nvfp4(np.array([TIES], np.float32), global_amax=2688.0)
    r.equal("E2M1 ties at every midpoint vs the contract", E2M1.pack(np.array([TIE_CODES], np.uint8)), tie.data)
    for label, x in _inputs(rng, quick):
        for opts in NVFP4_OPTIONS:
            for columnwise in (False, True) if x.shape[0] % 16 == 0 else (False,):
                offset = 0 if columnwise else 1  # +1: a misaligned view takes the rowwise element-wise loads
                name = f"{label} {opts} {'columnwise' if columnwise else 'rowwise'} +{offset}"
                _equal_quantized(t, r, name, lambda v: fp4.quantize_nvfp4(v, columnwise=columnwise, **opts),
                                 fp4.dequantize_nvfp4, x, offset)
        with t.ref():
            ref = fp4.quantize_nvfp4(x, hadamard=True, rounding="stochastic", seed=RNG_SEED, offset=RNG_OFFSET + 1)
        for state in RNG_STATES:
            with t.dut():  # on a GPU the kernel reads the state from device memory
                got = fp4.quantize_nvfp4(t.put(x), hadamard=True, rounding="stochastic", rng_state=t.put(state),
                                         offset=1)
            _equal_parts(r, f"{label} stochastic, (seed, offset) read from {state.dtype} [{state.size}] in memory",
                         ref, got, x)


@check("fp4: MXFP4 quantize (rceil, floor, rowwise and columnwise) and dequantize",
       covers=("fp4.quantize_mxfp4", "fp4.dequantize_mxfp4"))
def _mxfp4(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import fp4

    with t.ref():
        tie = fp4.quantize_mxfp4(np.array([TIES * 2], np.float32))
    r.equal("E2M1 ties at every midpoint vs the contract", E2M1.pack(np.array([TIE_CODES * 2], np.uint8)), tie.data)
    for label, x in _inputs(rng, quick):
        if x.shape[1] % 32:
            continue
        for mode in ("rceil", "floor"):
            for columnwise in (False, True) if x.shape[0] % 32 == 0 else (False,):
                offset = 0 if columnwise else 1
                name = f"{label} {mode} {'columnwise' if columnwise else 'rowwise'} +{offset}"
                _equal_quantized(t, r, name, lambda v: fp4.quantize_mxfp4(v, rounding=mode, columnwise=columnwise),
                                 fp4.dequantize_mxfp4, x, offset)


@check("fp4: Philox4x32-10's known answer (stochastic rounding's random bytes)")
def _philox(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core.backends import cpu_fp4

    got = cpu_fp4.block_bytes(np.zeros(1, np.uint64), 0, 0).reshape(-1)
    r.equal("block 0, seed 0, offset 0", np.array(PHILOX_ZERO, "<u4").view(np.uint8), got)


@check("fp4: the scale layout of the FP4 GEMM (1x16, 16x16 tiles, 1x32 in 128x4 tiles)", covers=("fp4.gemm_scale",))
def _gemm_scale(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core._tensor import wrap

    for rows, kgroups, tiles in ((1, 1, False), (130, 6, False), (257, 3, True), (32, 4, True), (0, 4, False)):
        s = rng.integers(0, 256, (-(-rows // 16) if tiles else rows, kgroups), dtype=np.uint8)
        name = f"{'16x16 tiles' if tiles else 'blocks'} [{rows}, {kgroups}]"
        expanded = np.repeat(s, 16, axis=0)[:rows] if tiles else s
        with t.ref():
            ref = _backend(CpuTarget()).gemm_scale(wrap(s), rows)
        r.equal(f"{name} vs oracle", gemm_scale_oracle(expanded, "1x32"), ref)
        with t.dut():
            got = _backend(t).gemm_scale(wrap(t.put(s)), rows)
        r.equal(name, ref, got)


# global amaxes at the edges of the global scale rule (0, inf, NaN, subnormal, S_enc just finite) and ordinary ones
ALPHA_AMAXES = (0.0, float("inf"), float("nan"), 1e-40, 7.9e-36, 2688.0, 1.0, 3.4028235e38, 0.3, 448.0)


@check("fp4: the NVFP4 GEMM's alpha and beta as cuBLASLt reads them from the device", covers=("fp4.gemm_alpha",))
def _gemm_alpha(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core._tensor import wrap

    for ga in ALPHA_AMAXES:
        for gb in ALPHA_AMAXES:
            a, b = np.array([ga], np.float32), np.array([gb], np.float32)
            with t.ref():
                ref = _backend(CpuTarget()).gemm_alpha(wrap(a), wrap(b))
            with t.dut():
                got = _backend(t).gemm_alpha(wrap(t.put(a)), wrap(t.put(b)))
            r.equal(f"amaxes {ga}, {gb}", ref, got)


def fp4_gemm_unavailable(t: Target) -> str:
    from fp8core.backends.cublaslt import FP4_MAJORS

    if isinstance(t, CudaTarget) and t.cc // 10 not in FP4_MAJORS:
        return (f"the FP4 GEMM needs compute capability 10.x-12.x (cuBLASLt's block-scaled FP4), this GPU is "
                f"{t.cc // 10}.{t.cc % 10}")
    return gemm_unavailable(t)


# out dtype -> its relative rounding (half an ulp) on top of the fp32 accumulation's
_OUT_RTOL = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@check("fp4: the FP4 GEMM (NVFP4 1x16 and 16x16 tiles, MXFP4) against the CPU emulation, tolerance growing with K",
       needs=fp4_gemm_unavailable, covers=("fp4.gemm",))
def _fp4_gemm(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    import fp8core
    from fp8core import fp4

    shapes = ((1, 16, 32), (130, 48, 256)) + (() if quick else ((256, 128, 4096),))
    kinds = (("nvfp4", {}, fp4.quantize_nvfp4, fp4.dequantize_nvfp4),
             ("nvfp4 16x16 weight", {"weight_2d": True}, fp4.quantize_nvfp4, fp4.dequantize_nvfp4),
             ("mxfp4", {}, fp4.quantize_mxfp4, fp4.dequantize_mxfp4))
    for m, n, k in shapes:
        # rows over a few binades: D stays inside float16's range
        x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-4, 4, (m, 1))).astype(np.float32)
        w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-4, 4, (n, 1))).astype(np.float32)
        for label, w_opts, quantize, dequantize in kinds:
            a, b = quantize(x), quantize(w, **w_opts)
            # |a| . |b|^T of the dequantized operands bounds every partial sum the fp32 accumulation rounds
            magnitude = np.abs(dequantize(a).astype(np.float64)) @ np.abs(dequantize(b).astype(np.float64)).T
            for out in ("float32", "bfloat16", "float16"):
                name = f"{m}x{n}x{k} {label} -> {out}"
                with t.ref():
                    emu = fp8core.gemm(a, b, out_dtype=out)
                da, db = (type(v)(*(t.put(np.asarray(p)) for p in v), v.layout) for v in (a, b))
                with t.dut():
                    got = fp8core.gemm(da, db, out_dtype=out)
                emu64 = np.asarray(emu).astype(np.float64)
                got64 = t.bits(got).view(logical_numpy_dtype(out)).astype(np.float64).reshape(emu64.shape)
                r.close(name, emu64, got64, k * 2.0 ** -23 * magnitude + 2.0 ** -126, 2 * _OUT_RTOL[out])
