// FP4 (docs/numerics.md, "FP4: E2M1 elements, NVFP4 and MXFP4"): NVFP4 and MXFP4 quantize and dequantize (the
// scale layout cuBLASLt's FP4 GEMM reads is MXFP8's, block_quantize.cu mx_scale_swizzle_kernel). Same bits as the CPU reference (backends/cpu_fp4.py).
//
// Every kernel works on **the operand** [R, C]: x [rows, cols] itself, or x^T when `columnwise` (written in the
// operand's layout: data [R, C/2], scales [R, C/block]). One thread quantizes one block (16 or 32 consecutive
// elements of an operand row), so a block's amax, scale and random bytes need no cross-thread work; 16x16 weight
// tiles are 16 lanes (one row segment each) reduced by shuffles.
//
// The plain path (rowwise, round to nearest, x 16-byte aligned: what a Linear's forward quantizes) is branch-free:
// block w of the operand is x[16 w ..] (32 w for MXFP4), its codes data[8 w ..] and its scale scale[w], so it
// needs no index division; 16-byte loads, one 8- or 16-byte store of codes. Its E2M1 conversion is
// cvt.rn.satfinite.e2m1x2.f32 on the family-specific Blackwell targets (sm_100f, sm_120f, ...: the loader compiles
// this file for one, _kernels.FAMILY_FILES) and e2m1_magnitudes8's fp32 arithmetic elsewhere (H100/H200 have no
// FP4 conversion). Neither meets a NaN: a block holding one (its amax NaN) gets the contract's NaN block (scale
// 0x7F or 0xFF, every code 0x7) by a select, so what the hardware writes for a NaN does not matter.
// The other paths (columnwise, 16x16 tiles, the Hadamard transform, stochastic rounding) convert with soft_cvt on
// bit patterns, as FP8 on sm_80. Stochastic rounding's random bytes are Philox4x32-10 keyed by (seed, block number,
// offset): no RNG state, the same bytes for any launch shape; cvt.rs (stochastic) is unconfirmed for its byte order
// and arithmetic, so it stays software everywhere.
#include "common.cuh"
#include "e8m0.cuh"
#include "nvfp4_scale.cuh"

