"""The emulator's scheduler against a kernel with a missing barrier: it must fail whichever way data flows between
the threads (runtime.cpp runs them in increasing and in decreasing order)."""

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


def _run(lib, kernel: int, blocks: int, threads: int) -> np.ndarray:
    out = np.zeros(blocks * threads, np.uint32)
    arg = ctypes.c_void_p(out.ctypes.data)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    err = ctypes.create_string_buffer(512)
    rc = lib.fp8emu_launch(kernel, blocks, 1, threads, 1, params, 1, 30.0, 0, 1 << 62, err, len(err))
    assert rc == 0, err.value.decode()
    return out


@pytest.mark.parametrize("kernel", range(len(NAMES)), ids=NAMES)
def test_a_missing_barrier_reads_stale_data_either_way(kernel):
    lib = ctypes.CDLL(str(build.build_module(PROBE, {}, (), 80, NAMES, "probe.cu")))
    lib.fp8emu_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_ulonglong,
                                  ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
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
