// cast_transpose (one read of x, q and q_t out, fused amax) and the fp8 transpose, through 64x64 tiles
// staged in padded shared memory.
#include "common.cuh"

namespace fp8core {

static constexpr int TILE = 64;
static constexpr int PAD = 4;  // row stride 68 bytes = 17 words: column reads spread over the banks
static constexpr int THREADS = 256;

struct Passthrough {};  // input already fp8 (transpose): bytes copied unchanged

template <typename T, int FMT>
__device__ __forceinline__ u8 convert_one(const T* x, i64 i, float scale, u32& m) {
  const float f = to_f32(x[i]);
  m = umax(m, abs_bits(f));
  return quant_one<FMT>(f, scale);
}
template <>
__device__ __forceinline__ u8 convert_one<Passthrough, 0>(const Passthrough* x, i64 i, float, u32&) {
  return reinterpret_cast<const u8*>(x)[i];
}

// Sixteen consecutive elements of a row into 16 bytes (4 words), vectorized.
template <typename T, int FMT>
__device__ __forceinline__ void convert16(const T* x, float scale, u32& m, u32* w) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float f[8];
    load8(x + 8 * h, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(f[j]));
    w[2 * h] = quant_pair<FMT>(f[0], f[1], scale) | (quant_pair<FMT>(f[2], f[3], scale) << 16);
    w[2 * h + 1] = quant_pair<FMT>(f[4], f[5], scale) | (quant_pair<FMT>(f[6], f[7], scale) << 16);
  }
}
template <>
__device__ __forceinline__ void convert16<Passthrough, 0>(const Passthrough* x, float, u32&, u32* w) {
  const uint4 a = *reinterpret_cast<const uint4*>(x);
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
}

// q (optional) = quantize(x); q_t = transpose(q). x is [rows, cols] row-major; one block per 64x64 tile.
template <typename T, int FMT, bool WRITE_Q>
__global__ void __launch_bounds__(THREADS) cast_transpose_kernel(
    const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ q_t, const float* __restrict__ scale_p,
    u32* __restrict__ amax_out, i64 rows, i64 cols) {
  __shared__ __align__(16) u8 tile[TILE][TILE + PAD];  // written as 32-bit words
  const i64 tiles_c = (cols + TILE - 1) / TILE;
  const i64 tile_id = blockIdx.x + (i64)blockIdx.y * gridDim.x;
  if (tile_id >= tiles_c * ((rows + TILE - 1) / TILE)) return;
  const i64 r0 = tile_id / tiles_c * TILE, c0 = tile_id % tiles_c * TILE;
  const float scale = scale_p != nullptr ? *scale_p : 1.f;
  const int t = threadIdx.x;
  u32 m = 0;
  const bool full = r0 + TILE <= rows && c0 + TILE <= cols;
  const bool vec = full && cols % 16 == 0 && rows % 16 == 0 && aligned(x, 16) && aligned(q_t, 16) &&
                   (!WRITE_Q || aligned(q, 16));
  if (vec) {
    const int r = t >> 2, g = t & 3;  // each thread: 16 columns of one row
    u32 w[4];
    convert16<T, FMT>(x + (r0 + r) * cols + c0 + 16 * g, scale, m, w);
    if (WRITE_Q) *reinterpret_cast<uint4*>(q + (r0 + r) * cols + c0 + 16 * g) = make_uint4(w[0], w[1], w[2], w[3]);
#pragma unroll
    for (int k = 0; k < 4; ++k) *reinterpret_cast<u32*>(&tile[r][16 * g + 4 * k]) = w[k];
    __syncthreads();
    const int oc = t >> 2;  // each thread: 16 rows of one column -> 16 bytes of a q_t row
    u32 o[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < 16; ++k) o[k >> 2] |= (u32)tile[16 * g + k][oc] << (8 * (k & 3));
    *reinterpret_cast<uint4*>(q_t + (c0 + oc) * rows + r0 + 16 * g) = make_uint4(o[0], o[1], o[2], o[3]);
  } else {
    for (int idx = t; idx < TILE * TILE; idx += THREADS) {
      const int r = idx / TILE, c = idx % TILE;
      if (r0 + r < rows && c0 + c < cols) {
        const i64 i = (r0 + r) * cols + c0 + c;
        const u8 b = convert_one<T, FMT>(x, i, scale, m);
        if (WRITE_Q) q[i] = b;
        tile[r][c] = b;
      }
    }
    __syncthreads();
    for (int idx = t; idx < TILE * TILE; idx += THREADS) {
      const int c = idx / TILE, r = idx % TILE;
      if (r0 + r < rows && c0 + c < cols) q_t[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
  }
  if (amax_out != nullptr) block_amax_atomic(m, amax_out);
}

}  // namespace fp8core
