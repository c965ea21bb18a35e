// NVFP4's global scale rule (docs/numerics.md, "FP4"), one definition for the quantize and dequantize kernels
// (fp4_quantize.cu) and the GEMM's alpha (fp4_gemm.cu), which the loader compiles as separate modules.
#pragma once
#include "common.cuh"

namespace fp8core {

static constexpr float NVFP4_RANGE = 2688.f;  // E4M3 max * E2M1 max, exact

// S_enc = 2688 /rn G (FLT_MAX where inf; 1 where G is 0, inf or NaN), S_dec = 1 /rn S_enc; the quotients in fp64,
// rounded once (the correctly rounded fp32 quotient, subnormal S_dec kept).
__device__ __forceinline__ void nvfp4_global_scales(float g, float* s_enc, float* s_dec) {
  const u32 a = __float_as_uint(g) & 0x7fffffffu;
  float s = 1.f;
  if (a != 0u && a < F32_INF) {
    s = d2f(f2d(NVFP4_RANGE) / f2d(g));
    if ((__float_as_uint(s) & 0x7fffffffu) == F32_INF) s = FLT_MAX_F;
  }
  *s_enc = s;
  *s_dec = d2f(1.0 / f2d(s));
}

}  // namespace fp8core
