// A CPU emulation of the part of CUDA that csrc/logits_cuda.cu uses, so that its kernels run, and are
// tested against the reference, on machines without a GPU (tests/test_cuda_sim.py builds them with it).
//
// Every thread of a block is a fiber (ucontext) on the calling thread; blocks run one after another.
// A fiber runs until it reaches a barrier: __syncthreads / __syncthreads_or (the whole block) or one
// half of a __shfl_xor_sync (its warp of 32). When every runnable fiber waits, the scheduler releases a
// warp all of whose lanes wait at the warp barrier, or else the block when all of its threads wait at
// the block barrier. Anything else is a deadlock on a GPU as well (a barrier in divergent code, a
// __syncthreads skipped by some threads, a shuffle with lanes missing) and is reported as a launch
// error, as are a __syncthreads after some threads exited, mixing __syncthreads and __syncthreads_or at
// one barrier, and a partial shuffle mask. Between barriers the fibers run in an order drawn anew
// (seeded per launch), so that a read of shared memory that misses its barrier sees a stale value.
// A block's shared array is declared `FRL_SHARED(type, name, n)` (`__shared__ type name[n]` under nvcc): here
// one buffer per declaration, shared by the block's fibers and filled with 0xff bytes (a NaN float, a -1
// integer) when each block starts, so that a read of an entry the block has not written sees garbage, as on a
// GPU, not the previous block's value. A plain `__shared__` does not compile here.
// Arithmetic is the host's (libm exp2f / log2f / expm1f; bf16 and fp16 conversions round to nearest
// even, as the CUDA intrinsics do); what it cannot show: timing, memory coalescing, register pressure,
// and alignment faults (tests/test_cuda_sim.py compiles the kernels with -fsanitize=alignment for those).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace cuda_sim {

constexpr unsigned kWarp = 32;
constexpr size_t kStackBytes = size_t(128) << 10;

enum class State { kReady, kBlockBarrier, kWarpBarrier, kDone };
enum Barrier : int { kPlain = 0, kOr = 1 };

struct Fiber {
  ucontext_t ctx;
  State state = State::kReady;
  int barrier = kPlain;  // which block barrier it waits at
  int pred = 0, result = 0;  // __syncthreads_or
};

struct BlockRun {
  std::vector<Fiber> fibers;
  std::vector<uint64_t> lanes;  // one __shfl exchange slot per thread
  ucontext_t scheduler;
  unsigned current = 0;
  const std::function<void()>* body = nullptr;
};

inline dim3 g_thread, g_block, g_block_dim, g_grid_dim;
inline BlockRun* g_run = nullptr;
inline std::string g_error;     // first emulation error since the last cudaGetLastError
inline std::string g_reported;  // the text of the error cudaGetLastError returned last
inline int g_sms = 4;           // the multiprocessors the emulated device reports
inline uint64_t g_launches = 0;  // seeds each launch's scheduling order
// FRL_SHARED's buffers, one per declaration (keyed by the address of a static the declaration defines: two on one
// line, or at the same line of two files, stay apart); poisoned at each block's start (run_block)
struct SharedBuffer {
  std::unique_ptr<unsigned char[]> data;
  size_t bytes = 0;
};
inline std::map<const void*, SharedBuffer> g_shared;
constexpr unsigned char kSharedPoison = 0xff;

inline void fail(const std::string& what) {
  if (g_error.empty()) g_error = "cuda_sim: " + what;
}

inline Fiber& self() { return g_run->fibers[g_run->current]; }

inline void wait_at(State s) {
  Fiber& f = self();
  f.state = s;
  swapcontext(&f.ctx, &g_run->scheduler);
}

inline void fiber_main() {
  (*g_run->body)();
  self().state = State::kDone;  // returning resumes uc_link, the scheduler
}

// Releases the next barrier whose participants have all arrived; false when none can be (a deadlock).
inline bool release(BlockRun& run, unsigned block) {
  bool released = false;
  for (unsigned w = 0; w < block; w += kWarp) {
    bool all = true;
    for (unsigned i = w; i < w + kWarp; ++i) all = all && run.fibers[i].state == State::kWarpBarrier;
    if (all) {
      for (unsigned i = w; i < w + kWarp; ++i) run.fibers[i].state = State::kReady;
      released = true;
    }
  }
  if (released) return true;
  unsigned waiting = 0, done = 0, kinds = 0;
  int any = 0;
  for (const Fiber& f : run.fibers) {
    waiting += f.state == State::kBlockBarrier;
    done += f.state == State::kDone;
    if (f.state == State::kBlockBarrier) {
      kinds |= 1u << f.barrier;
      any |= f.pred;
    }
  }
  if (waiting == 0 || waiting + done != block) return false;
  if (done != 0) {
    fail("__syncthreads reached after some threads of the block exited");
    return false;
  }
  if (kinds == 3u) {
    fail("__syncthreads and __syncthreads_or at the same barrier");
    return false;
  }
  for (Fiber& f : run.fibers) {
    f.result = any;
    f.state = State::kReady;
  }
  return true;
}

// Fiber stacks, kept across launches (allocated once, untouched pages never committed).
inline char* stack_of(unsigned thread) {
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() <= thread) stacks.emplace_back(new char[kStackBytes]);
  return stacks[thread].get();
}

