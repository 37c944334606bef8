// Closed-form per-token policy-loss epilogue shared by the C++ CPU and the CUDA kernels.
//
// This header is, with the Triton epilogue (kernels/epilogue.py), the only other copy of
// fused_rl/loss_math.py (tests/test_native.py checks it against autograd of loss_math.per_token_loss).
// For one unmasked token with log-prob `logp`, entropy `H`, advantage `a`, old / ref / rollout
// log-probs and aggregation weight `w` it returns the value of the per-token loss l_t and
// w * dl_t/dlogp, w * dl_t/dH, using the same tie rules as torch autograd (torch.maximum / minimum
// split the gradient in half on ties, clamp passes it at the bounds):
//
//   r = exp(logp - old)                     (old = sg(logp) on-policy: r = 1, dr/dlogp = r; an r that
//                                            overflows to inf is a constant: no gradient through it)
//   ppo_clip: l = max(-a u, -a clamp(r, 1-cl, 1+ch)), u = r (min(r, delta) with TRL's two-sided
//             clip); dual clip c: l = min(l, -c a) where a < 0
//   sapo:     l = -a 4/tau sigmoid(tau (r - 1)), tau = sapo_pos if a > 0 else sapo_neg
//   cispo:    l = -sg(min(r, 1+ch)) a logp
//   reinforce l = -a logp
//   dppo:     l = -k sg(min(r, delta)) a logp (no min without delta), k the trust-region mask of p = exp(logp),
//             q = exp(old): tv: p - q <= ch where a > 0, else p - q >= -cl; binary KL D = q (old - logp) +
//             (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)): D <= ch or p <= q where a > 0, else D <= cl or p >= q
//   rollout correction (token level, detached): rho = exp(clamp(sg(old) - rollout, -20, 20)) (the bound is
//             loss_math.ROLLOUT_LOG_RHO_BOUND, verl's; 1 where rollout is NaN:
//             a token the engine did not score); the policy term is
//             multiplied by clamp(rho, lo, hi) (truncate) or rho 1[lo <= rho <= hi] (mask)
//   kl (d = ref - logp): k1 -d, k2 d^2/2, k3 expm1(d) - d, abs |d|, low_var_kl clamp(k3(clamp(d,+-20)), +-10);
//             straight-through "X+": the value of X with the gradient of k2 (dk/dd = d, 0 at an infinite d);
//             kl_clamp c: k = clamp(k, -c, c), dk/dd 0 where cut (an "X+" keeps k2's);
//             kl_is_clip C ("X+"): k2's dk/dd times the detached min(r, C);
//             kl_bias_correction: the KL term is r kl (gradient r dkl/dlogp + kl r), each product 0 where one
//             factor is 0 and the other infinite, no kl r where r overflowed, k3's r expm1(d) as exp(ref - old) - r
//             past d = 20 for a finite r (loss_math.bias_corrected_kl)
//   l += beta kl;  l -= entropy_coef H
//   a NaN logp (a row whose softmax is undefined: NaN / +inf logits, or all -inf) gives l = dl/dlogp = NaN
//             for every option, as autograd of the reference does (the on-policy r = 1, the clamps and
//             the ppo_clip / dual-clip min and max, or an l and dl/dlogp independent of logp, would drop it)
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define FRL_HD __host__ __device__ __forceinline__
#else
#define FRL_HD inline
#endif

