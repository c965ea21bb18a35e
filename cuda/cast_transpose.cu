// cast_transpose (one read of x, q and q_t out, fused amax) and the fp8 transpose, through 128x128 tiles
// staged in swizzled shared memory.
#include "common.cuh"

namespace fp8core {

static constexpr int TILE = 128;
static constexpr int TILE_WORDS = TILE / 4;  // a tile row: 128 codes in 32 words, no padding
static constexpr int THREADS = 256;

// The tile's word (r, w), w = column / 4, is stored at r * TILE_WORDS + (w ^ 4 * ((r >> 4) & 7)). The swizzle moves
// whole 16-byte chunks (bits 2-4 of w) and is the same for 16 consecutive rows, so that a thread's 16 codes of a row
// are one 16-byte store, a thread's 16 rows of a column are loads at fixed offsets from one address, and neither
// has bank conflicts: a quarter warp's 16-byte stores (the 8 chunks of one row) and a warp's 32-bit loads (4
// columns x 8 groups of rows) each hit all 32 banks once.
__device__ __forceinline__ int word_at(int r, int w) { return r * TILE_WORDS + (w ^ (((r >> 4) & 7) << 2)); }

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

// Four rows of 16 elements, as the 16-byte vectors they were loaded in, into 4 x 16 codes (4 words a row).
template <typename T, int FMT, bool MAY_NAN>
__device__ __forceinline__ void quant_rows(const uint4 (&v)[4][sizeof(T)], float scale, u32 (&w)[4][4]) {
  constexpr int E = 16 / sizeof(T);  // elements per vector
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float f[16];
#pragma unroll
    for (int k = 0; k < (int)sizeof(T); ++k) unpack16(v[i][k], f + E * k, (T*)nullptr);
#pragma unroll
    for (int k = 0; k < 4; ++k) w[i][k] = quant4<FMT, MAY_NAN>(f + 4 * k, scale);
  }
}

// Four rows of 16 consecutive elements (rows `stride` elements apart) into 4 x 16 codes, from 16-byte loads all
// issued before the first is used. One NaN test for the 64 values: the fix-up path only where one of them is NaN
// (or the scale makes one).
template <typename T, int FMT>
__device__ __forceinline__ void convert_rows(const T* x, i64 stride, float scale, u32& m, u32 (&w)[4][4]) {
  constexpr int V = sizeof(T);  // 16-byte vectors per 16 elements
  uint4 v[4][V];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) v[i][k] = reinterpret_cast<const uint4*>(x + i * stride)[k];
  }
  u32 packed = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int k = 0; k < V; ++k) packed = vec_max(packed, vec_abs_max(v[i][k], (T*)nullptr), (T*)nullptr);
  }
  const u32 raw = widen_abs_max(packed, (T*)nullptr);
  m = umax(m, nan_canonical(raw));
  if (nan_free(raw, scale)) {
    quant_rows<T, FMT, false>(v, scale, w);
  } else {
    quant_rows<T, FMT, true>(v, scale, w);
  }
}
template <>
__device__ __forceinline__ void convert_rows<Passthrough, 0>(const Passthrough* x, i64 stride, float, u32&,
                                                             u32 (&w)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 a = *reinterpret_cast<const uint4*>(reinterpret_cast<const u8*>(x) + i * stride);
    w[i][0] = a.x; w[i][1] = a.y; w[i][2] = a.z; w[i][3] = a.w;
  }
}

// The blocks per SM cast_transpose_kernel's launch bounds ask for, so that ptxas gives it the registers it needs
// (issue 40): left to itself it aims at 48 on sm_120 and spills the NaN fix-up path. 16-bit input and the fp8
// transpose fit in 64 registers (four blocks); fp32 input holds twice the words (sixteen 16-byte loads a thread in
// flight) and spills at 64 on every target, so it gets 128 (two). A named constant: the launch bounds are read by
// fp8core._signatures, which reads no parentheses there.
// FP8CORE_FORCE_SOFT_FP8 (the software conversion forced on a target with hardware FP8, a debugging build) compiles
// both software variants, the NaN-free one and the NaN-checked one, into one kernel, and on sm_90 spills at 64: three
// blocks there.
template <typename T>
struct CtBlocks {
#ifdef FP8CORE_FORCE_SOFT_FP8
  static constexpr int value = sizeof(T) == 4 ? 2 : 3;
#else
  static constexpr int value = sizeof(T) == 4 ? 2 : 4;
#endif
};

