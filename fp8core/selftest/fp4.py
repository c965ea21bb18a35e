"""Checks of FP4 (fp8core.fp4): NVFP4 and MXFP4 quantize and dequantize by bits against the CPU reference, the
E2M1 ties and Philox's known answer against values written from the contract, and the GEMM's scale layout."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import formats
from .blocks import gemm_scale_oracle
from .harness import HIGH, CpuTarget, Recorder, Target, check, name_of, sample

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


@check("fp4: NVFP4 quantize (rowwise, columnwise, 16x16 tiles, Hadamard, stochastic) and dequantize",
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
                with t.ref():
                    ref = fp4.quantize_nvfp4(x, columnwise=columnwise, **opts)
                with t.dut():
                    got = fp4.quantize_nvfp4(t.put(x, offset), columnwise=columnwise, **opts)
                _equal_parts(r, name, ref, got, x)
                for out in ("float32", "bfloat16", "float16"):
                    with t.ref():
                        y_ref = fp4.dequantize_nvfp4(ref, out)
                    with t.dut():
                        y = fp4.dequantize_nvfp4(got, out)
                    r.equal(f"{name} dequantized to {out}", y_ref, y)


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
                with t.ref():
                    ref = fp4.quantize_mxfp4(x, rounding=mode, columnwise=columnwise)
                with t.dut():
                    got = fp4.quantize_mxfp4(t.put(x, offset), rounding=mode, columnwise=columnwise)
                _equal_parts(r, name, ref, got, x)
                for out in ("float32", "bfloat16", "float16"):
                    with t.ref():
                        y_ref = fp4.dequantize_mxfp4(ref, out)
                    with t.dut():
                        y = fp4.dequantize_mxfp4(got, out)
                    r.equal(f"{name} dequantized to {out}", y_ref, y)


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
