"""fused_rl.integrations.verl against values derived by hand from verl 0.9.1's definitions (core_algos.py)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.integrations.verl import (_bypass_correction, compute_policy_loss, compute_policy_loss_from_hidden,
                                        get_policy_loss_fn, policy_loss_config_from_verl)
from fused_rl.integrations.verl_rollout import correct
from fused_rl.loss_math import dppo_keep

# Two responses, T = 3. Row 0: A = +1, ratios 1.5, 0.5, 1.0. Row 1: A = -2, ratios 4.0, 0.5, (1.1 masked).
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [4.0, 0.5, 1.1]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.5]], dtype=torch.float64)
CONFIG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "policy_loss": {"loss_mode": "vanilla"}}

# Per-token vanilla losses by hand (clip 0.2, dual clip c = 3):
#   row 0 (A=1):  r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r=0.5 -> max(-0.5, -0.8) = -0.5; r=1 -> -1
#   row 1 (A=-2): r=4 -> max(8, 2.4) = 8, capped at -c A = 6 (dual clip); r=0.5 -> max(1, 1.6) = 1.6 (clipped)
TOKEN_LOSS = [[-1.2, -0.5, -1.0], [6.0, 1.6]]
HAND = {
    "token-mean": (-1.2 - 0.5 - 1.0 + 6.0 + 1.6) / 5,
    "seq-mean-token-mean": ((-1.2 - 0.5 - 1.0) / 3 + (6.0 + 1.6) / 2) / 2,
    "seq-mean-token-sum": ((-1.2 - 0.5 - 1.0) + (6.0 + 1.6)) / 2,
    "seq-mean-token-sum-norm": ((-1.2 - 0.5 - 1.0) + (6.0 + 1.6)) / 2 / 3,  # verl 0.9: / #non-empty / T
}


def _log_prob():
    return (OLD + RATIOS.log()).clone().requires_grad_(True)


@pytest.mark.parametrize("agg", sorted(HAND))
def test_vanilla_hand_values(agg):
    log_prob = _log_prob()
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(OLD, log_prob, ADV, MASK, agg, CONFIG)
    assert pg_loss.item() == pytest.approx(HAND[agg], rel=1e-6)
    # clipped term active: (row 0, r=1.5, A>0) and (row 1, r=0.5, A<0): 2 of 5 tokens; dual cap: 1 of 5
    assert clipfrac.item() == pytest.approx(0.4)
    assert clipfrac_lower.item() == pytest.approx(0.2)
    assert ppo_kl.item() == pytest.approx(-math.log(1.5 * 0.5 * 1.0 * 4.0 * 0.5) / 5, rel=1e-6)
    pg_loss.backward()
    # Only unclipped tokens have a gradient: d(-r A)/dlogp = -r A: row 0 tokens r=0.5 and r=1.
    weights = {"token-mean": [[1 / 5] * 3, [1 / 5] * 3], "seq-mean-token-mean": [[1 / 6] * 3, [1 / 4] * 3],
               "seq-mean-token-sum": [[1 / 2] * 3, [1 / 2] * 3],
               "seq-mean-token-sum-norm": [[1 / 6] * 3, [1 / 6] * 3]}[agg]
    expected = torch.tensor([[0.0, -0.5 * weights[0][1], -1.0 * weights[0][2]], [0.0, 0.0, 0.0]],
                            dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-6, atol=1e-9)


def test_clip_ratio_low_high_and_attribute_config():
    # clip_ratio_high 0.6 un-clips r=1.5 (A>0): its loss becomes -1.5, and the clip fraction drops to 1/5.
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.6, clip_ratio_c=10.0,
                             policy_loss=SimpleNamespace(loss_mode="vanilla"))
    pg_loss, clipfrac, _, clipfrac_lower = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config)
    # c = 10 no longer caps r=4 (A=-2): max(8, 2*1.6=3.2) = 8.
    assert pg_loss.item() == pytest.approx((-1.5 - 0.5 - 1.0 + 8.0 + 1.6) / 5, rel=1e-6)
    assert clipfrac.item() == pytest.approx(0.2)
    assert clipfrac_lower.item() == 0.0


def test_gspo_hand_values():
    # s_0 = (1.5 * 0.5 * 1)^(1/3), A=+1, inside [0.8, 1.2]: l = -s_0.
    # s_1 = (4 * 0.5)^(1/2) = sqrt 2, A=-2: max(2 sqrt 2, 2 * 1.2) = 2 sqrt 2. verl 0.9's gspo aggregates by
    # loss_agg_mode (0.7 forced seq-mean-token-mean): token-mean is (-3 s_0 + 4 s_1) / 5.
    s0, s1 = 0.75 ** (1 / 3), math.sqrt(2.0)
    config = {"clip_ratio": 0.2, "policy_loss": {"loss_mode": "gspo"}}
    token_mean = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config)[0]
    assert token_mean.item() == pytest.approx((-3 * s0 + 4 * s1) / 5, rel=1e-6)
    log_prob = _log_prob()
    pg_loss, clipfrac, _, clipfrac_lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "seq-mean-token-mean",
                                                               config)
    assert pg_loss.item() == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
    assert clipfrac.item() == 0.0 and clipfrac_lower.item() == 0.0
    pg_loss.backward()
    # d/dlogp_t of (1/B) mean_t(l): row 0: -s0 / (B * 3) per token; row 1: 2 s1 / (B * 2) on its 2 tokens.
    expected = torch.tensor([[-s0 / 6] * 3, [2 * s1 / 4] * 2 + [0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-6, atol=1e-9)


def test_gpg_hand_values():
    log_prob = _log_prob()
    pg_loss, clipfrac, ppo_kl, lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "seq-mean-token-sum",
                                                           {"policy_loss": {"loss_mode": "gpg"}})
    lp = (OLD + RATIOS.log())
    hand = (-(lp[0] * 1.0).sum() + (2.0 * lp[1, :2]).sum()) / 2
    assert pg_loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert clipfrac.item() == ppo_kl.item() == lower.item() == 0.0


def test_config_mapping():
    options = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "use_kl_loss": True,
               "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "entropy_coeff": 0.01}
    cfg = policy_loss_config_from_verl(options, "seq-mean-token-sum-norm", response_length=64, kl=True, entropy=True)
    assert cfg == PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-sum-norm",
                                   max_len=64, kl="low_var_kl", beta=0.001, entropy_coef=0.01)
    # verl's registered losses read global_batch_info's loss_scale_factor; its ppo_loss (actor=True) overwrites that
    # with the actor's top-level option, None included
    for info, actor, max_len in (({"loss_scale_factor": 4096}, True, 4096), ({"loss_scale_factor": 4096}, False, 64),
                                 ({"global_batch_info": {"loss_scale_factor": 4096}}, False, 4096),
                                 ({"global_batch_info": {"loss_scale_factor": 4096}}, True, 64)):
        assert policy_loss_config_from_verl(dict(options, **info), "seq-mean-token-sum-norm", response_length=64,
                                            actor=actor).max_len == max_len
    assert policy_loss_config_from_verl(options, "token-sum", response_length=64).agg == "token-mean"
    # errors name verl's option (they named the PolicyLossConfig field only)
    with pytest.raises(ValueError, match=r"^verl clip_ratio_low \(or clip_ratio\)=-0.1: PolicyLossConfig.clip_low"):
        policy_loss_config_from_verl({"clip_ratio_low": -0.1}, response_length=4)
    with pytest.raises(ValueError, match=r"^verl kl_loss_coef=-1.0: PolicyLossConfig.beta must be >= 0"):
        policy_loss_config_from_verl({"use_kl_loss": True, "kl_loss_coef": -1}, response_length=4, kl=True)
    with pytest.raises(ValueError, match=r"^verl policy_loss.kl_cov_ratio=-0.5: PolicyLossConfig.cov_ratio"):
        policy_loss_config_from_verl({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": -0.5}}, response_length=4)
    with pytest.raises(ValueError, match=r"^verl policy_loss.dro_beta=1e\+39: PolicyLossConfig.beta must be finite"):
        policy_loss_config_from_verl({"policy_loss": {"loss_mode": "dro", "dro_beta": 1e39}}, response_length=4)
    assert policy_loss_config_from_verl(options, "seq-mean-token-sum-norm", response_length=torch.tensor(64)).max_len \
        == 64
    for bad in (4.5, 0, "64", True, torch.tensor(4.5)):  # int(4.5) divided by 4
        with pytest.raises(ValueError, match="response_length must be a positive integer"):
            policy_loss_config_from_verl(options, "seq-mean-token-sum-norm", response_length=bad)
    for verl_name, ours in (("kl", "k1"), ("k1", "k1"), ("mse", "k2"), ("abs", "abs"), ("k3", "low_var_kl")):
        cfg = policy_loss_config_from_verl({"kl_loss_type": verl_name, "kl_loss_coef": 0.1, "use_kl_loss": True},
                                           response_length=4, kl=True)
        assert cfg.kl == ours
    for off in ({"use_kl_loss": False}, {"kl_loss_coef": 0.1}):  # absent: verl's ActorConfig default, false
        cfg = policy_loss_config_from_verl(off, response_length=4, kl=True)
        assert cfg.kl is None


@pytest.mark.parametrize("field, value", [("kl_loss_coef", True), ("clip_ratio", "0.2"), ("clip_ratio_c", False),
                                          ("entropy_coeff", "0.01"), ("tau_pos", True)])
def test_config_numbers_refuse_bools_and_strings(field, value):
    """A YAML ``kl_loss_coef: true`` is no coefficient of 1.0: the field is named, not converted."""
    config = {"use_kl_loss": True, field: value}
    loss_mode = "sapo" if field == "tau_pos" else "vanilla"
    with pytest.raises(ValueError, match=f"verl {field} must be a number"):
        policy_loss_config_from_verl(config, response_length=4, loss_mode=loss_mode, kl=True,
                                     entropy=True)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(config={"policy_loss": {"loss_mode": "ppo_pi"}}), "not one of verl 0.9.1's loss modes"),
    (dict(config={"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}, "use_kl_loss": True}, kl=True), "one KL term"),
    (dict(config={"policy_loss": {"loss_mode": "cispo"}}), "two-sided"),  # clip_ratio_low defaults to 0.2
    (dict(config={"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 0.999}), "clip_ratio_low=0.999"),
    (dict(loss_agg_mode="token-mean-unbiased"), "token-mean-unbiased"),
    (dict(config={"kl_loss_type": "full", "use_kl_loss": True}, kl=True), "full"),
    (dict(config={"kl_loss_type": "full+", "use_kl_loss": True}, kl=True), "full"),
])
def test_unsupported_raise(kwargs, needle):
    with pytest.raises(NotImplementedError, match=needle.replace("+", r"\+")):
        policy_loss_config_from_verl(response_length=4, **kwargs)


def test_new_modes_and_straight_through_kl_mapping():
    for verl_name, ours in (("kl+", "k1+"), ("k1+", "k1+"), ("mse+", "k2"), ("abs+", "abs+"), ("k3+", "low_var_kl+"),
                            ("low_var_kl+", "low_var_kl+")):
        cfg = policy_loss_config_from_verl({"kl_loss_type": verl_name, "kl_loss_coef": 0.1, "use_kl_loss": True},
                                           response_length=4, kl=True)
        assert cfg.kl == ours
    cfg = policy_loss_config_from_verl({"clip_ratio_low": 0.4, "clip_ratio_high": 0.4,
                                        "policy_loss": {"loss_mode": "geo_mean"}}, "token-mean",
                                       response_length=4)
    assert cfg == PolicyLossConfig.preset("gmpo")
    cfg = policy_loss_config_from_verl({"policy_loss": {"loss_mode": "gspo"}}, response_length=4)
    assert cfg.policy_loss == "gspo_token"


def test_geo_mean_hand_values():
    """verl's geo_mean: -mean_i A_i exp(mean_t sgn(A) min(sgn(A) x, sgn(A) clip(x, -0.4, 0.4))), x = log r."""
    log_prob = _log_prob()
    config = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4, "policy_loss": {"loss_mode": "geo_mean"}}
    pg_loss, clipfrac, _, clipfrac_lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config)
    x = RATIOS.log()
    a0, a1 = 1.0, -2.0
    row0 = [min(v, min(max(v, -0.4), 0.4)) for v in x[0].tolist()]  # A > 0: capped above only
    row1 = [max(v, min(max(v, -0.4), 0.4)) for v in x[1, :2].tolist()]  # A < 0: floored below only
    hand = (-a0 * math.exp(sum(row0) / 3) - a1 * math.exp(sum(row1) / 2)) / 2
    assert pg_loss.item() == pytest.approx(hand, rel=1e-6)
    # verl's metrics: log-ratios outside [-0.4, 0.4] (clamped or not by the sign-aware min), by the sign of A
    out = [abs(v) > 0.4 for v in x[0].tolist()], [abs(v) > 0.4 for v in x[1, :2].tolist()]
    assert (clipfrac.item(), clipfrac_lower.item()) == (pytest.approx(sum(out[0]) / 5), pytest.approx(sum(out[1]) / 5))
    assert sum(out[0]) + sum(out[1]) > 0


