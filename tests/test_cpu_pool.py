"""The CPU backend's thread pool (``cpu.map_chunks``): every element once, results in chunk order, errors raised only
after every chunk begun has finished, no deadlock when a pooled chunk maps again, and the oracle's bits on both
sides of the size from which each primitive uses the pool."""

import threading

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format
from fp8core._tensor import wrap
from fp8core.backends import cpu
from fp8core.formats import ENCODINGS
from oracle import quantize_bits


@pytest.fixture
def pool_always(monkeypatch):
    monkeypatch.setattr(cpu, "_POOL_MIN", dict.fromkeys(cpu._POOL_MIN, 0))


@pytest.mark.parametrize("n", [0, 1, 8191, 16384, 65537, 3 * 65536 + 5, 1 << 20])
@pytest.mark.parametrize("kind", ["cast", "lookup"])
def test_map_covers_every_element_once_in_chunk_order(pool_always, n, kind):
    threads = set()

    def fn(a, b):
        threads.add(threading.get_ident())
        return (a, b)

    spans = cpu.map_chunks(n, fn, kind)
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    assert np.array_equal(np.concatenate([np.arange(a, b) for a, b in spans] or [np.arange(0)]), np.arange(n))
    assert all(b > a for a, b in spans)
    assert threads <= {threading.get_ident()} | {t.ident for t in threading.enumerate()}


def test_a_failing_chunk_raises_once_every_begun_chunk_has_finished(pool_always, monkeypatch):
    monkeypatch.setattr(cpu, "CHUNK", cpu._MIN_SHARE)  # 16 chunks
    lock = threading.Lock()
    state = {"running": 0, "done": 0}

    def fn(a, b):
        with lock:
            state["running"] += 1
        try:
            if a == 3 * cpu._MIN_SHARE:
                raise RuntimeError("chunk 3")
            np.sort(np.random.default_rng(a).random(b - a))  # some work that releases the GIL
        finally:
            with lock:
                state["running"] -= 1
                state["done"] += 1

    with pytest.raises(RuntimeError, match="chunk 3"):
        cpu.map_chunks(16 * cpu._MIN_SHARE, fn)
    assert state["running"] == 0  # nothing still writing into the caller's arrays
    assert state["done"] >= 4


def test_map_spans_raises_only_once_every_begun_span_has_finished(monkeypatch):
    """Several threads: spans that fail at once must not let map_spans raise while another span still runs (it
    writes into the caller's arrays, and a GEMM's span reads the caller's scratch, which its next GEMM reuses).
    Which thread takes the slow span is up to the threads, so the call is made a dozen times."""
    monkeypatch.setattr(cpu, "_THREADS", 4)
    monkeypatch.setattr(cpu, "_pool", None)  # a pool of 3 threads for this test
    lock = threading.Lock()
    try:
        for _ in range(12):
            started, state = threading.Barrier(4, timeout=30), {"running": 0}

            def fn(a, b, started=started, state=state):
                with lock:
                    state["running"] += 1
                try:
                    started.wait()  # all four spans begun, one per thread
                    if a == 3:
                        threading.Event().wait(0.05)
                    else:
                        raise RuntimeError(f"span {a}")
                finally:
                    with lock:
                        state["running"] -= 1

            with pytest.raises(RuntimeError, match="span"):
                cpu.map_spans(4, 1, fn)
            assert state["running"] == 0
    finally:
        cpu._pool.shutdown(wait=True)


def test_map_spans_raises_what_one_thread_would(monkeypatch):
    """Spans that fail at once on several threads: the error raised is the first failing span's in order (what
    one thread running them in order raises), though it fails last; an interrupt goes before any error."""
    monkeypatch.setattr(cpu, "_THREADS", 4)
    monkeypatch.setattr(cpu, "_pool", None)
    try:
        for fail, want in (({1: RuntimeError, 2: ValueError, 3: RuntimeError}, "span 1"),
                           ({2: ValueError, 3: KeyboardInterrupt}, "span 3")):
            for _ in range(12):
                started = threading.Barrier(4, timeout=30)

                def fn(a, b, started=started, fail=fail):
                    started.wait()
                    if a in fail:
                        if a == min(fail):
                            threading.Event().wait(0.05)  # the first failing span in order fails last
                        raise fail[a](f"span {a}")

                with pytest.raises(BaseException, match=want) as e:
                    cpu.map_spans(4, 1, fn)
                assert type(e.value) is fail[int(want[-1])]
    finally:
        cpu._pool.shutdown(wait=True)


