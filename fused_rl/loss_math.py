"""The O(N) policy-loss math: the only definition of every loss variant.

Everything here works on per-token ``(B, T)`` vectors (log-probs, entropies, advantages, mask),
never on the vocabulary. Every backend computes ``logp`` / ``entropy`` its own way (full
``log_softmax``, chunked torch, Triton, C++) and then either calls :func:`compute_policy_loss`
directly or, for fused single-pass kernels, must agree with it (the tests check that).

Conventions (``m`` the boolean mask, ``r = exp(logp - old)``, ``d = ref - logp``):

* masked positions never reach the loss or metrics: values there (padding, NaN, inf) are replaced
  by neutral ones with ``torch.where`` before any arithmetic, so ``0 * nan`` cannot poison a sum;
* on-policy (``old=None``) means ``old = sg(logp)``: ``r == 1`` but ``d r / d logp == 1``;
* the loss is ``sum_t w_t * l_t`` with the aggregation weights of :func:`aggregation_weights`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .config import PolicyLossConfig

Normalizer = Union[None, int, float, torch.Tensor]

METRIC_NAMES = ("kl_mean", "clip_frac_low", "clip_frac_high", "clip_frac", "clip_frac_dual", "ratio_mean",
                "entropy_mean")


def aggregation_weights(mask: torch.Tensor, config: PolicyLossConfig,
                        token_normalizer: Normalizer = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights ``w`` (B, T) of ``dtype`` with ``loss = sum(w * l)``.

    * token-mean:              ``w = m / N``, ``N = token_normalizer`` or ``max(sum(m), 1)``
    * seq-mean-token-mean:     ``w = m / (B * max(sum_t m, 1))``
    * seq-mean-token-sum:      ``w = m / B``
    * seq-mean-token-sum-norm: ``w = m / (B * max_len)``, ``max_len`` defaulting to ``T``
    """
    m = mask.to(dtype)
    batch, length = m.shape
    if config.agg == "token-mean":
        if token_normalizer is None:
            denom = m.sum().clamp(min=1.0)
        elif isinstance(token_normalizer, torch.Tensor):
            denom = token_normalizer.to(device=m.device, dtype=dtype)
        else:
            denom = float(token_normalizer)
        return m / denom
    if token_normalizer is not None:
        raise ValueError(f"token_normalizer only applies to agg='token-mean', not {config.agg!r}")
    if config.agg == "seq-mean-token-mean":
        return m / (m.sum(dim=1, keepdim=True).clamp(min=1.0) * batch)
    if config.agg == "seq-mean-token-sum":
        return m / batch
    max_len = config.max_len if config.max_len is not None else length
    return m / float(batch * max_len)


