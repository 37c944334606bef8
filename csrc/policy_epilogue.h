// Closed-form per-token policy-loss epilogue shared by the C++ CPU and the CUDA kernels.
//
// This header is the only second copy of fused_rl/loss_math.py (tests/test_native.py checks it
// against autograd of loss_math.per_token_loss). For one unmasked token with log-prob `logp`,
// entropy `H`, advantage `a`, old / ref log-probs and aggregation weight `w` it returns the value
// of the per-token loss l_t and w * dl_t/dlogp, w * dl_t/dH, using the same tie rules as torch
// autograd (torch.maximum / minimum split the gradient in half on ties, clamp passes it at the
// bounds):
//
//   r = exp(logp - old)                     (old = sg(logp) on-policy: r = 1, dr/dlogp = r)
//   ppo_clip: l = max(-a r, -a clamp(r, 1-cl, 1+ch)); dual clip c: l = min(l, -c a) where a < 0
//   cispo:    l = -sg(min(r, 1+ch)) a logp
//   reinforce l = -a logp
//   kl (d = ref - logp): k1 -d, k2 d^2/2, k3 expm1(d) - d, abs |d|, low_var_kl clamp(k3(clamp(d,+-20)), +-10)
//   l += beta kl;  l -= entropy_coef H
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define FRL_HD __host__ __device__ __forceinline__
#else
#define FRL_HD inline
#endif

namespace fused_rl {

enum PolicyKind : int { kPpoClip = 0, kGspo = 1, kCispo = 2, kReinforce = 3 };
enum KlKind : int { kKlNone = 0, kK1 = 1, kK2 = 2, kK3 = 3, kKlAbs = 4, kLowVarKl = 5 };

struct EpilogueParams {
  int policy;          // PolicyKind (kGspo is handled in Python: it is sequence-level)
  int kl;              // KlKind
  int has_old;         // 0: on-policy
  int has_dual;        // dual clip active
  float clip_low, clip_high, dual_clip, beta, entropy_coef;
};

struct EpilogueOut {
  float loss;    // l_t (unweighted)
  float g_logp;  // w * dl/dlogp
  float g_ent;   // w * dl/dH
};

FRL_HD float frl_clamp(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// d(clamp(x, lo, hi))/dx as torch computes it: 1 on the closed interval, else 0.
FRL_HD float frl_clamp_grad(float x, float lo, float hi) { return (x >= lo && x <= hi) ? 1.0f : 0.0f; }

FRL_HD EpilogueOut policy_epilogue(const EpilogueParams& p, float logp, float ent, float a, float old,
                                   float ref, float w) {
  const float log_ratio = p.has_old ? (logp - old) : 0.0f;
  const float r = expf(log_ratio);
  float loss = 0.0f, dl_dlogp = 0.0f;
  if (p.policy == kCispo) {
    const float tw = fminf(r, 1.0f + p.clip_high);
    loss = -tw * a * logp;
    dl_dlogp = -tw * a;
  } else if (p.policy == kReinforce) {
    loss = -a * logp;
    dl_dlogp = -a;
  } else {  // ppo_clip (and gspo's token form, unused)
    const float na = -a;
    const float lo = 1.0f - p.clip_low, hi = 1.0f + p.clip_high;
    const float clipped = frl_clamp(r, lo, hi);
    const float u = na * r, v = na * clipped;
    // torch.maximum(u, v): gradient to u where u > v, half to each on a tie.
    float gu, gv;
    if (u > v) { gu = 1.0f; gv = 0.0f; } else if (u < v) { gu = 0.0f; gv = 1.0f; } else { gu = 0.5f; gv = 0.5f; }
    float l = u > v ? u : v;
    if (u != u) l = u;  // propagate NaN like torch.maximum
    float gl = 1.0f;  // d(final)/d(l)
    if (p.has_dual && a < 0.0f) {
      const float cap = -p.dual_clip * a;
      if (l < cap) { gl = 1.0f; } else if (l > cap) { gl = 0.0f; l = cap; } else { gl = 0.5f; }
    }
    loss = l;
    const float dl_dr = gl * (gu * na + gv * na * frl_clamp_grad(r, lo, hi));
    dl_dlogp = dl_dr * r;  // dr/dlogp = r (on-policy too)
  }
  if (p.kl != kKlNone) {
    const float d = ref - logp;
    float k = 0.0f, dk_dd = 0.0f;
    switch (p.kl) {
      case kK1: k = -d; dk_dd = -1.0f; break;
      case kK2: k = 0.5f * d * d; dk_dd = d; break;
      case kK3: { const float e = expm1f(d); k = e - d; dk_dd = e; break; }
      case kKlAbs: k = fabsf(d); dk_dd = (d > 0.0f) ? 1.0f : ((d < 0.0f) ? -1.0f : 0.0f); break;
      case kLowVarKl: {
        const float dc = frl_clamp(d, -20.0f, 20.0f);
        const float e = expm1f(dc);
        const float k3 = e - dc;
        k = frl_clamp(k3, -10.0f, 10.0f);
        dk_dd = e * frl_clamp_grad(k3, -10.0f, 10.0f) * frl_clamp_grad(d, -20.0f, 20.0f);
        break;
      }
      default: break;
    }
    if (p.beta != 0.0f) {
      loss += p.beta * k;
      dl_dlogp += -p.beta * dk_dd;  // dd/dlogp = -1
    }
  }
  float dl_dent = 0.0f;
  if (p.entropy_coef != 0.0f) {
    loss -= p.entropy_coef * ent;
    dl_dent = -p.entropy_coef;
  }
  EpilogueOut out;
  out.loss = loss;
  out.g_logp = w * dl_dlogp;
  out.g_ent = w * dl_dent;
  return out;
}

}  // namespace fused_rl
