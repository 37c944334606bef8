"""fused_rl.integrations.openrlhf against OpenRLHF's own ``PolicyLoss`` (openrlhf 0.11.2, installed with ``--no-deps``
by .ci/run) and against values derived by hand from its definitions."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from fused_rl.integrations.openrlhf import PolicyLoss, is_correction_weights, policy_loss_config_from_openrlhf
from helpers import fused_backends, supports


@pytest.fixture(scope="module")
def upstream():
    """OpenRLHF's ``models/loss.py`` and ``models/utils.py``, loaded as files: the package's ``__init__`` imports its
    actor (DeepSpeed, flash-attn, ...), and ``utils.py`` imports ``deepspeed`` at module level for functions these
    tests do not call, so an empty stand-in is in ``sys.modules`` while the two files load (and removed after)."""
    try:
        root = Path(importlib.metadata.distribution("openrlhf").locate_file("openrlhf")) / "models"
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("FUSED_RL_REQUIRE_OPENRLHF") == "1":  # .ci/run installs it: missing is a failure there
            pytest.fail("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
        pytest.skip("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
    names = ("deepspeed", "_openrlhf_models", "_openrlhf_models.utils", "_openrlhf_models.loss")
    saved = {name: sys.modules.get(name) for name in names}
    package = types.ModuleType("_openrlhf_models")
    package.__path__ = [str(root)]
    sys.modules.update({"deepspeed": types.ModuleType("deepspeed"), "_openrlhf_models": package})
    loaded = {}
    try:
        for name in ("utils", "loss"):
            spec = importlib.util.spec_from_file_location(f"_openrlhf_models.{name}", root / f"{name}.py")
            loaded[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            with warnings.catch_warnings():  # utils.py's @torch.compile warns of torch.jit under torch 2.13
                warnings.simplefilter("ignore", DeprecationWarning)
                spec.loader.exec_module(loaded[name])
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return types.SimpleNamespace(**loaded)


def _inputs(seed: int, dtype=torch.float64, per_sequence_advantages: bool = False):
    """Five responses of ragged lengths (7, 4, 1, 0, 6 tokens: a one-token and an empty one), log-probs whose
    ratios to the old policy reach the clip range, and rollout log-probs a little off the old ones."""
    g = torch.Generator().manual_seed(seed)
    batch, length = 5, 7
    lengths = torch.tensor([7, 4, 1, 0, 6])
    mask = (torch.arange(length) < lengths[:, None]).to(dtype)
    logp = -torch.rand(batch, length, generator=g, dtype=dtype) * 4 - 0.01
    old = (logp + 0.35 * torch.randn(batch, length, generator=g, dtype=dtype)).clamp(max=-1e-3)
    rollout = (old + 0.3 * torch.randn(batch, length, generator=g, dtype=dtype)).clamp(max=-1e-3)
    adv = torch.randn(batch, 1 if per_sequence_advantages else length, generator=g, dtype=dtype)
    return logp, old, rollout, adv.expand(batch, length).contiguous(), mask


CORRECTIONS = {
    "off": ("off", "mask", "ratio", (0.5, 5.0)),
    "token-clip": ("token", "clip", "ratio", (0.8, 1.2)),
    "token-mask": ("token", "mask", "ratio", (0.8, 1.25)),
    "seq-mask": ("seq", "mask", "ratio", (0.9, 1.1)),
    "token-binary_kl": ("token", "mask", "binary_kl", (0.0, 0.01)),
    "seq-tv": ("seq", "mask", "tv", (0.0, 0.04)),
}
NORMALIZATIONS = {"local": {}, "global": {"dp_size": 2, "batch_num_tokens": 37.0, "global_batch_size": 9.0},
                  "global-tensor": {"dp_size": 4, "batch_num_tokens": torch.tensor(70.0),
                                    "global_batch_size": torch.tensor(15.0)}}


def _kwargs(policy_loss_type, dual_clip, token_level_loss, correction):
    level, mode, gating, threshold = CORRECTIONS[correction]
    return dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=token_level_loss,
                policy_loss_type=policy_loss_type, is_correction_level=level, is_correction_mode=mode,
                is_correction_gating=gating, is_correction_threshold=threshold)


def _assert_metric(got, expected, what):
    if expected is None:
        assert got is None, what
    else:
        torch.testing.assert_close(got.double(), expected.double(), rtol=2e-6, atol=1e-7, msg=what)  # fp32 metrics


@pytest.mark.parametrize("normalization", sorted(NORMALIZATIONS))
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 1.6])
@pytest.mark.parametrize("policy_loss_type", ["ppo", "gspo"])
def test_forward_matches_openrlhf(upstream, policy_loss_type, dual_clip, token_level_loss, correction,
                                  normalization):
    """Loss, gradient and the four metrics of OpenRLHF's PolicyLoss, in fp64 (rtol 1e-7: OpenRLHF divides a
    response's sum by ``count + 1e-8``), every option of its constructor and both normalizations."""
    kwargs = _kwargs(policy_loss_type, dual_clip, token_level_loss, correction)
    logp, old, rollout, adv, mask = _inputs(1 if policy_loss_type == "ppo" else 4)
    if correction != "off" and policy_loss_type == "ppo":  # the gates must drop some tokens and keep others
        _, filtered = is_correction_weights(old, rollout, mask.bool(), *CORRECTIONS[correction][:3],
                                            *CORRECTIONS[correction][3])
        assert 0 < (filtered & mask.bool()).sum() < mask.sum() - 1
    norm = NORMALIZATIONS[normalization]

    x_ref = logp.clone().requires_grad_(True)
    expected = upstream.loss.PolicyLoss(**kwargs)(x_ref, old, adv, mask, rollout, **norm)
    expected[0].backward()
    x = logp.clone().requires_grad_(True)
    got = PolicyLoss(**kwargs)(x, old, adv, mask, rollout, **norm)
    got[0].backward()

    torch.testing.assert_close(got[0], expected[0], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-7, atol=1e-12)
    for name, g, e in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), got[1:], expected[1:]):
        _assert_metric(g, e, name)
    assert x.grad.abs().sum() > 0
    if policy_loss_type == "ppo" and correction == "off":
        assert 0 < got[1] < 1  # some tokens clipped, not all


