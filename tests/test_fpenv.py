"""The CPU reference gives the contract's bits in any floating-point mode: flush-to-zero and
denormals-are-zero set in the calling thread (``torch.set_flush_denormal``, XLA:CPU's callback threads), in a
thread created while they were set, and in a pool created from such a thread."""

from __future__ import annotations

import subprocess
import sys
import threading
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format, _caches
from fp8core._fpenv import is_default
from fp8core.backends import cpu
from oracle import quantize_bits

torch = pytest.importorskip("torch")

TINY = np.float32(1e-39)  # an fp32 subnormal


def _flushing() -> bool:
    return bool(np.float32(TINY) * np.float32(1) == 0)


@contextmanager
def flush_denormal():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert _flushing(), "torch.set_flush_denormal(True) did not set FTZ/DAZ"
        yield
    finally:
        torch.set_flush_denormal(False)
    assert not _flushing()


def _bits(a) -> list[int]:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]).reshape(-1).tolist()


def _subnormal_cases() -> list:
    """(name, thunk) pairs: every CPU numerics path fed subnormal inputs, scales or amaxes."""
    x = np.array([1e-39, -1e-39, 2e-39, 1, -3e-45, 0, -0.0], np.float32)
    bf = (np.arange(1 << 18, dtype=np.uint32) % 4096).astype(np.uint16).view(ml_dtypes.bfloat16)  # table path
    sub_scale = np.array([1e-39], np.float32)
    hist = np.zeros((4, 3), np.float32)
    hist[0] = [TINY, 0, 5.0]
    hist[1:, 1] = 2.0
    ones = np.ones((16, 16), ml_dtypes.float8_e4m3fn)
    # every input is made here, in the default mode: the thunks run while flushing
    half = x.astype(np.float16) * np.float16(2.0 ** -10)
    s = {e: np.array([2.0 ** e], np.float32) for e in (-130, -1, 0, 24, 100, 120, 126)}
    big_x = np.array([1e30, -3e38, 3e38], np.float32)

    def update():
        h, sc, si = hist.copy(), np.ones(3, np.float32), np.ones(3, np.float32)
        cpu.update(h, sc, si, np.full(3, 448, np.float32), 0, "max", False, 0.0, True, None)
        return h, sc, si

    def fused():
        slot = np.array([-0.0], np.float32)
        fp8core.quantize(x, 1.0, Format.E4M3, amax_out=slot)
        return slot

    return [
        ("quantize, subnormal x", lambda: fp8core.quantize(x, s[120], "e4m3")),
        ("quantize, subnormal x, e5m2", lambda: fp8core.quantize(x, s[120], "e5m2")),
        ("quantize, subnormal scale", lambda: fp8core.quantize(big_x,
                                                                sub_scale, "e4m3")),
        ("quantize, Python float subnormal scale", lambda: fp8core.quantize(big_x,
                                                                             1e-39, "e4m3")),
        ("quantize, bf16 table path", lambda: fp8core.quantize(bf, s[126], "e4m3")),
        ("quantize, fp16", lambda: fp8core.quantize(half, s[24], "e5m2")),
        ("amax, subnormal", lambda: fp8core.amax(x[[0, 1, 4]])),
        ("amax, bf16 subnormal", lambda: fp8core.amax(bf[:4096])),
        ("fused amax into -0.0", fused),
        ("quantize_dynamic, subnormal amax", lambda: fp8core.quantize_dynamic(x[[0, 1, 4]], "e4m3", margin=8)),
        ("quantize_dynamic, power_of_2", lambda: fp8core.quantize_dynamic(x[[0, 1, 4]], "e5m2", margin=30,
                                                                           power_of_2=True)),
        ("dequantize, subnormal scale_inv", lambda: fp8core.dequantize(ones, sub_scale, "float32")),
        ("dequantize, bf16 out", lambda: fp8core.dequantize(ones, s[-130], "bfloat16")),
        ("compute_scale, subnormal amax", lambda: fp8core.compute_scale(np.array([TINY]), "e4m3", margin=20)),
        ("compute_scale, Python float subnormal amax", lambda: fp8core.compute_scale(1e-39, "e4m3")),
        ("compute_scale, subnormal result", lambda: fp8core.compute_scale(np.array([448.0], np.float32), "e4m3",
                                                                           margin=140)),
        ("compute_scale, subnormal pow2", lambda: fp8core.compute_scale(np.array([3.0], np.float32), "e4m3",
                                                                         margin=140, power_of_2=True)),
        ("update, subnormal amax runs", update),
        ("gemm, subnormal result", lambda: fp8core.gemm(ones, ones, sub_scale, s[-1],
                                                        out_dtype="float32")),
        ("gemm, fp8 out with amax", lambda: fp8core.gemm(ones, ones, sub_scale, s[0],
                                                         out_dtype="float8_e4m3fn", out_scale=s[100])),
    ]


