// amax, quantize (delayed and current scaling) and their multi-tensor forms.
#include "common.cuh"

namespace fp8core {

// Amax bits of 8 values and their quantized bytes as two words. clean_below: F32_INF where no value times scale can
// be NaN unless the value is (nan_free(0, scale)), else 0: each vector's NaN test is then one compare of its amax.
template <int FMT>
__device__ __forceinline__ uint2 quant8(const float* f, float scale, u32 clean_below, u32& m) {
  u32 m8 = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) m8 = umax(m8, abs_raw(f[j]));
  m = umax(m, nan_canonical(m8));
  if (m8 < clean_below) {
    return make_uint2(quant4<FMT, false>(f, scale), quant4<FMT, false>(f + 4, scale));
  }
  return make_uint2(quant4<FMT, true>(f, scale), quant4<FMT, true>(f + 4, scale));
}

// x[0, cnt) (cnt <= 8) into q[0, cnt), their amax into m: read one element at a time (at most one vector's worth),
// stored as two words by store_partial8 (a few stores at q's alignment, not cnt byte stores). Each code is
// quant_one's, NaN fix-up included; the codes past cnt are made from zeros and never stored.
template <typename T, int FMT>
__device__ __forceinline__ void quantize_short(const T* __restrict__ x, u8* __restrict__ q, int cnt, float scale,
                                               u32& m) {
  float f[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    f[j] = j < cnt ? to_f32(x[j]) : 0.f;
    m = umax(m, abs_bits(f[j]));
  }
  store_partial8(q, make_uint2(quant4<FMT, true>(f, scale), quant4<FMT, true>(f + 4, scale)), cnt);
}

// Quantize x[i] for i = start, start + stride, ... (in vectors of 8 after a peeled head, two vectors in flight
// per thread where q's vectors are 8-byte aligned, else one, stored by store8_misaligned; the head and the tail
// in pieces by quantize_short). REVERSE walks this thread's vectors last first: quantize_dynamic's second pass
// then starts on what its first pass read last, still in L2. Returns the amax bits of the elements read.
template <typename T, int FMT, bool REVERSE>
__device__ __forceinline__ u32 quantize_range(const T* __restrict__ x, u8* __restrict__ q, i64 n, float scale,
                                              i64 start, i64 stride) {
  u32 m = 0;
  const Split sp = split8<sizeof(T), 1, 1>(x, nullptr, n);  // x peeled to 16 bytes: its loads stay vectors
  const T* __restrict__ xb = x + sp.head;
  u8* __restrict__ qb = q + sp.head;
  const i64 cnt = stride_count(start, stride, sp.nv);
  const u32 clean_below = nan_free(0u, scale) ? F32_INF : 0u;
  if (aligned(qb, 8)) {
    for (i64 k = 0; k + 1 < cnt; k += 2) {
      const i64 v0 = start + (REVERSE ? cnt - 1 - k : k) * stride, v1 = REVERSE ? v0 - stride : v0 + stride;
      float f0[8], f1[8];
      load8(xb + v0 * 8, f0);
      load8(xb + v1 * 8, f1);
      *reinterpret_cast<uint2*>(qb + v0 * 8) = quant8<FMT>(f0, scale, clean_below, m);
      *reinterpret_cast<uint2*>(qb + v1 * 8) = quant8<FMT>(f1, scale, clean_below, m);
    }
    if (cnt & 1) {
      const i64 v = start + (REVERSE ? 0 : cnt - 1) * stride;
      float f[8];
      load8(xb + v * 8, f);
      *reinterpret_cast<uint2*>(qb + v * 8) = quant8<FMT>(f, scale, clean_below, m);
    }
  } else {  // a misaligned view of x left q off 8 bytes (every vector of it): one vector at a time, so that the
            // stores' branches add no registers
    for (i64 k = 0; k < cnt; ++k) {
      const i64 v = start + (REVERSE ? cnt - 1 - k : k) * stride;
      float f[8];
      load8(xb + v * 8, f);
      store8_misaligned(qb + v * 8, quant8<FMT>(f, scale, clean_below, m));
    }
  }
  // The head and the tail, under 8 elements each where the body is vectors (else the head is the whole range: x
  // shorter than its head, or not aligned to its own elements), by the first thread in pieces of 8, one piece at
  // a time: a loop the vector loops' registers and schedule do not feel (unrolled, or shared out over the threads,
  // it cost the fast path up to 4 instructions or 8 registers on one target or another).
  if (start == 0) {
    const i64 tail = sp.head + sp.nv * 8;
#pragma unroll 1
    for (i64 at = sp.head > 0 ? 0 : tail; at < n; at = at + 8 < sp.head ? at + 8 : (at < tail ? tail : at + 8)) {
      const i64 end = at < sp.head ? sp.head : n;
      quantize_short<T, FMT>(x + at, q + at, end - at < 8 ? (int)(end - at) : 8, scale, m);
    }
  }
  return m;
}

