// Shared device code for fp8core's kernels. NVRTC compiles these without any CUDA header.
//
// Immunity to -ftz=true (which CuPy appends and fp8core passes on purpose): every fp32 operation whose
// result or input can be subnormal is written as inline PTX without .ftz, or done in fp64 or on bit patterns.
#pragma once

namespace fp8core {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// ---- the encodings: their constants come from fp8core's table of rows (fp8core/formats.py) -------------------
// The loader defines two lists of FP8CORE_ENCODING(...), one per encoding (fp8core._kernels.module_options):
// FP8CORE_ENCODINGS, those the FP8 kernels are instantiated for (template indices 0, 1, ...), and
// FP8CORE_FP4_ENCODINGS, the packed FP4 element encodings (E2M1, index 16 on: no FP8 instantiation takes them).
// Each gives its name, template index, exponent bits, mantissa bits, bias, the code of +max, whether the all-ones
// exponent is inf/NaN (IEEE, E5M2), whether it has a NaN (without inf: the all-ones magnitude, E4M3), and the code
// a NaN casts to. One macro declares both lists, so an encoding is laid out the same whichever list holds it.
#ifndef FP8CORE_ENCODINGS
#error "FP8CORE_ENCODINGS is undefined: compile through fp8core._kernels, whose module_options define it"
#endif
#ifndef FP8CORE_FP4_ENCODINGS
#error "FP8CORE_FP4_ENCODINGS is undefined: compile through fp8core._kernels, whose module_options define it"
#endif
template <int FMT> struct Encoding;
#define FP8CORE_ENCODING(NAME, INDEX, EXP_BITS, MANT_BITS, BIAS_, MAX_CODE_, HAS_INF_, HAS_NAN_, NAN_CAST_) \
  enum { NAME = INDEX };                                                                                   \
  template <> struct Encoding<INDEX> {                                                                     \
    static constexpr int EB = EXP_BITS, MB = MANT_BITS, BIAS = BIAS_;                                      \
    static constexpr u32 MAX_CODE = MAX_CODE_, NAN_CAST = NAN_CAST_;                                       \
    static constexpr bool HAS_INF = HAS_INF_, HAS_NAN = HAS_NAN_;                                          \
  };
FP8CORE_ENCODINGS
FP8CORE_FP4_ENCODINGS
#undef FP8CORE_ENCODING

static constexpr u32 F32_NAN = 0x7fffffffu;
static constexpr u32 F32_INF = 0x7f800000u;
static constexpr float FLT_MAX_F = 3.40282346638528859811704183484516925e+38f;

// ---- exact widening to fp32 --------------------------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float((u32)x.bits << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x.bits));
  return r;
}

// |x| as fp32 bits, NaN canonicalised: unsigned order is the float order, with NaN above inf.
__device__ __forceinline__ u32 abs_bits(float x) {
  u32 b = __float_as_uint(x) & 0x7fffffffu;
  return b > F32_INF ? F32_NAN : b;
}
// |x| as fp32 bits with a NaN's payload kept, for a running max: every NaN pattern is above inf, so the max is a NaN
// exactly when one of its values is, and nan_canonical makes it abs_bits' once per max instead of once per value.
__device__ __forceinline__ u32 abs_raw(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ u32 nan_canonical(u32 m) { return m > F32_INF ? F32_NAN : m; }
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > F32_INF; }
__device__ __forceinline__ u32 umax(u32 a, u32 b) { return a > b ? a : b; }

