"""The loss math against an independent scalar re-derivation, for every policy_loss x kl x agg."""

import itertools
import math
import zlib

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.config import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from helpers import DPPO_NEAR_ONE, EPILOGUE_TIES
from fused_rl.loss_math import (aggregation_weights, compute_policy_loss, dppo_keep, entropy_quantile_across,
                                kl_estimator, log_importance_ratio, per_token_loss, top_entropy_keep, vespo_weights)


def _kl(kind, d):
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1, "abs": abs(d),
            "low_var_kl": min(max(math.exp(d) - d - 1, -10), 10)}[kind]


def _sign(x):
    return (x > 0) - (x < 0)


def _rollout_weight(cfg, rho):
    """The rollout correction's factor of an importance weight ``rho``: truncated or masked to the bounds."""
    lo, hi = cfg.rollout_is_min, cfg.rollout_is_max
    if cfg.rollout_is.endswith("truncate"):
        return min(max(rho, -math.inf if lo is None else lo), math.inf if hi is None else hi)
    return rho if (lo is None or rho >= lo) and (hi is None or rho <= hi) else 0.0


def _cov_selected(frozen, old, adv, mask, cfg):
    """``cov_mode``'s tokens at the base point: kl_cov's ``n`` largest covariances; clip_cov's candidates (band, PPO
    clip inactive), which these tests keep no more than ``n`` of (then all are dropped: no random draw)."""
    valid = [(b, t) for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]
    a_mean = sum(adv[b][t] for b, t in valid) / max(len(valid), 1)
    lp_mean = sum(frozen[b][t] for b, t in valid) / max(len(valid), 1)
    cov = {(b, t): (adv[b][t] - a_mean) * (frozen[b][t] - lp_mean) for b, t in valid}
    n = max(math.floor(cfg.cov_ratio * len(valid)), 1)
    if cfg.cov_mode == "kl_cov":
        return set(sorted(valid, key=lambda bt: -cov[bt])[:n])
    candidates = set()
    for b, t in valid:
        r, A = math.exp(frozen[b][t] - old[b][t]), adv[b][t]
        clipped = -A * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) > -A * r
        if cfg.clip_cov_lb < cov[(b, t)] < cfg.clip_cov_ub and not clipped:
            candidates.add((b, t))
    assert len(candidates) <= n, "a random draw: give the test a larger cov_ratio"
    return candidates


def scalar_loss(logp, old, ref, ent, adv, mask, cfg, normalizer=None, frozen_logp=None, rollout=None,
                is_weights=None):
    """Plain-Python evaluation of the documented formulas (lists of lists, math module only).

    ``frozen_logp`` supplies the log-probs behind every stop-gradient (cispo's weight, gspo_token's
    sequence ratio, the "+" KL value, the off-policy mask) for finite differences; ``rollout`` the
    sampler's log-probs; ``is_weights`` the caller's importance weights of the policy term."""
    B, T = len(logp), len(logp[0])
    frozen = logp if frozen_logp is None else frozen_logp
    per = [[0.0] * T for _ in range(B)]
    valid_ent = sorted(ent[b][t] for b in range(B) for t in range(T) if mask[b][t])
    cov_selected = _cov_selected(frozen, old, adv, mask, cfg) if cfg.cov_mode is not None else set()
    if cfg.top_entropy_quantile < 1.0 and valid_ent:
        pos = (len(valid_ent) - 1) * (1.0 - cfg.top_entropy_quantile)
        lo, hi = math.floor(pos), math.ceil(pos)
        ent_threshold = valid_ent[lo] + (pos - lo) * (valid_ent[hi] - valid_ent[lo])
    for b in range(B):
        toks = [t for t in range(T) if mask[b][t]]
        n_b = max(len(toks), 1)
        seq_log_ratio = sum(logp[b][t] - old[b][t] for t in toks) / n_b
        frozen_seq = sum(frozen[b][t] - old[b][t] for t in toks) / n_b
        if cfg.policy_loss == "gmpo":
            xs = []
            for t in toks:
                x, s = logp[b][t] - old[b][t], _sign(adv[b][t])
                xs.append(s * min(s * x, s * min(max(x, -cfg.clip_low), cfg.clip_high)))
            geo = math.exp(sum(xs) / n_b)
        if cfg.rollout_is is not None:
            seq_rho = math.exp(sum(old[b][t] - rollout[b][t] for t in toks))
        if cfg.policy_loss == "vespo":  # the sequence weight's log w, held at the base point
            log_w = sum(min(max(frozen[b][t] - old[b][t], -20.0), 20.0) for t in toks)
            if cfg.rollout_is is not None:
                log_w += sum(min(max(math.log(_rollout_weight(cfg, math.exp(old[b][t] - rollout[b][t])) or 1e-300),
                                     math.log(1e-8)), 20.0) for t in toks)
            log_w = min(max(log_w, math.log(1e-8)), 20.0)
        if cfg.off_policy_mask is not None:
            behaviour = rollout if rollout is not None else old
            seq_kl = sum(behaviour[b][t] - frozen[b][t] for t in toks) / n_b
        for t in toks:
            A = adv[b][t]
            if cfg.policy_loss in ("gspo", "gmpo"):
                r = math.exp(seq_log_ratio)
            elif cfg.policy_loss == "gspo_token":
                r = math.exp(frozen_seq + logp[b][t] - frozen[b][t])
            else:
                r = math.exp(logp[b][t] - old[b][t])
            if cfg.policy_loss in ("ppo_clip", "gspo", "gspo_token"):
                clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
                unclipped = r if cfg.delta is None else min(r, cfg.delta)
                l = max(-A * unclipped, -A * clipped)
                if cfg.dual_clip is not None and A < 0:
                    l = min(l, -cfg.dual_clip * A)
            elif cfg.policy_loss == "gmpo":
                l = -A * geo
            elif cfg.policy_loss == "sapo":
                tau = cfg.sapo_temperature_pos if A > 0 else cfg.sapo_temperature_neg
                l = -A * 4 / tau / (1 + math.exp(-tau * (r - 1)))
            elif cfg.policy_loss == "cispo":
                rf = math.exp(frozen[b][t] - old[b][t])
                l = -min(rf, 1 + cfg.clip_high) * A * logp[b][t]
            elif cfg.policy_loss == "vespo":
                k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if A >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
                l = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * A * logp[b][t]
            elif cfg.policy_loss in ("dppo_tv", "dppo_kl"):  # weight and trust-region mask at the base point
                rf = math.exp(frozen[b][t] - old[b][t])
                p, q = math.exp(frozen[b][t]), math.exp(old[b][t])
                if cfg.policy_loss == "dppo_tv":
                    keep = p - q <= cfg.clip_high if A > 0 else p - q >= -cfg.clip_low
                else:
                    arg = (1 - q + 1e-8) / (1 - p + 1e-8)  # < 0 for an old log-prob > 0: NaN, as torch.log
                    div = q * (old[b][t] - frozen[b][t]) + (1 - q) * (math.log(arg) if arg > 0 else math.nan)
                    keep = (div <= cfg.clip_high or p <= q) if A > 0 else (div <= cfg.clip_low or p >= q)
                l = -(rf if cfg.delta is None else min(rf, cfg.delta)) * A * logp[b][t] if keep else 0.0
            else:
                l = -A * logp[b][t]
            if (b, t) in cov_selected:  # kl_cov: + coef |logp - old| (in the policy term); clip_cov: dropped
                l = l + cfg.kl_cov_coef * abs(logp[b][t] - old[b][t]) if cfg.cov_mode == "kl_cov" else 0.0
            if cfg.off_policy_mask is not None and A < 0 and seq_kl > cfg.off_policy_mask:
                l = 0.0
            if cfg.top_entropy_quantile < 1.0 and ent[b][t] < ent_threshold:
                l = 0.0
            if cfg.rollout_is is not None and cfg.policy_loss != "vespo":  # vespo's is in log_w
                rho = seq_rho if cfg.rollout_is.startswith("sequence") else math.exp(old[b][t] - rollout[b][t])
                l *= _rollout_weight(cfg, rho)
            if is_weights is not None:
                l *= is_weights[b][t]
            if cfg.kl is not None and cfg.beta:
                d = ref[b][t] - logp[b][t]
                if cfg.kl.endswith("+"):  # value of X, gradient of k2
                    df = ref[b][t] - frozen[b][t]
                    kl = _kl("k2", d) + _kl(cfg.kl[:-1], df) - _kl("k2", df)
                else:
                    kl = _kl(cfg.kl, d)
                l += cfg.beta * kl * (r if cfg.kl_bias_correction else 1.0)
            l -= cfg.entropy_coef * ent[b][t]
            per[b][t] = l
    total = sum(map(sum, per))
    n = sum(map(sum, mask))
    if cfg.agg == "token-mean":
        return total / (normalizer if normalizer is not None else max(n, 1))
    if cfg.agg == "seq-mean-token-mean":
        return sum(sum(per[b]) / max(sum(mask[b]), 1) for b in range(B)) / B
    if cfg.agg == "seq-mean-token-sum":
        return total / B
    return total / (B * (cfg.max_len or T))


def _inputs(seed, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # an all-masked row
    mask[1] = torch.tensor([True] + [False] * (T - 1))  # a length-1 response
    return logp, old, ref, ent, adv, mask


def _check_against_scalar(cfg, seed, rollout_spread=0.5, is_weights=None):
    """Loss equal to the scalar derivation (1e-12) and gradients equal to its central differences,
    with every stop-gradient input held at the base point."""
    logp, old, ref, ent, adv, mask = _inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    rollout = old + rollout_spread * torch.randn(old.shape, generator=g, dtype=torch.float64)
    kwargs = dict(old_logprobs=old, ref_logprobs=ref, entropy=ent)
    if cfg.uses_rollout_logprobs:
        kwargs["rollout_logprobs"] = rollout
    if is_weights is not None:
        kwargs["rollout_is_weights"] = is_weights
    x = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(x, adv, mask, cfg, **kwargs)
    args = (old.tolist(), ref.tolist(), ent.tolist(), adv.tolist(), mask.tolist(), cfg)
    extra = dict(rollout=rollout.tolist() if cfg.uses_rollout_logprobs else None,
                 is_weights=None if is_weights is None else is_weights.tolist())
    assert loss.item() == pytest.approx(scalar_loss(logp.tolist(), *args, **extra), rel=1e-12, abs=1e-14)
    loss.backward()
    base, h = logp.tolist(), 1e-6
    for b, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        plus = [row[:] for row in base]
        minus = [row[:] for row in base]
        plus[b][t] += h
        minus[b][t] -= h
        numeric = (scalar_loss(plus, *args, frozen_logp=base, **extra)
                   - scalar_loss(minus, *args, frozen_logp=base, **extra)) / (2 * h)
        assert x.grad[b, t].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8), (b, t)
    return metrics