def test_from_openrlhf_copies_the_options(upstream):
    theirs = upstream.loss.PolicyLoss(**_kwargs("ppo", 1.6, False, "seq-tv"))
    ours = PolicyLoss.from_openrlhf(theirs)
    assert ours.config == policy_loss_config_from_openrlhf(0.2, 0.28, 1.6, False, "ppo")
    assert ours.is_correction == ("seq", "mask", "tv") and ours.is_correction_bounds == (0.0, 0.04)


def _upstream_actor_loss(upstream, kwargs, logits, action_ids, old, adv, mask, rollout, base, kl_coef, entropy_coef,
                         norm, kl_estimator="k3", unbiased_gradient=False):
    """OpenRLHF's ``training_step`` loss on log-probs of ``logits`` (fp64): policy loss + kl_coef * KL loss
    (``compute_approx_kl`` as ``training_step`` calls it) - entropy_coef * entropy loss, the last two aggregated per
    token with the same batch info."""
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, action_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss, *metrics = upstream.loss.PolicyLoss(**kwargs)(logp, old, adv, mask, rollout, **norm)
    if kl_coef > 0:
        kl = upstream.utils.compute_approx_kl(logp, base, log_probs_old=old, kl_estimator=kl_estimator,
                                              unbiased_gradient=unbiased_gradient)
        loss = loss + kl_coef * upstream.loss.aggregate_loss(kl, mask, **norm)
    if entropy_coef is not None:
        loss = loss - entropy_coef * upstream.loss.aggregate_loss(entropy, mask, **norm)
    return loss, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", fused_backends())
@pytest.mark.parametrize("setup", ["ppo-kl-entropy-token-mask", "ppo-token-clip-global", "gspo-seq-mask",
                                   "ppo-per-sample-seq-tv"])