def test_geo_mean_takes_the_geometric_mean_of_a_response_s_rollout_is_weights():
    """verl's geo_mean weights a response by ``exp(mean_t log(w + 1e-10))`` of its tokens' ``rollout_is_weights``, not
    each token by its own (the per-token product was 0.1640 where verl's is 0.1821 on a larger case); both entry
    points; one weight a response (``(B,)``) is the same in both readings."""
    weights = torch.tensor([[0.5, 2.0, 1.0], [0.25, 1.5, 9.0]], dtype=torch.float64)
    config = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4, "policy_loss": {"loss_mode": "geo_mean"}}
    log_prob = _log_prob()
    per_response = torch.stack([(weights[0].log().sum() / 3).exp(), (weights[1, :2].log().sum() / 2).exp()])
    got = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config, weights)[0]
    expected = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config, per_response)[0]
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)  # verl's +1e-10 in the log, +1e-8 in the count
    plain = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config)[0]
    assert got != plain
    # by hand: -mean_i w_i A_i exp(mean_t of the sign-aware clipped log-ratios), as test_geo_mean_hand_values
    x = RATIOS.log()
    row0 = [min(v, min(max(v, -0.4), 0.4)) for v in x[0].tolist()]
    row1 = [max(v, min(max(v, -0.4), 0.4)) for v in x[1, :2].tolist()]
    w0, w1 = per_response.tolist()
    hand = (-1.0 * w0 * math.exp(sum(row0) / 3) + 2.0 * w1 * math.exp(sum(row1) / 2)) / 2
    assert got.item() == pytest.approx(hand, rel=1e-7)
    # from hidden states: logits h W^T whose log-probs are the same function, checked against the per-response weights
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(11, 8, generator=g)
    responses = torch.randint(0, 11, (2, 3), generator=g)
    old = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, responses[..., None])[..., 0].detach() - 0.3
    args = (hidden, weight, responses, old, torch.tensor([1.0, -2.0]), MASK, "token-mean", config)
    got = compute_policy_loss_from_hidden(*args, rollout_is_weights=weights.float())[0]
    expected = compute_policy_loss_from_hidden(*args, rollout_is_weights=per_response.float())[0]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_rollout_is_weights_hand_values():
    """verl's ``pg_losses * rollout_is_weights``: the token losses of TOKEN_LOSS times the weights
    (row 1's weight 0 silences its dual-capped token; the masked 9.0 is never read), the clip metrics
    unchanged."""
    weights = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.5, 9.0]], dtype=torch.float64)
    log_prob = _log_prob()
    pg_loss, clipfrac, _, clipfrac_lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", CONFIG,
                                                               weights)
    assert pg_loss.item() == pytest.approx((-1.2 * 0.5 - 0.5 * 2.0 - 1.0 * 1.0 + 6.0 * 0.0 + 1.6 * 1.5) / 5, rel=1e-6)
    assert clipfrac.item() == pytest.approx(0.4) and clipfrac_lower.item() == pytest.approx(0.2)
    pg_loss.backward()
    expected = torch.tensor([[0.0, -0.5 * 2.0 / 5, -1.0 * 1.0 / 5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-6, atol=1e-9)


def test_dual_clip_c_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", {"clip_ratio_c": 1.0})


@pytest.mark.parametrize("info", ["local", "global"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "token-sum"])
def test_from_hidden_matches_verl_actor_composition(agg, info):
    """verl's actor loss: pg_loss - entropy_coeff * agg(H) + kl_loss_coef * agg(kl), on log-probs of the
    tempered logits ``hidden @ W.T``; here built by hand from the reference log-softmax."""
    g = torch.Generator().manual_seed(0)
    batch, length, hidden_size, vocab, tau = 3, 5, 8, 1000, 0.7
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.3
    responses = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.randn(batch, 1, generator=g).expand(batch, length)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden @ weight.T / tau, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    old = lp0 + 0.3 * torch.randn(lp0.shape, generator=g)
    ref = lp0 + 0.3 * torch.randn(lp0.shape, generator=g)
    config = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "use_kl_loss": True, "kl_loss_coef": 0.05,
              "kl_loss_type": "low_var_kl", "entropy_coeff": 0.01, "global_batch_info": GLOBAL_INFOS[info],
              # ppo_loss copies the actor's loss_scale_factor into global_batch_info (overwriting it)
              "loss_scale_factor": GLOBAL_INFOS[info].get("loss_scale_factor")}

    def verl_agg(x):
        return _verl_agg(x, mask, agg, **GLOBAL_INFOS[info])

    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp_all = torch.log_softmax(h_ref @ w_ref.T / tau, -1)
    log_prob = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pg_loss = verl_agg(_verl_pg_losses("vanilla", old, log_prob, adv, mask, config))
    d = (ref - log_prob).clamp(-20, 20)
    kl = (d.exp() - d - 1).clamp(-10, 10)  # verl's low_var_kl

    expected = pg_loss - 0.01 * verl_agg(entropy) + 0.05 * verl_agg(kl)
    expected.backward()

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got, clipfrac, ppo_kl, lower, out = compute_policy_loss_from_hidden(
        h, w, responses, old, adv, mask, agg, config, ref_log_prob=ref, temperature=tau)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-6)
    _, clipfrac_ref, ppo_kl_ref, lower_ref = compute_policy_loss(old, log_prob.detach(), adv, mask, agg, config)
    torch.testing.assert_close(clipfrac, clipfrac_ref)
    torch.testing.assert_close(ppo_kl, ppo_kl_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lower, lower_ref)
    assert clipfrac > 0


@pytest.mark.parametrize("loss_mode", ["gspo", "geo_mean", "sapo"])
def test_from_hidden_sequence_modes_refuse_a_second_aggregation(loss_mode):
    """verl 0.9 aggregates sapo's policy term by seq-mean-token-mean, geo_mean's by a mean over all B responses,
    and the actor's KL / entropy terms by loss_agg_mode over the non-empty (or global) responses: one fused pass
    cannot, so sapo with another loss_agg_mode and geo_mean with a KL or entropy term raise; gspo follows
    loss_agg_mode (verl 0.9) and runs."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(50, 8, generator=g)
    responses, mask = torch.randint(0, 50, (2, 3), generator=g), torch.ones(2, 3)
    old, adv = -torch.rand(2, 3, generator=g) * 3, torch.randn(2, 3, generator=g)
    config = {"policy_loss": {"loss_mode": loss_mode}, "entropy_coeff": 0.01}
    if loss_mode == "gspo":
        compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "token-mean", config)
    else:
        with pytest.raises(NotImplementedError, match="one fused pass cannot"):
            compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "token-mean", config)
    if loss_mode == "geo_mean":
        with pytest.raises(NotImplementedError, match="a mean over all B responses"):
            compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "seq-mean-token-mean", config)
    else:
        compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "seq-mean-token-mean", config)
    compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "token-mean",
                                    dict(config, entropy_coeff=0.0))


def test_kl_loss_without_ref_log_prob_raises():
    """``use_kl_loss=True`` without ``ref_log_prob``: verl's actor reads ``data["ref_log_prob"]``; the KL term was
    silently left out."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(50, 8, generator=g)
    responses, mask = torch.randint(0, 50, (2, 3), generator=g), torch.ones(2, 3)
    old, adv = -torch.rand(2, 3, generator=g) * 3, torch.randn(2, 3, generator=g)
    config = {"use_kl_loss": True, "kl_loss_coef": 0.1}
    with pytest.raises(ValueError, match="use_kl_loss=True needs ref_log_prob"):
        compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "token-mean", config)
    compute_policy_loss_from_hidden(hidden, weight, responses, old, adv, mask, "token-mean", config,
                                    ref_log_prob=old - 0.1)


