"""The software fp8 conversion of cuda/common.cuh (the sm_80/86 path), compiled for the host with the system's
C++ compiler and checked bit for bit against the CPU reference, without a GPU.

soft_cvt, soft_quad and fp8_to_f32 use integer operations, bit casts, IEEE fp32 arithmetic (correctly rounded on
the host as on the GPU) and, in soft_quad, the fp32 -> f16 conversion and the f16 min (shims as the PTX ISA defines
them), so the same source means the same bits on the host; they are cut out of common.cuh as they are, with shims
for the CUDA intrinsics and the PTX helpers they call.
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
#include <cmath>
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
static inline u32 umax(u32 a, u32 b) { return a > b ? a : b; }
static inline float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline float abs_f32(float a) { return __uint_as_float(__float_as_uint(a) & 0x7fffffffu); }
static inline float mul_rn(float a, float b) { return a * b; }  // ISO C++: not contracted
static inline float sub_rn(float a, float b) { return a - b; }
static inline u16 f16_bits(float x) {  // cvt.rn.f16.f32: RNE, subnormals kept; a NaN as the canonical 0x7FFF
  if (std::isnan(x)) return 0x7fff;
  const _Float16 h = (_Float16)x;
  u16 b;
  std::memcpy(&b, &h, 2);
  return b;
}
static inline u32 f16x2_rn(float lo, float hi) { return ((u32)f16_bits(hi) << 16) | f16_bits(lo); }
static inline u16 f16_min(u16 a, u16 b) {  // min.f16x2's half: a NaN operand gives the other
  const bool na = (a & 0x7fffu) > 0x7c00u, nb = (b & 0x7fffu) > 0x7c00u;
  if (na || nb) return na && nb ? 0x7fff : na ? b : a;
  _Float16 x, y;
  std::memcpy(&x, &a, 2);
  std::memcpy(&y, &b, 2);
  return x < y || (x == y && (a & 0x8000u)) ? a : b;
}
static inline u32 f16x2_min(u32 a, u32 b) { return ((u32)f16_min(a >> 16, b >> 16) << 16) | f16_min(a, b); }
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {  // selectors 0-7 only, as soft_pair uses
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= (u32)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
"""

# Per input, one code of each encoding, then each again as the caller that knows the input is no NaN converts
# (MAY_NAN false), then the pair (x, -x) as soft_pair converts it for such a caller (lo and hi bytes), then the four
# codes of soft_quad (x, -x, -x, x), with and without its NaN test; then every code's value in each encoding.
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
""".replace("CODES", ", ".join([f"(u8)soft_cvt<{r.name}>(__uint_as_float(x))" for r in KERNEL_ROWS] + [
    f"(u8)soft_cvt<{r.name}, false>(__uint_as_float(x))" for r in KERNEL_ROWS] + [
    f"(u8)(soft_pair<{r.name}, false>(__uint_as_float(x), -__uint_as_float(x)) >> {8 * h})"
    for r in KERNEL_ROWS for h in (0, 1)] + [
    f"(u8)(soft_quad<{r.name}, {nan}>(__uint_as_float(x), -__uint_as_float(x), -__uint_as_float(x), "
    f"__uint_as_float(x)) >> {8 * h})" for r in KERNEL_ROWS for nan in ("true", "false") for h in range(4)])).replace(
    "VALUES", ", ".join(f"fp8_to_f32<{r.name}>(c)" for r in KERNEL_ROWS))


def _cut(source: str, start: str, end: str) -> str:
    return source[source.index(start):source.index(end)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    src = (_kernels.cuda_dir() / "common.cuh").read_text()
    code = SHIMS + _cut(src, "#ifndef FP8CORE_ENCODINGS", "static constexpr u32 F32_NAN") + \
        _cut(src, "template <int FMT>\n__device__ __forceinline__ u32 soft_magnitude",
             "template <int FMT> __device__ __forceinline__ u16 cvt_pair") + \
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
    q = np.frombuffer(out[:12 * n * bits.size], np.uint8).reshape(-1, 12 * n)
    x = bits.view(np.float32)
    number = ~np.isnan(x)
    assert number.sum() < x.size  # NaN inputs are among them
    for k, row in enumerate(KERNEL_ROWS):
        ref = fp8core.quantize(x, 1.0, row.dtype_name).view(np.uint8)
        bad = np.nonzero(q[:, k] != ref)[0]
        assert bad.size == 0, (f"{row}: {bad.size} differ, e.g. x bits {bits[bad[:5]]}: {q[bad[:5], k]} vs "
                               f"{ref[bad[:5]]}")
        bad = np.nonzero(number & (q[:, n + k] != ref))[0]
        assert bad.size == 0, (f"{row}, no NaN: {bad.size} differ, e.g. x bits {bits[bad[:5]]}: "
                               f"{q[bad[:5], n + k]} vs {ref[bad[:5]]}")
        neg = fp8core.quantize(-x, 1.0, row.dtype_name).view(np.uint8)
        pair = q[:, 2 * n + 2 * k], q[:, 2 * n + 2 * k + 1]
        bad = np.nonzero(number & ((pair[0] != ref) | (pair[1] != neg)))[0]
        assert bad.size == 0, (f"{row}, soft_pair(x, -x): {bad.size} differ, e.g. x bits {bits[bad[:5]]}: "
                               f"{pair[0][bad[:5]]}, {pair[1][bad[:5]]} vs {ref[bad[:5]]}, {neg[bad[:5]]}")
        for j, may_nan in enumerate((True, False)):  # soft_quad: bytes x, -x, -x, x
            quad = q[:, 4 * n + 8 * k + 4 * j: 4 * n + 8 * k + 4 * j + 4]
            want = np.stack([ref, neg, neg, ref], axis=1)
            rows = np.ones_like(number) if may_nan else number
            bad = np.nonzero(rows & (quad != want).any(axis=1))[0]
            assert bad.size == 0, (f"{row}, soft_quad (MAY_NAN {may_nan}): {bad.size} differ, e.g. x bits "
                                   f"{bits[bad[:5]]}: {quad[bad[:5]]} vs {want[bad[:5]]}")
    dec = np.frombuffer(out[12 * n * bits.size:], np.float32).reshape(256, n)
    for k, row in enumerate(KERNEL_ROWS):
        codes = np.arange(256, dtype=np.uint8).view(row.numpy_dtype)
        ref = fp8core.dequantize(codes, 1.0, "float32")
        nan = np.isnan(ref)
        np.testing.assert_array_equal(dec[~nan, k].view(np.uint32), ref[~nan].view(np.uint32))
        assert np.isnan(dec[nan, k]).all()
