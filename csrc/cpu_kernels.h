// Plain-C++ interface of the CPU kernels (no torch types): raw pointers, sizes and strides in elements.
#pragma once

#include <cstdint>

#include "policy_epilogue.h"

namespace fused_rl {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum IndexType : int { kInt32 = 0, kInt64 = 1 };
constexpr int64_t kIgnoreIndex = -100;

// (B, T, V) rows: element (b, t, v) at x[b * sb + t * st + v].
struct RowsView {
  const void* x;
  int dtype;
  int64_t B, T, V, sb, st;
};

struct StatsArgs {
  RowsView in;
  const void* targets;  // B*T contiguous, IndexType
  int tdtype;
  float inv_tau;
  float* logp;  // B*T
  float* ent;   // B*T or nullptr
  float* lse;   // 2*B*T: row max m at [i], log s at [B*T + i] (kept apart: m + log s would round)
  int nthreads;
};

struct GradArgs {
  RowsView in;
  const void* targets;
  int tdtype;
  float inv_tau;
  const float* lse;  // as StatsArgs::lse
  const float* g_logp;
  const float* ent;    // nullptr: no entropy term
  const float* g_ent;  // nullptr: no entropy term
  void* out;           // logits dtype, element (b, t, v) at out[b * osb + t * ost + v]
  int64_t osb, ost;
  int nthreads;
};

struct PolicyArgs {
  RowsView in;
  const void* targets;  // IGNORE_INDEX where the mask is off
  int tdtype;
  float inv_tau;
  const float* adv;  // B*T fp32
  const float* old;  // nullptr: on-policy
  const float* ref;  // nullptr unless kl
  const float* rollout;  // nullptr unless ep.rollout
  const float* w;    // aggregation weights
  EpilogueParams ep;
  float* logp;
  float* ent;
  void* out;  // dlogits (may alias in.x for the in-place variant: same strides)
  int64_t osb, ost;
  int odtype;  // dlogits' DType: in.dtype, or bf16 / fp16 for fp32 logits (the fused linear's mixed mode)
  int nthreads;
};

namespace cpu {
// Implemented once per instruction set (baseline x86-64-v2 and AVX2+FMA) and dispatched at run time.
void token_stats(const StatsArgs& a);
void token_grad(const GradArgs& a);
void policy_fused(const PolicyArgs& a);
// 0: auto (AVX2 when the CPU has it), 1: force the baseline build.
void set_isa(int mode);
const char* isa_name();
int max_threads();
}  // namespace cpu

#define FRL_DECLARE_ISA(ns)                  \
  namespace ns {                             \
  void token_stats(const StatsArgs& a);      \
  void token_grad(const GradArgs& a);        \
  void policy_fused(const PolicyArgs& a);    \
  }

FRL_DECLARE_ISA(cpu_baseline)
FRL_DECLARE_ISA(cpu_avx2)

}  // namespace fused_rl
