// amax, quantize (delayed and current scaling) and their multi-tensor forms.
#include "common.cuh"

namespace fp8core {

// Quantize x[i] for i = start, start + stride, ... (in vectors of 8 when both pointers allow it).
// Returns the amax bits of the elements this thread read.
template <typename T, int FMT>
__device__ __forceinline__ u32 quantize_range(const T* __restrict__ x, u8* __restrict__ q, i64 n, float scale,
                                              i64 start, i64 stride) {
  u32 m = 0;
  i64 done = 0;
  if (aligned(x, 16) && aligned(q, 8)) {
    const i64 nv = n / 8;
    for (i64 v = start; v < nv; v += stride) {
      float f[8];
      load8(x + v * 8, f);
      u32 w[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
#pragma unroll
        for (int j = 0; j < 4; ++j) m = umax(m, abs_bits(f[4 * k + j]));
        w[k] = quant_pair<FMT>(f[4 * k], f[4 * k + 1], scale) | (quant_pair<FMT>(f[4 * k + 2], f[4 * k + 3], scale) << 16);
      }
      *reinterpret_cast<uint2*>(q + v * 8) = make_uint2(w[0], w[1]);
    }
    done = nv * 8;
  }
  for (i64 i = done + start; i < n; i += stride) {
    const float f = to_f32(x[i]);
    m = umax(m, abs_bits(f));
    q[i] = quant_one<FMT>(f, scale);
  }
  return m;
}

template <typename T>
__device__ __forceinline__ u32 amax_range(const T* __restrict__ x, i64 n, i64 start, i64 stride) {
  u32 m = 0;
  i64 done = 0;
  if (aligned(x, 16)) {
    const i64 nv = n / 8;
    for (i64 v = start; v < nv; v += stride) {
      float f[8];
      load8(x + v * 8, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(f[j]));
    }
    done = nv * 8;
  }
  for (i64 i = done + start; i < n; i += stride) m = umax(m, abs_bits(to_f32(x[i])));
  return m;
}

__device__ __forceinline__ i64 global_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }

// The scale a block quantizes with: read (delayed scaling) or made from an amax (current scaling);
// block 0 then writes scale_inv.
__device__ __forceinline__ float block_scale(const float* scale, const float* amax_in, float* scale_inv_out,
                                             float fp8_max, int margin, int power_of_2, float epsilon) {
  if (amax_in == nullptr) return *scale;
  float s = 1.f, s_inv = 1.f;
  scale_from_amax(*amax_in, fp8_max, margin, power_of_2 != 0, epsilon, &s, &s_inv);
  if (blockIdx.x == 0 && threadIdx.x == 0 && scale_inv_out != nullptr) *scale_inv_out = s_inv;
  return s;
}

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, u32* __restrict__ amax_out, i64 n) {
  block_amax_atomic(amax_range(x, n, global_thread(), grid_threads()), amax_out);
}

template <typename T, int FMT>
__global__ void quantize_kernel(const T* __restrict__ x, u8* __restrict__ q, const float* __restrict__ scale,
                                const float* __restrict__ amax_in, u32* __restrict__ amax_out,
                                float* __restrict__ scale_inv_out, i64 n, float fp8_max, int margin,
                                int power_of_2, float epsilon) {
  const float s = block_scale(scale, amax_in, scale_inv_out, fp8_max, margin, power_of_2, epsilon);
  const u32 m = quantize_range<T, FMT>(x, q, n, s, global_thread(), grid_threads());
  if (amax_out != nullptr) block_amax_atomic(m, amax_out);
}

// A barrier across all blocks of a cooperative launch (every block is resident). The counter returns to 0
// after each use, and the generation only grows, so the two words can be reused launch after launch.
__device__ __forceinline__ void grid_barrier(u32* count, volatile u32* generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 gen = *generation;
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      *count = 0;
      __threadfence();
      atomicAdd((u32*)generation, 1u);
    } else {
      while (*generation == gen) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Current scaling in one launch: amax partials, a grid barrier, the scale in every block, then the cast.
// The second read of x hits L2 for tensors that fit there.
template <typename T, int FMT>
__global__ void quantize_dynamic_kernel(const T* __restrict__ x, u8* __restrict__ q, u32* partials, u32* barrier,
                                        float* __restrict__ amax_out, float* __restrict__ scale_inv_out, i64 n,
                                        float fp8_max, int margin, int power_of_2, float epsilon) {
  u32 m = block_max(amax_range(x, n, global_thread(), grid_threads()));
  if (threadIdx.x == 0) ((volatile u32*)partials)[blockIdx.x] = m;
  __threadfence();
  grid_barrier(barrier, barrier + 1);
  m = 0;
  for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) m = umax(m, ((volatile u32*)partials)[b]);
  m = block_max(m);
  __shared__ float s_shared;
  if (threadIdx.x == 0) {
    float s = 1.f, s_inv = 1.f;
    scale_from_amax(__uint_as_float(m), fp8_max, margin, power_of_2 != 0, epsilon, &s, &s_inv);
    s_shared = s;
    if (blockIdx.x == 0) {
      *amax_out = __uint_as_float(m);
      *scale_inv_out = s_inv;
    }
  }
  __syncthreads();
  quantize_range<T, FMT>(x, q, n, s_shared, global_thread(), grid_threads());
}

// Multi-tensor forms: blockIdx.y is the tensor; pointers, sizes and slots come as device arrays.
template <typename T>
__global__ void multi_amax_kernel(const u64* __restrict__ ptrs, const i64* __restrict__ sizes,
                                  u32* __restrict__ out) {
  const int t = blockIdx.y;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  block_amax_atomic(amax_range(reinterpret_cast<const T*>(ptrs[t]), sizes[t], global_thread(), stride), out + t);
}

template <typename T, int FMT>
__global__ void multi_quantize_kernel(const u64* __restrict__ x_ptrs, const u64* __restrict__ q_ptrs,
                                      const i64* __restrict__ sizes, const u64* __restrict__ scale_ptrs,
                                      const u64* __restrict__ amax_ptrs) {
  const int t = blockIdx.y;
  const float s = *reinterpret_cast<const float*>(scale_ptrs[t]);
  const u32 m = quantize_range<T, FMT>(reinterpret_cast<const T*>(x_ptrs[t]), reinterpret_cast<u8*>(q_ptrs[t]),
                                       sizes[t], s, global_thread(), (i64)gridDim.x * blockDim.x);
  if (amax_ptrs[t] != 0ull) block_amax_atomic(m, reinterpret_cast<u32*>(amax_ptrs[t]));
}

}  // namespace fp8core