COMBOS = list(itertools.product(POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS))


@pytest.mark.parametrize("policy, kl, agg", COMBOS, ids=["-".join(map(str, c)) for c in COMBOS])
def test_every_combination_matches_scalar_derivation(policy, kl, agg):
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.1 if kl else 0.0, agg=agg, clip_low=0.15,
                           clip_high=0.25, entropy_coef=0.01,
                           dual_clip=2.0 if policy in ("ppo_clip", "gspo", "gspo_token") else None,
                           max_len=7 if agg == "seq-mean-token-sum-norm" else None)
    _check_against_scalar(cfg, seed=zlib.crc32(f"{policy}-{kl}-{agg}".encode()) % 1000)


#: Every option of #10, alone and combined (each formula and its source in PolicyLossConfig).
VARIANTS = {
    "gspo_token": PolicyLossConfig(policy_loss="gspo_token", clip_low=0.1, clip_high=0.15),
    "gspo_token_dual_delta": PolicyLossConfig(policy_loss="gspo_token", dual_clip=2.0, delta=1.6),
    "gmpo": PolicyLossConfig.preset("gmpo"),
    "gmpo_tight": PolicyLossConfig(policy_loss="gmpo", clip_low=0.1, clip_high=0.05, kl="k3", beta=0.1,
                                   kl_bias_correction=True),
    "sapo": PolicyLossConfig.preset("sapo"),
    "sapo_temps": PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=3.0, sapo_temperature_neg=0.5,
                                   kl="k1", beta=0.2),
    "delta": PolicyLossConfig(clip_high=0.28, delta=1.5),
    "delta_gspo": PolicyLossConfig(policy_loss="gspo", delta=1.3, agg="seq-mean-token-mean"),
    "k1+": PolicyLossConfig(kl="k1+", beta=0.3),
    "k3+": PolicyLossConfig(kl="k3+", beta=0.3, kl_bias_correction=True),
    "abs+": PolicyLossConfig(policy_loss="reinforce", kl="abs+", beta=0.2),
    "low_var_kl+": PolicyLossConfig(policy_loss="cispo", kl="low_var_kl+", beta=0.2),
    "tis_token": PolicyLossConfig(rollout_is="token_truncate", rollout_is_max=1.3),
    "tis_token_min": PolicyLossConfig(rollout_is="token_truncate", rollout_is_min=0.8, rollout_is_max=1.2,
                                      kl="k3", beta=0.1),
    "mis_token": PolicyLossConfig(rollout_is="token_mask", rollout_is_max=1.4),
    "tis_seq": PolicyLossConfig(rollout_is="sequence_truncate", rollout_is_max=2.0, agg="seq-mean-token-mean"),
    "mis_seq": PolicyLossConfig(rollout_is="sequence_mask", rollout_is_min=0.2, rollout_is_max=3.0),
    "off_policy_mask": PolicyLossConfig(off_policy_mask=0.05),
    "off_policy_mask_rollout": PolicyLossConfig(off_policy_mask=0.0, rollout_is="token_truncate"),
    "top_entropy": PolicyLossConfig(top_entropy_quantile=0.4),
    "top_entropy_0": PolicyLossConfig(top_entropy_quantile=0.0, entropy_coef=0.01, agg="seq-mean-token-sum"),
    "all": PolicyLossConfig(policy_loss="sapo", kl="k3+", beta=0.1, rollout_is="sequence_mask",
                            rollout_is_max=2.5, off_policy_mask=0.1, top_entropy_quantile=0.6, entropy_coef=0.02,
                            agg="seq-mean-token-sum-norm", max_len=8),
    "luspo": PolicyLossConfig.preset("luspo", clip_low=0.1, clip_high=0.1, kl="k3", beta=0.1),
    "vespo": PolicyLossConfig.preset("vespo", kl="k3", beta=0.1, kl_bias_correction=True),
    "vespo_tis": PolicyLossConfig(policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                                  vespo_lambda_neg=1.0, rollout_is="token_truncate", rollout_is_min=0.8,
                                  rollout_is_max=1.2, off_policy_mask=0.05, agg="seq-mean-token-mean"),
    # names of 15 characters: seed 108, whose six tokens these bounds drop on both sides of A (and dppo_kl keeps a
    # token with A < 0 beyond its bound, p >= q)
    "dppo_tv_bounded": PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.1, clip_high=0.02, delta=1.3, kl="k3",
                                        beta=0.1),
    "dppo_kl_rollout": PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.1, clip_high=0.005,
                                        rollout_is="token_truncate", rollout_is_max=1.6, kl="low_var_kl+", beta=0.1,
                                        kl_bias_correction=True, agg="seq-mean-token-mean"),
    # kl_cov (12 characters: seed 87, five tokens whose covariances -0.21, -0.04, 0.09, 0.29, 1.17 are well apart): the
    # top two; clip_cov (13: seed 94, covariances -1.37, -0.6, -0.12, -0.11, -0.06, 2.37): the band's three, all drawn
    "kl_cov_top_2": PolicyLossConfig(cov_mode="kl_cov", cov_ratio=0.45, kl_cov_coef=0.5, kl="k2", beta=0.1,
                                     rollout_is="token_truncate", rollout_is_max=1.5),
    "clip_cov_band": PolicyLossConfig(cov_mode="clip_cov", cov_ratio=0.5, clip_cov_lb=-0.2, clip_cov_ub=1.0,
                                      clip_high=0.1, entropy_coef=0.01, agg="seq-mean-token-mean"),
    # masked tokens have weight 0, log 0 = -inf clamped to log 1e-8: phi ~ 0 on their sequences
    "vespo_mis": PolicyLossConfig(policy_loss="vespo", rollout_is="token_mask", rollout_is_max=1.4,
                                  top_entropy_quantile=0.6, entropy_coef=0.01),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_scalar_derivation(name):
    metrics = _check_against_scalar(VARIANTS[name], seed=len(name) * 7 + 3)
    assert all(torch.isfinite(v) for v in metrics.values())
    if name.startswith("dppo"):  # the trust region drops tokens with A > 0 and with A < 0
        assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0
    if name.startswith(("kl_cov", "clip_cov")):  # two of five tokens; the band's three of six minus the clipped
        assert metrics["cov_frac"] > 0


@pytest.mark.parametrize("name", ["sapo_temps", "delta", "gmpo_tight", "k3+", "mis_token", "all",
                                  "dppo_tv_bounded"])
def test_rollout_is_weights_match_scalar_derivation(name):
    """Caller-computed importance weights (with zeros) multiply the policy term only."""
    w = 2.0 * torch.rand(3, 5, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    w[:, 1] = 0.0
    _check_against_scalar(VARIANTS[name], seed=len(name) * 5 + 1, is_weights=w)


@pytest.mark.parametrize("name, on_policy", [("tis_token", False), ("mis_seq", False), ("tis_seq", True),
                                              ("off_policy_mask", False), ("off_policy_mask_rollout", True),
                                              ("all", True), ("vespo_tis", False)])
def test_an_unscored_rollout_token_has_log_ratio_zero(name, on_policy):
    """A NaN rollout log-prob (a token the engine did not score: vLLM's ``None``) has log-ratio 0 in the rollout
    correction (``old - q``: no weight of its own, nothing added to its sequence's sum) and in the off-policy
    mask's KL (``q - sg(logp)``: adds 0, still counted), TRL's ``nan_to_num``: the loss, gradient and metrics of
    the ``q`` that gives it log-ratio 0 there, ``old`` (correction only) or ``sg(logp)`` (on-policy: both)."""
    cfg = VARIANTS[name]
    logp, old, ref, ent, adv, mask = _inputs(17, B=4, T=6)
    old = None if on_policy else old
    rollout = (old if old is not None else logp) + 0.5 * torch.randn(logp.shape, dtype=torch.float64,
                                                                      generator=torch.Generator().manual_seed(5))
    unscored = mask & (torch.arange(6) % 3 == 1)
    assert unscored.any() and (mask & ~unscored).any()
    same = logp if old is None or cfg.rollout_is is None else old
    results = []
    for q in (torch.where(unscored, float("nan"), rollout), torch.where(unscored, same, rollout)):
        x = logp.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(x, adv, mask, cfg, old_logprobs=old, ref_logprobs=ref, entropy=ent,
                                            rollout_logprobs=q)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    (loss, grad, metrics), (exp_loss, exp_grad, exp_metrics) = results
    torch.testing.assert_close(loss, exp_loss, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-12, atol=0.0)
    for key in exp_metrics:
        torch.testing.assert_close(metrics[key], exp_metrics[key], rtol=1e-12, atol=0.0, msg=key)


@pytest.mark.parametrize("lambda_neg", [0.5, 0.0, 3e-5])
@pytest.mark.parametrize("advantages", ["sequence", "token"])
@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
def test_vespo_weights_match_trl(advantages, mode, lambda_neg):
    """``loss_math.vespo_weights`` against TRL's own ``GRPOTrainer.get_gamma_weights`` (its static method), with
    TRL's vLLM ratio (``exp((old - sampling) m)`` truncated or masked) where a correction is configured, log-ratios
    large enough to reach both clamps of ``log w``, and k / lambda other than TRL's defaults (lambda below TRL's
    least rate 1e-4, which TRL and Liger use instead: 0 and 3e-5)."""
    trl = pytest.importorskip("trl")
    from fused_rl.loss_math import rollout_weights, vespo_weights

    logp, old, ref, ent, adv, mask = _inputs(23, B=6, T=7)
    old = old.clone()
    old[2] -= 9.0  # sum of log r ~ 60: log w clamped at 20
    old[3] += 6.0  # ~ -40: clamped at log 1e-8
    adv = adv[:, :1].expand_as(adv) if advantages == "sequence" else adv
    adv = adv.clone()
    adv[4] = 0.0  # A = 0 takes the A >= 0 parameters
    cfg = PolicyLossConfig(policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5,
                           vespo_lambda_neg=lambda_neg, rollout_is=mode, rollout_is_min=0.8 if mode else None,
                           rollout_is_max=1.25)
    sampling = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    m = mask.to(torch.float64)
    trl_ratio = rollout_w = None
    if mode is not None:
        trl_ratio = torch.exp((old - sampling) * m)
        if mode == "token_truncate":
            trl_ratio = trl_ratio.clamp(min=0.8, max=1.25)
        else:
            trl_ratio = trl_ratio.masked_fill((trl_ratio < 0.8) | (trl_ratio > 1.25), 0.0)
        rollout_w = rollout_weights(old, sampling, mask, cfg)[1]
    expected = trl.GRPOTrainer.get_gamma_weights(
        advantages=adv[:, :1] if advantages == "sequence" else adv, log_ratio_per_token=logp - old, mask=m,
        importance_sampling_ratio=trl_ratio, k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=lambda_neg)
    got = vespo_weights(torch.where(mask, logp - old, 0.0), adv, mask, cfg, rollout_w)
    # TRL forms lambda with torch.where of Python floats: in fp32, where 1e-4 is 1e-4 (1 - 2.5e-8)
    rtol = 1e-12 if lambda_neg == 0.5 else 1e-10
    torch.testing.assert_close(got, expected.expand_as(got), rtol=rtol, atol=1e-300)
    seq_log_w = torch.where(mask, logp - old, 0.0).sum(1)
    assert seq_log_w[2] > 20 and seq_log_w[3] < math.log(1e-8)  # both clamps reached
    assert ((got > 0.05) & mask).any() and got[mask].std() > 0.1  # and the weights non-trivial


def test_variant_metrics_count_what_they_say():
    logp, old, ref, ent, adv, mask = _inputs(3)
    rollout = old + 0.7 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    cfg = PolicyLossConfig(rollout_is="token_mask", rollout_is_max=1.5, off_policy_mask=0.0,
                           top_entropy_quantile=0.5)
    _, m = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=old, entropy=ent, rollout_logprobs=rollout)
    n = mask.sum()
    rho = torch.exp(old - rollout)
    assert m["rollout_is_clip_frac"].item() == pytest.approx(((rho > 1.5) & mask).sum().item() / n.item())
    assert m["rollout_is_mean"].item() == pytest.approx((torch.where(rho <= 1.5, rho, 0.0)[mask]).mean().item())
    seq_kl = (torch.where(mask, rollout - logp, 0.0).sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)
    dropped = mask & (adv < 0) & (seq_kl > 0.0)
    assert m["off_policy_mask_frac"].item() == pytest.approx(dropped.sum().item() / n.item())
    assert m["entropy_mask_frac"].item() == pytest.approx(
        (mask & (ent < torch.quantile(ent[mask], 0.5))).sum().item() / n.item())