def test_weighted_response_mask_raises():
    """verl multiplies by ``response_mask``; fused_rl does not weight tokens, so a mask other than 0 / 1
    raises instead of being rounded to 1."""
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        compute_policy_loss(OLD, _log_prob(), ADV, MASK * 0.5, "token-mean", CONFIG)


def _bad(name, value):
    """compute_policy_loss's tensor arguments (the hand-value batch) with ``name`` replaced by ``value``."""
    args = dict(old_log_prob=OLD, log_prob=_log_prob(), advantages=ADV, response_mask=MASK)
    args[name] = value
    return args


NAN = float("nan")


@pytest.mark.parametrize("name, value, needle", [
    ("log_prob", OLD[0], "log_prob must be a floating (B, T)"),
    ("log_prob", OLD.long(), "log_prob must be a floating (B, T)"),
    ("old_log_prob", OLD[:, :2], "old_log_prob must have shape (2, 3)"),
    ("old_log_prob", OLD.long(), "old_log_prob must be a floating tensor"),
    ("old_log_prob", None, "old_log_prob is required"),
    ("old_log_prob", OLD.index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(NAN, dtype=torch.float64)),
     "old_log_prob contain NaN or inf"),
    ("old_log_prob", -OLD, "old_log_prob must be log-probabilities"),  # a negative log-likelihood
    ("advantages", ADV[:, :2], "advantages must have shape (2, 3) or (2,)"),
    ("advantages", ADV[:, 0].reshape(2, 1), "advantages must have shape (2, 3) or (2,)"),
    ("advantages", ADV.long(), "advantages must be a floating tensor"),
    ("advantages", ADV.index_put((torch.tensor(1), torch.tensor(0)), torch.tensor(NAN, dtype=torch.float64)),
     "advantages contain NaN or inf"),
    ("advantages", torch.tensor([1.0, math.inf], dtype=torch.float64), "advantages contain NaN or inf"),
    ("response_mask", MASK[:1], "response_mask must have shape (2, 3)"),
    ("response_mask", MASK * 2, "response_mask must contain only 0 and 1"),
    ("rollout_is_weights", torch.ones(3, 2, dtype=torch.float64), "rollout_is_weights must have shape (2, 3)"),
    ("rollout_is_weights", -torch.ones(2, 3, dtype=torch.float64), "rollout_is_weights must be finite and >= 0"),
    ("rollout_is_weights", torch.full((2, 3), NAN, dtype=torch.float64), "rollout_is_weights must be finite"),
])
def test_bad_inputs_raise_naming_the_argument(name, value, needle):
    """Every verl argument is checked (shape, dtype, and finite / log-prob / 0-1 / >= 0 values where
    response_mask is set), the ValueError naming it as verl does; the fused entry point checks the same."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        compute_policy_loss(**_bad(name, value), loss_agg_mode="token-mean", config=CONFIG)
    if name == "log_prob":
        return
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 3, 8, dtype=torch.float64, generator=g), torch.randn(50, 8, dtype=torch.float64)
    args = dict(_bad(name, value), hidden=hidden, weight=weight, responses=torch.randint(0, 50, (2, 3), generator=g))
    del args["log_prob"]
    with pytest.raises(ValueError, match=re.escape(needle)):
        compute_policy_loss_from_hidden(**args, loss_agg_mode="token-mean", config=CONFIG)


def test_device_mismatch_names_log_prob():
    with pytest.raises(ValueError, match="advantages is on meta but log_prob is on cpu"):
        compute_policy_loss(OLD, _log_prob(), ADV.to("meta"), MASK)


@pytest.mark.parametrize("responses, needle", [
    (torch.zeros(2, 3), "responses must be an int32 or int64 tensor"),
    (None, "responses must be an int32 or int64 tensor"),
    (torch.zeros(2, 2, dtype=torch.long), "responses must have shape (2, 3)"),
    (torch.zeros(2, 3, dtype=torch.long).to("meta"), "responses is on meta but hidden is on cpu"),
])
def test_from_hidden_bad_responses(responses, needle):
    hidden, weight = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(needle)):
        compute_policy_loss_from_hidden(hidden, weight, responses, OLD, ADV, MASK)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "geo_mean", "gpg", "sapo", "cispo"])
def test_per_sequence_advantages_broadcast_over_tokens(loss_mode):
    """A (B,) tensor is per sequence (TRL's habit), broadcast over its tokens: with B == T (where numpy-style
    broadcasting would silently spread it over the tokens' axis instead) and B != T, the result is that of the
    (B, T) advantages, as compute_policy_loss_from_hidden's."""
    g = torch.Generator().manual_seed(3)
    config = {"clip_ratio": 0.2, "policy_loss": {"loss_mode": loss_mode}}
    if loss_mode == "cispo":
        config["clip_ratio_low"] = 1.0
    for batch, length in ((4, 4), (4, 6)):
        old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
        log_prob = old + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
        adv, mask = torch.randn(batch, generator=g, dtype=torch.float64), torch.ones(batch, length)
        weights = torch.rand(batch, generator=g, dtype=torch.float64)
        got = compute_policy_loss(old, log_prob, adv, mask, "token-mean", config, weights)
        want = compute_policy_loss(old, log_prob, adv[:, None].expand(batch, length), mask, "token-mean", config,
                                   weights[:, None].expand(batch, length))
        for g_value, w_value in zip(got, want):
            torch.testing.assert_close(g_value, w_value)


def test_padding_may_hold_nan():
    """Positions where response_mask is 0 are never read: NaN / inf / positive values there are accepted and
    change nothing (verl pads with whatever the rollout left)."""
    want = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", CONFIG, torch.ones_like(OLD))
    pad = torch.zeros_like(MASK, dtype=torch.bool)
    pad[1, 2] = True
    got = compute_policy_loss(OLD.masked_fill(pad, NAN), _log_prob(), ADV.masked_fill(pad, math.inf),
                              MASK.bool(), "token-mean", CONFIG, torch.ones_like(OLD).masked_fill(pad, -1.0))
    for g_value, w_value in zip(got, want):
        torch.testing.assert_close(g_value, w_value)
    adv = torch.tensor([1.0, NAN], dtype=torch.float64)  # a (B,) advantage of an empty response is not read either
    compute_policy_loss(OLD, _log_prob(), adv, MASK * torch.tensor([[1.0], [0.0]], dtype=torch.float64))


def test_check_inputs_false_skips_the_value_checks():
    adv = ADV.clone()
    adv[0, 0] = NAN
    assert compute_policy_loss(OLD, _log_prob(), adv, MASK, check_inputs=False)[0].isnan()


# --- sapo / cispo against transcriptions of verl 0.9.1 (compute_policy_loss_sapo / _cispo, agg_loss), which
# return (loss, {pg_clipfrac, ppo_kl, pg_clipfrac_lower}).
def _verl_agg(loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
              loss_scale_factor=None):
    """verl 0.9.1's agg_loss with a global_batch_info: token-mean over the global token count, token-sum times
    dp_size, seq-mean-* over the global count of responses (locally: those with a token)."""
    total = (loss_mat * mask).sum()
    if mode == "token-mean":
        return total / (mask.sum() if batch_num_tokens is None else batch_num_tokens) * dp_size
    if mode == "token-sum":
        return total * dp_size
    seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (mask.sum(-1) + 1e-8)
    nonempty = (mask.sum(-1) > 0).to(seq.dtype)
    rows = nonempty.sum() if global_batch_size is None else global_batch_size
    loss = (seq * nonempty).sum() / rows * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or mask.shape[-1])
    return loss


def _verl_sapo_cispo(mode, old, log_prob, adv, mask, agg, config, weights=None, mat=False):
    """verl 0.9.1's sapo / cispo: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, or with ``mat`` the per-token
    losses before agg_loss."""
    log_ratio = (log_prob - old).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    masked_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    zero = torch.zeros((), dtype=old.dtype)
    if mode == "sapo":
        tau = torch.where(adv > 0, torch.tensor(config["tau_pos"], dtype=adv.dtype),
                          torch.tensor(config["tau_neg"], dtype=adv.dtype))
        pg_losses, agg, clipfrac = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, "seq-mean-token-mean", zero
    else:
        clipped = ratio.clamp(1 - config["clip_ratio_low"], 1 + config["clip_ratio_high"])
        pg_losses = -clipped.detach() * adv * log_prob
        clipfrac = masked_mean((ratio != clipped).to(old.dtype))
    if weights is not None:
        pg_losses = pg_losses * weights
    if mat:
        return pg_losses
    return _verl_agg(pg_losses, mask, agg), clipfrac, masked_mean(-log_ratio), zero


NEW_CONFIGS = {
    "sapo": {"tau_pos": 0.9, "tau_neg": 1.3, "clip_ratio": 0.2, "policy_loss": {"loss_mode": "sapo"}},
    "cispo": {"clip_ratio": 0.2, "clip_ratio_low": 1.0, "clip_ratio_high": 0.28, "policy_loss": {"loss_mode": "cispo"}},
}


def _ragged_batch(seed, lengths=(7, 3, 0, 5, 1)):
    """Ragged responses (one empty), advantages of both signs (and 0), ratios well beyond the clip bounds."""
    g = torch.Generator().manual_seed(seed)
    batch, length = len(lengths), max(lengths)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).to(torch.float64)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 - 0.05
    log_prob = old + 0.8 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv[0, :2] = 0.0
    weights = torch.rand(batch, length, generator=g, dtype=torch.float64) * 2
    return old, log_prob, adv, mask, weights


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("agg", sorted(HAND))
@pytest.mark.parametrize("mode", ["sapo", "cispo"])
def test_sapo_cispo_parity_with_verl(mode, agg, with_weights):
    """Loss, d loss / d log_prob and the three metrics equal the transcription of the newer verl, for every
    loss_agg_mode (sapo ignores it, as verl), ragged responses with an empty one, A > 0, A < 0 and A = 0."""
    old, lp, adv, mask, weights = _ragged_batch(4)
    weights = weights if with_weights else None
    ratio = (lp - old).exp()[mask.bool()]
    assert (ratio > 1.28).any() and (ratio < 0.8).any() and (adv[mask.bool()] > 0).any() and (adv < 0).any()
    log_prob, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got = compute_policy_loss(old, log_prob, adv, mask, agg, NEW_CONFIGS[mode], weights)
    want = _verl_sapo_cispo(mode, old, ref_lp, adv, mask, agg, NEW_CONFIGS[mode], weights)
    for g_value, w_value in zip(got, want):
        torch.testing.assert_close(g_value.to(torch.float64), w_value, rtol=1e-6, atol=1e-9)
    got[0].backward()
    want[0].backward()
    torch.testing.assert_close(log_prob.grad, ref_lp.grad, rtol=1e-6, atol=1e-9)
    if mode == "cispo":
        assert got[1] > 0