def test_forward_from_hidden_matches_openrlhf_actor(upstream, backend, setup, dtype):
    """The fused loss from hidden states against OpenRLHF's on the fp64 tempered logits ``hidden @ W.T / tau`` (of
    the bf16-rounded operands in bf16): loss, hidden / weight gradients and metrics, in fp32 and bf16 (vocabulary
    1000, not a multiple of a block; bf16: the loss within 1e-2, the gradients, rounded to bf16 once, within 2% of
    their largest entry)."""
    if not supports(backend, dtype):
        pytest.skip(f"{backend} has no {dtype}")
    policy_loss_type, *rest = setup.split("-")
    token_level = "per" not in rest
    kl_coef, entropy_coef = (0.05, 0.01) if "kl" in rest else (0.0, None)
    correction = {"ppo-kl-entropy-token-mask": "token-mask", "ppo-token-clip-global": "token-clip",
                  "gspo-seq-mask": "seq-mask", "ppo-per-sample-seq-tv": "seq-tv"}[setup]
    kwargs = _kwargs(policy_loss_type, 1.6 if policy_loss_type == "ppo" else None, token_level, correction)
    norm = NORMALIZATIONS["global" if "global" in rest else "local"]
    g = torch.Generator().manual_seed(3)
    batch, length, hidden_size, vocab, tau = 5, 7, 16, 1000, 0.8
    hidden = torch.randn(batch, length, hidden_size, generator=g).to(dtype).float()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.4).to(dtype).float()
    action_ids = torch.randint(0, vocab, (batch, length), generator=g)
    _, _, _, adv, mask = _inputs(5, torch.float32)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden.double() @ weight.double().T / tau, -1)
        lp0 = lp0.gather(-1, action_ids.unsqueeze(-1)).squeeze(-1)
    old = (lp0 + 0.3 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).float()
    rollout = (old + 0.2 * torch.randn(lp0.shape, generator=g)).clamp(max=-1e-3)
    base = (lp0 + 0.3 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).float()

    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    expected, expected_metrics = _upstream_actor_loss(
        upstream, kwargs, h64 @ w64.T / tau, action_ids, old.double(), adv.double(), mask.double(), rollout.double(),
        base.double(), kl_coef, entropy_coef, norm)
    expected.backward()

    h, w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
    got, *metrics, out = PolicyLoss(**kwargs).forward_from_hidden(
        h, w, action_ids, old, adv, mask, rollout, **norm, temperature=tau, base_log_probs=base, kl_coef=kl_coef,
        kl_estimator="k3", entropy_coef=entropy_coef, backend=backend)
    got.backward()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-4, atol=2e-6)
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-4, atol=2e-6)
    else:
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-3)
        for grad, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
            assert grad.dtype == dtype
            torch.testing.assert_close(grad.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert h.grad.abs().sum() > 0
    for name, got_metric, e in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), metrics,
                                   expected_metrics):
        if e is None:
            assert got_metric is None, name
        else:
            tol = (1e-4, 1e-6) if dtype == torch.float32 else (1e-2, 1e-3)
            torch.testing.assert_close(got_metric.double(), e.double(), rtol=tol[0], atol=tol[1], msg=name)


@pytest.mark.parametrize("unbiased", [False, True], ids=["legacy", "unbiased"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("backend", fused_backends())
def test_forward_from_hidden_kl_estimators(upstream, backend, estimator, unbiased):
    """OpenRLHF's KL loss, every ``--algo.kl.estimator`` with ``unbiased_gradient`` off and on, fused (fp32) against
    ``training_step``'s sum on the fp64 log-softmax: loss and hidden / weight gradients. The reference model's
    log-probs lie up to ~20 nats away, so the ``[-10, 10]`` value clamp cuts tokens on both sides, and the old ones
    far enough that ``unbiased_gradient``'s weight ``min(pi / pi_old, 10)`` is cut too."""
    kwargs = _kwargs("ppo", None, True, "off")
    g = torch.Generator().manual_seed(11)
    batch, length, hidden_size, vocab = 4, 9, 16, 300
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.5
    action_ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length)
    mask[1, 5:] = 0.0
    mask[3, 1:] = 0.0  # a length-1 response
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, action_ids.unsqueeze(-1))[..., 0]
    old = (lp0 + 2.0 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).clamp(max=0.0).float()
    base = (lp0 + 7.0 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).clamp(max=0.0).float()
    d = (lp0 - base)[mask.bool()]
    assert (d > 10).any() and (d < -10).any() and (d.abs() < 4).any()
    assert ((lp0 - old)[mask.bool()] > math.log(10.0)).any()

    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    expected, _ = _upstream_actor_loss(upstream, kwargs, h64 @ w64.T, action_ids, old.double(), adv.double(),
                                       mask.double(), None, base.double(), 0.1, None, {}, estimator, unbiased)
    expected.backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got, *_ = PolicyLoss(**kwargs).forward_from_hidden(h, w, action_ids, old, adv, mask, base_log_probs=base,
                                                       kl_coef=0.1, kl_estimator=estimator,
                                                       kl_unbiased_gradient=unbiased, backend=backend)
    got.backward()
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-4, atol=2e-6)


# Hand values (no OpenRLHF needed). One response of three tokens, the old policy's sampled-token probabilities
# q = (0.5, 0.2, 0.9) and the sampler's p = (0.4, 0.2, 0.99).
Q = torch.tensor([[0.5, 0.2, 0.9]], dtype=torch.float64)
P = torch.tensor([[0.4, 0.2, 0.99]], dtype=torch.float64)
ALL = torch.ones(1, 3, dtype=torch.bool)