// One IEEE fp32 multiply, round-to-nearest-even, never contracted, never flushed.
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// One IEEE fp32 sum or difference, round-to-nearest-even, never flushed (a C++ sum under -ftz=true, or an fp64 sum
// rounded to fp32, which the compiler may fold into one, becomes FADD.FTZ).
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// One fused multiply-add (one rounding, RTNE) and |x|, never flushed.
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
__device__ __forceinline__ float abs_f32(float a) {
  float r;
  asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
// Two fp32 values to f16 (lo in bits 0-15, hi in 16-31), round-to-nearest-even, subnormals kept; and the min of
// two such pairs half by half (a NaN operand gives the other), subnormals kept.
__device__ __forceinline__ u32 f16x2_rn(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 f16x2_min(u32 a, u32 b) {
  u32 r;
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ double f2d(float x) {
  double r;
  asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float d2f(double x) {
  float r;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
  return r;
}
// One IEEE fp32 division, round-to-nearest-even, never flushed (no FP64 pipe).
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---- fp32 -> fp8, RTNE with saturation; NaN of either sign -> 0x7F ---------------------------------------
// sm_89+ converts in hardware (cvt.rn.satfinite); older GPUs (sm_80/86), or any GPU when the backend is told to
// (FP8CORE_FORCE_SOFT_FP8), use the software conversion below, which writes the same bits.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(FP8CORE_FORCE_SOFT_FP8)
#define FP8CORE_HW_FP8 1
#else
#define FP8CORE_HW_FP8 0
#endif

// RTNE into the format with saturation to +-max, branch-free (a branch per element costs the SM more than the
// arithmetic, and a route through SASS takes only its cheaper side). With E = 2^e, e the exponent of |f| clamped
// below at the format's smallest normal exponent 1 - BIAS, z = |f| * 2^-(23-MB) + E rounds once (one FMA, the FPU's
// RTNE) at E's ulp 2^(e-23), which is |f| rounded to a multiple of 2^(e-MB): the format's spacing in e's binade, or
// in its subnormals where e was clamped. bits(z) - bits(E) counts those steps (2^MB and up for a normal, the code
// itself for a subnormal, a carry moving on as it should), and (e + BIAS - 1) << MB adds the exponent field; beyond
// the format's range the code exceeds MAX_CODE and saturates (inf too: z = E = inf). fp32 subnormals are exact in
// the FMA, and -ftz cannot touch it (fma.rn/abs without .ftz). A NaN gives the encoding's NaN code unless MAY_NAN
// is false, where the caller knows f is not NaN; the sign of a result that rounds to zero is kept.
template <int FMT>
__device__ __forceinline__ u32 soft_magnitude(float f) {  // the code of |f|; f not NaN
  constexpr int MB = Encoding<FMT>::MB, BIAS = Encoding<FMT>::BIAS;
  constexpr u32 MIN_E = (u32)(128 - BIAS) << 23;        // bits of 2^(1-BIAS)
  constexpr u32 E_CODE = (u32)(128 - BIAS) << MB;       // (E's biased exponent << MB) - E_CODE: the exponent field
  constexpr float STEP = 1.f / (float)(1u << (23 - MB));  // 2^-(23-MB)
  const u32 e = umax(__float_as_uint(f) & 0x7f800000u, MIN_E);
  const u32 z = __float_as_uint(fma_rn(abs_f32(f), STEP, __uint_as_float(e)));
  const u32 r = z - e + (e >> (23 - MB)) - E_CODE;
  return r < Encoding<FMT>::MAX_CODE ? r : Encoding<FMT>::MAX_CODE;
}
template <int FMT, bool MAY_NAN = true>
__device__ __forceinline__ u32 soft_cvt(float f) {
  constexpr int SIGN_BIT = Encoding<FMT>::EB + Encoding<FMT>::MB;
  const u32 b = __float_as_uint(f), sign = (b >> (31 - SIGN_BIT)) & (1u << SIGN_BIT);
  const u32 r = soft_magnitude<FMT>(f);
  return MAY_NAN && (b & 0x7fffffffu) > F32_INF ? Encoding<FMT>::NAN_CAST : r | sign;  // a NaN of either sign
}

// Two codes, lo in bits 0-7 and hi in bits 8-15: in software for every encoding, in hardware (below) for those
// the PTX ISA converts on this target. An encoding's hardware conversion is its own code, in its own lines.
// With no NaN and the sign in bit 7 (E4M3, E5M2), the two signs are the top bits of the values' byte 3, moved in
// one byte permute rather than a shift and a mask each.
template <int FMT, bool MAY_NAN = true> __device__ __forceinline__ u16 soft_pair(float lo, float hi) {
  if constexpr (!MAY_NAN && Encoding<FMT>::EB + Encoding<FMT>::MB == 7) {
    const u32 signs = __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x73u) & 0x8080u;
    return (u16)(soft_magnitude<FMT>(lo) | (soft_magnitude<FMT>(hi) << 8) | signs);
  } else {
    return (u16)(soft_cvt<FMT, MAY_NAN>(lo) | (soft_cvt<FMT, MAY_NAN>(hi) << 8));
  }
}

// Four codes, value i in byte i, by way of f16 (E4M3 and E5M2: an encoding with the sign in bit 7 whose every value
// times 2^(BIAS-15) is an f16 whose bits are the code's magnitude << (10-MB), subnormals included). soft_grid
// rounds |f| as soft_magnitude does (E clamped, one FMA at E's ulp); z - E is that rounded value times STEP,
// exactly (a multiple of E's ulp below 2^4 E), and the multiply by 2^(BIAS-15+23-MB) is exact too, so the fp32
// -> f16 conversion (one instruction for two values, no rounding left to do) and a packed min against the +max's
// f16 bits, which also takes the values past +max, inf (z - E = inf - inf = NaN; a min with one NaN operand is the
// other) and f16's overflow to +max, give each code's magnitude as a field of a half: the two halves of the values
// 0 and 2, shifted down, and of 1 and 3, shifted up, fill the four bytes without a mask. The integer work of an
// element falls from soft_magnitude's five ops to the exponent's two (the conversion and the min count as integer
// ops too: on sm_80 the fp32 -> f16 conversion runs on the integer pipe).
template <int FMT>
struct F16Grid {
  static constexpr bool value = Encoding<FMT>::EB + Encoding<FMT>::MB == 7 && Encoding<FMT>::EB <= 5 &&
                                Encoding<FMT>::BIAS <= 15 && Encoding<FMT>::MB >= 2 && Encoding<FMT>::MB <= 3;
};
template <int FMT>
__device__ __forceinline__ float soft_grid(float f) {  // |f| rounded into the format, times 2^(BIAS-15); f not NaN
  constexpr int MB = Encoding<FMT>::MB, BIAS = Encoding<FMT>::BIAS;
  constexpr u32 MIN_E = (u32)(128 - BIAS) << 23;
  constexpr float STEP = 1.f / (float)(1u << (23 - MB));
  constexpr float TO_F16 = (float)(1u << (BIAS - 15 + 23 - MB));
  const float e = __uint_as_float(umax(__float_as_uint(f) & 0x7f800000u, MIN_E));
  return mul_rn(sub_rn(fma_rn(abs_f32(f), STEP, e), e), TO_F16);
}
// signs: bit 7 of byte i is the sign of a_i (the other bits are ignored), from the caller where its values' own
// words hold them in place (MXFP8's bf16 and f16 pairs: one byte permute for four values), else soft_quad's.
template <int FMT, bool MAY_NAN = true>
__device__ __forceinline__ u32 soft_quad_signed(float a0, float a1, float a2, float a3, u32 signs) {
  if constexpr (F16Grid<FMT>::value) {
    constexpr int SHIFT = 10 - Encoding<FMT>::MB;
    constexpr u32 MAX2 = (Encoding<FMT>::MAX_CODE << SHIFT) * 0x10001u;
    const u32 h02 = f16x2_min(f16x2_rn(soft_grid<FMT>(a0), soft_grid<FMT>(a2)), MAX2);
    const u32 h13 = f16x2_min(f16x2_rn(soft_grid<FMT>(a1), soft_grid<FMT>(a3)), MAX2);
    // the two fields' bits do not meet: the sum is their union, one shift-and-add
    u32 r = ((h13 << (8 - SHIFT)) + (h02 >> SHIFT)) | (signs & 0x80808080u);
    if (MAY_NAN) {
      const float a[4] = {a0, a1, a2, a3};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool nan = (__float_as_uint(a[i]) & 0x7fffffffu) > F32_INF;  // is_nan(a[i]), as soft_cvt tests it
        if (nan) r = (r & ~(0xffu << (8 * i))) | (Encoding<FMT>::NAN_CAST << (8 * i));
      }
    }
    return r;
  } else {
    return soft_pair<FMT, MAY_NAN>(a0, a1) | ((u32)soft_pair<FMT, MAY_NAN>(a2, a3) << 16);
  }
}
template <int FMT, bool MAY_NAN = true>
__device__ __forceinline__ u32 soft_quad(float a0, float a1, float a2, float a3) {
  const u32 b0 = __float_as_uint(a0), b1 = __float_as_uint(a1), b2 = __float_as_uint(a2), b3 = __float_as_uint(a3);
  return soft_quad_signed<FMT, MAY_NAN>(a0, a1, a2, a3,
                                        __byte_perm(__byte_perm(b0, b1, 0x73u), __byte_perm(b2, b3, 0x73u), 0x5410u));
}

template <int FMT> __device__ __forceinline__ u16 cvt_pair(float lo, float hi) { return soft_pair<FMT>(lo, hi); }
#if FP8CORE_HW_FP8
template <> __device__ __forceinline__ u16 cvt_pair<E4M3>(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ u16 cvt_pair<E5M2>(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// Whether cvt_pair<FMT> is the hardware conversion on this target, whose NaN code quant_pair fixes up; the
// software conversion writes the encoding's NaN code itself (and skips that test where MAY_NAN is false).
template <int FMT> struct HwCvt { static constexpr bool value = false; };
#if FP8CORE_HW_FP8
template <> struct HwCvt<E4M3> { static constexpr bool value = true; };
template <> struct HwCvt<E5M2> { static constexpr bool value = true; };
#endif

// Quantize two values already widened to fp32, each with its own scale (quant_pair: one for both); returns lo in
// bits 0-7, hi in bits 8-15. A NaN gets the encoding's NaN code whatever the hardware writes for it (which NaN code
// the silicon's conversion writes is not settled): unless MAY_NAN is false, where the caller knows no product is
// NaN (nan_free), and the fix-up, two compares and selects per pair (the software conversion's NaN test likewise),
// costs nothing.
template <int FMT, bool MAY_NAN = true>
__device__ __forceinline__ u32 quant_pair2(float lo, float hi, float scale_lo, float scale_hi) {
  constexpr u32 NAN_CODE = Encoding<FMT>::NAN_CAST;
  float a = mul_rn(lo, scale_lo), b = mul_rn(hi, scale_hi);
  u32 r = HwCvt<FMT>::value ? cvt_pair<FMT>(a, b) : soft_pair<FMT, MAY_NAN>(a, b);
  if (MAY_NAN && HwCvt<FMT>::value) {
    if (is_nan(a)) r = (r & 0xff00u) | NAN_CODE;
    if (is_nan(b)) r = (r & 0x00ffu) | (NAN_CODE << 8);
  }
  return r;
}
template <int FMT, bool MAY_NAN = true>
__device__ __forceinline__ u32 quant_pair(float lo, float hi, float scale) {
  return quant_pair2<FMT, MAY_NAN>(lo, hi, scale, scale);
}
template <int FMT>
__device__ __forceinline__ u8 quant_one(float x, float scale) { return (u8)(quant_pair<FMT>(x, 0.f, scale) & 0xffu); }

// Whether no x * scale is NaN for values x whose abs_bits are at most m: a NaN product needs a NaN x (m above
// inf), inf * 0 or 0 * inf, or a NaN scale. One test per vector or block instead of two per pair.
__device__ __forceinline__ bool nan_free(u32 m, float scale) {
  const u32 s = __float_as_uint(scale) & 0x7fffffffu;
  return m < F32_INF && s < F32_INF && s != 0u;
}

// Four pairs (8 values) into two words, with the NaN fix-up only where nan_free(m, scale) is false.
template <int FMT>
__device__ __forceinline__ uint2 quant8_checked(const float* f, float scale, u32 m) {
  if (nan_free(m, scale)) {
    return make_uint2(quant_pair<FMT, false>(f[0], f[1], scale) | (quant_pair<FMT, false>(f[2], f[3], scale) << 16),
                      quant_pair<FMT, false>(f[4], f[5], scale) | (quant_pair<FMT, false>(f[6], f[7], scale) << 16));
  }
  return make_uint2(quant_pair<FMT>(f[0], f[1], scale) | (quant_pair<FMT>(f[2], f[3], scale) << 16),
                    quant_pair<FMT>(f[4], f[5], scale) | (quant_pair<FMT>(f[6], f[7], scale) << 16));
}

// Four values into one word of four codes, value i in byte i.
template <int FMT, bool MAY_NAN>
__device__ __forceinline__ u32 quant4(const float* f, float scale) {
  if constexpr (!HwCvt<FMT>::value) {
    return soft_quad<FMT, MAY_NAN>(mul_rn(f[0], scale), mul_rn(f[1], scale), mul_rn(f[2], scale), mul_rn(f[3], scale));
  }
  return quant_pair<FMT, MAY_NAN>(f[0], f[1], scale) | (quant_pair<FMT, MAY_NAN>(f[2], f[3], scale) << 16);
}

// ---- fp8 -> fp32, exact, by bit manipulation ------------------------------------------------------------
template <int FMT>
__device__ __forceinline__ float fp8_to_f32(u32 v) {
  using E = Encoding<FMT>;
  const int MB = E::MB, BIAS = E::BIAS;
  const u32 sign_bit = 1u << (E::EB + MB), top = (1u << E::EB) - 1u;
  const u32 sign = (v & sign_bit) << (31 - E::EB - MB);
  const u32 e = (v >> MB) & top, m = v & ((1u << MB) - 1);
  if (!E::HAS_INF && E::HAS_NAN && (v & (sign_bit - 1u)) == sign_bit - 1u) return __uint_as_float(F32_NAN);
  if (E::HAS_INF && e == top) return __uint_as_float(m ? F32_NAN : (sign | F32_INF));
  if (e == 0) {  // subnormal: m * 2^(1 - BIAS - MB), a normal fp32, made exactly from its bits
    if (m == 0) return __uint_as_float(sign);
    const int lz = 31 - __clz(m);  // position of the leading bit
    const u32 exp32 = (u32)(lz + 1 - BIAS - MB + 127);
    const u32 frac = (m & ~(1u << lz)) << (23 - lz);
    return __uint_as_float(sign | (exp32 << 23) | frac);
  }
  return __uint_as_float(sign | ((e - BIAS + 127) << 23) | (m << (23 - MB)));
}

// Two fp8 codes (lo in bits 0-7, hi in bits 8-15) to fp32, exact. sm_89+ decodes an E4M3 or E5M2 pair in one
// instruction (the PTX names the encoding) into f16, which holds every value of both exactly; a code laid out as
// f16's top byte (5 exponent bits, bias 15, inf: E5M2) is one anyway; any other code is decoded on its own.
template <int FMT> __device__ __forceinline__ u32 f16x2_of(u16 pair);
#if FP8CORE_HW_FP8
template <> __device__ __forceinline__ u32 f16x2_of<E4M3>(u16 pair) {
  u32 h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
  return h2;
}
template <> __device__ __forceinline__ u32 f16x2_of<E5M2>(u16 pair) {
  u32 h2;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(pair));
  return h2;
}
#endif
template <int FMT>
__device__ __forceinline__ void fp8x2_to_f32(u32 pair, float& lo, float& hi) {
  using E = Encoding<FMT>;
  f16 a, b;
  if constexpr (FP8CORE_HW_FP8 && (FMT == E4M3 || FMT == E5M2)) {
    const u32 h2 = f16x2_of<FMT>((u16)pair);
    a.bits = (u16)(h2 & 0xffffu);
    b.bits = (u16)(h2 >> 16);
  } else if constexpr (E::EB == 5 && E::MB == 2 && E::BIAS == 15 && E::HAS_INF) {
    a.bits = (u16)((pair & 0xffu) << 8);
    b.bits = (u16)(pair & 0xff00u);
  } else {
    lo = fp8_to_f32<FMT>(pair & 0xffu);
    hi = fp8_to_f32<FMT>((pair >> 8) & 0xffu);
    return;
  }
  lo = to_f32(a);
  hi = to_f32(b);
}

// ---- fp32 -> output dtypes, RTNE, canonical NaN -----------------------------------------------------------
__device__ __forceinline__ float from_f32_out(float x, float*) { return is_nan(x) ? __uint_as_float(F32_NAN) : x; }
__device__ __forceinline__ bf16 from_f32_out(float x, bf16*) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  if (is_nan(x)) r.bits = 0x7fff;
  return r;
}
__device__ __forceinline__ f16 from_f32_out(float x, f16*) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  if (is_nan(x)) r.bits = 0x7fff;
  return r;
}

// ---- reductions -------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 warp_max(u32 m) {
  for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Block-wide max of m, valid in thread 0. All threads of the block must call it.
__device__ __forceinline__ u32 block_max(u32 m) {
  __shared__ u32 partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  m = warp_max(m);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = m;
  __syncthreads();
  if (warp == 0) m = warp_max(lane < nwarps ? partial[lane] : 0u);
  return m;
}

// One atomic per block. An amax slot holds an fp32 bit pattern and slots compare as SIGNED 32-bit integers:
// every amax (non-negative or NaN 0x7FFFFFFF, which is above inf) is above a slot holding -0.0 or a negative
// value, so max(slot, amax) is amax there; the CPU reference compares the same way. m is an abs_bits value
// (<= 0x7FFFFFFF), so it is the same number signed or unsigned. No skip when m == 0: 0 is above -0.0.
__device__ __forceinline__ void block_amax_atomic(u32 m, u32* out) {
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(out), (int)m);
}

