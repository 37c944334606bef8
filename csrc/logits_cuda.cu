// CUDA kernels of the fused logits pass: one block per row, grid-stride over rows (any N, no 65,535
// limit), 128-bit vectorized loads when a row is 16-byte aligned, warp-shuffle reductions, exp2 with
// log2(e) folded into the 1/tau scale, fp32 accumulation, the shared epilogue of policy_epilogue.h.
//
// In the base-2 domain y = x * scale2, scale2 = log2(e) / tau, per thread and then per block, with m = max x
// (the raw logits) and y - max y = (x - m) scale2:
//   s = sum 2^(y - max y), u = sum 2^(y - max y) (y - max y)
//   logp = ln2 ((y_t - max y) - log2 s), H = ln2 (log2 s - u / s); m and log2 s are saved apart (lse buffer 2N)
//   dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau, p = 2^d2, d2 = (y - max y) - log2 s,
//   E[z] - z = -H - ln2 d2.
// The raw max is subtracted before the scaling so that the max's own y - max y is exactly 0 and its term
// 2^0 = 1 (x scale2 - max y, which nvcc contracts into an FMA, leaves the residual of the product: H ~ 5e-8
// and logp ~ -5e-8 on a one-hot row at tau != 1).
// A row whose softmax is undefined (a NaN or +inf y, or every y = -inf) gets m = log2 s = logp = H = NaN and
// a NaN dlogits row, as log_softmax of the reference gives (a -inf y in a finite row is p = 0).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda_kernels.h"
#include "policy_epilogue.h"

// The launch and a block's shared array; tests/cuda_sim (the CPU emulation these kernels are tested with where no
// GPU is present) defines its own (its shared arrays hold NaN bytes when each block starts).
#ifndef FRL_LAUNCH
#define FRL_LAUNCH(kernel, grid, block, stream, args) kernel<<<grid, block, 0, stream>>>(args)
#endif
#ifndef FRL_SHARED
#define FRL_SHARED(type, name, n) __shared__ type name[n]
#endif