CASES = _subnormal_cases()


def _expected() -> dict[str, list[int]]:
    _caches.reset()
    out = _run_all()
    _caches.reset()  # every table the cases use is built again, under whatever mode the next test sets
    return out


def _run_all() -> dict[str, list[int]]:
    out = {}
    for name, f in CASES:
        r = f()
        out[name] = [_bits(v) for v in (r if isinstance(r, tuple) else (r,))]
    return out


def test_contract_bits_of_the_subnormal_cases():
    """The default-mode results the other tests compare with are the contract's, checked against the oracle."""
    assert not _flushing()
    x = np.array([1e-39, -1e-39, 2e-39, 1, -3e-45, 0, -0.0], np.float32)
    q = fp8core.quantize(x, np.array([2.0 ** 120], np.float32), "e4m3")
    assert _bits(q) == quantize_bits(x, 2.0 ** 120, "e4m3").tolist()
    assert float(q.astype(np.float32)[0]) == 0.001953125  # 1e-39 * 2^120 ~ 1.33e-3 -> the E4M3 subnormal 2^-9
    slot = np.array([-0.0], np.float32)
    fp8core.quantize(x, 1.0, Format.E4M3, amax_out=slot)
    assert slot[0] == 1.0
    s, _ = fp8core.compute_scale(np.array([TINY]), "e4m3", margin=20)
    assert s[0] == np.float32(3.4028235e38)  # 448 / a subnormal overflows: FLT_MAX (read as 0, it would be 1.0)
    h, sc, si = np.zeros((2, 1), np.float32), np.ones(1, np.float32), np.ones(1, np.float32)
    h[0, 0] = TINY
    cpu.update(h, sc, si, np.array([448.0], np.float32), 100, "max", False, 0.0, True, None)
    assert h[0, 0] == 0 and h[1, 0] == TINY and sc[0] != 1.0  # a subnormal amax did run


def test_reference_under_flush_to_zero_in_this_thread():
    expected = _expected()
    with flush_denormal():
        got = _run_all()
    assert got == expected


def test_reference_in_a_thread_created_under_flush_to_zero():
    expected = _expected()
    got: dict = {}

    def work():
        torch.set_flush_denormal(True)  # whether or not the thread inherited it, it runs flushing
        try:
            got["flushing"] = _flushing()
            got["results"] = _run_all()
        finally:
            torch.set_flush_denormal(False)

    with flush_denormal():
        t = threading.Thread(target=work)
        t.start()
    t.join()
    assert got["flushing"] and got["results"] == expected


def test_tables_built_under_flush_to_zero_are_right():
    """A table cached while the caller flushed must not poison later calls anywhere in the process."""
    bf = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    bf = np.tile(bf, 4)  # 2^18 elements: the table path
    scale = np.array([2.0 ** 120], np.float32)
    ones = np.ones(64, ml_dtypes.float8_e5m2)
    tiny = np.array([2.0 ** -140], np.float32)
    _caches.reset()  # every table, the cast's and the GEMM's too, is built while the caller flushes
    with flush_denormal():
        q_ftz = fp8core.quantize(bf, scale, "e4m3")
        y_ftz = fp8core.dequantize(ones, tiny, "float32")
    q = fp8core.quantize(bf, scale, "e4m3")  # now from the cache
    y = fp8core.dequantize(ones, tiny, "float32")
    want = quantize_bits(bf.astype(np.float32), 2.0 ** 120, "e4m3").tolist()
    assert _bits(q) == want and _bits(q_ftz) == want
    assert y[0] == np.float32(2.0 ** -140) and _bits(y_ftz) == _bits(y)


