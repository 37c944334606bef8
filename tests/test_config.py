"""PolicyLossConfig validation and the presets against an independent re-derivation of TRL's loss."""

import dataclasses
import math

import pytest
import torch

from fused_rl import PRESETS, PolicyLossConfig
from fused_rl.loss_math import compute_policy_loss


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy_loss="ppo"), "policy_loss"),
    (dict(kl="k4"), "kl"),
    (dict(agg="mean"), "agg"),
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_high=-0.1), "clip_high"),
    (dict(clip_high=float("nan")), "finite"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(policy_loss="cispo", dual_clip=3.0), "dual_clip"),
    (dict(beta=-1.0), "beta"),
    (dict(beta=0.1), "needs a KL estimator"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=1e-38), r"temperature must be >= 1e-05 \(below it samplers decode greedily"),
    (dict(temperature="1"), "real number"),
    (dict(entropy_coef=float("inf")), "finite"),
    (dict(temperature=10 ** 400), "must be finite"),  # an int beyond float's range: was an OverflowError
    (dict(kl="k3", beta=10 ** 400), "must be finite"),
    (dict(max_len=0, agg="seq-mean-token-sum-norm"), "max_len"),
    (dict(max_len=8), "only used by"),
    (dict(clip_low=True), "real number"),
    (dict(kl_bias_correction=True), "set kl"),
    (dict(kl="k3", kl_bias_correction=1), "must be a bool"),
    (dict(kl="k1", kl_clamp=0.0), "kl_clamp must be > 0"),
    (dict(kl="k1", kl_clamp=float("inf")), "kl_clamp must be finite"),
    (dict(kl="k3", kl_clamp=10.0), "low_var_kl"),
    (dict(kl="low_var_kl", kl_clamp=5.0), "kl_clamp applies to"),
    (dict(kl_clamp=10.0), "kl_clamp applies to"),
    (dict(kl="k1", kl_clamp=10.0, kl_bias_correction=True), "kl_clamp with kl_bias_correction"),
    (dict(kl="k1", kl_is_clip=10.0), "ending in '\\+'"),
    (dict(kl_is_clip=10.0), "ending in '\\+'"),
    (dict(kl="k2+", kl_is_clip=-1.0), "kl_is_clip must be > 0"),
    (dict(kl="k3+", kl_is_clip=10.0, kl_bias_correction=True), "two off-policy corrections"),
    (dict(policy_loss="dppo_tv", delta=0.0), "truncation of the importance weight"),
    (dict(policy_loss="dppo_kl", dual_clip=3.0), "dual_clip applies to"),
    (dict(policy_loss="cispo", delta=2.0), "delta applies to"),
    (dict(cov_mode="entropy"), "cov_mode must be one of"),
    (dict(cov_mode="kl_cov", cov_ratio=0.0), r"cov_ratio must be in \(0, 1\]"),
    (dict(cov_ratio=1.5), r"cov_ratio must be in \(0, 1\]"),
    (dict(cov_mode="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "must be < clip_cov_ub"),
    (dict(cov_mode="kl_cov", kl_cov_coef=-1.0), "kl_cov_coef must be >= 0"),
    (dict(cov_mode="clip_cov", policy_loss="cispo"), "clip_cov' drops tokens whose PPO clip is inactive"),
    (dict(cov_mode="clip_cov", dual_clip=3.0), "without dual_clip or delta"),
])
def test_invalid_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_frozen_hashable_and_normalized():
    a = PolicyLossConfig(clip_low=1 / 5, beta=0, temperature=1)
    b = PolicyLossConfig()
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.beta = 1.0  # type: ignore[misc]
    assert a.replace(beta=0.1, kl="k3").beta == 0.1
    with pytest.raises(ValueError):
        a.replace(beta=0.1)