namespace fused_rl {
namespace cuda {
namespace {

// One block of g_threads (default 1024) threads per row and by default 2 resident rows per SM: the best of
// bench/gpu_logits_bench.py's sweep on an H200 at N = 16384, V = 151936 bf16, with the gradient sweep reversed
// and streaming (3.15 ms; 768 x 2 3.17, 512 x 2-6 3.22-3.25, 256 x 4-8 3.46; docs/native.md). set_threads and
// set_rows_per_sm change them (tuning knobs for that sweep); every kernel is compiled for up to kMaxThreads
// (<= 64 registers).
constexpr int kMaxThreads = 1024;
int g_threads = 1024;
int g_rows_per_sm = 2;
// 128-bit loads each thread issues before it uses the first (1, 2 or 4; set_unroll): the bytes in flight
// must cover HBM latency x bandwidth (~3 MB on an H200), which one load per thread of 2 x 512 threads per
// SM does not (~2 MB), and one row per SM (the L2-resident setting for 151936-entry bf16 rows) less so
// (the H200 sweep: unroll 2 3.28 ms against 3.15 at 1024 x 2).
// The values are accumulated in the same order whatever the unroll: the results are bitwise the same.
int g_unroll = 4;
// The gradient sweep's order and cache policy (tuning knobs, bitwise the same results): reverse walks a row's
// vectors from its end, the ones the statistics sweep read last and L2 most likely still holds; streaming
// reads them with ld.global.cs (last use: evict first) and writes dlogits with st.global.cs, so that
// neither displaces the rows still to be re-read. Both on by measurement (the H200 sweep above, 1024 x 2:
// 3.15 ms with both, 3.26 reverse alone, 3.18 streaming alone, 3.37 neither).
bool g_reverse = true;
bool g_streaming = true;

struct Tuning {
  bool reverse, streaming;
};

// What a kernel is launched with: the arguments shared with the CPU kernels and the knobs above.
template <class Args>
struct Launch {
  Args a;
  Tuning tune;
};
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x by one MUFU.EX2 with flush-to-zero (exp2f adds a denormal range fix-up: 4 more instructions per
// element). Results below 2^-126 are 0: nothing in an fp32 sum that holds the row max's 2^0 = 1, and a
// gradient entry under 1e-38. The CPU emulation of tests/cuda_sim flushes the same.
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.0f : y;
#endif
}

// The smallest base-2 exponent a sweep passes to exp2_ftz: 2^-256 is 0, and (y - max y) - log2 s clamped
// here keeps p * (y - max y) finite (0) where y = -inf, without a branch.
constexpr float kMinExp2 = -256.0f;

// log p = ln2 ((x_t - m) scale2 - log2 s), clamped to <= 0 (s >= 1 holds if ex2.approx gives 2^0 = 1, which
// PTX does not document); NaN passes.
__device__ __forceinline__ float target_logp(float xt, float m, float scale2, float l2s) {
  const float lp = ((xt - m) * scale2 - l2s) * kLn2;
  return lp > 0.0f ? 0.0f : lp;
}

// H = ln2 (log2 s - u / s), clamped to >= 0 (as target_logp: u <= 0, and s >= 1 if 2^0 = 1); NaN passes.
__device__ __forceinline__ float row_entropy(float l2s, float u, float s) {
  const float h = kLn2 * (l2s - u / s);
  return h < 0.0f ? 0.0f : h;
}

// One 128-bit store of four 32-bit words to a 16-byte-aligned global address: nvcc splits a uint4 / float4
// assigned through a cast pointer into four 32-bit stores.
// With streaming, st.global.cs (evict first).
__device__ __forceinline__ void store128(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d, bool streaming) {
#if defined(__CUDA_ARCH__)
  if (streaming)
    asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
  else
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#else
  (void)streaming;
  *static_cast<uint4*>(p) = uint4{a, b, c, d};
#endif
}

// One 64-bit store of two 32-bit words to an 8-byte-aligned global address (st.global.cs with streaming).
__device__ __forceinline__ void store64(void* p, uint32_t a, uint32_t b, bool streaming) {
#if defined(__CUDA_ARCH__)
  if (streaming)
    asm volatile("st.global.cs.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
  else
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
#else
  (void)streaming;
  *static_cast<uint2*>(p) = uint2{a, b};
#endif
}

// One 128-bit load; with last_use, ld.global.cs (evict first).
template <class V>
__device__ __forceinline__ V load128(const void* p, bool last_use) {
  const V* q = static_cast<const V*>(p);
  return last_use ? __ldcs(q) : *q;
}

__device__ __forceinline__ uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

template <class T> struct Elem;
template <> struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static float load(const float* p) { return *p; }
  __device__ static void store(float* p, float v) { *p = v; }
  __device__ static void load_vec(const float* p, float* v, bool last_use = false) {
    const float4 q = load128<float4>(p, last_use);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  }
  __device__ static void store_vec(float* p, const float* v, bool streaming = false) {
    store128(p, float_bits(v[0]), float_bits(v[1]), float_bits(v[2]), float_bits(v[3]), streaming);
  }
};
// bf16 and fp16: 8 values a 128-bit vector, converted two at a time by C's functions.
template <class T, class T2, class C>
struct Elem16 {
  static constexpr int kVec = 8;
  __device__ static float load(const T* p) { return C::to_float(*p); }
  __device__ static void store(T* p, float v) { *p = C::from_float(v); }
  __device__ static void load_vec(const T* p, float* v, bool last_use = false) {
    const uint4 q = load128<uint4>(p, last_use);
    const T2* h = reinterpret_cast<const T2*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = C::to_float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }
  }
  __device__ static uint32_t pack(float a, float b) {
    const T2 h = C::from_floats(a, b);
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
  }
  __device__ static void store_vec(T* p, const float* v, bool streaming = false) {
    store128(p, pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7]), streaming);
  }
  // Four values (an fp32 vector's worth: the dlogits of fp32 logits rounded to 16 bits) at 8-byte alignment.
  __device__ static void store_vec4(T* p, const float* v, bool streaming = false) {
    store64(p, pack(v[0], v[1]), pack(v[2], v[3]), streaming);
  }
};
struct Bf16Conv {
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ static float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
  __device__ static __nv_bfloat162 from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
struct HalfConv {
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static float2 to_float2(__half2 x) { return __half22float2(x); }
  __device__ static __half2 from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Elem<__nv_bfloat16> : Elem16<__nv_bfloat16, __nv_bfloat162, Bf16Conv> {};
template <> struct Elem<__half> : Elem16<__half, __half2, HalfConv> {};

struct Acc {
  float m, s, u;  // running max of x, sum 2^d, sum 2^d d with d = y - max y = (x - m) scale2
};

__device__ __forceinline__ Acc acc_empty() { return Acc{-INFINITY, 0.0f, 0.0f}; }

// Add a group of logits x[0..n) to the accumulator: one rescale per group.
template <int N>
__device__ __forceinline__ void acc_add(Acc& a, const float* x, float scale2) {
  float gm = x[0];
#pragma unroll
  for (int i = 1; i < N; ++i) gm = fmaxf(gm, x[i]);
  if (gm > a.m) {
    if (a.m != -INFINITY) {
      const float d = fmaxf((a.m - gm) * scale2, kMinExp2);  // 2^d = 0 below; a.s * d stays finite
      const float sc = exp2f(d);
      a.u = sc * (a.u + a.s * d);
      a.s *= sc;
    }
    a.m = gm;
  }
  if (a.m == -INFINITY) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float d = fmaxf((x[i] - a.m) * scale2, kMinExp2);  // x = -inf: 2^d = 0 and e * d = 0, not 0 * -inf
    const float e = exp2_ftz(d);
    a.s += e;
    a.u = fmaf(e, d, a.u);
  }
}

__device__ __forceinline__ Acc acc_merge(Acc a, Acc b, float scale2) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const float m = fmaxf(a.m, b.m);
  const float da = fmaxf((a.m - m) * scale2, kMinExp2), db = fmaxf((b.m - m) * scale2, kMinExp2);
  const float ea = exp2f(da), eb = exp2f(db);
  return Acc{m, a.s * ea + b.s * eb, ea * (a.u + a.s * da) + eb * (b.u + b.s * db)};
}

