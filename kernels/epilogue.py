"""The policy-loss epilogue as a ``@triton.jit`` helper: the per-token closed form of the loss and of
its derivatives, for kernels that know ``logp_t`` (and ``H_t``) of a token after its row's logsumexp.

This is the ONE Triton copy of the math of :func:`fused_rl.loss_math.per_token_loss` (token-level
variants: ppo_clip with asymmetric / dual clip, cispo, reinforce; the five KL estimators; the entropy
bonus). ``tests/test_triton.py`` checks it against autograd of ``per_token_loss`` on random inputs.
With ``r = exp(logp - old)`` (``r = 1`` and ``dr/dlogp = 1`` on-policy), ``d = ref - logp``:

* ppo_clip: ``l = max(-A r, -A clip(r, 1-cl, 1+ch))``; ``dl/dr = -A`` where the unclipped term is
  active, else 0; dual clip ``c`` (``A < 0``): ``l = min(l, -c A)``, ``dl/dr = 0`` where capped;
  ``dl/dlogp = r dl/dr``;
* cispo: ``l = -min(r, 1+ch) A logp`` with the weight detached: ``dl/dlogp = -min(r, 1+ch) A``;
* reinforce: ``l = -A logp``, ``dl/dlogp = -A``;
* KL (``+ beta kl``): k1 ``-d`` (``dkl/dlogp = 1``), k2 ``d^2/2`` (``-d``), k3 ``expm1(d) - d``
  (``-expm1(d)``), abs ``|d|`` (``-sign d``), low_var_kl ``clamp(k3(clamp(d, -20, 20)), -10, 10)``
  (``-expm1(d)`` inside both clamps, else 0);
* entropy bonus: ``l -= entropy_coef H``, ``dl/dH = -entropy_coef``.

Every output is 0 at masked tokens (``valid == False``); the ratio is 1 there.
The kernel multiplies ``dl/dlogp`` and ``dl/dH`` by the aggregation weight ``w_t`` (computed in torch
by :func:`fused_rl.loss_math.aggregation_weights`) to get the coefficients of ``dlogits``.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ``POLICY`` constexpr codes.
PPO_CLIP, CISPO, REINFORCE = 0, 1, 2
#: ``KL`` constexpr codes (0: no estimator).
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "abs": 4, "low_var_kl": 5}


def epilogue_args(config, on_policy: bool) -> dict:
    """Kernel arguments (runtime floats and constexpr switches) of a token-level ``PolicyLossConfig``."""
    if config.policy_loss == "gspo":
        raise ValueError("gspo is sequence-level: its ratio needs all tokens of a sequence; no token epilogue")
    policy = {"ppo_clip": PPO_CLIP, "cispo": CISPO, "reinforce": REINFORCE}[config.policy_loss]
    return dict(
        clip_low=float(config.clip_low), clip_high=float(config.clip_high),
        dual_clip=float(config.dual_clip) if config.dual_clip is not None else 0.0,
        beta=float(config.beta), entropy_coef=float(config.entropy_coef),
        POLICY=policy, HAS_DUAL=config.dual_clip is not None, KL=KL_CODES[config.kl],
        ADD_KL=config.kl is not None and config.beta != 0.0, ADD_ENT=config.entropy_coef != 0.0,
        ON_POLICY=bool(on_policy),
    )


@triton.jit
def expm1(x):
    """``exp(x) - 1`` accurate near 0: Taylor to ``x^9 / 9!`` for ``|x| < 0.5`` (truncation < 3e-10
    relative), ``exp(x) - 1`` elsewhere. Does not rely on an accurate ``log`` (GPU ``log`` is approximate)."""
    p = 1.0 / 362880.0
    p = p * x + 1.0 / 40320.0
    p = p * x + 1.0 / 5040.0
    p = p * x + 1.0 / 720.0
    p = p * x + 1.0 / 120.0
    p = p * x + 1.0 / 24.0
    p = p * x + 1.0 / 6.0
    p = p * x + 0.5
    p = p * x + 1.0
    return tl.where(tl.abs(x) < 0.5, p * x, tl.exp(x) - 1.0)


@triton.jit
def token_epilogue(logp, entropy, old, ref, adv, valid,
                   clip_low, clip_high, dual_clip, beta, entropy_coef,
                   POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, KL: tl.constexpr, ADD_KL: tl.constexpr,
                   ADD_ENT: tl.constexpr, ON_POLICY: tl.constexpr):
    """``(l, dl/dlogp, dl/dH, r, kl)`` per token (any shape, fp32). ``old`` is ignored with
    ``ON_POLICY``, ``ref`` without ``KL``, ``entropy`` without ``ADD_ENT``."""
    zero = tl.where(valid, 0.0, 0.0)
    a = tl.where(valid, adv, zero)
    lp = tl.where(valid, logp, zero)
    if ON_POLICY:
        log_ratio = zero
    else:
        log_ratio = tl.where(valid, logp - old, zero)
    ratio = tl.exp(log_ratio)
    if POLICY == 0:  # ppo_clip
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        unclipped_loss = -a * ratio
        clipped_loss = -a * clipped
        loss = tl.maximum(unclipped_loss, clipped_loss)
        dl_dr = tl.where(unclipped_loss >= clipped_loss, -a, zero)
        if HAS_DUAL:
            cap = -dual_clip * a
            capped = (a < 0.0) & (cap < loss)
            loss = tl.where(capped, cap, loss)
            dl_dr = tl.where(capped, zero, dl_dr)
        dlogp = dl_dr * ratio
    elif POLICY == 1:  # cispo
        weight = tl.minimum(ratio, 1.0 + clip_high)
        loss = -weight * a * lp
        dlogp = -weight * a
    else:  # reinforce
        loss = -a * lp
        dlogp = -a
    kl = zero
    if KL != 0:
        d = tl.where(valid, ref, zero) - lp
        if KL == 1:  # k1
            kl = -d
            dkl = zero + 1.0
        elif KL == 2:  # k2
            kl = 0.5 * d * d
            dkl = -d
        elif KL == 3:  # k3
            em1 = expm1(d)
            kl = em1 - d
            dkl = -em1
        elif KL == 4:  # abs
            kl = tl.abs(d)
            dkl = tl.where(d > 0.0, zero - 1.0, tl.where(d < 0.0, zero + 1.0, zero))
        else:  # low_var_kl
            dc = tl.minimum(tl.maximum(d, -20.0), 20.0)
            em1 = expm1(dc)
            k3 = em1 - dc
            kl = tl.minimum(tl.maximum(k3, -10.0), 10.0)
            inside = (d >= -20.0) & (d <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
            dkl = tl.where(inside, -em1, zero)
        kl = tl.where(valid, kl, zero)
        if ADD_KL:
            loss = loss + beta * kl
            dlogp = dlogp + beta * dkl
    dh = zero
    if ADD_ENT:
        loss = loss - entropy_coef * tl.where(valid, entropy, zero)
        dh = zero - entropy_coef
    loss = tl.where(valid, loss, zero)
    dlogp = tl.where(valid, dlogp, zero)
    dh = tl.where(valid, dh, zero)
    return loss, dlogp, dh, ratio, kl


@triton.jit
def _epilogue_vector_kernel(logp_ptr, ent_ptr, old_ptr, ref_ptr, adv_ptr, valid_ptr,
                            loss_ptr, dlogp_ptr, dh_ptr, ratio_ptr, kl_ptr, n,
                            clip_low, clip_high, dual_clip, beta, entropy_coef,
                            POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, KL: tl.constexpr,
                            ADD_KL: tl.constexpr, ADD_ENT: tl.constexpr, ON_POLICY: tl.constexpr,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    valid = tl.load(valid_ptr + offs, mask=m, other=0) != 0
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0)
    ent = tl.load(ent_ptr + offs, mask=m, other=0.0)
    old = tl.load(old_ptr + offs, mask=m, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=m, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
    loss, dlogp, dh, ratio, kl = token_epilogue(logp, ent, old, ref, adv, valid, clip_low, clip_high, dual_clip,
                                                beta, entropy_coef, POLICY, HAS_DUAL, KL, ADD_KL, ADD_ENT,
                                                ON_POLICY)
    tl.store(loss_ptr + offs, loss, mask=m)
    tl.store(dlogp_ptr + offs, dlogp, mask=m)
    tl.store(dh_ptr + offs, dh, mask=m)
    tl.store(ratio_ptr + offs, ratio, mask=m)
    tl.store(kl_ptr + offs, kl, mask=m)


def apply_epilogue(logp, entropy, old, ref, adv, valid, config):
    """Run :func:`token_epilogue` elementwise on flat fp32 vectors (for tests): returns
    ``(loss, dloss/dlogp, dloss/dH, ratio, kl)``. ``old=None`` means on-policy."""
    import torch

    n = logp.numel()
    f = lambda x: (torch.zeros_like(logp) if x is None else x).reshape(-1).to(torch.float32).contiguous()
    outs = [torch.empty(n, dtype=torch.float32, device=logp.device) for _ in range(5)]
    block = 256
    _epilogue_vector_kernel[(triton.cdiv(n, block),)](
        f(logp), f(entropy), f(old), f(ref), f(adv), valid.reshape(-1).to(torch.int8).contiguous(), *outs, n,
        BLOCK=block, **epilogue_args(config, on_policy=old is None))
    return tuple(o.reshape(logp.shape) for o in outs)
