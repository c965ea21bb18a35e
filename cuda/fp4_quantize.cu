// FP4 (docs/numerics.md, "FP4: E2M1 elements, NVFP4 and MXFP4"): NVFP4 and MXFP4 quantize and dequantize (the
// scale layout cuBLASLt's FP4 GEMM reads is MXFP8's, block_quantize.cu mx_scale_swizzle_kernel). Same bits as the CPU reference (backends/cpu_fp4.py).
//
// Every kernel works on **the operand** [R, C]: x [rows, cols] itself, or x^T when `columnwise` (written in the
// operand's layout: data [R, C/2], scales [R, C/block]). One thread quantizes one block (16 or 32 consecutive
// elements of an operand row), so a block's amax, scale and random bytes need no cross-thread work; 16x16 weight
// tiles are 16 lanes (one row segment each) reduced by shuffles.
//
// E2M1 is converted in software on every target (soft_cvt on bit patterns, as FP8 on sm_80): the contract allows
// cvt.rn.satfinite.e2m1x2.f32 only where it agrees with the software rule, which stays unconfirmed on sm_100 for
// NaN, and cvt.rs (stochastic) is unconfirmed for its byte order and arithmetic. Stochastic rounding's random bytes
// are Philox4x32-10 keyed by (seed, block number, offset): no RNG state, the same bytes for any launch shape.
#include "common.cuh"
#include "e8m0.cuh"
#include "nvfp4_scale.cuh"

// E2M1 (fp8core.formats.E2M1) is declared by common.cuh from the loader's FP8CORE_FP4_ENCODINGS: Encoding<E2M1>
// gives soft_cvt and fp8_to_f32 its layout, +max code and NaN cast.
namespace fp8core {

static constexpr int FP4_THREADS = 256;
static constexpr int NVFP4_BLOCK = 16;
static constexpr int MXFP4_BLOCK = 32;
static constexpr u32 ONE_SIXTH_BITS = 0x3E2AAAABu;  // fp32(1/6), rounded once
static constexpr u32 HADAMARD_SIGN_MASK = 0xD7E8u;  // TE's wgrad sign vector: bit i set where S_i = -1
static constexpr u32 PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
static constexpr u32 PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;

// ---- Philox4x32-10 (Random123, curand) ----------------------------------------------------------------------
__device__ __forceinline__ uint4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    if (i) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const u64 p0 = (u64)PHILOX_M0 * c0, p1 = (u64)PHILOX_M1 * c2;
    const u32 n0 = (u32)(p1 >> 32) ^ c1 ^ k0, n2 = (u32)(p0 >> 32) ^ c3 ^ k1;
    c1 = (u32)p1;
    c3 = (u32)p0;
    c0 = n0;
    c2 = n2;
  }
  return make_uint4(c0, c1, c2, c3);
}

// The 16 random bytes of block g, as four little-endian words: byte j is bits 8 (j & 3) .. of word j >> 2.
__device__ __forceinline__ uint4 block_random(u64 g, u64 seed, u64 offset) {
  return philox4x32_10((u32)g, (u32)(g >> 32), (u32)offset, (u32)(offset >> 32), (u32)seed, (u32)(seed >> 32));
}

// ---- E2M1 ---------------------------------------------------------------------------------------------------
// SR(y, r): |y| >= 6 and inf give 6, NaN 0x7, the sign kept. Below 6, n = |y| * 256 / step (exact: a power of two)
// truncated: n >> 8 is the magnitude in steps, n & 255 the 8 bits below the step; a carry out of those bits plus r
// moves it up a step. The code is the step count plus 0, 2 or 4 (steps of 0.5 below 2, 1 below 4, 2 below 6).
// The comparisons and the truncation may flush under -ftz (FSETP.FTZ, F2I.FTZ): a subnormal |y| gives what 0 does.
__device__ __forceinline__ u32 e2m1_stochastic(float y, u32 r) {
  const u32 b = __float_as_uint(y), a = b & 0x7fffffffu, sign = (b >> 28) & 8u;
  if (a > F32_INF) return Encoding<E2M1>::NAN_CAST;
  const float mag = __uint_as_float(a);
  if (!(mag < 6.f)) return Encoding<E2M1>::MAX_CODE | sign;
  const u32 binade = (mag >= 2.f ? 1u : 0u) + (mag >= 4.f ? 1u : 0u);
  const u32 n = (u32)mul_rn(mag, __uint_as_float((u32)(127 + 9 - binade) << 23));  // 512, 256, 128: exact
  return ((n >> 8) + (((n & 255u) + r) >> 8) + 2u * binade) | sign;
}