__device__ __forceinline__ Acc warp_merge(Acc a, float scale2) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Acc b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, off);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, off);
    b.u = __shfl_xor_sync(0xffffffffu, a.u, off);
    a = acc_merge(a, b, scale2);
  }
  return a;
}

// The 16-byte-aligned part of a row, V / VEC vectors: f(v, j) on the VEC values v of entries j .. j+VEC-1 of
// each vector this thread takes (k, k + blockDim.x, ... in that order; with reverse, vector V / VEC - 1 - k
// for each k), U loads issued before the first f (with last_use: ld.global.cs); returns the number of
// entries covered (the scalar tail starts there).
template <class T, int U, class F>
__device__ __forceinline__ int64_t for_each_vector(const T* row, int64_t V, F&& f, bool reverse = false,
                                                   bool last_use = false) {
  using E = Elem<T>;
  constexpr int VEC = E::kVec;
  const int64_t nvec = V / VEC, step = blockDim.x;
  const auto at = [&](int64_t k) { return (reverse ? nvec - 1 - k : k) * VEC; };
  int64_t k = threadIdx.x;
  for (; k + (U - 1) * step < nvec; k += U * step) {
    float v[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) E::load_vec(row + at(k + u * step), v[u], last_use);
#pragma unroll
    for (int u = 0; u < U; ++u) f(v[u], at(k + u * step));
  }
  for (; k < nvec; k += step) {
    float v[VEC];
    E::load_vec(row + at(k), v, last_use);
    f(v, at(k));
  }
  return nvec * VEC;
}