// ---- the scale rule of the contract, in fp64 (immune to flush-to-zero) -----------------------------------
// Returns false where there is no new scale; otherwise *s and *s_inv.
__device__ __forceinline__ float pow2_floor(float s) {
  u32 b = __float_as_uint(s);
  if (b & 0x7f800000u) return __uint_as_float(b & 0xff800000u);
  const u32 m = b & 0x7fffffu;
  return __uint_as_float(m ? (1u << (31 - __clz(m))) : 0u);
}

__device__ __forceinline__ bool scale_from_amax(float amax, float fp8_max, int margin, bool power_of_2,
                                                float epsilon, float* s_out, float* s_inv_out) {
  double a = f2d(amax);
  const double eps = f2d(epsilon);
  if (a < eps) a = eps;  // a NaN amax stays NaN
  if (!(a > 0.0) || a > 1.7976931348623157e308) return false;  // 0, NaN or inf: no new scale
  const float q = d2f(f2d(fp8_max) / a);                         // correctly rounded fp32 division
  float s;
  if (__float_as_uint(q) == F32_INF) {
    s = FLT_MAX_F;
  } else {
    const double p = __longlong_as_double((long long)(1023 - margin) << 52);  // 2^-margin, |margin| <= 512
    s = d2f(f2d(q) * p);
    if (__float_as_uint(s) == F32_INF) s = FLT_MAX_F;
  }
  if (power_of_2) s = pow2_floor(s);
  *s_out = s;
  *s_inv_out = d2f(1.0 / f2d(s));
  return true;
}

