// dequantize: y = ROUND_TO(out, fp32(q) * scale_inv), canonical NaN.
#include "common.cuh"

namespace fp8core {

template <int FMT, typename OUT>
__global__ void dequantize_kernel(const u8* __restrict__ q, OUT* __restrict__ y, const float* __restrict__ scale_inv,
                                  i64 n) {
  const float s = *scale_inv;
  const i64 start = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  i64 done = 0;
  struct alignas(16) Pack { OUT v[8]; };
  if (aligned(q, 8) && aligned(y, 16)) {
    const i64 nv = n / 8;
    for (i64 v = start; v < nv; v += stride) {
      const uint2 w = *reinterpret_cast<const uint2*>(q + v * 8);
      Pack r;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const u32 byte = ((j < 4 ? w.x : w.y) >> (8 * (j & 3))) & 0xffu;
        r.v[j] = from_f32_out(mul_rn(fp8_to_f32<FMT>(byte), s), (OUT*)nullptr);
      }
      *reinterpret_cast<Pack*>(y + v * 8) = r;
    }
    done = nv * 8;
  }
  for (i64 i = done + start; i < n; i += stride) y[i] = from_f32_out(mul_rn(fp8_to_f32<FMT>(q[i]), s), (OUT*)nullptr);
}

}  // namespace fp8core