// Block-wide (m, s, u) of one row; every thread gets the result. A row whose softmax is undefined gives
// m = s = u = NaN: a NaN anywhere (fmaxf drops NaN and a thread whose other values are all -inf never
// sums, so each thread ORs x != x into a flag, voted on by the block's first barrier), a +inf y (m scale2 =
// +inf) or no finite y at all (m = -inf).
template <class T, int U>
__device__ Acc row_reduce(const T* row, int64_t V, float scale2, Acc* smem) {
  using E = Elem<T>;
  constexpr int VEC = E::kVec;
  Acc a = acc_empty();
  bool seen_nan = false;
  int64_t start = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
    start = for_each_vector<T, U>(row, V, [&](float* v, int64_t) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) seen_nan |= v[i] != v[i];
      acc_add<VEC>(a, v, scale2);
    });
  }
  for (int64_t j = start + threadIdx.x; j < V; j += blockDim.x) {
    float v[1] = {E::load(row + j)};
    seen_nan |= v[0] != v[0];
    acc_add<1>(a, v, scale2);
  }
  a = warp_merge(a, scale2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = a;
  const int any_nan = __syncthreads_or(seen_nan);
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    Acc b = lane < nw ? smem[lane] : acc_empty();
    b = warp_merge(b, scale2);
    if (lane == 0) smem[32] = b;
  }
  __syncthreads();
  const Acc r = smem[32];
  __syncthreads();  // smem is reused by the next row
  // m / tau = inf: no softmax (m scale2 overflows earlier, by log2(e), for finite rows the CPU kernel computes)
  if (any_nan || r.m * (scale2 * kLn2) == INFINITY || r.m == -INFINITY) return Acc{NAN, NAN, NAN};
  return r;
}

// The gradient of an entry from its logit x, with d2 = log2 p = (x - m) scale2 - l2s and E[z] - z = -H - ln2 d2:
// (g_H p (E[z] - z) - g_logp p) / tau = p (c0 + c1 d2), c0 = -(cge H + cgl), c1 = -cge ln2 (cgl, cge: g / tau);
// d2 is clamped at kMinExp2, where p = 0 already, so that x = -inf gives 0 without a branch. The target
// entry adds cgl = g_logp / tau; target() computes it with 1 - p = -expm1(ln2 d2), exact for a
// near-certain token.
struct GradCoef {
  float scale2, m, l2s, H, cgl, cge, c0, c1;
  __device__ __forceinline__ float operator()(float x) const {
    const float d2 = fmaxf((x - m) * scale2 - l2s, kMinExp2);
    return exp2_ftz(d2) * fmaf(c1, d2, c0);
  }
  __device__ __forceinline__ float target(float x) const {
    const float d2 = fmaxf((x - m) * scale2 - l2s, kMinExp2);  // a -inf target: p = 0, not 0 * inf = NaN
    const float dz = d2 * kLn2;
    return cgl * -expm1f(dz) + exp2f(d2) * cge * (-H - dz);
  }
};

// dlogits of one row, read as T and written as TO (T itself, or bf16 / fp16 for fp32 logits: one rounding on
// store); out may alias row when TO is T (each element is read before it is written by the same thread).
// In base 2: d2 = (x - m) scale2 - l2s = log2 p, with m = max x and l2s = log2 s kept apart (m scale2 + l2s
// rounded to one float would lose l2s at large |m|, and with it 1 - p of a near-certain token). The sweep is
// the same for every entry; the thread whose sweep covers the target (0 <= target < V) reads it first and
// writes its value last (no other thread touches it).
template <class T, class TO, int U>
__device__ void row_grad(const T* row, TO* out, int64_t V, float scale2, float inv_tau, float m, float l2s,
                         float H, float g_logp, float g_ent, int64_t target, Tuning tune) {
  using E = Elem<T>;
  using EO = Elem<TO>;
  constexpr int VEC = E::kVec;
  const float cgl = g_logp * inv_tau, cge = g_ent * inv_tau;
  const GradCoef gc{scale2, m, l2s, H, cgl, cge, -(cge * H + cgl), -cge * kLn2};
  // out takes VEC values a store: 16 bytes, or 8 when TO is 16-bit and T fp32 (a V % 8 == 4 fp32 tile's odd rows)
  constexpr uintptr_t out_align = sizeof(TO) * VEC;
  const bool vectorized = (reinterpret_cast<uintptr_t>(row) & 15u) == 0 &&
                          (reinterpret_cast<uintptr_t>(out) & (out_align - 1)) == 0;
  const int64_t nvec = vectorized ? V / VEC : 0, start = nvec * VEC;  // for_each_vector's part
  const int64_t tvec = tune.reverse ? nvec - 1 - target / VEC : target / VEC;  // its k: on thread k % blockDim
  const int64_t owner = target < start ? tvec % blockDim.x : (target - start) % blockDim.x;
  // the callers send no target outside [0, V) here (NaN rows take another path); none is read or written if one came
  const bool own = threadIdx.x == owner && target >= 0 && target < V;
  const float g_target = own ? gc.target(E::load(row + target)) : 0.0f;
  if (vectorized) {
    for_each_vector<T, U>(row, V, [&](float* v, int64_t j) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = gc(v[i]);
      if constexpr (std::is_same<T, TO>::value) EO::store_vec(out + j, v, tune.streaming);
      else EO::store_vec4(out + j, v, tune.streaming);  // T = float: 4 values a vector
    }, tune.reverse, tune.streaming);
  }
  for (int64_t j = start + threadIdx.x; j < V; j += blockDim.x) EO::store(out + j, gc(E::load(row + j)));
  if (own) EO::store(out + target, g_target);
}