// q (optional) = quantize(x); q_t = transpose(q). x is [rows, cols] row-major; one block per 128x128 tile.
template <typename T, int FMT, bool WRITE_Q>
__global__ void __launch_bounds__(THREADS, CtBlocks<T>::value) cast_transpose_kernel(
    const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ q_t, const float* __restrict__ scale_p,
    u32* __restrict__ amax_out, i64 rows, i64 cols) {
  __shared__ __align__(16) u32 tile[TILE * TILE_WORDS];
  u8* const tile_bytes = reinterpret_cast<u8*>(tile);
  i64 r0, c0;
  if (!tile_origin<TILE, TILE>(rows, cols, r0, c0)) return;
  const float scale = scale_p != nullptr ? *scale_p : 1.f;
  const int t = threadIdx.x;
  u32 m = 0;
  // Every full tile takes the tiled path; x is read with 16-byte loads where its rows allow, and q and q_t with
  // 16-byte stores where theirs do, else with the widest stores each row's address allows (store16), so dims that are not multiples of 16
  // still run the interior at tile speed. Edge tiles go element by element.
  const bool full = r0 + TILE <= rows && c0 + TILE <= cols;
  if (full) {
    const bool x_vec = cols * (i64)sizeof(T) % 16 == 0 && aligned(x, 16);
    const bool q_vec = cols % 16 == 0 && aligned(q, 16);
    const bool qt_vec = rows % 16 == 0 && aligned(q_t, 16);
    // Each thread: columns 16g .. 16g+15 of rows rq .. rq+3 (a warp: 16 rows, 4 of them per load instruction).
    const int g = t & 7, rq = 4 * (t >> 3);
    const i64 at = (r0 + rq) * cols + c0 + 16 * g;
    u32 w[4][4];
    if (x_vec) {
      convert_rows<T, FMT>(x + at, cols, scale, m, w);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          w[i][k] = 0u;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            w[i][k] |= (u32)convert_one<T, FMT>(x, at + i * cols + 4 * k + b, scale, m) << (8 * b);
          }
        }
      }
    }
    // Rows rq .. rq+3 share their swizzle (rq % 4 == 0): one address, rows TILE_WORDS words apart.
    uint4* const row_chunk = reinterpret_cast<uint4*>(tile + word_at(rq, 4 * g));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 c = make_uint4(w[i][0], w[i][1], w[i][2], w[i][3]);
      if (WRITE_Q) {
        if (q_vec) {
          *reinterpret_cast<uint4*>(q + at + i * cols) = c;
        } else {
          store16(q + at + i * cols, c);
        }
      }
      row_chunk[i * TILE_WORDS / 4] = c;
    }
    __syncthreads();
    // Each thread: columns 4cw .. 4cw+3 of rows 16rg .. 16rg+15, sixteen 32-bit loads (one swizzle, one address),
    // four 4 x 4 byte transposes in registers, and four 16-byte pieces of q_t rows out. A warp (4 column words,
    // all 8 row groups) writes 128 contiguous bytes of each of 4 q_t rows per store.
    const int rg = t & 7, cw = t >> 3;
    const u32* const col = tile + word_at(16 * rg, cw);
    u32 in[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) in[i] = col[i * TILE_WORDS];
    u32 out[4][4];  // out[c][s]: column 4cw + c, rows 16rg + 4s .. +3
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const u32* const a = in + 4 * s;
      const u32 lo01 = __byte_perm(a[0], a[1], 0x5140), lo23 = __byte_perm(a[2], a[3], 0x5140);
      const u32 hi01 = __byte_perm(a[0], a[1], 0x7362), hi23 = __byte_perm(a[2], a[3], 0x7362);
      out[0][s] = __byte_perm(lo01, lo23, 0x5410);
      out[1][s] = __byte_perm(lo01, lo23, 0x7632);
      out[2][s] = __byte_perm(hi01, hi23, 0x5410);
      out[3][s] = __byte_perm(hi01, hi23, 0x7632);
    }
    u8* const dst = q_t + (c0 + 4 * cw) * rows + r0 + 16 * rg;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 o = make_uint4(out[c][0], out[c][1], out[c][2], out[c][3]);
      if (qt_vec) {
        *reinterpret_cast<uint4*>(dst + c * rows) = o;
      } else {
        store16(dst + c * rows, o);
      }
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