// 16 or 32 codes, packed two a byte (element 2i in the low nibble), stored at p (8 or 16 bytes).
template <int N>
__device__ __forceinline__ void store_codes(u8* p, const u32* c) {
  u32 w[N / 8];
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    w[k] = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w[k] |= c[8 * k + i] << (4 * i);
  }
  if (aligned(p, 8)) {
#pragma unroll
    for (int k = 0; k < N / 8; k += 2) *reinterpret_cast<uint2*>(p + 4 * k) = make_uint2(w[k], w[k + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) p[i] = (u8)(w[i / 4] >> (8 * (i % 4)));
  }
}

// ---- loading one operand block ------------------------------------------------------------------------------
// Operand row r, elements N j .. N j + N - 1: x[r, N j + i] (rowwise, contiguous: vector loads where x is 16-byte
// aligned; a row of a multiple of 16 elements keeps every block so) or x[N j + i, r] (columnwise; neighbouring
// threads take neighbouring columns, so the loads coalesce).
template <int N, typename T>
__device__ __forceinline__ void load_block(const T* x, i64 r, i64 j, i64 cols, bool columnwise, bool vec, float* f) {
  if (!columnwise) {
    const T* p = x + r * cols + (i64)N * j;
    if (vec) {
#pragma unroll
      for (int i = 0; i < N; i += 8) load8(p + i, f + i);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = to_f32(p[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f32(x[((i64)N * j + i) * cols + r]);
  }
}

// ---- the random Hadamard transform of one block --------------------------------------------------------------
// v_i = S_i x_i (exact: a multiply by -1 never flushed; a sign-bit flip the compiler turns into a negation, which
// -ftz=true flushes on sm_100, FADD.FTZ); the fp32 butterfly for h = 1, 2, 4, 8 in the contract's order, each sum
// and difference one IEEE fp32 operation (add_rn, sub_rn: never flushed); then ROUND_TO(T, v *rn 0.25), widened
// back.
__device__ __forceinline__ float round_to(float v, float*) { return v; }
template <typename T>
__device__ __forceinline__ float round_to(float v, T*) { return to_f32(from_f32_out(v, (T*)nullptr)); }

template <typename T>
__device__ __forceinline__ void hadamard16(float* f) {
#pragma unroll
  for (int i = 0; i < NVFP4_BLOCK; ++i) {
    if ((HADAMARD_SIGN_MASK >> i) & 1u) f[i] = mul_rn(f[i], -1.f);
  }
#pragma unroll
  for (int h = 1; h < NVFP4_BLOCK; h <<= 1) {
#pragma unroll
    for (int i = 0; i < NVFP4_BLOCK; ++i) {
      if (i & h) continue;
      const float a = f[i], b = f[i + h];
      f[i] = add_rn(a, b);
      f[i + h] = sub_rn(a, b);
    }
  }
#pragma unroll
  for (int i = 0; i < NVFP4_BLOCK; ++i) f[i] = round_to(mul_rn(f[i], 0.25f), (T*)nullptr);
}

// ---- NVFP4 --------------------------------------------------------------------------------------------------
// The work items of one launch: operand blocks (r, j), numbered so that neighbouring threads read neighbouring
// memory: rowwise r-major; columnwise j-major (threads along r, the columns of x); 16x16 tiles in groups of 16
// lanes, one row segment each (rows past R in a partial last tile are items that load zeros and write nothing).
struct Items {
  i64 rows_op, nb, count;
  bool columnwise, tiles;
  __device__ __forceinline__ void at(i64 w, i64* r, i64* j) const {
    if (tiles) {
      const i64 group = w / 16;
      *r = group / nb * 16 + w % 16;
      *j = group % nb;
    } else if (columnwise) {
      *j = w / rows_op;
      *r = w % rows_op;
    } else {
      *r = w / nb;
      *j = w % nb;
    }
  }
};

__device__ __forceinline__ Items nvfp4_items(i64 rows, i64 cols, int columnwise, int tiles) {
  const i64 r_op = columnwise ? cols : rows, nb = (columnwise ? rows : cols) / NVFP4_BLOCK;
  return Items{r_op, nb, (tiles ? (r_op + 15) / 16 * 16 : r_op) * nb, columnwise != 0, tiles != 0};
}

// x [rows, cols] -> the NVFP4 operand's data [R, C/2] and E4M3 scales ([R, C/16], or [ceil(R/16), C/16] with
// tiles). With amax_out non-null the launch only takes the operand's amax (after the transform) into it (one
// atomic per CTA, the slot zeroed before): the global amax pass. Otherwise *global_amax is G.
// Stochastic rounding's (seed, offset): by value, or with rng_state non-null from the caller's state in device
// memory, four little-endian u32 words (seed lo, seed hi, offset lo, offset hi: an int64 [2] or uint32 [4] array,
// 4-byte aligned), so the caller never reads it to the host; the by-value offset is then added to the state's (the
// stream of one state), mod 2^64.
template <typename T>
__global__ void __launch_bounds__(FP4_THREADS) nvfp4_quantize_kernel(
    const T* __restrict__ x, u8* __restrict__ data, u8* __restrict__ scale, const float* __restrict__ global_amax,
    u32* __restrict__ amax_out, i64 rows, i64 cols, int columnwise, int tiles, int hadamard, int stochastic,
    u64 seed, u64 offset, const u32* __restrict__ rng_state) {
  if (rng_state != nullptr) {
    seed = (u64)rng_state[0] | (u64)rng_state[1] << 32;
    offset += (u64)rng_state[2] | (u64)rng_state[3] << 32;
  }
  const Items items = nvfp4_items(rows, cols, columnwise, tiles);
  const bool vec = !columnwise && aligned(x, 16);
  float s_enc = 1.f, s_dec = 1.f;
  if (amax_out == nullptr) nvfp4_global_scales(*global_amax, &s_enc, &s_dec);
  const float m = mul_rn(s_enc, __uint_as_float(ONE_SIXTH_BITS));
  u32 acc = 0u;
  // The trip count is uniform over a CTA (base steps together), so every lane reaches the tile shuffles.
  for (i64 base = (i64)blockIdx.x * blockDim.x; base < items.count; base += (i64)gridDim.x * blockDim.x) {
    const i64 w = base + threadIdx.x;
    i64 r = 0, j = 0;
    if (w < items.count) items.at(w, &r, &j);
    const bool in = w < items.count && r < items.rows_op;
    float f[NVFP4_BLOCK];
    if (in) {
      load_block<NVFP4_BLOCK>(x, r, j, cols, columnwise != 0, vec, f);
      if (hadamard) hadamard16<T>(f);
    } else {
#pragma unroll
      for (int i = 0; i < NVFP4_BLOCK; ++i) f[i] = 0.f;
    }
    u32 amax_b = 0u;
#pragma unroll
    for (int i = 0; i < NVFP4_BLOCK; ++i) amax_b = umax(amax_b, abs_raw(f[i]));
    amax_b = nan_canonical(amax_b);
    if (amax_out != nullptr) {
      acc = umax(acc, amax_b);
      continue;
    }
    if (tiles) {
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) amax_b = umax(amax_b, __shfl_xor_sync(0xffffffffu, amax_b, o));
    }
    if (!in) continue;
    const u32 s_b = soft_cvt<E4M3>(mul_rn(__uint_as_float(amax_b), m));
    float e = d2f(1.0 / f2d(mul_rn(fp8_to_f32<E4M3>(s_b), s_dec)));
    if ((__float_as_uint(e) & 0x7fffffffu) == F32_INF) e = FLT_MAX_F;
    u32 c[NVFP4_BLOCK];
    if (stochastic) {
      const uint4 rnd = block_random((u64)r * (u64)items.nb + (u64)j, seed, offset);
      const u32 words[4] = {rnd.x, rnd.y, rnd.z, rnd.w};
#pragma unroll
      for (int i = 0; i < NVFP4_BLOCK; ++i) c[i] = e2m1_stochastic(mul_rn(f[i], e), (words[i >> 2] >> (8 * (i & 3))) & 0xffu);
    } else {
#pragma unroll
      for (int i = 0; i < NVFP4_BLOCK; ++i) c[i] = soft_cvt<E2M1>(mul_rn(f[i], e));
    }
    store_codes<NVFP4_BLOCK>(data + r * (items.nb * NVFP4_BLOCK / 2) + j * (NVFP4_BLOCK / 2), c);
    if (!tiles) {
      scale[r * items.nb + j] = (u8)s_b;
    } else if (r % 16 == 0) {
      scale[r / 16 * items.nb + j] = (u8)s_b;
    }
  }
  if (amax_out != nullptr) block_amax_atomic(acc, amax_out);
}

// ---- MXFP4 --------------------------------------------------------------------------------------------------
// x [rows, cols] -> the MXFP4 operand's data [R, C/2] and E8M0 scales [R, C/32]: MXFP8's scale rules with
// fp_max 6 (inv_max = fp32(1/6)) and emax 2; q = E2M1(fp32(x) *rn 2^(127 - e)), a NaN block (e = 0xFF) all 0x7.
template <typename T, bool RCEIL>
__global__ void __launch_bounds__(FP4_THREADS) mxfp4_quantize_kernel(
    const T* __restrict__ x, u8* __restrict__ data, u8* __restrict__ scale, i64 rows, i64 cols, int columnwise) {
  const i64 r_op = columnwise ? cols : rows, nb = (columnwise ? rows : cols) / MXFP4_BLOCK;
  const Items items{r_op, nb, r_op * nb, columnwise != 0, false};
  const bool vec = !columnwise && aligned(x, 16);
  for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < items.count; w += (i64)gridDim.x * blockDim.x) {
    i64 r, j;
    items.at(w, &r, &j);
    float f[MXFP4_BLOCK];
    load_block<MXFP4_BLOCK>(x, r, j, cols, columnwise != 0, vec, f);
    u32 amax_b = 0u;
#pragma unroll
    for (int i = 0; i < MXFP4_BLOCK; ++i) amax_b = umax(amax_b, abs_raw(f[i]));
    amax_b = nan_canonical(amax_b);
    const u32 e = e8m0<RCEIL>(amax_b, __uint_as_float(ONE_SIXTH_BITS), 2);
    const float factor = e8m0_quant_factor(e);
    u32 c[MXFP4_BLOCK];
#pragma unroll
    for (int i = 0; i < MXFP4_BLOCK; ++i) c[i] = soft_cvt<E2M1>(mul_rn(f[i], factor));
    store_codes<MXFP4_BLOCK>(data + r * (nb * MXFP4_BLOCK / 2) + j * (MXFP4_BLOCK / 2), c);
    scale[r * nb + j] = (u8)e;
  }
}

// ---- dequantize ---------------------------------------------------------------------------------------------
// data [rows, cols/2] -> y [rows, cols]. NVFP4 (NV = true): y = ROUND_TO(OUT, (q * s_b) *rn S_dec), s_b the E4M3
// byte at scale[(r / tile_rows) * (cols / 16) + c / 16] (tile_rows 16 for 16x16 tiles, else 1), S_dec from
// *global_amax; the first product is exact. MXFP4: y = ROUND_TO(OUT, q *rn 2^(e - 127)), e = scale[r, c / 32].
// A NaN scale gives the canonical NaN. One thread per byte (two elements).
template <typename OUT, bool NV>
__global__ void fp4_dequantize_kernel(const u8* __restrict__ data, const u8* __restrict__ scale,
                                      const float* __restrict__ global_amax, OUT* __restrict__ y, i64 rows, i64 cols,
                                      int tile_rows) {
  constexpr int B = NV ? NVFP4_BLOCK : MXFP4_BLOCK;
  float s_enc = 1.f, s_dec = 1.f;
  if (NV) nvfp4_global_scales(*global_amax, &s_enc, &s_dec);
  const i64 half = cols / 2, n = rows * half, nb = cols / B;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 r = i / half, c = 2 * (i % half);
    const u32 s = scale[(r / tile_rows) * nb + c / B], byte = data[i];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float q = fp8_to_f32<E2M1>((byte >> (4 * k)) & 0xfu);
      const float v = NV ? mul_rn(mul_rn(q, fp8_to_f32<E4M3>(s)), s_dec) : mul_rn(q, e8m0_value(s));
      y[r * cols + c + k] = from_f32_out(v, (OUT*)nullptr);
    }
  }
}

}  // namespace fp8core
