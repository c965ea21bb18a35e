// The NVFP4 GEMM's per-tensor factor (docs/numerics.md, "FP4", GEMM): alpha = S_dec_a *rn S_dec_b from the two
// operands' global amaxes, written on the device because cuBLASLt reads it there (CUBLASLT_POINTER_MODE_DEVICE):
// the amaxes never come to the host, so the GEMM needs no synchronisation. beta = 0 is written beside it, since that
// pointer mode reads beta from the device too. Same bits as the CPU reference (backends/cpu_fp4.py gemm_alpha).
#include "nvfp4_scale.cuh"

namespace fp8core {

// S_dec of a global amax G by the global scale rule (nvfp4_scale.cuh).
__device__ __forceinline__ float s_dec_of(float g) {
  float s_enc, s_dec;
  nvfp4_global_scales(g, &s_enc, &s_dec);
  return s_dec;
}

// One thread: alpha_beta[0] = S_dec(amax_a) *rn S_dec(amax_b), alpha_beta[1] = 0.
__global__ void nvfp4_gemm_alpha_kernel(const float* __restrict__ amax_a, const float* __restrict__ amax_b,
                                        float* __restrict__ alpha_beta) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    alpha_beta[0] = mul_rn(s_dec_of(*amax_a), s_dec_of(*amax_b));
    alpha_beta[1] = 0.f;
  }
}

}  // namespace fp8core
