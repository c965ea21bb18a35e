// dequantize: y = ROUND_TO(out, fp32(q) * scale_inv), canonical NaN.
#include "common.cuh"

namespace fp8core {

template <int FMT, typename OUT>
__device__ __forceinline__ OUT dequant_one(float f, float s) {
  return from_f32_out(mul_rn(f, s), (OUT*)nullptr);
}

template <int FMT, typename OUT>
__global__ void dequantize_kernel(const u8* __restrict__ q, OUT* __restrict__ y, const float* __restrict__ scale_inv,
                                  i64 n) {
  const float s = *scale_inv;
  const i64 start = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  struct alignas(16) Pack { OUT v[8]; };
  // Peel q to 16 bytes; the body reads 8 codes (one 8-byte load) and writes one or two 16-byte stores.
  const Split sp = split8<1, sizeof(OUT), 16>(q, y, n);
  const u8* __restrict__ qb = q + sp.head;
  OUT* __restrict__ yb = y + sp.head;
  for (i64 v = start; v < sp.nv; v += stride) {
    const uint2 w = *reinterpret_cast<const uint2*>(qb + v * 8);
    Pack r;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float lo, hi;
      fp8x2_to_f32<FMT>(((j < 2 ? w.x : w.y) >> (16 * (j & 1))) & 0xffffu, lo, hi);
      r.v[2 * j] = dequant_one<FMT, OUT>(lo, s);
      r.v[2 * j + 1] = dequant_one<FMT, OUT>(hi, s);
    }
    *reinterpret_cast<Pack*>(yb + v * 8) = r;
  }
  for (i64 i = start; i < sp.head; i += stride) y[i] = dequant_one<FMT, OUT>(fp8_to_f32<FMT>(q[i]), s);
  for (i64 i = sp.head + sp.nv * 8 + start; i < n; i += stride)
    y[i] = dequant_one<FMT, OUT>(fp8_to_f32<FMT>(q[i]), s);
}

}  // namespace fp8core
