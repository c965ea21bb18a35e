// The emulator's scheduler: CUDA threads as ucontext fibers, blocks on OS threads (see cuda_host.h).
// Before any header: fortified glibc (Ubuntu's compilers define _FORTIFY_SOURCE whenever they optimise) turns
// _longjmp into __longjmp_chk, which aborts ("longjmp causes uninitialized stack frame") on a jump to a lower
// address on another stack, and every fiber switch is a jump to another stack.
#undef _FORTIFY_SOURCE
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <xmmintrin.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_host.h"
#include "launch.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FP8EMU_ASAN 1
#else
#define FP8EMU_ASAN 0
#endif

namespace fp8emu {

thread_local BlockCtx* tls_block = nullptr;
thread_local FiberCtx* tls_fiber = nullptr;

namespace {

constexpr size_t kStack = 64 * 1024;
enum class State { Run, Barrier, Shuffle, Done };

// Fiber stacks outlive launches (a pool), so their pages are touched once per process, not once per block.
std::mutex stacks_lock;
std::vector<char*> free_stacks;

char* take_stack() {
  {
    std::lock_guard<std::mutex> g(stacks_lock);
    if (!free_stacks.empty()) {
      char* p = free_stacks.back();
      free_stacks.pop_back();
      return p;
    }
  }
  void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "fp8emu: no memory for fiber stacks\n");
    std::abort();
  }
  return static_cast<char*>(p);
}

void give_stack(char* p) {
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(p, kStack);  // frames abandoned by a failed block may have left poison
#endif
  std::lock_guard<std::mutex> g(stacks_lock);
  free_stacks.push_back(p);
}

// Switching: the first entry into a fiber goes through setcontext (onto its own stack), every later switch
// through _setjmp/_longjmp, which unlike swapcontext makes no system call (the signal mask stays as it is).
struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  bool started = false;
  FiberCtx c;
  State st = State::Done;
  const char* file = "";
  int line = 0;
  unsigned mask = 0;
  int mode = 0, arg = 0;
  unsigned long long value = 0, result = 0;
  char* stack = nullptr;
  void* fake_stack = nullptr;
};

// One per OS thread: the block it runs now.
struct Scheduler {
  jmp_buf main;
  void* main_fake_stack = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
  std::vector<Fiber> fibers;
  int current = -1;
  std::string error;
  const std::function<void()>* body = nullptr;
  std::atomic<unsigned long long>* progress = nullptr;
  ~Scheduler() {
    for (auto& f : fibers)
      if (f.stack) give_stack(f.stack);
  }
};
thread_local Scheduler* tls_sched = nullptr;

std::string where(const char* file, int line) {
  std::string f = file;
  const size_t slash = f.rfind('/');
  return (slash == std::string::npos ? f : f.substr(slash + 1)) + ":" + std::to_string(line);
}