// A row of one value: 0 (ignored rows, zero coefficients) or NaN (rows whose softmax is undefined, whatever
// g_logp and g_H are: autograd of log_softmax gives NaN there even for a zero upstream gradient).
template <class T>
__device__ void row_fill(T* out, int64_t V, float value) {
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) Elem<T>::store(out + j, value);
}

__device__ __forceinline__ int64_t target_at(const void* t, int tdtype, int64_t i) {
  return tdtype == kInt32 ? int64_t(static_cast<const int32_t*>(t)[i]) : static_cast<const int64_t*>(t)[i];
}

template <class T, int U>
__global__ void __launch_bounds__(kMaxThreads) stats_kernel(Launch<StatsArgs> l) {
  const StatsArgs& a = l.a;
  FRL_SHARED(Acc, smem, 33);
  const T* x = static_cast<const T*>(a.in.x);
  const int64_t N = a.in.B * a.in.T, V = a.in.V;
  const float scale2 = a.inv_tau * kLog2e;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t t = target_at(a.targets, a.tdtype, i);
    if (t == kIgnoreIndex) {
      if (threadIdx.x == 0) { a.logp[i] = 0.0f; a.lse[i] = 0.0f; a.lse[N + i] = 0.0f; if (a.ent) a.ent[i] = 0.0f; }
      continue;
    }
    const T* row = x + (i / a.in.T) * a.in.sb + (i % a.in.T) * a.in.st;
    // thread 0's target logit, loaded before the sweep (its latency hidden behind it)
    const float xt = (threadIdx.x == 0 && t >= 0 && t < V) ? Elem<T>::load(row + t) : NAN;
    const Acc r = row_reduce<T, U>(row, V, scale2, smem);
    if (threadIdx.x == 0) {
      const float l2s = log2f(r.s);
      a.logp[i] = target_logp(xt, r.m, scale2, l2s);
      a.lse[i] = r.m;  // max x and log2 s, as row_grad reads them
      a.lse[N + i] = l2s;
      if (a.ent) a.ent[i] = row_entropy(l2s, r.u, r.s);
    }
  }
}