template <class T>
T* block_shared(const void* site, size_t n) {
  static_assert(std::is_trivially_copyable<T>::value, "shared array element");
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "shared array element aligned beyond new[]'s");
  SharedBuffer& buffer = g_shared[site];
  if (!buffer.data) {  // first reached in this block: poisoned as run_block poisons the others
    buffer.bytes = n * sizeof(T);
    buffer.data.reset(new unsigned char[buffer.bytes]);
    std::memset(buffer.data.get(), kSharedPoison, buffer.bytes);
  }
  return reinterpret_cast<T*>(buffer.data.get());
}

inline void run_block(BlockRun& run, unsigned block, std::mt19937_64& rng) {
  for (auto& [site, buffer] : g_shared) std::memset(buffer.data.get(), kSharedPoison, buffer.bytes);
  run.fibers.assign(block, Fiber{});
  run.lanes.assign(block, 0);
  for (unsigned i = 0; i < block; ++i) {
    ucontext_t& c = run.fibers[i].ctx;
    getcontext(&c);
    c.uc_stack.ss_sp = stack_of(i);
    c.uc_stack.ss_size = kStackBytes;
    c.uc_link = &run.scheduler;
    makecontext(&c, fiber_main, 0);
  }
  std::vector<unsigned> order(block);
  std::iota(order.begin(), order.end(), 0u);
  for (;;) {
    std::shuffle(order.begin(), order.end(), rng);
    for (unsigned i : order) {
      if (run.fibers[i].state != State::kReady) continue;
      run.current = i;
      g_thread = dim3{i, 1, 1};
      swapcontext(&run.scheduler, &run.fibers[i].ctx);
    }
    if (std::all_of(run.fibers.begin(), run.fibers.end(), [](const Fiber& f) { return f.state == State::kDone; }))
      return;
    if (!release(run, block)) {  // the fibers left waiting are abandoned with their stacks
      fail("deadlock in block " + std::to_string(g_block.x) + ": threads wait at barriers that cannot complete");
      return;
    }
  }
}

inline void run_grid(unsigned grid, unsigned block, const std::function<void()>& body) {
  ++g_launches;
  if (grid == 0 || block == 0 || block > 1024 || block % kWarp != 0) {
    fail("invalid launch configuration <<<" + std::to_string(grid) + ", " + std::to_string(block) + ">>>");
    return;
  }
  std::mt19937_64 rng(g_launches);
  g_grid_dim = dim3{grid, 1, 1};
  g_block_dim = dim3{block, 1, 1};
  BlockRun run;
  run.body = &body;
  g_run = &run;
  for (unsigned b = 0; b < grid && g_error.empty(); ++b) {
    g_block = dim3{b, 1, 1};
    run_block(run, block, rng);
  }
  g_run = nullptr;
}

template <class Args>
void launch(void (*kernel)(Args), int grid, int block, const Args& args) {
  const std::function<void()> body = [&] { kernel(args); };
  run_grid(unsigned(std::max(grid, 0)), unsigned(std::max(block, 0)), body);
}

}  // namespace cuda_sim

#define FRL_SHARED(type, name, n) \
  static char name##_site;        \
  type* const name = ::cuda_sim::block_shared<type>(&name##_site, n)
#define FRL_LAUNCH(kernel, grid, block, stream, args) (static_cast<void>(stream), ::cuda_sim::launch(kernel, grid, block, args))

#define threadIdx (::cuda_sim::g_thread)
#define blockIdx (::cuda_sim::g_block)
#define blockDim (::cuda_sim::g_block_dim)
#define gridDim (::cuda_sim::g_grid_dim)

inline void __syncthreads() {
  cuda_sim::self().barrier = cuda_sim::kPlain;
  cuda_sim::wait_at(cuda_sim::State::kBlockBarrier);
}

inline int __syncthreads_or(int pred) {
  cuda_sim::Fiber& f = cuda_sim::self();
  f.barrier = cuda_sim::kOr;
  f.pred = pred != 0;
  cuda_sim::wait_at(cuda_sim::State::kBlockBarrier);
  return cuda_sim::self().result;
}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value, "shuffled type");
  using namespace cuda_sim;
  if (mask != 0xffffffffu) fail("__shfl_xor_sync with a partial mask is not emulated");
  const unsigned t = g_thread.x, lane = t % kWarp;
  std::memcpy(&g_run->lanes[t], &value, sizeof(T));
  wait_at(State::kWarpBarrier);
  T out;
  std::memcpy(&out, &g_run->lanes[t - lane + ((lane ^ unsigned(lane_mask)) % kWarp)], sizeof(T));
  wait_at(State::kWarpBarrier);  // nobody overwrites a slot before every lane has read it
  return out;
}

// ---------------------------------------------------------------- vector and half-precision types
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {  // 64-bit vector stores: -fsanitize=alignment checks their 8-byte alignment
  unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
// cache-streaming load (ld.global.cs): a plain load here
template <class T>
inline T __ldcs(const T* p) { return *p; }

struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits, sizeof v);
  return float(v);
}
inline __half __float2half_rn(float f) {
  const _Float16 v = _Float16(f);  // round to nearest even
  __half h;
  std::memcpy(&h.bits, &v, sizeof v);
  return h;
}
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }

// ---------------------------------------------------------------- runtime API
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorLaunchFailure = 719;
using cudaStream_t = struct CUstream_st*;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? cuda_sim::g_sms : 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {  // returns and clears the first error, as CUDA does
  if (cuda_sim::g_error.empty()) return cudaSuccess;
  cuda_sim::g_reported = cuda_sim::g_error;
  cuda_sim::g_error.clear();
  return cudaErrorLaunchFailure;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : cuda_sim::g_reported.c_str();
}
