"""The CUDA launch layer's host-side logic, without a GPU: grid shares, argument layouts, capability errors and the
cuBLASLt plan cache's bound."""

import struct

import pytest

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed")
from fp8core.backends import cublaslt, cuda  # noqa: E402


@pytest.mark.parametrize("sizes", [[5, 4096, 100000], [0, 0, 7], [1 << 30, 16, 16, 0], [1] * 64, [0]])
def test_multi_blocks_by_elements(sizes):
    first = cuda._multi_blocks(sizes, 1056)
    blocks = [b - a for a, b in zip(first, first[1:])]
    assert first[0] == 0 and len(first) == len(sizes) + 1
    assert all(b >= 1 for b in blocks), "every tensor gets a block (an empty one still merges its amax 0)"
    assert all(b <= max(1, -(-n // (8 * cuda._THREADS))) for b, n in zip(blocks, sizes)), "no idle blocks"
    big = max(range(len(sizes)), key=lambda i: sizes[i])
    if sizes[big] >= 1 << 30:
        assert blocks[big] >= 1000, "a large tensor among small ones gets the GPU's share of blocks"
    assert first[-1] < 2 ** 31 - 1


def test_multi_format_is_the_struct():
    assert struct.calcsize(cuda._MULTI_FORMAT) == 2824 <= 4096
    assert cuda.arg_layout(cuda._MULTI_FORMAT) == [(0, 2824)]


def test_argument_layouts_are_naturally_aligned():
    for kernel, fmt in cuda.ARGS.items():
        for offset, size in cuda.arg_layout(fmt):
            assert offset % min(size, 8) == 0, kernel


def test_tiles_stay_within_grid_limits():
    assert cuda._tiles(64, 64) == (1, 1)
    gx, gy = cuda._tiles(1 << 20, 1 << 16)
    assert gx <= 65535 and gy <= 65535 and gx * gy >= (1 << 14) * (1 << 10)


def test_gemm_refuses_older_gpus(monkeypatch):
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 86)
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*8.6"):
        cublaslt._check_device(0)


class FakeLt:
    """Counts descriptor destruction: evicted plans must be freed."""

    def __init__(self):
        self.destroyed = []

    def matrix_layout_destroy(self, layout):
        self.destroyed.append(layout)

    def matmul_desc_destroy(self, desc):
        self.destroyed.append(desc)


def test_plan_cache_is_bounded():
    lt, plans = FakeLt(), cublaslt._plans()
    plans.clear()
    try:
        for i in range(cublaslt._PLANS_PER_THREAD + 5):
            cublaslt._remember(lt, plans, i, cublaslt._Plan(i, (10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3), None,
                                                             False))
        plans.move_to_end(5)  # a hit makes it the most recent
        cublaslt._remember(lt, plans, "new", cublaslt._Plan(-1, (-1, -1, -1, -1), None, False))
        assert 5 in plans and 6 not in plans
        assert len(plans) == cublaslt._PLANS_PER_THREAD
        assert len(lt.destroyed) == 6 * 5 and 0 not in plans and 4 not in plans
    finally:
        plans.clear()


class _RecordingPlan:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, grid, block, args, stream, cooperative=False):
        self.calls.append((grid, block, args, stream))


class _Dev:
    """A stand-in for a 1-element device array: only its pointer is read."""

    def __init__(self, ptr):
        self.data = type("Ptr", (), {"ptr": ptr})()


def test_gemm_with_no_rows_still_merges_amax_zero(monkeypatch):
    """M = 0 launches no GEMM, but out_amax still merges amax 0 (a slot holding -0.0 becomes 0, as on the CPU)."""
    calls, plans = [], []
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 90)
    monkeypatch.setattr(cublaslt, "_lt", lambda: None)  # no cuBLASLt call is made for M = 0 (nvmath not needed)
    monkeypatch.setattr(cuda, "_plan", lambda device, f, expr, threads=256: plans.append((device, f, expr))
                        or _RecordingPlan(calls))
    spec = type("Spec", (), {"m": 0, "n": 16, "out_dtype": "float8_e4m3fn"})()
    a = type("T", (), {"device": ("cuda", 3)})()
    d = cublaslt.gemm(spec, a, None, None, None, None, None, _Dev(0x1000), None, 77,
                      lambda shape, dtype, like, stream: ("D", shape))
    assert d == ("D", (0, 16))
    assert plans == [(3, "quantize.cu", "fp8core::amax_kernel<float>")]
    assert calls == [(1, cuda._THREADS, (0, 0x1000, 0), 77)], "x = null, n = 0: the kernel merges amax 0"


def test_merge_amax_packs_value_and_slot(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda, "_plan", lambda device, f, expr, threads=256: _RecordingPlan(calls))
    cuda.merge_amax(_Dev(0x2000), _Dev(0x3000), 0, 5)
    args = calls[0][2]
    assert args == (0x3000, 0x2000, 1) and struct.calcsize(cuda.ARGS["amax_kernel"]) == 24
