// CUDA's built-ins on the host, so that cuda/*.cu compile as C++ and run on the CPU (tests/emulation/build.py).
//
// Each CUDA thread is a ucontext fiber; the threads of a block share one OS thread and a scheduler that runs
// every runnable thread until it blocks, then completes the collective operations they wait in: __syncthreads
// once every live thread of the block waits at the same one, a warp shuffle once every lane of its mask waits at
// the same one. Anything else (a barrier some threads skipped or exited before, lanes at different shuffles,
// a mask naming an exited lane, nothing runnable) is reported as the error it would be on a GPU, with the line.
// Blocks run concurrently on `resident` OS threads (what the occupancy rule lets be resident), so atomics and
// a spinning grid barrier work across blocks as on a GPU, and hang as on a GPU when too few blocks are resident.
// __shared__ variables are thread_local statics: one per OS thread, which runs one block at a time. build.py
// follows each declaration with FP8EMU_SHARED(name): the first thread of a block to pass it fills the variable
// with a poison byte (0x7F or 0xFF, alternating from block to block: a large finite float and a NaN, a large
// positive and a negative integer), so a read of what no thread of the block wrote sees neither zeros nor the
// previous block's data, as on a GPU it would see whatever the SM's shared memory last held.
//
// Inline PTX is rewritten by build.py into calls of fp8emu::ptx<op>(...) (ptx_host.h), each instruction
// implemented as the PTX ISA documents it, operands in the order the asm statement binds them.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

struct uint3 { unsigned int x, y, z; };
typedef uint3 dim3;
struct __align__(8) uint2 { unsigned int x, y; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct __align__(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace fp8emu {

struct BlockCtx {
  uint3 idx, dim, grid;
  unsigned long long serial;  // unique to this run of this block in the process
};
struct FiberCtx {
  uint3 idx;
  int linear;
};
extern thread_local BlockCtx* tls_block;
extern thread_local FiberCtx* tls_fiber;

// Collectives: the calling fiber parks itself with what it waits for and returns to the scheduler.
void sync_block(const char* file, int line);
unsigned long long shfl(unsigned mask, unsigned long long bits, int lane_arg, int mode, const char* file, int line);

template <typename T>
inline T shfl_t(unsigned mask, T v, int arg, int mode, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shfl(mask, bits, arg, mode, file, line);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// Poison a __shared__ variable the first time a thread of this block reaches its declaration (`seen` holds the
// serial of the block that last poisoned it on this OS thread).
inline void poison_shared(void* p, size_t n, unsigned long long& seen) {
  if (seen == tls_block->serial) return;
  seen = tls_block->serial;
  std::memset(p, (seen & 1u) ? 0xff : 0x7f, n);
}

}  // namespace fp8emu

#define FP8EMU_SHARED(name)                                  \
  static thread_local unsigned long long fp8emu_seen_##name = 0; \
  ::fp8emu::poison_shared(&(name), sizeof(name), fp8emu_seen_##name)

#define threadIdx (::fp8emu::tls_fiber->idx)
#define blockIdx (::fp8emu::tls_block->idx)
#define blockDim (::fp8emu::tls_block->dim)
#define gridDim (::fp8emu::tls_block->grid)
#define __syncthreads() ::fp8emu::sync_block(__FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lanemask) ::fp8emu::shfl_t((mask), (v), (lanemask), 1, __FILE__, __LINE__)
#define __shfl_sync(mask, v, src) ::fp8emu::shfl_t((mask), (v), (src), 0, __FILE__, __LINE__)

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAdd(int* p, int v) {  // two's complement wrap, as the hardware adds
  return (int)__atomic_fetch_add(reinterpret_cast<unsigned int*>(p), (unsigned int)v, __ATOMIC_SEQ_CST);
}

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
// CUDA's __byte_perm: byte i of the result is byte s[4i+2:4i] of {y, x} (x bytes 0-3, y bytes 4-7). Bit 4i+3 of s is
// ignored: NVRTC compiles __byte_perm(x, y, 0xFBD9) to PRMT x, 0x7351, y (no sign replication, which only prmt.b32
// written as inline PTX gives).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
// Per 16-bit half, the unsigned max.
inline unsigned int __vmaxu2(unsigned int a, unsigned int b) {
  const unsigned lo = (a & 0xffffu) > (b & 0xffffu) ? (a & 0xffffu) : (b & 0xffffu);
  const unsigned hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return (hi << 16) | lo;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

#include "ptx_host.h"
