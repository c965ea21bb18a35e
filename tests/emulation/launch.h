// A module's kernel table and its C entry points (build.py generates the table from _kernels.KERNELS).
//
// A launch reads the kernel's arguments the way the driver does: params[j] points at argument j, laid out
// by the caller. Before running, it checks that the caller laid every argument where the kernel's own
// parameter list puts it (natural alignment, in order): a Python argument layout out of step with the
// kernel's signature fails here by name instead of reading garbage.
#pragma once

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fp8emu {

struct Launch {
  unsigned gx, gy, bx, by;
  int resident;       // blocks running at once (OS threads): the occupancy rule's number
  double timeout_s;   // no progress for this long: a deadlock (the process exits, see runtime.cpp)
  unsigned long long first, last;  // run only the blocks numbered [first, last) (x fastest): huge grids
  unsigned long long seed;  // 0: the two fixed thread orders; else seeded random orders (runtime.cpp, run_block)
};

// Runs body() in every thread of every block; "" or the first error.
std::string run_grid(const Launch& l, const std::function<void()>& body);

struct Entry {
  const char* name;
  int (*launch)(void** params, const Launch& l, std::string& err);
  int nparams;
  size_t sizes[32];
  size_t offsets[32];
};

template <typename... P>
struct Signature {
  static constexpr int n = sizeof...(P);
  static void layout(size_t* sizes, size_t* offsets) {
    const size_t sz[] = {sizeof(std::decay_t<P>)..., 0};
    const size_t al[] = {alignof(std::decay_t<P>)..., 1};
    size_t at = 0;
    for (int j = 0; j < n; ++j) {
      at = (at + al[j] - 1) / al[j] * al[j];
      sizes[j] = sz[j];
      offsets[j] = at;
      at += sz[j];
    }
  }
};

template <auto FN>
struct KernelOf;
template <typename... P, void (*FN)(P...)>
struct KernelOf<FN> {
  using Args = std::tuple<std::decay_t<P>...>;

  template <size_t... I>
  static void load(Args& a, void** params, std::index_sequence<I...>) {
    (std::memcpy(static_cast<void*>(&std::get<I>(a)), params[I], sizeof(std::get<I>(a))), ...);
  }

  static int launch(void** params, const Launch& l, std::string& err) {
    size_t sizes[32], offsets[32];
    Signature<P...>::layout(sizes, offsets);
    const char* base = static_cast<const char*>(params[0]);
    for (int j = 0; j < (int)sizeof...(P); ++j) {
      const long long at = static_cast<const char*>(params[j]) - base;
      if (at != (long long)offsets[j]) {
        char msg[256];
        std::snprintf(msg, sizeof msg, "argument %d (%zu bytes) is at offset %lld of the caller's buffer; the "
                      "kernel's parameter list puts it at %zu", j, sizes[j], at, offsets[j]);
        err = msg;
        return 1;
      }
    }
    Args args;
    load(args, params, std::index_sequence_for<P...>{});
    err = run_grid(l, [&args] { std::apply(FN, Args(args)); });
    return err.empty() ? 0 : 2;
  }

  static Entry entry(const char* name) {
    Entry e{name, &launch, (int)sizeof...(P), {}, {}};
    Signature<P...>::layout(e.sizes, e.offsets);
    return e;
  }
};

}  // namespace fp8emu

// The module's C interface over its table `fp8emu_entries` (defined by the generated translation unit).
#define FP8EMU_EXPORTS                                                                                          \
  extern "C" __attribute__((visibility("default"))) int fp8emu_count() {                                       \
    return (int)(sizeof(fp8emu_entries) / sizeof(fp8emu_entries[0]));                                           \
  }                                                                                                             \
  extern "C" __attribute__((visibility("default"))) const char* fp8emu_name(int k) {                           \
    return fp8emu_entries[k].name;                                                                              \
  }                                                                                                             \
  extern "C" __attribute__((visibility("default"))) int fp8emu_params(int k, size_t* sizes, size_t* offsets) { \
    for (int j = 0; j < fp8emu_entries[k].nparams; ++j) {                                                       \
      sizes[j] = fp8emu_entries[k].sizes[j];                                                                    \
      offsets[j] = fp8emu_entries[k].offsets[j];                                                                \
    }                                                                                                           \
    return fp8emu_entries[k].nparams;                                                                           \
  }                                                                                                             \
  extern "C" __attribute__((visibility("default"))) int fp8emu_launch(                                          \
      int k, unsigned gx, unsigned gy, unsigned bx, unsigned by, void** params, int resident, double timeout_s, \
      unsigned long long first, unsigned long long last, unsigned long long seed, char* err, int errlen) {     \
    std::string e;                                                                                              \
    const fp8emu::Launch l{gx, gy, bx, by, resident, timeout_s, first, last, seed};                            \
    const int rc = fp8emu_entries[k].launch(params, l, e);                                                      \
    std::snprintf(err, (size_t)errlen, "%s", e.c_str());                                                        \
    return rc;                                                                                                  \
  }
