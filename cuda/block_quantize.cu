// Block scaling (docs/numerics.md, "Block scaling"): MXFP8 rowwise and columnwise from one read of x, 1x128 and
// 128x128 blocks with fp32 scales, and the dequantization of both. Same bits as the CPU reference.
// The E8M0 scale rules are e8m0.cuh's (their hardware form on family-specific Blackwell targets).
#include "common.cuh"
#include "e8m0.cuh"

namespace fp8core {

static constexpr int BLOCK_THREADS = 256;
static constexpr int MX = 32;          // MXFP8 block: 32 elements of a row or of a column
static constexpr int MX_TILE_R = 32;   // one CTA: a 32 x 256 tile, one row block (32 elements) per thread
static constexpr int MX_TILE_C = 256;

// ---- MXFP8 quantize ---------------------------------------------------------------------------------------
// The bits of one element (fp32's, or the 16 of bf16/f16), for the scalar loads of a partial block.
__device__ __forceinline__ u32 raw_bits(const float* p) { return __float_as_uint(*p); }
template <typename T>
__device__ __forceinline__ u32 raw_bits(const T* p) { return p->bits; }

// A word of the elements' own bits as fp32 values (1 for fp32, 2 for bf16/f16).
__device__ __forceinline__ void unpack_word(u32 w, float* f, float*) { f[0] = __uint_as_float(w); }
template <typename T>
__device__ __forceinline__ void unpack_word(u32 w, float* f, T*) {
  T lo, hi;
  lo.bits = (u16)(w & 0xffffu);
  hi.bits = (u16)(w >> 16);
  f[0] = to_f32(lo);
  f[1] = to_f32(hi);
}

// The codes of the four values in two words of bf16 or f16 bits (values 0, 1 in w0, 2, 3 in w1), value j times
// factor f[j % 2], value j's code in byte j; by the software conversion (soft_quad_signed), which takes the signs
// from the words themselves: a factor is positive, or NaN and every code NaN's.
template <typename T, int FMT, bool MAY_NAN>
__device__ __forceinline__ u32 soft_quad_words(u32 w0, u32 w1, float f0, float f1) {
  float x[4];
  unpack_word(w0, x, (T*)nullptr);
  unpack_word(w1, x + 2, (T*)nullptr);
  return soft_quad_signed<FMT, MAY_NAN>(mul_rn(x[0], f0), mul_rn(x[1], f1), mul_rn(x[2], f0), mul_rn(x[3], f1),
                                        __byte_perm(w0, w1, 0x7531u));
}

// The staged tile pads each row block (32 elements) with one 16-byte chunk: the 8 threads of a quarter warp (the 8
// row blocks of one row) then store their k-th chunks to 8 different bank groups, a thread's chunks stay at fixed
// offsets from one address, and a warp's loads of 32 consecutive words of one row hit 32 banks (fp32: one block)
// or all but 4 once (bf16, f16: two blocks 80 bytes apart).
template <typename T>
struct Staged {
  static constexpr int BLOCK_WORDS = 8 * sizeof(T) + 4;         // a row block's words, padding included
  static constexpr int ROW_WORDS = 8 * BLOCK_WORDS;              // a staged row: the tile's 8 row blocks
  __device__ static u32 word(u32 wc) { return wc / (8 * sizeof(T)) * BLOCK_WORDS + wc % (8 * sizeof(T)); }
};

// 32 codes of one row block (8 words) to p: 16-byte stores where VEC, else store16's widest; a partial block
// (n < 32 elements) byte by byte, one per row. By store_partial8 instead, ptxas moves this kernel's address
// arithmetic and registers on the fast path: +7 instructions on sm_90 (issue 40's fourth round); in a rolled loop,
// as four pieces, in a __noinline__ function or from the staged codes in shared memory, with the tail's address
// from the row's end and the scale stored first, the best left mxfp8_both 0.13 instructions per element over on
// sm_90 or 0.19 on sm_100 (sixth round). Left until the kernel's own redesign.
__device__ __forceinline__ void store_block(u8* p, const u32* c, int n, bool vec) {
  if (n == MX) {
    const uint4 a = make_uint4(c[0], c[1], c[2], c[3]), b = make_uint4(c[4], c[5], c[6], c[7]);
    if (vec) {
      reinterpret_cast<uint4*>(p)[0] = a;
      reinterpret_cast<uint4*>(p)[1] = b;
    } else {
      store16(p, a);
      store16(p + 16, b);
    }
  } else {
#pragma unroll
    for (int j = 0; j < MX; ++j) {  // unrolled, so that c stays in registers
      if (j < n) p[j] = (u8)(c[j >> 2] >> (8 * (j & 3)));
    }
  }
}

// RPT rows of one staged word (EW columns, each with its own factor) into codes at crow, rows MX_TILE_C bytes apart.
// The software conversion takes four values at a time (soft_quad): the words of 4 / EW rows.
template <typename T, int FMT, bool MAY_NAN, int RPT, int EW>
__device__ __forceinline__ void columns_to_codes(const u32* v, const float* factor, u8* crow) {
  if constexpr (HwCvt<FMT>::value) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      float f[EW];
      unpack_word(v[i], f, (T*)nullptr);
      if constexpr (EW == 2) {
        *reinterpret_cast<u16*>(crow + i * MX_TILE_C) =
            (u16)quant_pair2<FMT, MAY_NAN>(f[0], f[1], factor[0], factor[1]);
      } else {
        crow[i * MX_TILE_C] = (u8)(quant_pair<FMT, MAY_NAN>(f[0], 0.f, factor[0]) & 0xffu);
      }
    }
  } else {
    constexpr int ROWS = 4 / EW;  // rows of one soft_quad
    static_assert(RPT % ROWS == 0, "columns_to_codes: whole quads");
#pragma unroll
    for (int i = 0; i < RPT; i += ROWS) {
      u32 c;
      if constexpr (EW == 2) {
        c = soft_quad_words<T, FMT, MAY_NAN>(v[i], v[i + 1], factor[0], factor[1]);
      } else {
        float a[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = mul_rn(__uint_as_float(v[i + j]), factor[0]);
        c = soft_quad<FMT, MAY_NAN>(a[0], a[1], a[2], a[3]);
      }
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        if constexpr (EW == 2) {
          *reinterpret_cast<u16*>(crow + (i + j) * MX_TILE_C) = (u16)(c >> (16 * j));
        } else {
          crow[(i + j) * MX_TILE_C] = (u8)(c >> (8 * j));
        }
      }
    }
  }
}