def _binary_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_gates_by_hand():
    """Token binary-KL gate at 0.02: KL(0.4 || 0.5) = 0.0201 and KL(0.99 || 0.9) = 0.0541 drop tokens 0 and 2; the
    kept token keeps its ratio q / p = 1. TV at 0.05 per sequence: mean(0.1, 0, 0.09) = 0.0633 drops the response.
    The sequence ratio gate reads the geometric mean (1.25 * 1 * 0.909)^(1/3) = 1.0434 and keeps the tokens' own
    ratios; a clip gate clamps each ratio."""
    old, rollout = Q.log(), P.log()
    assert _binary_kl(0.4, 0.5) == pytest.approx(0.020136, abs=1e-6)
    w, filtered = is_correction_weights(old, rollout, ALL, "token", "mask", "binary_kl", 0.0, 0.02)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))
    assert filtered.tolist() == [[True, False, True]]
    w, filtered = is_correction_weights(old, rollout, ALL, "seq", "mask", "tv", 0.0, 0.05)
    assert w.tolist() == [[0.0, 0.0, 0.0]] and filtered.all()
    w, filtered = is_correction_weights(old, rollout, ALL, "seq", "mask", "tv", 0.0, 0.07)
    torch.testing.assert_close(w, (Q / P).float().double(), rtol=1e-6, atol=0)
    w, _ = is_correction_weights(old, rollout, ALL, "seq", "mask", "ratio", 1.0, 1.05)
    torch.testing.assert_close(w, Q / P)
    w, _ = is_correction_weights(old, rollout, ALL, "seq", "mask", "ratio", 1.05, 2.0)
    assert w.abs().sum() == 0
    w, filtered = is_correction_weights(old, rollout, ALL, "token", "clip", "ratio", 0.95, 1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.0, 0.95]], dtype=torch.float64))
    assert filtered.tolist() == [[True, False, True]]


