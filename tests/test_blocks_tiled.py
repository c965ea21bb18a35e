"""The CPU block paths work tile by tile: the same bits as the whole-array implementation they replaced
(tests/blocks_unchunked.py), and peak memory within 2x their input plus output whatever the shape."""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest

import blocks_unchunked as twin
from fp8core._tensor import wrap
from fp8core.backends import cpu_blocks
from fp8core.declarations import PRIMITIVES
from fp8core.formats import ENCODINGS, Format
from fp8core.layouts import Layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
try:
    from bench_blocks import memory_rows
finally:
    sys.path.pop(0)

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e-40, -1e-45, -0.0, 3e38, 6e4, 2.0 ** -20], np.float32)


def hostile(shape: tuple[int, int], dtype, rng, spread: float = 30.0) -> np.ndarray:
    """Values over 2^+-spread, with NaN, +-inf, subnormals and -0 scattered in."""
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-spread, spread, shape)).astype(np.float32)
    flat = x.reshape(-1)
    k = min(flat.size, SPECIALS.size)
    flat[rng.choice(flat.size, k, replace=False)] = SPECIALS[:k]
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def u8(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def outs(name: str, x: np.ndarray, *options) -> tuple[np.ndarray, ...]:
    """The backend's out arrays, as the core allocates them: from the declaration's rule."""
    return tuple(np.empty(s.shape, s.dtype) for s in PRIMITIVES[name].results((x.shape, x.dtype.name), *options))


def check_every_path(x: np.ndarray, fmts=tuple(ENCODINGS), columnwise=(False, True), brs=(1, 128)):
    w = wrap(x)
    for fmt in fmts:
        for cw in columnwise:
            for mode in ("rceil", "floor"):
                layout = Layout.MX_COLUMNWISE if cw else Layout.MX_ROWWISE
                got = cpu_blocks.quantize_mxfp8(w, fmt.encoding, mode, layout,
                                                outs("quantize_mxfp8", x, fmt.encoding, mode, cw))
                want = twin.quantize_mxfp8(x, fmt, mode, cw)
                for g, e in zip(got, want):
                    np.testing.assert_array_equal(u8(g), u8(e), err_msg=f"mxfp8 {fmt} {mode} columnwise={cw}")
            for out in ("float32", "bfloat16", "float16"):
                np.testing.assert_array_equal(
                    u8(cpu_blocks.dequantize_blocks(wrap(got[0]), wrap(got[1]), fmt.encoding, layout, out)),
                    u8(twin.dequantize_mxfp8(got[0], got[1], cw, out)), err_msg=f"dequantize_mxfp8 {out}")
        for br in brs:
            for pow2 in (True, False):
                layout = Layout.BLOCK_1X128 if br == 1 else Layout.BLOCK_128X128
                got = cpu_blocks.quantize_blockwise(w, fmt.encoding, layout, pow2, 1e-30,
                                                    outs("quantize_blockwise", x, fmt.encoding, layout, pow2, 1e-30))
                want = twin.quantize_blockwise(x, fmt, br, pow2, 1e-30)
                for g, e in zip(got, want):
                    np.testing.assert_array_equal(u8(g), u8(e), err_msg=f"blockwise {fmt} {br}x128 pow2={pow2}")
            for out in ("float32", "bfloat16"):
                np.testing.assert_array_equal(
                    u8(cpu_blocks.dequantize_blocks(wrap(got[0]), wrap(got[1]), fmt.encoding, layout, out)),
                    u8(twin.dequantize_blockwise(got[0], got[1], br, out)), err_msg=f"dequantize_blockwise {out}")


SHAPES = [(1, 1), (1, 31), (1, 33), (33, 1), (31, 129), (129, 257), (257, 130), (2, 7001), (7001, 3), (300, 1000)]


@pytest.mark.parametrize("tile", [cpu_blocks.TILE, 1 << 10], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_paths_equal_the_whole_array_twin(rng, monkeypatch, shape, dtype, tile):
    """Odd sizes, partial blocks on either edge, and (small tiles) tiles that split rows and columns."""
    monkeypatch.setattr(cpu_blocks, "TILE", tile)
    monkeypatch.setattr(cpu_blocks, "TILE_BLOCKS", tile // 32)
    check_every_path(hostile(shape, dtype, rng))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_one_long_row_equals_the_twin(rng, dtype):
    """(1, 2M): the shape whose zero padding to whole blocks cost 32x (columnwise) and 128x (128x128); the twin
    pads it too, so the rowwise paths here and the columnwise ones on a (1, 70001) row under small tiles."""
    check_every_path(hostile((1, 1 << 21), dtype, rng), fmts=(Format.E4M3,), columnwise=(False,), brs=(1,))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spread", [0.0, 3.0, 30.0], ids=["one-scale", "few-scales", "many-scales"])
@pytest.mark.parametrize("shape", [(512, 640), (1, 1 << 18), (1 << 18, 1), (300, 1000)], ids=str)
def test_16_bit_table_and_direct_casts_equal_the_twin(rng, monkeypatch, shape, dtype, spread):
    """From TABLE_MIN elements bf16/fp16 cast by lookup when at most TABLE_MAX_SCALES factors are used: tiles
    keep their factors (or, with tiny blocks, a byte per block) until that is known."""
    monkeypatch.setattr(cpu_blocks, "TABLE_MIN", 1 << 12)
    x = hostile(shape, dtype, rng, spread)
    if spread == 0.0:
        x[np.isnan(x) | np.isinf(x)] = 1
    check_every_path(x, fmts=(Format.E4M3,))


def test_empty_inputs(rng):
    for shape in ((0, 5), (5, 0), (0, 0)):
        check_every_path(np.zeros(shape, np.float32), fmts=(Format.E4M3,))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1 << 20), (1 << 20, 1), (256, 4096), (1025, 2049)], ids=str)