def test_top_entropy_keep_matches_torch_quantile():
    g = torch.Generator().manual_seed(0)
    for rho in (0.0, 0.2, 0.5, 0.77, 1.0):
        ent = torch.rand(6, 9, generator=g) * 5
        mask = torch.rand(6, 9, generator=g) > 0.3
        expected = mask & (ent >= torch.quantile(ent[mask], 1 - rho))
        assert torch.equal(top_entropy_keep(ent, mask, rho), expected)
    assert not top_entropy_keep(ent, torch.zeros_like(mask), 0.5).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_entropy_keep_of_half_precision_entropies(dtype):
    """bf16 / fp16 entropies get TRL's threshold, ``torch.quantile(H.float(), 1 - rho)``: in their own dtype the
    position ``(n - 1) (1 - rho)`` was rounded (bf16: to 16 at n ~ 3000) and the threshold with it."""
    g = torch.Generator().manual_seed(4)
    ent = (torch.randn(3, 1100, generator=g) * 2).exp().to(dtype)
    mask = torch.rand(3, 1100, generator=g) > 0.1
    for rho in (0.2, 0.37, 0.5, 0.91):
        expected = mask & (ent.float() >= torch.quantile(ent.float()[mask], 1 - rho))
        assert torch.equal(top_entropy_keep(ent, mask, rho), expected), rho