def test_forward_by_hand():
    """ppo, clip 0.2, one response of ratios (1.5, 0.5, 1.0) with A = +1 and one of ratio 4 with A = -2 (dual clip
    3): token losses -1.2, -0.5, -1; min(8, 6) = 6. Token mean 3.3 / 4; per sample ((-2.7 / 3) + 6) / 2; a global
    token count of 10 on 2 ranks: 3.3 / 10 * 2; a global 5 responses on 2 ranks: (-0.9 + 6) / 5 * 2."""
    ratios = torch.tensor([[1.5, 0.5, 1.0], [4.0, 1.0, 1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    logp = old + ratios.log()
    token = PolicyLoss(dual_clip=3.0)(logp, old, adv, mask)
    assert token[0].item() == pytest.approx(3.3 / 4)
    assert token[1].item() == pytest.approx(1 / 4)  # r = 1.5 with A > 0
    assert token[2].item() == pytest.approx(-math.log(1.5 * 0.5 * 4.0) / 4)
    assert token[3] is None and token[4] is None
    sample = PolicyLoss(dual_clip=3.0, token_level_loss=False)(logp, old, adv, mask)
    assert sample[0].item() == pytest.approx((-0.9 + 6.0) / 2)
    assert PolicyLoss(dual_clip=3.0)(logp, old, adv, mask, dp_size=2, batch_num_tokens=10)[0].item() == \
        pytest.approx(0.66)
    assert PolicyLoss(dual_clip=3.0, token_level_loss=False)(logp, old, adv, mask, dp_size=2,
                                                             global_batch_size=5)[0].item() == pytest.approx(2.04)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(kl_coef=0.1, kl_estimator="k4"), ValueError, "kl_estimator must be one of k1/k2/k3"),
    (dict(kl_estimator="low_var_kl"), ValueError, "kl_estimator"),
    (dict(kl_coef=0.1, token_level_loss=False), NotImplementedError, "per sample"),
    (dict(entropy_coef=0.01, policy_loss_type="gspo"), NotImplementedError, "per sample"),
    (dict(policy_loss_type="grpo"), ValueError, "policy_loss_type"),
    (dict(dual_clip=1.0), ValueError, "dual_clip"),
])
def test_config_refuses_what_it_cannot_compute(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        policy_loss_config_from_openrlhf(**kwargs)


def test_config_mapping():
    cfg = policy_loss_config_from_openrlhf(0.1, 0.3, 2.0, True, "ppo", kl_coef=0.02, entropy_coef=0.001,
                                           temperature=0.7)
    assert (cfg.policy_loss, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.agg) == \
        ("ppo_clip", 0.1, 0.3, 2.0, "token-mean")
    assert (cfg.kl, cfg.beta, cfg.entropy_coef, cfg.temperature) == ("k1", 0.02, 0.001, 0.7)  # OpenRLHF's default
    assert (cfg.kl_clamp, cfg.kl_is_clip) == (10.0, None)
    for estimator, unbiased, expected in (("k2", False, ("k2", 10.0, None)), ("k3", False, ("low_var_kl", None, None)),
                                          ("k1", True, ("k1+", 10.0, 10.0)), ("k2", True, ("k2+", 10.0, 10.0)),
                                          ("k3", True, ("low_var_kl+", None, 10.0))):
        cfg = policy_loss_config_from_openrlhf(kl_coef=0.1, kl_estimator=estimator, kl_unbiased_gradient=unbiased)
        assert (cfg.kl, cfg.kl_clamp, cfg.kl_is_clip) == expected
    gspo = policy_loss_config_from_openrlhf(policy_loss_type="gspo", kl_estimator="k1")  # KL off: any estimator
    assert (gspo.policy_loss, gspo.agg, gspo.kl) == ("gspo", "seq-mean-token-mean", None)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(is_correction_level="sequence"), "is_correction_level"),
    (dict(is_correction_mode="truncate"), "is_correction_mode"),
    (dict(is_correction_gating="kl"), "is_correction_gating"),
    (dict(is_correction_level="seq", is_correction_mode="clip"), "needs is_correction_level='token'"),
    # checked with the correction off too, as OpenRLHF's constructor
    (dict(is_correction_level="off", is_correction_mode="clip", is_correction_gating="tv"),
     "needs is_correction_level='token'"),
    (dict(is_correction_level="token", is_correction_gating="tv"), "upper bound only"),
    (dict(is_correction_level="token", is_correction_threshold=(2.0, 1.0)), "low <= high"),
    (dict(is_correction_level="seq", is_correction_threshold=(float("nan"), 1.0)), "low <= high"),
    (dict(is_correction_level="token", is_correction_threshold=(0.5,)), "two numbers"),
])
def test_constructor_checks(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PolicyLoss(**kwargs)
    options = {"is_correction_level": "token", **kwargs}
    if len(options.get("is_correction_threshold", (0, 1))) == 2:  # the same checks in the public gate function
        with pytest.raises(ValueError, match=needle):
            is_correction_weights(Q.log(), P.log(), ALL, options["is_correction_level"],
                                  options.get("is_correction_mode", "mask"),
                                  options.get("is_correction_gating", "ratio"),
                                  *options.get("is_correction_threshold", (0.5, 5.0)))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(clip_eps_low=-0.1), r"^clip_eps_low=-0.1: PolicyLossConfig.clip_low must be >= 0"),
    (dict(clip_eps_high=float("nan")), r"^clip_eps_high=nan: PolicyLossConfig.clip_high must be finite"),
    (dict(dual_clip=float("inf")), r"^dual_clip=inf: PolicyLossConfig.dual_clip must be finite"),
])
def test_bad_settings_name_openrlhf_s_argument(kwargs, needle):
    """Settings the config refuses are named by OpenRLHF's argument and its value (they named the PolicyLossConfig
    field: ``clip_eps_low=-0.1`` raised ``PolicyLossConfig.clip_low must be >= 0``)."""
    with pytest.raises(ValueError, match=needle):
        PolicyLoss(**kwargs)
    with pytest.raises(ValueError, match=r"^kl_coef=-0.5: PolicyLossConfig.beta must be >= 0"):
        policy_loss_config_from_openrlhf(kl_coef=-0.5)


def test_bad_inputs_raise_naming_openrlhf_s_argument():
    logp, old, rollout, adv, mask = _inputs(0)
    loss = PolicyLoss(is_correction_level="token")
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        loss(logp, old, adv, mask)
    with pytest.raises(ValueError, match="old_log_probs"):
        loss(logp, old[:, :3], adv, mask, rollout)
    with pytest.raises(ValueError, match="action_mask must contain only 0 and 1"):
        loss(logp, old, adv, mask * 0.5, rollout)
    bad = rollout.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_log_probs contain NaN or inf where action_mask is set"):
        loss(logp, old, adv, mask, bad)
    bad_adv = adv.clone()
    bad_adv[1, 0] = float("inf")
    with pytest.raises(ValueError, match="advantages contain NaN or inf"):
        loss(logp, old, bad_adv, mask, rollout)
    with pytest.raises(ValueError, match="dp_size must be a positive integer"):
        loss(logp, old, adv, mask, rollout, dp_size=0, batch_num_tokens=10)
    with pytest.raises(ValueError, match="log_probs must be a floating"):
        loss(logp.long(), old, adv, mask, rollout)
    hidden, weight = torch.randn(5, 7, 4), torch.randn(11, 4)
    with pytest.raises(ValueError, match="action_ids must be an int32 or int64"):
        loss.forward_from_hidden(hidden, weight, torch.zeros(5, 7), old, adv, mask, rollout)
    with pytest.raises(ValueError, match="base_log_probs"):
        PolicyLoss().forward_from_hidden(hidden, weight, torch.zeros(5, 7, dtype=torch.long), old, adv, mask,
                                         kl_coef=0.1)