def test_a_failed_span_starts_no_other(monkeypatch):
    """Once a span fails no thread starts another (an interrupted inspect stops at the recipes already begun);
    the spans already running finish first."""
    monkeypatch.setattr(cpu, "_THREADS", 2)
    monkeypatch.setattr(cpu, "_pool", None)
    try:
        for _ in range(6):
            begun, lock = [], threading.Lock()

            def fn(a, b, begun=begun):
                with lock:
                    begun.append(a)
                    first = len(begun) == 1
                if first:
                    raise RuntimeError(f"span {a}")
                threading.Event().wait(0.02)

            with pytest.raises(RuntimeError):
                cpu.map_spans(16, 1, fn)
            assert len(begun) <= 2, begun  # the failing span and the one the other thread had begun
    finally:
        cpu._pool.shutdown(wait=True)


def test_a_pooled_chunk_that_maps_again_does_not_deadlock(pool_always):
    """A chunk running on a pool thread may itself call map_chunks (the pool's queue holds only that thread's
    tasks): the inner caller drains the queue itself and cancels the tasks no thread has started."""
    out = []

    def outer():
        inner = lambda a, b: cpu.map_chunks(b - a, lambda c, d: d - c)
        out.append(sum(sum(r) for r in cpu.map_chunks(8 * cpu._MIN_SHARE, inner)))

    t = threading.Thread(target=outer, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "nested map_chunks deadlocked"
    assert out == [8 * cpu._MIN_SHARE]


def _patterns(n: int, dtype, seed: int) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaN, inf, subnormals included) with the specials at both ends."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).itemsize == 4:
        bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
        bits[:6] = [0x7FC00000, 0xFF800000, 0x7F800000, 0x80000000, 0x00000001, 0x43E00000]
        bits[-3:] = [0x7F7FFFFF, 0xFF7FFFFF, 0x80000001]
        return bits.view(np.float32)
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    return bits.view(dtype)


# Below and above where the pool takes over: the lookups' threshold (bf16/fp16 quantize, dequantize), then the
# fp32 cast's (the calling thread alone at the first size, the pool at the second)
SIZES = [cpu._POOL_MIN["lookup"] - 5, cpu._POOL_MIN["cast"] + 3]


def test_sizes_straddle_the_pool_thresholds():
    assert SIZES[0] < min(cpu._POOL_MIN.values()) and SIZES[1] > max(cpu._POOL_MIN.values())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("fmt", [f.value for f in ENCODINGS])
def test_quantize_with_amax_has_the_oracles_bits(n, dtype, fmt):
    x = _patterns(n, dtype, n)
    want = quantize_bits(x.astype(np.float32), 0.3, fmt)
    want_amax = cpu._amax_bits(x)
    slot = np.zeros(1, np.float32)
    q = fp8core.quantize(x, np.array([0.3], np.float32), fmt, amax_out=slot)
    np.testing.assert_array_equal(q.view(np.uint8), want)
    assert slot.view(np.uint32)[0] == want_amax


@pytest.mark.parametrize("n", SIZES)
def test_quantize_dynamic_and_cast_transpose_have_the_oracles_bits(n):
    x = np.random.default_rng(5).standard_normal(n, dtype=np.float32)
    x[17] = 1e30
    x2 = x[: n - n % 128].reshape(128, -1)
    scale = np.float32(448) / np.float32(1e30)
    q, s_inv, a = fp8core.quantize_dynamic(x, "e4m3")
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x, float(scale), "e4m3"))
    assert a[0] == np.float32(1e30) and s_inv[0] == np.float32(1) / scale
    cq, cqt = fp8core.cast_transpose(x2, 0.5, "e5m2")
    np.testing.assert_array_equal(cq.view(np.uint8), quantize_bits(x2, 0.5, "e5m2"))
    np.testing.assert_array_equal(cqt.view(np.uint8), quantize_bits(x2, 0.5, "e5m2").T)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32", "float16"])