def kl_estimator(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) with ``d = ref - logp``.

    k1 ``-d``; k2 ``d^2 / 2``; k3 ``exp(d) - d - 1``; abs ``|d|``; low_var_kl ``clamp(k3, -10, 10)``.
    """
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.expm1(d) - d
    if kind == "abs":
        return d.abs()
    if kind == "low_var_kl":
        # d is clamped to [-20, 20] first (as verl does): it changes no value, since k3 > 10 there,
        # but keeps exp(d) finite so the zero gradient of the outer clamp is not 0 * inf = NaN.
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.expm1(d) - d).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def importance_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                     config: PolicyLossConfig) -> torch.Tensor:
    """``r_t = exp(logp_t - old_t)``; for gspo ``s_i = exp(sum_t m (logp - old) / max(sum_t m, 1))``
    broadcast over the sequence. Masked positions contribute ``log r = 0``."""
    log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
    if config.policy_loss == "gspo":
        count = mask.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / count).expand_as(logp)
    return torch.exp(log_ratio)


def policy_gradient_loss(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                         config: PolicyLossConfig) -> torch.Tensor:
    """Per-token surrogate (to minimize) of ``config.policy_loss``; see :class:`PolicyLossConfig`."""
    a = advantages
    if config.policy_loss in ("ppo_clip", "gspo"):
        clipped = ratio.clamp(min=1.0 - config.clip_low, max=1.0 + config.clip_high)
        loss = torch.maximum(-a * ratio, -a * clipped)
        if config.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -config.dual_clip * a), loss)
        return loss
    if config.policy_loss == "cispo":
        return -ratio.clamp(max=1.0 + config.clip_high).detach() * a * logp
    return -a * logp  # reinforce


def per_token_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(l, r, kl)``: per-token loss ``l_t = pg_t + beta * kl_t - entropy_coef * H_t`` (0 where masked),
    the importance ratio and the KL estimate (``None`` without ``config.kl``).

    Each row ``b`` depends only on row ``b`` of the inputs (gspo's ratio included), so callers may
    evaluate it on any subset of whole sequences. Shapes ``(B, T)``; ``mask`` boolean.
    """
    zeros = torch.zeros_like(logp)
    old = logp.detach() if old_logprobs is None else old_logprobs
    a = torch.where(mask, advantages, zeros)
    ratio = importance_ratio(logp, old, mask, config)
    safe_logp = torch.where(mask, logp, zeros)
    loss = policy_gradient_loss(safe_logp, ratio, a, config)
    kl = None
    if config.kl is not None:
        if ref_logprobs is None:
            raise ValueError(f"config.kl={config.kl!r} needs ref_logprobs")
        kl = torch.where(mask, kl_estimator(safe_logp, torch.where(mask, ref_logprobs, zeros), config.kl), zeros)
        if config.beta != 0.0:
            loss = loss + config.beta * kl
    if config.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("config.entropy_coef != 0 needs the entropy")
        loss = loss - config.entropy_coef * torch.where(mask, entropy, zeros)
    return torch.where(mask, loss, zeros), ratio, kl


def compute_policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    token_normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics from per-token log-probs: ``loss = sum_t w_t l_t`` with ``l`` from
    :func:`per_token_loss` and ``w`` from :func:`aggregation_weights`.

    Shapes: all ``(B, T)``; ``advantages`` already broadcast; ``mask`` boolean. Metrics are
    detached 0-dim fp32 tensors averaged over masked tokens (no host sync).
    """
    loss_t, ratio, kl = per_token_loss(logp, advantages, mask, config, old_logprobs=old_logprobs,
                                       ref_logprobs=ref_logprobs, entropy=entropy)
    weights = aggregation_weights(mask, config, token_normalizer, dtype=logp.dtype)
    loss = (loss_t * weights).sum()
    return loss, metrics(ratio, advantages, mask, config, kl, entropy)


def metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig,
            kl: Optional[torch.Tensor], entropy: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masked means: clip fractions follow TRL (``low``: ``r < 1-clip_low`` and ``A < 0``; ``high``:
    ``r > 1+clip_high`` and ``A > 0``); cispo's ``high`` counts every truncated weight ``r > 1+clip_high``;
    ``dual``: tokens where the dual-clip cap ``-c A`` is the active value."""
    m = mask.to(torch.float32)
    count = m.sum().clamp(min=1.0)
    ratio = ratio.detach()
    a = torch.where(mask, advantages, torch.zeros_like(advantages))

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(mask, x.detach().to(torch.float32), torch.zeros_like(m))).sum() / count

    false = torch.zeros_like(mask)
    low = high = dual = false
    if config.policy_loss in ("ppo_clip", "gspo"):
        low = (ratio < 1.0 - config.clip_low) & (a < 0)
        high = (ratio > 1.0 + config.clip_high) & (a > 0)
        if config.dual_clip is not None:
            # for A < 0 the clipped surrogate is |A| max(r, 1 - clip_low); the cap |A| c binds when r > c.
            dual = (a < 0) & (ratio > config.dual_clip)
    elif config.policy_loss == "cispo":
        high = ratio > 1.0 + config.clip_high
    metrics = {
        "kl_mean": mean(kl) if kl is not None else m.new_zeros(()),
        "clip_frac_low": mean(low),
        "clip_frac_high": mean(high),
        "clip_frac": mean(low | high),
        "clip_frac_dual": mean(dual),
        "ratio_mean": mean(ratio),
    }
    if entropy is not None:
        metrics["entropy_mean"] = mean(entropy)
    return metrics
