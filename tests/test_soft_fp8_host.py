"""The software fp8 conversion of cuda/common.cuh (the sm_80/86 path), compiled for the host with the system's
C++ compiler and checked bit for bit against the CPU reference, without a GPU.

soft_cvt and fp8_to_f32 use only integer operations and bit casts, so the same source means the same bits on
the host; they are cut out of common.cuh as they are, with shims for the CUDA intrinsics they call.
"""

import shutil
import subprocess

import numpy as np
import pytest

import fp8core
from fp8core import _kernels
from fp8core.formats import ROWS

KERNEL_ROWS = [row for row in ROWS if row.index is not None]  # every encoding the kernels convert

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (c++, g++ or clang++) on PATH")

SHIMS = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32;
#define __device__
#define __forceinline__ inline
static constexpr u32 F32_NAN = 0x7fffffffu;
static constexpr u32 F32_INF = 0x7f800000u;
static inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __clz(u32 x) { return x ? __builtin_clz(x) : 32; }
"""

# Per input, one code of each encoding; then every code's value in each encoding.
MAIN = r"""
int main() {
  std::vector<u32> in;
  u32 b;
  while (std::fread(&b, 4, 1, stdin) == 1) in.push_back(b);
  for (u32 x : in) {
    const u8 r[] = {CODES};
    std::fwrite(r, 1, sizeof r, stdout);
  }
  for (u32 c = 0; c < 256; ++c) {
    const float d[] = {VALUES};
    std::fwrite(d, 4, sizeof d / 4, stdout);
  }
  return 0;
}
""".replace("CODES", ", ".join(f"(u8)soft_cvt<{r.name}>(__uint_as_float(x))" for r in KERNEL_ROWS)).replace(
    "VALUES", ", ".join(f"fp8_to_f32<{r.name}>(c)" for r in KERNEL_ROWS))


def _cut(source: str, start: str, end: str) -> str:
    return source[source.index(start):source.index(end)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    src = (_kernels.cuda_dir() / "common.cuh").read_text()
    code = SHIMS + _cut(src, "#ifndef FP8CORE_ENCODINGS", "static constexpr u32 F32_NAN") + \
        _cut(src, "template <int FMT>\n__device__ __forceinline__ u32 soft_cvt", "// Two codes, lo in bits") + \
        _cut(src, "template <int FMT>\n__device__ __forceinline__ float fp8_to_f32", "// Two fp8 codes") + MAIN
    d = tmp_path_factory.mktemp("soft")
    (d / "soft.cpp").write_text(code)
    encodings = [o for o in _kernels.module_options(False)
                 if o.startswith(("-DFP8CORE_ENCODINGS=", "-DFP8CORE_FP4_ENCODINGS="))]
    subprocess.run([CXX, "-O1", "-std=c++17", *encodings, str(d / "soft.cpp"), "-o", str(d / "soft")], check=True,
                   capture_output=True)
    return d / "soft"


def inputs() -> np.ndarray:
    """Every bf16 value, every f16 value, a stride through all fp32 patterns, and each format's boundaries
    (ties between neighbours, the saturation edge, the subnormal edge) with their one-ulp neighbours."""
    rng = np.random.default_rng(7)
    bf16 = np.arange(65536, dtype=np.uint32) << 16
    f16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    stride = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    edges = []
    for row in KERNEL_ROWS:
        codes = np.arange(256, dtype=np.uint8).view(row.numpy_dtype).astype(np.float32)
        codes = np.sort(codes[np.isfinite(codes)])
        mids = ((codes[1:].astype(np.float64) + codes[:-1]) / 2).astype(np.float32)
        edges += [codes, mids, np.float32(row.max) * np.float32(1.0625)]
    e = np.concatenate([np.atleast_1d(v) for v in edges]).astype(np.float32).view(np.uint32)
    near = np.concatenate([e, e + 1, e - 1, e | 0x80000000])
    return np.concatenate([bf16, f16, stride, near, rng.integers(0, 1 << 32, 100000, dtype=np.uint64)
                           .astype(np.uint32)])


def test_soft_conversion_matches_the_contract(harness):
    bits = inputs()
    out = subprocess.run([str(harness)], input=bits.tobytes(), check=True, capture_output=True).stdout
    n = len(KERNEL_ROWS)
    q = np.frombuffer(out[:n * bits.size], np.uint8).reshape(-1, n)
    x = bits.view(np.float32)
    for k, row in enumerate(KERNEL_ROWS):
        ref = fp8core.quantize(x, 1.0, row.dtype_name).view(np.uint8)
        bad = np.nonzero(q[:, k] != ref)[0]
        assert bad.size == 0, (f"{row}: {bad.size} differ, e.g. x bits {bits[bad[:5]]}: {q[bad[:5], k]} vs "
                               f"{ref[bad[:5]]}")
    dec = np.frombuffer(out[n * bits.size:], np.float32).reshape(256, n)
    for k, row in enumerate(KERNEL_ROWS):
        codes = np.arange(256, dtype=np.uint8).view(row.numpy_dtype)
        ref = fp8core.dequantize(codes, 1.0, "float32")
        nan = np.isnan(ref)
        np.testing.assert_array_equal(dec[~nan, k].view(np.uint32), ref[~nan].view(np.uint32))
        assert np.isnan(dec[nan, k]).all()
