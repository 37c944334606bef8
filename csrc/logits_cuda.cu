// CUDA kernels of the fused logits pass: one block per row, grid-stride over rows (any N, no 65,535
// limit), 128-bit vectorized loads when a row is 16-byte aligned, warp-shuffle reductions, exp2 with
// log2(e) folded into the 1/tau scale, fp32 accumulation, the shared epilogue of policy_epilogue.h.
//
// In the base-2 domain y = x * (log2(e) / tau), per thread and then per block:
//   m = max y, s = sum 2^(y - m), u = sum 2^(y - m) (y - m)
//   logp = ln2 ((y_t - m) - log2 s), H = ln2 (log2 s - u / s); m and log2 s are saved apart (lse buffer 2N)
//   dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau, p = 2^d2, d2 = (y - m) - log2 s,
//   E[z] - z = -H - ln2 d2.
// A row whose softmax is undefined (a NaN or +inf y, or every y = -inf) gets m = log2 s = logp = H = NaN and
// a NaN dlogits row, as log_softmax of the reference gives (a -inf y in a finite row is p = 0).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda_kernels.h"
#include "policy_epilogue.h"

// tests/cuda_sim (the CPU emulation these kernels are tested with where no GPU is present) defines its own.
#ifndef FRL_LAUNCH
#define FRL_LAUNCH(kernel, grid, block, stream, args) kernel<<<grid, block, 0, stream>>>(args)
#endif

namespace fused_rl {
namespace cuda {
namespace {

// 512 threads per row and by default 2 resident rows per SM: the rows in flight (2 x SMs, e.g. 264 x 128
// KiB for fp32 V = 32000 on H100/H200) fit in L2, so the second (gradient) sweep re-reads them from L2.
// set_rows_per_sm changes it (a tuning knob for bench/gpu_logits_bench.py's sweep).
constexpr int kThreads = 512;
int g_rows_per_sm = 2;
// 128-bit loads each thread issues before it uses the first (1, 2 or 4; set_unroll): the bytes in flight
// must cover HBM latency x bandwidth (~3 MB on an H200), which one load per thread of 2 x 512 threads per
// SM does not (~2 MB), and one row per SM (the L2-resident setting for 151936-entry bf16 rows) less so.
// The values are accumulated in the same order whatever the unroll: the results are bitwise the same.
int g_unroll = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// log p = ln2 ((y_t - m) - log2 s), clamped to <= 0 (FMA contraction of y_t can round it to +1e-8 for
// a near-certain token); NaN passes.
__device__ __forceinline__ float target_logp(float yt, float m, float l2s) {
  const float lp = ((yt - m) - l2s) * kLn2;
  return lp > 0.0f ? 0.0f : lp;
}

template <class T> struct Elem;
template <> struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static float load(const float* p) { return *p; }
  __device__ static void store(float* p, float v) { *p = v; }
  __device__ static void load_vec(const float* p, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  }
  __device__ static void store_vec(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ static float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
  __device__ static void load_vec(const __nv_bfloat16* p, float* v) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = __bfloat1622float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }
  }
  __device__ static void store_vec(__nv_bfloat16* p, const float* v) {
    uint4 q;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = q;
  }
};
template <> struct Elem<__half> {
  static constexpr int kVec = 8;
  __device__ static float load(const __half* p) { return __half2float(*p); }
  __device__ static void store(__half* p, float v) { *p = __float2half_rn(v); }
  __device__ static void load_vec(const __half* p, float* v) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = __half22float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }
  }
  __device__ static void store_vec(__half* p, const float* v) {
    uint4 q;
    __half2* h = reinterpret_cast<__half2*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = q;
  }
};

struct Acc {
  float m, s, u;  // base-2 running max, sum 2^(y-m), sum 2^(y-m) (y-m)
};

__device__ __forceinline__ Acc acc_empty() { return Acc{-INFINITY, 0.0f, 0.0f}; }

// Add a group of values y[0..n) (base-2 domain) to the accumulator: one rescale per group.
template <int N>
__device__ __forceinline__ void acc_add(Acc& a, const float* y) {
  float gm = y[0];
#pragma unroll
  for (int i = 1; i < N; ++i) gm = fmaxf(gm, y[i]);
  if (gm > a.m) {
    if (a.m != -INFINITY) {
      const float d = a.m - gm;
      const float sc = exp2f(d);
      a.u = sc * (a.u + a.s * d);
      a.s *= sc;
    }
    a.m = gm;
  }
  if (a.m == -INFINITY) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float d = y[i] - a.m;
    const float e = exp2f(d);  // exp2(-inf) = 0
    a.s += e;
    a.u += (e > 0.0f) ? e * d : 0.0f;
  }
}