def test_sapo_cispo_config_mapping():
    config = SimpleNamespace(tau_pos=0.5, tau_neg=2.0, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                             global_batch_info={"dp_size": 1, "batch_num_tokens": None},
                             policy_loss=SimpleNamespace(loss_mode="sapo"))
    cfg = policy_loss_config_from_verl(config, "token-mean", response_length=4)
    assert cfg == PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0,
                                   agg="seq-mean-token-mean")
    cfg = policy_loss_config_from_verl({"policy_loss": {"loss_mode": "sapo"}}, response_length=4)
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)  # verl's ActorConfig defaults
    cfg = policy_loss_config_from_verl({"clip_ratio": 0.2, "clip_ratio_low": 5.0, "clip_ratio_high": 4.0,
                                        "policy_loss": {"loss_mode": "cispo"}}, "seq-mean-token-sum-norm",
                                       response_length=8)
    assert cfg == PolicyLossConfig(policy_loss="cispo", clip_low=0.0, clip_high=4.0, agg="seq-mean-token-sum-norm",
                                   max_len=8)


@pytest.mark.parametrize("mode, agg", [("sapo", "seq-mean-token-mean"), ("cispo", "seq-mean-token-sum"),
                                       ("cispo", "token-mean")])
def test_from_hidden_sapo_cispo_matches_verl_actor(mode, agg):
    """The fused pass equals verl's actor composition on its log-softmax: the policy term of the transcription,
    - entropy_coeff * agg(H) + kl_loss_coef * agg(low_var_kl), each by the newer agg_loss (empty response skipped)."""
    g = torch.Generator().manual_seed(5)
    lengths, hidden_size, vocab, tau = (5, 2, 0, 4), 8, 300, 0.8
    batch, length = len(lengths), max(lengths)
    hidden = torch.randn(batch, length, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * 0.5
    responses = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).to(torch.float64)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden @ weight.T / tau, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    old = lp0 + 0.6 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    ref = lp0 + 0.3 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    config = dict(NEW_CONFIGS[mode], use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                  entropy_coeff=0.01)

    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp_all = torch.log_softmax(h_ref @ w_ref.T / tau, -1)
    log_prob = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pg_loss, *metrics = _verl_sapo_cispo(mode, old, log_prob, adv, mask, agg, config)
    d = (ref - log_prob).clamp(-20, 20)
    kl = (d.exp() - d - 1).clamp(-10, 10)
    expected = pg_loss - 0.01 * _verl_agg(entropy, mask, agg) + 0.05 * _verl_agg(kl, mask, agg)
    expected.backward()

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got, *got_metrics, _ = compute_policy_loss_from_hidden(h, w, responses, old, adv, mask, agg, config,
                                                           ref_log_prob=ref, temperature=tau, backend="torch")
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-9)
    for g_value, w_value in zip(got_metrics, metrics):
        torch.testing.assert_close(g_value.to(torch.float64), w_value.detach(), rtol=1e-6, atol=1e-9)


# --- verl 0.9.1's global_batch_info (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor), which its
# ppo_loss always sets, for every loss mode and loss_agg_mode (token-sum included).
def _verl_pg_losses(mode, old, log_prob, adv, mask, config):
    """verl 0.9.1's per-token policy losses (vanilla, gspo, gpg; sapo / cispo: :func:`_verl_sapo_cispo`)."""
    low, high = 1 - config.get("clip_ratio", 0.2), 1 + config.get("clip_ratio", 0.2)
    if mode == "vanilla":
        ratio = (log_prob - old).clamp(-20.0, 20.0).exp()
        clip1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
        return torch.where(adv < 0, torch.minimum(-adv * config["clip_ratio_c"], clip1), clip1)
    if mode == "gspo":
        seq = ((log_prob - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        ratio = (log_prob - log_prob.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0).exp()
        return torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    return -log_prob * adv  # gpg


GLOBAL_INFOS = {
    "local": {},
    "global": {"dp_size": 2, "batch_num_tokens": 9.0, "global_batch_size": 5.0, "loss_scale_factor": 6},
    "global-tensors": {"dp_size": 4, "batch_num_tokens": torch.tensor(31.0), "global_batch_size": torch.tensor(11)},
}


@pytest.mark.parametrize("info", sorted(GLOBAL_INFOS))
@pytest.mark.parametrize("agg", sorted(HAND) + ["token-sum"])
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "sapo", "cispo"])
def test_global_batch_info_matches_verl_agg_loss(mode, agg, info):
    """Loss and d loss / d log_prob against verl 0.9.1's per-token losses aggregated by its agg_loss with the
    global_batch_info, on ragged responses with an empty one (verl averages seq-mean-* over the non-empty ones
    locally, over global_batch_size otherwise); sapo aggregates by seq-mean-token-mean whatever loss_agg_mode."""
    old, lp, adv, mask, _ = _ragged_batch(6)
    batch_info = GLOBAL_INFOS[info]
    config = dict(NEW_CONFIGS.get(mode, {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "policy_loss": {"loss_mode": mode}}),
                  global_batch_info=batch_info)
    log_prob, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got = compute_policy_loss(old, log_prob, adv, mask, agg, config)[0]
    if mode in ("sapo", "cispo"):
        losses = _verl_sapo_cispo(mode, old, ref_lp, adv, mask, "token-sum", config, mat=True)
    else:
        losses = _verl_pg_losses(mode, old, ref_lp, adv, mask, config)
    want = _verl_agg(losses, mask, "seq-mean-token-mean" if mode == "sapo" else agg, **batch_info)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    got.backward()
    want.backward()
    torch.testing.assert_close(log_prob.grad, ref_lp.grad, rtol=1e-6, atol=1e-9)
    assert log_prob.grad.abs().sum() > 0


def test_geo_mean_ignores_global_batch_info():
    """verl's geo_mean takes torch.mean over the B responses and never reads global_batch_info."""
    config = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4, "policy_loss": {"loss_mode": "geo_mean"}}
    local = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config)[0]
    global_ = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-sum",
                                  dict(config, global_batch_info=GLOBAL_INFOS["global"]))[0]
    assert local.item() == global_.item()


@pytest.mark.parametrize("info, needle", [({"dp_size": 2}, "batch_num_tokens is required"),
                                          ({"dp_size": 2, "batch_num_tokens": 8}, None),
                                          ({"dp_size": 0}, "positive integer"), ({"dp_size": 2.5}, "positive")])
def test_dp_size_above_one_needs_the_global_counts(info, needle):
    """As verl's agg_loss: with dp_size > 1 the local counts would be wrong, so the global ones are required."""
    config = {"global_batch_info": info}
    if needle is None:
        compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config)
        with pytest.raises(ValueError, match="global_batch_size is required"):
            compute_policy_loss(OLD, _log_prob(), ADV, MASK, "seq-mean-token-mean", config)
    else:
        with pytest.raises(ValueError, match=needle):
            compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config)


def test_get_policy_loss_fn_has_verl_s_registered_signature():
    """verl 0.9.1's registered losses return (pg_loss, {actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower});
    gpg returns no metrics; an unsupported mode raises when the function is made, not at the first step."""
    fn = get_policy_loss_fn("vanilla")
    loss, metrics = fn(OLD, _log_prob(), ADV, MASK, "seq-mean-token-mean", CONFIG, rollout_is_weights=None)
    expected = compute_policy_loss(OLD, _log_prob(), ADV, MASK, "seq-mean-token-mean", CONFIG)
    assert loss.item() == expected[0].item() == pytest.approx(HAND["seq-mean-token-mean"])
    assert list(metrics) == ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"]
    assert [m.item() for m in metrics.values()] == [e.item() for e in expected[1:]]
    assert get_policy_loss_fn("gpg")(OLD, _log_prob(), ADV, MASK, config={})[1] == {}
    cispo = {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28}  # built without a config, run with one
    assert get_policy_loss_fn("cispo")(OLD, _log_prob(), ADV, MASK, config=cispo)[0].item() == \
        compute_policy_loss(OLD, _log_prob(), ADV, MASK, config=cispo, loss_mode="cispo")[0].item()
    # verl's default loss_agg_mode of each function: gspo and sapo seq-mean-token-mean
    gspo = {"clip_ratio": 0.2}
    assert get_policy_loss_fn("gspo")(OLD, _log_prob(), ADV, MASK, config=gspo)[0].item() == \
        compute_policy_loss(OLD, _log_prob(), ADV, MASK, "seq-mean-token-mean", gspo, loss_mode="gspo")[0].item()
    with pytest.raises(NotImplementedError, match="ppo_pi"):
        get_policy_loss_fn("ppo_pi")


