"""cuBLASLt's per-thread and per-stream resources, checked on the CPU against stand-ins for cuBLASLt (handles,
matmul) and CUDA's runtime (events, the capture query): handles go back to a per-device pool when their thread
ends; workspaces stay bounded however many streams run GEMMs, are never shared by two streams at once, and a
workspace passed to another stream is waited for (module docstring of fp8core/backends/cublaslt.py); a captured
GEMM takes its workspace from the caller's allocator (torch) or runs without one (CuPy)."""

import gc
import threading
import types

import numpy as np
import pytest

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed")
import fp8core  # noqa: E402
from fp8core import _kernels  # noqa: E402
from fp8core._tensor import Tensor  # noqa: E402
from fp8core.backends import cublaslt  # noqa: E402
from fp8core.gemm import GemmSpec  # noqa: E402
from test_cupy_capture import FakeArray  # noqa: E402

BOUND = cublaslt._WORKSPACES_PER_DEVICE
WS_SIZE = cublaslt._WORKSPACE_SM90


class FakeRuntime:
    def __init__(self, log):
        self.log, self.capturing, self.events = log, False, 0

    def streamIsCapturing(self, stream):
        self.log.append(("is_capturing", stream))
        return self.capturing

    def eventCreateWithFlags(self, flags):
        assert flags == 2, "cudaEventDisableTiming"
        self.events += 1
        self.log.append(("event", 0xE000 + self.events))
        return 0xE000 + self.events

    def streamWaitEvent(self, stream, event, flags=0):
        self.log.append(("wait", stream, event))

    def eventRecord(self, event, stream):
        self.log.append(("record", event, stream))


class FakeLt:
    def __init__(self, log):
        self.log, self.handles, self.destroyed = log, 0, []
        self.lock = threading.Lock()

    def create(self):
        with self.lock:
            self.handles += 1
            return 0x100 + self.handles

    def matmul(self, handle, desc, alpha, A, la, B, lb, beta, C, lc, D, ld, algo, ws, ws_size, stream):
        self.log.append(("matmul", stream, ws, ws_size, handle))

    def matrix_layout_destroy(self, layout):
        self.destroyed.append(layout)

    def matmul_desc_destroy(self, desc):
        self.destroyed.append(desc)


@pytest.fixture
def lt(monkeypatch):
    """The stand-ins installed; ``lt.log`` records allocations, events, waits, matmuls and amax merges in order."""
    log = []
    fake, runtime = FakeLt(log), FakeRuntime(log)
    next_ptr = [0x10000000]
    plans_made = []

    def alloc(shape, dtype, like):
        a = FakeArray(shape, dtype, next_ptr[0])
        next_ptr[0] += 1 << 26
        log.append(("alloc", a.shape, like.origin))
        return a

    def merge_launch(kernel, device, targs, work, stream, grid=None, block=None, cooperative=False, **args):
        assert kernel is _kernels.AMAX, "the GEMM launches only amax merges"
        kernel.signature.pack(args)  # the names and kinds amax_kernel's C++ signature takes
        log.append(("merge_amax", args, stream))

    def make_plan(lt_, spec, handle, workspace_bytes, align, pointers):
        n = len(plans_made)
        plans_made.append((workspace_bytes, pointers))
        return cublaslt._Plan(10 * n, (10 * n + 1, 10 * n + 2, 10 * n + 3, 10 * n + 4),
                              types.SimpleNamespace(ptr=0x99), spec.out_dtype.startswith("float8"))

    monkeypatch.setattr(cublaslt, "lt_bindings", lambda: fake)
    monkeypatch.setattr(cublaslt, "_runtime", lambda: runtime)
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 90)
    monkeypatch.setattr(cublaslt, "_local", threading.local())
    monkeypatch.setattr(cublaslt, "_workspaces", {})
    monkeypatch.setattr(cublaslt, "_handle_pool", {})
    monkeypatch.setattr(cublaslt, "_make_plan", make_plan)
    monkeypatch.setattr(cublaslt, "_set_pointers", lambda lt_, plan, *pointers: plans_made.append((None, pointers)))
    monkeypatch.setattr(cublaslt, "empty", alloc)
    monkeypatch.setattr(_kernels.Kernel, "launch", merge_launch)
    fake.runtime, fake.alloc, fake.plans_made = runtime, alloc, plans_made
    return fake


def operand(origin="cupy", ptr=0x1000000):
    return Tensor(FakeArray((64, 128), np.uint8, ptr), "float8_e4m3fn", ("cuda", 0), origin)


SPEC = GemmSpec(64, 32, 128, fp8core.as_format("e4m3"), fp8core.as_format("e4m3"), "bfloat16", None, False, None,
                None)
SPEC_FP8 = GemmSpec(64, 32, 128, fp8core.as_format("e4m3"), fp8core.as_format("e4m3"), "float8_e4m3fn", None, False,
                    None, None)