def test_peak_memory_within_twice_input_plus_output(rng, shape, dtype):
    """tracemalloc's peak (NumPy reports its buffers) of every block path and its dequantize, from 1M elements:
    below that, the 16-bit table path's fixed ~3 MiB (up to 16 concatenated 64 KiB tables, the pool's chunk
    offsets) is not proportional to the input."""
    x = rng.standard_normal(shape).astype(dtype)
    rows = memory_rows(x)
    assert len(rows) == 9
    over = [(r["case"], round(r["peak_over_in_out"], 2)) for r in rows if r["peak_over_in_out"] > 2.0]
    assert not over, over


@pytest.fixture
def eight_threads_each_holding_a_chunk(monkeypatch):
    """cpu's pool at its largest (8 threads: any machine of 8 cores or more), each thread holding one chunk's
    temporaries at the moment of its lookup (the bf16/fp16 table cast waits there for all of them): the most
    memory the pool can hold at once, whatever this machine's cores and timing."""
    import threading

    from fp8core.backends import cpu

    monkeypatch.setattr(cpu, "_THREADS", 8)
    monkeypatch.setattr(cpu, "_pool", None)  # a pool of 7 for this test; the machine's own one comes back after
    meet = threading.Barrier(8, timeout=2.0)
    take = np.take

    def take_together(*args, **kwargs):
        if kwargs.get("out") is not None:
            try:
                meet.wait()
            except threading.BrokenBarrierError:  # the last round had fewer chunks than threads: the next cast's
                meet.reset()                      # rounds meet again
        return take(*args, **kwargs)

    monkeypatch.setattr(np, "take", take_together)
    yield
    if cpu._pool is not None:
        cpu._pool.shutdown()


@pytest.mark.parametrize("shape", [(1, 1 << 20), (1 << 20, 1), (256, 4096)], ids=str)
def test_peak_memory_within_twice_input_plus_output_on_eight_threads(rng, shape, eight_threads_each_holding_a_chunk):
    """The same bound with every thread of the pool holding its chunk at once: the table cast's per-thread
    offsets (8 bytes an element of a 64K chunk) must not add up past it (they took a 1M-element bf16 input to
    3.2x its size on a 16-core machine)."""
    rows = memory_rows(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
    over = [(r["case"], round(r["peak_over_in_out"], 2)) for r in rows if r["peak_over_in_out"] > 2.0]
    assert not over, over
