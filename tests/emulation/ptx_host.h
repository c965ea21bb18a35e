// The PTX instructions cuda/ uses in inline asm, on the host, as the PTX ISA documents them (sections "cvt", "mul", "add",
// "sub", "fma", "abs", "min", "max", "prmt").
//
// build.py rewrites `asm("T" : "=c"(d) : "c"(a), "c"(b));` into
// `::fp8emu::ptx<::fp8emu::op("T")>(::fp8emu::out<'c'>(d), ::fp8emu::in<'c'>(a), ::fp8emu::in<'c'>(b));`
// so operands arrive in the order the statement binds them (%0, %1, %2) and each constraint letter is checked
// against its operand's size. An instruction not listed here does not compile (Ptx<op> is incomplete).
//
// Written from the ISA's definitions, not from cuda/common.cuh's software conversions, so that the emulated
// hardware path is an independent check of the code around it:
// - fp8 results: round to nearest even among the format's finite values (found by search, compared exactly in
//   double), .satfinite clamps to +-MAX_NORM (infinities included), NaN gives a NaN code (not the canonical
//   0x7F: the input's sign, and 0x7D for E5M2; what the silicon writes is unconfirmed, see fp8_rn_satfinite);
//   the sign of a result that rounds to zero is the input's. For x2 forms, a goes to the upper 8 bits, b lower.
// - ue8m0 (.rp.satfinite): the least 2^(e-127) >= a, e in 0..254; NaN gives 0xFF.
// - f16 and bf16 conversions round to nearest even with subnormals (no .ftz), NaN -> canonical 0x7FFF; min.f16x2
//   compares the halves as values, a NaN operand giving the other.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <xmmintrin.h>

