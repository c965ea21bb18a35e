"""Checks of the conversions: quantize, amax, dequantize, transpose and cast_transpose."""

from __future__ import annotations

import numpy as np

import fp8core
from fp8core import Format, _oracle
from fp8core._views import logical_numpy_dtype

from .harness import BF16, F16, FORMATS, HIGH, ORACLE_MAX, UINT, Recorder, Target, check, f32, name_of, sample


def _patterns(dtype: np.dtype) -> np.ndarray:
    return np.arange(65536, dtype=np.uint16).view(dtype)


# Scales: ordinary, odd, tiny (products go subnormal), fp32-subnormal, huge (everything saturates), FLT_MAX.
SCALES = (1.0, 3.0, 0.7, 2.0 ** -20, 2.0 ** -140, 2.0 ** 20, 3.0e38)
QUICK_SCALES = (1.0, 3.0, 2.0 ** -140, 3.0e38)
ODD_SHAPES = ((1,), (7,), (33,), (31, 33), (4097,), (3, 5, 7), (1, 65537), (257, 129))
EMPTY_SHAPES = ((0,), (0, 8), (8, 0))


@check("quantize: all 65,536 bf16 and fp16 patterns", covers=("quantize",))
def _all_patterns(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    for dtype in (BF16, F16):
        x = _patterns(dtype)
        xd = t.put(x)
        for fmt in FORMATS:
            for scale in (QUICK_SCALES if quick else SCALES):
                label = f"{name_of(dtype)} -> {fmt.name}, scale {scale:g}"
                with t.ref():
                    slot_ref = f32([0.0])
                    ref = fp8core.quantize(x, scale, fmt, amax_out=slot_ref)
                r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), scale, fmt.value),
                        ref, x)
                slot = t.put(f32([0.0]))
                with t.dut():
                    got = fp8core.quantize(xd, t.put(f32([scale])), fmt, amax_out=slot)
                r.equal(label, ref, got, x)
                r.equal(f"{label} fused amax", slot_ref, slot)