// The blocks per SM mx_quantize_kernel's launch bounds ask for, so that ptxas gives it the registers it needs: left
// to itself it aims at 64 and spills (issue 40). The hardware conversion of bf16/f16 fits in 64 registers (four
// blocks); fp32 input holds twice the words and spills 8 bytes at 64 on sm_120, so it gets 80 (three). The software
// conversion (sm_80, or forced) needs up to 80 (three), 128 (two) for fp32. A named constant: the launch bounds are
// read by fp8core._signatures, which reads no parentheses there.
template <typename T, int FMT>
struct MxBlocks {
  static constexpr int value = sizeof(T) == 4 ? (HwCvt<FMT>::value ? 3 : 2) : (HwCvt<FMT>::value ? 4 : 3);
};

// x [rows, cols] -> rowwise (q, s [rows, ceil(cols/32)]) and/or columnwise (qc, sc [ceil(rows/32), cols]);
// a null q or qc skips that half. One CTA per 32 x 256 tile: thread t holds the row block (row t/8, columns
// 32 (t%8) .. +31) in registers (2 or 4 16-byte loads; its amax and scale need no other thread). The columnwise
// half stages the tile's bits in shared memory, where each thread takes the 32 rows of one column (fp32) or 16 rows
// of two (bf16, f16: the two halves meet in shared memory), and its codes go back through shared memory so that
// each thread stores 32 consecutive bytes of one qc row, as the rowwise half stores q.
template <typename T, int FMT, bool RCEIL>
__global__ void __launch_bounds__(BLOCK_THREADS, MxBlocks<T, FMT>::value) mx_quantize_kernel(
    const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ s, u8* __restrict__ qc, u8* __restrict__ sc,
    i64 rows, i64 cols, float inv_max, int emax) {
  constexpr int V = 2 * sizeof(T);                       // 16-byte vectors in a row block
  constexpr int W = 4 * V;                                // words in a row block
  constexpr int EW = 4 / sizeof(T);                       // elements per word
  constexpr int ROW_WORDS = MX_TILE_C / EW;               // words per staged row
  constexpr int RPT = MX_TILE_R * ROW_WORDS / BLOCK_THREADS;  // rows per thread in the columnwise half
  __shared__ __align__(16) u32 xs[MX_TILE_R * Staged<T>::ROW_WORDS];
  __shared__ __align__(16) u8 codes[MX_TILE_R][MX_TILE_C];
  __shared__ u32 part[2][MX_TILE_C / 2];
  i64 r0, c0;
  if (!tile_origin<MX_TILE_R, MX_TILE_C>(rows, cols, r0, c0)) return;  // the whole CTA, before any barrier
  const u32 t = threadIdx.x, r = t >> 3, cb = t & 7;  // unsigned: no sign fix-ups in the index arithmetic
  const i64 row = r0 + r, col = c0 + MX * cb;
  const bool in = row < rows && col < cols;
  const int n = in ? (int)(cols - col < MX ? cols - col : MX) : 0;  // elements of this row block
  // cols % 8 == 0: every row starts 16-byte aligned when x does
  const bool whole = n == MX && cols % 8 == 0 && aligned(x, 16);
  u32 w[W];
  if (whole) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const uint4 a = reinterpret_cast<const uint4*>(x + row * cols + col)[k];
      w[4 * k] = a.x; w[4 * k + 1] = a.y; w[4 * k + 2] = a.z; w[4 * k + 3] = a.w;
    }
  } else {  // zeros past the end: no amax, no code stored
#pragma unroll
    for (int k = 0; k < W; ++k) w[k] = 0u;
#pragma unroll
    for (int j = 0; j < MX; ++j) {  // unrolled, so that w stays in registers
      if (j < n) w[j / EW] |= raw_bits(x + row * cols + col + j) << (32 / EW * (j % EW));
    }
  }

  if (q != nullptr) {
    u32 packed = 0u;
#pragma unroll
    for (int k = 0; k < W; ++k) packed = max_abs16x2(packed, w[k], (T*)nullptr);
    const u32 m = nan_canonical(widen_abs_max(packed, (T*)nullptr));
    const u32 e = e8m0<RCEIL>(m, inv_max, emax);
    const float factor = e8m0_quant_factor(e);
    if (in) {
      float f[MX];
#pragma unroll
      for (int k = 0; k < W; ++k) unpack_word(w[k], f + EW * k, (T*)nullptr);
      u32 c[8];
      if constexpr (EW == 2 && !HwCvt<FMT>::value) {
        if (e8m0_nan_free(m)) {
#pragma unroll
          for (int k = 0; k < 8; ++k) c[k] = soft_quad_words<T, FMT, false>(w[2 * k], w[2 * k + 1], factor, factor);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) c[k] = soft_quad_words<T, FMT, true>(w[2 * k], w[2 * k + 1], factor, factor);
        }
      } else if (e8m0_nan_free(m)) {
#pragma unroll
        for (int k = 0; k < 8; ++k) c[k] = quant4<FMT, false>(f + 4 * k, factor);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) c[k] = quant4<FMT, true>(f + 4 * k, factor);
      }
      store_block(q + row * cols + col, c, n, cols % 16 == 0 && aligned(q, 16));
      s[row * ((cols + MX - 1) >> 5) + (col >> 5)] = (u8)e;  // rows of ceil(cols / 32) scales
    }
  }

  if (qc != nullptr) {
    uint4* const block = reinterpret_cast<uint4*>(xs + r * Staged<T>::ROW_WORDS + cb * Staged<T>::BLOCK_WORDS);
#pragma unroll
    for (int k = 0; k < V; ++k) block[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    __syncthreads();
    // Word wc of rows h RPT .. h RPT + RPT-1: one address, rows apart by fixed offsets.
    const u32 wc = t % ROW_WORDS, h = t / ROW_WORDS;
    const u32* const cp = xs + h * RPT * Staged<T>::ROW_WORDS + Staged<T>::word(wc);
    u32 v[RPT];
    u32 packed = 0u;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      v[i] = cp[i * Staged<T>::ROW_WORDS];
      packed = max_abs16x2(packed, v[i], (T*)nullptr);
    }
    if constexpr (EW == 2) {
      part[h][wc] = packed;
      __syncthreads();
      packed = vec_max(part[0][wc], part[1][wc], (T*)nullptr);
    }
    u32 m[EW], e[EW];
    float factor[EW];
    bool clean = true;
#pragma unroll
    for (int k = 0; k < EW; ++k) {
      m[k] = nan_canonical(widen_abs_max(EW == 1 ? packed : (packed >> (16 * k)) & 0xffffu, (T*)nullptr));
      e[k] = e8m0<RCEIL>(m[k], inv_max, emax);
      factor[k] = e8m0_quant_factor(e[k]);
      clean = clean && e8m0_nan_free(m[k]);
    }
    u8* const crow = &codes[h * RPT][EW * wc];
    if (clean) {
      columns_to_codes<T, FMT, false, RPT, EW>(v, factor, crow);
    } else {
      columns_to_codes<T, FMT, true, RPT, EW>(v, factor, crow);
    }
    if (h == 0) {
#pragma unroll
      for (int k = 0; k < EW; ++k) {
        if (c0 + EW * wc + k < cols) sc[(r0 >> 5) * cols + c0 + EW * wc + k] = (u8)e[k];  // scale row r0 / 32
      }
    }
    __syncthreads();
    if (in) {
      const uint4* const src = reinterpret_cast<const uint4*>(&codes[r][MX * cb]);
      const uint4 a = src[0], b = src[1];
      const u32 c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      store_block(qc + row * cols + col, c, n, cols % 16 == 0 && aligned(qc, 16));
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
    if (col < cols) {  // every lane's word where vec; else store4's widest at q's own alignment
      const u32 c = nan_free(m, sc) ? quant4<FMT, false>(f, sc) : quant4<FMT, true>(f, sc);
      if (vec) {
        *reinterpret_cast<u32*>(q + row * cols + col) = c;
      } else if (col + 4 <= cols) {
        store4(q + row * cols + col, c);
      } else {  // the row's last 1-3 codes (of zeros past the row, not stored)
        store_partial8(q + row * cols + col, make_uint2(c, 0u), (int)(cols - col));
      }
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
  const i64 id = blockIdx.x + (i64)blockIdx.y * gridDim.x;
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
    } else if (col + 8 <= cols) {  // store8's widest at the address's own alignment
      store8(q + row * cols + col, quant8_checked<FMT>(f[i], sc, mine));
    } else {  // the row's last 1-7 codes (of zeros past the row, not stored)
      store_partial8(q + row * cols + col, quant8_checked<FMT>(f[i], sc, mine), (int)(cols - col));
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