// Fiber -> scheduler. `finished`: the fiber never runs again (ASan drops its fake stack).
void to_main(bool finished) {
  Scheduler& s = *tls_sched;
  Fiber& f = s.fibers[s.current];
#if FP8EMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f.fake_stack, s.main_bottom, s.main_size);
#else
  (void)finished;
#endif
  if (!_setjmp(f.jb)) _longjmp(s.main, 1);
#if FP8EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

// Scheduler -> fiber i, back when it blocks or ends.
void run_fiber(Scheduler& s, int i) {
  Fiber& f = s.fibers[i];
  s.current = i;
  tls_fiber = &f.c;
#if FP8EMU_ASAN
  __sanitizer_start_switch_fiber(&s.main_fake_stack, f.stack, kStack);
#endif
  if (!_setjmp(s.main)) {
    if (!f.started) {
      f.started = true;
      setcontext(&f.ctx);
    }
    _longjmp(f.jb, 1);
  }
#if FP8EMU_ASAN
  __sanitizer_finish_switch_fiber(s.main_fake_stack, nullptr, nullptr);
#endif
  s.progress->fetch_add(1, std::memory_order_relaxed);
}

void trampoline() {
  Scheduler& s = *tls_sched;
#if FP8EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.main_bottom, &s.main_size);
#endif
  (*s.body)();
  s.fibers[s.current].st = State::Done;
  to_main(true);
}

void park(State st, const char* file, int line) {
  Scheduler& s = *tls_sched;
  Fiber& f = s.fibers[s.current];
  f.st = st;
  f.file = file;
  f.line = line;
  to_main(false);
}

// Complete what the parked threads of the block wait for; false if nothing could be completed.
bool release(Scheduler& s, int nthreads) {
  bool released = false;
  for (int w0 = 0; w0 < nthreads && s.error.empty(); w0 += 32) {
    const int lanes = std::min(32, nthreads - w0);
    int first = -1;
    for (int l = 0; l < lanes; ++l)
      if (s.fibers[w0 + l].st == State::Shuffle) { first = l; break; }
    if (first < 0) continue;
    const Fiber& g = s.fibers[w0 + first];
    const std::string site = where(g.file, g.line);
    for (int l = 0; l < 32; ++l) {
      if (!(g.mask >> l & 1u)) continue;
      if (l >= lanes) {
        s.error = "warp shuffle at " + site + ": its mask names lane " + std::to_string(l) + ", which the block (" +
                  std::to_string(nthreads) + " threads) does not have";
        return false;
      }
      const Fiber& f = s.fibers[w0 + l];
      if (f.st == State::Done) {
        s.error = "warp shuffle at " + site + ": lane " + std::to_string(l) + " of its mask has exited";
        return false;
      }
      if (f.st != State::Shuffle || f.file != g.file || f.line != g.line || f.mask != g.mask || f.mode != g.mode) {
        s.error = "divergent warp: lane " + std::to_string(first) + " waits at the shuffle at " + site + ", lane " +
                  std::to_string(l) + " at " + (f.st == State::Barrier ? "__syncthreads " : "a shuffle ") +
                  where(f.file, f.line);
        return false;
      }
    }
    for (int l = 0; l < lanes; ++l) {
      Fiber& f = s.fibers[w0 + l];
      if (!(g.mask >> l & 1u)) continue;
      const int src = f.mode == 1 ? (l ^ f.arg) & 31 : f.arg & 31;
      if (!(g.mask >> src & 1u) || src >= lanes) {
        s.error = "warp shuffle at " + site + ": lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
                  ", outside the mask";
        return false;
      }
      f.result = s.fibers[w0 + src].value;
    }
    for (int l = 0; l < lanes; ++l)
      if (g.mask >> l & 1u) s.fibers[w0 + l].st = State::Run;
    released = true;
  }
  if (released || !s.error.empty()) return released;
  int at_barrier = 0, done = 0, first = -1;
  for (int i = 0; i < nthreads; ++i) {
    if (s.fibers[i].st == State::Barrier) {
      ++at_barrier;
      if (first < 0) first = i;
    }
    if (s.fibers[i].st == State::Done) ++done;
  }
  if (at_barrier == 0) return false;
  const Fiber& g = s.fibers[first];
  if (done) {
    s.error = "__syncthreads at " + where(g.file, g.line) + " reached by " + std::to_string(at_barrier) +
              " threads while " + std::to_string(done) + " have exited";
    return false;
  }
  for (int i = 0; i < nthreads; ++i) {
    const Fiber& f = s.fibers[i];
    if (f.file != g.file || f.line != g.line) {
      s.error = "divergent barrier: thread " + std::to_string(first) + " waits at __syncthreads " +
                where(g.file, g.line) + ", thread " + std::to_string(i) + " at " + where(f.file, f.line);
      return false;
    }
  }
  for (int i = 0; i < nthreads; ++i) s.fibers[i].st = State::Run;
  return true;
}

std::atomic<unsigned long long> block_serial{0};

unsigned long long splitmix64(unsigned long long x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The order of one round: with seed 0, increasing thread order on even rounds and decreasing on odd ones, the
// first round's parity alternating from block to block: shared memory read with no barrier after another thread's
// write then reads stale data whichever way the data flows between two threads (in one fixed order, a reader that
// runs after its writer would see the data as if the barrier were there). A race among three or more threads can
// still hide from both (two writers at either end of the block publishing one value: every reader runs after one
// of them), so a seed gives each round of each block its own random order, the same for the same seed.
void round_order(std::vector<int>& order, int nthreads, unsigned long long seed, const BlockCtx& blk,
                 unsigned round) {
  order.resize(nthreads);
  for (int k = 0; k < nthreads; ++k) order[k] = ((blk.idx.x + blk.idx.y + round) & 1u) ? nthreads - 1 - k : k;
  if (seed == 0) return;
  unsigned long long r = splitmix64(seed ^ splitmix64(((unsigned long long)blk.idx.y << 32 | blk.idx.x) ^
                                                      splitmix64(round)));
  for (int k = nthreads - 1; k > 0; --k) {  // Fisher-Yates
    r = splitmix64(r);
    std::swap(order[k], order[(int)(r % (unsigned long long)(k + 1))]);
  }
}

void run_block(Scheduler& s, BlockCtx& blk, unsigned long long seed) {
  const int nthreads = (int)(blk.dim.x * blk.dim.y);
  if ((int)s.fibers.size() < nthreads) s.fibers.resize(nthreads);
  tls_block = &blk;
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = s.fibers[i];
    if (!f.stack) f.stack = take_stack();
    f.started = false;
    f.c.idx = uint3{(unsigned)i % blk.dim.x, (unsigned)i / blk.dim.x, 0u};
    f.c.linear = i;
    f.st = State::Run;
    f.file = "";
    f.line = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
  }
  // Each round runs every runnable thread up to its next collective, in the round's order (round_order).
  std::vector<int> order;
  for (unsigned round = 0;; ++round) {
    round_order(order, nthreads, seed, blk, round);
    for (int k = 0; k < nthreads && s.error.empty(); ++k) {
      const int i = order[k];
      if (s.fibers[i].st == State::Run) run_fiber(s, i);
    }
    if (!s.error.empty()) break;
    bool all_done = true;
    for (int i = 0; i < nthreads; ++i) all_done = all_done && s.fibers[i].st == State::Done;
    if (all_done) break;
    if (!release(s, nthreads)) {
      if (s.error.empty()) s.error = "deadlock inside the block: no thread can run and no barrier can complete";
      break;
    }
  }
  if (!s.error.empty()) {
    char head[96];
    std::snprintf(head, sizeof head, "block (%u, %u): ", blk.idx.x, blk.idx.y);
    s.error = head + s.error;
  }
  tls_block = nullptr;
  tls_fiber = nullptr;
}

}  // namespace