@check("quantize: float32 bit patterns", covers=("quantize",))
def _f32_patterns(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    n = 1 << (16 if quick else 20)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    specials = [0x0, 0x80000000, 0x1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F7FFFFF,
                0x43E00000, 0x43E80000, 0x43F00000, 0x3B000000, 0x3A800000, 0x47600000, 0x47700000]
    bits[:len(specials)] = specials
    x = bits.view(np.float32)
    xd = t.put(x)
    for fmt in FORMATS:
        for scale in (1.0, 2.0 ** -20, 2.0 ** 20):
            with t.ref():
                ref = fp8core.quantize(x, scale, fmt)
            r.equal(f"float32 -> {fmt.name}, scale {scale:g} vs oracle",
                    _oracle.quantize_bits(x, scale, fmt.value), ref, x)
            with t.dut():
                got = fp8core.quantize(xd, scale, fmt)
            r.equal(f"float32 -> {fmt.name}, scale {scale:g}", ref, got, x)


@check("amax and quantize: odd shapes, misaligned views, empty tensors", covers=("amax", "quantize"))
def _shapes(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    shapes = ODD_SHAPES[:5] if quick else ODD_SHAPES
    for dtype in HIGH:
        for shape in shapes + EMPTY_SHAPES:
            for offset in (0, 1, 3):
                x = sample(rng, shape, dtype)
                xd = t.put(x, offset)
                label = f"{name_of(dtype)} {shape} +{offset}"
                with t.ref():
                    a_ref = fp8core.amax(x)
                with t.dut():
                    r.equal(f"amax {label}", a_ref, fp8core.amax(xd))
                for fmt in FORMATS:
                    with t.ref():
                        slot_ref = f32([0.5])  # accumulates: max(0.5, amax)
                        ref = fp8core.quantize(x, 0.75, fmt, amax_out=slot_ref)
                    slot = t.put(f32([0.5]))
                    with t.dut():
                        got = fp8core.quantize(xd, t.put(f32([0.75])), fmt, amax_out=slot)
                    r.equal(f"quantize {label} -> {fmt.name}", ref, got, x)
                    r.equal(f"quantize {label} -> {fmt.name} fused amax", slot_ref, slot)
    n = 1 << (18 if quick else 22)  # large enough for the table path and many blocks
    for dtype in HIGH:
        x = sample(rng, (n,), dtype)
        with t.ref():
            ref, a_ref = fp8core.quantize(x, 2.0, Format.E4M3), fp8core.amax(x)
        xd = t.put(x, 1)
        with t.dut():
            r.equal(f"quantize {name_of(dtype)} ({n},) +1", ref, fp8core.quantize(xd, 2.0, Format.E4M3), x)
            r.equal(f"amax {name_of(dtype)} ({n},) +1", a_ref, fp8core.amax(xd))
    for dtype in HIGH:  # amax of all-NaN-free data whose max is a subnormal, and of -0 only
        for values in ([1e-45, -1e-44, 0.0], [-0.0, -0.0]):
            x = np.array(values, np.float32).astype(dtype)
            with t.ref():
                a_ref = fp8core.amax(x)
            with t.dut():
                r.equal(f"amax {name_of(dtype)} {values}", a_ref, fp8core.amax(t.put(x)))


def dequantize_oracle(codes: np.ndarray, fmt: Format, scale_inv: float, out: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        y = (_oracle.decode(fmt.value)[codes].astype(np.float32) * np.float32(scale_inv)).astype(np.float32)
        o = y.astype(logical_numpy_dtype(out))
    o.view(UINT[o.dtype.itemsize])[np.isnan(y)] = 0x7FFFFFFF if out == "float32" else 0x7FFF
    return o


@check("dequantize: every code to every output dtype", covers=("dequantize",))
def _dequantize(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    codes = np.arange(256, dtype=np.uint8)
    for fmt in FORMATS:
        q = codes.view(fmt.numpy_dtype)
        for out in ("float32", "bfloat16", "float16"):
            for scale_inv in (1.0, 3.0, 2.0 ** -10, 2.0 ** -130, 2.0 ** 100):
                label = f"{fmt.name} -> {out}, scale_inv {scale_inv:g}"
                with t.ref():
                    ref = fp8core.dequantize(q, scale_inv, out)
                r.equal(f"{label} vs oracle", dequantize_oracle(codes, fmt, scale_inv, out), ref, codes)
                with t.dut():
                    r.equal(label, ref, fp8core.dequantize(t.put(q), t.put(f32([scale_inv])), out), codes)
        for shape in ((7,), (31, 33), (4097,)) + EMPTY_SHAPES:
            for offset in (0, 1):
                q = rng.integers(0, 256, shape, dtype=np.uint8).view(fmt.numpy_dtype)
                with t.ref():
                    ref = fp8core.dequantize(q, 0.5, "bfloat16")
                with t.dut():
                    r.equal(f"{fmt.name} {shape} +{offset} -> bfloat16", ref,
                            fp8core.dequantize(t.put(q, offset), 0.5, "bfloat16"))


@check("transpose and cast_transpose: odd shapes, misaligned, empty", covers=("transpose", "cast_transpose"))
def _transposes(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    shapes = ((1, 1), (1, 65), (63, 65), (64, 64), (129, 257), (4097, 3), (0, 8), (8, 0))
    if not quick:
        shapes += ((1000, 1000), (2049, 1537))
    for shape in shapes:
        for fmt in FORMATS:
            q = rng.integers(0, 256, shape, dtype=np.uint8).view(fmt.numpy_dtype)
            with t.ref():
                ref = fp8core.transpose(q)
            r.truth(f"transpose {shape} is .T", np.array_equal(ref.view(np.uint8), q.view(np.uint8).T))
            with t.dut():
                r.equal(f"transpose {fmt.name} {shape}", ref, fp8core.transpose(t.put(q, 1)))
        for dtype in HIGH:
            for fmt in FORMATS:
                x = sample(rng, shape, dtype)
                label = f"cast_transpose {name_of(dtype)} {shape} -> {fmt.name}"
                with t.ref():
                    slot_ref = f32([0.0])
                    q_ref, qt_ref = fp8core.cast_transpose(x, 0.75, fmt, amax_out=slot_ref)
                if x.size <= ORACLE_MAX:
                    r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), 0.75, fmt.value),
                            q_ref, x)
                r.truth(f"{label}: q_t is q.T", np.array_equal(qt_ref.view(np.uint8), q_ref.view(np.uint8).T))
                slot = t.put(f32([0.0]))
                with t.dut():
                    q, qt = fp8core.cast_transpose(t.put(x, 1), t.put(f32([0.75])), fmt, amax_out=slot)
                r.equal(label, q_ref, q, x)
                r.equal(f"{label} (q_t)", qt_ref, qt)
                r.equal(f"{label} fused amax", slot_ref, slot)