template <typename T>
__device__ __forceinline__ u32 amax_range(const T* __restrict__ x, i64 n, i64 start, i64 stride) {
  u32 m = 0;
  const Split sp = split8<sizeof(T), 1, 1>(x, nullptr, n);
  const T* __restrict__ xb = x + sp.head;
  const i64 cnt = stride_count(start, stride, sp.nv);
  for (i64 k = 0; k + 1 < cnt; k += 2) {
    const i64 v0 = start + k * stride;
    float f0[8], f1[8];
    load8(xb + v0 * 8, f0);
    load8(xb + (v0 + stride) * 8, f1);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, umax(abs_bits(f0[j]), abs_bits(f1[j])));
  }
  if (cnt & 1) {
    float f[8];
    load8(xb + (start + (cnt - 1) * stride) * 8, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(f[j]));
  }
  for (i64 i = start; i < sp.head; i += stride) m = umax(m, abs_bits(to_f32(x[i])));
  for (i64 i = sp.head + sp.nv * 8 + start; i < n; i += stride) m = umax(m, abs_bits(to_f32(x[i])));
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

// n may be 0: one block then merges amax 0 into the slot (a slot holding -0.0 or less becomes 0).
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
  const u32 m = quantize_range<T, FMT, false>(x, q, n, s, global_thread(), grid_threads());
  if (amax_out != nullptr) block_amax_atomic(m, amax_out);
}

// A barrier across all blocks of a cooperative launch (every block is resident). The host zeroes both words
// on the launch stream before every launch (see cuda.py, quantize_dynamic), so nothing carries over between
// launches, streams, threads or graph replays.
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
// workspace: [0] barrier count, [1] barrier generation (both zero at launch), [2 ...] one partial per block.
template <typename T, int FMT>
__global__ void quantize_dynamic_kernel(const T* __restrict__ x, u8* __restrict__ q, u32* workspace,
                                        float* __restrict__ amax_out, float* __restrict__ scale_inv_out, i64 n,
                                        float fp8_max, int margin, int power_of_2, float epsilon) {
  u32* partials = workspace + 2;
  u32 m = block_max(amax_range(x, n, global_thread(), grid_threads()));
  if (threadIdx.x == 0) ((volatile u32*)partials)[blockIdx.x] = m;
  __threadfence();
  grid_barrier(workspace, workspace + 1);
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
  quantize_range<T, FMT, true>(x, q, n, s_shared, global_thread(), grid_threads());
}

// Multi-tensor forms. The table travels by value as the kernel's parameter (no device copy per call); lists
// longer than MULTI_CHUNK are launched in chunks. Blocks are shared out by elements: tensor t owns blocks
// [first_block[t], first_block[t + 1]) of a 1-D grid (no grid.y limit), at least one each. The launch layer
// reads MULTI_CHUNK and MultiArgs from here (fp8core/_signatures.py): this is their one definition.
static constexpr int MULTI_CHUNK = 64;
struct MultiArgs {
  u64 x[MULTI_CHUNK];      // input data
  u64 q[MULTI_CHUNK];      // fp8 outputs (multi_quantize)
  u64 scale[MULTI_CHUNK];  // 1-element fp32 scales (multi_quantize)
  u64 amax[MULTI_CHUNK];   // amax slots, 0 for none
  i64 n[MULTI_CHUNK];
  u32 first_block[MULTI_CHUNK + 1];
  int count;
};

// The tensor of this block: the last t with first_block[t] <= blockIdx.x (empty ranges are skipped).
__device__ __forceinline__ int multi_tensor(const MultiArgs& a) {
  int lo = 0, hi = a.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.first_block[mid] <= blockIdx.x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__global__ void multi_amax_kernel(const __grid_constant__ MultiArgs a) {
  const int t = multi_tensor(a);
  const i64 blocks = a.first_block[t + 1] - a.first_block[t];
  const i64 start = (i64)(blockIdx.x - a.first_block[t]) * blockDim.x + threadIdx.x;
  block_amax_atomic(amax_range(reinterpret_cast<const T*>(a.x[t]), a.n[t], start, blocks * blockDim.x),
                    reinterpret_cast<u32*>(a.amax[t]));
}

template <typename T, int FMT>
__global__ void multi_quantize_kernel(const __grid_constant__ MultiArgs a) {
  const int t = multi_tensor(a);
  const i64 blocks = a.first_block[t + 1] - a.first_block[t];
  const i64 start = (i64)(blockIdx.x - a.first_block[t]) * blockDim.x + threadIdx.x;
  const float s = *reinterpret_cast<const float*>(a.scale[t]);
  const u32 m = quantize_range<T, FMT, false>(reinterpret_cast<const T*>(a.x[t]), reinterpret_cast<u8*>(a.q[t]),
                                              a.n[t], s, start, blocks * blockDim.x);
  if (a.amax[t] != 0ull) block_amax_atomic(m, reinterpret_cast<u32*>(a.amax[t]));
}

}  // namespace fp8core
