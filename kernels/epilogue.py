"""The policy-loss epilogue as a ``@triton.jit`` helper: the per-token closed form of the loss and of
its derivatives, for kernels that know ``logp_t`` (and ``H_t``) of a token after its row's logsumexp.

This is the ONE Triton copy of the math of :func:`fused_rl.loss_math.per_token_loss` for every
token-local config (``PolicyLossConfig.has_token_epilogue``: ppo_clip with asymmetric / dual clip and
TRL's ``delta``, sapo, cispo, reinforce, dppo; every KL estimator, straight-through ones included, and
``kl_bias_correction``; token-level rollout correction; the entropy bonus). ``tests/test_triton.py``
checks it against autograd of ``per_token_loss`` on random inputs. With ``r = exp(logp - old)``
(``r = 1`` and ``dr/dlogp = 1`` on-policy, so ``dr/dlogp = r`` always), ``d = ref - logp``:

* ppo_clip: ``l = max(-A u, -A c)`` with ``c = clamp(r, 1-cl, 1+ch)``, ``u = r`` or, with ``delta``,
  ``u = min(r, delta)``; ``dl/dr`` follows torch's autograd rules exactly: ``clamp`` / ``min`` pass
  the gradient at their bounds (``dc/dr = 1[1-cl <= r <= 1+ch]``, ``du/dr = 1[r <= delta]``) and
  ``max`` / ``min`` of two equal values give each half of it. Dual clip ``k`` (``A < 0``):
  ``l = min(l, -k A)``, the cap a constant. ``dl/dlogp = r dl/dr``, 0 where ``r`` overflowed to inf
  (a constant there, ``loss_math.ratio_exp``; not ``0 * inf = NaN`` for a clipped token);
* sapo: ``l = -A 4/tau sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where ``A > 0``, else
  ``tau_neg``; ``dl/dlogp = -4 A s (1 - s) r`` with ``s = sigmoid(tau (r - 1))``, ``1 - s`` taken as
  ``sigmoid(-tau (r - 1))`` (exact in the tail, where ``s`` rounds to 1; 0 where ``r`` is inf);
* cispo: ``l = -min(r, 1+ch) A logp`` with the weight detached: ``dl/dlogp = -min(r, 1+ch) A``;
* reinforce: ``l = -A logp``, ``dl/dlogp = -A``;
* dppo (``dppo_tv`` / ``dppo_kl``): ``l = -k w A logp`` with the detached weight ``w = min(r, delta)`` (``r``
  without ``delta``) and trust-region mask ``k`` of ``p = exp(logp)``, ``q = exp(old)`` (``loss_math.dppo_keep``:
  ``p - q`` or the binary KL against ``clip_high`` where ``A > 0``, ``clip_low`` elsewhere):
  ``dl/dlogp = -k w A``, 0 where ``A = 0`` (also where ``r`` overflowed: without ``delta`` an overflowed ``r`` with
  ``A != 0`` gives an infinite weight);
* token rollout correction (``rollout_is="token_*"``): ``rho = exp(clamp(old - rollout, -20, 20))``
  (``old = sg(logp)`` on-policy; the bound is ``loss_math.ROLLOUT_LOG_RHO_BOUND``, verl's),
  ``w = clamp(rho, lo, hi)`` (truncate) or ``rho 1[lo <= rho <= hi]`` (mask), a missing bound no bound;
  ``w`` (detached) multiplies the policy term and its derivative only;
* KL (``+ beta kl``): k1 ``-d`` (``dkl/dlogp = 1``), k2 ``d^2/2`` (``-d``), k3 ``expm1(d) - d``
  (``-expm1(d)``), abs ``|d|`` (``-sign d``), low_var_kl ``clamp(k3(clamp(d, -20, 20)), -10, 10)``
  (``-expm1(d)`` inside both clamps, else 0); ``"X+"``: the value of ``X``, the derivative of k2
  (``-d``, 0 at an infinite ``d``); ``kl_clamp=c``: ``kl <- clamp(kl, -c, c)``, ``dkl/dlogp`` 0 where cut (an
  ``"X+"`` keeps k2's); ``kl_is_clip=C`` (``"X+"``): k2's derivative times ``min(r, C)`` (detached);
  ``kl_bias_correction``: ``kl <- r kl`` (the returned ``kl`` too), so
  ``dl/dlogp += beta r (dkl/dlogp + kl)``, which is ``-beta r d`` for k3 (taken so: the two terms
  cancel to ``|d|`` from ``exp(d)``); each product 0 where one factor is 0 and the other infinite (a ``-inf``
  log-prob off-policy; an overflowed ``r`` times a zero slope), an overflowed ``r`` (a constant) carries no
  derivative of its own, and k3's ``r expm1(d)`` is ``exp(ref - old) - r`` past ``d = 20`` for a finite ``r``
  (``loss_math.bias_corrected_kl``: finite where ``exp(d)`` overflows but ``r`` is small);
* entropy bonus: ``l -= entropy_coef H``, ``dl/dH = -entropy_coef``;
* a NaN ``logp`` (a row whose softmax is undefined: NaN / ``+inf`` logits, or all ``-inf``) gives
  ``l = dl/dlogp = r = NaN`` (and ``kl = NaN`` with ``KL``) at a valid token for every option, as
  autograd of the reference does: the on-policy ``r = 1`` and the clamps would otherwise lose it. Every min / max
  / clamp keeps a NaN operand (``_nan_min`` / ``_nan_max``, as torch's), so a NaN old / ref / rollout log-prob
  (possible only with ``check_inputs=False``) gives what the reference gives.

Every output is 0 at masked tokens (``valid == False``); the ratio is 1 there. Each option is a
``tl.constexpr`` switch (an unused one compiles to nothing); its numbers are runtime arguments (a
new value does not recompile). The kernel multiplies ``dl/dlogp`` and ``dl/dH`` by the aggregation
weight ``w_t`` (computed in torch by :func:`fused_rl.loss_math.aggregation_weights`) to get the
coefficients of ``dlogits``.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ``loss_math.KL_BIAS_FAR`` (compiled Triton reads only constexpr globals).
KL_BIAS_FAR = tl.constexpr(20.0)
#: ``POLICY`` constexpr codes.
POLICY_CODES = {"ppo_clip": 0, "cispo": 1, "reinforce": 2, "sapo": 3, "dppo_tv": 4, "dppo_kl": 5}
#: ``loss_math.DPPO_BINARY_KL_EPS``.
DPPO_BINARY_KL_EPS = tl.constexpr(1e-8)
#: ``KL`` constexpr codes of the base estimator (0: none); ``KL_ST`` marks the straight-through ``"X+"``.
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "abs": 4, "low_var_kl": 5}
#: ``ROLLOUT`` constexpr codes (token-level rollout correction; 0: none).
ROLLOUT_CODES = {None: 0, "token_truncate": 1, "token_mask": 2}


def epilogue_args(config, on_policy: bool) -> dict:
    """Kernel arguments (runtime floats and constexpr switches) of a token-level ``PolicyLossConfig``,
    in the order of :func:`token_epilogue`'s parameters after ``valid``."""
    if not config.has_token_epilogue:
        raise ValueError("no token epilogue for this config (sequence ratio or mask, top-entropy quantile, cov_mode): "
                         f"{config}")
    kl = config.kl
    lo, hi = (config.rollout_is_min, config.rollout_is_max) if config.rollout_is is not None else (None, None)
    return dict(
        clip_low=float(config.clip_low), clip_high=float(config.clip_high),
        dual_clip=float(config.dual_clip) if config.dual_clip is not None else 0.0,
        delta=float(config.delta) if config.delta is not None else 0.0,
        tau_pos=float(config.sapo_temperature_pos), tau_neg=float(config.sapo_temperature_neg),
        beta=float(config.beta), entropy_coef=float(config.entropy_coef),
        ris_min=float(lo) if lo is not None else 0.0, ris_max=float(hi) if hi is not None else 0.0,
        kl_clamp=float(config.kl_clamp) if config.kl_clamp is not None else 0.0,
        kl_is_clip=float(config.kl_is_clip) if config.kl_is_clip is not None else 0.0,
        POLICY=POLICY_CODES[config.policy_loss], HAS_DUAL=config.dual_clip is not None,
        HAS_DELTA=config.delta is not None,
        KL=KL_CODES[kl.rstrip("+") if kl is not None else None], KL_ST=kl is not None and kl.endswith("+"),
        ADD_KL=kl is not None and config.beta != 0.0, KL_BIAS=bool(config.kl_bias_correction),
        KL_CLAMP=config.kl_clamp is not None, KL_IS=config.kl_is_clip is not None,
        ROLLOUT=ROLLOUT_CODES[config.rollout_is], HAS_RIS_MIN=lo is not None, HAS_RIS_MAX=hi is not None,
        ADD_ENT=config.entropy_coef != 0.0, ON_POLICY=bool(on_policy),
    )