namespace fp8emu {

constexpr unsigned long long op(const char* s) {
  unsigned long long h = 1469598103934665603ull;
  while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
  return h;
}

template <char C, typename T>
constexpr bool constraint_fits() {
  if (C == 'h') return sizeof(T) == 2;
  if (C == 'r') return sizeof(T) == 4 && !std::is_floating_point<T>::value;
  if (C == 'l') return sizeof(T) == 8 && !std::is_floating_point<T>::value;
  if (C == 'f') return std::is_same<T, float>::value;
  if (C == 'd') return std::is_same<T, double>::value;
  return false;
}
template <char C, typename T>
inline T& out(T& x) {
  static_assert(constraint_fits<C, T>(), "asm output operand does not fit its constraint");
  return x;
}
template <char C, typename T>
inline T in(const T& x) {
  static_assert(constraint_fits<C, T>(), "asm input operand does not fit its constraint");
  return x;
}

template <unsigned long long OP>
struct Ptx;  // an instruction without a specialisation here is not emulated: compile error at its call
// The threads run with the host's flush-to-zero and denormals-are-zero modes where the module was compiled with
// -ftz=true (runtime.cpp), as plain fp32 arithmetic flushes on the GPU; an instruction written without .ftz does
// not flush, so each runs in IEEE mode. (The host's modes flush fp64 too, which the GPU's -ftz does not: stricter.)
struct IeeeMode {
#if defined(FP8EMU_FTZ)
  unsigned saved = _mm_getcsr();
  IeeeMode() { _mm_setcsr(0x1f80u); }
  ~IeeeMode() { _mm_setcsr(saved); }
#endif
};

template <unsigned long long OP, typename... A>
inline void ptx(A&&... a) {
  IeeeMode ieee;
  Ptx<OP>::run(std::forward<A>(a)...);
}

inline float f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Exact value of an fp8 code (E4M3: bias 7, 3 mantissa bits, no inf, S.1111.111 NaN; E5M2: bias 15, IEEE-like).
inline double fp8_value(unsigned code, bool e4m3) {
  const int mb = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const unsigned e = (code >> mb) & (e4m3 ? 0xfu : 0x1fu), m = code & ((1u << mb) - 1u);
  const double s = (code & 0x80u) ? -1.0 : 1.0;
  if (e4m3 && (code & 0x7fu) == 0x7fu) return NAN;
  if (!e4m3 && e == 0x1fu) return m ? NAN : s * INFINITY;
  if (e == 0) return s * std::ldexp((double)m, 1 - bias - mb);
  return s * std::ldexp((double)((1u << mb) | m), (int)e - bias - mb);
}

// The positive values of a format's codes 0 .. MAX_NORM, increasing with the code.
struct Fp8Values {
  double v[128];
  unsigned top;
  explicit Fp8Values(bool e4m3) : top(e4m3 ? 0x7eu : 0x7bu) {
    for (unsigned c = 0; c <= top; ++c) v[c] = fp8_value(c, e4m3);
  }
};

inline uint8_t fp8_rn_satfinite(float x, bool e4m3) {
  static const Fp8Values e4m3_values(true), e5m2_values(false);
  const Fp8Values& t = e4m3 ? e4m3_values : e5m2_values;
  // A NaN: the ISA gives a NaN, but which code the silicon writes is not settled (cuda_fp8.hpp says 0x7F), so the
  // emulator writes the input's sign and, for E5M2, another NaN code: a kernel that leaves the contract's 0x7F
  // to the hardware fails here.
  if (std::isnan(x)) return (uint8_t)((std::signbit(x) ? 0x80u : 0u) | (e4m3 ? 0x7fu : 0x7du));
  const unsigned sign = std::signbit(x) ? 0x80u : 0u;
  const double a = std::fabs((double)x);
  if (a >= t.v[t.top]) return (uint8_t)(sign | t.top);  // .satfinite: beyond MAX_NORM (inf too) is MAX_NORM
  unsigned lo = 0, hi = t.top;  // t.v[lo] <= a < t.v[hi]
  while (hi - lo > 1) {
    const unsigned mid = (lo + hi) / 2;
    (t.v[mid] <= a ? lo : hi) = mid;
  }
  const double below = a - t.v[lo], above = t.v[hi] - a;
  const unsigned r = below < above ? lo : above < below ? hi : ((lo & 1u) ? hi : lo);  // a tie: the even code
  return (uint8_t)(sign | r);
}

inline uint16_t f16_from_f32(float x) {  // IEEE binary16, round to nearest even (GCC's _Float16 conversion)
  if (std::isnan(x)) return 0x7fff;
  const _Float16 h = (_Float16)x;
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float f32_from_f16(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return (float)h;
}
inline uint16_t bf16_from_f32(float x) {
  if (std::isnan(x)) return 0x7fff;
  const uint32_t u = bits(x), lower = u & 0xffffu, half = 0x8000u;
  uint32_t r = u >> 16;
  if (lower > half || (lower == half && (r & 1u))) ++r;  // a carry into the exponent is the right result (inf too)
  return (uint16_t)r;
}

inline uint8_t ue8m0_rp_satfinite(float x) {
  if (std::isnan(x)) return 0xff;
  if (std::signbit(x) && x != 0.f) {
    std::fprintf(stderr, "fp8emu: cvt.rp.satfinite.ue8m0x2.f32 of a negative value is not emulated\n");
    std::abort();
  }
  const double a = (double)x;
  for (int e = 0; e <= 254; ++e)
    if (std::ldexp(1.0, e - 127) >= a) return (uint8_t)e;
  return 254;  // above 2^127, infinity included: .satfinite
}

inline uint16_t f16_of_fp8(unsigned code, bool e4m3) {
  const double v = fp8_value(code, e4m3);
  return f16_from_f32((float)v);  // every E4M3 and E5M2 value is an f16 value: exact
}

#define FP8EMU_PTX(TEXT) template <> struct Ptx<op(TEXT)>

FP8EMU_PTX("cvt.f32.f16 %0, %1;") {
  template <typename H> static void run(float& d, H a) { d = f32_from_f16((uint16_t)a); }
};
FP8EMU_PTX("mul.rn.f32 %0, %1, %2;") {
  // The product of two floats is exact in double; one rounding to float is then the correctly rounded product.
  static void run(float& d, float a, float b) { d = (float)((double)a * (double)b); }
};
FP8EMU_PTX("add.rn.f32 %0, %1, %2;") {
  // double carries more than 2 * 24 + 2 significant bits: its sum rounded once to float is the correctly rounded sum.
  static void run(float& d, float a, float b) { d = (float)((double)a + (double)b); }
};
FP8EMU_PTX("sub.rn.f32 %0, %1, %2;") {
  static void run(float& d, float a, float b) { d = (float)((double)a - (double)b); }
};
FP8EMU_PTX("div.rn.f32 %0, %1, %2;") {
  static void run(float& d, float a, float b) { d = a / b; }  // IEEE: the host's division in IeeeMode
};
FP8EMU_PTX("cvt.f64.f32 %0, %1;") {
  static void run(double& d, float a) { d = (double)a; }
};
FP8EMU_PTX("cvt.rn.f32.f64 %0, %1;") {
  static void run(float& d, double a) { d = (float)a; }
};
FP8EMU_PTX("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;") {
  template <typename H> static void run(H& d, float a, float b) {
    d = (H)((fp8_rn_satfinite(a, true) << 8) | fp8_rn_satfinite(b, true));
  }
};
FP8EMU_PTX("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;") {
  template <typename H> static void run(H& d, float a, float b) {
    d = (H)((fp8_rn_satfinite(a, false) << 8) | fp8_rn_satfinite(b, false));
  }
};
FP8EMU_PTX("cvt.rn.f16x2.e4m3x2 %0, %1;") {
  template <typename R, typename H> static void run(R& d, H a) {
    d = (R)(((uint32_t)f16_of_fp8(((unsigned)a >> 8) & 0xffu, true) << 16) | f16_of_fp8((unsigned)a & 0xffu, true));
  }
};
FP8EMU_PTX("cvt.rn.f16x2.e5m2x2 %0, %1;") {
  template <typename R, typename H> static void run(R& d, H a) {
    d = (R)(((uint32_t)f16_of_fp8(((unsigned)a >> 8) & 0xffu, false) << 16) | f16_of_fp8((unsigned)a & 0xffu, false));
  }
};
FP8EMU_PTX("cvt.rn.bf16.f32 %0, %1;") {
  template <typename H> static void run(H& d, float a) { d = (H)bf16_from_f32(a); }
};
FP8EMU_PTX("cvt.rn.f16.f32 %0, %1;") {
  template <typename H> static void run(H& d, float a) { d = (H)f16_from_f32(a); }
};
FP8EMU_PTX("cvt.rn.f16x2.f32 %0, %1, %2;") {
  // a to the upper half, b to the lower (the ISA's order for the x2 forms)
  static void run(uint32_t& d, float a, float b) { d = ((uint32_t)f16_from_f32(a) << 16) | f16_from_f32(b); }
};
// min.f16x2 without .NaN: per half, one NaN operand gives the other, two the canonical NaN; -0.0 is below +0.0.
inline uint16_t f16_min(uint16_t a, uint16_t b) {
  const bool na = (a & 0x7fffu) > 0x7c00u, nb = (b & 0x7fffu) > 0x7c00u;
  if (na && nb) return 0x7fff;
  if (na) return b;
  if (nb) return a;
  const float x = f32_from_f16(a), y = f32_from_f16(b);
  if (x == y) return (a & 0x8000u) ? a : b;
  return x < y ? a : b;
}
FP8EMU_PTX("min.f16x2 %0, %1, %2;") {
  static void run(uint32_t& d, uint32_t a, uint32_t b) {
    d = ((uint32_t)f16_min((uint16_t)(a >> 16), (uint16_t)(b >> 16)) << 16) | f16_min((uint16_t)a, (uint16_t)b);
  }
};
// max.NaN.bf16x2 / max.NaN.f16x2: per half, a NaN operand gives the canonical NaN 0x7FFF; +0.0 is above -0.0.
template <bool BF16>
inline uint16_t half_max_nan(uint16_t a, uint16_t b) {
  const float x = BF16 ? f32((uint32_t)a << 16) : f32_from_f16(a), y = BF16 ? f32((uint32_t)b << 16) : f32_from_f16(b);
  if (std::isnan(x) || std::isnan(y)) return 0x7fff;
  if (x == y) return (a & 0x8000u) ? b : a;
  return x > y ? a : b;
}
FP8EMU_PTX("max.NaN.bf16x2 %0, %1, %2;") {
  static void run(uint32_t& d, uint32_t a, uint32_t b) {
    d = ((uint32_t)half_max_nan<true>((uint16_t)(a >> 16), (uint16_t)(b >> 16)) << 16) |
        half_max_nan<true>((uint16_t)a, (uint16_t)b);
  }
};
FP8EMU_PTX("max.NaN.f16x2 %0, %1, %2;") {
  static void run(uint32_t& d, uint32_t a, uint32_t b) {
    d = ((uint32_t)half_max_nan<false>((uint16_t)(a >> 16), (uint16_t)(b >> 16)) << 16) |
        half_max_nan<false>((uint16_t)a, (uint16_t)b);
  }
};
// abs.bf16x2 / abs.f16x2 then the max: abs clears each half's sign bit (a NaN stays a NaN).
FP8EMU_PTX("{ .reg .b32 t; abs.bf16x2 t, %2; max.NaN.bf16x2 %0, %1, t; }") {
  static void run(uint32_t& d, uint32_t m, uint32_t w) { Ptx<op("max.NaN.bf16x2 %0, %1, %2;")>::run(d, m, w & 0x7fff7fffu); }
};
FP8EMU_PTX("{ .reg .b32 t; abs.f16x2 t, %2; max.NaN.f16x2 %0, %1, t; }") {
  static void run(uint32_t& d, uint32_t m, uint32_t w) { Ptx<op("max.NaN.f16x2 %0, %1, %2;")>::run(d, m, w & 0x7fff7fffu); }
};
FP8EMU_PTX("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;") {
  template <typename H> static void run(H& d, float a, float b) {
    d = (H)((ue8m0_rp_satfinite(a) << 8) | ue8m0_rp_satfinite(b));
  }
};

FP8EMU_PTX("fma.rn.f32 %0, %1, %2, %3;") {
  static void run(float& d, float a, float b, float c) { d = std::fmaf(a, b, c); }  // one rounding, IeeeMode
};
FP8EMU_PTX("abs.f32 %0, %1;") {
  static void run(float& d, float a) { d = f32(bits(a) & 0x7fffffffu); }  // no .ftz: subnormals kept
};
FP8EMU_PTX("min.f32 %0, %1, %2;") {
  // One NaN operand: the other; both: the canonical NaN; -0.0 is below +0.0.
  static void run(float& d, float a, float b) {
    if (std::isnan(a) && std::isnan(b)) d = f32(0x7fffffffu);
    else if (std::isnan(a)) d = b;
    else if (std::isnan(b)) d = a;
    else if (a == b) d = std::signbit(a) ? a : b;
    else d = a < b ? a : b;
  }
};
FP8EMU_PTX("max.NaN.f32 %0, %1, %2;") {
  // Either operand NaN: the canonical NaN; +0.0 is above -0.0.
  static void run(float& d, float a, float b) {
    if (std::isnan(a) || std::isnan(b)) d = f32(0x7fffffffu);
    else if (a == b) d = std::signbit(a) ? b : a;
    else d = a > b ? a : b;
  }
};
FP8EMU_PTX("prmt.b32 %0, %1, %2, %3;") {
  // Default mode: byte i of d is byte s[4i+2:4i] of {b, a} (a bytes 0-3), its sign replicated where s[4i+3] is set.
  static void run(uint32_t& d, uint32_t a, uint32_t b, uint32_t s) {
    const unsigned long long v = ((unsigned long long)b << 32) | a;
    d = 0;
    for (int i = 0; i < 4; ++i) {
      const unsigned sel = (s >> (4 * i)) & 0xfu;
      unsigned byte = (unsigned)(v >> (8 * (sel & 7u))) & 0xffu;
      if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
      d |= byte << (8 * i);
    }
  }
};

// E2M1 (cvt.rn.satfinite.e2m1x2.f32): round to nearest even among 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code = index), .satfinite
// clamps beyond 6 (inf too) to 6, the sign kept (also on a result that rounds to 0). A NaN: E2M1 has none, and what
// the silicon writes is unconfirmed (cuda_fp4.hpp's host emulation: +6, 0x7), so the emulator writes 0xF: a kernel
// that leaves the contract's 0x7 to the hardware fails here.
inline uint8_t e2m1_rn_satfinite(float x) {
  static const double v[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if (std::isnan(x)) return 0xf;
  const unsigned sign = std::signbit(x) ? 8u : 0u;
  const double a = std::fabs((double)x);
  if (a >= 6) return (uint8_t)(sign | 7u);
  unsigned lo = 0;
  while (v[lo + 1] <= a) ++lo;  // v[lo] <= a < v[lo + 1]
  const double below = a - v[lo], above = v[lo + 1] - a;
  const unsigned r = below < above ? lo : above < below ? lo + 1 : ((lo & 1u) ? lo + 1 : lo);
  return (uint8_t)(sign | r);
}
FP8EMU_PTX("{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, %1, %2; cvt.u32.u8 %0, t; }") {
  // a's code in bits 4-7, b's in bits 0-3 (the first source in the upper nibble), widened to 32 bits
  static void run(uint32_t& d, float a, float b) { d = (uint32_t)((e2m1_rn_satfinite(a) << 4) | e2m1_rn_satfinite(b)); }
};

#undef FP8EMU_PTX

}  // namespace fp8emu