def test_a_pool_created_under_flush_to_zero_keeps_the_contract():
    """The pool's threads inherit the mode of the thread that created them; a fresh process makes sure the
    pool is created while flushing."""
    code = """
import numpy as np, ml_dtypes, torch, fp8core
bf = np.tile(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16), 8)
x = bf.astype(np.float32)
s = np.array([2.0 ** 120], np.float32)
want_q = fp8core.quantize(x, s, "e4m3").view(np.uint8).copy()
want_a = fp8core.amax(x[: 1 << 16]).view(np.uint32).copy()
fp8core._caches.reset()
assert torch.set_flush_denormal(True)
assert np.float32(1e-39) * np.float32(1) == 0
from fp8core._fpenv import is_default
from fp8core.backends import cpu
cpu._pool = None
q = fp8core.quantize(x, s, "e4m3").view(np.uint8)
qb = fp8core.quantize(bf, s, "e4m3").view(np.uint8)
print(int((q != want_q).sum()), int((qb != want_q).sum()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"]


def test_fp8core_jax_on_the_cpu_keeps_subnormals():
    """XLA:CPU runs callbacks with FTZ/DAZ set: fp8core.jax must still give the contract's bits (under jit)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import fp8core.jax as fj

    x = np.array([1e-39, -1e-39, 2e-39, 1], np.float32)
    q, amax = jax.jit(lambda v: fj.quantize(v, 2.0 ** 120, "e4m3"))(jnp.asarray(x))
    assert _bits(np.asarray(q)) == quantize_bits(x, 2.0 ** 120, "e4m3").tolist()
    assert np.asarray(q).astype(np.float32)[0] == 0.001953125
    a = jax.jit(fj.amax)(jnp.asarray(x[:3]))
    assert _bits(np.asarray(a)) == _bits(np.array([2e-39], np.float32))
    y = jax.jit(lambda v: fj.dequantize(v, 2.0 ** -140))(jnp.ones(8, jnp.float8_e4m3fn))
    assert np.all(np.asarray(y) == np.float32(2.0 ** -140))
    recipe = fp8core.DelayedScaling(amax_history_len=2)
    h = jnp.asarray(np.array([[1e-39], [0]], np.float32))
    h2, s2, _ = jax.jit(lambda h: fj.update(h, jnp.ones(1, jnp.float32), jnp.ones(1, jnp.float32), recipe,
                                            ["e4m3"]))(h)
    assert np.asarray(h2)[1, 0] == np.float32(1e-39)  # the subnormal amax ran: rolled into the history
    assert np.asarray(s2)[0] == np.float32(3.4028235e38)  # 448 / 1e-39 overflows: FLT_MAX
    # nothing cached inside XLA's thread poisons plain NumPy calls afterwards
    ones = np.ones(8, ml_dtypes.float8_e4m3fn)
    assert np.all(fp8core.dequantize(ones, np.array([2.0 ** -140], np.float32), "float32") == np.float32(2.0 ** -140))


@pytest.mark.parametrize("mode", ["upward", "downward", "toward zero"])
def test_reference_under_another_rounding_mode(mode):
    import ctypes
    import ctypes.util
    import platform

    modes = {"x86_64": {"upward": 0x800, "downward": 0x400, "toward zero": 0xC00},
             "aarch64": {"upward": 0x400000, "downward": 0x800000, "toward zero": 0xC00000}}
    if sys.platform != "linux" or platform.machine() not in modes:
        pytest.skip("rounding-mode constants known for Linux x86-64 and aarch64 only")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    expected = _expected()
    assert libm.fesetround(modes[platform.machine()][mode]) == 0
    try:
        assert not is_default()  # the mode is really set
        got = _run_all()
    finally:
        libm.fesetround(0)
    assert got == expected


@pytest.mark.parametrize("spelling", ["context variable", "np.errstate"])
def test_ieee_silences_numpy_inside_and_restores_the_callers_error_state(spelling, monkeypatch):
    """Overflow and inf * 0 are values the contract defines: the reference warns of neither, whichever way the
    guard sets NumPy's error state, and the caller's own setting (here: raise) holds again afterwards."""
    from fp8core import _fpenv

    if spelling == "np.errstate":
        monkeypatch.setattr(_fpenv, "_ERRSTATE", None)

    @_fpenv.ieee
    def overflow():
        return np.float32(3e38) * np.float32(10), np.float32(np.inf) * np.float32(0)

    with np.errstate(all="raise"):
        big, nan = overflow()
        assert big == np.inf and np.isnan(nan)
        with pytest.raises(FloatingPointError):
            np.float32(3e38) * np.float32(10)
        with flush_denormal():  # the switching branch restores it too
            assert overflow()[0] == np.inf
            with pytest.raises(FloatingPointError):
                np.float32(3e38) * np.float32(10)