void sync_block(const char* file, int line) { park(State::Barrier, file, line); }

unsigned long long shfl(unsigned mask, unsigned long long bits, int arg, int mode, const char* file, int line) {
  Scheduler& s = *tls_sched;
  Fiber& f = s.fibers[s.current];
  f.mask = mask;
  f.value = bits;
  f.arg = arg;
  f.mode = mode;
  park(State::Shuffle, file, line);
  return f.result;
}

std::string run_grid(const Launch& l, const std::function<void()>& body) {
  const unsigned long long threads = (unsigned long long)l.bx * l.by;
  if (l.gx == 0 || l.gy == 0 || l.gx > 2147483647u || l.gy > 65535u || threads == 0 || threads > 1024 ||
      l.by > 1024)
    return "invalid launch configuration: grid (" + std::to_string(l.gx) + ", " + std::to_string(l.gy) +
           "), block (" + std::to_string(l.bx) + ", " + std::to_string(l.by) + ")";
  const unsigned long long total = std::min((unsigned long long)l.gx * l.gy, l.last);
  if (l.first >= total) return "";
  const int workers = (int)std::min<unsigned long long>(total - l.first, (unsigned long long)std::max(1, l.resident));
  std::atomic<unsigned long long> next{l.first}, progress{0};
  int finished = 0;  // workers done, under m
  std::mutex m;
  std::condition_variable done;
  std::string error;
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
#if defined(FP8EMU_FTZ)
      _mm_setcsr(0x9fc0u);  // -ftz=true: fp32 results and inputs flushed (FTZ, DAZ); PTX instructions restore IEEE
#else
      _mm_setcsr(0x1f80u);  // IEEE, whatever the launching thread had
#endif
      Scheduler s;
      s.body = &body;
      s.progress = &progress;
      tls_sched = &s;
      for (;;) {
        const unsigned long long b = next.fetch_add(1);
        if (b >= total) break;
        {
          std::lock_guard<std::mutex> g(m);
          if (!error.empty()) break;
        }
        BlockCtx blk{uint3{(unsigned)(b % l.gx), (unsigned)(b / l.gx), 0u}, uint3{l.bx, l.by, 1u},
                     uint3{l.gx, l.gy, 1u}, block_serial.fetch_add(1) + 1};
        run_block(s, blk, l.seed);
        progress.fetch_add(1, std::memory_order_relaxed);
        if (!s.error.empty()) {
          std::lock_guard<std::mutex> g(m);
          if (error.empty()) error = s.error;
          break;
        }
      }
      tls_sched = nullptr;
      {
        std::lock_guard<std::mutex> g(m);
        ++finished;
      }
      done.notify_all();
    });
  }
  // Watchdog: blocks spinning on a grid barrier that too few resident blocks can reach never return, as on a
  // GPU. Their threads cannot be stopped, so the process ends with the diagnosis.
  unsigned long long seen = progress.load();
  auto last = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(m);
  while (finished < workers) {
    if (done.wait_for(lock, std::chrono::milliseconds(200)) != std::cv_status::timeout) continue;
    const unsigned long long now_progress = progress.load();
    const auto now = std::chrono::steady_clock::now();
    if (now_progress != seen) {
      seen = now_progress;
      last = now;
    } else if (std::chrono::duration<double>(now - last).count() > l.timeout_s) {
      std::fprintf(stderr,
                   "fp8emu: deadlock: grid (%u, %u) x block (%u, %u) with %d resident blocks made no progress for "
                   "%.0f s (blocks spinning on others that cannot become resident?)\n",
                   l.gx, l.gy, l.bx, l.by, workers, l.timeout_s);
      std::fflush(stderr);
      _exit(86);
    }
  }
  lock.unlock();
  for (auto& t : pool) t.join();
  return error;
}

}  // namespace fp8emu