def test_presets():
    assert set(PRESETS) == {"grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo", "ppo", "gspo_token", "gmpo", "sapo",
                            "luspo", "vespo"}
    assert PolicyLossConfig.preset("dapo").clip_high == 0.28
    assert PolicyLossConfig.preset("grpo", beta=0.04).kl == "k3"  # TRL's estimator
    assert PolicyLossConfig.preset("grpo", beta=0.04, kl="k1").kl == "k1"
    with pytest.raises(ValueError, match="unknown preset"):
        PolicyLossConfig.preset("ppo2")
    with pytest.raises(ValueError, match="unknown PolicyLossConfig field"):
        PolicyLossConfig.preset("grpo", epsilon=0.2)
    # Dr. GRPO's divisor is a constant: without max_len it would be each batch's padded length
    with pytest.raises(ValueError, match="needs max_len"):
        PolicyLossConfig.preset("dr_grpo")
    assert PolicyLossConfig.preset("dr_grpo", max_len=64).max_len == 64


def trl_loss(loss_type, logp, old, ref, adv, mask, *, beta, eps_low, eps_high, level="token",
             max_completion_length=None, num_items_in_batch=None, bias_correction=False):
    """Independent transcription of TRL GRPOTrainer._compute_loss (TRL 1.x) on given log-probs,
    single process, no gradient accumulation."""
    maskf = mask.float()
    log_ratio = logp - old
    if level == "sequence":
        log_iw = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_iw = log_ratio
    coef_1 = torch.exp(log_iw)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * a * logp
    elif loss_type == "vespo":  # get_gamma_weights with TRL's default k / lambda, no vLLM ratio
        with torch.no_grad():
            log_w = (torch.clamp(log_ratio, -20.0, 20.0) * maskf).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
            k = torch.where(a >= 0, 2.0, 3.0)
            lam = torch.where(a >= 0, 3.0, 2.0)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi * a * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * (kl * coef_1 if bias_correction else kl)
    if loss_type == "grpo":
        return ((per_token * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * maskf).sum() / maskf.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * maskf).sum() / (per_token.size(0) * max_completion_length)
    if loss_type == "luspo":
        return (per_token * maskf).sum(-1).mean()
    return (per_token * maskf).sum() / num_items_in_batch.clamp(min=1.0)  # dapo, cispo, vespo