@triton.jit
def expm1(x):
    """``exp(x) - 1`` accurate near 0: Taylor to ``x^9 / 9!`` for ``|x| < 0.5`` (truncation < 1e-9
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
def _times_ratio(dl_dr, ratio):
    """``dl/dlogp = dl/dr * r`` (``dr/dlogp = r``); an ``r`` that overflowed to inf is a constant: 0."""
    return tl.where(ratio == float("inf"), 0.0, dl_dr * ratio)


@triton.jit
def _times_limit(r, x):
    """``r x``, 0 where one factor is 0 and the other infinite (``loss_math._times``: the bias-corrected KL's
    limits at a ``-inf`` log-prob and at an overflowed ratio times a zero slope)."""
    zero = ((r == 0.0) & (tl.abs(x) == float("inf"))) | ((r == float("inf")) & (x == 0.0))
    return tl.where(zero, 0.0, r * x)


@triton.jit
def _weighted(coef, x):
    """``coef * x``, 0 where ``coef == 0`` and ``x`` is infinite; NaN ``x`` stays NaN
    (``loss_math.weighted``)."""
    return tl.where((coef == 0.0) & (tl.abs(x) == float("inf")), 0.0, coef * x)


@triton.jit
def _nan_min(x, y):
    """``torch.minimum`` / the upper side of ``torch.clamp``: NaN where either operand is (``tl.minimum`` drops a NaN
    on GPUs, and in the interpreter: a NaN old log-prob, which only ``check_inputs=False`` lets through, gave a finite
    loss where the reference's is NaN)."""
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nan_max(x, y):
    """``torch.maximum`` / the lower side of ``torch.clamp``: NaN where either operand is."""
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_grad(x, y, dx, dy):
    """``(max(x, y), d max)`` from the derivatives ``dx``, ``dy`` of ``x``, ``y``: torch's rule, half of
    each on ties."""
    return _nan_max(x, y), tl.where(x > y, dx, tl.where(x < y, dy, 0.5 * (dx + dy)))


@triton.jit
def _min_grad(x, y, dx, dy):
    """``(min(x, y), d min)``, half of each derivative on ties (torch's rule)."""
    return _nan_min(x, y), tl.where(x < y, dx, tl.where(x > y, dy, 0.5 * (dx + dy)))


@triton.jit
def token_epilogue(logp, entropy, old, ref, rollout, adv, valid,
                   clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta, entropy_coef, ris_min, ris_max,
                   kl_clamp, kl_is_clip,
                   POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_DELTA: tl.constexpr, KL: tl.constexpr,
                   KL_ST: tl.constexpr, ADD_KL: tl.constexpr, KL_BIAS: tl.constexpr, KL_CLAMP: tl.constexpr,
                   KL_IS: tl.constexpr, ROLLOUT: tl.constexpr,
                   HAS_RIS_MIN: tl.constexpr, HAS_RIS_MAX: tl.constexpr, ADD_ENT: tl.constexpr,
                   ON_POLICY: tl.constexpr):
    """``(l, dl/dlogp, dl/dH, r, kl)`` per token (any shape, fp32). ``old`` is ignored with
    ``ON_POLICY``, ``ref`` without ``KL``, ``rollout`` without ``ROLLOUT``, ``entropy`` without ``ADD_ENT``."""
    zero = tl.where(valid, 0.0, 0.0)
    a = tl.where(valid, adv, zero)
    lp = tl.where(valid, logp, zero)
    if ON_POLICY:
        log_ratio = zero
    else:
        log_ratio = tl.where(valid, logp - old, zero)
    ratio = tl.exp(log_ratio)
    if ROLLOUT != 0:  # the detached weight of the policy term, applied below
        if ON_POLICY:
            behind = lp
        else:
            behind = old
        # a NaN rollout log-prob: a token the engine did not score, no correction (log-ratio 0), as TRL
        log_rho = tl.where(valid & (rollout == rollout), behind - rollout, zero)
        # clamp(., -20, 20) (loss_math.ROLLOUT_LOG_RHO_BOUND) by where: a NaN passes, as torch's clamp
        log_rho = tl.where(log_rho > 20.0, 20.0, tl.where(log_rho < -20.0, -20.0, log_rho))
        rho = tl.exp(log_rho)
        if ROLLOUT == 1:  # token_truncate
            w_is = rho
            if HAS_RIS_MIN:
                w_is = _nan_max(w_is, ris_min)
            if HAS_RIS_MAX:
                w_is = _nan_min(w_is, ris_max)
        else:  # token_mask
            keep = valid
            if HAS_RIS_MIN:
                keep = keep & (rho >= ris_min)
            if HAS_RIS_MAX:
                keep = keep & (rho <= ris_max)
            w_is = tl.where(keep, rho, zero)
    if POLICY == 0:  # ppo_clip
        clipped = _nan_min(_nan_max(ratio, 1.0 - clip_low), 1.0 + clip_high)
        d_clipped = tl.where((ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high), -a, zero)
        if HAS_DELTA:
            unclipped = _nan_min(ratio, delta)
            d_unclipped = tl.where(ratio <= delta, -a, zero)
        else:
            unclipped = ratio
            d_unclipped = -a
        loss, dl_dr = _max_grad(_weighted(-a, unclipped), -a * clipped, d_unclipped, d_clipped)
        if HAS_DUAL:
            capped, d_capped = _min_grad(loss, -dual_clip * a, dl_dr, zero)
            neg = a < 0.0
            loss = tl.where(neg, capped, loss)
            dl_dr = tl.where(neg, d_capped, dl_dr)
        dlogp = _times_ratio(dl_dr, ratio)
    elif POLICY == 1:  # cispo
        weight = _nan_min(ratio, 1.0 + clip_high)
        loss = _weighted(-weight * a, lp)
        dlogp = -weight * a
    elif POLICY == 2:  # reinforce
        loss = _weighted(-a, lp)
        dlogp = -a
    elif POLICY == 3:  # sapo
        tau = tl.where(a > 0.0, zero + tau_pos, zero + tau_neg)
        x = tau * (ratio - 1.0)
        sig = 1.0 / (1.0 + tl.exp(-x))
        loss = -a * sig * (4.0 / tau)
        dlogp = _times_ratio(-4.0 * a * sig * (1.0 / (1.0 + tl.exp(x))), ratio)
    else:  # dppo: 4 total variation, 5 binary KL
        weight = ratio
        if HAS_DELTA:
            weight = _nan_min(ratio, delta)
        prob = tl.exp(lp)
        if ON_POLICY:
            lq = lp
        else:
            lq = tl.where(valid, old, zero)
        q = tl.exp(lq)
        if POLICY == 4:
            up = prob - q <= clip_high
            down = prob - q >= -clip_low
        else:
            eps = DPPO_BINARY_KL_EPS
            div = q * (lq - lp) + (1.0 - q) * tl.log((1.0 - q + eps) / (1.0 - prob + eps))
            up = (div <= clip_high) | (prob <= q)
            down = (div <= clip_low) | (prob >= q)
        kept = tl.where(a > 0.0, up, down) & (a != 0.0)
        if ROLLOUT != 0:  # a dropped token: its weight may be an overflowed r (no delta), not inf * 0 below
            kept = kept & (w_is != 0.0)
        dlogp = tl.where(kept, -weight * a, zero)  # A = 0: 0, also at r = inf
        loss = _weighted(dlogp, lp)
    if ROLLOUT != 0:
        loss = _weighted(w_is, loss)
        dlogp = dlogp * w_is
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
            kl = tl.where(d == float("inf"), d, em1 - d)  # not inf - inf = NaN at a -inf log-prob
            dkl = -em1
        elif KL == 4:  # abs
            kl = tl.abs(d)
            dkl = tl.where(d > 0.0, zero - 1.0, tl.where(d < 0.0, zero + 1.0, zero))
        else:  # low_var_kl
            dc = _nan_min(_nan_max(d, -20.0), 20.0)
            em1 = expm1(dc)
            k3 = em1 - dc
            kl = _nan_min(_nan_max(k3, -10.0), 10.0)
            inside = (d >= -20.0) & (d <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
            dkl = tl.where(inside, -em1, zero)
        if KL_CLAMP:  # clamp(kl, -c, c), its gradient passing on the closed interval (torch's clamp)
            cut = (kl > kl_clamp) | (kl < -kl_clamp)  # a NaN is not cut (loss_math.kl_estimator)
            kl = tl.where(kl > kl_clamp, kl_clamp, tl.where(kl < -kl_clamp, -kl_clamp, kl))
            dkl = tl.where(cut, zero, dkl)
        if KL_ST:  # "X+": the value of X, the gradient of k2 (0 at an infinite d, as loss_math._k2_slope)
            dkl = tl.where(tl.abs(d) == float("inf"), zero, -d)
            if KL_IS:  # times sg(min(r, C)), the token ratio
                dkl = _nan_min(ratio, kl_is_clip) * dkl
        kl = tl.where(valid, kl, zero)
        if KL_BIAS:  # r kl with the differentiable ratio: d(r kl)/dlogp = r kl + r dkl, products at their limits
            rd = _times_limit(ratio, d)
            r_kl = _times_limit(ratio, kl)
            if KL == 3:  # r expm1(d) as exp(log r + d) - r past KL_BIAS_FAR, for a finite r (exp(d) overflows)
                if ON_POLICY:
                    log_rd = d
                else:
                    log_rd = tl.where(valid, ref - old, zero)
                far = (d > KL_BIAS_FAR) & (ratio != float("inf"))
                r_kl = tl.where(far, tl.exp(tl.where(far, log_rd, zero)) - ratio - rd, r_kl)
            if KL == 3 and not KL_ST:
                dkl = zero - rd  # k3: -r expm1(d) + r expm1(d) - r d, without the cancellation
            else:  # r kl as the derivative r carries (none where it overflowed: a constant) plus r dkl
                dkl = tl.where(ratio == float("inf"), zero, r_kl) + _times_limit(ratio, dkl)
            kl = r_kl
        if ADD_KL:
            loss = loss + beta * kl
            dlogp = dlogp + beta * dkl
    dh = zero
    if ADD_ENT:
        loss = loss - entropy_coef * tl.where(valid, entropy, zero)
        dh = zero - entropy_coef
    undefined = valid & (logp != logp)  # NaN whatever the branches above made of it
    loss = tl.where(valid, tl.where(undefined, float("nan"), loss), zero)
    dlogp = tl.where(valid, tl.where(undefined, float("nan"), dlogp), zero)
    dh = tl.where(valid, dh, zero)
    ratio = tl.where(undefined, float("nan"), ratio)
    if KL != 0:
        kl = tl.where(undefined, float("nan"), kl)
    return loss, dlogp, dh, ratio, kl


@triton.jit
def _epilogue_vector_kernel(logp_ptr, ent_ptr, old_ptr, ref_ptr, rollout_ptr, adv_ptr, valid_ptr,
                            loss_ptr, dlogp_ptr, dh_ptr, ratio_ptr, kl_ptr, n,
                            clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta, entropy_coef,
                            ris_min, ris_max, kl_clamp, kl_is_clip,
                            POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_DELTA: tl.constexpr,
                            KL: tl.constexpr, KL_ST: tl.constexpr, ADD_KL: tl.constexpr, KL_BIAS: tl.constexpr,
                            KL_CLAMP: tl.constexpr, KL_IS: tl.constexpr,
                            ROLLOUT: tl.constexpr, HAS_RIS_MIN: tl.constexpr, HAS_RIS_MAX: tl.constexpr,
                            ADD_ENT: tl.constexpr, ON_POLICY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    valid = tl.load(valid_ptr + offs, mask=m, other=0) != 0
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0)
    ent = tl.load(ent_ptr + offs, mask=m, other=0.0)
    old = tl.load(old_ptr + offs, mask=m, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=m, other=0.0)
    rollout = tl.load(rollout_ptr + offs, mask=m, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
    loss, dlogp, dh, ratio, kl = token_epilogue(
        logp, ent, old, ref, rollout, adv, valid, clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta,
        entropy_coef, ris_min, ris_max, kl_clamp, kl_is_clip, POLICY, HAS_DUAL, HAS_DELTA, KL, KL_ST, ADD_KL,
        KL_BIAS, KL_CLAMP, KL_IS, ROLLOUT, HAS_RIS_MIN, HAS_RIS_MAX, ADD_ENT, ON_POLICY)
    tl.store(loss_ptr + offs, loss, mask=m)
    tl.store(dlogp_ptr + offs, dlogp, mask=m)
    tl.store(dh_ptr + offs, dh, mask=m)
    tl.store(ratio_ptr + offs, ratio, mask=m)
    tl.store(kl_ptr + offs, kl, mask=m)


def apply_epilogue(logp, entropy, old, ref, adv, valid, config, rollout=None):
    """Run :func:`token_epilogue` elementwise on flat fp32 vectors (for tests): returns
    ``(loss, dloss/dlogp, dloss/dH, ratio, kl)``. ``old=None`` means on-policy; ``rollout`` are the
    sampler's log-probs (``config.rollout_is``)."""
    import torch

    n = logp.numel()
    f = lambda x: (torch.zeros_like(logp) if x is None else x).reshape(-1).to(torch.float32).contiguous()
    outs = [torch.empty(n, dtype=torch.float32, device=logp.device) for _ in range(5)]
    block = 256
    _epilogue_vector_kernel[(triton.cdiv(n, block),)](
        f(logp), f(entropy), f(old), f(ref), f(rollout), f(adv), valid.reshape(-1).to(torch.int8).contiguous(),
        *outs, n, BLOCK=block, **epilogue_args(config, on_policy=old is None))
    return tuple(o.reshape(logp.shape) for o in outs)