template <class T, int U>
__global__ void __launch_bounds__(kMaxThreads) grad_kernel(Launch<GradArgs> l) {
  const GradArgs& a = l.a;
  const T* x = static_cast<const T*>(a.in.x);
  T* out = static_cast<T*>(a.out);
  const int64_t N = a.in.B * a.in.T, V = a.in.V;
  const float scale2 = a.inv_tau * kLog2e;
  const bool with_ent = a.ent != nullptr && a.g_ent != nullptr;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t b = i / a.in.T, tt = i % a.in.T;
    T* orow = out + b * a.osb + tt * a.ost;
    const int64_t t = target_at(a.targets, a.tdtype, i);
    const float gl = a.g_logp[i], ge = with_ent ? a.g_ent[i] : 0.0f;
    if (t == kIgnoreIndex) { row_fill<T>(orow, V, 0.0f); continue; }
    const float m = a.lse[i];
    // an undefined row (row_reduce), a target outside [0, V) (only with check_inputs=False: NaN logp), or a
    // NaN upstream gradient (autograd of log_softmax: NaN everywhere, also where p = 0)
    if (m != m || t < 0 || t >= V || gl != gl || ge != ge) { row_fill<T>(orow, V, NAN); continue; }
    if (gl == 0.0f && ge == 0.0f) { row_fill<T>(orow, V, 0.0f); continue; }
    const T* row = x + b * a.in.sb + tt * a.in.st;
    row_grad<T, T, U>(row, orow, V, scale2, a.inv_tau, m, a.lse[N + i], with_ent ? a.ent[i] : 0.0f, gl, ge, t,
                      l.tune);
  }
}

template <class T, class TO, int U>
__global__ void __launch_bounds__(kMaxThreads) policy_kernel(Launch<PolicyArgs> l) {
  const PolicyArgs& a = l.a;
  FRL_SHARED(Acc, smem, 33);
  FRL_SHARED(float, coef, 5);
  const T* x = static_cast<const T*>(a.in.x);
  TO* out = static_cast<TO*>(a.out);
  const int64_t N = a.in.B * a.in.T, V = a.in.V;
  const float scale2 = a.inv_tau * kLog2e;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t b = i / a.in.T, tt = i % a.in.T;
    TO* orow = out + b * a.osb + tt * a.ost;
    const int64_t t = target_at(a.targets, a.tdtype, i);
    if (t == kIgnoreIndex) {
      if (threadIdx.x == 0) { a.logp[i] = 0.0f; a.ent[i] = 0.0f; }
      row_fill<TO>(orow, V, 0.0f);
      continue;
    }
    const T* row = x + b * a.in.sb + tt * a.in.st;
    // thread 0's target logit and per-token inputs, loaded before the sweep (their latency hidden behind it)
    const bool lead = threadIdx.x == 0;
    const float xt = (lead && t >= 0 && t < V) ? Elem<T>::load(row + t) : NAN;
    const float adv = lead ? a.adv[i] : 0.0f, w = lead ? a.w[i] : 0.0f;
    const float old = (lead && a.old) ? a.old[i] : 0.0f, ref = (lead && a.ref) ? a.ref[i] : 0.0f;
    const float rollout = (lead && a.rollout) ? a.rollout[i] : 0.0f;
    const Acc r = row_reduce<T, U>(row, V, scale2, smem);
    if (lead) {
      const float l2s = log2f(r.s);  // NaN m, s: NaN logp, H and a NaN dlogits row
      const float logp = target_logp(xt, r.m, scale2, l2s);
      const float H = row_entropy(l2s, r.u, r.s);
      a.logp[i] = logp;
      a.ent[i] = H;
      const EpilogueOut e = policy_epilogue(a.ep, logp, H, adv, old, ref, rollout, w);
      coef[0] = r.m; coef[1] = l2s; coef[2] = H; coef[3] = e.g_logp; coef[4] = e.g_ent;
    }
    __syncthreads();
    const float m = coef[0], l2s = coef[1], H = coef[2], gl = coef[3], ge = coef[4];
    __syncthreads();
    // an undefined row (row_reduce), or NaN coefficients (e.g. a NaN logp of a target outside [0, V)):
    // NaN everywhere, also where p = 0, as on the CPU and in autograd
    if (m != m || gl != gl || ge != ge) row_fill<TO>(orow, V, NAN);
    else if (gl == 0.0f && ge == 0.0f) row_fill<TO>(orow, V, 0.0f);
    else row_grad<T, TO, U>(row, orow, V, scale2, a.inv_tau, m, l2s, H, gl, ge, t, l.tune);
  }
}