// E2M1 (fp8core.formats.E2M1) is declared by common.cuh from the loader's FP8CORE_FP4_ENCODINGS: Encoding<E2M1>
// gives soft_cvt and fp8_to_f32 its layout, +max code and NaN cast.
namespace fp8core {

static constexpr int FP4_THREADS = 256;
static constexpr int NVFP4_BLOCK = 16;
static constexpr int MXFP4_BLOCK = 32;
// The quantizers' packed codes (data) are 16-byte aligned: always the launcher's own allocation, never the caller's
// memory (backends/cuda_fp4.py refuses any other address before a launch), so every store of codes is a word store.
static constexpr int DATA_ALIGNMENT = 16;
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

// ---- the plain path's E2M1: branch-free, two codes a byte -----------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && !defined(FP8CORE_FORCE_SOFT_FP8) && \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) || defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FEAT_SM100_ALL))
#define FP8CORE_HW_E2M1 1
#else
#define FP8CORE_HW_E2M1 0
#endif

// IEEE fp32 operations that -ftz=true must not flush (written as PTX without .ftz, as mul_rn; fma_rn and abs_f32
// are common.cuh's).
__device__ __forceinline__ float min_f32(float a, float b) {
  float r;
  asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// max with NaN propagating (the canonical NaN 0x7FFFFFFF when either is NaN): a block's amax on the FP pipe.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The E2M1 magnitudes of 8 values y (none NaN, all |y| < 7 unless CLAMP), code i in bits 4i .. 4i+2 (bit 4i+3
// clear). With a = |y|, E2M1's code is g(a) = min(2a, a + 2, a/2 + 4) rounded to the nearest integer, ties to even
// (slopes 2, 1, 1/2 on the steps 0.5, 1 and 2 below 2, 4 and 6; the lines meet at 2 and 4, where the code is even;
// 6 <= a < 7 rounds to 7, saturation), and rounding is monotonic, so it is the min of the three lines each rounded:
// fma(a, slope, MAGIC + offset) rounds the exact line once to an integer (fp32's ulp is 1 in [2^23, 2^24), MAGIC
// even, so ties go to the even code), leaving the code in the low bits. CLAMP takes min(a, 6) first, for blocks
// whose largest product may reach 7 (a saturated or E4M3-subnormal scale, inf). The words are summed as
// w = sum 16^i t_i: every bit above the codes is MAGIC's and cancels mod 2^32 (bits(MAGIC) + 16 bits(MAGIC1) =
// 2^32, and 256 bits(MAGIC) = 0), one LEA a value. Everything before the sum runs on the FP pipe, |y| an operand
// modifier; -ftz cannot touch it (fma.rn/add.rn/min without .ftz; a subnormal a gives 0 anyway).
static constexpr float E2M1_MAGIC = 8388608.f;    // 2^23: bits 0x4B000000
static constexpr float E2M1_MAGIC1 = 13631488.f;  // 2^23 + 0x500000: bits 0x4B500000, element 1's
static constexpr float E2M1_UNCLAMPED = 7.f;      // products below this need no clamp
template <bool CLAMP>
__device__ __forceinline__ u32 e2m1_magnitudes8(const float* y) {
  u32 w = 0u;
#pragma unroll
  for (int i = 7; i >= 0; --i) {
    const float m = i == 1 ? E2M1_MAGIC1 : E2M1_MAGIC;
    const float a = CLAMP ? min_f32(abs_f32(y[i]), 6.f) : abs_f32(y[i]);
    const float t = min_f32(min_f32(fma_rn(a, 2.f, m), add_rn(a, m + 2.f)), fma_rn(a, 0.5f, m + 4.f));
    w = w * 16u + __float_as_uint(t);
  }
  return w;
}

// prmt.b32 in its default mode: byte i of the result is byte s[4i+2:4i] of {b, a}, its sign bit replicated where
// s bit 4i+3 is set (CUDA's __byte_perm drops that bit).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}

// The signs of 8 elements at bits 4i+3, from their raw words: bf16/f16 (4 words, element 2j in the low half of word
// j), by sign-replicating byte permutes, no shifts: a = [s0, s2, s1, s3], b = [s4, s6, s5, s7] (a byte each), then
// the even signs go to bits 3 and the odd to bits 7 of their bytes. fp32: 8 words, the sign in each top byte.
template <typename T>
__device__ __forceinline__ u32 sign_bits8(const u32* w, T*) {
  const u32 a = prmt(w[0], w[1], 0xFBD9u), b = prmt(w[2], w[3], 0xFBD9u);
  return (prmt(a, b, 0x5410u) & 0x08080808u) | (prmt(a, b, 0x7632u) & 0x80808080u);
}
__device__ __forceinline__ u32 sign_bits8(const u32* w, float*) {
  const u32 even = prmt(prmt(w[0], w[2], 0xFBFBu), prmt(w[4], w[6], 0xFBFBu), 0x5410u);
  const u32 odd = prmt(prmt(w[1], w[3], 0xFBFBu), prmt(w[5], w[7], 0xFBFBu), 0x5410u);
  return (even & 0x08080808u) | (odd & 0x80808080u);
}

#if FP8CORE_HW_E2M1
// Two codes in one byte: hi in bits 4-7 (PTX puts its first source in the upper nibble).
__device__ __forceinline__ u32 cvt_e2m1x2(float lo, float hi) {
  u32 r;
  asm("{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, %1, %2; cvt.u32.u8 %0, t; }" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// The codes of 8 products y = x * factor (factor > 0, so y has x's sign; none NaN), packed: code i in bits 4i ..
// 4i+3. raw: the 8 elements' own words (their signs).
template <typename T, bool CLAMP>
__device__ __forceinline__ u32 e2m1x8(const float* y, const u32* raw) {
#if FP8CORE_HW_E2M1
  return cvt_e2m1x2(y[0], y[1]) | cvt_e2m1x2(y[2], y[3]) << 8 | cvt_e2m1x2(y[4], y[5]) << 16 |
         cvt_e2m1x2(y[6], y[7]) << 24;
#else
  return e2m1_magnitudes8<CLAMP>(y) | sign_bits8(raw, (T*)nullptr);
#endif
}

static constexpr u32 E2M1_NAN_WORD = 0x77777777u;  // a NaN block: every code 0x7

// N elements at p (16-byte aligned) as raw words and as fp32; their amax with NaN propagating (NaN: 0x7FFFFFFF).
template <typename T, int N>
struct PlainBlock {
  static constexpr int WORDS = N * (int)sizeof(T) / 4;
  u32 w[WORDS];
  float f[N];
  __device__ __forceinline__ float load(const T* p) {
#pragma unroll
    for (int k = 0; k < WORDS / 4; ++k) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[k];
      w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
    }
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      f[i] = element(i, (T*)nullptr);
      m = max_nan(m, abs_f32(f[i]));
    }
    return m;
  }
  __device__ __forceinline__ float element(int i, float*) const { return __uint_as_float(w[i]); }
  template <typename U>
  __device__ __forceinline__ float element(int i, U*) const {
    U h;
    h.bits = (u16)(w[i / 2] >> (16 * (i % 2)));
    return to_f32(h);
  }
  // The N codes times factor (> 0), packed 8 a word; a NaN block (amax NaN) all 0x7. Blocks whose largest product
  // reaches 7 (E2M1_UNCLAMPED) convert with the clamp: another copy of the loop, so the usual block runs its own.
  __device__ __forceinline__ void codes(float amax, float factor, u32* c) const {
    if (!(mul_rn(amax, factor) < E2M1_UNCLAMPED)) {
      codes_of<true>(factor, c);
      if (__float_as_uint(amax) > F32_INF) {
#pragma unroll
        for (int k = 0; k < N / 8; ++k) c[k] = E2M1_NAN_WORD;
      }
    } else {
      codes_of<false>(factor, c);
    }
  }
  template <bool CLAMP>
  __device__ __forceinline__ void codes_of(float factor, u32* c) const {
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = mul_rn(f[8 * k + i], factor);
      c[k] = e2m1x8<T, CLAMP>(y, w + k * 8 * (int)sizeof(T) / 4);
    }
  }
};
// 16 or 32 codes, packed two a byte (element 2i in the low nibble), stored at p (8 or 16 bytes) by 8-byte words:
// p is a block's codes in data, 8-byte aligned as data is (DATA_ALIGNMENT) and every block's codes 8 or 16 bytes.
template <int N>
__device__ __forceinline__ void store_codes(u8* p, const u32* c) {
  u32 w[N / 8];
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    w[k] = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w[k] |= c[8 * k + i] << (4 * i);
  }
#pragma unroll
  for (int k = 0; k < N / 8; k += 2) *reinterpret_cast<uint2*>(p + 4 * k) = make_uint2(w[k], w[k + 1]);
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
// e_b = 1 /rn (fp32(s_b) *rn S_dec), FLT_MAX where inf, for the E4M3 scale code s_b (0 .. 0x7F; 0x7F: NaN).
__device__ __forceinline__ float nvfp4_encode_multiplier(u32 s_b, float s_dec) {
  const float e = d2f(1.0 / f2d(mul_rn(fp8_to_f32<E4M3>(s_b), s_dec)));
  return (__float_as_uint(e) & 0x7fffffffu) == F32_INF ? FLT_MAX_F : e;
}

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
  // e_b of each scale code s_b (0x7F, the NaN scale: NaN), computed once per CTA: a block looks its e_b up
  __shared__ float e_of[128];
  if (amax_out == nullptr) {
    nvfp4_global_scales(*global_amax, &s_enc, &s_dec);
    for (u32 k = threadIdx.x; k < 128u; k += blockDim.x) e_of[k] = nvfp4_encode_multiplier(k, s_dec);
    __syncthreads();
  }
  const float m = mul_rn(s_enc, __uint_as_float(ONE_SIXTH_BITS));
  if (amax_out == nullptr && vec && !tiles && !hadamard && !stochastic) {
    // The plain path: block w is x[16 w ..], its codes data[8 w ..], its scale scale[w] (the operand is x, whose
    // rows hold whole blocks).
    for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < items.count; w += (i64)gridDim.x * blockDim.x) {
      PlainBlock<T, NVFP4_BLOCK> b;
      const float amax_b = b.load(x + w * NVFP4_BLOCK);
      const u32 s_b = __float_as_uint(amax_b) > F32_INF ? 0x7fu : (u32)cvt_pair<E4M3>(mul_rn(amax_b, m), 0.f) & 0x7fu;
      u32 c[2];
      b.codes(amax_b, e_of[s_b], c);
      reinterpret_cast<uint2*>(data)[w] = make_uint2(c[0], c[1]);
      scale[w] = (u8)s_b;
    }
    return;
  }
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
    const float e = e_of[s_b];
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
// Four blocks an SM (64 registers): left to itself ptxas takes 76 on sm_120f.
static constexpr int MXFP4_BLOCKS = 4;

