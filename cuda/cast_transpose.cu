// cast_transpose (one read of x, q and q_t out, fused amax) and the fp8 transpose, through 64x64 tiles
// staged in padded, swizzled shared memory.
#include "common.cuh"

namespace fp8core {

static constexpr int TILE = 64;
static constexpr int ROW_WORDS = 20;  // a tile row: 16 words of data + 4 of padding (80 bytes, 16-byte aligned)
static constexpr int THREADS = 256;

// The tile's word (r, w), w = column / 4, is stored at r * ROW_WORDS + (w ^ swizzle(r)). With this padding and
// swizzle both the row-wise 32-bit writes (4 threads per row) and the column-wise 32-bit reads of the transpose
// (4 threads per 16 rows, see below) hit 32 different banks in every warp: no conflicts.
__device__ __forceinline__ int swizzle(int r) { return (((r >> 3) << 1) ^ (r & 3)) & 15; }
__device__ __forceinline__ int word_at(int r, int w) { return r * ROW_WORDS + (w ^ swizzle(r)); }

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
    u32 m8 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m8 = umax(m8, abs_raw(f[j]));
    m = umax(m, nan_canonical(m8));
    const uint2 q8 = quant8_checked<FMT>(f, scale, m8);
    w[2 * h] = q8.x;
    w[2 * h + 1] = q8.y;
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
  __shared__ u32 tile[TILE * ROW_WORDS];
  u8* const tile_bytes = reinterpret_cast<u8*>(tile);
  const i64 tiles_c = (cols + TILE - 1) / TILE;
  const i64 tile_id = blockIdx.x + (i64)blockIdx.y * gridDim.x;
  if (tile_id >= tiles_c * ((rows + TILE - 1) / TILE)) return;
  const i64 r0 = tile_id / tiles_c * TILE, c0 = tile_id % tiles_c * TILE;
  const float scale = scale_p != nullptr ? *scale_p : 1.f;
  const int t = threadIdx.x;
  u32 m = 0;
  // Every full tile takes the tiled path; each of its three memory streams is vectorised where that stream's
  // addresses allow (x rows 16-byte aligned, q rows and q_t rows 16-byte aligned), else done a byte at a time,
  // so dims that are not multiples of 16 still run the interior at tile speed. Edge tiles go element by element.
  const bool full = r0 + TILE <= rows && c0 + TILE <= cols;
  if (full) {
    const bool x_vec = cols * (i64)sizeof(T) % 16 == 0 && aligned(x, 16);
    const bool q_vec = cols % 16 == 0 && aligned(q, 16);
    const bool qt_vec = rows % 16 == 0 && aligned(q_t, 16);
    const int r = t >> 2, g = t & 3;  // each thread: 16 columns of one row
    u32 w[4];
    const i64 at = (r0 + r) * cols + c0 + 16 * g;
    if (x_vec) {
      convert16<T, FMT>(x + at, scale, m, w);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        w[k] = 0u;
#pragma unroll
        for (int b = 0; b < 4; ++b) w[k] |= (u32)convert_one<T, FMT>(x, at + 4 * k + b, scale, m) << (8 * b);
      }
    }
    if (WRITE_Q) {
      if (q_vec) {
        *reinterpret_cast<uint4*>(q + at) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
#pragma unroll
        for (int b = 0; b < 16; ++b) q[at + b] = (u8)(w[b >> 2] >> (8 * (b & 3)));
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[word_at(r, 4 * g + k)] = w[k];
    __syncthreads();
    // Each thread: 4 columns (4cw..4cw+3) x 4 rows (rb..rb+3) as four 32-bit reads, transposed in registers;
    // the four threads of a quad (j = 0..3, rows 16gq..16gq+15) then transpose their 4 x 4 words in two xor
    // exchanges (lanes j ^ 2, then j ^ 1; selects on j's bits, no lane-dependent index), so that each holds 16
    // bytes of one q_t row (column 4cw + j), stored with one 16-byte store. A warp writes 64 contiguous bytes per
    // q_t row.
    const int j = t & 3, gq = (t >> 2) & 3, cw = t >> 4, rb = 16 * gq + 4 * j;
    u32 in[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) in[i] = tile[word_at(rb + i, cw)];
    const u32 lo01 = __byte_perm(in[0], in[1], 0x5140), lo23 = __byte_perm(in[2], in[3], 0x5140);
    const u32 hi01 = __byte_perm(in[0], in[1], 0x7362), hi23 = __byte_perm(in[2], in[3], 0x7362);
    const u32 o[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                      __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};  // o[c]: column 4cw + c
    // Word (s, c): rows 16gq + 4s .. +3 of column 4cw + c, held by lane s as o[c]; lane j wants (s, j), s = 0..3.
    const bool b1 = (j & 2) != 0, b0 = (j & 1) != 0;
    // Lanes j and j ^ 2 swap halves: lane j keeps columns 2 b1, 2 b1 + 1 of rows j (own) and j ^ 2 (part).
    const u32 own0 = b1 ? o[2] : o[0], own1 = b1 ? o[3] : o[1];
    const u32 part0 = __shfl_xor_sync(0xffffffffu, b1 ? o[0] : o[2], 2);
    const u32 part1 = __shfl_xor_sync(0xffffffffu, b1 ? o[1] : o[3], 2);
    // Lanes j and j ^ 1 swap columns: lane j keeps column j of rows j and j ^ 2, gets it of rows j ^ 1 and j ^ 3.
    const u32 keep_own = b0 ? own1 : own0, keep_part = b0 ? part1 : part0;
    const u32 got_own = __shfl_xor_sync(0xffffffffu, b0 ? own0 : own1, 1);
    const u32 got_part = __shfl_xor_sync(0xffffffffu, b0 ? part0 : part1, 1);
    // Rows s with s's bit 1 equal to j's come from own, the others from part; bit 0 equal to j's: kept, else got.
    const u32 own_even = b0 ? got_own : keep_own, own_odd = b0 ? keep_own : got_own;
    const u32 part_even = b0 ? got_part : keep_part, part_odd = b0 ? keep_part : got_part;
    const u32 fin[4] = {b1 ? part_even : own_even, b1 ? part_odd : own_odd,
                        b1 ? own_even : part_even, b1 ? own_odd : part_odd};  // fin[s]: rows 16gq + 4s .. +3
    u8* const dst = q_t + (c0 + 4 * cw + j) * rows + r0 + 16 * gq;
    if (qt_vec) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(fin[0], fin[1], fin[2], fin[3]);
    } else {
#pragma unroll
      for (int b = 0; b < 16; ++b) dst[b] = (u8)(fin[b >> 2] >> (8 * (b & 3)));
    }
  } else {
    for (int idx = t; idx < TILE * TILE; idx += THREADS) {
      const int r = idx / TILE, c = idx % TILE;
      if (r0 + r < rows && c0 + c < cols) {
        const i64 i = (r0 + r) * cols + c0 + c;
        const u8 b = convert_one<T, FMT>(x, i, scale, m);
        if (WRITE_Q) q[i] = b;
        tile_bytes[4 * word_at(r, c >> 2) + (c & 3)] = b;
      }
    }
    __syncthreads();
    for (int idx = t; idx < TILE * TILE; idx += THREADS) {
      const int c = idx / TILE, r = idx % TILE;
      if (r0 + r < rows && c0 + c < cols) q_t[(c0 + c) * rows + r0 + r] = tile_bytes[4 * word_at(r, c >> 2) + (c & 3)];
    }
  }
  if (amax_out != nullptr) block_amax_atomic(m, amax_out);
}

}  // namespace fp8core