def test_ppo_kl_is_verl_s_clamped_log_ratio():
    """vanilla / sapo / cispo compute ppo_kl from the log ratio clamped to [-20, 20]: log r = (25, 0) gives -10."""
    old = torch.tensor([[-30.0, -1.0]], dtype=torch.float64)
    log_prob = old + torch.tensor([[25.0, 0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([[-1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2)
    assert compute_policy_loss(old, log_prob, adv, mask, "token-mean", CONFIG)[2].item() == -10.0
    gspo = compute_policy_loss(old, log_prob, adv, mask, "token-mean", {"policy_loss": {"loss_mode": "gspo"}})
    assert gspo[2].item() == -12.5  # verl's gspo: unclamped


# --- shared by the parity tests of the newer modes
def _check_parity(lp, ours, verl):
    """``ours(log_prob)`` and ``verl(log_prob)``, 4-tuples ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``,
    equal in value and in ``d pg_loss / d log_prob``; returns ours."""
    log_prob, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got, want = ours(log_prob), verl(ref_lp)
    for g_value, w_value in zip(got, want):
        torch.testing.assert_close(g_value.to(torch.float64), w_value, rtol=1e-6, atol=1e-9)
    got[0].backward()
    want[0].backward()
    torch.testing.assert_close(log_prob.grad, ref_lp.grad, rtol=1e-6, atol=1e-9)
    return got


def _check_fused_parity(seed, lengths, tau, agg, backend, behind_spread, verl_terms, fused_call,
                        weight_scale=1.0, likely=False):
    """The fused entry point on ``backend`` against verl's actor composition on a full fp64 log-softmax: a random
    actor (hidden 8, vocab 40; ``likely``: every other response token the row's argmax, as sampled tokens often
    are) and the old (or rollout) log-probs ``behind`` = its log-probs plus ``behind_spread`` noise. ``verl_terms(
    behind, log_prob, entropy, adv, mask)`` -> ``(expected loss, *metrics)`` in fp64; ``fused_call(hidden, weight,
    responses, behind, adv, mask)`` -> ``compute_policy_loss_from_hidden``'s value. Compares loss, the hidden and
    weight gradients and the metrics; returns the fused metrics."""
    if fused_rl.available_backends()[backend] is not None:
        pytest.skip(fused_rl.available_backends()[backend])
    g = torch.Generator().manual_seed(seed)
    batch, length, hidden_size, vocab = len(lengths), max(lengths), 8, 40
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * weight_scale
    responses = torch.randint(0, vocab, (batch, length), generator=g)
    if likely:
        responses[:, ::2] = (hidden @ weight.T).argmax(-1)[:, ::2]
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).to(torch.float32)
    adv = torch.randn(batch, length, generator=g)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden.double() @ weight.double().T / tau, -1).gather(
            -1, responses.unsqueeze(-1)).squeeze(-1)
    behind = (lp0 + behind_spread * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).clamp(max=0.0).float()

    h_ref, w_ref = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp_all = torch.log_softmax(h_ref @ w_ref.T / tau, -1)
    log_prob = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    expected, *metrics = verl_terms(behind.double(), log_prob, entropy, adv.double(), mask.double())
    expected.backward()

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got, *got_metrics, _ = fused_call(h, w, responses, behind, adv, mask)
    got.backward()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)
    for g_value, w_value in zip(got_metrics, metrics):
        torch.testing.assert_close(g_value.double(), w_value.detach(), rtol=1e-5, atol=1e-6)
    return got_metrics


# --- DPPO (dppo_tv, dppo_kl) and DRO, verl 0.9.1's newest loss modes
def _verl_dppo_dro(mode, old, log_prob, adv, mask, agg, config, weights=None):
    """verl 0.9.1's ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` / ``_dro`` transcribed: ``(pg_loss, pg_clipfrac,
    ppo_kl, pg_clipfrac_lower)`` (dro: 0 clip fractions; verl returns ppo_kl alone)."""
    masked_mean = lambda x: (x * mask).sum() / (mask.sum() + 1e-8)  # noqa: E731
    zero = torch.zeros((), dtype=old.dtype)
    if mode == "dro":
        log_ratio = log_prob - old
        pg_losses = -(log_prob * adv - 0.5 * config["policy_loss"]["dro_beta"] * log_ratio.square())
        if weights is not None:
            pg_losses = pg_losses * weights
        return _verl_agg(pg_losses, mask, agg), zero, masked_mean(-log_ratio), zero
    negative_approx_kl = torch.clamp(log_prob - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=config.get("clip_ratio_c", 20.0)).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old)
    high = config.get("clip_ratio_high") or config["clip_ratio"]
    low = config.get("clip_ratio_low") or config["clip_ratio"]
    if mode == "dppo_tv":
        valid_pos, valid_neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old - log_prob) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) /
                                                                             (1.0 - prob + 1e-8))
        valid_pos = (binary_kl <= high) | (prob <= old_prob)
        valid_neg = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach().float()
    pg_losses = -adv * truncated_ratio * log_prob * valid
    if weights is not None:
        pg_losses = pg_losses * weights
    clip_c = config.get("clip_ratio_c", 20.0)
    return (_verl_agg(pg_losses, mask, agg), masked_mean(1.0 - valid), masked_mean(-negative_approx_kl),
            masked_mean((ratio > clip_c).float() * valid))


DPPO_DRO_CONFIGS = {
    "dppo_tv": {"clip_ratio": 0.2, "clip_ratio_low": 0.05, "clip_ratio_high": 0.1, "clip_ratio_c": 2.0,
                "policy_loss": {"loss_mode": "dppo_tv"}},
    "dppo_kl": {"clip_ratio": 0.2, "clip_ratio_low": 0.02, "clip_ratio_high": 0.01, "clip_ratio_c": 2.0,
                "policy_loss": {"loss_mode": "dppo_kl"}},
    "dro": {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.3}},
}


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("agg", sorted(HAND) + ["token-sum"])
@pytest.mark.parametrize("mode", sorted(DPPO_DRO_CONFIGS))
def test_dppo_dro_parity_with_verl(mode, agg, with_weights):
    """Loss, d loss / d log_prob and the three metrics equal verl 0.9.1's dppo_tv / dppo_kl / dro (transcribed), on
    ragged responses with an empty one, A > 0, A < 0 and A = 0; the trust regions drop tokens of both signs of A and
    dppo_kl keeps some beyond its bound (p <= q with A > 0); rollout_is_weights (dppo) multiply the policy term."""
    if mode == "dro" and with_weights:
        pytest.skip("refused: test_dro_refuses_rollout_is_weights")
    old, lp, adv, mask, weights = _ragged_batch(9)
    lp = lp.clamp(max=-1e-3)  # log-probs
    weights = weights if with_weights else None
    config = DPPO_DRO_CONFIGS[mode]
    got = _check_parity(lp, lambda x: compute_policy_loss(old, x, adv, mask, agg, config, weights),
                        lambda x: _verl_dppo_dro(mode, old, x, adv, mask, agg, config, weights))
    if mode != "dro":  # the masks and the truncation bind
        keep = dppo_keep(lp, old, adv, policy_loss_config_from_verl(config, agg, response_length=7))
        valid = mask.bool()
        assert (~keep & valid & (adv > 0)).any() and (~keep & valid & (adv < 0)).any() and (keep & valid).any()
        assert got[3] > 0
    if mode == "dppo_kl":
        p, q = lp.exp(), old.exp()
        div = q * (old - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        assert (valid & (adv > 0) & (div > 0.01) & (p <= q)).any()


def test_dppo_and_dro_hand_values():
    """The module's two responses (ratios 1.5, 0.5, 1 | 4, 0.5; A = 1 | -2; old log-probs -1, -2, -0.5 | -3, -1.5),
    probabilities p = q r: p - q = 0.184, -0.068, 0 | 0.149, -0.112. dppo_tv with bounds 0.1 drops token 1 (A > 0,
    0.184 > 0.1) and token 5 (A < 0, -0.112 < -0.1); the binary KL (0.068 | 0.050 for those two) with bounds 0.05
    (A > 0) / 0.06 (A < 0) drops token 1 only. Kept: ``l = -min(r, 3) A logp``, token 4's weight 4 truncated at
    clip_ratio_c = 3. dro (beta 0.5): ``l = -A logp + 0.25 log(r)^2``, slope ``-A + 0.5 log r``."""
    logp = OLD + RATIOS.log()
    weight = RATIOS.clamp(max=3.0)
    for mode, bounds, keep in (("dppo_tv", (0.1, 0.1), [[0, 1, 1], [1, 0, 0]]),
                               ("dppo_kl", (0.06, 0.05), [[0, 1, 1], [1, 1, 0]])):
        config = dict(CONFIG, clip_ratio_low=bounds[0], clip_ratio_high=bounds[1], policy_loss={"loss_mode": mode})
        log_prob = _log_prob()
        pg_loss, clipfrac, _, lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config)
        k = torch.tensor(keep, dtype=torch.float64)
        assert pg_loss.item() == pytest.approx((-weight * ADV * logp * k).sum().item() / 5, rel=1e-9)
        assert clipfrac.item() == pytest.approx((5 - k.sum().item()) / 5)
        assert lower.item() == pytest.approx(1 / 5)  # token 4: r = 4 > 3, kept
        pg_loss.backward()
        torch.testing.assert_close(log_prob.grad, -weight * ADV * k / 5)
    config = {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.5}}
    log_prob = _log_prob()
    pg_loss, clipfrac, ppo_kl, lower = compute_policy_loss(OLD, log_prob, ADV, MASK, "token-mean", config)
    per_token = (-ADV * logp + 0.25 * RATIOS.log() ** 2) * MASK
    assert pg_loss.item() == pytest.approx(per_token.sum().item() / 5, rel=1e-9)
    assert (clipfrac.item(), lower.item()) == (0.0, 0.0)
    assert ppo_kl.item() == pytest.approx(-math.log(1.5 * 0.5 * 1.0 * 4.0 * 0.5) / 5, rel=1e-6)
    pg_loss.backward()
    torch.testing.assert_close(log_prob.grad, (-ADV + 0.5 * RATIOS.log()) * MASK / 5)
    assert get_policy_loss_fn("dro")(OLD, _log_prob(), ADV, MASK, config=config)[1].keys() == {"actor/ppo_kl"}


def test_dppo_and_dro_config_mapping():
    cfg = policy_loss_config_from_verl({"clip_ratio": 0.2, "clip_ratio_high": 0.3,
                                        "policy_loss": {"loss_mode": "dppo_kl"}}, response_length=4)
    # verl reads the truncation with config.get("clip_ratio_c", 20.0)
    assert cfg == PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.2, clip_high=0.3, delta=20.0)
    actor = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                            policy_loss=SimpleNamespace(loss_mode="dppo_tv"))
    assert policy_loss_config_from_verl(actor, response_length=4).delta == 3.0  # an ActorConfig's own default
    cfg = policy_loss_config_from_verl({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.2}}, "seq-mean-token-mean",
                                       response_length=4)
    assert cfg == PolicyLossConfig(policy_loss="reinforce", kl="k2", beta=0.2, agg="seq-mean-token-mean")
    for beta in (None, 0.0, -1.0, True):
        with pytest.raises(ValueError, match="dro_beta must be a positive value"):
            policy_loss_config_from_verl({"policy_loss": {"loss_mode": "dro", "dro_beta": beta}}, response_length=4)