// The same rule with margin 0 in fp32, for block scales (one per 128 or 128x128 values: fp64 would occupy the
// narrow FP64 pipe). Same bits: for fp32 a and b, fp32(fp64(a) / fp64(b)) is the correctly rounded fp32 quotient
// (53 >= 2 * 24 + 2: rounding twice is innocuous for division, subnormal and overflowing quotients included), which
// div.rn.f32 computes; with margin 0 the multiply by 2^-margin is exact, and the compares are on bits, which
// -ftz cannot flush. amax_bits: abs_bits of the amax (NaN canonical); epsilon >= 0 (args.epsilon).
__device__ __forceinline__ bool scale_from_amax_f32(u32 amax_bits, float fp8_max, bool power_of_2, float epsilon,
                                                    float* s_out, float* s_inv_out) {
  const u32 eps = __float_as_uint(epsilon) & 0x7fffffffu;  // -0.0 is 0
  const u32 a = amax_bits < eps ? eps : amax_bits;          // unsigned order is the float order; NaN stays
  if (a == 0u || a >= F32_INF) return false;                // 0, inf or NaN: no new scale
  float s = div_rn(fp8_max, __uint_as_float(a));
  if (__float_as_uint(s) == F32_INF) s = FLT_MAX_F;
  if (power_of_2) s = pow2_floor(s);
  *s_out = s;
  *s_inv_out = div_rn(1.f, s);
  return true;
}