def test_dequantize_has_the_oracles_bits(n, out_dtype):
    codes = np.random.default_rng(3).integers(0, 256, size=n, dtype=np.uint16).astype(np.uint8)
    y = fp8core.dequantize(codes.view(ml_dtypes.float8_e4m3fn), 0.25, out_dtype)
    table = cpu._dequant_table(Format.E4M3, int(np.float32(0.25).view(np.uint32)), out_dtype)  # the definition
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), table[codes].view(np.uint8))


def test_pooled_chunks_keep_the_callers_raising_errstate_quiet(pool_always):
    """The product may overflow or be inf * 0 on any thread; fp8core's chunks must not raise FloatingPointError
    there, whatever the caller's np.errstate (pool threads do not inherit it)."""
    x = np.full((1 << 17) + 1, 3e38, np.float32)
    x[::3] = np.inf
    with np.errstate(all="raise"):
        q = fp8core.quantize(x, np.array([0.0], np.float32), "e4m3")
        q2 = fp8core.quantize(x, np.array([1e10], np.float32), "e4m3")
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x, 0.0, "e4m3"))
    np.testing.assert_array_equal(q2.view(np.uint8), quantize_bits(x, 1e10, "e4m3"))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("where", [0, 1 << 20, (1 << 21) - 1])
def test_amax_of_a_large_array_sees_a_nan_or_inf_anywhere(dtype, where):
    x = np.random.default_rng(1).standard_normal(1 << 21, dtype=np.float32).astype(dtype)
    x[where] = -np.inf
    assert np.asarray(fp8core.amax(x)).view(np.uint32)[0] == 0x7F800000
    x[where] = np.nan
    assert np.asarray(fp8core.amax(x)).view(np.uint32)[0] == 0x7FFFFFFF


def test_the_backend_amax_takes_a_strided_tensor_whole():
    x = np.random.default_rng(2).standard_normal((1024, 3000), dtype=np.float32)[:, ::3]
    x[500, 7] = -1e9
    got = cpu.amax(wrap(x))
    assert got.view(np.uint32)[0] == np.array(1e9, np.float32).view(np.uint32)


# ---- the GEMM's column spans and scratch, the transpose's strips --------------------------------------------

def _gemm_cases(rng):
    """(name, thunk) pairs: every operand pair and output (an fp8 output with its amax slot), bias, an empty M,
    and the block-scaled GEMMs, with N = 80 (spans of 48 and 32 columns on 2 threads) and a NaN operand row."""
    from fp8core.blocks import quantize_blockwise, quantize_mxfp8
    from gemm_cases import CASES, as_fp8, fp8_codes

    cases = []
    for a_fmt, b_fmt, out_dtype in CASES:
        ac, bc = fp8_codes(rng, (37, 96), a_fmt), fp8_codes(rng, (80, 96), b_fmt)
        ac[4, 9] = 0x7F
        a, b = as_fp8(ac, a_fmt), as_fp8(bc, b_fmt)
        bias = rng.standard_normal(80).astype(ml_dtypes.bfloat16)
        fp8_out = out_dtype.startswith("float8")

        def run(a=a, b=b, bias=bias if out_dtype in ("bfloat16", "float32") or fp8_out else None,
                out_dtype=out_dtype, fp8_out=fp8_out):
            slot = np.zeros(1, np.float32) if fp8_out else None
            d = fp8core.gemm(a, b, 0.5, 3.0, out_dtype=out_dtype, bias=bias, out_scale=0.25 if fp8_out else None,
                             out_amax=slot)
            return [np.asarray(d).view(np.uint8)] + ([slot.view(np.uint32)] if fp8_out else [])

        cases.append((f"{a_fmt}x{b_fmt}->{out_dtype}", run))
    empty = as_fp8(np.zeros((0, 32), np.uint8), "e4m3"), as_fp8(fp8_codes(rng, (48, 32), "e4m3"), "e4m3")
    cases.append(("empty M", lambda: [np.asarray(fp8core.gemm(*empty, 1.0, 1.0, out_dtype="float32")).view(np.uint8)]))
    x = (rng.standard_normal((37, 256)) * 2.0 ** rng.uniform(-6, 6, (37, 256))).astype(np.float32)
    w = (rng.standard_normal((80, 256)) * 2.0 ** rng.uniform(-6, 6, (80, 1))).astype(np.float32)
    blocked = {"mx": (quantize_mxfp8(x), quantize_mxfp8(w))}
    for a_block, b_block in [("1x128", "128x128"), ("128x128", "1x128")]:  # M a multiple of 8 (blocks.gemm_blocks)
        blocked[f"{a_block},{b_block}"] = (quantize_blockwise(x[:32], block=a_block, power_of_2=False),
                                           quantize_blockwise(w, block=b_block, power_of_2=False))
    for scheme, (a, b) in blocked.items():
        cases.append((scheme, lambda a=a, b=b: [np.asarray(fp8core.gemm(a, b, out_dtype="float32")).view(np.uint8)]))
    # fp8 outputs with no NaN: the amax is the largest |D|, in the last span (b's last rows the largest), or in
    # spans of 1024 x 512 whose output cast uses the pool again from inside the span
    for m, n, k in [(37, 80, 96), (1024, 1024, 16)]:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[-16:] *= 16
        a = fp8core.quantize(rng.standard_normal((m, k)).astype(np.float32), 1.0, "e4m3")
        b = fp8core.quantize(w, 1.0, "e4m3")

        def run(a=a, b=b):
            slot = np.zeros(1, np.float32)
            d = fp8core.gemm(a, b, 0.5, 3.0, out_dtype="float8_e4m3fn", out_scale=0.25, out_amax=slot)
            return [d.view(np.uint8), slot.view(np.uint32)]

        cases.append((f"{m}x{n}x{k} amax", run))
    return cases