def test_dro_refuses_rollout_is_weights():
    """verl weights DRO's quadratic penalty too; fused_rl's KL term (the penalty here) is never weighted."""
    config = DPPO_DRO_CONFIGS["dro"]
    with pytest.raises(NotImplementedError, match="dro.*rollout_is_weights"):
        compute_policy_loss(OLD, _log_prob(), ADV, MASK, "token-mean", config, torch.ones_like(OLD))
    hidden, weight = torch.randn(2, 3, 4), torch.randn(10, 4)
    with pytest.raises(NotImplementedError, match="dro.*rollout_is_weights"):
        compute_policy_loss_from_hidden(hidden, weight, torch.zeros(2, 3, dtype=torch.long), OLD, ADV, MASK,
                                        config=config, rollout_is_weights=torch.ones_like(OLD))


@pytest.mark.parametrize("mode", sorted(DPPO_DRO_CONFIGS))
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_from_hidden_dppo_dro_matches_verl_actor(mode, backend):
    """The fused pass (dppo: the kernels' epilogue on the tiled route; dro: reinforce plus k2 against the old
    log-probs) equals verl's actor composition on its log-softmax: the transcribed policy term minus entropy_coeff *
    agg(H), on peaked rows (target probabilities up to ~0.9)."""
    agg, tau, config = "token-mean", 0.8, dict(DPPO_DRO_CONFIGS[mode], entropy_coeff=0.01)

    def verl_terms(old, log_prob, entropy, adv, mask):
        pg_loss, *metrics = _verl_dppo_dro(mode, old, log_prob, adv, mask, agg, config)
        return (pg_loss - 0.01 * _verl_agg(entropy, mask, agg), *metrics)

    metrics = _check_fused_parity(11, (5, 2, 0, 4), tau, agg, backend, 0.5, verl_terms, lambda *a: (
        compute_policy_loss_from_hidden(*a, agg, config, temperature=tau, backend=backend)), weight_scale=1.5,
                                  likely=True)
    if mode != "dro":
        assert 0 < metrics[0] < 1  # the trust region drops some tokens and keeps others


# --- the Entropy Mechanism's clip_cov and kl_cov
def _verl_cov(mode, old, log_prob, adv, mask, agg, config, weights=None):
    """verl 0.9.1's ``compute_policy_loss_clip_cov`` / ``_kl_cov`` transcribed: ``(pg_loss, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower)`` (kl_cov: ppo_kl is its mean |log r|, the clip fractions 0)."""
    policy = config["policy_loss"]
    masked_mean = lambda x: (x * mask).sum() / (mask.sum() + 1e-8)  # noqa: E731
    zero = torch.zeros((), dtype=old.dtype)
    negative_approx_kl = log_prob - old
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    if mode == "kl_cov":
        pg_losses = pg_losses1.clone()
        pg_losses_kl = -adv * ratio + policy.get("ppo_kl_coef", 1.0) * negative_approx_kl.abs()
        all_valid_idx = torch.nonzero((mask > 0).reshape(-1), as_tuple=True)[0]
        valid_adv, valid_logp = adv[mask > 0].detach().reshape(-1), log_prob[mask > 0].detach().reshape(-1)
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        large = all_valid_idx[torch.topk(cov, max(1, int(len(cov) * policy["kl_cov_ratio"])), largest=True).indices]
        rows, cols = large // adv.shape[1], large % adv.shape[1]
        pg_losses[rows, cols] = pg_losses_kl[rows, cols]
        if weights is not None:
            pg_losses = pg_losses * weights
        return _verl_agg(pg_losses, mask, agg), zero, masked_mean(negative_approx_kl.abs()), zero
    low = config.get("clip_ratio_low") or config["clip_ratio"]
    high = config.get("clip_ratio_high") or config["clip_ratio"]
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (adv - masked_mean(adv)) * (log_prob - masked_mean(log_prob.detach()))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(policy["clip_cov_ratio"] * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < policy["clip_cov_ub"]) & (cov_all > policy["clip_cov_lb"]) & (mask > 0))
    top_k_idx = top_k_idx[torch.randperm(len(top_k_idx))[:min(clip_num, len(top_k_idx))]]
    corr = torch.ones_like(adv)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if weights is not None:
        pg_losses = pg_losses * weights
    return _verl_agg(pg_losses, mask, agg), masked_mean((corr == 0).float()), masked_mean(-negative_approx_kl), zero


COV_CONFIGS = {
    # clip_cov_ratio 1: verl's randperm keeps every candidate, fused_rl's draw too (the same tokens)
    "clip_cov": {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                 "policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 1.0, "clip_cov_lb": 0.05,
                                 "clip_cov_ub": 0.6}},
    "kl_cov": {"clip_ratio": 0.2, "policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.7}},
}


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("agg", sorted(HAND) + ["token-sum"])
@pytest.mark.parametrize("mode", sorted(COV_CONFIGS))
def test_cov_parity_with_verl(mode, agg, with_weights):
    """Loss, d loss / d log_prob and the metrics equal verl 0.9.1's clip_cov / kl_cov (transcribed) on ragged
    responses with an empty one, A of both signs and A = 0; clip_cov drops some tokens (not those it clips), kl_cov
    penalizes a fifth; rollout_is_weights multiply the whole per-token loss, penalty included."""
    old, lp, adv, mask, weights = _ragged_batch(12)
    lp = lp.clamp(max=-1e-3)
    weights = weights if with_weights else None
    config = COV_CONFIGS[mode]
    got = _check_parity(lp, lambda x: compute_policy_loss(old, x, adv, mask, agg, config, weights),
                        lambda x: _verl_cov(mode, old, x, adv, mask, agg, config, weights))
    if mode == "clip_cov":
        assert 0 < got[1] < 0.5
    names = {"clip_cov": ["actor/pg_clipfrac", "actor/ppo_kl"], "kl_cov": ["actor/ppo_kl"]}[mode]
    assert list(get_policy_loss_fn(mode)(old, lp, adv, mask, agg, config)[1]) == names


def test_clip_cov_draws_as_many_as_verl_from_the_same_candidates():
    """With verl's default clip_cov_ratio (a random draw), both drop ``max(int(ratio * #tokens), 1)`` of the same
    candidates (not the same ones: verl draws with torch.randperm, fused_rl with torch.rand keys)."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 200, generator=g, dtype=torch.float64) * 3
    lp = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 200) * 2
    mask = torch.ones_like(old)
    policy = {"loss_mode": "clip_cov", "clip_cov_ratio": 0.01, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}
    config = {"clip_ratio": 0.2, "policy_loss": policy}
    everything = dict(config, policy_loss=dict(policy, clip_cov_ratio=1.0))
    candidates = compute_policy_loss(old, lp, adv, mask, "token-mean", everything)[1] * mask.numel()
    assert candidates > 30
    for seed in range(3):
        torch.manual_seed(seed)
        assert compute_policy_loss(old, lp, adv, mask, "token-mean", config)[1].item() * mask.numel() == \
            pytest.approx(16)  # int(0.01 * 1600)
        assert _verl_cov("clip_cov", old, lp, adv, mask, "token-mean", config)[1].item() * mask.numel() == \
            pytest.approx(16)


def test_cov_config_mapping():
    cfg = policy_loss_config_from_verl({"clip_ratio": 0.2, "policy_loss": {"loss_mode": "clip_cov"}},
                                       response_length=4)
    assert cfg == PolicyLossConfig(cov_mode="clip_cov", cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0)
    cfg = policy_loss_config_from_verl({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": None}},
                                       response_length=4)
    assert cfg == PolicyLossConfig(clip_low=1.0, clip_high=1e30, cov_mode="kl_cov", cov_ratio=2e-4, kl_cov_coef=1.0)


@pytest.mark.parametrize("mode", sorted(COV_CONFIGS))
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_from_hidden_cov_matches_verl_actor(mode, backend):
    """The fused entry point (a batch-level config: each backend's two passes) equals verl's actor composition on its
    log-softmax: the transcribed policy term, minus entropy_coeff * agg(H), plus kl_loss_coef * agg(low_var_kl)."""
    agg, tau = "seq-mean-token-mean", 0.9
    config = dict(COV_CONFIGS[mode], entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                  kl_loss_type="low_var_kl")
    ref = -torch.rand(4, 6, generator=torch.Generator().manual_seed(14)) * 4  # reference log-probs

    def verl_terms(old, log_prob, entropy, adv, mask):
        pg_loss, *metrics = _verl_cov(mode, old, log_prob, adv, mask, agg, config)
        d = (ref.double() - log_prob).clamp(-20, 20)
        kl = (d.exp() - d - 1).clamp(-10, 10)
        return (pg_loss - 0.01 * _verl_agg(entropy, mask, agg) + 0.05 * _verl_agg(kl, mask, agg), *metrics)

    metrics = _check_fused_parity(13, (6, 2, 0, 5), tau, agg, backend, 0.5, verl_terms, lambda *a: (
        compute_policy_loss_from_hidden(*a, agg, config, ref_log_prob=ref, temperature=tau, backend=backend)),
                                  weight_scale=1.5)
    if mode == "clip_cov":
        assert 0 < metrics[0] < 1


# --- bypass_mode (old_log_prob are the rollout log-probs)
def _verl_bypass(old, log_prob, adv, mask, agg, config):
    """verl 0.9.1's ``compute_policy_loss_bypass_mode`` transcribed (with ``compute_rollout_correction_weights``, no
    rejection sampling): ppo_clip -> vanilla against the rollout log-probs; reinforce -> ``-A logp w`` with ``w``
    the detached ``pi / pi_rollout`` (per token or sequence, log-ratio clamped at 20), truncated at ``upper`` or
    zeroed outside ``lower_upper``. ``(pg_loss, ppo_kl)``."""
    corr = config["policy_loss"]["rollout_correction"]
    if corr.get("loss_type", "ppo_clip") == "ppo_clip":
        clipped = _verl_pg_losses("vanilla", old, log_prob, adv, mask, dict(config, clip_ratio_c=3.0))
        return _verl_agg(clipped, mask, agg), ((old - log_prob) * mask).sum() / (mask.sum() + 1e-8)
    log_ratio = (log_prob - old).detach()
    weights = None
    if corr.get("rollout_is") is not None:
        if corr["rollout_is"] == "token":
            raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
        else:
            raw = torch.exp(((log_ratio * mask).sum(-1, keepdim=True)).clamp(-20.0, 20.0)).expand_as(log_ratio)
        raw = raw * mask
        threshold = corr.get("rollout_is_threshold", 2.0)
        if isinstance(threshold, str) and "_" in threshold:
            lower, upper = (float(x) for x in threshold.split("_"))
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        else:
            weights = raw.clamp(max=float(threshold))
    pg_losses = -adv * log_prob if weights is None else -adv * log_prob * weights
    return _verl_agg(pg_losses, mask, agg), ((old - log_prob) * mask).sum() / (mask.sum() + 1e-8)


BYPASS = {
    "ppo_clip": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0},
    "reinforce": {"loss_type": "reinforce"},
    "reinforce-token-tis": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.2},
    "reinforce-token-icepop": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.8_1.25"},
    "reinforce-sequence-tis": {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": "1.5"},
    "reinforce-sequence-icepop": {"loss_type": "reinforce", "rollout_is": "sequence",
                                  "rollout_is_threshold": "0.3_3.0"},
}


@pytest.mark.parametrize("agg", sorted(HAND) + ["token-sum"])
@pytest.mark.parametrize("name", sorted(BYPASS))
def test_bypass_mode_parity_with_verl(name, agg):
    """Loss, d loss / d log_prob and ppo_kl equal verl 0.9.1's bypass_mode (transcribed) for each loss_type and
    rollout_is level / threshold form, on ragged responses with an empty one; the weights bind on both sides."""
    rollout, lp, adv, mask, weights = _ragged_batch(15)
    config = {"clip_ratio": 0.2, "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": BYPASS[name]}}
    log_prob, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got = compute_policy_loss(rollout, log_prob, adv, mask, agg, config, weights)  # the weights: ignored, as verl
    want = _verl_bypass(rollout, ref_lp, adv, mask, agg, config)
    torch.testing.assert_close(got[0].to(torch.float64), want[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got[2].to(torch.float64), want[1], rtol=1e-6, atol=1e-9)
    got[0].backward()
    want[0].backward()
    torch.testing.assert_close(log_prob.grad, ref_lp.grad, rtol=1e-6, atol=1e-9)
    ratio = (lp - rollout).exp()[mask.bool()]
    assert (ratio > 1.25).any() and (ratio < 0.8).any()
    names = ["actor/ppo_kl"] if name.startswith("reinforce") else ["actor/pg_clipfrac", "actor/ppo_kl",
                                                                   "actor/pg_clipfrac_lower"]
    metrics = get_policy_loss_fn("bypass_mode")(rollout, lp, adv, mask, agg, config)[1]
    assert [n for n in metrics if not n.startswith("rollout_corr/")] == names


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("name", ["reinforce-token-tis", "reinforce-sequence-icepop"])
def test_from_hidden_bypass_mode_matches_verl_actor(name, backend):
    """The fused entry point: the weights from the fused pass's own log-probs (on-policy rollout correction)."""
    agg = "token-mean"
    config = {"clip_ratio": 0.2, "entropy_coeff": 0.01,
              "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": BYPASS[name]}}

    def verl_terms(rollout, log_prob, entropy, adv, mask):
        pg_loss, ppo_kl = _verl_bypass(rollout, log_prob, adv, mask, agg, config)
        return pg_loss - 0.01 * _verl_agg(entropy, mask, agg), torch.zeros((), dtype=torch.float64), ppo_kl

    _check_fused_parity(17, (6, 1, 0, 4), 1.0, agg, backend, 0.3, verl_terms, lambda *a: (
        compute_policy_loss_from_hidden(*a, agg, config, backend=backend)))


