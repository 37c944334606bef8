// CPU kernels of the fused logits pass, written once with GCC vector extensions (4 or 8 x fp32) and
// compiled once per instruction set: included by logits_cpu.cpp (baseline) and logits_cpu_avx2.cpp
// (after `#pragma GCC target("avx2,fma")`), with FRL_NS naming the namespace.
//
// Per row (z = x / tau, one thread per row, a fixed reduction order => bit-identical results for
// any thread count):
//   online over vocabulary blocks of FRL_BLOCK: m = running max of the logits x (from -inf), z - max z =
//   (x - m) / tau, S = sum exp(z - max z), U = sum exp(z - max z) (z - max z), rescaled by exp(dz), dz =
//   (m_old - m_new) / tau (0 below the exp floor, as each entry's own term), when the max grows;
//   logp = (z_target - max z) - log S, H = log S - U / S (= lse - E[z]); m and log S are saved apart
//   (lse = m / tau + log S rounded to one float loses log S at large |m|, and with it 1 - p of a sure token).
//   The raw max is subtracted before the scaling so that the max's own z - max z is exactly 0 and its term
//   exactly 1 (x * (1/tau) - max z, contracted into an FMA by the AVX2 build, left the rounding residual of
//   the max's product: H ~ 5e-8 and logp ~ -5e-8 on a one-hot row at tau != 1); hence S >= 1, U <= 0,
//   logp <= 0 and H >= 0 with no clamp.
//   A row whose softmax is undefined (a NaN or +inf z, or every z = -inf) gets m = log S = logp = H = NaN
//   and a NaN dlogits row, as log_softmax of the reference gives (a -inf z in a finite row is p = 0).
// Gradient: dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau with p = exp(d), d = (z - max z) - log S.
#ifndef FRL_NS
#error "define FRL_NS before including logits_cpu_impl.h"
#endif

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace fused_rl {
namespace FRL_NS {
namespace {

#ifndef FRL_VEC_BYTES
#define FRL_VEC_BYTES 16  // 4 x fp32 (SSE); the AVX2 build uses 32
#endif
// W fp32 lanes per vector; the names say v8 but the width is FRL_VEC_BYTES / 4.
constexpr int W = FRL_VEC_BYTES / 4;
typedef float v8f __attribute__((vector_size(FRL_VEC_BYTES)));
typedef int32_t v8i __attribute__((vector_size(FRL_VEC_BYTES)));
typedef uint32_t v8u __attribute__((vector_size(FRL_VEC_BYTES)));
typedef uint16_t v8h __attribute__((vector_size(FRL_VEC_BYTES / 2)));

constexpr int64_t FRL_BLOCK = 2048;
constexpr float kExpLo = -87.3f;  // exp(x) is returned as exactly 0 at and below this (so a clamped -inf gives 0)

inline v8f splat(float x) {
  v8f v;
  for (int l = 0; l < W; ++l) v[l] = x;
  return v;
}
inline v8f as_f(v8u u) { v8f f; std::memcpy(&f, &u, sizeof f); return f; }
inline v8u as_u(v8f f) { v8u u; std::memcpy(&u, &f, sizeof u); return u; }
inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }
inline v8f vmin(v8f a, v8f b) { return a < b ? a : b; }

// exp(x) to ~2 ulp on [-87.3, 88]; exactly 0 below -87.3 (so exp(-inf) = 0 and 0 * (z - M) stays 0).
inline v8f vexp(v8f x) {
  const v8f xc = vmin(vmax(x, splat(kExpLo)), splat(88.0f));
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest integer
  const v8f k = (xc * splat(1.44269504088896341f) + magic) - magic;
  v8f r = xc - k * splat(0.693359375f);
  r = r - k * splat(-2.12194440e-4f);
  v8f p = splat(1.0f / 5040.0f);
  p = p * r + splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const v8i ki = __builtin_convertvector(k, v8i);
  const v8u scale = (v8u)((ki + 127) << 23);
  const v8f res = p * as_f(scale);
  return x <= splat(kExpLo) ? splat(0.0f) : res;
}

inline float sexp(float x) {  // the scalar twin of vexp (same arithmetic in lane 0)
  return vexp(splat(x))[0];
}

// z - max z = (x - m) / tau for one element (m: the row's max logit), as the row loops compute it (no
// contraction can apply: a product of a difference): exactly 0 at the max, <= 0 elsewhere.
inline float shifted(float x, float inv_tau, float m) { return (x - m) * inv_tau; }

// ---- element types -------------------------------------------------------------------------------
struct F32 {
  using T = float;
  static inline v8f load8(const T* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
  static inline void store8(T* p, v8f v) { std::memcpy(p, &v, sizeof v); }
  // memcpy: a tensor of torch.frombuffer / from_numpy may start at any byte (UB through a typed pointer)
  static inline float load1(const T* p) { float v; std::memcpy(&v, p, sizeof v); return v; }
  static inline void store1(T* p, float v) { std::memcpy(p, &v, sizeof v); }
};

// The loads and stores of a 16-bit type D, from its from_bits / to_bits (8 lanes).
template <class D>
struct Bits16 {
  using T = uint16_t;
  static inline v8f load8(const T* p) { v8h h; std::memcpy(&h, p, sizeof h); return D::from_bits(h); }
  static inline void store8(T* p, v8f v) { v8h h = D::to_bits(v); std::memcpy(p, &h, sizeof h); }
  static inline float load1(const T* p) {  // memcpy: any byte alignment (F32::load1)
    T bits;
    std::memcpy(&bits, p, sizeof bits);
    return D::from_bits(v8h{bits})[0];
  }
  static inline void store1(T* p, float v) {
    const T bits = D::to_bits(splat(v))[0];
    std::memcpy(p, &bits, sizeof bits);
  }
};

struct BF16 : Bits16<BF16> {
  using T = uint16_t;
  static inline v8f from_bits(v8h h) { return as_f(__builtin_convertvector(h, v8u) << 16); }
  static inline v8h to_bits(v8f f) {
    const v8u u = as_u(f);
    const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    const v8u nan = (u >> 16) | 0x40u;
    const v8u out = (f != f) ? nan : rounded;
    return __builtin_convertvector(out, v8h);
  }
};

struct F16 : Bits16<F16> {
  using T = uint16_t;
  static inline v8f from_bits(v8h h16) {
    const v8u h = __builtin_convertvector(h16, v8u);
    const v8u sign = (h & 0x8000u) << 16;
    const v8u em = h & 0x7fffu;
    // No fp32 subnormal is formed (a multiply of one reads 0 under DAZ, torch.set_flush_denormal, in the
    // threads that have it): normals by rebiasing the exponent (15 -> 127), subnormals em * 2^-24 as
    // (0.5 + em 2^-24) - 0.5, both exact.
    const v8u normal = (em << 13) + 0x38000000u;
    const v8u sub = as_u(as_f(em | 0x3f000000u) - splat(0.5f));
    const v8u special = (em << 13) | 0x7f800000u;  // inf / nan
    const v8u bits = (em >= 0x7c00u) ? special : ((em < 0x400u) ? sub : normal);
    return as_f(bits | sign);
  }
  static inline v8h to_bits(v8f f) {
    // round-to-nearest-even float -> half, subnormals and overflow included
    const v8u w = as_u(f);
    const v8u shl1 = w + w;
    const v8u sign = w & 0x80000000u;
    v8u bias = shl1 & 0xff000000u;
    bias = (bias < 0x71000000u) ? (v8u)(bias * 0u + 0x71000000u) : bias;
    v8f absf = as_f(w & 0x7fffffffu);
    v8f base = (absf * splat(5.192296858534828e33f)) * splat(7.703719777548943e-34f);
    base = as_f((bias >> 1) + 0x07800000u) + base;
    const v8u bits = as_u(base);
    const v8u nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    const v8u res = (sign >> 16) | ((shl1 > 0xff000000u) ? (v8u)(shl1 * 0u + 0x7e00u) : nonsign);
    return __builtin_convertvector(res, v8h);
  }
};

// Load n < W trailing elements, the rest of the lanes = fill.
template <class D>
inline v8f load_tail(const typename D::T* p, int64_t n, float fill) {
  v8f v = splat(fill);
  for (int64_t l = 0; l < n; ++l) v[l] = D::load1(p + l);
  return v;
}

inline float hmax(v8f v) {
  float m = v[0];
  for (int l = 1; l < W; ++l) m = v[l] > m ? v[l] : m;
  return m;
}
inline float hsum(v8f v) {  // fixed pairwise tree order
  for (int half = W / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) v[l] = v[l] + v[l + half];
  return v[0];
}

struct RowStats {
  float m;    // max x (the raw logit: z - max z = shifted(x, inv_tau, m))
  double s;   // sum exp(z - max z) >= 1
  double u;   // sum exp(z - max z) (z - max z) <= 0
  bool bad() const { return m != m; }  // the softmax is undefined (see row_stats)
};

// H = log S - U / S, >= 0 as log S >= 0 >= U (exactly 0 on a one-hot row); NaN passes
inline float entropy_of(float logs, const RowStats& st) { return float(double(logs) - st.u / st.s); }

// The stats of a row whose softmax is undefined: NaN m, hence NaN log s, logp and H (stats_impl) and a NaN
// dlogits row (row_nan).
constexpr RowStats kBadRow = {NAN, NAN, NAN};

inline bool any_lane(v8i v) {
  int32_t r = 0;
  for (int l = 0; l < W; ++l) r |= v[l];
  return r != 0;
}

// (M, S, U) of one row, or kBadRow when its softmax is undefined: a NaN anywhere (the max drops NaN, so
// the max loop also ORs "x is NaN" into a flag, no second pass: per pair of vectors one add, one compare,
// one OR, as a + b is NaN iff a or b is NaN or they are +inf and -inf, and a +inf is undefined anyway),
// a +inf z (the block max, scaled; z - max z would be NaN) or no finite z at all (M = -inf at the end). The
// row is left at its first bad block.
template <class D>
inline RowStats row_stats(const typename D::T* x, int64_t V, float inv_tau) {
  const v8f vt = splat(inv_tau);
  const float NEG_INF = -INFINITY;
  float M = NEG_INF;  // max x so far
  double S = 0.0, U = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += FRL_BLOCK) {
    const int64_t n = (V - b0) < FRL_BLOCK ? (V - b0) : FRL_BLOCK;
    const typename D::T* xb = x + b0;
    const int64_t nv = n & ~int64_t(W - 1);
    v8f mx0 = splat(NEG_INF), mx1 = splat(NEG_INF);
    v8i seen_nan = {};  // lanes that saw a NaN
    int64_t j = 0;
    for (; j + 2 * W <= nv; j += 2 * W) {
      const v8f a = D::load8(xb + j), b = D::load8(xb + j + W), ab = a + b;
      mx0 = vmax(mx0, a);
      mx1 = vmax(mx1, b);
      seen_nan |= ab != ab;
    }
    for (; j < nv; j += W) {
      const v8f a = D::load8(xb + j);
      mx0 = vmax(mx0, a);
      seen_nan |= a != a;
    }
    if (nv < n) {
      const v8f a = load_tail<D>(xb + nv, n - nv, NEG_INF);
      mx1 = vmax(mx1, a);
      seen_nan |= a != a;
    }
    const float bm = hmax(vmax(mx0, mx1));
    if (any_lane(seen_nan) || bm * inv_tau == INFINITY) return kBadRow;
    if (bm > M) {
      if (M != NEG_INF) {
        const double dz = (double(M) - double(bm)) * inv_tau;
        const double sc = dz <= kExpLo ? 0.0 : std::exp(dz);
        U = sc * (U + S * dz);
        S = sc * S;
      }
      M = bm;
    }
    if (M == NEG_INF) continue;  // everything so far is -inf
    const v8f vm = splat(M);
    v8f s0 = splat(0.0f), s1 = splat(0.0f), u0 = splat(0.0f), u1 = splat(0.0f);
    j = 0;
    for (; j + 2 * W <= nv; j += 2 * W) {
      const v8f d0 = vmax((D::load8(xb + j) - vm) * vt, splat(kExpLo));
      const v8f d1 = vmax((D::load8(xb + j + W) - vm) * vt, splat(kExpLo));
      const v8f e0 = vexp(d0), e1 = vexp(d1);
      s0 += e0; s1 += e1;
      u0 += e0 * d0; u1 += e1 * d1;
    }
    for (; j < nv; j += W) {
      const v8f d0 = vmax((D::load8(xb + j) - vm) * vt, splat(kExpLo));
      const v8f e0 = vexp(d0);
      s0 += e0; u0 += e0 * d0;
    }
    if (nv < n) {
      const v8f d1 = vmax((load_tail<D>(xb + nv, n - nv, NEG_INF) - vm) * vt, splat(kExpLo));
      const v8f e1 = vexp(d1);  // padding lanes: d = kExpLo -> e = 0
      s1 += e1; u1 += e1 * d1;
    }
    S += double(hsum(s0 + s1));
    U += double(hsum(u0 + u1));
  }
  if (M == NEG_INF) return kBadRow;  // every z = -inf: 0 / 0
  return RowStats{M, S, U};
}

// dlogits row: (g_logp (onehot - p) + g_ent p (E[z] - z)) / tau, p = exp(d), d = (z - max z) - logs (m: max x);
// E[z] - z = -H - d.
// Read as D, written as DO (D itself, or a 16-bit type for fp32 logits: one rounding on store).
template <class D, class DO = D>
inline void row_grad(const typename D::T* x, typename DO::T* out, int64_t V, float inv_tau, float m, float logs,
                     float H, float g_logp, float g_ent, int64_t target) {
  const float xt = (target >= 0 && target < V) ? D::load1(x + target) : NAN;  // before any write
  const v8f vt = splat(inv_tau), vm = splat(m), vls = splat(logs), vgl = splat(-g_logp * inv_tau),
            vge = splat(g_ent * inv_tau), vnh = splat(-H);
  const int64_t nv = V & ~int64_t(W - 1);
  for (int64_t j = 0; j < nv; j += W) {
    const v8f d = vmax((D::load8(x + j) - vm) * vt - vls, splat(kExpLo));
    const v8f p = vexp(d);
    DO::store8(out + j, p * (vgl + vge * (vnh - d)));
  }
  if (nv < V) {
    const v8f d = vmax((load_tail<D>(x + nv, V - nv, -INFINITY) - vm) * vt - vls, splat(kExpLo));
    const v8f p = vexp(d);
    const v8f g = p * (vgl + vge * (vnh - d));
    for (int64_t l = 0; l < V - nv; ++l) DO::store1(out + nv + l, g[l]);
  }
  if (target >= 0 && target < V) {
    // 1 - p by expm1: a near-certain token's 1 - p is below the error of the vector exp
    const float d = fmaxf(shifted(xt, inv_tau, m) - logs, kExpLo);
    DO::store1(out + target, (g_logp * -std::expm1(d) + g_ent * sexp(d) * (-H - d)) * inv_tau);
  }
}

template <class D>
inline void row_zero(typename D::T* out, int64_t V) { std::memset(out, 0, sizeof(typename D::T) * V); }

// The dlogits row of a row whose softmax is undefined (RowStats::bad): NaN, whatever g_logp and g_H are
// (autograd of log_softmax gives NaN there even for a zero upstream gradient: 0 * NaN).
template <class D>
inline void row_nan(typename D::T* out, int64_t V) {
  const int64_t nv = V & ~int64_t(W - 1);
  for (int64_t j = 0; j < nv; j += W) D::store8(out + j, splat(NAN));
  for (int64_t j = nv; j < V; ++j) D::store1(out + j, NAN);
}

inline int64_t target_at(const void* t, int tdtype, int64_t i) {
  if (tdtype == kInt32) {
    int32_t v;
    std::memcpy(&v, static_cast<const int32_t*>(t) + i, sizeof v);  // any byte alignment, as load1
    return v;
  }
  int64_t v;
  std::memcpy(&v, static_cast<const int64_t*>(t) + i, sizeof v);
  return v;
}

inline int threads(int n) { return n > 0 ? n : omp_get_max_threads(); }

template <class D>
void stats_impl(const StatsArgs& a) {
  const auto* x = static_cast<const typename D::T*>(a.in.x);
  const int64_t N = a.in.B * a.in.T, T = a.in.T, V = a.in.V;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(a.nthreads))
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = target_at(a.targets, a.tdtype, i);
    if (t == kIgnoreIndex) {
      a.logp[i] = 0.0f; a.lse[i] = 0.0f; a.lse[N + i] = 0.0f;
      if (a.ent) a.ent[i] = 0.0f;
      continue;
    }
    const typename D::T* row = x + (i / T) * a.in.sb + (i % T) * a.in.st;
    const RowStats st = row_stats<D>(row, V, a.inv_tau);
    const float logs = float(std::log(st.s));
    const float xt = (t >= 0 && t < V) ? D::load1(row + t) : NAN;
    a.logp[i] = shifted(xt, a.inv_tau, st.m) - logs;
    a.lse[i] = st.m;
    a.lse[N + i] = logs;
    if (a.ent) a.ent[i] = entropy_of(logs, st);
  }
}