template <typename T, bool RCEIL>
__global__ void __launch_bounds__(FP4_THREADS, MXFP4_BLOCKS) mxfp4_quantize_kernel(
    const T* __restrict__ x, u8* __restrict__ data, u8* __restrict__ scale, i64 rows, i64 cols, int columnwise) {
  const i64 r_op = columnwise ? cols : rows, nb = (columnwise ? rows : cols) / MXFP4_BLOCK;
  const Items items{r_op, nb, r_op * nb, columnwise != 0, false};
  const bool vec = !columnwise && aligned(x, 16);
  // data is always 16-byte aligned (DATA_ALIGNMENT); its test stays because without it ptxas spills 72 bytes at
  // the 64-register bound on sm_80, 89 and 90.
  if (vec && aligned(data, 16)) {
    // The plain path: block w is x[32 w ..], its codes data[16 w ..] (one 16-byte store), its scale scale[w].
    for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < items.count; w += (i64)gridDim.x * blockDim.x) {
      PlainBlock<T, MXFP4_BLOCK> b;
      const u32 amax_b = __float_as_uint(b.load(x + w * MXFP4_BLOCK));  // NaN: 0x7FFFFFFF, e = 0xFF
      const u32 e = e8m0<RCEIL>(amax_b, __uint_as_float(ONE_SIXTH_BITS), 2);
      u32 c[4];
      b.codes(__uint_as_float(amax_b), e8m0_quant_factor(e), c);
      reinterpret_cast<uint4*>(data)[w] = make_uint4(c[0], c[1], c[2], c[3]);
      scale[w] = (u8)e;
    }
    return;
  }
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
