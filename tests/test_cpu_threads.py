"""fp8core.cpu_threads(n): at most n threads work for a CPU call, NumPy's BLAS on one thread per GEMM span (set and
restored, counted across threads), the same bits whatever n; the torch ops run inside it with torch's own count."""

import threading

import numpy as np
import pytest

import fp8core
from fp8core.backends import cpu, cpu_threads as ct


def blas_threads():
    return [get() for get, _ in ct._blas_setters()]


needs_openblas = pytest.mark.skipif(not ct._blas_setters(), reason="NumPy's BLAS here is not an OpenBLAS fp8core "
                                                                   "can set (MKL, Accelerate): its threads are BLAS's")


def operands(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    a = fp8core.quantize(rng.standard_normal((m, k)).astype(np.float32), 1.0, "e4m3")
    b = fp8core.quantize(rng.standard_normal((n, k)).astype(np.float32), 1.0, "e4m3")
    return a, b


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="n: expected an int >= 1 or None"):
        with fp8core.cpu_threads(bad):
            pass


def test_the_innermost_count_holds_on_this_thread_only():
    seen = {}
    with fp8core.cpu_threads(3):
        with fp8core.cpu_threads(1):
            seen["inner"] = ct.thread_budget()
        seen["outer"] = ct.thread_budget()
        other = threading.Thread(target=lambda: seen.setdefault("other", ct.thread_budget()))
        other.start()
        other.join()
    assert seen == {"inner": 1, "outer": 3, "other": None} and ct.thread_budget() is None


@pytest.mark.skipif(cpu._THREADS == 1, reason="one CPU: the pool never runs a span")
def test_one_thread_keeps_every_span_on_the_calling_thread():
    def who(a, b):
        return threading.get_ident()

    with fp8core.cpu_threads(1):
        assert set(cpu.map_spans(64, 1, who)) == {threading.get_ident()}
        assert set(cpu.map_chunks(1 << 22, who, "cast")) == {threading.get_ident()}


@needs_openblas
def test_blas_runs_on_one_thread_in_the_gemm_and_gets_its_threads_back(monkeypatch):
    before = blas_threads()
    seen = []
    real = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **k: (seen.append(blas_threads()), real(*a, **k))[1])
    a, b = operands(256, 256, 256)
    with fp8core.cpu_threads(2):
        fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32")
    assert seen and all(s == [1] * len(before) for s in seen)
    assert blas_threads() == before
    seen.clear()
    fp8core.gemm(a, b, 1.0, 1.0, out_dtype="float32")  # outside: BLAS's own setting untouched
    assert seen and all(s == before for s in seen)


@needs_openblas
def test_concurrent_users_restore_blas_once_the_last_leaves():
    before = blas_threads()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with ct.blas_on_one_thread():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    with ct.blas_on_one_thread():
        pass
    assert blas_threads() == [1] * len(before)  # the other user is still inside
    release.set()
    t.join()
    assert blas_threads() == before


@pytest.mark.parametrize("shape", [(256, 256, 256), (48, 64, 32)], ids=["split", "one_span"])
def test_the_bits_do_not_depend_on_the_thread_count(shape):
    a, b = operands(*shape, seed=1)
    want = fp8core.gemm(a, b, 0.5, 2.0, out_dtype="float32")
    for n in (1, 2, 8):
        with fp8core.cpu_threads(n):
            got = fp8core.gemm(a, b, 0.5, 2.0, out_dtype="float32")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n


def test_torch_ops_take_torchs_thread_count(monkeypatch):
    torch = pytest.importorskip("torch")
    import fp8core.torch as f8

    seen = []
    real = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **k: (seen.append(ct.thread_budget()), real(*a, **k))[1])
    x = torch.randn(32, 64)
    q = f8.ops.quantize(x, torch.ones(1), "e4m3")
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            f8.ops.gemm(q, q, torch.ones(1), torch.ones(1), torch.float32)
            assert seen[-1] == n
    finally:
        torch.set_num_threads(before)
    assert ct.thread_budget() is None