def run(lt, stream, origin="cupy", spec=SPEC, out_amax=None):
    a = operand(origin)
    return cublaslt.gemm(spec, a, operand(origin, 0x2000000), None, None, None, None, out_amax, None, stream)


def matmuls(log):
    return [e for e in log if e[0] == "matmul"]


def workspace_allocs(log):
    return [e for e in log if e[0] == "alloc" and e[1] == (WS_SIZE,)]


def assert_no_two_streams_share(device=0):
    table = cublaslt._workspaces.get(device, {})
    assert len({id(w) for w in table.values()}) == len(table)


# ---- workspaces ------------------------------------------------------------------------------------------------

def test_each_stream_has_its_own_workspace_and_reuses_it(lt):
    for stream in (10, 11, 12, 10, 11):
        run(lt, stream)
    ws = {m[1]: m[2] for m in matmuls(lt.log)}
    assert len(set(ws.values())) == 3 and len(workspace_allocs(lt.log)) == 3
    assert [m[1:3] for m in matmuls(lt.log)][3:] == [(10, ws[10]), (11, ws[11])], "the same one again"
    assert all(m[3] == WS_SIZE - cublaslt._SCRATCH for m in matmuls(lt.log)), "the scratch bytes kept out"
    assert_no_two_streams_share()


def test_every_pooled_gemm_waits_for_the_workspaces_last_use_and_records_its_own(lt):
    run(lt, 10)
    run(lt, 10, spec=SPEC_FP8, out_amax=FakeArray((1,), np.float32, 0x3000000))
    events = [e[1] for e in lt.log if e[0] == "event"]
    assert len(events) == 1
    steps = [e[0] for e in lt.log if e[0] in ("wait", "matmul", "merge_amax", "record")]
    assert steps == ["wait", "matmul", "record", "wait", "matmul", "merge_amax", "record"], \
        "the record follows the amax merge, which reads the scratch word inside the workspace"
    assert all(e[1:] in ((10, events[0]), (events[0], 10)) for e in lt.log if e[0] in ("wait", "record"))
    ws = matmuls(lt.log)[0][2]
    merge = next(e for e in lt.log if e[0] == "merge_amax")
    assert (merge[1]["x"], merge[1]["amax_out"]) == (ws + WS_SIZE - cublaslt._SCRATCH, 0x3000000), \
        "scratch at the workspace's end"


def test_many_streams_stay_within_the_bound(lt):
    for stream in range(100, 300):
        run(lt, stream)
        assert_no_two_streams_share()
    assert len(workspace_allocs(lt.log)) == BOUND
    assert len(cublaslt._workspaces[0]) == BOUND
    assert len({e[1] for e in lt.log if e[0] == "event"}) == BOUND


def test_a_workspace_taken_over_waits_for_its_previous_stream(lt):
    """Beyond the bound, a new stream takes the least recently used workspace; it waits for the event recorded
    after that workspace's last GEMM (on the old stream), so the two never run on it at once. The old stream,
    back, takes another one over, waiting likewise."""
    for stream in range(1, BOUND + 1):
        run(lt, stream)
    first = {m[1]: m[2] for m in matmuls(lt.log)}
    recorded = {e[2]: e[1] for e in lt.log if e[0] == "record"}  # stream -> event of its workspace
    lt.log.clear()
    run(lt, 99)
    assert [e[0] for e in lt.log] == ["is_capturing", "alloc", "wait", "matmul", "record"], "no new workspace"
    assert lt.log[2] == ("wait", 99, recorded[1]) and lt.log[3][2] == first[1]
    lt.log.clear()
    run(lt, 1)
    assert lt.log[2] == ("wait", 1, recorded[2]) and lt.log[3][2] == first[2]
    assert_no_two_streams_share()


def test_per_thread_default_streams_have_one_workspace_per_thread(lt):
    """cudaStreamPerThread is the handle 2 in every thread, a different stream in each."""
    barrier = threading.Barrier(2)

    def worker():
        barrier.wait()
        run(lt, cublaslt._PER_THREAD_STREAM)
        barrier.wait()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ws = [m[2] for m in matmuls(lt.log)]
    assert len(ws) == 2 and ws[0] != ws[1]


# ---- inside a graph capture ----------------------------------------------------------------------------------

def test_torch_capture_takes_a_workspace_of_its_own_from_torchs_allocator(lt):
    """Graphs captured on one stream and replayed on several would share a pooled workspace: each captured GEMM
    allocates its own (torch keeps it in the graph's private pool), the pool untouched, no event calls."""
    lt.runtime.capturing = True
    amax = FakeArray((1,), np.float32, 0x3000000)
    run(lt, 7, "torch", SPEC_FP8, amax)
    run(lt, 7, "torch", SPEC_FP8, amax)
    allocs = workspace_allocs(lt.log)
    assert len(allocs) == 2 and all(e[2] == "torch" for e in allocs)
    ws = [m[2] for m in matmuls(lt.log)]
    assert ws[0] != ws[1] and cublaslt._workspaces == {}
    assert not [e for e in lt.log if e[0] in ("event", "wait", "record")]
    assert [p[1][4] for p in lt.plans_made] == [w + WS_SIZE - cublaslt._SCRATCH for w in ws], "scratch inside it"
    assert lt.plans_made[0][0] == WS_SIZE - cublaslt._SCRATCH