def test_a_gemm_split_into_column_spans_has_the_bits_of_one_span(monkeypatch):
    """From cpu._GEMM_POOL_MIN multiply-adds the GEMM's columns are split between threads: every output element
    is still computed whole in one span, so the split changes no bit (nor the fp8 output's amax). Two threads
    whatever the machine has (a one-core machine would not split)."""
    monkeypatch.setattr(cpu, "_THREADS", 2)
    for name, run in _gemm_cases(np.random.default_rng(11)):
        monkeypatch.setattr(cpu, "_GEMM_POOL_MIN", 1 << 62)
        whole = run()
        monkeypatch.setattr(cpu, "_GEMM_POOL_MIN", 0)
        split = run()
        for w, s in zip(whole, split, strict=True):
            np.testing.assert_array_equal(s, w, err_msg=name)


def test_gemm_results_and_outs_do_not_share_the_scratch(monkeypatch, rng):
    """The widened operands and the float64 product live in a scratch buffer per thread, reused by the next
    GEMM: what a GEMM returns (or wrote into ``out``) must not be that buffer, nor change with the next GEMM."""
    from gemm_cases import as_fp8, fp8_codes

    monkeypatch.setattr(cpu, "_scratch_buffers", type(cpu._scratch_buffers)())
    big = as_fp8(fp8_codes(rng, (64, 128), "e4m3"), "e4m3"), as_fp8(fp8_codes(rng, (64, 128), "e5m2"), "e5m2")
    fp8core.gemm(*big, 2.0, 0.5, out_dtype="float32")  # the buffers now fit the smaller GEMMs below
    a1, b1 = as_fp8(fp8_codes(rng, (16, 64), "e4m3"), "e4m3"), as_fp8(fp8_codes(rng, (32, 64), "e4m3"), "e4m3")
    a2, b2 = as_fp8(fp8_codes(rng, (16, 64), "e4m3"), "e4m3"), as_fp8(fp8_codes(rng, (32, 64), "e4m3"), "e4m3")
    for out_dtype in ["float32", "bfloat16"]:
        d1 = fp8core.gemm(a1, b1, 1.0, 1.0, out_dtype=out_dtype)
        given = np.empty_like(d1)
        fp8core.gemm(a1, b1, 1.0, 1.0, out_dtype=out_dtype, out=given)
        for buf in cpu._scratch_buffers.kinds.values():
            assert not np.shares_memory(d1, buf) and not np.shares_memory(given, buf)
        kept, kept_given = d1.copy(), given.copy()
        fp8core.gemm(a2, b2, 2.0, 0.5, out_dtype=out_dtype)  # the same shape: the same scratch
        np.testing.assert_array_equal(d1.view(np.uint8), kept.view(np.uint8))
        np.testing.assert_array_equal(given.view(np.uint8), kept_given.view(np.uint8))


