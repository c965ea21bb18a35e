// The NVFP4 GEMM's per-tensor factor (docs/numerics.md, "FP4", GEMM): alpha = S_dec_a *rn S_dec_b from the two
// operands' global amaxes, written on the device because cuBLASLt reads it there (CUBLASLT_POINTER_MODE_DEVICE):
// the amaxes never come to the host, so the GEMM needs no synchronisation. beta = 0 is written beside it, since that
// pointer mode reads beta from the device too. Same bits as the CPU reference (backends/cpu_fp4.py gemm_alpha).
#include "common.cuh"

namespace fp8core {

static constexpr float NVFP4_GEMM_RANGE = 2688.f;  // E4M3 max * E2M1 max, exact

// S_dec of a global amax G by the global scale rule: S_enc = 2688 /rn G (FLT_MAX where inf; 1 where G is 0, inf or
// NaN), S_dec = 1 /rn S_enc; the quotients in fp64 rounded once, as fp4_quantize.cu's nvfp4_global_scales (kept in
// its own file, which the quantize kernels' loader compiles apart; both are checked against the CPU by bits).
__device__ __forceinline__ float nvfp4_s_dec(float g) {
  const u32 a = __float_as_uint(g) & 0x7fffffffu;
  float s = 1.f;
  if (a != 0u && a < F32_INF) {
    s = d2f(f2d(NVFP4_GEMM_RANGE) / f2d(g));
    if ((__float_as_uint(s) & 0x7fffffffu) == F32_INF) s = FLT_MAX_F;
  }
  return d2f(1.0 / f2d(s));
}

// One thread: alpha_beta[0] = S_dec(amax_a) *rn S_dec(amax_b), alpha_beta[1] = 0.
__global__ void nvfp4_gemm_alpha_kernel(const float* __restrict__ amax_a, const float* __restrict__ amax_b,
                                        float* __restrict__ alpha_beta) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    alpha_beta[0] = mul_rn(nvfp4_s_dec(*amax_a), nvfp4_s_dec(*amax_b));
    alpha_beta[1] = 0.f;
  }
}

}  // namespace fp8core