template <class D>
void grad_impl(const GradArgs& a) {
  const auto* x = static_cast<const typename D::T*>(a.in.x);
  auto* out = static_cast<typename D::T*>(a.out);
  const int64_t N = a.in.B * a.in.T, T = a.in.T, V = a.in.V;
  const bool with_ent = a.ent != nullptr && a.g_ent != nullptr;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(a.nthreads))
  for (int64_t i = 0; i < N; ++i) {
    const int64_t b = i / T, tt = i % T;
    typename D::T* orow = out + b * a.osb + tt * a.ost;
    const int64_t t = target_at(a.targets, a.tdtype, i);
    const float gl = a.g_logp[i], ge = with_ent ? a.g_ent[i] : 0.0f;
    if (t == kIgnoreIndex) { row_zero<D>(orow, V); continue; }
    const float m = a.lse[i];
    // stats of RowStats::bad, or a target outside [0, V) (only with check_inputs=False; its logp is NaN)
    if (m != m || t < 0 || t >= V) { row_nan<D>(orow, V); continue; }
    if (gl == 0.0f && ge == 0.0f) { row_zero<D>(orow, V); continue; }
    const typename D::T* row = x + b * a.in.sb + tt * a.in.st;
    const float H = with_ent ? a.ent[i] : 0.0f;
    row_grad<D>(row, orow, V, a.inv_tau, m, a.lse[N + i], H, gl, ge, t);
  }
}

