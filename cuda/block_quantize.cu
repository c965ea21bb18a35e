// Block scaling (docs/numerics.md, "Block scaling"): MXFP8 rowwise and columnwise from one read of x, 1x128 and
// 128x128 blocks with fp32 scales, and the dequantization of both. Same bits as the CPU reference.
// The E8M0 scale rules are e8m0.cuh's (their hardware form on family-specific Blackwell targets).
#include "common.cuh"
#include "e8m0.cuh"

namespace fp8core {

static constexpr int BLOCK_THREADS = 256;
static constexpr int MX = 32;         // MXFP8 block: 32 elements of a row or of a column
static constexpr int MX_TILE_R = 32;  // one CTA: a 32 x 64 tile, 8 elements per thread
static constexpr int MX_TILE_C = 64;

__device__ __forceinline__ i64 tile_index() { return blockIdx.x + (i64)blockIdx.y * gridDim.x; }

// ---- MXFP8 quantize ---------------------------------------------------------------------------------------
// x [rows, cols] -> rowwise (q, s [rows, ceil(cols/32)]) and/or columnwise (qc, sc [ceil(rows/32), cols]);
// a null q or qc skips that half. One CTA per 32 x 64 tile: thread t holds 8 consecutive elements of row t/8
// in registers (one 16- or 32-byte load), the row blocks reduce across 4 lanes, the column blocks through
// shared memory.
template <typename T, int FMT, bool RCEIL>
__global__ void __launch_bounds__(BLOCK_THREADS) mx_quantize_kernel(
    const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ s, u8* __restrict__ qc, u8* __restrict__ sc,
    i64 rows, i64 cols, float inv_max, int emax) {
  __shared__ __align__(16) float tile[MX_TILE_R][MX_TILE_C];  // float4 stores
  __shared__ u32 part[4][MX_TILE_C];
  const i64 tiles_c = (cols + MX_TILE_C - 1) / MX_TILE_C;
  const i64 id = tile_index();
  if (id >= tiles_c * ((rows + MX_TILE_R - 1) / MX_TILE_R)) return;  // the whole CTA, before any barrier
  const i64 r0 = id / tiles_c * MX_TILE_R, c0 = id % tiles_c * MX_TILE_C;
  const int t = threadIdx.x, r = t >> 3, g = t & 7;
  const i64 row = r0 + r, col = c0 + 8 * g;
  const bool in = row < rows && col < cols;
  // cols % 8 == 0 and col % 8 == 0: the 8 elements are whole, and 16-byte aligned when x is
  const bool vec = cols % 8 == 0 && aligned(x, 16);
  float f[8];
  if (in && vec) {
    load8(x + row * cols + col, f);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = in && col + j < cols ? to_f32(x[row * cols + col + j]) : 0.f;  // 0: no amax
  }

  if (q != nullptr) {
    u32 m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, abs_raw(f[j]));
    m = umax(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the 4 lanes g&~3 .. g|3 hold one 32-element block
    m = nan_canonical(umax(m, __shfl_xor_sync(0xffffffffu, m, 2)));
    const u32 e = e8m0<RCEIL>(m, inv_max, emax);
    const float factor = e8m0_quant_factor(e);
    if (in) {
      if (vec && aligned(q, 8)) {
        *reinterpret_cast<uint2*>(q + row * cols + col) = quant8_checked<FMT>(f, factor, m);
      } else {
        for (int j = 0; j < 8 && col + j < cols; ++j) q[row * cols + col + j] = quant_one<FMT>(f[j], factor);
      }
      if ((g & 3) == 0) s[row * ((cols + MX - 1) / MX) + col / MX] = (u8)e;
    }
  }

  if (qc != nullptr) {
    *reinterpret_cast<float4*>(&tile[r][8 * g]) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(&tile[r][8 * g + 4]) = make_float4(f[4], f[5], f[6], f[7]);
    __syncthreads();
    const int c = t & (MX_TILE_C - 1), h = t >> 6;  // column c, rows 8h .. 8h+7 of the tile
    float v[8];
    u32 m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = tile[8 * h + i][c];
      m = umax(m, abs_raw(v[i]));
    }
    part[h][c] = m;
    __syncthreads();
    m = nan_canonical(umax(umax(part[0][c], part[1][c]), umax(part[2][c], part[3][c])));
    const u32 e = e8m0<RCEIL>(m, inv_max, emax);
    const float factor = e8m0_quant_factor(e);
    // The codes go through shared memory so that each thread then stores 8 consecutive bytes of one qc row,
    // as the rowwise half stores q, instead of 8 bounds-checked byte stores down a column.
    __shared__ __align__(16) u8 qtile[MX_TILE_R][MX_TILE_C];
    const uint2 w = quant8_checked<FMT>(v, factor, m);
#pragma unroll
    for (int i = 0; i < 8; ++i) qtile[8 * h + i][c] = (u8)(((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xffu);
    if (h == 0 && c0 + c < cols) sc[(r0 / MX) * cols + c0 + c] = (u8)e;
    __syncthreads();
    if (in) {
      if (vec && aligned(qc, 8)) {
        *reinterpret_cast<uint2*>(qc + row * cols + col) = *reinterpret_cast<const uint2*>(&qtile[r][8 * g]);
      } else {
        for (int j = 0; j < 8 && col + j < cols; ++j) qc[row * cols + col + j] = qtile[r][8 * g + j];
      }
    }
  }
}

// ---- fp32 block scales: 1x128 blocks (one warp each) and 128x128 tiles (one CTA each) ---------------------

__device__ __forceinline__ void block_scale(u32 amax_bits, float fp8_max, int power_of_2, float epsilon, float* s,
                                            float* s_inv) {
  *s = 1.f;
  *s_inv = 1.f;
  scale_from_amax_f32(amax_bits, fp8_max, power_of_2 != 0, epsilon, s, s_inv);
}

// x [rows, cols]: block (row, kb) is x[row, 128 kb : 128 kb + 128]; lane l holds its elements 4l .. 4l+3.
template <typename T, int FMT>
__global__ void __launch_bounds__(BLOCK_THREADS) quantize_1x128_kernel(
    const T* __restrict__ x, u8* __restrict__ q, float* __restrict__ scale_inv, i64 rows, i64 cols,
    float fp8_max, int power_of_2, float epsilon) {
  const i64 kbs = (cols + 127) / 128, nblocks = rows * kbs;
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  const bool vec = cols % 4 == 0 && aligned(x, 16) && aligned(q, 4);
  for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nblocks; b += warps) {  // warp-uniform
    const i64 row = b / kbs, col = (b % kbs) * 128 + 4 * lane;
    const T* src = x + row * cols + col;
    float f[4];
    if (vec && col < cols) {
      if constexpr (sizeof(T) == 4) {
        const uint4 w = *reinterpret_cast<const uint4*>(src);
        f[0] = __uint_as_float(w.x); f[1] = __uint_as_float(w.y); f[2] = __uint_as_float(w.z); f[3] = __uint_as_float(w.w);
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(src);
        const u32 h[2] = {w.x, w.y};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          T e;
          reinterpret_cast<u16*>(&e)[0] = (u16)(h[j >> 1] >> (16 * (j & 1)));
          f[j] = to_f32(e);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) f[j] = col + j < cols ? to_f32(src[j]) : 0.f;
    }
    u32 m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) m = umax(m, abs_bits(f[j]));
    m = warp_max(m);
    // The scale rule (two fp32 divisions) once per block in lane 0, not in all 32 lanes.
    float sc = 1.f, sc_inv = 1.f;
    if (lane == 0) block_scale(m, fp8_max, power_of_2, epsilon, &sc, &sc_inv);
    sc = __shfl_sync(0xffffffffu, sc, 0);
    if (vec && col < cols) {
      *reinterpret_cast<u32*>(q + row * cols + col) =
          nan_free(m, sc) ? quant_pair<FMT, false>(f[0], f[1], sc) | (quant_pair<FMT, false>(f[2], f[3], sc) << 16)
                          : quant_pair<FMT>(f[0], f[1], sc) | (quant_pair<FMT>(f[2], f[3], sc) << 16);
    } else {
      for (int j = 0; j < 4 && col + j < cols; ++j) q[row * cols + col + j] = quant_one<FMT>(f[j], sc);
    }
    if (lane == 0) scale_inv[b] = sc_inv;
  }
}

