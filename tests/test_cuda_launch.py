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