template <class T, int U>
__global__ void __launch_bounds__(kMaxThreads) scale_kernel(Launch<ScaleArgs> l) {
  const ScaleArgs& a = l.a;
  using E = Elem<T>;
  constexpr int VEC = E::kVec;
  const float g = *a.g;
  if (g == 1.0f) return;
  T* x = const_cast<T*>(static_cast<const T*>(a.in.x));
  const int64_t N = a.in.B * a.in.T, V = a.in.V;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    T* row = x + (i / a.in.T) * a.in.sb + (i % a.in.T) * a.in.st;
    int64_t start = 0;
    if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
      start = for_each_vector<T, U>(row, V, [&](float* v, int64_t j) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] *= g;
        E::store_vec(row + j, v);
      });
    }
    for (int64_t j = start + threadIdx.x; j < V; j += blockDim.x) E::store(row + j, E::load(row + j) * g);
  }
}

int grid_for(int64_t rows) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 108;
  const int64_t g = int64_t(sms) * g_rows_per_sm;
  return int(rows < g ? (rows > 0 ? rows : 1) : g);
}

std::string last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

template <class Args>
std::string launch(const Args& args, uintptr_t stream, void (*f32)(Launch<Args>), void (*bf16)(Launch<Args>),
                   void (*f16)(Launch<Args>)) {
  const Launch<Args> a{args, Tuning{g_reverse, g_streaming}};
  const int64_t rows = args.in.B * args.in.T;
  if (rows == 0) return std::string();
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int grid = grid_for(rows);
  switch (args.in.dtype) {
    case kFloat32: FRL_LAUNCH(f32, grid, g_threads, s, a); break;
    case kBFloat16: FRL_LAUNCH(bf16, grid, g_threads, s, a); break;
    default: FRL_LAUNCH(f16, grid, g_threads, s, a); break;
  }
  return last_error();
}

// f(std::integral_constant<int, U>) for U = g_unroll.
template <class F>
std::string by_unroll(F f) {
  switch (g_unroll) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

}  // namespace

std::string token_stats(const StatsArgs& a, uintptr_t stream) {
  return by_unroll([&](auto u) {
    constexpr int U = decltype(u)::value;
    return launch(a, stream, stats_kernel<float, U>, stats_kernel<__nv_bfloat16, U>, stats_kernel<__half, U>);
  });
}

std::string token_grad(const GradArgs& a, uintptr_t stream) {
  return by_unroll([&](auto u) {
    constexpr int U = decltype(u)::value;
    return launch(a, stream, grad_kernel<float, U>, grad_kernel<__nv_bfloat16, U>, grad_kernel<__half, U>);
  });
}

std::string policy_fused(const PolicyArgs& a, uintptr_t stream) {
  return by_unroll([&](auto u) {
    constexpr int U = decltype(u)::value;
    // fp32 logits may have 16-bit dlogits (the bindings admit no other pair of dtypes)
    auto* f32 = a.odtype == kBFloat16 ? policy_kernel<float, __nv_bfloat16, U>
                : a.odtype == kFloat16 ? policy_kernel<float, __half, U> : policy_kernel<float, float, U>;
    return launch(a, stream, f32, policy_kernel<__nv_bfloat16, __nv_bfloat16, U>, policy_kernel<__half, __half, U>);
  });
}

std::string scale_rows(const ScaleArgs& a, uintptr_t stream) {
  return by_unroll([&](auto u) {
    constexpr int U = decltype(u)::value;
    return launch(a, stream, scale_kernel<float, U>, scale_kernel<__nv_bfloat16, U>, scale_kernel<__half, U>);
  });
}

void set_reverse(bool on) { g_reverse = on; }

bool reverse() { return g_reverse; }

void set_streaming(bool on) { g_streaming = on; }

bool streaming() { return g_streaming; }

void set_threads(int n) { g_threads = n; }

int threads() { return g_threads; }

void set_rows_per_sm(int k) { g_rows_per_sm = k; }

int rows_per_sm() { return g_rows_per_sm; }

void set_unroll(int u) { g_unroll = u; }

int unroll() { return g_unroll; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error (no driver / no device)
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace fused_rl