def test_gemms_on_several_threads_at_once_each_get_their_own_bits(monkeypatch):
    """Each thread's GEMMs use that thread's scratch: four threads running GEMMs of different shapes at the same
    time (each split across the pool as well) get the bits they get alone."""
    from gemm_cases import as_fp8, fp8_codes

    monkeypatch.setattr(cpu, "_GEMM_POOL_MIN", 0)
    rng = np.random.default_rng(4)
    jobs = [(as_fp8(fp8_codes(rng, (m, k), "e4m3"), "e4m3"), as_fp8(fp8_codes(rng, (n, k), "e4m3"), "e4m3"))
            for m, n, k in [(8, 48, 32), (64, 96, 160), (33, 256, 64), (128, 16, 512)]]
    alone = [fp8core.gemm(a, b, 0.5, 2.0, out_dtype="float32") for a, b in jobs]
    wrong = []

    def worker(i):
        a, b = jobs[i]
        for _ in range(40):
            if not np.array_equal(fp8core.gemm(a, b, 0.5, 2.0, out_dtype="float32").view(np.uint32),
                                  alone[i].view(np.uint32)):
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("shape", [(1, 5000), (33, 4097), (4099, 7), (700, 96), (96, 700), (257, 1025)])
def test_a_transpose_split_across_the_pool_moves_every_byte(monkeypatch, shape):
    """From cpu._TRANSPOSE_POOL_MIN elements the transpose's strips of rows go to the pool in spans: odd sizes,
    a last short strip, a single row, and narrow rows (taller strips) all land where q.T puts them."""
    monkeypatch.setattr(cpu, "_TRANSPOSE_POOL_MIN", 0)
    codes = np.random.default_rng(sum(shape)).integers(0, 256, size=shape, dtype=np.uint16).astype(np.uint8)
    q = codes.view(ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(fp8core.transpose(q).view(np.uint8), codes.T)
    out = np.empty(shape[::-1], ml_dtypes.float8_e5m2)
    fp8core.transpose(q, out=out)
    np.testing.assert_array_equal(out.view(np.uint8), codes.T)


def test_the_gemm_scratch_keeps_at_most_its_cap_per_thread_and_kind(monkeypatch, rng):
    """A GEMM needing more scratch than cpu._SCRATCH_MAX gets fresh memory for that call alone: the thread keeps
    no buffer above the cap, and the result is the same as with the buffers kept."""
    from gemm_cases import as_fp8, fp8_codes

    a, b = as_fp8(fp8_codes(rng, (64, 256), "e4m3"), "e4m3"), as_fp8(fp8_codes(rng, (128, 256), "e5m2"), "e5m2")
    kept = fp8core.gemm(a, b, 0.5, 2.0, out_dtype="bfloat16")
    monkeypatch.setattr(cpu, "_scratch_buffers", type(cpu._scratch_buffers)())
    monkeypatch.setattr(cpu, "_SCRATCH_MAX", 64 * 256 * 8)  # room for the widened a alone
    fresh = fp8core.gemm(a, b, 0.5, 2.0, out_dtype="bfloat16")
    np.testing.assert_array_equal(fresh.view(np.uint16), kept.view(np.uint16))
    sizes = {kind: buf.size for kind, buf in cpu._scratch_buffers.kinds.items()}
    assert sizes == {"operand": 64 * 256 * 8}


@pytest.mark.parametrize("env,one", [
    ({}, False),
    ({"OPENBLAS_NUM_THREADS": "1"}, True),
    ({"OPENBLAS_NUM_THREADS": " 1 "}, True),
    ({"OPENBLAS_NUM_THREADS": "2"}, False),
    ({"OMP_NUM_THREADS": "1"}, True),
    ({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "4"}, False),
    ({"OMP_NUM_THREADS": "8", "OPENBLAS_NUM_THREADS": "1"}, True),
    ({"MKL_NUM_THREADS": "1"}, True),
    ({"MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "2"}, False),
    ({"VECLIB_MAXIMUM_THREADS": "1", "OPENBLAS_NUM_THREADS": ""}, True),
])
def test_the_gemm_splits_only_where_blas_runs_on_one_thread(monkeypatch, env, one):
    """With BLAS's own threads the split put two teams of threads on the same cores (1.1-1.3x slower): the GEMM
    splits its columns only where the environment runs BLAS on one thread."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cpu._blas_on_one_thread() is one