template <class D, class DO = D>
void policy_impl(const PolicyArgs& a) {
  const auto* x = static_cast<const typename D::T*>(a.in.x);
  auto* out = static_cast<typename DO::T*>(a.out);
  const int64_t N = a.in.B * a.in.T, T = a.in.T, V = a.in.V;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(a.nthreads))
  for (int64_t i = 0; i < N; ++i) {
    const int64_t b = i / T, tt = i % T;
    typename DO::T* orow = out + b * a.osb + tt * a.ost;
    const int64_t t = target_at(a.targets, a.tdtype, i);
    if (t == kIgnoreIndex) {
      a.logp[i] = 0.0f; a.ent[i] = 0.0f;
      row_zero<DO>(orow, V);
      continue;
    }
    const typename D::T* row = x + b * a.in.sb + tt * a.in.st;
    const RowStats st = row_stats<D>(row, V, a.inv_tau);
    const float logs = float(std::log(st.s));
    const float xt = (t >= 0 && t < V) ? D::load1(row + t) : NAN;
    const float logp = shifted(xt, a.inv_tau, st.m) - logs;
    const float H = entropy_of(logs, st);
    a.logp[i] = logp;
    a.ent[i] = H;
    if (st.bad()) { row_nan<DO>(orow, V); continue; }  // NaN logp and H (the epilogue's g_logp is NaN too)
    const EpilogueOut e = policy_epilogue(a.ep, logp, H, F32::load1(a.adv + i), a.old ? F32::load1(a.old + i) : 0.0f,
                                          a.ref ? F32::load1(a.ref + i) : 0.0f,
                                          a.rollout ? F32::load1(a.rollout + i) : 0.0f, a.w[i]);
    if (e.g_logp == 0.0f && e.g_ent == 0.0f) { row_zero<DO>(orow, V); continue; }
    row_grad<D, DO>(row, orow, V, a.inv_tau, st.m, logs, H, e.g_logp, e.g_ent, t);
  }
}

}  // namespace

void token_stats(const StatsArgs& a) {
  switch (a.in.dtype) {
    case kFloat32: stats_impl<F32>(a); break;
    case kBFloat16: stats_impl<BF16>(a); break;
    default: stats_impl<F16>(a); break;
  }
}

void token_grad(const GradArgs& a) {
  switch (a.in.dtype) {
    case kFloat32: grad_impl<F32>(a); break;
    case kBFloat16: grad_impl<BF16>(a); break;
    default: grad_impl<F16>(a); break;
  }
}

void policy_fused(const PolicyArgs& a) {
  if (a.odtype != a.in.dtype) {  // fp32 logits, 16-bit dlogits (the bindings admit no other pair)
    if (a.odtype == kBFloat16) policy_impl<F32, BF16>(a);
    else policy_impl<F32, F16>(a);
    return;
  }
  switch (a.in.dtype) {
    case kFloat32: policy_impl<F32>(a); break;
    case kBFloat16: policy_impl<BF16>(a); break;
    default: policy_impl<F16>(a); break;
  }
}

}  // namespace FRL_NS
}  // namespace fused_rl