// ---- vector loads of 8 elements as fp32 (bf16 and f16: load8 after unpack16, below) -------------------------
__device__ __forceinline__ void load8(const float* p, float* f) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y); f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
  f[4] = __uint_as_float(b.x); f[5] = __uint_as_float(b.y); f[6] = __uint_as_float(b.z); f[7] = __uint_as_float(b.w);
}

// ---- the amax of 16-byte vectors, in the elements' own bits ------------------------------------------------
// vec_abs_max: the magnitudes of one vector's elements, maxed; vec_max: two such, maxed; widen_abs_max: the result
// as abs_raw of the fp32 values (NaN payload kept, so nan_canonical applies). fp32: one mask and max per element.
// bf16 and f16: a mask per two elements and a packed 16-bit max (max16x2): their magnitudes' bits order as their
// values, NaN above inf, as fp32's do; the two halves meet once, in widen_abs_max.
__device__ __forceinline__ u32 vec_abs_max(uint4 a, float*) {
  return umax(umax(a.x & 0x7fffffffu, a.y & 0x7fffffffu), umax(a.z & 0x7fffffffu, a.w & 0x7fffffffu));
}
__device__ __forceinline__ u32 vec_max(u32 a, u32 b, float*) { return umax(a, b); }
__device__ __forceinline__ u32 widen_abs_max(u32 m, float*) { return m; }
// Before sm_90 there is no 16-bit integer max (__vmaxu2 takes five instructions on sm_80): the packed float max
// with NaN propagation (one instruction) orders magnitudes as the integer max does and gives the same bits where
// no half is NaN, and a NaN (0x7FFF, above inf) where one is, which nan_canonical takes as it takes any NaN.
// max_abs16x2(m, w): m and the magnitudes of w's two values, maxed; there the packed abs (ptxas makes it a packed
// FMA with |w|, on the FP16 pipe) takes the place of the mask. fp32 (one value a word): umax of the masked bits.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
__device__ __forceinline__ u32 max16x2(u32 a, u32 b, bf16*) {
  u32 r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 max16x2(u32 a, u32 b, f16*) {
  u32 r;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 max_abs16x2(u32 m, u32 w, bf16*) {
  u32 r;
  asm("{ .reg .b32 t; abs.bf16x2 t, %2; max.NaN.bf16x2 %0, %1, t; }" : "=r"(r) : "r"(m), "r"(w));
  return r;
}
__device__ __forceinline__ u32 max_abs16x2(u32 m, u32 w, f16*) {
  u32 r;
  asm("{ .reg .b32 t; abs.f16x2 t, %2; max.NaN.f16x2 %0, %1, t; }" : "=r"(r) : "r"(m), "r"(w));
  return r;
}
#else
template <typename T>
__device__ __forceinline__ u32 max16x2(u32 a, u32 b, T*) { return __vmaxu2(a, b); }
template <typename T>
__device__ __forceinline__ u32 max_abs16x2(u32 m, u32 w, T*) { return __vmaxu2(m, w & 0x7fff7fffu); }
#endif
__device__ __forceinline__ u32 max_abs16x2(u32 m, u32 w, float*) { return umax(m, w & 0x7fffffffu); }
template <typename T>
__device__ __forceinline__ u32 vec_abs_max(uint4 a, T*) {
  T* const t = nullptr;
  return max16x2(max16x2(a.x & 0x7fff7fffu, a.y & 0x7fff7fffu, t), max16x2(a.z & 0x7fff7fffu, a.w & 0x7fff7fffu, t), t);
}
template <typename T>
__device__ __forceinline__ u32 vec_max(u32 a, u32 b, T*) { return max16x2(a, b, (T*)nullptr); }
__device__ __forceinline__ u32 widen_abs_max(u32 m, bf16*) { return umax(m >> 16, m & 0xffffu) << 16; }
__device__ __forceinline__ u32 widen_abs_max(u32 m, f16*) {
  f16 h;
  h.bits = (u16)umax(m >> 16, m & 0xffffu);
  return abs_raw(to_f32(h));  // exact and monotonic: the widened max is the max of the widened
}

// One 16-byte vector of T as fp32 values (4 for fp32, 8 for bf16 and f16).
__device__ __forceinline__ void unpack16(uint4 a, float* f, float*) {
  f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y); f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
}
template <typename T>
__device__ __forceinline__ void unpack16(uint4 a, float* f, T*) {
  const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    T lo, hi;
    lo.bits = (u16)(w[i] & 0xffffu);
    hi.bits = (u16)(w[i] >> 16);
    f[2 * i] = to_f32(lo);
    f[2 * i + 1] = to_f32(hi);
  }
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {  // bf16, f16: one 16-byte load
  unpack16(*reinterpret_cast<const uint4*>(p), f, static_cast<T*>(nullptr));
}

// ---- stores of 4, 8 or 16 bytes at any address ---------------------------------------------------------------
// NW words (byte i is byte i % 4 of word i / 4) to a p that is not 4-byte aligned: the 1-3 bytes up to the next
// 4-byte boundary (a byte and/or a 16-bit store), NW - 1 aligned words, each funnel-shifted from two, and the 3-1
// bytes left: at most NW + 3 stores where bytes took 4 NW.
template <int NW>
__device__ __forceinline__ void store_words_unaligned(u8* p, const u32* w) {
  const u32 h = 4u - ((u32)(u64)p & 3u);  // bytes before the next 4-byte boundary: 1, 2 or 3
  if (h & 1u) p[0] = (u8)w[0];
  if (h & 2u) *reinterpret_cast<u16*>(p + (h & 1u)) = (u16)(w[0] >> (8u * (h & 1u)));
#pragma unroll
  for (int k = 0; k + 1 < NW; ++k) {
    *reinterpret_cast<u32*>(p + h + 4 * k) = (u32)((((u64)w[k + 1] << 32) | w[k]) >> (8u * h));
  }
  const u32 rest = 4u - h, last = w[NW - 1] >> (8u * h);
  if (rest & 2u) *reinterpret_cast<u16*>(p + h + 4 * (NW - 1)) = (u16)last;
  if (rest & 1u) p[4 * NW - 1] = (u8)(last >> (8u * (rest & 2u)));
}

// v's 16 bytes to p with the widest stores p's alignment allows: one 16-byte store where p is 16-byte aligned; 8- or
// 4-byte stores where it is 8- or 4-byte aligned; otherwise store_words_unaligned's (at most 6 stores).
__device__ __forceinline__ void store16(u8* p, uint4 v) {
  const u32 a = (u32)(u64)p;
  if ((a & 15u) == 0u) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  if ((a & 7u) == 0u) {
    reinterpret_cast<uint2*>(p)[0] = make_uint2(v.x, v.y);
    reinterpret_cast<uint2*>(p)[1] = make_uint2(v.z, v.w);
    return;
  }
  const u32 w[4] = {v.x, v.y, v.z, v.w};
  if ((a & 3u) == 0u) {
#pragma unroll
    for (int k = 0; k < 4; ++k) reinterpret_cast<u32*>(p)[k] = w[k];
    return;
  }
  store_words_unaligned<4>(p, w);
}

// v's 8 bytes to a p that is not 8-byte aligned: two 4-byte stores, or store_words_unaligned's (at most 4 stores).
__device__ __forceinline__ void store8_misaligned(u8* p, uint2 v) {
  if (((u32)(u64)p & 3u) == 0u) {
    reinterpret_cast<u32*>(p)[0] = v.x;
    reinterpret_cast<u32*>(p)[1] = v.y;
    return;
  }
  const u32 w[2] = {v.x, v.y};
  store_words_unaligned<2>(p, w);
}

// v's 8 bytes to p likewise: one 8-byte store where p is 8-byte aligned, else store8_misaligned's.
__device__ __forceinline__ void store8(u8* p, uint2 v) {
  if (((u32)(u64)p & 7u) == 0u) {
    *reinterpret_cast<uint2*>(p) = v;
    return;
  }
  store8_misaligned(p, v);
}

// v's 4 bytes to p likewise: one 4-byte store, two 16-bit ones, or a byte, a 16-bit store and a byte.
__device__ __forceinline__ void store4(u8* p, u32 v) {
  if (((u32)(u64)p & 3u) == 0u) {
    *reinterpret_cast<u32*>(p) = v;
    return;
  }
  store_words_unaligned<1>(p, &v);
}

// v's first n bytes (0 <= n <= 8; byte i is byte i % 4 of word i / 4) to p, at any alignment: the bytes up to p's
// next 2-, 4- and 8-byte boundaries as one store each (while n lasts), then what is left as 8-, 4-, 2- and 1-byte
// stores, each aligned to its width; at most 4 stores (n = 7 or 8 at an odd p) where bytes took n. For the 1-7
// codes at either end of a range whose middle goes by vectors, and rows shorter than a vector.
__device__ __forceinline__ void store_partial8(u8* p, uint2 v, int n) {
  u64 w = ((u64)v.y << 32) | v.x;
  if (((u64)p & 1u) && n >= 1) {
    *p = (u8)w;
    p += 1; w >>= 8; n -= 1;
  }
  if (((u64)p & 2u) && n >= 2) {
    *reinterpret_cast<u16*>(p) = (u16)w;
    p += 2; w >>= 16; n -= 2;
  }
  if (((u64)p & 4u) && n >= 4) {
    *reinterpret_cast<u32*>(p) = (u32)w;
    p += 4; w >>= 32; n -= 4;
  }
  // Each step above cleared its bit of p unless fewer bytes than its width were left, so every store below is
  // aligned to its width.
  if (n == 8) {
    *reinterpret_cast<uint2*>(p) = v;
    return;
  }
  if (n & 4) {
    *reinterpret_cast<u32*>(p) = (u32)w;
    p += 4; w >>= 32;
  }
  if (n & 2) {
    *reinterpret_cast<u16*>(p) = (u16)w;
    p += 2; w >>= 16;
  }
  if (n & 1) *p = (u8)w;
}

__device__ __forceinline__ bool aligned(const void* p, int bytes) { return ((u64)p & (u64)(bytes - 1)) == 0; }

// The origin (r0, c0) of the TR x TC tile of a rows x cols tensor this block takes, or false for a spare block of
// the last row of blocks. Blocks are numbered over (x, y) as fp8core._kernels._tiles lays them out, at most 65535 x
// 65535, so a live block's index is below 2^32 and the division is 32-bit: ptxas's 64-bit division is a subroutine
// call whose register convention made the conversion code after it spill to local memory (issue 40).
template <int TR, int TC>
__device__ __forceinline__ bool tile_origin(i64 rows, i64 cols, i64& r0, i64& c0) {
  const u64 id = blockIdx.x + (u64)blockIdx.y * gridDim.x;
  const u64 tiles_c = (u64)(cols + TC - 1) / TC;
  if (id >= tiles_c * (u64)((rows + TR - 1) / TR)) return false;
  // tiles_c > id: the first row of tiles, where tiles_c itself need not fit in 32 bits
  const u32 tr = tiles_c > id ? 0u : (u32)id / (u32)tiles_c;
  r0 = (i64)tr * TR;
  c0 = (i64)((u32)id - tr * (u32)tiles_c) * TC;
  return true;
}

// How a flat loop over n elements splits for 8-wide vectors: [0, head) and [head + 8 * nv, n) one by one,
// 8 * nv elements between as vectors. The head peels x up to 16 bytes, so a misaligned view still runs its
// body vectorised when the other operand (XE-byte input, YE-byte output, Y_ALIGN-byte vector) lines up too.
struct Split {
  i64 head, nv;
};
template <int XE, int YE, int Y_ALIGN>
__device__ __forceinline__ Split split8(const void* x, const void* y, i64 n) {
  const u32 mis = (u32)((u64)x & 15u);
  const i64 head = mis == 0u ? 0 : (i64)((16u - mis) / XE);
  const bool ok = mis % XE == 0u && head <= n && (y == nullptr || aligned((const u8*)y + head * YE, Y_ALIGN));
  if (!ok) return Split{n, 0};
  return Split{head, (n - head) / 8};
}

// The indices this thread takes from [0, cnt) of a grid-stride loop, k-th first or last.
__device__ __forceinline__ i64 stride_count(i64 start, i64 stride, i64 total) {
  return start < total ? (total - 1 - start) / stride + 1 : 0;
}

}  // namespace fp8core