@pytest.mark.parametrize("preset, trl_args", [
    ("grpo", dict(loss_type="grpo", eps_low=0.2, eps_high=0.2)),
    ("bnpo", dict(loss_type="bnpo", eps_low=0.2, eps_high=0.2)),
    ("dapo", dict(loss_type="dapo", eps_low=0.2, eps_high=0.28)),
    ("dr_grpo", dict(loss_type="dr_grpo", eps_low=0.2, eps_high=0.2)),
    ("gspo", dict(loss_type="grpo", eps_low=3e-4, eps_high=4e-4, level="sequence")),
    ("cispo", dict(loss_type="cispo", eps_low=0.2, eps_high=5.0)),
    ("luspo", dict(loss_type="luspo", eps_low=3e-4, eps_high=4e-4, level="sequence")),
    ("vespo", dict(loss_type="vespo", eps_low=0.2, eps_high=0.2)),
])
@pytest.mark.parametrize("beta, bias_correction", [(0.0, False), (0.04, False), (0.04, True)])
def test_presets_match_trl(preset, trl_args, beta, bias_correction):
    g = torch.Generator().manual_seed(11)
    B, T = 4, 7
    logp = (-torch.rand(B, T, generator=g) * 3).double()
    spread = 3e-4 if preset in ("gspo", "luspo") else (2.0 if preset == "cispo" else 0.3)
    old = logp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([[7], [3], [1], [5]])
    num_items = torch.tensor(40.0, dtype=torch.float64)  # tokens of the whole accumulated batch
    overrides = dict(beta=beta, kl_bias_correction=bias_correction)
    kwargs = {}
    if preset == "dr_grpo":
        overrides["max_len"] = 10
    if preset in ("dapo", "cispo", "vespo"):
        kwargs["token_normalizer"] = num_items
    cfg = PolicyLossConfig.preset(preset, **overrides)

    lp1 = logp.clone().requires_grad_(True)
    ours, _ = compute_policy_loss(lp1, adv.unsqueeze(1).expand(B, T), mask, cfg, old_logprobs=old,
                                  ref_logprobs=ref if beta else None, **kwargs)
    ours.backward()
    lp2 = logp.clone().requires_grad_(True)
    theirs = trl_loss(
        trl_args["loss_type"], lp2, old, ref, adv, mask, beta=beta, eps_low=trl_args["eps_low"],
        eps_high=trl_args["eps_high"], level=trl_args.get("level", "token"), max_completion_length=10,
        num_items_in_batch=num_items, bias_correction=bias_correction)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    # TRL's padding positions receive gradient 0 in both; compare the whole gradient
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("fields, message", [
    (dict(delta=1.1), "delta must be > 1 \\+ clip_high"),
    (dict(policy_loss="cispo", delta=2.0), "delta applies to"),
    (dict(policy_loss="sapo", dual_clip=3.0), "dual_clip applies to"),
    (dict(policy_loss="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 1.2e-38"),
    # finite in fp64, not in the kernels' fp32: a -inf loss, an inf gradient (1e-50: 4 / tau) or NaN (1e39)
    (dict(policy_loss="sapo", sapo_temperature_pos=1e-50), r"must be > 1.2e-38 \(4 / tau finite in float32\)"),
    (dict(policy_loss="sapo", sapo_temperature_pos=1e39), r"must be finite in float32 \(\|x\| < 3.4e38\)"),
    (dict(kl="k3", beta=1e39), "beta must be finite in float32"),
    (dict(policy_loss="vespo", vespo_lambda_pos=-0.5), "vespo_lambda_pos must be >= 0"),
    (dict(policy_loss="gmpo", clip_low=-0.1), "clip_low must be >= 0"),
    (dict(kl="k4+", beta=0.1), "kl must be one of"),
    (dict(rollout_is="token_clip"), "rollout_is must be one of"),
    (dict(rollout_is="token_mask", rollout_is_max=None), "needs rollout_is_max and/or rollout_is_min"),
    (dict(rollout_is="token_mask", rollout_is_min=3.0, rollout_is_max=2.0), "must be <= rollout_is_max"),
    (dict(rollout_is_max=float("nan")), "must be finite"),
    (dict(off_policy_mask=-0.1), "off_policy_mask must be >= 0"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
    (dict(mask_truncated_completions=1), "must be a bool"),
])
def test_new_fields_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**fields)


def test_new_fields_route_the_backends():
    assert PolicyLossConfig(policy_loss="gmpo", clip_low=1.5).clip_low == 1.5  # log-space: may exceed 1
    for cfg in (PolicyLossConfig(), PolicyLossConfig(policy_loss="sapo"), PolicyLossConfig(delta=2.0),
                PolicyLossConfig(kl="k3+"), PolicyLossConfig(kl="k1", kl_bias_correction=True),
                PolicyLossConfig(kl="k2+", kl_clamp=10.0, kl_is_clip=10.0),
                PolicyLossConfig(rollout_is="token_truncate"), PolicyLossConfig(rollout_is="token_mask")):
        assert cfg.has_token_epilogue  # token-local: the single-pass kernels
    for cfg in (PolicyLossConfig(policy_loss="gspo"), PolicyLossConfig(policy_loss="gspo_token"),
                PolicyLossConfig(policy_loss="gmpo"), PolicyLossConfig(rollout_is="sequence_truncate"),
                PolicyLossConfig(off_policy_mask=0.1), PolicyLossConfig(top_entropy_quantile=0.2)):
        assert not cfg.has_token_epilogue
    assert PolicyLossConfig(rollout_is="sequence_mask").is_sequence_level
    assert not PolicyLossConfig(rollout_is="token_mask").is_sequence_level
    assert PolicyLossConfig(off_policy_mask=0.1).is_sequence_level
    assert PolicyLossConfig(top_entropy_quantile=0.2).is_batch_level and PolicyLossConfig(top_entropy_quantile=0.2).needs_entropy
    for cfg in (PolicyLossConfig(cov_mode="clip_cov"), PolicyLossConfig(policy_loss="cispo", cov_mode="kl_cov")):
        assert cfg.is_batch_level and not cfg.has_token_epilogue and not cfg.needs_entropy
    assert PolicyLossConfig(policy_loss="dppo_kl", delta=3.0).has_token_epilogue


def test_numpy_scalars_are_numbers():
    """Numbers from numpy (a sweep's ``np.linspace``, a config file read with numpy) are accepted and
    stored as Python numbers, so equal configs stay equal and hash alike."""
    np = pytest.importorskip("numpy")
    a = PolicyLossConfig(clip_low=np.float64(0.1), temperature=np.float64(0.7), beta=np.float32(0.5), kl="k3",
                         agg="seq-mean-token-sum-norm", max_len=np.int64(9))
    b = PolicyLossConfig(clip_low=0.1, temperature=0.7, beta=0.5, kl="k3", agg="seq-mean-token-sum-norm", max_len=9)
    assert a == b and hash(a) == hash(b) and type(a.max_len) is int and type(a.beta) is float
    with pytest.raises(ValueError, match="must be a real number"):
        PolicyLossConfig(clip_low=np.bool_(True))


@pytest.mark.parametrize("policy_loss, unused", [
    ("ppo_clip", {"sapo_temperature_pos", "vespo_k_neg", "rollout_is_max"}),
    ("gmpo", {"sapo_temperature_pos", "vespo_k_neg", "rollout_is_max"}),
    ("cispo", {"clip_low", "sapo_temperature_pos", "vespo_k_neg", "rollout_is_max"}),
    ("sapo", {"clip_low", "clip_high", "vespo_k_neg", "rollout_is_max"}),
    ("reinforce", {"clip_low", "clip_high", "sapo_temperature_pos", "vespo_k_neg", "rollout_is_max"}),
    ("vespo", {"clip_low", "clip_high", "sapo_temperature_pos", "rollout_is_max"}),
])
def test_unused_fields_name_what_the_loss_never_reads(policy_loss, unused):
    """Each field's readers, checked against the loss math: a field the loss never reads changes no loss value."""
    asked = ["clip_low", "clip_high", "sapo_temperature_pos", "vespo_k_neg", "rollout_is_max", "beta", "agg"]
    config = PolicyLossConfig(policy_loss=policy_loss)
    assert set(config.unused_fields(asked)) == unused
    assert not PolicyLossConfig(rollout_is="token_mask").unused_fields(["rollout_is_max", "rollout_is_min"])
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 2
    old = logp + 0.5 * torch.randn(3, 5, generator=g)  # ratios well outside every clip range
    rollout = old + 0.5 * torch.randn(3, 5, generator=g)
    adv, mask = torch.tensor([[1.0], [-1.0], [0.5]]).expand(3, 5), torch.ones(3, 5, dtype=torch.bool)
    changed = dict(clip_low=0.05, clip_high=0.05, sapo_temperature_pos=3.0, vespo_k_neg=1.0, rollout_is_max=1.01)
    for name, value in changed.items():
        (loss, stats), (loss2, stats2) = [compute_policy_loss(logp, adv, mask, c, old_logprobs=old,
                                                              rollout_logprobs=rollout)
                                          for c in (config, config.replace(**{name: value}))]
        same = bool(loss == loss2) and all(bool(stats[k].eq(stats2[k]) | stats[k].isnan()) for k in stats)
        assert same == (name in unused), name


def test_literal_holds_the_structure_and_float_values_the_floats():
    """How the custom ops take a config: :attr:`literal` (the fields, each set float ``...``) and :attr:`float_values`
    (``nan`` where an optional float is unset). Configs that differ in a float share the literal (under torch.compile
    a constant string: a new value is not a new graph); :meth:`from_literal` rebuilds each config exactly, unset
    optional floats included; every float-typed field is in ``FLOAT_FIELDS``."""
    from fused_rl.config import FLOAT_FIELDS, literal_fields

    annotated = {f.name for f in dataclasses.fields(PolicyLossConfig) if "float" in str(f.type)}
    assert set(FLOAT_FIELDS) == annotated
    configs = [PolicyLossConfig(), PolicyLossConfig(beta=0.04, kl="k3", clip_high=0.28, dual_clip=3.0, delta=1.5),
               PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=0.7, temperature=0.9),
               PolicyLossConfig(rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=None, off_policy_mask=0.3,
                                top_entropy_quantile=0.2, entropy_coef=1e-3, agg="seq-mean-token-sum-norm", max_len=7)]
    for config in configs:
        assert PolicyLossConfig.from_literal(config.literal, config.float_values) == config
        fields = literal_fields(config.literal)
        assert all(fields[name] is (None if getattr(config, name) is None else Ellipsis) for name in FLOAT_FIELDS)
        assert [math.isnan(v) for v in config.float_values] == [getattr(config, n) is None for n in FLOAT_FIELDS]
    other = configs[1].replace(beta=0.05, clip_high=0.3, dual_clip=2.5, temperature=0.7)
    assert other.literal == configs[1].literal and other.float_values != configs[1].float_values
    without = configs[3].replace(rollout_is=None)
    assert PolicyLossConfig.from_literal(configs[3].literal_without_rollout, configs[3].float_values) == without
    assert configs[1].replace(kl="k2").literal != configs[1].literal