def test_cupy_capture_runs_without_a_workspace(lt):
    """A workspace from CuPy's pool would be freed while the graph reads it: none (cuBLASLt picks an algorithm
    that needs none), planned apart from the pooled plan of the same spec."""
    run(lt, 7)
    lt.runtime.capturing = True
    run(lt, 7)
    (pooled, captured) = matmuls(lt.log)
    assert pooled[2:4] == (pooled[2], WS_SIZE - cublaslt._SCRATCH) and captured[2:4] == (0, 0)
    assert [p[0] for p in lt.plans_made] == [WS_SIZE - cublaslt._SCRATCH, 0]
    assert len(workspace_allocs(lt.log)) == 1


def test_cupy_capture_refuses_out_amax_before_anything_is_made(lt):
    lt.runtime.capturing = True
    with pytest.raises(ValueError, match="^out_amax: cuBLASLt writes the output's amax to a device scratch word, "
                                         "which a graph captured with CuPy would read after it is freed"):
        run(lt, 7, spec=SPEC_FP8, out_amax=FakeArray((1,), np.float32, 0x3000000))
    assert lt.log == [("is_capturing", 7)]


def test_torch_capture_keeps_out_amax(lt):
    lt.runtime.capturing = True
    run(lt, 7, "torch", SPEC_FP8, FakeArray((1,), np.float32, 0x3000000))
    assert [e[0] for e in lt.log if e[0] in ("matmul", "merge_amax")] == ["matmul", "merge_amax"]


# ---- handles and plans of threads that end ---------------------------------------------------------------------

def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    gc.collect()
    return out[0]


def test_a_thread_that_ends_gives_its_handle_back(lt):
    h1 = _in_thread(lambda: cublaslt._handle(0))
    assert cublaslt._handle_pool == {0: [h1]}
    h2 = _in_thread(lambda: cublaslt._handle(0))
    assert h2 == h1 and lt.handles == 1, "reused, not created again"
    assert cublaslt._handle_pool == {0: [h1]}


def test_live_threads_hold_distinct_handles(lt):
    barrier, got = threading.Barrier(3), []

    def worker():
        got.append((cublaslt._handle(0), cublaslt._handle(0), cublaslt._handle(1)))
        barrier.wait()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    assert len({g[0] for g in got}) == 2 and all(g[0] == g[1] for g in got), "one per thread and device"
    for t in threads:
        t.join()
    gc.collect()
    assert sorted(cublaslt._handle_pool[0]) == sorted(g[0] for g in got) and len(cublaslt._handle_pool[1]) == 2
    for _ in range(5):
        _in_thread(lambda: (cublaslt._handle(0), cublaslt._handle(1)))
    assert lt.handles == 4, "the pool's handles serve later threads"


def test_a_thread_that_ends_destroys_its_plans(lt):
    _in_thread(lambda: run(lt, 10))
    assert sorted(lt.destroyed) == [0, 1, 2, 3, 4], "the plan's descriptor and its four layouts"
    assert len(cublaslt._handle_pool[0]) == 1


def test_a_lease_gives_back_to_the_pool_and_bindings_it_was_made_with(monkeypatch):
    """The H200 run of 2026-11-27: a main-thread lease made under this file's stand-ins was collected after they
    were restored, and gave its stand-in handle to the real pool; a later GEMM on a thread with no handle took it
    and cuBLASLt's heuristic segfaulted. A lease gives its handles back to the pool it was made with, and its
    plans to the bindings that made them."""
    real_pool, real_bindings = cublaslt._handle_pool, cublaslt.lt_bindings
    before = {device: list(handles) for device, handles in real_pool.items()}
    fake, stand_in_pool, local = FakeLt([]), {}, threading.local()
    with monkeypatch.context() as m:
        m.setattr(cublaslt, "lt_bindings", lambda: fake)
        m.setattr(cublaslt, "_handle_pool", stand_in_pool)
        m.setattr(cublaslt, "_local", local)
        handle = cublaslt._handle(0)
        cublaslt._plans()["key"] = cublaslt._Plan(7, (8, 9, 10, 11), None, False)
    assert cublaslt._handle_pool is real_pool and cublaslt.lt_bindings is real_bindings
    del local
    gc.collect()
    assert stand_in_pool == {0: [handle]} and sorted(fake.destroyed) == [7, 8, 9, 10, 11]
    assert cublaslt._handle_pool == before, "the stand-in's handle reached the real pool"
