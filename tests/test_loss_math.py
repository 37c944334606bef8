"""The loss math against an independent scalar re-derivation, for every policy_loss x kl x agg."""

import itertools
import math

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.config import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from fused_rl.loss_math import compute_policy_loss


def scalar_loss(logp, old, ref, ent, adv, mask, cfg, normalizer=None, frozen_logp=None):
    """Plain-Python evaluation of the documented formulas (lists of lists, math module only).

    ``frozen_logp`` supplies the log-probs of cispo's stop-gradient weight (for finite differences)."""
    B, T = len(logp), len(logp[0])
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n_b = sum(mask[b])
        seq_log_ratio = sum(logp[b][t] - old[b][t] for t in range(T) if mask[b][t]) / max(n_b, 1)
        for t in range(T):
            if not mask[b][t]:
                continue
            A = adv[b][t]
            r = math.exp(seq_log_ratio) if cfg.policy_loss == "gspo" else math.exp(logp[b][t] - old[b][t])
            if cfg.policy_loss in ("ppo_clip", "gspo"):
                clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
                l = max(-A * r, -A * clipped)
                if cfg.dual_clip is not None and A < 0:
                    l = min(l, -cfg.dual_clip * A)
            elif cfg.policy_loss == "cispo":
                if frozen_logp is not None:
                    r = math.exp(frozen_logp[b][t] - old[b][t])
                l = -min(r, 1 + cfg.clip_high) * A * logp[b][t]
            else:
                l = -A * logp[b][t]
            if cfg.kl is not None and cfg.beta:
                d = ref[b][t] - logp[b][t]
                kl = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1, "abs": abs(d),
                      "low_var_kl": min(max(math.exp(d) - d - 1, -10), 10)}[cfg.kl]
                l += cfg.beta * kl
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


COMBOS = list(itertools.product(POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS))


@pytest.mark.parametrize("policy, kl, agg", COMBOS, ids=["-".join(map(str, c)) for c in COMBOS])
def test_every_combination_matches_scalar_derivation(policy, kl, agg):
    cfg = PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.1 if kl else 0.0, agg=agg, clip_low=0.15,
                           clip_high=0.25, entropy_coef=0.01,
                           dual_clip=2.0 if policy in ("ppo_clip", "gspo") else None,
                           max_len=7 if agg == "seq-mean-token-sum-norm" else None)
    logp, old, ref, ent, adv, mask = _inputs(hash((policy, kl, agg)) % 1000)
    loss, metrics = compute_policy_loss(logp, adv, mask, cfg, old_logprobs=old, ref_logprobs=ref, entropy=ent)
    expected = scalar_loss(logp.tolist(), old.tolist(), ref.tolist(), ent.tolist(), adv.tolist(),
                           mask.tolist(), cfg)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    # gradients agree with central differences of the scalar derivation (cispo's weight held fixed)
    x = logp.clone().requires_grad_(True)
    compute_policy_loss(x, adv, mask, cfg, old_logprobs=old, ref_logprobs=ref, entropy=ent)[0].backward()
    base, h = logp.tolist(), 1e-6
    for b, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        plus = [row[:] for row in base]
        minus = [row[:] for row in base]
        plus[b][t] += h
        minus[b][t] -= h
        args = (old.tolist(), ref.tolist(), ent.tolist(), adv.tolist(), mask.tolist(), cfg)
        numeric = (scalar_loss(plus, *args, frozen_logp=base) - scalar_loss(minus, *args, frozen_logp=base)) / (2 * h)
        assert x.grad[b, t].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8), (b, t)


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
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 1 + 1.5 + 4) / 4, rel=1e-6)
    k3 = [math.exp(d) - d - 1 for d in (0.0, 1.0, -1.0, 0.5)]
    assert m["kl_mean"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert m["entropy_mean"].item() == pytest.approx(1.0)


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