// One fp32 scale per row or per column of x [rows, cols] (torchao's axiswise scaling): the 1x128 rule with the
// block a whole row or column. Rows: one warp per row, grid-stride; a row of any length is read twice (amax,
// then the cast), the second time mostly from cache. Columns: one thread per column, neighbouring threads on
// neighbouring columns so that each step down the rows is one coalesced read.
template <typename T, int FMT>
__global__ void __launch_bounds__(BLOCK_THREADS) quantize_axiswise_kernel(
    const T* __restrict__ x, u8* __restrict__ q, float* __restrict__ scale_inv, i64 rows, i64 cols,
    float fp8_max, int power_of_2, float epsilon, int columnwise) {
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, threads = (i64)gridDim.x * blockDim.x;
  if (columnwise) {
    for (i64 c = tid; c < cols; c += threads) {
      u32 m = 0;
      for (i64 r = 0; r < rows; ++r) m = umax(m, abs_bits(to_f32(x[r * cols + c])));
      float sc, sc_inv;
      block_scale(m, fp8_max, power_of_2, epsilon, &sc, &sc_inv);
      for (i64 r = 0; r < rows; ++r) q[r * cols + c] = quant_one<FMT>(to_f32(x[r * cols + c]), sc);
      scale_inv[c] = sc_inv;
    }
    return;
  }
  const int lane = threadIdx.x & 31;
  for (i64 row = tid >> 5; row < rows; row += threads >> 5) {  // warp-uniform
    const T* src = x + row * cols;
    u32 m = 0;
    for (i64 c = lane; c < cols; c += 32) m = umax(m, abs_bits(to_f32(src[c])));
    m = warp_max(m);
    float sc = 1.f, sc_inv = 1.f;
    if (lane == 0) block_scale(m, fp8_max, power_of_2, epsilon, &sc, &sc_inv);
    sc = __shfl_sync(0xffffffffu, sc, 0);
    for (i64 c = lane; c < cols; c += 32) q[row * cols + c] = quant_one<FMT>(to_f32(src[c]), sc);
    if (lane == 0) scale_inv[row] = sc_inv;
  }
}

