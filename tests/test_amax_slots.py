"""Fused amax slots: ``amax_out = max(amax_out, amax(x))`` with slots compared as signed int32 bit patterns,
and atomic among threads sharing one slot (the GPU's atomicMax semantics, on the CPU)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import fp8core
from conftest import requires_gpu
from fp8core import Format


def _f32(bits: int) -> np.ndarray:
    return np.array([bits], np.uint32).view(np.float32)


@pytest.mark.parametrize("slot_bits,name", [
    (0x80000000, "-0.0"), (0xC0A00000, "-5.0"), (0xFF800000, "-inf"), (0xFFC00000, "negative NaN"),
    (0x80000001, "negative subnormal"), (0x00000000, "+0.0"),
])
def test_a_slot_below_the_amax_takes_it(slot_bits, name):
    x = np.array([1.5, -3.0, 0.25], np.float32)
    for run in (lambda s: fp8core.quantize(x, 1.0, Format.E4M3, amax_out=s),
                lambda s: fp8core.cast_transpose(x.reshape(1, 3), 1.0, Format.E4M3, amax_out=s)):
        slot = _f32(slot_bits)
        run(slot)
        assert slot.view(np.uint32)[0] == 0x40400000, name  # 3.0


def test_multi_amax_slots_holding_negatives_take_the_amax():
    out = np.array([-0.0, -7.0, 2.0], np.float32)
    xs = [np.array([1.0, -2.0], np.float32), np.array([0.5], np.float32), np.array([1.0], np.float32)]
    fp8core.multi_amax(xs, out)
    assert out.tolist() == [2.0, 0.5, 2.0]


@pytest.mark.parametrize("slot_bits,expect", [
    (0x7FFFFFFF, 0x7FFFFFFF),  # NaN (canonical) ranks above inf and stays
    (0x7FC00000, 0x7FC00000),  # any positive NaN pattern ranks above inf
    (0x7F800000, 0x7F800000),  # inf stays
    (0x40800000, 0x40800000),  # 4.0 > 3.0 stays
    (0x3F800000, 0x40400000),  # 1.0 < 3.0 is replaced
])
def test_slots_at_or_above_the_amax_keep_their_value(slot_bits, expect):
    slot = _f32(slot_bits)
    fp8core.quantize(np.array([3.0, -1.0], np.float32), 1.0, Format.E5M2, amax_out=slot)
    assert slot.view(np.uint32)[0] == expect


def test_a_nan_amax_replaces_inf_and_negatives():
    for start in (0x7F800000, 0x80000000, 0xFFC00000):
        slot = _f32(start)
        fp8core.quantize(np.array([1.0, np.nan], np.float32), 1.0, Format.E4M3, amax_out=slot)
        assert slot.view(np.uint32)[0] == 0x7FFFFFFF


def test_eight_threads_sharing_one_slot_never_lose_the_max():
    """Each round, eight threads fuse amaxes 1..8 into one zeroed slot at once; the slot must end at 8.

    A tiny switch interval makes the interpreter change threads between any two bytecodes, so an unguarded
    read-modify-write loses the max within a few rounds."""
    threads, rounds = 8, 1000
    xs = [np.full(64, -(i + 1.0), np.float32) for i in range(threads)]
    slot = np.zeros(1, np.float32)
    barrier = threading.Barrier(threads)
    lost: list[tuple[int, float]] = []

    def work(i: int) -> None:
        for r in range(rounds):
            barrier.wait()
            fp8core.quantize(xs[i], 1.0, Format.E4M3, amax_out=slot)
            fp8core.amax(xs[i])  # more switching between the fused updates
            if barrier.wait() == 0:
                if slot[0] != threads:
                    lost.append((r, float(slot[0])))
                slot[0] = -0.0  # negative zero: the next round must still take every amax
            barrier.wait()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not lost, f"lost the max in {len(lost)} of {rounds} rounds, e.g. {lost[:3]}"


SLOT_CASES = [0x80000000, 0xC0A00000, 0xFF800000, 0xFFC00000, 0x80000001, 0x00000000, 0x7FFFFFFF, 0x7FC00000,
              0x7F800000, 0x40800000, 0x3F800000]


@requires_gpu
@pytest.mark.parametrize("slot_bits", SLOT_CASES, ids=[hex(b) for b in SLOT_CASES])
def test_gpu_slots_follow_the_same_signed_rule(slot_bits):
    """The GPU's atomicMax must rank slots as the CPU does (signed int32 of the bit patterns)."""
    import cupy

    x = np.array([1.5, -3.0, 0.25, np.float32(2.0 ** -140)], np.float32)
    want = _f32(slot_bits)
    fp8core.quantize(x, 1.0, Format.E4M3, amax_out=want)
    slot = cupy.asarray(_f32(slot_bits))
    fp8core.quantize(cupy.asarray(x), 1.0, Format.E4M3, amax_out=slot)
    assert int(slot.view(cupy.uint32).get()[0]) == int(want.view(np.uint32)[0])
    out = cupy.asarray(np.concatenate([_f32(slot_bits), _f32(slot_bits)]))
    fp8core.multi_amax([cupy.asarray(x), cupy.asarray(x[:1])], out)
    want2 = np.concatenate([_f32(slot_bits), _f32(slot_bits)])
    fp8core.multi_amax([x, x[:1]], want2)
    assert out.view(cupy.uint32).get().tolist() == want2.view(np.uint32).tolist()


def _slot_doors():
    """(door, run(slot)) for every argument a call accumulates an amax into: one rule, fp8core.args.f32_slots."""
    x = np.array([1.5, -3.0, 0.25, 2.0], np.float32)
    q = fp8core.quantize(np.ones((16, 16), np.float32), 1.0, Format.E4M3)
    return [
        ("quantize amax_out", 1, lambda s: fp8core.quantize(x, 1.0, Format.E4M3, amax_out=s), "amax_out"),
        ("cast_transpose amax_out", 1, lambda s: fp8core.cast_transpose(x.reshape(2, 2), 1.0, amax_out=s),
         "amax_out"),
        ("gemm out_amax", 1, lambda s: fp8core.gemm(q, q, 1.0, 1.0, out_dtype=Format.E4M3, out_scale=1.0,
                                                    out_amax=s), "out_amax"),
        ("multi_amax out", 2, lambda s: fp8core.multi_amax([x, x], s), "out"),
        ("multi_quantize amax_out", 2, lambda s: fp8core.multi_quantize([x, x], np.ones(2, np.float32), "e4m3",
                                                                         amax_out=s), "amax_out"),
    ]


@pytest.mark.parametrize("door,n,run,arg", _slot_doors(), ids=[d[0] for d in _slot_doors()])
def test_every_amax_slot_is_checked_by_one_rule(door, n, run, arg):
    """float64, the wrong element count and read-only memory are refused naming the argument, nothing written;
    the good slot takes the amax."""
    size = r"1 element, got shape \(2,\)" if n == 1 else f"{n} elements, got 3"
    readonly = np.zeros(n, np.float32)
    readonly.flags.writeable = False
    for bad, exc, match in ((np.zeros(n), TypeError, f"^{arg}: expected float32, got float64"),
                            (np.zeros(n + 1 if n > 1 else 2, np.float32), ValueError, f"^{arg}: expected {size}"),
                            (readonly, ValueError, f"^{arg}: is read-only")):
        before = bad.copy()
        with pytest.raises(exc, match=match):
            run(bad)
        np.testing.assert_array_equal(bad, before)
    good = np.zeros(n, np.float32)
    run(good)
    assert good.max() > 0