def test_action_mask_none_and_per_sequence_advantages():
    """``action_mask=None`` is every token; ``(B,)`` advantages broadcast over the response."""
    logp, old, _, adv, _ = _inputs(1, per_sequence_advantages=True)
    full = torch.ones_like(logp)
    loss = PolicyLoss()
    torch.testing.assert_close(loss(logp, old, adv[:, 0])[0], loss(logp, old, adv, full)[0])


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_step_traces_whole_and_does_not_recompile_per_step(fused):
    """A step compiled with ``fullgraph=True`` (``aot_eager``) over four steps whose adaptive KL coefficient
    (OpenRLHF's ``kl_ctl``), global token count and response lengths change: equal to eager (loss, gradients,
    metrics), no graph break, at most two graphs (the first call specialized, then symbolic)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss_fn = PolicyLoss(dual_clip=2.0, is_correction_level="seq")
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(1000, 16, generator=g) * 0.4

    def step(x, old, adv, mask, rollout, tokens, kl_coef, base, ids):
        if fused:
            return loss_fn.forward_from_hidden(x, weight, ids, old, adv, mask, rollout, 2, tokens, temperature=0.9,
                                               base_log_probs=base, kl_coef=kl_coef, entropy_coef=0.01,
                                               backend="cpu")[:5]
        return loss_fn(x, old, adv, mask, rollout, 2, tokens)

    compiled = torch.compile(step, fullgraph=True, backend=CompileCounterWithBackend("aot_eager"))
    for i, length in enumerate((7, 5, 9, 6)):
        logp, old, rollout, adv, mask = (torch.cat([t, t], dim=1)[:, :length].contiguous()
                                         for t in _inputs(i, torch.float32))
        ids = torch.randint(0, 1000, logp.shape, generator=g)
        x = torch.randn(*logp.shape, 16, generator=g) if fused else logp
        args = (old, adv, mask, rollout, torch.tensor(10.0 + i), 0.01 * (i + 1), old + 0.1, ids)
        results = []
        for fn in (step, compiled):
            leaf = x.clone().requires_grad_(True)
            out = fn(leaf, *args)
            out[0].backward()
            results.append((out, leaf.grad))
        (eager, eager_grad), (got, got_grad) = results
        torch.testing.assert_close(got[0], eager[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got_grad, eager_grad, rtol=1e-6, atol=1e-7)
        for e, c in zip(eager[1:], got[1:]):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2


def _upstream_and_ours(upstream, kwargs, logp, old, adv, mask, rollout):
    x_ref, x = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    expected = upstream.loss.PolicyLoss(**kwargs)(x_ref, old, adv, mask, rollout)
    got = PolicyLoss(**kwargs)(x, old, adv, mask, rollout)
    expected[0].backward()
    got[0].backward()
    return got, expected, x.grad, x_ref.grad


@pytest.mark.parametrize("far", [25.0, -25.0])
def test_sequence_gate_reads_the_unclamped_statistic(upstream, far):
    """One token 25 nats off in a 13-token response: the geometric mean is exp(+-25 / 13) = 6.8 or 0.15, outside
    (0.5, 5): OpenRLHF drops the response. (The weights' clamp at +-20 nats once entered the mean: exp(20 / 13) =
    4.66 kept it, with a token weight e^20 and a loss of -3.8e7.)"""
    old = torch.full((1, 13), -0.5, dtype=torch.float64)
    rollout = old.clone()
    old[0, 0], rollout[0, 0] = (-5.0, -30.0) if far > 0 else (-30.0, -5.0)
    logp, adv, mask = old + 0.01, torch.ones(1, 13, dtype=torch.float64), torch.ones(1, 13, dtype=torch.float64)
    got, expected, grad, grad_ref = _upstream_and_ours(upstream, _kwargs("ppo", None, True, "off") | dict(
        is_correction_level="seq", is_correction_threshold=(0.5, 5.0)), logp, old, adv, mask, rollout)
    assert got[0].item() == expected[0].item() == 0.0 and got[4].item() == expected[4].item() == 1.0
    torch.testing.assert_close(grad, grad_ref)


def test_a_negative_low_keeps_binary_kl_rounding_below_zero(upstream):
    """fp32 rounds this token's binary KL to -1.4e-9: ``low = 0`` drops it in OpenRLHF and here alike; a negative
    ``low`` (accepted, as OpenRLHF accepts it) keeps it."""
    old, rollout = torch.tensor([[-11.0783, -1.0]]), torch.tensor([[-11.0784, -1.0]])
    logp, adv, mask = old + 0.05, torch.ones(1, 2), torch.ones(1, 2)
    for low, dropped in ((0.0, 0.5), (-1e-6, 0.0)):
        kwargs = _kwargs("ppo", None, True, "off") | dict(is_correction_level="token", is_correction_gating="binary_kl",
                                                         is_correction_threshold=(low, 0.01))
        got, expected, grad, grad_ref = _upstream_and_ours(upstream, kwargs, logp, old, adv, mask, rollout)
        assert got[4].item() == expected[4].item() == dropped
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(grad, grad_ref)


def test_bf16_log_probs_against_fp32_inputs_compute_in_fp32(upstream):
    """bf16 log-probs with fp32 old log-probs and advantages: OpenRLHF's arithmetic promotes to fp32, so does the
    adapter (the loss fp32, equal to upstream's to fp32 rounding; the gradient in bf16, as the leaf)."""
    logp, old, rollout, adv, mask = (t.float() for t in _inputs(2))
    logp = logp.bfloat16()
    kwargs = _kwargs("ppo", 1.6, True, "token-mask")
    got, expected, grad, grad_ref = _upstream_and_ours(upstream, kwargs, logp, old, adv, mask, rollout)
    assert got[0].dtype == expected[0].dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=1e-2, atol=1e-4)