def test_top_entropy_keep_interpolates_in_fp32_as_trl():
    """An fp32 threshold interpolated between 1 and the next float at 0.2 of the way rounds to 1 (position 4 * 0.3 =
    1.2), as in TRL's ``torch.quantile`` of fp32 entropies: the token at 1.0 is kept (an exact, e.g. float64,
    threshold lies above 1 and drops it)."""
    up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    ent = torch.tensor([[0.0, 1.0, up, 2.0, 3.0]])
    mask = torch.ones_like(ent, dtype=torch.bool)
    assert top_entropy_keep(ent, mask, 0.7).tolist() == [[False, True, True, True, True]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_entropy_keep_across_one_process_is_the_local_keep(dtype):
    """An identity gather (one process) gives the local mask exactly, fp64 included (the gathered entropies
    were rounded to fp32, which moved the threshold across fp64 values that close)."""
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        h = (torch.rand(6, 9, generator=g, dtype=torch.float64) * 1e-7 + 1.0).to(dtype)
        mask = torch.rand(6, 9, generator=g) > 0.3
        local = top_entropy_keep(h, mask, 0.4)
        with entropy_quantile_across(lambda x: x):
            assert torch.equal(top_entropy_keep(h, mask, 0.4), local)


def test_on_policy_rollout_weight_uses_detached_logp():
    """on-policy (old=None) the rollout weight is exp(sg(logp) - rollout): no gradient through it."""
    logp, _, _, _, adv, mask = _inputs(5)
    rollout = logp - 0.3
    cfg = PolicyLossConfig(policy_loss="reinforce", rollout_is="token_truncate", rollout_is_max=10.0)
    x = logp.clone().requires_grad_(True)
    compute_policy_loss(x, adv, mask, cfg, rollout_logprobs=rollout)[0].backward()
    w = torch.exp(torch.tensor(0.3, dtype=torch.float64))
    expected = torch.where(mask, -adv * w / mask.sum(), 0.0)
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo", "gspo_token", "cispo"])
def test_kl_bias_correction_matches_scalar_derivation(policy):
    _check_against_scalar(PolicyLossConfig(policy_loss=policy, kl="k3", beta=0.3, kl_bias_correction=True), seed=21)


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo_token", "cispo"])
@pytest.mark.parametrize("kl", ["abs+", "k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_bias_correction_gradient_is_exact_in_fp32(policy, kl):
    """``d (r X+) / d logp = r (X - d)`` (k2's slope ``-d`` carried by X's value) in fp32 at ratios up to
    ``e^20``: autograd of the product added ``r X`` and ``-r d`` apart, so abs+'s exact 0 at ``d > 0`` came out
    ``ulp(r |d|)`` (a 3.2 relative error of the hidden-state gradient at ``r = e^20``, cispo + abs+)."""
    d = torch.tensor([[0.0, 1e-3, -0.5, 0.5, 3.0, -3.0, 8.0, 12.0, -12.0, 16.0, 20.0]], dtype=torch.float64)
    logp64 = -torch.linspace(25.0, 0.5, d.shape[1], dtype=torch.float64).view(1, -1)
    gap = torch.linspace(-3.0, 20.0, d.shape[1], dtype=torch.float64).view(1, -1)
    logp64, ref64, old64 = (t.float().double() for t in (logp64, logp64 + d, logp64 - gap))
    mask = torch.ones_like(d, dtype=torch.bool)
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.1, kl_bias_correction=True, agg="seq-mean-token-sum")
    x = logp64.float().requires_grad_(True)
    terms = per_token_loss(x, torch.zeros_like(x), mask, cfg, old_logprobs=old64.float(), ref_logprobs=ref64.float())
    (terms.loss / 3.0).sum().backward()  # beta and an aggregation weight: autograd's two terms round apart
    r = torch.exp(logp64 - old64)
    if policy == "gspo_token":  # sg(sequence ratio) times the token's own ratio, 1 in value
        r = torch.exp((logp64 - old64).sum() / mask.sum()).expand_as(r)
    # X and d as fp32 forms them (k3 at small d: ulp(d)); abs+'s exact 0 at d > 0 needs X - d of the same d;
    # gspo_token's parts are formed in fp64 (a sequence ratio's log s + d)
    work = torch.float64 if policy == "gspo_token" else torch.float32
    value = kl_estimator(logp64.to(work), ref64.to(work), kl[:-1]).double()
    d = (ref64.to(work) - logp64.to(work)).double()
    torch.testing.assert_close(terms.loss.detach().double(), 0.1 * r * value, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(x.grad.double(), 0.1 / 3.0 * r * (value - d), rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("kl", ["abs+", "k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_where_k2_overflows(kl):
    """``"X+"`` at a gap ``|d|`` whose square overflows fp32 (``d^2 / 2 = inf`` beyond ~2.6e19; ``2 d`` beyond
    ~1.7e38) and at an infinite one (a ``-inf`` log-prob): X's value (``k2 + sg(X - k2)`` was ``inf - inf = NaN``),
    and where ``d`` is finite k2's first and second derivatives, ``-d`` and 1."""
    d = torch.tensor([1e20, -1e20, 3e19, 3e38, -3e38, float("inf"), 0.5])
    logp = torch.full_like(d, -2.0).requires_grad_(True)
    ref = logp.detach() + d
    value = kl_estimator(logp, ref, kl)
    (grad,) = torch.autograd.grad(value.sum(), logp, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), logp)
    finite = torch.isfinite(d)
    torch.testing.assert_close(value.detach(), kl_estimator(logp.detach(), ref, kl[:-1]), equal_nan=True)
    assert not value[finite].isnan().any()
    torch.testing.assert_close(grad[finite].detach(), -d[finite].float())
    torch.testing.assert_close(second[finite], torch.ones(int(finite.sum())))


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo_token"])
def test_kl_bias_correction_gradient_is_exact_in_fp32(policy):
    """``d (r k3) / d logp = -r d`` in fp32 up to d = 40, where autograd of the plain product cancels two
    terms of size ``r exp(d)`` (-32 for the exact -20 at d = 20); the value and the ``ref`` and ``old``
    gradients against fp64 (near d = 0, to fp32's absolute error of ``expm1(d) - d`` and of autograd's
    ``exp(d) - 1``)."""
    d = torch.tensor([[0.0, 1e-4, -1e-3, 0.5, -7.0, 5.0, 15.0, 20.0, 30.0, 40.0, -30.0]])
    logp64 = -torch.linspace(0.1, 25.0, d.shape[1], dtype=torch.float64).view(1, -1)
    ref64, old64 = logp64 + d.double(), logp64 + torch.linspace(-0.7, 0.6, d.shape[1], dtype=torch.float64)
    logp64, ref64, old64 = (t.float().double() for t in (logp64, ref64, old64))  # the fp32 inputs, exactly
    d = ref64 - logp64
    mask = torch.ones_like(d, dtype=torch.bool)
    mask[0, -1] = False
    cfg = PolicyLossConfig(policy_loss=policy, kl="k3", beta=1.0, kl_bias_correction=True, agg="seq-mean-token-sum")
    results = []
    for dtype in (torch.float32, torch.float64):
        x, ref, old = (t.to(dtype).requires_grad_(True) for t in (logp64, ref64, old64))
        terms = per_token_loss(x, torch.zeros_like(x), mask, cfg, old_logprobs=old, ref_logprobs=ref)
        terms.loss.sum().backward()
        results.append([terms.loss.detach(), x.grad, ref.grad, old.grad])
    (got_loss, got_x, got_ref, got_old), (exp_loss, exp_x, exp_ref, exp_old) = results
    r = torch.exp(torch.where(mask, logp64 - old64, 0.0))
    if policy == "gspo_token":  # sg(sequence ratio) times the token's own ratio, 1 in value
        r = torch.exp((torch.where(mask, logp64 - old64, 0.0)).sum() / mask.sum()).expand_as(r)
    torch.testing.assert_close(exp_x, torch.where(mask, -r * d, 0.0), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(got_x, exp_x.float(), rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(got_loss, exp_loss.float(), rtol=2e-6, atol=1e-10)
    torch.testing.assert_close(got_ref, exp_ref.float(), rtol=2e-6, atol=5e-7)
    if policy == "gspo_token":  # old enters only under the stop-gradient
        assert got_old is None and exp_old is None
    else:
        torch.testing.assert_close(got_old, exp_old.float(), rtol=2e-6, atol=1e-10)


def _plain_ratio_times_kl(policy, kl, x, rf, od, mask):
    """``r kl`` as autograd of the plain product (exact in fp64 for gaps ``d`` below ~700), 0 where masked."""
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    seq = torch.where(mask, x - od, 0.0).sum(dim=1, keepdim=True) / n
    log_r = {"ppo_clip": x - od, "cispo": x - od, "gspo": seq.expand(x.shape), "gmpo": seq.expand(x.shape),
             "gspo_token": seq.detach() + x - x.detach()}[policy]
    d = rf - x
    k2 = 0.5 * d * d
    x_val = {"k1": -d, "k2": k2, "k3": torch.expm1(d) - d, "abs": d.abs(),
             "low_var_kl": (torch.expm1(d) - d).clamp(-10.0, 10.0)}[kl.rstrip("+")]
    value = x_val.detach() + k2 - k2.detach() if kl.endswith("+") else x_val
    return torch.where(mask, torch.exp(log_r) * value, 0.0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's own
@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k3+", "abs+", "low_var_kl+"])
@pytest.mark.parametrize("policy", ["ppo_clip", "gspo", "gspo_token", "gmpo"])
def test_kl_bias_correction_derivatives_of_every_order_match_the_plain_product(policy, kl):
    """``beta r kl_t`` (fp64, moderate ``d``: autograd of the plain product, written here, is exact enough) under
    per-token weights that differ within a row (``per_token_loss`` is a per-token function: its exact slope must
    not assume an aggregation), for ``logp``, ``ref`` and ``old``: the value, the first derivatives, a
    Hessian-vector product (double backward through the exact slope) and a forward-mode ``jvp``. The earlier
    ``sg(slope) (logp - sg(logp))`` form gave the row's whole slope to each token (gspo: 1.55 for 0.81, 0.13,
    0.13 under weights 1, 0, 0) and no second derivative (a Hessian-vector product 0.83 off for ppo_clip)."""
    from torch.func import jvp

    g = torch.Generator().manual_seed(5)
    shape = (3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 0.1
    ref = logp + torch.empty(shape, dtype=torch.float64).uniform_(-3.0, 3.0, generator=g)
    old = logp + torch.empty(shape, dtype=torch.float64).uniform_(-0.5, 0.5, generator=g)
    w = torch.rand(shape, generator=g, dtype=torch.float64) + 0.1
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.7, kl_bias_correction=True)
    zeros = torch.zeros(shape, dtype=torch.float64)

    def plain(x, rf, od):
        return 0.7 * _plain_ratio_times_kl(policy, kl, x, rf, od, mask)

    def fused(x, rf, od):
        return per_token_loss(x, zeros, mask, cfg, old_logprobs=od, ref_logprobs=rf).loss

    results = []
    for fn in (fused, plain):
        x, rf, od = (t.clone().requires_grad_(True) for t in (logp, ref, old))
        out = fn(x, rf, od)
        grads = torch.autograd.grad((out * w).sum(), (x, rf, od), create_graph=True, allow_unused=True)
        grads = [zeros if gr is None else gr for gr in grads]
        v = torch.linspace(-1.0, 1.0, logp.numel(), dtype=torch.float64).view(shape)
        hvp = torch.autograd.grad((grads[0] * v).sum(), (x, rf), allow_unused=True)
        tangents = (v, v.flip(0), v.flip(1))
        _, forward = jvp(lambda *a: fn(*a), (logp, ref, old), tangents)
        results.append([out.detach(), *[gr.detach() for gr in grads], *[zeros if h is None else h for h in hvp],
                        forward])
    names = ["value", "d/dlogp", "d/dref", "d/dold", "hvp logp", "hvp ref", "jvp"]
    for name, got, want in zip(names, *results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


ALL_KL = ["k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k3+", "abs+", "low_var_kl+"]


def _mp_ratio_times_kl(policy, kl, lp, ref, old, mask, w):
    """``(r kl, d (sum w r kl) / d logp, / d ref, / d old)`` at 60 digits (mpmath, central differences of the plain
    product; ``"X+"`` as ``X(d_0) + k2(d) - k2(d_0)``, gspo_token's ratio ``s_0 exp(logp - logp_0)`` with ``old``
    under the stop-gradient), for float64 ``(B, T)`` inputs: exact where fp64 autograd of the product cancels."""
    import mpmath

    mp = mpmath.mp
    mp.dps = 60
    base = kl.rstrip("+")
    shape = lp.shape
    lp, ref, old, mask, w = (x.tolist() for x in (lp, ref, old, mask, w))

    def estimator(d):
        k3 = mpmath.expm1(d) - d
        return {"k1": -d, "k2": d * d / 2, "k3": k3, "abs": abs(d),
                "low_var_kl": max(min(mpmath.expm1(max(min(d, 20), -20)) - max(min(d, 20), -20), 10), -10)}[base]

    def terms(row, lps, refs, olds):
        valid = [t for t in range(len(lps)) if mask[row][t]]
        log_s = mpmath.fsum(lps[t] - olds[t] for t in valid) / max(len(valid), 1)
        log_s0 = mpmath.fsum(mpmath.mpf(lp[row][t]) - mpmath.mpf(old[row][t]) for t in valid) / max(len(valid), 1)
        out = []
        for t in range(len(lps)):
            if not mask[row][t]:
                out.append(mpmath.mpf(0))
                continue
            d, d0 = refs[t] - lps[t], mpmath.mpf(ref[row][t]) - mpmath.mpf(lp[row][t])
            x = estimator(d0) + d * d / 2 - d0 * d0 / 2 if kl.endswith("+") else estimator(d)
            log_r = {"gspo": log_s, "gmpo": log_s, "gspo_token": log_s0 + lps[t] - mpmath.mpf(lp[row][t])}.get(
                policy, lps[t] - olds[t])
            out.append(mpmath.exp(log_r) * x)
        return out

    values = torch.zeros(shape, dtype=torch.float64)
    grads = [torch.zeros(shape, dtype=torch.float64) for _ in range(3)]
    for row in range(shape[0]):
        point = [[mpmath.mpf(v) for v in x[row]] for x in (lp, ref, old)]
        for t, v in enumerate(terms(row, *point)):
            values[row, t] = float(v)
        for which in range(3):
            for t in range(shape[1]):
                def f(h):
                    moved = [list(p) for p in point]
                    moved[which][t] += h
                    return mpmath.fsum(mpmath.mpf(w[row][u]) * v for u, v in enumerate(terms(row, *moved)))
                grads[which][row, t] = float(mpmath.diff(f, 0))
    if policy == "gspo_token":
        grads[2].zero_()
    return values, grads


@pytest.mark.parametrize("kl", ALL_KL)
@pytest.mark.parametrize("policy", ["ppo_clip", "cispo", "gspo", "gspo_token", "gmpo"])
def test_kl_bias_correction_far_off_policy_is_finite_where_the_product_is(policy, kl):
    """``r kl`` in fp32 where the new log-prob is far below the old and reference ones (``d = 95``: fp32's
    ``exp(d)`` overflows, ``r = e^-80``; k3's product is ``e^15``), and around the switch at ``d = 20``: the value and
    the ``logp``, ``ref`` and ``old`` gradients against the plain product at 60 digits, and a finite second
    derivative. The fp32 product was ``inf`` (the value and the ``ref`` gradient) for k3 and k3+."""
    lp = torch.tensor([[-100.0, -1.0, -2.0, -0.5], [-30.0, -40.0, -3.0, -1.0], [-25.0, -24.9, -25.1, -2.0]])
    ref = torch.tensor([[-5.0, -1.2, -2.5, -0.1], [-10.05, -19.95, -3.1, -1.3], [-5.0, -5.0, -5.0, -2.0]])
    old = torch.tensor([[-20.0, -1.1, -2.2, -0.4], [-29.0, -38.5, -3.2, -1.1], [-24.0, -24.5, -25.0, -2.1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    w = torch.tensor([[0.5, 1.0, 2.0, 1.0], [1.0, 0.3, 1.0, 1.0], [1.0, 2.0, 0.7, 1.0]])
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=1.0, kl_bias_correction=True)
    x, rf, od = (t.clone().requires_grad_(True) for t in (lp, ref, old))
    got = per_token_loss(x, torch.zeros_like(x), mask, cfg, old_logprobs=od, ref_logprobs=rf).kl
    grads = torch.autograd.grad((got * w).sum(), (x, rf, od), allow_unused=True, create_graph=True)
    grads = [torch.zeros_like(lp) if g is None else g for g in grads]
    second = torch.autograd.grad(grads[0].sum(), (x, rf), allow_unused=True)  # a Hessian-vector product
    want, want_grads = _mp_ratio_times_kl(policy, kl, lp.double(), ref.double(), old.double(), mask, w.double())
    assert got.isfinite().all() and all(g.isfinite().all() for g in [*grads, *second] if g is not None)
    got, grads = got.detach(), [g.detach() for g in grads]
    for name, g, wt in zip(["value", "d/dlogp", "d/dref", "d/dold"], [got, *grads], [want, *want_grads]):
        # relative to each element; the second bound for an exact 0 (abs+ at d > 0) or a term below fp32's range
        torch.testing.assert_close(g.double(), wt, rtol=1e-5, atol=1e-38, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kl", ALL_KL)
@pytest.mark.parametrize("policy", ["ppo_clip", "cispo", "gspo_token"])
def test_kl_bias_correction_at_a_neg_inf_logprob_is_its_limit(policy, kl):
    """Off-policy, a sampled token whose log-prob is ``-inf`` (``r = 0``, ``d = inf``) has ``r kl`` at its limit:
    ``exp(ref - old)`` for k3 and k3+ (``r exp(d)``), 0 for the other estimators (``r`` falls faster than their
    terms grow); the gradients the limits of theirs: ``logp`` ``r (kl + K')``, k3's ``-r d`` 0, k3+'s ``r (k3 - d)``
    ``exp(ref - old)``; ``ref`` ``-r K'``, k3's ``r expm1(d)`` ``exp(ref - old)``; ``old`` minus the value. It was
    ``0 * inf = NaN``. gspo_token's value is the sequence ratio ``s``: ``s exp(d)`` at a ``-inf`` token is
    ``exp(-inf + inf)``, NaN (its limit is ``+inf`` in a row of two tokens or more)."""
    lp = torch.tensor([[float("-inf"), -1.0], [float("-inf"), -2.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    ref = torch.tensor([[-2.0, -1.5], [-3.0, -2.0]])
    old = torch.tensor([[-2.5, -0.8], [-1.0, -2.2]])
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=1.0, kl_bias_correction=True)
    x, rf, od = (t.clone().requires_grad_(True) for t in (lp, ref, old))
    kl_t = per_token_loss(x, torch.zeros_like(x), mask, cfg, old_logprobs=od, ref_logprobs=rf).kl
    k3 = kl.rstrip("+") == "k3"
    limit = (torch.exp(ref - old) if k3 else torch.zeros_like(ref))[:, 0]
    if policy == "gspo_token":  # row 0: s = 0 times the finite term of token 1
        assert (kl_t[:, 0].isnan() == k3).all() and kl_t[0, 1] == 0
        if k3:
            return
    else:
        finite = _mp_ratio_times_kl(policy, kl, lp[:1, 1:].double(), ref[:1, 1:].double(), old[:1, 1:].double(),
                                    mask[:1, 1:], torch.ones(1, 1, dtype=torch.float64))[0]
        torch.testing.assert_close(kl_t[0, 1], finite[0, 0].float())
    torch.testing.assert_close(kl_t[:, 0], limit)
    gx, gref, gold = torch.autograd.grad(kl_t.sum(), (x, rf, od), allow_unused=True)
    zero = torch.zeros_like(limit)
    torch.testing.assert_close(gx[:, 0], limit if kl == "k3+" else zero)
    torch.testing.assert_close(gref[:, 0], limit if kl == "k3" else zero)
    if policy != "gspo_token":  # gspo_token's old is under the stop-gradient
        torch.testing.assert_close(gold[:, 0], -limit)


@pytest.mark.parametrize("kl, d, value, grads", [
    ("k3", 25.0, float("inf"), (-float("inf"), float("inf"), 0.0)),
    ("k3+", 25.0, float("inf"), (-float("inf"), float("inf"), 0.0)),
    ("k1", 0.5, -float("inf"), (float("inf"), -float("inf"), 0.0)),
    ("low_var_kl", 25.0, float("inf"), (0.0, 0.0, 0.0)),
    ("abs", 0.0, 0.0, (0.0, 0.0, 0.0)),
])
def test_kl_bias_correction_with_an_overflowed_ratio(kl, d, value, grads):
    """An old log-prob far below the new one (an inference engine's -9999) overflows ``r`` to inf: ``r kl`` is
    ``+-inf`` (0 for a zero term) and ``r``, a constant there as in ``ratio_exp``, carries no derivative of its own:
    ``d/dlogp = r K'`` (0 for a zero slope: low_var_kl outside its clamps, abs at ``d = 0``), ``d/dold = 0``. The far
    form of k3 (``exp(log r + d) - r - r d``) was ``inf - inf = NaN`` there."""
    lp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-100.0 + d, -1.5]], requires_grad=True)
    old = torch.tensor([[-9999.0, -1.2]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = PolicyLossConfig(kl=kl, beta=1.0, kl_bias_correction=True)
    kl_t = per_token_loss(lp, torch.zeros_like(lp), mask, cfg, old_logprobs=old, ref_logprobs=ref).kl
    got = torch.autograd.grad(kl_t.sum(), (lp, ref, old))
    assert kl_t[0, 0] == value and kl_t[0, 1].isfinite()
    assert [float(g[0, 0]) for g in got] == list(grads)
    assert all(g[0, 1].isfinite() for g in got)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's own
@pytest.mark.parametrize("kl", ["k1", "k3", "k3+", "low_var_kl"])
@pytest.mark.parametrize("policy", ["ppo_clip", "sapo", "gspo", "gspo_token", "gmpo"])
def test_an_overflowed_ratio_does_not_reach_other_rows(policy, kl):
    """A row whose ratio overflows (``old = -9999``) has infinite parts; a zero upstream gradient or tangent there
    (another row's loss; a direction along another row) adds 0 to it, not ``0 * inf = NaN``: the other row's
    gradient and forward-mode derivative are those of the same row alone."""
    from torch.func import jvp

    lp = torch.tensor([[-100.0, -3.0], [-1.0, -2.0]])
    ref = torch.tensor([[-99.0, -2.5], [-1.5, -1.0]])
    old = torch.tensor([[-9999.0, -3.1], [-1.2, -2.2]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.1, kl_bias_correction=True)
    adv = torch.tensor([[0.8, 0.8], [-0.5, -0.5]])

    def loss(rows, x, rf, od):
        return per_token_loss(x, adv[rows], mask[rows], cfg, old_logprobs=od, ref_logprobs=rf).loss

    both_rows, row_1 = slice(0, 2), slice(1, 2)
    tangents = tuple(torch.tensor([[0.0, 0.0], [1.0, -0.5]]) * k for k in (1.0, 0.3, -0.7))
    _, both = jvp(lambda *a: loss(both_rows, *a), (lp, ref, old), tangents)
    _, alone = jvp(lambda *a: loss(row_1, *a), tuple(t[row_1] for t in (lp, ref, old)),
                   tuple(t[row_1] for t in tangents))
    assert (both[0] == 0).all()
    torch.testing.assert_close(both[row_1], alone)
    grads, grads_alone = [], []
    for rows, out in ((both_rows, grads), (row_1, grads_alone)):
        inputs = [t[rows].clone().requires_grad_(True) for t in (lp, ref, old)]
        out += torch.autograd.grad(loss(rows, *inputs)[-1].sum(), inputs, allow_unused=True)
    for g, g1 in zip(grads, grads_alone):
        assert (g is None) == (g1 is None)
        if g is not None:
            assert (g[0] == 0).all()
            torch.testing.assert_close(g[row_1], g1)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl", ["k3", "k3+", "abs+"])
@pytest.mark.parametrize("policy", ["gspo", "gmpo"])
def test_sequence_ratio_kl_bias_correction_gradient_matches_fp64(policy, kl, agg):
    """gspo / gmpo: ``beta s kl_t`` with the sequence ratio ``s``, against fp64 autograd of that plain product
    (written here, independent of :func:`bias_corrected_kl`). fp32 autograd of the product cancelled two terms
    of size ``s exp(d)``: a one-token row at ``d = 16`` gave a logit gradient 1.78 for the exact 1.8 (19.3:
    1.0 for 1.965). Rows: one token; three with equal large ``d``; spread ``d`` in both signs; one all masked."""
    d = torch.tensor([[16.0, 0.0, 0.0, 0.0], [17.3, 17.3, 17.3, 0.0], [19.3, -4.0, 0.5, 12.0],
                      [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    logp64 = -torch.linspace(20.0, 0.3, d.numel(), dtype=torch.float64).view(d.shape)
    old64 = logp64 + torch.linspace(-0.4, 0.3, d.numel(), dtype=torch.float64).view(d.shape)
    logp64, ref64, old64 = (t.float().double() for t in (logp64, logp64 + d, old64))  # the fp32 inputs, exactly
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.05, kl_bias_correction=True, agg=agg)
    x, ref, old = (t.float().requires_grad_(True) for t in (logp64, ref64, old64))
    terms = per_token_loss(x, torch.zeros_like(x), mask, cfg, old_logprobs=old, ref_logprobs=ref)
    (terms.loss * aggregation_weights(mask, cfg)).sum().backward()

    x64, ref_64, old_64 = (t.clone().requires_grad_(True) for t in (logp64, ref64, old64))
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    s = torch.exp(torch.where(mask, x64 - old_64, 0.0).sum(dim=1, keepdim=True) / n)
    dd = torch.where(mask, ref_64 - x64, 0.0)
    k2 = 0.5 * dd * dd
    value = {"k3": torch.expm1(dd) - dd, "k3+": (torch.expm1(dd) - dd).detach() + k2 - k2.detach(),
             "abs+": dd.abs().detach() + k2 - k2.detach()}[kl]
    expected = torch.where(mask, 0.05 * s * value, 0.0)
    (expected * aggregation_weights(mask, cfg, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(terms.loss.detach().double(), expected.detach(), rtol=2e-6, atol=1e-12)
    for got, want in ((x.grad, x64.grad), (ref.grad, ref_64.grad), (old.grad, old_64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)


def test_token_normalizer_replaces_count():
    cfg = PolicyLossConfig(agg="token-mean")
    logp, old, ref, ent, adv, mask = _inputs(7)
    loss, _ = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=old, token_normalizer=37.0)
    expected = scalar_loss(logp.tolist(), old.tolist(), ref.tolist(), ent.tolist(), adv.tolist(), mask.tolist(),
                           cfg, normalizer=37.0)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_metrics_hand_computed():
    # one sequence, four tokens: ratios 0.5, 1.0, 1.5, 4.0 with advantages -1, +1, +1, -1
    logp = torch.zeros(1, 4)
    old = -torch.log(torch.tensor([[0.5, 1.0, 1.5, 4.0]]))
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    ref = torch.tensor([[0.0, 1.0, -1.0, 0.5]])
    cfg = PolicyLossConfig(dual_clip=3.0, kl="k3", beta=0.0)
    _, m = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=old, ref_logprobs=ref, entropy=torch.ones(1, 4))
    assert m["clip_frac_low"].item() == pytest.approx(0.25)  # r=0.5 with A<0
    assert m["clip_frac_high"].item() == pytest.approx(0.25)  # r=1.5 with A>0
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["clip_frac_dual"].item() == pytest.approx(0.25)  # r=4 > c=3 with A<0
    # asymmetric bounds [0.4, 1.2]: r=0.5 is inside, r=1.5 still above (each fraction reads its own bound)
    _, m2 = compute_policy_loss(logp, adv, mask, cfg.replace(clip_low=0.6), old_logprobs=old, ref_logprobs=ref)
    assert (m2["clip_frac_low"].item(), m2["clip_frac_high"].item()) == (0.0, pytest.approx(0.25))
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 1 + 1.5 + 4) / 4, rel=1e-6)
    k3 = [math.exp(d) - d - 1 for d in (0.0, 1.0, -1.0, 0.5)]
    assert m["kl_mean"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert m["entropy_mean"].item() == pytest.approx(1.0)


def test_gspo_clip_fractions_count_sequences_as_trl():
    """gspo's one ratio a sequence: TRL (importance_sampling_level="sequence") reports the fraction of the
    B sequences clipped, not of the tokens. Rows: 2 tokens clipped high (A > 0), 9 tokens unclipped, 1 token
    clipped low (A < 0), empty (counted, unclipped, as in TRL): 1/4 high, 1/4 low, not 2/12 and 1/12."""
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[0, :2], mask[1, :], mask[2, :1] = True, True, True
    logp = torch.zeros(4, 9)
    old = torch.zeros(4, 9)
    old[0], old[2] = -0.5, 0.5  # sequence ratios e^0.5 and e^-0.5
    adv = torch.tensor([[1.0], [1.0], [-1.0], [1.0]]).expand(4, 9)
    _, m = compute_policy_loss(logp, adv, mask, PolicyLossConfig.preset("gspo"), old_logprobs=old)
    assert (m["clip_frac_high"].item(), m["clip_frac_low"].item(), m["clip_frac"].item()) == (0.25, 0.25, 0.5)
    _, m = compute_policy_loss(logp, adv, mask, PolicyLossConfig.preset("gspo_token"), old_logprobs=old)
    assert m["clip_frac_high"].item() == pytest.approx(2 / 12)  # gspo_token: TRL's "sequence_token", per token


@pytest.mark.parametrize("kind", ["k1", "k3", "abs", "low_var_kl"])
def test_straight_through_kl_value_is_exactly_its_estimators(kind):
    """``"X+"`` has X's value bit for bit and k2's gradient, also where k2 is huge (``d = -8000`` in fp32:
    ``k2 + sg(X - k2)`` rounded low_var_kl's 10 to k2's ulp; a fuzz found 6 against the kernels' 10)."""
    from fused_rl.loss_math import kl_estimator

    logp = torch.tensor([-21162.5, -3.0, -0.5, 40.0]).requires_grad_(True)
    ref = torch.tensor([-29229.7, -2.0, -0.5, -3.0])
    value = kl_estimator(logp, ref, kind + "+")
    assert torch.equal(value.detach(), kl_estimator(logp.detach(), ref, kind))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, -(ref - logp.detach()))  # dk2/dlogp = -d


def test_kl_clamp_and_is_weight_by_hand():
    """OpenRLHF's ``compute_approx_kl``, by hand, four tokens with ``logp - ref`` = 12, -3, -11, 4 and ``logp - old``
    = log 3, 0, log 0.5, log 30. k1 clamped at 10: values 10, -3, -10, 4, gradient 0 where cut, else 1. k2 clamped:
    72 -> 10, 4.5, 60.5 -> 10, 8, gradient ``logp - ref`` (4 only: 3 and -3 inside, cut ones 0). ``"k2+"`` with
    ``kl_is_clip=2``: the same values, gradient ``min(r, 2) (logp - ref)`` on every token: 2 * 12, 1 * -3,
    0.5 * -11, 2 * 4."""
    logp = torch.tensor([[-1.0, -5.0, -12.0, -2.0]])
    ref = logp - torch.tensor([[12.0, -3.0, -11.0, 4.0]])
    old = logp - torch.tensor([[math.log(3.0), 0.0, math.log(0.5), math.log(30.0)]])
    zeros, mask = torch.zeros_like(logp), torch.ones_like(logp, dtype=torch.bool)
    cases = (
        (dict(kl="k1", kl_clamp=10.0), [10.0, -3.0, -10.0, 4.0], [0.0, 1.0, 0.0, 1.0]),
        (dict(kl="k2", kl_clamp=10.0), [10.0, 4.5, 10.0, 8.0], [0.0, -3.0, 0.0, 4.0]),
        (dict(kl="k2+", kl_clamp=10.0, kl_is_clip=2.0), [10.0, 4.5, 10.0, 8.0], [24.0, -3.0, -5.5, 8.0]),
        (dict(kl="k1+", kl_is_clip=2.0), [12.0, -3.0, -11.0, 4.0], [24.0, -3.0, -5.5, 8.0]),
    )
    for fields, values, grads in cases:
        x = logp.clone().requires_grad_(True)
        config = PolicyLossConfig(policy_loss="reinforce", beta=1.0, agg="seq-mean-token-sum", **fields)
        loss, m = compute_policy_loss(x, zeros, mask, config, old_logprobs=old, ref_logprobs=ref)
        loss.backward()
        assert m["kl_mean"].item() == pytest.approx(sum(values) / 4), fields
        torch.testing.assert_close(x.grad, torch.tensor([grads]), msg=str(fields))
    # on-policy the weight is min(1, C)
    x = logp.clone().requires_grad_(True)
    config = PolicyLossConfig(policy_loss="reinforce", kl="k2+", beta=1.0, kl_is_clip=0.5, agg="seq-mean-token-sum")
    compute_policy_loss(x, zeros, mask, config, ref_logprobs=ref)[0].backward()
    torch.testing.assert_close(x.grad, 0.5 * torch.tensor([[12.0, -3.0, -11.0, 4.0]]))


def test_on_policy_ratio_is_one_with_nonzero_gradient():
    """old=None: r == 1 exactly, but d loss / d logp = -A / n, as the seed stresses."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = compute_policy_loss(logp, adv, mask, PolicyLossConfig())
    assert m["ratio_mean"].item() == 1.0
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2.0 / 3))


@pytest.mark.parametrize("adv_sign", [1.0, -1.0])
def test_dr_grpo_coefficients(adv_sign):
    """Seed: per-token coefficients +-0.5 at 2 tokens and +-0.125 at 8 tokens under length
    normalization; +-0.125 at both lengths with a shared constant 8 (Dr. GRPO)."""
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, :] = True
    adv = torch.full((2, 8), adv_sign)
    for preset, expected_short in (("grpo", 0.5), ("dr_grpo", 0.125)):
        logp = torch.full((2, 8), -1.0, requires_grad=True)
        cfg = PolicyLossConfig.preset(preset, max_len=8) if preset == "dr_grpo" else PolicyLossConfig.preset(preset)
        loss, _ = compute_policy_loss(logp, adv, mask, cfg)
        loss.backward()
        coeff = -logp.grad * 2  # the objective's coefficient, times B (the batch mean)
        torch.testing.assert_close(coeff[0, :2], torch.full((2,), adv_sign * expected_short))
        torch.testing.assert_close(coeff[1], torch.full((8,), adv_sign * 0.125))
        assert (coeff[0, 2:] == 0).all()


def test_all_masked_batch_gives_zero_loss_and_grad():
    for agg in AGGREGATIONS:
        logp = torch.randn(2, 3, requires_grad=True)
        cfg = PolicyLossConfig(agg=agg, kl="k3", beta=0.1)
        loss, m = compute_policy_loss(logp, torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool), cfg,
                                      ref_logprobs=torch.full((2, 3), float("nan")))
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
        assert all(torch.isfinite(v) for v in m.values())


def test_masked_garbage_does_not_leak():
    """NaN / inf in old and ref at masked positions change nothing."""
    logp, old, ref, ent, adv, mask = _inputs(3)
    cfg = PolicyLossConfig(kl="k3", beta=0.2)
    clean = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=old, ref_logprobs=ref)[0]
    dirty_old = torch.where(mask, old, float("nan"))
    dirty_ref = torch.where(mask, ref, float("inf"))
    dirty = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=dirty_old, ref_logprobs=dirty_ref)[0]
    assert dirty.item() == clean.item()


def test_low_var_kl_clamp_has_finite_gradient():
    logp = torch.tensor([[-200.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -200.0]])
    cfg = PolicyLossConfig(kl="low_var_kl", beta=1.0, policy_loss="reinforce")
    loss, _ = compute_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), cfg, ref_logprobs=ref)
    loss.backward()
    assert loss.item() == pytest.approx(10.0)  # both tokens clamped at 10, token-mean of 2
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_reference_policy_loss_is_log_softmax_plus_loss_math():
    """The reference end to end on a tiny vocabulary computed by hand: logits [0, log 3] -> p = [1/4, 3/4]."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]], requires_grad=True)
    targets = torch.tensor([[1, 0]])
    out = fused_rl.reference.policy_loss(logits, targets, torch.tensor([1.0]), torch.tensor([[1, 1]]),
                                         config=PolicyLossConfig(policy_loss="reinforce", agg="seq-mean-token-sum"))
    torch.testing.assert_close(out.logprobs, torch.log(torch.tensor([[0.75, 0.5]])))
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(out.entropy, torch.tensor([[h1, math.log(2.0)]]))
    assert out.loss.item() == pytest.approx(-(math.log(0.75) + math.log(0.5)))
    out.loss.backward()
    # d(-logp_target)/dz = p - onehot
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.25, -0.25], [-0.5, 0.5]]]))


def test_off_policy_mask_boundaries_as_trl():
    """TRL's off-policy sequence mask keeps ``A >= 0`` or ``mean KL <= delta``: a sequence whose mean KL equals
    ``delta`` is kept (``off_policy_mask=0`` on-policy: nothing dropped, every token's gradient there), and an
    ``A = 0`` token is never counted as dropped (a mutation to ``<`` / ``A > 0`` survived the suite)."""
    logp = (-2.0 * torch.rand(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    logp.requires_grad_(True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.tensor([[-1.0] * 4, [1.0] * 4], dtype=torch.float64)
    loss, metrics = compute_policy_loss(logp, adv, mask, PolicyLossConfig(off_policy_mask=0.0))
    loss.backward()
    assert metrics["off_policy_mask_frac"].item() == 0.0 and loss.item() == pytest.approx(0.0)
    torch.testing.assert_close(logp.grad[0], torch.full((4,), 0.125, dtype=torch.float64))
    adv = torch.tensor([[0.0, 0.0, -1.0, 1.0], [0.0] * 4], dtype=torch.float64)
    _, metrics = compute_policy_loss(logp.detach(), adv, mask, PolicyLossConfig(off_policy_mask=0.1),
                                     old_logprobs=logp.detach(), rollout_logprobs=logp.detach() + 1.0)
    assert metrics["off_policy_mask_frac"].item() == pytest.approx(1 / 8)  # the one A < 0 token of a KL-1 sequence


@pytest.mark.parametrize("rollout_is", ["token_mask", "sequence_mask"])
@pytest.mark.parametrize("bounds", [dict(rollout_is_max=1.0), dict(rollout_is_min=1.0, rollout_is_max=2.0)],
                         ids=["max", "min"])
def test_rollout_mask_bounds_are_inclusive(rollout_is, bounds):
    """``rho`` exactly at a bound is kept (``min <= rho <= max``, as TRL's and verl's masks): with the rollout
    log-probs equal to the old ones (``rho = 1``) and a bound at 1 the loss is the uncorrected one."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    config = PolicyLossConfig(rollout_is=rollout_is, **bounds)
    args = (logp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool), config)
    loss, metrics = compute_policy_loss(*args, old_logprobs=logp, rollout_logprobs=logp.clone())
    assert metrics["rollout_is_mean"].item() == 1.0 and loss.item() == pytest.approx(-1.0)


def test_dppo_by_hand():
    """DPPO (verl 0.9.1's ``compute_policy_loss_dppo_tv`` / ``_kl``), five tokens ``(p, q, A)``: (0.5, 0.3, 1),
    (0.5, 0.6, 1), (0.2, 0.4, -1), (0.4, 0.2, -2), (0.95, 0.85, 1); bounds 0.15 (A > 0) / 0.1 (A < 0) for tv,
    0.05 / 0.05 for the binary KL, the weight truncated at ``delta = 1.5``.

    tv, ``p - q`` = 0.2 (> 0.15: dropped), -0.1, -0.2 (< -0.1: dropped), 0.2, 0.1. Binary KL ``D`` = 0.0823 (p > q,
    dropped), 0.0201, 0.1046 (p < q, dropped), 0.0915 (beyond 0.05, but p >= q with A < 0: kept), 0.0702 (p > q,
    dropped: tv keeps it). Kept tokens: ``l = -min(r, 1.5) A log p``, slope ``-min(r, 1.5) A``: 5/6 log 2,
    -1.5 * -2 * log 0.4 (r = 2 truncated), -(0.95 / 0.85) log 0.95."""
    p = torch.tensor([[0.5, 0.5, 0.2, 0.4, 0.95]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.6, 0.4, 0.2, 0.85]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(p, dtype=torch.bool)
    slope = torch.tensor([[0.0, -5 / 6, 0.0, 3.0, -0.95 / 0.85]], dtype=torch.float64)
    cases = (
        (dict(policy_loss="dppo_tv", clip_low=0.1, clip_high=0.15), [False, True, False, True, True]),
        (dict(policy_loss="dppo_kl", clip_low=0.05, clip_high=0.05), [False, True, False, True, False]),
    )
    for fields, keep in cases:
        config = PolicyLossConfig(delta=1.5, agg="seq-mean-token-sum", **fields)
        assert dppo_keep(p.log(), q.log(), adv, config).tolist() == [keep]
        x = p.log().requires_grad_(True)
        loss, m = compute_policy_loss(x, adv, mask, config, old_logprobs=q.log())
        loss.backward()
        expected = torch.where(torch.tensor([keep]), slope, 0.0)
        torch.testing.assert_close(x.grad, expected)
        assert loss.item() == pytest.approx((expected * p.log()).sum().item())
        # dropped: A > 0 tokens 1 (and 5 for the binary KL), A < 0 token 3
        assert m["clip_frac_high"].item() == pytest.approx((2 - keep[4]) / 5)
        assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
        assert m["clip_frac"].item() == pytest.approx((3 - keep[4]) / 5)
    # p ~ 1: the binary KL's smoothing of 1 - p (1e-8) decides (helpers.DPPO_NEAR_ONE)
    near = DPPO_NEAR_ONE
    assert dppo_keep(torch.tensor([near["logp"]]), torch.tensor([near["old"]]), torch.tensor([near["adv"]]),
                     near["config"]).tolist() == [[False, True]]
    # on-policy every token is kept with weight 1: REINFORCE
    x = p.log().requires_grad_(True)
    compute_policy_loss(x, adv, mask, PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.0, clip_high=0.0,
                                                       agg="seq-mean-token-sum"))[0].backward()
    torch.testing.assert_close(x.grad, -adv)


def _cov_case(seed=0, batch=4, length=64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 4
    old = logp + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length) * 2
    mask = torch.rand(batch, length, generator=g) < 0.8
    mask[0] = False
    a, lp = adv[mask], logp[mask]
    cov = torch.zeros_like(logp)
    cov[mask] = (a - a.mean()) * (lp - lp.mean())
    return logp, old, adv, mask, cov


def test_clip_cov_draws_uniformly_from_its_candidates():
    """clip_cov drops ``n = floor(cov_ratio * #unmasked)`` tokens drawn from its candidates only (covariance in the
    band, PPO clip inactive), the same ones under the same seed, each candidate about equally often over seeds."""
    logp, old, adv, mask, cov = _cov_case()
    config = PolicyLossConfig(cov_mode="clip_cov", cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=1.0, clip_high=0.1)
    r = (logp - old).exp()
    clipped = -adv * r.clamp(0.8, 1.1) > -adv * r
    candidates = mask & (cov > 0.0) & (cov < 1.0) & ~clipped
    n = math.floor(0.05 * mask.sum().item())
    assert clipped[mask & (cov > 0) & (cov < 1)].any() and candidates.sum() > 3 * n
    counts = torch.zeros_like(logp)
    for seed in range(300):
        torch.manual_seed(seed)
        selected = per_token_loss(logp, adv, mask, config, old_logprobs=old).extras["cov_selected"]
        assert selected.sum() == n and not (selected & ~candidates).any()
        counts += selected
    torch.manual_seed(299)
    assert torch.equal(per_token_loss(logp, adv, mask, config, old_logprobs=old).extras["cov_selected"], selected)
    expected = 300 * n / candidates.sum().item()
    assert 0.5 * expected < counts[candidates].min() and counts[candidates].max() < 1.6 * expected
    # fewer candidates than n: all of them
    config = config.replace(cov_ratio=1.0)
    assert torch.equal(per_token_loss(logp, adv, mask, config, old_logprobs=old).extras["cov_selected"], candidates)


def test_cov_count_is_verl_s_double_precision_product():
    """``n = max(floor(cov_ratio N), 1)`` with the product in double precision, verl's ``int(ratio * N)``: 0.29 * 100
    is 28.999999999999996 there (float32 rounds it to 29.000000xx, one token more)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(1, 100, generator=g)
    adv, mask = torch.randn(1, 100, generator=g), torch.ones(1, 100, dtype=torch.bool)
    for mode in ("kl_cov", "clip_cov"):
        config = PolicyLossConfig(cov_mode=mode, cov_ratio=0.29, clip_cov_lb=-1e6, clip_cov_ub=1e6)
        assert per_token_loss(logp, adv, mask, config).extras["cov_selected"].sum() == int(0.29 * 100) == 28


def test_kl_cov_penalizes_the_top_covariance_tokens():
    """kl_cov's ``n`` tokens are torch.topk's of the covariance; each adds ``kl_cov_coef |logp - old|`` (slope
    ``coef sign(logp - old)``) to its policy term, scaled by the aggregation weight."""
    logp, old, adv, mask, cov = _cov_case(1)
    n = math.floor(0.1 * mask.sum().item())
    top = torch.zeros_like(mask).view(-1)
    top[torch.where(mask, cov, -math.inf).view(-1).topk(n).indices] = True
    top = top.view(mask.shape)
    base = PolicyLossConfig(agg="seq-mean-token-sum")
    config = base.replace(cov_mode="kl_cov", cov_ratio=0.1, kl_cov_coef=0.7)
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, m = compute_policy_loss(x, adv, mask, config, old_logprobs=old)
    plain, _ = compute_policy_loss(y, adv, mask, base, old_logprobs=old)
    loss.backward()
    plain.backward()
    batch = logp.shape[0]
    assert loss.item() == pytest.approx(plain.item() + 0.7 * (logp - old).abs()[top].sum().item() / batch)
    torch.testing.assert_close(x.grad - y.grad, torch.where(top, 0.7 * (logp - old).sign() / batch, 0.0))
    assert m["cov_frac"].item() == pytest.approx(n / mask.sum().item())


# ----------------------------------------------------------------------------- values exactly at a bound, overflow
# (cases a mutation-testing round found untested)
def _f(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def test_kl_clamp_passes_the_gradient_at_the_bound():
    """a value exactly at +-kl_clamp is not cut (torch's clamp, the epilogue's ``>``): k2 at d = 2 is 2.0."""
    logp = _f([-1.0], torch.float64).requires_grad_(True)
    ref = _f([1.0], torch.float64)
    value = kl_estimator(logp, ref, "k2", clamp=2.0)
    value.sum().backward()
    assert value.item() == 2.0
    assert logp.grad.item() == -2.0  # -d, as autograd of clamp(d^2 / 2, -2, 2)


def test_an_empty_row_has_sequence_log_ratio_zero_not_nan():
    """an all-masked row's sequence mean is 0 (count clamped to 1), not 0 / 0."""
    from fused_rl.integrations.verl_rollout import _row_mean
    mask = torch.tensor([[True, True, False], [False, False, False]])
    logp = _f([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = logp - 0.1
    cfg = PolicyLossConfig(policy_loss="gspo")
    assert torch.equal(log_importance_ratio(logp, old, mask, cfg)[1], torch.zeros(3))
    ratio = per_token_loss(logp, torch.ones(2, 3), mask, cfg, old_logprobs=old).ratio
    assert torch.isfinite(ratio).all()
    assert torch.equal(_row_mean(torch.ones(2, 3), mask), _f([1.0, 0.0]))


def test_vespo_clamps_each_token_log_ratio_as_trl():
    """``log w`` sums the token log-ratios clamped to [-20, 20] (TRL's get_gamma_weights)."""
    trl = pytest.importorskip("trl")
    log_r = torch.tensor([[30.0, -25.0, 0.0], [30.0, -25.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    cfg = PolicyLossConfig(policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5,
                           vespo_lambda_neg=0.5)
    expected = trl.GRPOTrainer.get_gamma_weights(advantages=adv, log_ratio_per_token=log_r,
                                                 mask=mask.double(), importance_sampling_ratio=None,
                                                 k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=0.5)
    got = vespo_weights(log_r, adv.expand(2, 3), mask, cfg)
    torch.testing.assert_close(got, expected.expand_as(got), rtol=1e-12, atol=0.0)
    assert got[0, 0].item() == pytest.approx(1.0)  # log w = 20 - 20 + 0 = 0: phi(1) = 1


@pytest.mark.parametrize("side", ["high", "low"])
def test_dppo_tv_keeps_a_token_exactly_at_its_bound(side):
    """dppo_tv keeps ``p - q <= clip_high`` (A > 0) and ``p - q >= -clip_low`` (A < 0): equality is kept."""
    lp, lq, a = (math.log(0.5), math.log(0.25), 1.0) if side == "high" else (math.log(0.25), math.log(0.5), -1.0)
    logp, old = _f([[lp]], torch.float64), _f([[lq]], torch.float64)
    gap = (logp.exp() - old.exp()).item()
    cfg = PolicyLossConfig(policy_loss="dppo_tv", clip_low=max(-gap, 0.1), clip_high=max(gap, 0.1))
    assert dppo_keep(logp, old, _f([[a]], torch.float64), cfg).item()
    x = logp.clone().requires_grad_(True)
    compute_policy_loss(x, _f([[a]], torch.float64), torch.ones(1, 1, dtype=torch.bool), cfg,
                        old_logprobs=old)[0].backward()
    assert x.grad.item() == pytest.approx(-math.exp(lp - lq) * a)


def test_dppo_zero_advantage_uses_the_lower_side_of_the_trust_region():
    """``A = 0`` takes the ``A <= 0`` side (``p - q >= -clip_low``): a token with p - q = 0.3 > clip_high
    is kept, so no clip fraction is counted for it."""
    logp = _f([[math.log(0.6), math.log(0.5)]], torch.float64)
    old = _f([[math.log(0.3), math.log(0.5)]], torch.float64)
    adv = _f([[0.0, 1.0]], torch.float64)
    cfg = PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.1, clip_high=0.1)
    assert dppo_keep(logp, old, adv, cfg).tolist() == [[True, True]]
    _, m = compute_policy_loss(logp, adv, torch.ones(1, 2, dtype=torch.bool), cfg, old_logprobs=old)
    assert m["clip_frac"].item() == 0.0 and m["clip_frac_low"].item() == 0.0


def _overflow_case():
    # token 0: r = exp(199.9) = inf in fp32; token 1 an ordinary one
    logp = _f([[-0.1, -1.0]])
    old = _f([[-200.0, -1.2]])
    return logp, old


def test_dppo_zero_advantage_with_an_overflowed_ratio_is_zero():
    """dppo without delta: ``A = 0`` gives 0 (loss and gradient), not ``inf * 0 = NaN``."""
    logp, old = _overflow_case()
    adv = _f([[0.0, 1.0]])
    cfg = PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.2, clip_high=0.2)
    x = logp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(x, adv, torch.ones(1, 2, dtype=torch.bool), cfg, old_logprobs=old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert x.grad[0, 0].item() == 0.0


def test_dppo_token_dropped_by_the_rollout_mask_with_an_overflowed_ratio_is_zero():
    """a dppo token kept by the trust region but dropped by the rollout mask (weight 0) with an overflowed
    ratio: gradient 0, not ``0 * inf = NaN``."""
    logp, old = _overflow_case()
    rollout = old - 5.0  # rho = e^5 > rollout_is_max: masked to 0
    adv = _f([[-1.0, 1.0]])
    cfg = PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.2, clip_high=0.2, rollout_is="token_mask",
                           rollout_is_max=1.5)
    x = logp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(x, adv, torch.ones(1, 2, dtype=torch.bool), cfg, old_logprobs=old,
                                  rollout_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert x.grad[0, 0].item() == 0.0


def test_kl_cov_selects_at_least_one_token():
    """``n = max(floor(cov_ratio * N), 1)``: 5 tokens at cov_ratio 0.1 select one."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(1, 5, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(1, 5, generator=g, dtype=torch.float64)
    cfg = PolicyLossConfig(cov_mode="kl_cov", cov_ratio=0.1, kl_cov_coef=0.5)
    _, m = compute_policy_loss(logp, adv, torch.ones(1, 5, dtype=torch.bool), cfg, old_logprobs=logp - 0.1)
    assert m["cov_frac"].item() == pytest.approx(1 / 5)


def test_dual_clip_fraction_counts_negative_advantages_only():
    """``clip_frac_dual`` counts ``A < 0`` and ``r > c`` (r = 3 > c = 2 with A > 0 does not count)."""
    old = _f([[0.0, 0.0]], torch.float64)
    logp = old + math.log(3.0)
    cfg = PolicyLossConfig(dual_clip=2.0)
    _, m = compute_policy_loss(logp, _f([[1.0, -1.0]], torch.float64), torch.ones(1, 2, dtype=torch.bool), cfg,
                               old_logprobs=old)
    assert m["clip_frac_dual"].item() == 0.5


def test_gmpo_high_clip_fraction_uses_clip_high():
    """gmpo's ``clip_frac_high`` is ``log r > clip_high`` with A > 0 (0.2 is inside clip_high = 0.3)."""
    old = _f([[0.0]], torch.float64)
    cfg = PolicyLossConfig(policy_loss="gmpo", clip_low=0.1, clip_high=0.3)
    _, m = compute_policy_loss(old + 0.2, _f([[1.0]], torch.float64), torch.ones(1, 1, dtype=torch.bool), cfg,
                               old_logprobs=old)
    assert m["clip_frac_high"].item() == 0.0


def test_vespo_weight_that_overflows_is_zero_as_trl():
    """a non-finite ``phi`` is 0 (TRL's ``nan_to_num(posinf=0)``): fp32, k = 10, lam -> 1e-4, log w = 10 gives
    ``exp(1e-4 + 100 - 2.2) = inf``."""
    trl = pytest.importorskip("trl")
    log_r = torch.tensor([[5.0, 5.0], [0.1, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0], [1.0]])
    cfg = PolicyLossConfig(policy_loss="vespo", vespo_k_pos=10.0, vespo_lambda_pos=0.0)
    got = vespo_weights(log_r, adv.expand(2, 2), mask, cfg)
    expected = trl.GRPOTrainer.get_gamma_weights(advantages=adv, log_ratio_per_token=log_r, mask=mask.float(),
                                                 importance_sampling_ratio=None, k_pos=10.0, lambda_pos=0.0)
    assert got[0].tolist() == [0.0, 0.0] and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected.expand_as(got))


@pytest.mark.parametrize("tie", EPILOGUE_TIES, ids=["dual_clip", "delta"])
def test_ratio_exactly_at_a_bound(tie):
    """``helpers.EPILOGUE_TIES`` (the kernels' epilogues are held to them): autograd of loss_math in fp32 at a
    ratio exactly on ``dual_clip`` / ``delta`` gives the tie's loss and slope."""
    logp = _f([[tie["logp"]]]).requires_grad_(True)
    assert torch.exp(logp.detach() - tie["old"]).item() in (tie["config"].dual_clip, tie["loss"])
    loss = per_token_loss(logp, _f([tie["adv"]]), torch.ones(1, 1, dtype=torch.bool), tie["config"],
                          old_logprobs=_f([[tie["old"]]])).loss
    loss.sum().backward()
    assert loss.item() == tie["loss"] and logp.grad.item() == tie["slope"]
