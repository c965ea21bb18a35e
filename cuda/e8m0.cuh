// E8M0 block scales (docs/numerics.md, "Block scaling" and "MXFP4"): the "rceil" and "floor" rules and the
// factors a block is quantized and dequantized with. Shared by block_quantize.cu (MXFP8) and fp4_quantize.cu.
//
// "rceil" is computed on bit patterns; on a family-specific Blackwell target (sm_100f, sm_120f, ...: the loader
// compiles a file of _kernels.FAMILY_FILES for one on sm_100+, _kernels.arch_options)
// cvt.rp.satfinite.ue8m0x2.f32 does it in one instruction and gives the same byte (the GPU tests compare).
// FP8CORE_FORCE_SOFT_FP8 keeps the software one.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && !defined(FP8CORE_FORCE_SOFT_FP8) && \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) || defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FEAT_SM100_ALL))
#define FP8CORE_HW_E8M0 1
#else
#define FP8CORE_HW_E8M0 0
#endif

namespace fp8core {

static constexpr u32 E8M0_NAN = 0xffu;

// 2^k as fp32 for k in [-149, 127], from its bits (exact, subnormals included, immune to -ftz).
__device__ __forceinline__ float pow2_exact(int k) {
  return __uint_as_float(k >= -126 ? (u32)(k + 127) << 23 : 1u << (k + 149));
}

// "rceil": v = amax *rn fp32(1/fp8_max); the exponent of v rounded toward +inf, 0..254; NaN -> 0xFF.
__device__ __forceinline__ u32 e8m0_rceil(u32 amax_bits, float inv_max) {
  const float v = mul_rn(__uint_as_float(amax_bits), inv_max);
#if FP8CORE_HW_E8M0
  u16 r;
  asm("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(v));
  return r & 0xffu;
#else
  const u32 b = __float_as_uint(v);  // v >= 0 or NaN
  if (b > F32_INF) return E8M0_NAN;
  const u32 exp = b >> 23, mant = b & 0x7fffffu;
  // subnormal v: 2^-127 (mantissa 0x400000) and below round up to 2^-127 (0); above it to 2^-126 (1)
  const u32 e = exp == 0 ? (mant > 0x400000u ? 1u : 0u) : exp + (mant != 0u ? 1u : 0u);
  return e > 254u ? 254u : e;  // inf and the top binade saturate
#endif
}

// "floor" (OCP): clamp(floor(log2(amax)) - emax + 127, 0, 254); 0 -> 0, inf -> 254, NaN -> 0xFF.
__device__ __forceinline__ u32 e8m0_floor(u32 a, int emax) {
  if (a > F32_INF) return E8M0_NAN;
  if (a == F32_INF) return 254u;
  if (a == 0u) return 0u;
  const int exp = (int)(a >> 23);
  const int log2 = exp != 0 ? exp - 127 : (31 - __clz(a & 0x7fffffu)) - 149;
  const int e = log2 - emax + 127;
  return (u32)(e < 0 ? 0 : (e > 254 ? 254 : e));
}

template <bool RCEIL>
__device__ __forceinline__ u32 e8m0(u32 amax_bits, float inv_max, int emax) {
  return RCEIL ? e8m0_rceil(amax_bits, inv_max) : e8m0_floor(amax_bits, emax);
}

// 2^(127 - e), what a block is quantized with; the NaN byte gives NaN (every element then becomes 0x7F). Its bits
// are (254 - e) << 23 for e <= 253, a normal; e = 254 gives 0 there, and 2^-127 (a subnormal, 0x00400000) is the
// larger: one multiply-add and one max, without the branch or the predicated shift of pow2_exact.
__device__ __forceinline__ float e8m0_quant_factor(u32 e) {
  return e == E8M0_NAN ? __uint_as_float(F32_NAN) : __uint_as_float(umax(0x7f000000u - (e << 23), 0x00400000u));
}
// Whether no value of a block with amax bits m (abs_bits) gives a NaN when multiplied by its e8m0_quant_factor: the
// factor is a finite, non-zero power of two unless the block holds a NaN, so only a NaN value can (one compare per
// block where nan_free takes four).
__device__ __forceinline__ bool e8m0_nan_free(u32 m) { return m <= F32_INF; }
// 2^(e - 127), what dequantize multiplies by.
__device__ __forceinline__ float e8m0_value(u32 e) {
  return e == E8M0_NAN ? __uint_as_float(F32_NAN) : pow2_exact((int)e - 127);
}

}  // namespace fp8core