# ------------------------------------------------------------------------------ the actor's log-probs and entropy
def _logits(seed: int, dtype=torch.float32):
    """Peaked logits (one entry +25 in some rows) of two sequences, V = 300, and labels (the rolled sequence)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 7, 300, generator=g) * 2
    z[0, :3].scatter_add_(-1, torch.randint(0, 300, (3, 1), generator=g), torch.full((3, 1), 25.0))
    return z.to(dtype), torch.randint(0, 300, (2, 7), generator=g), torch.randn(2, 7, generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_from_logits_match_openrlhf(upstream, temperature):
    """OpenRLHF's fp32 path (its chunked logsumexp: flash-attn is not installed): the same log-probs and logits
    gradient; OpenRLHF divides the caller's logits by the temperature in place, fused_rl does not."""
    from fused_rl.integrations.openrlhf import log_probs_from_logits

    z, labels, upstream_grad = _logits(1)
    ours_x, theirs_x = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ours = log_probs_from_logits(ours_x, labels, temperature)
    theirs = upstream.utils.log_probs_from_logits(theirs_x.clone(), labels, temperature)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    (ours * upstream_grad).sum().backward()
    (theirs * upstream_grad).sum().backward()
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours_x.detach(), z) and ours.dtype == torch.float32


def test_log_probs_from_bf16_logits_are_fp32(upstream):
    """bf16 logits: fp32 log-probs of the bf16 values (OpenRLHF's row loop returns bf16 ones), within fp32 rounding
    of the float64 log-softmax and closer to it than OpenRLHF's."""
    from fused_rl.integrations.openrlhf import log_probs_from_logits

    z, labels, _ = _logits(2, torch.bfloat16)
    exact = torch.log_softmax(z.double(), -1).gather(-1, labels[..., None])[..., 0]
    ours = log_probs_from_logits(z, labels)
    theirs = upstream.utils.log_probs_from_logits(z.clone(), labels)
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), exact, atol=1e-5, rtol=1e-5)
    assert (ours.double() - exact).abs().max() < (theirs.double() - exact).abs().max()