def test_the_ops_floats_stay_on_the_host_under_a_default_device():
    """``custom_ops.config_args``' floats are read on the host inside the ops: under ``torch.set_default_device``
    (here ``meta``; ``cuda`` in a user's script) they are still a CPU tensor, never a device one (a sync to read)."""
    from fused_rl.backends.custom_ops import config_args, config_from_args

    config = PolicyLossConfig(beta=0.04, kl="k3", rollout_is="token_truncate", rollout_is_max=2.5)
    with torch.device("meta"):
        literal, floats = config_args(config)
    assert floats.device == torch.device("cpu") and floats.dtype == torch.float64
    assert config_from_args(literal, floats) == config


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "luspo"])
def test_gspo_presets_clip_range(name):
    """GSPO's clip range (the paper's and TRL's ``epsilon=3e-4``, ``epsilon_high=4e-4``): a sequence ratio of
    ``e^3.5e-4`` with ``A > 0`` is inside it, so its tokens keep their gradient (the two swapped survived the
    suite: only a ratio between the bounds tells them apart)."""
    config = PolicyLossConfig.preset(name)
    assert (config.clip_low, config.clip_high) == (3e-4, 4e-4)
    logp = torch.full((1, 2), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(logp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                                  config, old_logprobs=logp.detach() - 3.5e-4)
    loss.backward()
    assert (logp.grad != 0).all()


def test_kl_is_clip_is_unused_at_beta_zero():
    """``kl_is_clip`` weights the KL's gradient only: at ``beta = 0`` loss, gradient and metrics are those without
    it, and ``unused_fields`` says so (it listed nothing)."""
    import fused_rl

    with_clip = PolicyLossConfig(kl="k2+", kl_is_clip=2.0)
    assert set(with_clip.unused_fields(["kl_is_clip", "kl"])) == {"kl_is_clip"}
    assert not PolicyLossConfig(kl="k2+", beta=0.1, kl_is_clip=2.0).unused_fields(["kl_is_clip"])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=g)
    targets = torch.randint(0, 7, (2, 4), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old, ref = lp + 0.5 * torch.randn(2, 4, generator=g), lp + 0.5 * torch.randn(2, 4, generator=g)
    outs = []
    for config in (with_clip, PolicyLossConfig(kl="k2+")):
        x = logits.clone().requires_grad_(True)
        out = fused_rl.reference.policy_loss(x, targets, torch.tensor([1.0, -1.0]), torch.ones(2, 4, dtype=torch.bool),
                                             old_logprobs=old.clamp(max=0), ref_logprobs=ref.clamp(max=0),
                                             config=config)
        out.loss.backward()
        outs.append((out.loss, x.grad, out.metrics))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2].keys() == outs[1][2].keys()
    assert all(torch.equal(outs[0][2][k], outs[1][2][k]) for k in outs[0][2])


def test_equal_rollout_bounds_are_valid():
    """``rollout_is_min == rollout_is_max`` is allowed (only ``min > max`` is refused)."""
    PolicyLossConfig(rollout_is="token_mask", rollout_is_min=1.0, rollout_is_max=1.0)


def test_clip_cov_refuses_delta():
    """clip_cov needs ppo_clip without dual_clip *or delta*."""
    with pytest.raises(ValueError, match="without dual_clip or delta"):
        PolicyLossConfig(cov_mode="clip_cov", delta=1.5)
