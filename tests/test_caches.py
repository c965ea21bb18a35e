"""fp8core._caches: the core's memos under one owner, and the reset tests use instead of replacing a module's
internals. A reset empties every memo (or those named) and the next calls give the same bits."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import _caches, ops
from fp8core.backends import cpu, cpu_blocks, cublaslt, cuda  # noqa: F401  (cuda: its memos registered)

FUNCTIONS = [cpu.quantize_table, cpu._dequant_table, cpu._widen_table, cpu_blocks._e8m0_factors,
             cpu_blocks._fp32_of_code, cublaslt.compute_capability]


def _calls():
    """Calls that fill every CPU memo: the fp32 cast, a bf16 table (2^17 elements), dequantize, the GEMM's
    widening, MXFP8 both ways."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    bf = x.astype(ml_dtypes.bfloat16)
    q = fp8core.quantize(x, 2.0, "e4m3")
    out = [q, fp8core.quantize(bf, 2.0, "e4m3"), fp8core.dequantize(q, 0.5, "bfloat16"),
           fp8core.gemm(q[:32], q[:64], 0.5, 0.25, out_dtype="float32")]
    mx = fp8core.quantize_mxfp8(x, "e4m3")
    out += [*mx, fp8core.dequantize_mxfp8(mx, "float32")]
    return [np.asarray(o).view(np.uint8).copy() for o in out]


def test_every_memo_is_registered_by_name():
    assert {"cpu.cast_tables", "cpu.quantize_tables", "cpu.seen_scales", "cpu.dequantize_tables", "cpu.widen_tables",
            "cpu_blocks.e8m0_factors", "cpu_blocks.fp32_of_code", "cublaslt.compute_capability",
            "ops.backends", "kernels.plans", "kernels.sm_counts", "kernels.nvrtc_version", "kernels.cubins",
            "cuda.no_cooperative"} <= set(_caches.names())


def test_reset_empties_every_memo_and_the_next_calls_give_the_same_bits():
    want = _calls()
    assert cpu._CAST and ops._BACKENDS
    assert all(f.cache_info().currsize for f in FUNCTIONS if f is not cublaslt.compute_capability)  # no GPU here
    _caches.reset()
    assert not cpu._CAST and not cpu._seen and not ops._BACKENDS
    assert all(f.cache_info().currsize == 0 for f in FUNCTIONS)
    got = _calls()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_reset_by_name_empties_those_alone():
    _calls()
    _caches.reset("cpu.quantize_tables")
    assert cpu.quantize_table.cache_info().currsize == 0 and cpu._CAST and ops._BACKENDS


def test_an_unknown_name_is_refused_naming_the_memos():
    with pytest.raises(KeyError, match="which: no memo named 'cpu.tables'; the memos: cpu.cast_tables, "):
        _caches.reset("cpu.quantize_tables", "cpu.tables")


def test_memo_takes_what_it_can_empty():
    with pytest.raises(TypeError, match="cache: expected a dict, a set or a functools cache, got tuple"):
        _caches.memo("test.tuple", ())
