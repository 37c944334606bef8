"""Hypothesis strategies and settings shared by the fuzz tests (``test_hardening.py`` for the logits-level
loss, ``test_linear_fuzz.py`` for the fused linear one, ``test_validation.py`` for bad inputs)."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from fused_rl import IGNORE_INDEX, PolicyLossConfig
from fused_rl.config import (AGGREGATIONS, COV_MODES, DPPO, KL_CLAMPABLE, KL_ESTIMATORS, POLICY_LOSSES, PPO_STYLE,
                             ROLLOUT_IS_MODES)


def _fuzz_scale() -> int:
    raw = os.environ.get("FUSED_RL_FUZZ_SCALE", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FUSED_RL_FUZZ_SCALE must be a positive integer, got {raw!r}")
    return int(raw)


#: ``FUSED_RL_FUZZ_SCALE=k`` (environment; default 1): every fuzz test draws ``k`` times its examples, fresh
#: random ones each run (hypothesis prints a failing example's ``@reproduce_failure`` blob), instead of the
#: fixed draw CI makes every run.
FUZZ_SCALE = _fuzz_scale()


def fuzz_settings(examples: int, *health_checks: HealthCheck) -> settings:
    """The hypothesis settings of a fuzz test: ``examples`` derandomized draws (the same ones every run), or
    ``FUZZ_SCALE`` times as many random ones; no deadline (the Triton interpreter is slow); ``too_slow`` and
    ``health_checks`` suppressed."""
    return settings(max_examples=examples * FUZZ_SCALE, deadline=None, derandomize=FUZZ_SCALE == 1,
                    print_blob=FUZZ_SCALE > 1, suppress_health_check=[HealthCheck.too_slow, *health_checks])


@st.composite
def configs(draw) -> PolicyLossConfig:
    """A config drawn from every field of ``PolicyLossConfig`` (combinations it refuses are rejected)."""
    policy = draw(st.sampled_from(POLICY_LOSSES))
    kl = draw(st.sampled_from(KL_ESTIMATORS))
    agg = draw(st.sampled_from(AGGREGATIONS))
    ppo = policy in PPO_STYLE
    clip_high = draw(st.sampled_from([0.0, 0.2, 0.28, 4.0]))
    rollout = draw(st.sampled_from(ROLLOUT_IS_MODES + (None,) * 4))  # None half the time: the tiled route
    cov_mode = draw(st.sampled_from(COV_MODES + (None,) * 4))
    fields = dict(
        policy_loss=policy, kl=kl, agg=agg, clip_high=clip_high,
        clip_low=draw(st.sampled_from([0.0, 0.1, 0.2])),
        beta=draw(st.sampled_from([0.0, 0.05, 1.0])) if kl else 0.0,
        kl_bias_correction=bool(kl) and draw(st.booleans()),
        kl_clamp=draw(st.sampled_from([None, None, 0.5, 10.0])) if kl in KL_CLAMPABLE else None,
        kl_is_clip=draw(st.sampled_from([None, 1.1])) if kl is not None and kl.endswith("+") else None,
        dual_clip=draw(st.sampled_from([None, 3.0])) if ppo else None,
        delta=draw(st.sampled_from([None, 1.5 + clip_high])) if ppo or policy in DPPO else None,
        sapo_temperature_pos=draw(st.sampled_from([1.0, 0.5])), sapo_temperature_neg=draw(st.sampled_from([1.05, 2.0])),
        rollout_is=rollout,
        rollout_is_min=draw(st.sampled_from([None, 0.5])) if rollout else None,
        rollout_is_max=draw(st.sampled_from([2.0, 3.0])),
        off_policy_mask=draw(st.sampled_from([None, 0.05])),
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5])),
        # clip_cov draws at random: cov_ratio 1 drops every candidate, the same on two backends
        cov_mode=cov_mode, cov_ratio=1.0 if cov_mode == "clip_cov" else draw(st.sampled_from([2e-4, 0.3])),
        clip_cov_lb=draw(st.sampled_from([-1.0, 0.0])), clip_cov_ub=draw(st.sampled_from([0.5, 100.0])),
        kl_cov_coef=draw(st.sampled_from([1.0, 0.3])),
        mask_truncated_completions=draw(st.booleans()),
        max_len=draw(st.sampled_from([None, 12])) if agg == "seq-mean-token-sum-norm" else None,
        temperature=draw(st.sampled_from([1.0, 0.3, 1.7])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, -0.1])),
    )
    try:
        return PolicyLossConfig(**fields)
    except ValueError:  # a combination the config refuses (e.g. delta with clip_high = 4)
        assume(False)


def fit_inputs(config: PolicyLossConfig, case):
    """A policy or linear case (a dataclass with ``old``, ``ref``, ``rollout``, ``truncated``) with just the
    inputs ``config`` reads: old log-probs for the off-policy mask even when the case is on-policy (any
    finite ones away from ``r = 1``), rollout log-probs only with rollout correction, the truncation flags
    only when they are used."""
    old = case.old
    if old is None and config.off_policy_mask is not None:
        old = case.ref + 0.1
    return dataclasses.replace(case, old=old, rollout=case.rollout if config.rollout_is else None,
                               truncated=case.truncated if config.mask_truncated_completions else None)


def loss_tokens(case) -> torch.Tensor:
    """The tokens a :func:`fit_inputs` case's loss reads (bool): its mask less ``IGNORE_INDEX`` targets and, where
    the config masks them (``truncated`` kept), the truncated completions. The tie checks below look at these: two
    tokens left of a larger mask always tie for kl_cov (their centred covariances are equal)."""
    mask = case.mask.bool() & (case.targets != IGNORE_INDEX)
    if case.truncated is not None:
        mask = mask & ~case.truncated.bool().reshape(-1, 1)
    return mask


def entropy_choice_is_a_tie(entropy, mask, config: PolicyLossConfig, tol: float) -> bool:
    """Whether ``top_entropy_quantile``'s choice of tokens hangs on rounding: two unmasked entropies closer
    than ``tol`` (identical rows, near-one-hot rows; the interpolated threshold then lies within ``tol`` of
    both), or one within ``tol`` of the threshold without being it. Two correct implementations may keep
    different tokens there (their entropies agree to ~1e-8, not bitwise), so the fuzz skips such draws."""
    if config.top_entropy_quantile >= 1.0 or entropy is None:
        return False
    h = entropy[mask].double().sort().values
    if h.numel() < 2:
        return False
    q = torch.quantile(h, 1.0 - config.top_entropy_quantile)
    near = (h - q).abs()
    return bool((h.diff() < tol).any() or ((near > 0) & (near < tol)).any())


def cov_choice_is_a_tie(config: PolicyLossConfig, logp, advantages, mask, tol: float) -> bool:
    """Whether ``cov_mode``'s choice hangs on rounding: kl_cov's ``n``-th and ``n+1``-th largest covariances, or a
    covariance and a clip_cov band edge, within ``tol`` times the advantages' scale (two correct implementations'
    log-probs agree to rounding, so their covariances to ``|A - mean A|`` times that)."""
    if config.cov_mode is None:
        return False
    adv = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(mask.shape)).double()[mask]
    lp = logp.detach().double()[mask]
    if lp.numel() < 2:
        return False
    cov = (adv - adv.mean()) * (lp - lp.mean())
    tol = tol * (1.0 + float((adv - adv.mean()).abs().max()))
    if config.cov_mode == "clip_cov":
        return bool(((cov - config.clip_cov_lb).abs() < tol).any() or ((cov - config.clip_cov_ub).abs() < tol).any())
    n = max(int(config.cov_ratio * lp.numel()), 1)
    top = cov.sort(descending=True).values
    return n < top.numel() and bool(top[n - 1] - top[n] < tol)


def ratio_at_a_bound(config: PolicyLossConfig, logp, old, mask, tol: float) -> bool:
    """Whether a token's ratio ``r = exp(logp - old)`` lies within ``tol`` (in log space) of a threshold where the
    loss or a clip-fraction metric switches (``1 - clip_low``, ``1 + clip_high``, cispo's cap ``clip_high``,
    ``dual_clip``, ``delta``): two correct implementations whose log-probs agree to rounding may put it on either
    side (a randomized fuzz example: 3.000004 vs the reference's 2.999999 at ``dual_clip = 3``), so the fuzz skips
    such draws. On-policy (``old`` None) the ratio is exactly 1 on every backend."""
    if old is None:
        return False
    bounds = [1.0 - config.clip_low, 1.0 + config.clip_high, config.clip_high, config.dual_clip, config.delta]
    d = (logp.detach().double() - old.double())[mask]
    if config.policy_loss in DPPO and _dppo_gate_at_a_bound(config, logp.detach().double()[mask],
                                                            old.double()[mask], tol):
        return True
    return any(b is not None and b > 0 and bool(((d - math.log(b)).abs() < tol).any()) for b in bounds)


def _dppo_gate_at_a_bound(config: PolicyLossConfig, logp, old, tol: float) -> bool:
    """Whether DPPO's mask hangs on rounding: ``p - q`` (tv) or the binary KL within ``tol`` of ``clip_low`` /
    ``clip_high`` (its sign-flipped bound for tv), or ``p`` within ``tol`` of ``q`` (the binary KL's exemptions)."""
    p, q = logp.exp(), old.exp()
    if config.policy_loss == "dppo_tv":
        gaps = [p - q - config.clip_high, p - q + config.clip_low]
    else:
        div = q * (old - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        gaps = [div - config.clip_high, div - config.clip_low, p - q]
    return any(bool((gap.abs() < tol).any()) for gap in gaps)