// One CTA per 128x128 tile; thread t holds rows t/16 + 16 i (i < 8), columns 8 (t%16) .. +7: 64 values in
// registers, so x is read once.
template <typename T, int FMT>
__global__ void __launch_bounds__(BLOCK_THREADS) quantize_128x128_kernel(
    const T* __restrict__ x, u8* __restrict__ q, float* __restrict__ scale_inv, i64 rows, i64 cols,
    float fp8_max, int power_of_2, float epsilon) {
  const i64 tiles_c = (cols + 127) / 128;
  const i64 id = tile_index();
  if (id >= tiles_c * ((rows + 127) / 128)) return;
  const i64 r0 = id / tiles_c * 128, c0 = id % tiles_c * 128;
  const int t = threadIdx.x;
  const i64 col = c0 + 8 * (t & 15);
  const bool vec = cols % 8 == 0 && aligned(x, 16);
  float f[8][8];
  u32 m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const i64 row = r0 + (t >> 4) + 16 * i;
    const bool in = row < rows && col < cols;
    if (in && vec) {
      load8(x + row * cols + col, f[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) f[i][j] = in && col + j < cols ? to_f32(x[row * cols + col + j]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(f[i][j]));
  }
  const u32 mine = m;  // this thread's 64 values: one NaN test for all of them
  m = block_max(m);
  __shared__ float shared_scale;
  if (t == 0) {
    float sc, sc_inv;
    block_scale(m, fp8_max, power_of_2, epsilon, &sc, &sc_inv);
    shared_scale = sc;
    scale_inv[id] = sc_inv;  // tiles are numbered row-major: [ceil(rows/128), ceil(cols/128)]
  }
  __syncthreads();
  const float sc = shared_scale;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const i64 row = r0 + (t >> 4) + 16 * i;
    if (row >= rows || col >= cols) continue;
    if (vec && aligned(q, 8)) {
      *reinterpret_cast<uint2*>(q + row * cols + col) = quant8_checked<FMT>(f[i], sc, mine);
    } else {
      for (int j = 0; j < 8 && col + j < cols; ++j) q[row * cols + col + j] = quant_one<FMT>(f[i][j], sc);
    }
  }
}