def test_compute_entropy_matches_openrlhf(upstream):
    """The entropy of every position equals OpenRLHF's ``logsumexp(z) - sum softmax(z) z``; its logits gradient (a
    random upstream gradient) is the float64 one of that formula within 1e-7, where OpenRLHF's fp32 autograd is 1e-6
    off on these peaked rows (an entry of 1.04e-6 it gives as 0)."""
    from fused_rl.integrations.openrlhf import compute_entropy

    z, _, upstream_grad = _logits(3)
    dtypes = {"ours": torch.float32, "theirs": torch.float32, "f64": torch.float64}
    xs = {name: z.to(dtype).clone().requires_grad_(True) for name, dtype in dtypes.items()}
    ours, theirs = compute_entropy(xs["ours"]), upstream.utils.compute_entropy(xs["theirs"])
    exact = upstream.utils.compute_entropy(xs["f64"])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for value, name in ((ours, "ours"), (theirs, "theirs"), (exact, "f64")):
        (value * upstream_grad.to(value.dtype)).sum().backward()
    torch.testing.assert_close(xs["ours"].grad.double(), xs["f64"].grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(xs["theirs"].grad.double(), xs["f64"].grad, atol=2e-6, rtol=1e-5)


def test_patch_actor_swaps_the_two_functions_and_returns_the_old_ones():
    """``patch_actor`` rebinds the names the actor module calls (a stand-in module here: the real one imports
    DeepSpeed and flash-attn) and returns the previous pair."""
    from fused_rl.integrations import openrlhf

    old = (lambda *a: None, lambda *a: None)
    actor = types.SimpleNamespace(log_probs_from_logits=old[0], compute_entropy=old[1])
    assert openrlhf.patch_actor(actor) == old
    assert actor.log_probs_from_logits.func is openrlhf.log_probs_from_logits
    assert actor.compute_entropy.func is openrlhf.compute_entropy
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    torch.testing.assert_close(actor.log_probs_from_logits(logits, labels),
                               logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    p = logits.softmax(-1)
    torch.testing.assert_close(actor.compute_entropy(logits), -(p * p.log()).sum(-1))


def test_patch_actor_passes_its_options_on(monkeypatch):
    """``backend`` and ``check_inputs`` reach the fused pass of both patched functions (``check_inputs=False``: no
    host sync a call)."""
    from fused_rl.integrations import openrlhf

    seen = []
    real = openrlhf.token_logprobs, openrlhf.token_entropy

    def spy(*args, **kwargs):
        seen.append((kwargs["backend"], kwargs.get("check_inputs")))
        return real[len(args) == 1](*args, **kwargs)

    monkeypatch.setattr(openrlhf, "token_logprobs", spy)
    monkeypatch.setattr(openrlhf, "token_entropy", spy)
    actor = types.SimpleNamespace(log_probs_from_logits=None, compute_entropy=None)
    openrlhf.patch_actor(actor, backend="torch", check_inputs=False)
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    actor.log_probs_from_logits(logits, labels)
    actor.compute_entropy(logits)
    assert seen == [("torch", False), ("torch", None)]  # compute_entropy reads no ids
    labels[0, 0] = 7
    openrlhf.patch_actor(actor)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 7\)"):
        actor.log_probs_from_logits(logits, labels)


def test_patch_actor_reaches_openrlhf_actor_forward(upstream):
    """The rebinding takes effect in OpenRLHF's own ``Actor.forward`` (its ``actor.py`` read as source: importing it
    needs DeepSpeed): the module imports both names from ``.utils`` and ``forward`` calls them as module globals, so
    it looks up what ``patch_actor`` set at each call."""
    import ast

    root = Path(importlib.metadata.distribution("openrlhf").locate_file("openrlhf")) / "models"
    tree = ast.parse((root / "actor.py").read_text())
    names = {"log_probs_from_logits", "compute_entropy"}
    imported = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "utils"
                and node.level == 1 for alias in node.names}
    assert names <= imported
    actor = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Actor")
    forward = next(node for node in actor.body if isinstance(node, ast.FunctionDef) and node.name == "forward")
    called = {node.func.id for node in ast.walk(forward)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert names <= called
    assert not any(isinstance(node, (ast.Import, ast.ImportFrom, ast.Global)) for node in ast.walk(forward))


def test_compute_entropy_of_a_row_with_minus_inf_logits_is_finite():
    """``-inf`` logits (masked vocabulary entries) carry no probability: the entropy is that of the finite ones, with
    a finite gradient, where OpenRLHF's formula ``logsumexp(z) - sum softmax(z) z`` gives ``0 * -inf = NaN``."""
    from fused_rl.integrations.openrlhf import compute_entropy

    z, _, _ = _logits(4)
    z[:, :, 250:] = float("-inf")
    x = z.clone().requires_grad_(True)
    ours = compute_entropy(x)
    finite = z[..., :250].double()
    exact = torch.logsumexp(finite, -1) - (torch.softmax(finite, -1) * finite).sum(-1)
    torch.testing.assert_close(ours.double(), exact, atol=1e-5, rtol=1e-5)
    assert (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).isnan().all()  # OpenRLHF's, eager
    ours.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[..., 250:] == 0).all()


def test_log_prob_functions_pass_their_options_on():
    """``backend`` reaches both functions' kernel choice and ``check_inputs`` the label check of
    :func:`log_probs_from_logits` (an out-of-range label raises a ``ValueError``, not an out-of-bounds read)."""
    from fused_rl.integrations.openrlhf import compute_entropy, log_probs_from_logits

    z, labels, _ = _logits(5)
    for fn in (lambda **k: log_probs_from_logits(z, labels, **k), lambda **k: compute_entropy(z, **k)):
        with pytest.raises(ValueError, match="backend must be one of"):
            fn(backend="nope")
    with pytest.raises(ValueError, match=r"targets must be in \[0, 300\)"):
        log_probs_from_logits(z, labels + 300)
