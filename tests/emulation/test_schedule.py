"""The emulator's scheduler and shared memory against kernels with planted bugs: a missing barrier must read stale
data whichever way data flows between the threads (runtime.cpp's two fixed orders), a race the fixed orders cannot
show must show under seeded random orders (reproducible by seed), and shared memory no thread of the block wrote
must read as poison, not as zeros or the previous block's data (build.py's poison_shared)."""

import ctypes

import numpy as np
import pytest

import build

# Thread t writes s[t], then, with no __syncthreads, reads the word of its neighbour below (DOWN) or above (the
# first or last thread its own).
PROBE = """
template <bool DOWN>
__global__ void neighbour_kernel(unsigned* out) {
  __shared__ unsigned s[64];
  const unsigned t = threadIdx.x, n = blockDim.x;
  s[t] = 1000u * blockIdx.x + t + 1u;
  out[blockIdx.x * n + t] = s[DOWN ? (t > 0u ? t - 1u : t) : (t + 1u < n ? t + 1u : t)];
}
"""
NAMES = ("neighbour_kernel<true>", "neighbour_kernel<false>")


def _run(lib, kernel: int, blocks: int, threads: int, seed: int = 0) -> np.ndarray:
    out = np.zeros(blocks * threads, np.uint32)
    arg = ctypes.c_void_p(out.ctypes.data)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    err = ctypes.create_string_buffer(512)
    rc = lib.fp8emu_launch(kernel, blocks, 1, threads, 1, params, 1, 30.0, 0, 1 << 62, seed, err, len(err))
    assert rc == 0, err.value.decode()
    return out


def _load(code: str, names: tuple[str, ...], filename: str, headers: dict | None = None, options=()):
    lib = ctypes.CDLL(str(build.build_module(code, headers or {}, tuple(options), 80, names, filename)))
    lib.fp8emu_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_ulonglong,
                                  ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
    return lib


@pytest.mark.parametrize("kernel", range(len(NAMES)), ids=NAMES)
def test_a_missing_barrier_reads_stale_data_either_way(kernel):
    lib = _load(PROBE, NAMES, "probe.cu")
    blocks, threads = 4, 64
    got = _run(lib, kernel, blocks, threads).reshape(blocks, threads)
    t = np.arange(threads)
    neighbour = np.maximum(t - 1, 0) if NAMES[kernel].endswith("<true>") else np.minimum(t + 1, threads - 1)
    with_barrier = 1000 * np.arange(blocks)[:, None] + neighbour[None, :] + 1
    assert (got != with_barrier).any(), "every thread saw its neighbour's write: the race went unseen"


def test_a_module_is_keyed_by_what_it_includes():
    """The module's cache entry changes with the headers its source reaches (directly or through another) and with
    nothing else offered: an edit of one kernel file rebuilds that module alone."""
    code = '#include "a.cuh"\n__global__ void k(unsigned* out) { out[threadIdx.x] = A + B; }\n'
    headers = {"a.cuh": '#include "b.cuh"\nconstexpr unsigned A = 1;\n', "b.cuh": "constexpr unsigned B = 2;\n",
               "c.cuh": "constexpr unsigned C = 3;\n"}
    first = build.build_module(code, headers, (), 80, ("k",), "keyed.cu")
    assert build.build_module(code, {**headers, "c.cuh": "constexpr unsigned C = 4;\n"}, (), 80, ("k",),
                              "keyed.cu") == first
    assert build.build_module(code, {**headers, "b.cuh": "constexpr unsigned B = 5;\n"}, (), 80, ("k",),
                              "keyed.cu") != first


# Planted: the first and the last thread both publish the block's value, and the others read it with no barrier.
# In either fixed order every reader runs after one of the two writers, so the race goes unseen; a random order
# runs some reader before both.
TWO_WRITERS = """
__global__ void two_writers_kernel(unsigned* out) {
  __shared__ unsigned v;
  const unsigned t = threadIdx.x, n = blockDim.x;
  if (t == 0u || t + 1u == n) v = 1000u + blockIdx.x;
  out[blockIdx.x * n + t] = v;
}
"""


def test_a_race_the_fixed_orders_miss_shows_under_seeded_orders():
    lib = _load(TWO_WRITERS, ("two_writers_kernel",), "two_writers.cu")
    blocks, threads = 4, 64
    published = np.repeat(1000 + np.arange(blocks), threads)
    assert (_run(lib, 0, blocks, threads, seed=0) == published).all(), "the fixed orders were to miss this race"
    for seed in (1, 2, 3, 0xFFFFFFFFFFFFFFFF):
        assert (_run(lib, 0, blocks, threads, seed=seed) != published).any(), f"seed {seed}: the race went unseen"