__device__ __forceinline__ Acc acc_merge(Acc a, Acc b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const float m = fmaxf(a.m, b.m);
  const float da = a.m - m, db = b.m - m;
  const float ea = exp2f(da), eb = exp2f(db);
  return Acc{m, a.s * ea + b.s * eb, ea * (a.u + a.s * da) + eb * (b.u + b.s * db)};
}

__device__ __forceinline__ Acc warp_merge(Acc a) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Acc b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, off);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, off);
    b.u = __shfl_xor_sync(0xffffffffu, a.u, off);
    a = acc_merge(a, b);
  }
  return a;
}

// The 16-byte-aligned part of a row, V / VEC vectors: f(v, j) on the VEC values v of entries j .. j+VEC-1 of
// each vector this thread takes (k, k + blockDim.x, ... in that order), U loads issued before the first
// f; returns the number of entries covered (the scalar tail starts there).
template <class T, int U, class F>
__device__ __forceinline__ int64_t for_each_vector(const T* row, int64_t V, F&& f) {
  using E = Elem<T>;
  constexpr int VEC = E::kVec;
  const int64_t nvec = V / VEC, step = blockDim.x;
  int64_t k = threadIdx.x;
  for (; k + (U - 1) * step < nvec; k += U * step) {
    float v[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) E::load_vec(row + (k + u * step) * VEC, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) f(v[u], (k + u * step) * VEC);
  }
  for (; k < nvec; k += step) {
    float v[VEC];
    E::load_vec(row + k * VEC, v);
    f(v, k * VEC);
  }
  return nvec * VEC;
}

// Block-wide (m, s, u) of one row; every thread gets the result. A row whose softmax is undefined gives
// m = s = u = NaN: a NaN anywhere (fmaxf drops NaN and a thread whose other values are all -inf never
// sums, so each thread ORs x != x into a flag, voted on by the block's first barrier), a +inf y (m = +inf)
// or no finite y at all (m = -inf).
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
      for (int i = 0; i < VEC; ++i) { seen_nan |= v[i] != v[i]; v[i] *= scale2; }
      acc_add<VEC>(a, v);
    });
  }
  for (int64_t j = start + threadIdx.x; j < V; j += blockDim.x) {
    float v[1] = {E::load(row + j) * scale2};
    seen_nan |= v[0] != v[0];
    acc_add<1>(a, v);
  }
  a = warp_merge(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = a;
  const int any_nan = __syncthreads_or(seen_nan);
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    Acc b = lane < nw ? smem[lane] : acc_empty();
    b = warp_merge(b);
    if (lane == 0) smem[32] = b;
  }
  __syncthreads();
  const Acc r = smem[32];
  __syncthreads();  // smem is reused by the next row
  if (any_nan || r.m == INFINITY || r.m == -INFINITY) return Acc{NAN, NAN, NAN};
  return r;
}

// The gradient of entry j from its logit x: d2 = log2 p, dz = z - lse.
struct GradCoef {
  float scale2, m2, l2s, H, cgl, cge;
  int64_t target;
  __device__ __forceinline__ float operator()(float x, int64_t j) const {
    const float d2 = (x * scale2 - m2) - l2s;
    const float p = exp2f(d2);
    const float dz = d2 * kLn2;
    if (j == target) return cgl * -expm1f(dz) + p * cge * (-H - dz);  // exact 1 - p
    return (p > 0.0f) ? p * (cge * (-H - dz) - cgl) : 0.0f;
  }
};