namespace fused_rl {

enum PolicyKind : int { kPpoClip = 0, kGspo = 1, kCispo = 2, kReinforce = 3, kSapo = 4, kDppoTv = 5, kDppoKl = 6 };
enum KlKind : int { kKlNone = 0, kK1 = 1, kK2 = 2, kK3 = 3, kKlAbs = 4, kLowVarKl = 5 };
enum RolloutKind : int { kRolloutNone = 0, kRolloutTruncate = 1, kRolloutMask = 2 };

struct EpilogueParams {
  int policy = kPpoClip;        // PolicyKind (kGspo is handled in Python: it is sequence-level)
  int kl = kKlNone;             // KlKind of the value
  int kl_straight = 0;          // "X+": gradient of k2
  int kl_bias = 0;              // kl_bias_correction: the KL term times r
  int has_kl_clamp = 0;         // kl_clamp: the KL value clamped to [-kl_clamp, kl_clamp]
  int has_kl_is = 0;            // kl_is_clip: "X+"'s k2 gradient times min(r, kl_is_clip)
  int has_old = 0;              // 0: on-policy
  int has_dual = 0;             // dual clip active
  int has_delta = 0;            // two-sided clip active (dppo: the weight truncated at delta)
  int rollout = kRolloutNone;   // RolloutKind (needs the rollout log-probs)
  float clip_low = 0.2f, clip_high = 0.2f, dual_clip = 0.0f, delta = 0.0f;
  float sapo_pos = 1.0f, sapo_neg = 1.05f, beta = 0.0f, entropy_coef = 0.0f;
  float rollout_min = -INFINITY, rollout_max = INFINITY;  // an absent bound is infinite
  float kl_clamp = 0.0f, kl_is_clip = 0.0f;
};

struct EpilogueOut {
  float loss;    // l_t (unweighted)
  float g_logp;  // w * dl/dlogp
  float g_ent;   // w * dl/dH
};

// torch.clamp / torch.minimum: a NaN operand gives NaN (fminf / fmaxf would drop it: a NaN old log-prob, which
// only check_inputs=False lets through, gave a finite gradient where the reference's is NaN)
FRL_HD float frl_clamp(float x, float lo, float hi) { return x != x ? x : fminf(fmaxf(x, lo), hi); }
FRL_HD float frl_min(float x, float y) { return (x != x || y != y) ? NAN : fminf(x, y); }

// d(clamp(x, lo, hi))/dx as torch computes it: 1 on the closed interval, else 0.
FRL_HD float frl_clamp_grad(float x, float lo, float hi) { return (x >= lo && x <= hi) ? 1.0f : 0.0f; }

// The smoothing of 1 - p in DPPO's binary KL (loss_math.DPPO_BINARY_KL_EPS).
constexpr float kDppoBinaryKlEps = 1e-8f;

// The gap d past which the bias-corrected k3 takes r expm1(d) as exp(log r + d) - r (loss_math.KL_BIAS_FAR).
constexpr float kKlBiasFar = 20.0f;

// r x, but 0 where one factor is 0 and the other infinite (loss_math._times: the bias-corrected KL's limits at a
// -inf log-prob, r = 0, and at an overflowed ratio, a constant, times a zero slope).
FRL_HD float frl_times_limit(float r, float x) {
  return ((r == 0.0f && fabsf(x) == INFINITY) || (r == INFINITY && x == 0.0f)) ? 0.0f : r * x;
}

// dl/dlogp = dl/dr * r (dr/dlogp = r); r overflowed to inf is a constant (loss_math.ratio_exp): 0, not
// 0 * inf = NaN for a clipped token (where the loss depends on r it is inf anyway).
FRL_HD float frl_times_ratio(float dl_dr, float r) { return r == INFINITY ? 0.0f : dl_dr * r; }

// coef * x, but 0 where coef == 0 and x is infinite (a token with no weight adds nothing, also where its term
// overflowed: not 0 * inf = NaN); a NaN x stays NaN (loss_math.weighted).
FRL_HD float frl_weighted(float coef, float x) { return (coef == 0.0f && fabsf(x) == INFINITY) ? 0.0f : coef * x; }

FRL_HD EpilogueOut policy_epilogue(const EpilogueParams& p, float logp, float ent, float a, float old,
                                   float ref, float rollout, float w) {
  const float log_ratio = p.has_old ? (logp - old) : 0.0f;
  const float r = expf(log_ratio);
  float loss = 0.0f, dl_dlogp = 0.0f;
  // the detached weight of the policy term (1 without rollout correction), applied below
  float c = 1.0f;
  if (p.rollout != kRolloutNone) {
    // a NaN rollout log-prob: a token the engine did not score, no correction (log-ratio 0), as TRL
    const float log_rho = (p.has_old ? old : logp) - rollout;  // clamped below, a NaN passing (torch's clamp)
    const float rho = rollout != rollout ? 1.0f
                                         : expf(log_rho > 20.0f ? 20.0f : (log_rho < -20.0f ? -20.0f : log_rho));
    c = p.rollout == kRolloutTruncate ? frl_clamp(rho, p.rollout_min, p.rollout_max)
                                      : ((rho >= p.rollout_min && rho <= p.rollout_max) ? rho : 0.0f);
  }
  if (p.policy == kCispo) {
    const float tw = frl_min(r, 1.0f + p.clip_high);
    loss = frl_weighted(-tw * a, logp);
    dl_dlogp = -tw * a;
  } else if (p.policy == kReinforce) {
    loss = frl_weighted(-a, logp);
    dl_dlogp = -a;
  } else if (p.policy == kSapo) {
    const float tau = a > 0.0f ? p.sapo_pos : p.sapo_neg;
    const float x = tau * (r - 1.0f);
    const float s = 1.0f / (1.0f + expf(-x));
    loss = -a * s * (4.0f / tau);
    // d sigmoid(x) / dr = tau s sigmoid(-x): 1 - s would be 0 once s rounds to 1 (x > 17), e^-x is not
    dl_dlogp = frl_times_ratio(-4.0f * a * s * (1.0f / (1.0f + expf(x))), r);
  } else if (p.policy == kDppoTv || p.policy == kDppoKl) {
    const float tw = p.has_delta ? frl_min(r, p.delta) : r;
    const float lq = p.has_old ? old : logp;
    const float prob = expf(logp), q = expf(lq);
    bool up, down;
    if (p.policy == kDppoTv) {
      up = prob - q <= p.clip_high;
      down = prob - q >= -p.clip_low;
    } else {
      const float eps = kDppoBinaryKlEps;
      const float div = q * (lq - logp) + (1.0f - q) * logf((1.0f - q + eps) / (1.0f - prob + eps));
      up = div <= p.clip_high || prob <= q;
      down = div <= p.clip_low || prob >= q;
    }
    // A = 0 or a dropped token (c = 0): 0, also where r is inf (no delta), not inf * 0 below
    dl_dlogp = (a != 0.0f && c != 0.0f && (a > 0.0f ? up : down)) ? -tw * a : 0.0f;
    loss = frl_weighted(dl_dlogp, logp);
  } else {  // ppo_clip (and gspo's token form, unused)
    const float na = -a;
    const float lo = 1.0f - p.clip_low, hi = 1.0f + p.clip_high;
    const float clipped = frl_clamp(r, lo, hi);
    // TRL's delta: u = clamp(r, max=delta) (NaN passes, the gradient passes at r == delta)
    const bool capped_u = p.has_delta && r > p.delta;
    const float u = frl_weighted(na, capped_u ? p.delta : r), v = na * clipped;  // a = 0: 0 also at r = inf
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
    const float dl_dr = gl * (gu * na * (capped_u ? 0.0f : 1.0f) + gv * na * frl_clamp_grad(r, lo, hi));
    dl_dlogp = frl_times_ratio(dl_dr, r);  // dr/dlogp = r (on-policy too)
  }
  if (p.rollout != kRolloutNone) {
    loss = frl_weighted(c, loss);
    dl_dlogp *= c;
  }
  if (p.kl != kKlNone) {
    const float d = ref - logp;
    float k = 0.0f, dk_dd = 0.0f;
    bool k3_slope = false;  // k = expm1(d) - d and dk/dd = expm1(d): k - dk/dd = -d exactly
    switch (p.kl) {
      case kK1: k = -d; dk_dd = -1.0f; break;
      case kK2: k = 0.5f * d * d; dk_dd = d; break;
      case kK3: {  // +inf at d = +inf (a -inf log-prob), not inf - inf = NaN
        const float e = expm1f(d);
        k = d == INFINITY ? d : e - d;
        dk_dd = e;
        k3_slope = true;
        break;
      }
      case kKlAbs: k = fabsf(d); dk_dd = (d > 0.0f) ? 1.0f : ((d < 0.0f) ? -1.0f : 0.0f); break;
      case kLowVarKl: {
        const float dc = frl_clamp(d, -20.0f, 20.0f);
        const float e = expm1f(dc);
        const float k3 = e - dc;
        k = frl_clamp(k3, -10.0f, 10.0f);
        k3_slope = frl_clamp_grad(k3, -10.0f, 10.0f) * frl_clamp_grad(d, -20.0f, 20.0f) != 0.0f;
        dk_dd = k3_slope ? e : 0.0f;
        break;
      }
      default: break;
    }
    if (p.has_kl_clamp) {  // torch's clamp: the gradient passes on the closed interval, else 0 (also at d = inf)
      if (frl_clamp_grad(k, -p.kl_clamp, p.kl_clamp) == 0.0f && k == k) dk_dd = 0.0f;
      k = k > p.kl_clamp ? p.kl_clamp : (k < -p.kl_clamp ? -p.kl_clamp : k);  // a NaN passes
    }
    if (p.kl_straight) {  // the gradient of k2 = d^2 / 2, 0 at an infinite d (loss_math._k2_slope)
      dk_dd = fabsf(d) == INFINITY ? 0.0f : (p.has_kl_is ? frl_min(r, p.kl_is_clip) * d : d);
      k3_slope = false;
    }
    if (p.beta != 0.0f) {
      if (p.kl_bias) {  // beta r kl: d/dlogp = beta (r kl + r dkl/dlogp) = beta (r kl - r dkl/dd)
        const float rd = frl_times_limit(r, d);
        float rk = frl_times_limit(r, k);
        // k3: r expm1(d) as exp(log r + d) - r past kKlBiasFar for a finite r (exp(d) overflows past 88 where r is
        // small)
        if (p.kl == kK3 && d > kKlBiasFar && r != INFINITY) rk = expf(p.has_old ? ref - old : d) - r - rd;
        loss += p.beta * rk;
        // k3: r kl - r dkl/dd = -r d, without cancelling two terms of size r exp(d); else r kl as the derivative r
        // carries (none where it overflowed: a constant) and r dkl/dlogp
        dl_dlogp += p.beta * (k3_slope ? -rd : (r == INFINITY ? 0.0f : rk) - frl_times_limit(r, dk_dd));
      } else {
        loss += p.beta * k;
        dl_dlogp += -p.beta * dk_dd;  // dd/dlogp = -1
      }
    }
  }
  float dl_dent = 0.0f;
  if (p.entropy_coef != 0.0f) {
    loss -= p.entropy_coef * ent;
    dl_dent = -p.entropy_coef;
  }
  if (logp != logp) {  // an undefined row: NaN whatever the branches above made of it
    loss = NAN;
    dl_dlogp = NAN;
  }
  EpilogueOut out;
  out.loss = loss;
  out.g_logp = w * dl_dlogp;
  out.g_ent = w * dl_dent;
  return out;
}

}  // namespace fused_rl