# The order the threads of a block run in: each takes a ticket when it runs (fibers run one at a time).
ORDER = """
__global__ void order_kernel(unsigned* out) {
  __shared__ unsigned next;
  if (threadIdx.x == 0u) next = 0u;
  __syncthreads();
  const unsigned ticket = next;
  next = ticket + 1u;
  out[blockIdx.x * blockDim.x + threadIdx.x] = ticket;
}
"""


def test_seeded_orders_are_reproducible_and_vary():
    lib = _load(ORDER, ("order_kernel",), "order.cu")
    blocks, threads = 3, 96
    fixed = _run(lib, 0, blocks, threads).reshape(blocks, threads)
    t = np.arange(threads)
    # the tickets are taken in round 1, decreasing in block 0 and increasing in block 1 (parity alternates)
    assert (fixed[0] == threads - 1 - t).all() and (fixed[1] == t).all()
    a, b = (_run(lib, 0, blocks, threads, seed=42).reshape(blocks, threads) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    assert all(sorted(row) == list(t) for row in a), "every thread runs once"
    assert len({row.tobytes() for row in a}) == blocks, "each block has its own order"
    assert not any((row == t).all() or (row == threads - 1 - t).all() for row in a)
    assert (_run(lib, 0, blocks, threads, seed=43).reshape(blocks, threads) != a).any()


# Thread t reads s[t] before any thread of the block wrote it, then writes it.
UNWRITTEN = """
__global__ void unwritten_kernel(unsigned* out) {
  __shared__ unsigned s[64];
  const unsigned t = threadIdx.x;
  out[blockIdx.x * blockDim.x + t] = s[t];
  __syncthreads();
  s[t] = 1u + blockIdx.x;
}
"""


def test_unwritten_shared_memory_reads_as_poison():
    """Not zeros (a fresh thread_local) and not the previous block's data (one OS thread runs every block here)."""
    lib = _load(UNWRITTEN, ("unwritten_kernel",), "unwritten.cu")
    got = _run(lib, 0, 6, 64).reshape(6, 64)
    assert set(np.unique(got)) <= {0x7F7F7F7F, 0xFFFFFFFF}, np.unique(got)
    assert len(set(np.unique(got))) == 2, "the poison alternates from block to block"


# Planted in the real block reduction of common.cuh: warp 0 reads one partial past the block's warps.
BLOCK_MAX = """
#include "common.cuh"
__global__ void block_max_kernel(const float* x, unsigned* out) {
  const unsigned m = fp8core::block_max(fp8core::abs_bits(x[blockIdx.x * blockDim.x + threadIdx.x]));
  if (threadIdx.x == 0) out[blockIdx.x] = m;
}
"""


@pytest.mark.parametrize("planted", [False, True], ids=["as_written", "lane_le_nwarps"])
def test_a_read_past_the_written_partials_is_caught(planted):
    from fp8core import _kernels

    common = (_kernels.cuda_dir() / "common.cuh").read_text()
    if planted:
        assert "lane < nwarps ? partial[lane]" in common
        common = common.replace("lane < nwarps ? partial[lane]", "lane <= nwarps ? partial[lane]")
    lib = _load(BLOCK_MAX, ("block_max_kernel",), "block_max.cu", {"common.cuh": common},
                _kernels.module_options(False))
    blocks, threads = 4, 64
    x = np.random.default_rng(5).standard_normal(blocks * threads).astype(np.float32)
    out = np.zeros(blocks, np.uint32)
    args = (ctypes.c_void_p * 2)(x.ctypes.data, out.ctypes.data)  # laid out as the kernel's parameters
    params = (ctypes.c_void_p * 2)(ctypes.addressof(args), ctypes.addressof(args) + ctypes.sizeof(ctypes.c_void_p))
    err = ctypes.create_string_buffer(512)
    rc = lib.fp8emu_launch(0, blocks, 1, threads, 1, params, 1, 30.0, 0, 1 << 62, 0, err, len(err))
    assert rc == 0, err.value.decode()
    want = np.abs(x).reshape(blocks, threads).max(axis=1).view(np.uint32)
    assert (out == want).all() != planted