// ---- dequantize: y = ROUND_TO(out, fp32(q) *rn factor[block]) -------------------------------------------
// Blocks are br x bc; the factor of (r, c) is at scale[(r / br) * sld + c / bc]: E8M0 bytes (E8M0 = true) or
// fp32 scale inverses. Eight consecutive elements of a row per step (one 8-byte load, codes decoded in pairs,
// one 16-byte store); bc is 1 (columnwise MXFP8: a factor per column) or a multiple of 8 (one factor for all 8).
template <bool E8M0>
__device__ __forceinline__ float block_factor(const void* scale, i64 idx) {
  if (E8M0) return e8m0_value(reinterpret_cast<const u8*>(scale)[idx]);
  return reinterpret_cast<const float*>(scale)[idx];
}

template <int FMT, typename OUT, bool E8M0>
__global__ void block_dequantize_kernel(const u8* __restrict__ q, const void* __restrict__ scale,
                                        OUT* __restrict__ y, i64 rows, i64 cols, int br, int bc, i64 sld) {
  struct alignas(16) Pack { OUT v[8]; };
  const i64 n = rows * cols;
  const i64 start = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  const bool vec = cols % 8 == 0 && aligned(q, 8) && aligned(y, 16);
  if (vec) {
    for (i64 v = start; v < n / 8; v += stride) {
      const i64 r = v * 8 / cols, c0 = v * 8 - r * cols;  // the 8 elements share a row
      const i64 base = (r / br) * sld;
      const uint2 w = *reinterpret_cast<const uint2*>(q + v * 8);
      const float one = bc == 1 ? 0.f : block_factor<E8M0>(scale, base + c0 / bc);
      Pack p;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float lo, hi;
        fp8x2_to_f32<FMT>(((j < 2 ? w.x : w.y) >> (16 * (j & 1))) & 0xffffu, lo, hi);
        const float f0 = bc == 1 ? block_factor<E8M0>(scale, base + c0 + 2 * j) : one;
        const float f1 = bc == 1 ? block_factor<E8M0>(scale, base + c0 + 2 * j + 1) : one;
        p.v[2 * j] = from_f32_out(mul_rn(lo, f0), (OUT*)nullptr);
        p.v[2 * j + 1] = from_f32_out(mul_rn(hi, f1), (OUT*)nullptr);
      }
      *reinterpret_cast<Pack*>(y + v * 8) = p;
    }
  } else {
    for (i64 i = start; i < n; i += stride) {
      const i64 r = i / cols, c = i % cols;
      const float factor = block_factor<E8M0>(scale, (r / br) * sld + c / bc);
      y[i] = from_f32_out(mul_rn(fp8_to_f32<FMT>(q[i]), factor), (OUT*)nullptr);
    }
  }
}

// ---- scale layouts for cuBLASLt ---------------------------------------------------------------------------
// E8M0 or E4M3 scale bytes [ceil(rows / tile_rows), kgroups] into cuBLASLt's 128 x 4 tiles of 512 bytes
// (VEC32_UE8M0, VEC16_UE4M3), tile (rb, cb) at (rb * ceil(kgroups/4) + cb) * 512, element (r, c) of a tile at
// (r % 32) * 16 + (r / 32) * 4 + c; padding 0. Row r reads scale row r / tile_rows: 1 for MXFP8 and FP4's rowwise
// blocks, 16 for NVFP4's 16x16 weight tiles, each repeated for the 16 rows it covers (backends/cuda_fp4.py).
__global__ void mx_scale_swizzle_kernel(const u8* __restrict__ s, u8* __restrict__ out, i64 rows, i64 kgroups,
                                        int tile_rows) {
  const i64 tiles_c = (kgroups + 3) / 4, n = ((rows + 127) / 128) * tiles_c * 512;
  for (i64 o = (i64)blockIdx.x * blockDim.x + threadIdx.x; o < n; o += (i64)gridDim.x * blockDim.x) {
    const i64 tile = o / 512;
    const int within = (int)(o % 512);
    const i64 r = (tile / tiles_c) * 128 + (within % 16) / 4 * 32 + within / 16;
    const i64 c = (tile % tiles_c) * 4 + within % 4;
    out[o] = r < rows && c < kgroups ? s[(r / tile_rows) * kgroups + c] : (u8)0;
  }
}

}  // namespace fp8core