@pytest.mark.parametrize("corr, error, needle", [
    (None, ValueError, "needs policy_loss.rollout_correction"),
    # from the current log-probs: the adapter's loss functions apply them, a config cannot
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}, NotImplementedError, "current log-probs"),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_batch_normalize": True}, NotImplementedError,
     "current log-probs"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, ValueError, "'token_k4' is not one of"),
    ({"rollout_rs": "token_k2"}, ValueError, "must be a number or a comma-separated string"),  # no threshold
    ({"rollout_rs": " , ", "rollout_rs_threshold": 1.0}, ValueError, "at least one option"),
    ({"rollout_rs": ["token_k2"], "rollout_rs_threshold": 1.0}, ValueError, "comma-separated string"),
    ({"rollout_rs": "token_k2,seq_sum_k3", "rollout_rs_threshold": "1,2,3"}, ValueError, "one per option"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, ValueError, "single upper bound"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_0.5"}, ValueError, "lower <= upper"),
    ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0_2"}, ValueError, "must be positive"),
    ({"rollout_rs": "seq_max_k3", "rollout_rs_threshold": "nan"}, ValueError, "must be positive"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": "x"}, ValueError, "not a number"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": True}, ValueError, "must be a number"),
    ({"loss_type": "ppo"}, ValueError, "must be 'reinforce' or 'ppo_clip'"),
    ({"loss_type": None}, ValueError, "must be 'reinforce' or 'ppo_clip'"),  # verl: "Invalid loss_type"
    ({"loss_type": "reinforce", "rollout_is": "tokens"}, ValueError, "'token', 'sequence' or None"),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "2_1"}, ValueError, "lower <= upper"),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "a_b"}, ValueError, "not a number"),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": True}, ValueError, "must be a number"),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": -1.0}, ValueError, "positive"),
])
def test_bypass_mode_refusals(corr, error, needle):
    with pytest.raises(error, match=needle):
        policy_loss_config_from_verl({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}},
                                     response_length=4)


@pytest.mark.parametrize("corr, needle", [
    ({"loss_type": "reinforce", "rollout_rs": "tok", "rollout_rs_threshold": 9}, "'tok' is not one of"),
    ({"rollout_is": "token", "rollout_is_threshold": "x"}, "not a number"),
])
def test_bypass_mode_refusals_reach_the_loss_functions(corr, needle):
    """The loss functions parse the rollout correction as the config mapping does: a bad option raises there too."""
    rollout, lp, adv, mask, _ = _ragged_batch(3)
    config = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}}
    with pytest.raises(ValueError, match=needle):
        get_policy_loss_fn("bypass_mode")(rollout, lp, adv, mask, "token-mean", config)


@pytest.mark.parametrize("corr, rollout_is", [
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": None}, None),  # verl: no weights
    ({"loss_type": "reinforce", "rollout_is": None, "rollout_is_batch_normalize": True}, None),
    ({"loss_type": "reinforce", "rollout_is": "sequence"}, "sequence_truncate"),  # threshold absent: 2.0
    ({"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_batch_normalize": True}, None),  # metrics only
])
def test_bypass_mode_weights_as_verl_computes_them(corr, rollout_is):
    cfg = policy_loss_config_from_verl({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}},
                                       response_length=4)
    assert cfg.rollout_is == rollout_is and cfg.policy_loss == ("ppo_clip" if corr["loss_type"] == "ppo_clip"
                                                                  else "reinforce")
    assert rollout_is is None or cfg.rollout_is_max == 2.0


# --- bypass_mode's rejection sampling, batch-normalized weights and rollout_corr/* metrics, against verl itself
#: verl 0.9.1's own compute_policy_loss_bypass_mode on one ragged batch (tests/data/make_verl_bypass_golden.py).
GOLDEN = json.loads((Path(__file__).parent / "data" / "verl_bypass_golden.json").read_text())


def _golden_inputs():
    return {name: torch.tensor(value, dtype=torch.float64) for name, value in GOLDEN["inputs"].items()}


def _golden_config(case: dict, **extra) -> dict:
    return {"clip_ratio": GOLDEN["clip_ratio"], "global_batch_info": case["global_batch_info"],
            "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": case["rollout_correction"]}, **extra}


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_bypass_mode_matches_verl_itself(name):
    """Loss, d loss / d log_prob and every metric (verl's names, ``rollout_corr/*`` included: importance-weight,
    rejection and off-policy diagnostics) equal verl 0.9.1's own function's on a ragged batch with an empty and a
    length-1 response, for rejection options alone, chained and with shared thresholds, batch-normalized token and
    sequence weights, both loss types, three aggregations and a data-parallel ``global_batch_info``."""
    case, x = GOLDEN["cases"][name], _golden_inputs()
    log_prob = x["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("bypass_mode")(x["rollout"], log_prob, x["advantages"], x["mask"],
                                                      case["loss_agg_mode"], _golden_config(case))
    loss.backward()
    # fp64; verl's means divide by count + 1e-8 (relative 1e-8 off)
    assert loss.item() == pytest.approx(case["loss"], rel=1e-7, abs=1e-10)
    torch.testing.assert_close(log_prob.grad, torch.tensor(case["grad"], dtype=torch.float64), rtol=1e-7, atol=1e-10)
    assert sorted(metrics) == sorted(case["metrics"])
    for key, want in case["metrics"].items():
        assert metrics[key].item() == pytest.approx(want, rel=1e-6, abs=1e-7), key
    four = compute_policy_loss(x["rollout"], x["log_prob"], x["advantages"], x["mask"], case["loss_agg_mode"],
                               _golden_config(case))
    assert four[0].item() == pytest.approx(case["loss"], rel=1e-7, abs=1e-10)
    assert four[2].item() == pytest.approx(case["metrics"]["actor/ppo_kl"], rel=1e-6, abs=1e-7)


def test_golden_cases_exercise_every_option():
    """Each rejection option of the golden cases drops some tokens and keeps others, the weights are normalized by a
    factor away from 1, and the cases cover every statistic kind and level."""
    options = set()
    for case in GOLDEN["cases"].values():
        corr, metrics = case["rollout_correction"], case["metrics"]
        for option in filter(None, (o.strip() for o in corr.get("rollout_rs", "").split(","))):
            options.add(option)
            assert 0 < metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] < 1, option
        if corr.get("rollout_is_batch_normalize"):
            assert abs(metrics["rollout_corr/rollout_is_batch_norm_factor"] - 1) > 0.1
    assert {o.rsplit("_", 1)[1] for o in options} == {"k1", "k2", "k3"}
    assert {o.split("_")[0] if o.startswith("token") else o.split("_")[1] for o in options} == {
        "token", "sum", "mean", "max"}