// dlogits of one row (out may alias row: each element is read before it is written by the same thread).
// In base 2: d2 = (y - m2) - l2s = log2 p, with m2 and l2s = log2 s kept apart (their sum rounded to one
// float would lose l2s at large |m2|, and with it 1 - p of a near-certain token).
template <class T, int U>
__device__ void row_grad(const T* row, T* out, int64_t V, float scale2, float inv_tau, float m2, float l2s,
                         float H, float g_logp, float g_ent, int64_t target) {
  using E = Elem<T>;
  constexpr int VEC = E::kVec;
  const GradCoef gc{scale2, m2, l2s, H, g_logp * inv_tau, g_ent * inv_tau, target};
  int64_t start = 0;
  if (((reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0) {
    start = for_each_vector<T, U>(row, V, [&](float* v, int64_t j) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = gc(v[i], j + i);
      E::store_vec(out + j, v);
    });
  }
  for (int64_t j = start + threadIdx.x; j < V; j += blockDim.x) E::store(out + j, gc(E::load(row + j), j));
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
__global__ void __launch_bounds__(kThreads) stats_kernel(StatsArgs a) {
  __shared__ Acc smem[33];
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
    const Acc r = row_reduce<T, U>(row, V, scale2, smem);
    if (threadIdx.x == 0) {
      const float l2s = log2f(r.s);
      const float yt = (t >= 0 && t < V) ? Elem<T>::load(row + t) * scale2 : NAN;
      a.logp[i] = target_logp(yt, r.m, l2s);
      a.lse[i] = r.m;  // base 2, as row_grad reads them
      a.lse[N + i] = l2s;
      if (a.ent) a.ent[i] = kLn2 * (l2s - r.u / r.s);
    }
  }
}

template <class T, int U>
__global__ void __launch_bounds__(kThreads) grad_kernel(GradArgs a) {
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
    const float m2 = a.lse[i];
    // an undefined row (row_reduce), a target outside [0, V) (only with check_inputs=False: NaN logp), or a
    // NaN upstream gradient (autograd of log_softmax: NaN everywhere, also where p = 0)
    if (m2 != m2 || t < 0 || t >= V || gl != gl || ge != ge) { row_fill<T>(orow, V, NAN); continue; }
    if (gl == 0.0f && ge == 0.0f) { row_fill<T>(orow, V, 0.0f); continue; }
    const T* row = x + b * a.in.sb + tt * a.in.st;
    row_grad<T, U>(row, orow, V, scale2, a.inv_tau, m2, a.lse[N + i], with_ent ? a.ent[i] : 0.0f, gl, ge, t);
  }
}

template <class T, int U>
__global__ void __launch_bounds__(kThreads) policy_kernel(PolicyArgs a) {
  __shared__ Acc smem[33];
  __shared__ float coef[5];
  const T* x = static_cast<const T*>(a.in.x);
  T* out = static_cast<T*>(a.out);
  const int64_t N = a.in.B * a.in.T, V = a.in.V;
  const float scale2 = a.inv_tau * kLog2e;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t b = i / a.in.T, tt = i % a.in.T;
    T* orow = out + b * a.osb + tt * a.ost;
    const int64_t t = target_at(a.targets, a.tdtype, i);
    if (t == kIgnoreIndex) {
      if (threadIdx.x == 0) { a.logp[i] = 0.0f; a.ent[i] = 0.0f; }
      row_fill<T>(orow, V, 0.0f);
      continue;
    }
    const T* row = x + b * a.in.sb + tt * a.in.st;
    const Acc r = row_reduce<T, U>(row, V, scale2, smem);
    if (threadIdx.x == 0) {
      const float l2s = log2f(r.s);  // NaN m, s: NaN logp, H and a NaN dlogits row
      const float yt = (t >= 0 && t < V) ? Elem<T>::load(row + t) * scale2 : NAN;
      const float logp = target_logp(yt, r.m, l2s);
      const float H = kLn2 * (l2s - r.u / r.s);
      a.logp[i] = logp;
      a.ent[i] = H;
      const EpilogueOut e = policy_epilogue(a.ep, logp, H, a.adv[i], a.old ? a.old[i] : 0.0f,
                                            a.ref ? a.ref[i] : 0.0f, a.rollout ? a.rollout[i] : 0.0f, a.w[i]);
      coef[0] = r.m; coef[1] = l2s; coef[2] = H; coef[3] = e.g_logp; coef[4] = e.g_ent;
    }
    __syncthreads();
    const float m2 = coef[0], l2s = coef[1], H = coef[2], gl = coef[3], ge = coef[4];
    __syncthreads();
    // an undefined row (row_reduce), or NaN coefficients (e.g. a NaN logp of a target outside [0, V)):
    // NaN everywhere, also where p = 0, as on the CPU and in autograd
    if (m2 != m2 || gl != gl || ge != ge) row_fill<T>(orow, V, NAN);
    else if (gl == 0.0f && ge == 0.0f) row_fill<T>(orow, V, 0.0f);
    else row_grad<T, U>(row, orow, V, scale2, a.inv_tau, m2, l2s, H, gl, ge, t);
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
std::string launch(const Args& a, uintptr_t stream, void (*f32)(Args), void (*bf16)(Args), void (*f16)(Args)) {
  const int64_t rows = a.in.B * a.in.T;
  if (rows == 0) return std::string();
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int grid = grid_for(rows);
  switch (a.in.dtype) {
    case kFloat32: FRL_LAUNCH(f32, grid, kThreads, s, a); break;
    case kBFloat16: FRL_LAUNCH(bf16, grid, kThreads, s, a); break;
    default: FRL_LAUNCH(f16, grid, kThreads, s, a); break;
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
    return launch(a, stream, policy_kernel<float, U>, policy_kernel<__nv_bfloat16, U>, policy_kernel<__half, U>);
  });
}

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
