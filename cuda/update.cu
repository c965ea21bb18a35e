// The batched delayed-scaling update and the standalone scale rule.
#include "common.cuh"

namespace fp8core {

// One thread per tensor column j; the W warps of a block split the history rows 1..L-1 between them
// (coalesced: lanes are adjacent tensors). Every warp reads what it needs before any warp writes.
template <bool ALGO_MAX>
__global__ void update_kernel(float* __restrict__ history, float* __restrict__ scale, float* __restrict__ scale_inv,
                              const float* __restrict__ fp8_max, u8* __restrict__ non_finite, i64 n, int L,
                              int margin, int power_of_2, float epsilon, int update_scale, int* step,
                              int interval) {
  __shared__ u32 warp_amax[32][33];
  __shared__ int step_now;
  // interval > 1: the step counter lives on the device (step[0] = steps % interval, step[1] = blocks done), so a
  // captured graph replays the schedule. Thread (0, 0) reads it once; the last block to finish advances it.
  if (step != nullptr && threadIdx.x == 0 && threadIdx.y == 0) step_now = *(volatile int*)step;
  __syncthreads();
  if (step != nullptr) update_scale = step_now == 0;
  const int lane = threadIdx.x, w = threadIdx.y, W = blockDim.y;
  const i64 j = (i64)blockIdx.x * 32 + lane;
  const bool active = j < n;
  const float cur = active ? history[j] : 0.f;
  const bool ran = active && (__float_as_uint(cur) & 0x7fffffffu) != 0u;
  const int per = (L - 1 + W - 1) / W;
  const int r0 = 1 + w * per, r1 = min(L, r0 + per);
  u32 m = 0;
  float boundary = cur;  // what lands in row r1 - 1: the next range's first row, or cur for the last range
  if (ran) {
    if (ALGO_MAX) {
#pragma unroll 8
      for (int i = r0; i < r1; ++i) m = umax(m, abs_bits(history[(i64)i * n + j]));
    }
    if (r1 < L) boundary = history[(i64)r1 * n + j];
  }
  warp_amax[w][lane] = m;
  __syncthreads();
  if (active && w == 0) {
    if (non_finite != nullptr) non_finite[j] = (__float_as_uint(cur) & 0x7fffffffu) >= F32_INF;
    if (ran && update_scale) {
      u32 a = abs_bits(cur);
      if (ALGO_MAX)
        for (int k = 0; k < W; ++k) a = umax(a, warp_amax[k][lane]);
      float s, s_inv;
      if (scale_from_amax(__uint_as_float(a), fp8_max[j], margin, power_of_2 != 0, epsilon, &s, &s_inv)) {
        scale[j] = s;
        scale_inv[j] = s_inv;
      }
    }
  }
  if (ran) {
    // The roll in chunks of 8: eight loads in flight, then eight stores (rows i..i+7 take rows i+1..i+8; the
    // next chunk reads from row i+9 on, which no store has touched yet).
    int i = r0;
    for (; i + 8 < r1; i += 8) {
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = history[(i64)(i + 1 + k) * n + j];
#pragma unroll
      for (int k = 0; k < 8; ++k) history[(i64)(i + k) * n + j] = v[k];
    }
    for (; i + 1 < r1; ++i) history[(i64)i * n + j] = history[(i64)(i + 1) * n + j];
    if (r0 < r1) history[(i64)(r1 - 1) * n + j] = boundary;
    if (w == 0) history[j] = 0.f;
  }
  if (step != nullptr && threadIdx.x == 0 && threadIdx.y == 0) {
    __threadfence();  // this block's read of step[0] is done before it counts itself finished
    if (atomicAdd(step + 1, 1) == (int)gridDim.x - 1) {
      step[0] = step_now + 1 == interval ? 0 : step_now + 1;
      step[1] = 0;
    }
  }
}

// (scale, scale_inv) from amax elementwise; where there is no new scale: previous (when given) or 1.
// fp8_max: one per element, or nullptr for fp8_max_value everywhere.
__global__ void compute_scale_kernel(const float* __restrict__ amax, const float* __restrict__ fp8_max,
                                     float fp8_max_value, float* __restrict__ scale, float* __restrict__ scale_inv,
                                     u8* __restrict__ ok, const float* __restrict__ previous, i64 previous_size,
                                     i64 n, int margin, int power_of_2, float epsilon) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s, s_inv;
  const bool fresh = scale_from_amax(amax[i], fp8_max != nullptr ? fp8_max[i] : fp8_max_value, margin,
                                     power_of_2 != 0, epsilon, &s, &s_inv);
  if (!fresh) {
    s = previous != nullptr ? previous[previous_size == 1 ? 0 : i] : 1.f;
    s_inv = d2f(1.0 / f2d(s));
  }
  scale[i] = s;
  scale_inv[i] = s_inv;
  if (ok != nullptr) ok[i] = fresh;
}

// out[i] = value: a host scalar reaches the device as a kernel parameter, on the caller's stream, with no
// host-to-device copy (so it can be captured in a CUDA graph).
__global__ void fill_kernel(u32* __restrict__ out, u32 value, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) out[i] = value;
}

}  // namespace fp8core