#: Golden cases the fused entry point is checked on (every backend; all of them on torch and cpu).
FUSED_GOLDEN = ["reinforce-token-icepop-rs-chain|global|seq-mean-token-mean", "ppo_clip-rs-token_k1|token-mean",
                "reinforce-sequence-icepop-normalize|seq-mean-token-sum"]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_from_hidden_bypass_rejection_matches_the_per_token_loss(name, backend):
    """The fused entry point with rejection / normalized weights (a no-grad log-prob pass first, then the loss pass
    with verl's policy aggregation over the kept tokens carried by the weights, the entropy term over all) against
    the per-token entry point (checked against verl above) on a full fp64 log-softmax: loss, hidden and weight
    gradients, every metric."""
    if backend == "triton" and name not in FUSED_GOLDEN:
        pytest.skip("the Triton interpreter is slow: three cases")
    if fused_rl.available_backends()[backend] is not None:
        pytest.skip(fused_rl.available_backends()[backend])
    case = GOLDEN["cases"][name]
    agg, config = case["loss_agg_mode"], _golden_config(case, entropy_coeff=0.01)
    g = torch.Generator().manual_seed(31)
    lengths, vocab, tau = (7, 3, 0, 5, 1), 40, 0.9
    hidden, weight = torch.randn(5, 7, 8, generator=g), torch.randn(vocab, 8, generator=g)
    responses = torch.randint(0, vocab, (5, 7), generator=g)
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).to(torch.float32)
    adv = torch.randn(5, 7, generator=g)
    h_ref, w_ref = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp_all = torch.log_softmax(h_ref @ w_ref.T / tau, -1)
    log_prob = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    rollout = (log_prob.detach() + 0.6 * torch.randn(5, 7, generator=g, dtype=torch.float64)).clamp(max=0.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pg_loss, want = get_policy_loss_fn("bypass_mode")(rollout, log_prob, adv.double(), mask.double(), agg, config)
    info = case["global_batch_info"]
    (pg_loss - 0.01 * _verl_agg(entropy, mask.double(), agg, **info)).backward()
    expected = pg_loss - 0.01 * _verl_agg(entropy.detach(), mask.double(), agg, **info)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, clipfrac, ppo_kl, clipfrac_lower, out = compute_policy_loss_from_hidden(
        h, w, responses, rollout.float(), adv, mask, agg, config, temperature=tau, backend=backend)
    loss.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)
    got = dict(out.metrics, **{"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl,
                               "actor/pg_clipfrac_lower": clipfrac_lower})
    for key, value in want.items():
        assert got[key].item() == pytest.approx(value.item(), rel=1e-4, abs=1e-5), key
    if case["rollout_correction"].get("rollout_rs"):
        assert 0 < want["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_bypass_rejection_of_every_token_and_unscored_tokens():
    """Every token rejected: a zero loss and gradient (verl divides 0 by 0) and finite metrics; an all-masked batch:
    the same (verl raises); NaN padding is never read; unchecked, a NaN rollout log-prob (a token the engine did not
    score) has log-ratio 0, as fused_rl's rollout correction reads it: kept by a k1 bound, weight 1."""
    x = _golden_inputs()
    corr = {"loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "token_k2", "rollout_rs_threshold": 1e-9}
    config = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}}
    for mask in (x["mask"], torch.zeros_like(x["mask"])):
        log_prob = x["log_prob"].clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn("bypass_mode")(x["rollout"], log_prob, x["advantages"], mask,
                                                          "token-mean", config)
        loss.backward()
        assert loss.item() == 0 and not log_prob.grad.any()
        assert all(torch.isfinite(v) for v in metrics.values())
    rollout = x["rollout"].clone()
    rollout[x["mask"] == 0] = float("nan")
    rollout[0, 1] = float("nan")
    corr = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.999_1.001",
            "rollout_rs": "token_k1", "rollout_rs_threshold": "0.999_1.001"}
    config = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}}
    log_prob = x["log_prob"].clone().requires_grad_(True)
    # check_inputs refuses a NaN old_log_prob where the mask is set; unchecked, it reads as unscored
    loss, metrics = get_policy_loss_fn("bypass_mode", check_inputs=False)(rollout, log_prob, x["advantages"],
                                                                          x["mask"], "token-sum", config)
    loss.backward()
    want = torch.zeros_like(log_prob)
    want[0, 1] = -x["advantages"][0, 1]  # the only kept token, weight 1
    torch.testing.assert_close(log_prob.grad, want)
    assert all(torch.isfinite(v) for k, v in metrics.items() if k.startswith("rollout_corr/"))  # ppo_kl: NaN


@pytest.mark.parametrize("shape", [(0, 7), (5, 0)])
def test_bypass_mode_of_an_empty_batch(shape):
    """No response (B = 0) or no token (T = 0): a zero loss and finite diagnostics, the keys of a non-empty batch (the
    reductions over no row raised); masked means over no token are 0 (the chi-square divergences ``E[.] - 1``: -1)."""
    x = _golden_inputs()
    case = GOLDEN["cases"]["reinforce-token-icepop-rs-chain|global|seq-mean-token-mean"]
    config = _golden_config(dict(case, global_batch_info={}))
    empty = {name: value[:shape[0], :shape[1]] for name, value in x.items()}
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, metrics = get_policy_loss_fn("bypass_mode")(empty["rollout"], empty["log_prob"], empty["advantages"],
                                                          empty["mask"], agg, config)
        assert loss.item() == 0 and sorted(metrics) == sorted(case["metrics"])
        assert all(torch.isfinite(value) for value in metrics.values())
        assert metrics["rollout_corr/kl"].item() == metrics["rollout_corr/rollout_is_mean"].item() == 0
        assert metrics["rollout_corr/chi2_token"].item() == -1


def test_effective_sample_size_of_no_weight_is_zero():
    """Every weight masked by IcePop's bounds: verl divides 1.0 by 0.0 (ZeroDivisionError); here 0."""
    x = _golden_inputs()
    corr = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "1e6_1e7"}
    config = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}}
    loss, metrics = get_policy_loss_fn("bypass_mode")(x["rollout"], x["log_prob"], x["advantages"], x["mask"],
                                                      "token-mean", config)
    assert loss.item() == 0 and metrics["rollout_corr/rollout_is_mean"].item() == 0
    assert metrics["rollout_corr/rollout_is_eff_sample_size"].item() == 0


def _normalize_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = _golden_inputs()
        rows = slice(0, 3) if rank == 0 else slice(3, 5)
        for level in ("token", "sequence"):
            corr = _bypass_correction({"policy_loss": {"rollout_correction": {
                "loss_type": "reinforce", "rollout_is": level, "rollout_is_threshold": 1.5,
                "rollout_is_batch_normalize": True}}})
            fixed = correct(corr, x["log_prob"][rows], x["rollout"][rows], x["mask"][rows].bool())
            torch.save(fixed.weights, os.path.join(out_dir, f"{level}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_batch_normalized_weights_over_processes(tmp_path, world):
    """With torch.distributed initialized the weights' batch mean is over every process (verl's
    distributed_masked_mean): two gloo processes with 3 + 2 responses get the weights of one process with all 5."""
    init_file = tmp_path / "init"
    mp.spawn(_normalize_rank, args=(world, str(init_file), str(tmp_path)), nprocs=world, join=True)
    x = _golden_inputs()
    for level in ("token", "sequence"):
        corr = _bypass_correction({"policy_loss": {"rollout_correction": {
            "loss_type": "reinforce", "rollout_is": level, "rollout_is_threshold": 1.5,
            "rollout_is_batch_normalize": True}}})
        whole = correct(corr, x["log_prob"], x["rollout"], x["mask"].bool()).weights
        parts = torch.cat([torch.load(tmp_path / f"{level}{rank}.pt") for rank in range(world)])
        mask = x["mask"].bool()
        torch.testing.assert_close(parts[mask], whole[mask], rtol=1e-12, atol=0)
        alone = correct(corr, x["log_prob"][:3], x["rollout"][:3], mask[:3]).weights
        assert not torch.allclose(alone[mask[:3]], whole[:3][mask[:3]])


def test_bypass_mode_refuses_fewer_thresholds_than_options():
    """Two thresholds for three options is neither one shared nor one per option: it raises (a zip of the two
    lists silently dropped the third option)."""
    from fused_rl.integrations.verl_rollout import parse_rejection

    with pytest.raises(ValueError, match=r"one per option \(3\), got 2"):
        parse_rejection("token_k2,seq_sum_k3,seq_max_k2", "1,2")
    assert [r.upper for r in parse_rejection("token_k2,seq_sum_k3,seq_max_k2", "1,2,3")] == [1.0, 2.0, 3.0]


def test_rejection_bounds_are_inclusive():
    """A k1 threshold ``"1_1"`` (lower = upper) is valid (verl checks ``lower <= upper``), ``"2_1"`` is not; a
    statistic exactly at its bound is kept (verl's ``<=``): k2 of ``log r = 1`` is 0.5, kept at threshold 0.5 and
    dropped at 0.49, beside a token at ``log r = 1.25`` (k2 0.78125) dropped at both."""
    from fused_rl.integrations.verl_rollout import BypassCorrection, Rejection, parse_rejection

    assert parse_rejection("token_k1", "1_1") == (Rejection("token_k1", 1.0, 1.0),)
    with pytest.raises(ValueError, match="lower <= upper"):
        parse_rejection("token_k1", "2_1")
    logp, rollout = torch.tensor([[-0.5, -0.5, -0.5]]), torch.tensor([[-1.5, -1.75, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for threshold, want in ((0.5, [True, False, True]), (0.49, [False, False, True])):
        corr = BypassCorrection("ppo_clip", None, False, parse_rejection("token_k2", threshold))
        assert correct(corr, logp, rollout, mask).mask.tolist() == [want]


def test_sequence_weight_metrics_clamp_the_log_ratio_and_read_half_precision_in_fp32():
    """``rollout_is_max`` of sequence weights is ``exp(min(max_i sum_t log r, 20))`` (verl's safety bound: a sum of
    30 reads exp(20), not exp(30)); bf16 log-probs give the metrics of the same values in fp32 (computed in fp32,
    not in bf16)."""
    corr = _bypass_correction({"policy_loss": {"rollout_correction": {
        "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0}}})
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp, rollout = torch.full((2, 3), -1.0), torch.tensor([[-11.0, -11.0, -11.0], [-1.5, -0.75, -1.0]])
    metrics = correct(corr, logp, rollout, mask).metrics
    assert metrics["rollout_corr/rollout_is_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    g = torch.Generator().manual_seed(5)
    logp, rollout = (-torch.rand(3, 7, generator=g) * 4).bfloat16(), (-torch.rand(3, 7, generator=g) * 4).bfloat16()
    mask = torch.rand(3, 7, generator=g) > 0.2
    half, full = (correct(corr, lp, ro, mask) for lp, ro in ((logp, rollout), (logp.float(), rollout.float())))
    assert torch.equal(half.weights, full.weights)
    for name, value in full.metrics.items():
        assert torch.equal(half.metrics[name], value), name
