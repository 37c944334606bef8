"""fused_rl.nn: the loss modules, the TRL/Liger option mapping, and the Liger-Kernel drop-in.

``FusedLinearGRPOLoss`` is compared with ``LigerFusedLinearGRPOLoss(compiled=False)`` (plain torch, so it
runs on CPU) on the same inputs: loss, metrics and the gradients of the hidden states, weight and bias.
"""

from __future__ import annotations

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.nn import FusedLinearGRPOLoss, FusedLinearPolicyLoss, FusedPolicyLoss, grpo_policy_loss_config

from helpers import CONFIGS, assert_close, make_case


# ----------------------------------------------------------------------------- FusedPolicyLoss
@pytest.mark.parametrize("config", CONFIGS[:4], ids=lambda c: f"{c.policy_loss}-{c.agg}")
def test_fused_policy_loss_module_matches_reference(config):
    case = make_case(batch=4, length=5, vocab=1000, seed=3)
    ref_logits = case.logits.clone().requires_grad_(True)
    expected = fused_rl.reference.policy_loss(ref_logits, case.targets, case.advantages, case.mask, config=config,
                                              **case.kwargs())
    expected.loss.backward()
    module = FusedPolicyLoss(config, backend="auto")
    logits = case.logits.clone().requires_grad_(True)
    got = module(logits, case.targets, case.advantages, case.mask, **case.kwargs())
    got.loss.backward()
    assert_close(got.loss, expected.loss, torch.float32, "loss")
    assert_close(logits.grad, ref_logits.grad, torch.float32, "dlogits", grad=True)
    for name, value in expected.metrics.items():
        assert_close(got.metrics[name], value, torch.float32, name)


def _linear_case(batch=4, length=6, hidden=16, vocab=1000, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    b = torch.randn(vocab, generator=g) if bias else None
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    lengths = torch.tensor([0, 1] + torch.randint(2, length + 1, (batch - 2,), generator=g).tolist())
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.randn(batch, generator=g)
    with torch.no_grad():
        logits = torch.nn.functional.linear(h, w, b)
        lp = torch.log_softmax(logits / 0.8, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.5 * torch.randn(lp.shape, generator=g)
    ref = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return h, w, b, targets, mask, advantages, old, ref


@pytest.mark.parametrize("config", [PolicyLossConfig(temperature=0.8), CONFIGS[1].replace(temperature=0.8)],
                         ids=["ppo", "dual-k3-entropy"])
def test_fused_linear_policy_loss_module_matches_reference(config):
    h, w, b, targets, mask, adv, old, ref = _linear_case()
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    expected = fused_rl.reference.linear_policy_loss(leaves[0], leaves[1], targets, adv, mask, bias=leaves[2],
                                                     old_logprobs=old, ref_logprobs=ref, config=config)
    expected.loss.backward()
    got_leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    got = FusedLinearPolicyLoss(config)(got_leaves[0], got_leaves[1], targets, adv, mask, bias=got_leaves[2],
                                        old_logprobs=old, ref_logprobs=ref)
    got.loss.backward()
    assert_close(got.loss, expected.loss, torch.float32, "loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got_leaves, leaves):
        assert_close(a.grad, e.grad, torch.float32, f"d{name}", grad=True)


def test_fused_linear_policy_loss_module_passes_its_memory_budget(monkeypatch):
    """``memory_budget_bytes`` reaches the tiles: a 3-token budget (3 fp32 rows of V = 1000) gives 3-token tiles,
    whose result is the reference's; a budget of 0 is refused."""
    from fused_rl.backends import tiled_linear

    sizes = []
    chunk_tokens = tiled_linear.chunk_tokens
    monkeypatch.setattr(tiled_linear, "chunk_tokens", lambda *a, **k: sizes.append(chunk_tokens(*a, **k)) or sizes[-1])
    h, w, b, targets, mask, adv, old, ref = _linear_case()
    config = PolicyLossConfig(temperature=0.8)
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    expected = fused_rl.reference.linear_policy_loss(leaves[0], leaves[1], targets, adv, mask, bias=leaves[2],
                                                     old_logprobs=old, config=config)
    expected.loss.backward()
    got_leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    module = FusedLinearPolicyLoss(config, backend="cpu", memory_budget_bytes=3 * 1000 * 4)
    got = module(got_leaves[0], got_leaves[1], targets, adv, mask, bias=got_leaves[2], old_logprobs=old)
    got.loss.backward()
    assert sizes == [3]
    assert_close(got.loss, expected.loss, torch.float32, "loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got_leaves, leaves):
        assert_close(a.grad, e.grad, torch.float32, f"d{name}", grad=True)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        FusedLinearPolicyLoss(config, memory_budget_bytes=0)(h, w, targets, adv, mask)


def test_module_rejects_non_config():
    with pytest.raises(ValueError, match="PolicyLossConfig"):
        FusedPolicyLoss({"policy_loss": "ppo_clip"})
    with pytest.raises(ValueError, match="PolicyLossConfig"):
        FusedLinearPolicyLoss("grpo")


# ----------------------------------------------------------------------------- option mapping
def test_grpo_policy_loss_config_mapping():
    assert grpo_policy_loss_config("grpo", epsilon_low=0.2) == PolicyLossConfig(agg="seq-mean-token-mean")
    assert grpo_policy_loss_config("bnpo", epsilon_low=0.1, epsilon_high=0.3) == PolicyLossConfig(
        clip_low=0.1, clip_high=0.3, agg="token-mean")
    assert grpo_policy_loss_config("dr_grpo", max_completion_length=16, beta=0.04) == PolicyLossConfig(
        agg="seq-mean-token-sum-norm", max_len=16, kl="k3", beta=0.04)
    assert grpo_policy_loss_config("dapo", epsilon_high=0.28, temperature=0.7) == PolicyLossConfig(
        clip_high=0.28, temperature=0.7)
    assert grpo_policy_loss_config("cispo", epsilon_high=5.0) == PolicyLossConfig(
        policy_loss="cispo", clip_low=0.0, clip_high=4.0)
    assert grpo_policy_loss_config("grpo", importance_sampling_level="sequence", epsilon_low=3e-4,
                                   epsilon_high=4e-4) == PolicyLossConfig.preset("gspo")
    assert grpo_policy_loss_config("luspo", importance_sampling_level="sequence", epsilon_low=3e-4,
                                   epsilon_high=4e-4) == PolicyLossConfig.preset("luspo")
    assert grpo_policy_loss_config("luspo", delta=1.5) == PolicyLossConfig(agg="seq-mean-token-sum", delta=1.5)
    assert grpo_policy_loss_config("vespo") == PolicyLossConfig.preset("vespo")
    assert grpo_policy_loss_config("vespo", vespo_k_neg=1.5, beta=0.1, vllm_importance_sampling_mode="token_mask") == \
        PolicyLossConfig.preset("vespo", vespo_k_neg=1.5, kl="k3", beta=0.1, rollout_is="token_mask",
                                rollout_is_max=3.0)


@pytest.mark.parametrize("kwargs, exc, needle", [
    (dict(loss_type="sapo", importance_sampling_level="sequence"), NotImplementedError, "sapo"),
    (dict(loss_type="vespo", importance_sampling_level="sequence"), NotImplementedError, "vespo"),
    (dict(loss_type="vespo", delta=1.5), ValueError, "delta"),
    (dict(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"), ValueError, "token-level rollout"),
    (dict(loss_type="vespo", vespo_lambda_neg=-1.0), ValueError, "vespo_lambda_neg must be >= 0"),
    (dict(loss_type="nope"), ValueError, "unknown loss_type"),
    (dict(loss_type="cispo", epsilon_high=5.0, delta=1.5), ValueError, "delta"),
    (dict(loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence"), NotImplementedError,
     "sequence"),
    (dict(loss_type="cispo", epsilon_high=0.2), ValueError, "epsilon_high"),
    (dict(loss_type="grpo", epsilon_high=0.28, delta=1.2), NotImplementedError, r"delta=1.2 <= 1 \+ epsilon_high"),
    (dict(loss_type="dr_grpo"), ValueError, "max_completion_length"),
    (dict(loss_type="grpo", importance_sampling_level="token-ish"), ValueError, "importance_sampling_level"),
])
def test_grpo_policy_loss_config_rejects(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        grpo_policy_loss_config(**kwargs)


def test_grpo_policy_loss_config_maps_the_new_trl_options():
    assert grpo_policy_loss_config("sapo", sapo_temperature_pos=2.0) == PolicyLossConfig(
        policy_loss="sapo", sapo_temperature_pos=2.0, agg="seq-mean-token-mean")
    assert grpo_policy_loss_config("dapo", epsilon_high=0.28, delta=1.5).delta == 1.5
    cfg = grpo_policy_loss_config("grpo", top_entropy_quantile=0.2, off_policy_mask_threshold=0.5,
                                  vllm_importance_sampling_mode="token_truncate",
                                  vllm_importance_sampling_clip_max=2.0)
    assert (cfg.top_entropy_quantile, cfg.off_policy_mask, cfg.rollout_is, cfg.rollout_is_max) == (
        0.2, 0.5, "token_truncate", 2.0)


def test_bias_correction_maps_to_kl_bias_correction():
    assert grpo_policy_loss_config("dapo", beta=0.1, use_bias_correction_kl=True).kl_bias_correction


def test_bias_correction_without_kl_is_a_no_op():
    # Liger and TRL apply the correction to the KL term only: with beta == 0 nothing changes.
    assert grpo_policy_loss_config("dapo", use_bias_correction_kl=True) == grpo_policy_loss_config("dapo")


# ----------------------------------------------------------------------------- Liger drop-in
try:
    from liger_kernel.chunked_loss import grpo_loss as liger_grpo
except ImportError:  # the non-Liger tests above still run
    liger_grpo = None
needs_liger = pytest.mark.skipif(liger_grpo is None, reason="liger-kernel is not installed (pip install liger-kernel)")

LIGER_CASES = [
    dict(loss_type="grpo", beta=0.0),
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="bnpo", beta=0.04, epsilon_low=0.1, epsilon_high=0.3),
    dict(loss_type="dr_grpo", beta=0.0, max_completion_length=9),
    dict(loss_type="dr_grpo", beta=0.1, max_completion_length=9),
    dict(loss_type="dapo", beta=0.0, epsilon_high=0.28),
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True),
    dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True),
    dict(loss_type="cispo", beta=0.0, epsilon_high=1.1),
    dict(loss_type="cispo", beta=0.04, epsilon_high=1.1),
    dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence", epsilon_low=0.01, epsilon_high=0.01),
    dict(loss_type="dapo", beta=0.0, importance_sampling_level="sequence", epsilon_low=0.01, epsilon_high=0.01),
    dict(loss_type="sapo", beta=0.0),
    dict(loss_type="sapo", beta=0.04, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    dict(loss_type="sapo", beta=0.04, use_bias_correction_kl=True),
    dict(loss_type="grpo", beta=0.0, delta=1.3),
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, delta=1.5, use_bias_correction_kl=True),
    dict(loss_type="vespo", beta=0.0),
    dict(loss_type="vespo", beta=0.04, vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.0,
         use_bias_correction_kl=True),
    dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence", epsilon_low=0.01, epsilon_high=0.01),
]


def _ids(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


def _run_grpo_loss(module, h, w, b, targets, mask, adv, forward_kwargs):
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    loss, metrics = module(leaves[0], leaves[1], targets, mask, adv, bias=leaves[2], **forward_kwargs)
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], [x.grad for x in leaves]


@needs_liger
@pytest.mark.parametrize("case, off_policy, num_items", [
    pytest.param(case, off_policy, num_items, id=f"{_ids(case)}-{'off' if off_policy else 'on'}-n{num_items}")
    for case in LIGER_CASES for off_policy in (False, True)
    # num_items_in_batch only changes dapo / cispo
    for num_items in ((None, 37) if case["loss_type"] in ("dapo", "cispo", "vespo") else (None,))
])
def test_matches_liger(case, off_policy, num_items):
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=8, length=8, seed=LIGER_CASES.index(case))
    ctor = dict(case, temperature=0.8)
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old if off_policy else None,
                   num_items_in_batch=None if num_items is None else torch.tensor(float(num_items)))
    expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **ctor), h, w, b, targets, mask,
                              adv, forward)
    got = _run_grpo_loss(FusedLinearGRPOLoss(**ctor), h, w, b, targets, mask, adv, forward)
    assert_close(got[0], expected[0], torch.float32, "loss")
    assert len(got[1]) == len(expected[1]) == (2 if case["beta"] else 1)
    for i, (a, e) in enumerate(zip(got[1], expected[1])):
        assert_close(a, e, torch.float32, f"metric {i}")
    for name, a, e in zip(("hidden", "weight", "bias"), got[2], expected[2]):
        assert_close(a, e, torch.float32, f"d{name}", grad=True)
    if off_policy and case["loss_type"] not in ("cispo", "sapo", "vespo"):  # no clip there (Liger reports 0)
        assert got[1][-1] > 0, "clip range never reached: the off-policy comparison is vacuous"
    if off_policy and case.get("delta"):
        logp = torch.log_softmax(torch.nn.functional.linear(h, w, b) / 0.8, -1).gather(
            -1, targets.unsqueeze(-1)).squeeze(-1)
        binding = (torch.exp(logp - old) > case["delta"]) & (adv.unsqueeze(1) < 0) & mask.bool()
        assert binding.any(), "no ratio above delta where A < 0: the delta comparison is vacuous"


@needs_liger
@pytest.mark.parametrize("case", [dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo", beta=0.0),
                                  dict(loss_type="sapo", beta=0.04), dict(loss_type="cispo", epsilon_high=1.1)],
                         ids=_ids)
@pytest.mark.parametrize("per_sequence", [False, True], ids=["token", "sequence"])
def test_matches_liger_vllm_is_ratio(case, per_sequence):
    """TRL hands Liger ``vllm_is_ratio``, its truncated importance weights against vLLM, ``(B, T)`` or
    ``(B, 1)``; zeros included (masked-IS modes)."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=8, length=8, seed=21)
    g = torch.Generator().manual_seed(3)
    ratio = 2.0 * torch.rand((8, 1) if per_sequence else (8, 8), generator=g)
    ratio[::3] = 0.0
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old, vllm_is_ratio=ratio)
    expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **case), h, w, b, targets, mask,
                              adv, forward)
    got = _run_grpo_loss(FusedLinearGRPOLoss(**case), h, w, b, targets, mask, adv, forward)
    unweighted = _run_grpo_loss(FusedLinearGRPOLoss(**case), h, w, b, targets, mask, adv,
                                dict(forward, vllm_is_ratio=None))
    assert not torch.allclose(got[0], unweighted[0])  # the weights matter here
    assert_close(got[0], expected[0], torch.float32, "loss")
    for a, e in zip(got[1], expected[1]):
        assert_close(a, e, torch.float32, "metric")
    for name, a, e in zip(("hidden", "weight", "bias"), got[2], expected[2]):
        assert_close(a, e, torch.float32, f"d{name}", grad=True)


@needs_liger
def test_matches_liger_ref_input_and_no_ref_model():
    h, w, b, targets, mask, adv, old, _ = _linear_case(seed=5)
    ref_h = h + 0.1 * torch.randn_like(h)
    ref_w = w + 0.05 * torch.randn_like(w)
    for ctor, forward in [
        (dict(beta=0.1, loss_type="bnpo"), dict(ref_input=ref_h, ref_weight=ref_w, ref_bias=b)),
        (dict(beta=0.1, loss_type="grpo", use_ref_model=False), {}),
    ]:
        forward = dict(forward, old_per_token_logps=old)
        expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **ctor), h, w, b, targets,
                                  mask, adv, forward)
        got = _run_grpo_loss(FusedLinearGRPOLoss(**ctor), h, w, b, targets, mask, adv, forward)
        assert_close(got[0], expected[0], torch.float32, "loss")
        for a, e in zip(got[1], expected[1]):
            assert_close(a, e, torch.float32, "metric")
        for a, e in zip(got[2], expected[2]):
            assert_close(a, e, torch.float32, "grad", grad=True)


@needs_liger
def test_liger_signature_compatible():
    import inspect

    liger = liger_grpo.LigerFusedLinearGRPOLoss
    for fn_ours, fn_liger in ((FusedLinearGRPOLoss.__init__, liger.__init__),
                              (FusedLinearGRPOLoss.forward, liger.forward)):
        ours = inspect.signature(fn_ours).parameters
        theirs = inspect.signature(fn_liger).parameters
        positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert [n for n in ours if n in positional] == positional, "positional order differs from Liger"
        for name, param in theirs.items():
            assert ours[name].default == param.default, f"default of {name} differs from Liger"


@pytest.mark.parametrize("ctor, forward, exc, needle", [
    (dict(loss_type="vespo", beta=0.0), dict(vllm_is_ratio=torch.ones(2, 5)), NotImplementedError,
     "vespo.*vllm_is_ratio"),
    (dict(loss_type="cispo", epsilon_high=5.0, delta=2.0), {}, ValueError, "delta"),
    (dict(beta=0.0), dict(vllm_is_ratio=torch.ones(4, 5)), ValueError, "vllm_is_ratio must have shape"),
    (dict(beta=0.04), {}, ValueError, "ref_per_token_logps"),
    (dict(loss_type="cispo"), {}, ValueError, "clip_high"),  # Liger's default epsilon_high 0.2 as the cap
    (dict(beta=0.0), dict(weighted_mask=True), ValueError, "attention_mask must contain only 0 and 1"),
])
def test_liger_unsupported_raise(ctor, forward, exc, needle):
    h, w, b, targets, mask, adv, _, _ = _linear_case()
    if forward.pop("weighted_mask", False):  # Liger would weight the tokens by it; fused_rl raises
        mask = mask.float() * 0.5
    with pytest.raises(exc, match=needle):
        FusedLinearGRPOLoss(**ctor)(h, w, targets, mask, adv, **forward)


@pytest.mark.parametrize("ctor, needle", [
    (dict(epsilon_low=-0.1), r"^epsilon_low=-0.1: PolicyLossConfig.clip_low must be >= 0"),
    (dict(epsilon_high=-0.5), r"^epsilon_high=-0.5: PolicyLossConfig.clip_high must be >= 0"),
    (dict(beta=-0.1), r"^beta=-0.1: PolicyLossConfig.beta must be >= 0"),
    (dict(temperature=0.0), r"^temperature=0.0: PolicyLossConfig.temperature must be >= 1e-05"),
    (dict(delta=float("nan")), r"^delta=nan: PolicyLossConfig.delta must be finite"),
    (dict(loss_type="vespo", vespo_lambda_neg=-1.0), r"^vespo_lambda_neg=-1.0: PolicyLossConfig.vespo_lambda_neg"),
    (dict(loss_type="dr_grpo", max_completion_length=0), r"^max_completion_length=0: PolicyLossConfig.max_len"),
    # was int(4.5): a loss divided by 4 where Liger divides by 4.5
    (dict(loss_type="dr_grpo", max_completion_length=4.5), r"^max_completion_length=4.5: .*must be a positive int"),
    (dict(loss_type="dr_grpo", max_completion_length=True), r"^max_completion_length=True: .*must be a positive int"),
])
def test_bad_settings_name_liger_arguments(ctor, needle):
    """Bad constructor values raise naming Liger's argument and its value (they named the PolicyLossConfig field
    it maps to: ``epsilon_low=-0.1`` raised ``PolicyLossConfig.clip_low must be >= 0``)."""
    with pytest.raises(ValueError, match=needle):
        FusedLinearGRPOLoss(**ctor)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(epsilon_low="0.2"), r"^epsilon_low='0.2': PolicyLossConfig.clip_low must be a real number"),  # was 0.2
    (dict(epsilon_low=True), r"^epsilon_low=True: .*must be a real number"),  # was 1.0
    (dict(beta="0.04"), r"^beta='0.04': .*must be a real number"),  # was 0.04
    (dict(beta=0.1, use_bias_correction_kl="False"), r"^use_bias_correction_kl must be a bool, got 'False'"),  # True
    (dict(epsilon_low=None), r"^epsilon_low=None: .*must be a real number"),  # TypeError from float()
    (dict(delta="2"), r"^delta='2': .*must be a real number"),  # TypeError from "2" <= 1.2
    (dict(loss_type="cispo", epsilon_high="5"), r"^epsilon_high='5': .*must be a real number"),  # TypeError
    (dict(loss_type="sapo", sapo_temperature_pos=None), r"^sapo_temperature_pos=None: .*must be a real number"),
])
def test_grpo_config_refuses_what_is_not_a_number(kwargs, needle):
    """TRL's / Liger's numeric options are numbers before anything compares or converts them: a string or a bool
    was converted by ``float()`` / ``bool()`` (``"False"`` turned the bias correction on) or raised a TypeError."""
    with pytest.raises(ValueError, match=needle):
        grpo_policy_loss_config(**{"loss_type": "grpo", **kwargs})


@pytest.mark.parametrize("ctor, needle", [
    (dict(sapo_temperature_pos="1"), r"sapo_temperature_pos must be a real number"),  # TypeError from "1" > 0
    (dict(beta="0.1", use_ref_model=False), r"beta must be a real number"),  # unread without a reference model
    (dict(beta=0.1, use_bias_correction_kl="False"), r"use_bias_correction_kl must be a bool"),
])
def test_liger_module_refuses_what_is_not_a_number(ctor, needle):
    with pytest.raises(ValueError, match=needle):
        FusedLinearGRPOLoss(**ctor)


def test_liger_module_takes_one_element_tensors_as_numbers():
    """Liger's math takes a tensor ``beta`` or ``epsilon`` (an adaptive KL controller's): their value is the
    config's, as before the checks of what is a number."""
    module = FusedLinearGRPOLoss(beta=torch.tensor(0.04), epsilon_low=torch.tensor(0.25), loss_type="sapo",
                                 sapo_temperature_pos=torch.tensor(2.0))
    assert (module.config.beta, module.config.sapo_temperature_pos) == (pytest.approx(0.04), 2.0)
    assert grpo_policy_loss_config("grpo", epsilon_low=torch.tensor(0.25)).clip_low == 0.25


def test_grpo_config_names_its_arguments():
    """:func:`grpo_policy_loss_config` names its own arguments (TRL's names for the vLLM correction and the
    off-policy mask); a ValueError of its own passes unchanged."""
    with pytest.raises(ValueError, match=r"^epsilon_low=-0.2: PolicyLossConfig.clip_low"):
        grpo_policy_loss_config("grpo", epsilon_low=-0.2)  # epsilon_high None: epsilon_low's, checked after it
    with pytest.raises(ValueError, match=r"^loss_type='cispo' caps the ratio"):
        grpo_policy_loss_config("cispo", epsilon_high=0.5)
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_clip_min=-1.0: PolicyLossConfig.rollout_is_min"):
        grpo_policy_loss_config("grpo", vllm_importance_sampling_mode="token_truncate",
                                vllm_importance_sampling_clip_min=-1.0)
    with pytest.raises(ValueError, match=r"^off_policy_mask_threshold=-1.0: PolicyLossConfig.off_policy_mask"):
        grpo_policy_loss_config("grpo", off_policy_mask_threshold=-1.0)


def test_frozen_weight_without_bias():
    """A frozen lm_head (LoRA) without bias: no weight / bias gradient is requested."""
    h, w, _, targets, mask, adv, old, _ = _linear_case(bias=False)
    leaves = h.clone().requires_grad_(True)
    expected_h = h.clone().requires_grad_(True)
    expected = fused_rl.reference.linear_policy_loss(expected_h, w, targets, adv, mask, old_logprobs=old)
    expected.loss.backward()
    got = FusedLinearPolicyLoss()(leaves, w, targets, adv, mask, old_logprobs=old)
    got.loss.backward()
    assert_close(leaves.grad, expected_h.grad, torch.float32, "dhidden", grad=True)


def test_python_number_num_items_equals_the_tensor_and_compiles_one_graph():
    """TRL and Liger pass ``num_items_in_batch`` as a tensor or a Python number: the same loss either way, and a
    Python number is not made a constant of the compiled graph (a recompile per value, eager after 8)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=4, length=5, seed=0)
    module = FusedLinearGRPOLoss(loss_type="dapo", beta=0.0)
    as_tensor = module(h, w, targets, mask, adv, bias=b, num_items_in_batch=torch.tensor(37.0))[0]
    assert_close(module(h, w, targets, mask, adv, bias=b, num_items_in_batch=37)[0], as_tensor, torch.float32, "loss")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    for n in (37, 41, 43, 47, 53):
        expected = module(h, w, targets, mask, adv, bias=b, num_items_in_batch=n)[0]
        assert_close(compiled(h, w, targets, mask, adv, bias=b, num_items_in_batch=n)[0], expected, torch.float32,
                     "loss")
    assert counter.frame_count <= 2  # the first value, then one graph for every other


@needs_liger
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32, torch.float32),
                                    (torch.float32, torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16, torch.float32)],
                         ids=["bf16-input-fp32-head", "fp32-input-bf16-head", "fp32-bias"])
def test_mixed_dtype_operands_work_as_in_liger(dtypes):
    """Liger takes ``_input``, ``lin_weight`` and ``bias`` of different dtypes (a bf16 hidden state under autocast
    and an fp32 ``lm_head``): fused_rl computes in the widest of them, i.e. Liger's result on the upcast operands,
    and hands back each gradient in its operand's dtype, as Liger does."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=4)
    h, w, b = (x.to(dt) for x, dt in zip((h, w, b), dtypes))
    wide = torch.promote_types(torch.promote_types(h.dtype, w.dtype), b.dtype)
    ctor = dict(loss_type="dapo", beta=0.04, temperature=0.8)
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old)
    liger_mixed = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **ctor), h, w, b, targets,
                                 mask, adv, forward)
    expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **ctor), h.to(wide), w.to(wide),
                              b.to(wide), targets, mask, adv, forward)
    got = _run_grpo_loss(FusedLinearGRPOLoss(**ctor), h, w, b, targets, mask, adv, forward)
    assert_close(got[0], expected[0], torch.float32, "loss")
    for a, e in zip(got[1], expected[1]):
        assert_close(a, e, torch.float32, "metric")
    assert [g.dtype for g in got[2]] == [g.dtype for g in liger_mixed[2]] == list(dtypes)
    for name, a, e in zip(("hidden", "weight", "bias"), got[2], expected[2]):
        assert_close(a.float(), e.to(a.dtype).float(), a.dtype, f"d{name}", grad=True)


@needs_liger
def test_mixed_dtype_reference_operands():
    """``ref_input`` / ``ref_weight`` / ``ref_bias`` of different dtypes, as Liger accepts them."""
    h, w, b, targets, mask, adv, old, _ = _linear_case(batch=2, length=5, vocab=50, seed=6)
    ref_h = (h + 0.1 * torch.randn_like(h)).bfloat16()
    forward = dict(old_per_token_logps=old, ref_input=ref_h, ref_weight=w, ref_bias=b)
    got = _run_grpo_loss(FusedLinearGRPOLoss(beta=0.1, loss_type="bnpo"), h, w, b, targets, mask, adv, forward)
    expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, beta=0.1, loss_type="bnpo"), h, w,
                              b, targets, mask, adv, dict(forward, ref_input=ref_h.float()))
    assert_close(got[0], expected[0], torch.float32, "loss")
    for a, e in zip(got[1], expected[1]):
        assert_close(a, e, torch.float32, "metric")


@needs_liger
def test_integer_advantages_as_in_liger():
    h, w, b, targets, mask, _, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=7)
    adv = torch.tensor([1, -1])
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old)
    expected = _run_grpo_loss(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, loss_type="grpo"), h, w, b,
                              targets, mask, adv, forward)
    got = _run_grpo_loss(FusedLinearGRPOLoss(loss_type="grpo"), h, w, b, targets, mask, adv, forward)
    assert_close(got[0], expected[0], torch.float32, "loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got[2], expected[2]):
        assert_close(a, e, torch.float32, f"d{name}", grad=True)


@needs_liger
def test_liger_attributes():
    """Every constructor argument is an attribute of the module under its Liger name, as in Liger."""
    import inspect

    ctor = dict(beta=0.1, compiled=False, use_ref_model=False, chunk_size=2, epsilon_low=0.1, epsilon_high=0.3,
                loss_type="sapo", max_completion_length=7, importance_sampling_level="token",
                sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, temperature=0.8, delta=None,
                use_bias_correction_kl=True, vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                vespo_lambda_neg=1.0)
    names = [n for n in inspect.signature(liger_grpo.LigerFusedLinearGRPOLoss.__init__).parameters if n != "self"]
    assert sorted(names) == sorted(ctor)
    liger, ours = liger_grpo.LigerFusedLinearGRPOLoss(**ctor), FusedLinearGRPOLoss(**ctor)
    for name in names:
        assert getattr(ours, name) == getattr(liger, name), name


@needs_liger
@pytest.mark.parametrize("ctor", [dict(sapo_temperature_pos=0.0), dict(sapo_temperature_neg=-1.0)], ids=_ids)
def test_constructor_rejects_what_liger_rejects(ctor):
    with pytest.raises(ValueError, match="sapo_temperature"):
        liger_grpo.LigerFusedLinearGRPOLoss(loss_type="dapo", **ctor)
    with pytest.raises(ValueError, match="sapo_temperature"):
        FusedLinearGRPOLoss(loss_type="dapo", **ctor)


BAD_LIGER_INPUTS = [
    ("old_per_token_logps", torch.zeros(2, 4), r"old_per_token_logps must have shape \(2, 5\)"),
    ("ref_per_token_logps", torch.zeros(2, 4), r"ref_per_token_logps must have shape \(2, 5\)"),
    ("old_per_token_logps", torch.full((2, 5), 3.0), "old_per_token_logps must be log-probabilities"),
    ("vllm_is_ratio", torch.ones(3, 5), r"vllm_is_ratio must have shape \(2, 5\)"),
    ("vllm_is_ratio", -torch.ones(2, 5), "vllm_is_ratio must be finite and >= 0 where attention_mask is set"),
    ("selected_token_ids", torch.full((2, 5), 50), r"selected_token_ids must be in \[0, 50\)"),
    ("attention_mask", torch.ones(2, 4), r"attention_mask must have shape \(2, 5\)"),
    ("advantages", torch.tensor([1.0, float("nan")]), "advantages contain NaN or inf where attention_mask is set"),
    ("lin_weight", torch.zeros(50, 8), r"lin_weight must have shape \(V, H=16\)"),
    ("_input", torch.zeros(10, 16), r"_input must have non-empty shape \(B, T, H\)"),
    ("ref_input", torch.zeros(2, 5, 8), r"ref_weight must have shape \(V, H=8\)"),
    ("ref_bias", torch.zeros(49), r"ref_bias must have shape \(50,\)"),
]


@pytest.mark.parametrize("arg, bad, needle", [pytest.param(*case, id=f"{case[0]}-{i}")
                                              for i, case in enumerate(BAD_LIGER_INPUTS)])
def test_bad_inputs_name_liger_arguments(arg, bad, needle):
    """A bad argument raises a ``ValueError`` naming it as Liger's ``forward`` does, not as fused_rl's
    ``linear_policy_loss`` calls it (``old_logprobs``, ``rollout_is_weights``, ``targets``, ``mask``, ...)."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=8)
    args = dict(_input=h, lin_weight=w, selected_token_ids=targets, attention_mask=mask, advantages=adv, bias=b,
                ref_per_token_logps=ref, old_per_token_logps=old)
    if arg in ("ref_input", "ref_bias"):  # the reference pass
        args.update(ref_per_token_logps=None, ref_input=h, ref_weight=w, ref_bias=b)
    args[arg] = bad
    with pytest.raises(ValueError, match=needle):
        FusedLinearGRPOLoss(beta=0.04)(**args)


@needs_liger
@pytest.mark.parametrize("changes", [dict(beta=0.0), dict(loss_type="bnpo", epsilon_high=0.28), dict(temperature=0.7),
                                     dict(use_ref_model=False), dict(loss_type="cispo", epsilon_high=5.0)], ids=_ids)
def test_settings_assigned_after_construction_apply_as_in_liger(changes):
    """Liger reads its settings at every ``forward``: ``loss_fn.beta = 0.0`` after construction takes effect. The
    config was built once in ``__init__``, so such an assignment was silently ignored; now it is rebuilt when next
    read. Settings that depend on each other in any order: ``loss_type = "cispo"`` alone is invalid (cispo caps
    the weight at ``epsilon_high``, 0.2 here), valid once ``epsilon_high = 5.0`` follows (it raised at the first
    assignment when each one was validated at once)."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=8)
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old)
    modules = [liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, loss_type="grpo", beta=0.1),
               FusedLinearGRPOLoss(loss_type="grpo", beta=0.1)]
    for module in modules:
        for name, value in changes.items():
            setattr(module, name, value)
    expected, got = (_run_grpo_loss(m, h, w, b, targets, mask, adv, forward) for m in modules)
    assert_close(got[0], expected[0], torch.float32, "loss")
    assert len(got[1]) == len(expected[1])
    for name, a, e in zip(("hidden", "weight", "bias"), got[2], expected[2]):
        assert_close(a, e, torch.float32, f"d{name}", grad=True)


def test_an_invalid_setting_assigned_after_construction_raises_when_read():
    """An invalid setting raises at the next ``forward`` (or read of ``config``), naming it; once mended, the
    config is the one of the valid settings."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=8)
    loss_fn = FusedLinearGRPOLoss(loss_type="grpo", beta=0.1)
    config = loss_fn.config
    loss_fn.loss_type = "grpoo"
    with pytest.raises(ValueError, match="loss_type"):
        loss_fn(h, w, targets, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref)
    loss_fn.loss_type = "grpo"
    loss_fn.sapo_temperature_pos = 0.0
    with pytest.raises(ValueError, match="sapo_temperature_pos"):
        loss_fn.config
    loss_fn.sapo_temperature_pos = 1.0
    assert loss_fn.config == config and loss_fn.config is loss_fn.config


@pytest.mark.parametrize("ctor", [dict(loss_type="grpo"), dict(loss_type="dapo"),
                                  dict(loss_type="cispo", epsilon_high=1.5),
                                  dict(loss_type="grpo", importance_sampling_level="sequence")], ids=_ids)
def test_clip_ratio_leaves_out_ignored_targets(ctor):
    """A ``-100`` target inside the attention mask is no token for the loss, nor for ``clip_ratio``: with every ratio
    ``e`` and ``A = (+1, -1)``, the three scored tokens of the ``A > 0`` row are clipped, 3 of the 7 scored (cispo
    and the sequence level counted the ignored token as a clipped one: 4 / 8)."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 4, 8, generator=g), torch.randn(30, 8, generator=g)
    targets = torch.randint(0, 30, (2, 4), generator=g)
    with torch.no_grad():
        old = torch.log_softmax(h @ w.T, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) - 1.0
    targets[0, 0] = fused_rl.IGNORE_INDEX
    _, metrics = FusedLinearGRPOLoss(beta=0.0, **ctor)(h, w, targets, torch.ones(2, 4), torch.tensor([1.0, -1.0]),
                                                       old_per_token_logps=old)
    assert metrics[-1].item() == pytest.approx(3 / 7, abs=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("batch, length", [(0, 5), (2, 0)])
def test_a_micro_batch_without_tokens_is_a_zero_loss(batch, length, beta):
    """As Liger: no tokens (a rank that dynamic sampling left empty) give loss 0, metrics 0 and zero gradients of the
    right shapes (so that ``backward`` and DDP's all-reduce run), even with an inf in the weight; a mismatched
    mask still raises."""
    h = torch.randn(batch, length, 8, requires_grad=True)
    w = torch.randn(20, 8).index_fill_(0, torch.tensor([3]), float("inf")).requires_grad_(True)
    b = torch.randn(20, requires_grad=True)
    targets, mask = torch.zeros(batch, length, dtype=torch.long), torch.ones(batch, length)
    loss, metrics = FusedLinearGRPOLoss(beta=beta)(h, w, targets, mask, torch.randn(batch), bias=b,
                                                   ref_per_token_logps=torch.zeros(batch, length))
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == 0.0 and [m.item() for m in metrics] == [0.0] * (
        2 if beta else 1)
    assert all(torch.equal(x.grad, torch.zeros_like(x)) for x in (h, w, b))
    if liger_grpo is not None:
        liger_loss, liger_metrics = liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, beta=beta)(
            h.detach(), w.detach().nan_to_num(posinf=0.0), targets, mask, torch.randn(batch), bias=b.detach(),
            ref_per_token_logps=torch.zeros(batch, length))
        assert liger_loss.item() == 0.0 and len(liger_metrics) == len(metrics)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        FusedLinearGRPOLoss(beta=beta)(h, w, targets, torch.ones(batch + 1, length), torch.randn(batch))


def _empty_rank_step(rank: int, init_file: str, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        h, w = torch.randn(3, 5, 8, generator=g), torch.randn(20, 8, generator=g).requires_grad_(True)
        targets, mask, adv = torch.randint(0, 20, (3, 5), generator=g), torch.ones(3, 5), torch.randn(3, generator=g)
        mask[1, 2:] = 0
        rows = slice(0, 3 if rank == 0 else 0)
        loss, _ = FusedLinearGRPOLoss(beta=0.0, loss_type="dapo")(h[rows].requires_grad_(True), w, targets[rows],
                                                                   mask[rows], adv[rows])
        loss.backward()
        dist.all_reduce(w.grad)  # DDP's: the next collective after the loss's token count
        torch.save({"loss": loss.detach(), "grad": w.grad}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_rank_without_tokens_joins_the_token_count(tmp_path):
    """dapo without ``num_items_in_batch`` all-reduces the token count on every rank: a rank whose micro-batch is
    empty takes part too (it returned early before, and its unmatched collective broke DDP's gradient all-reduce:
    gloo's "collective mismatch"); the other rank's loss is the one-process loss over its 12 tokens / 2 ranks."""
    import torch.multiprocessing as mp

    mp.spawn(_empty_rank_step, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 5, 8, generator=g), torch.randn(20, 8, generator=g).requires_grad_(True)
    targets, mask, adv = torch.randint(0, 20, (3, 5), generator=g), torch.ones(3, 5), torch.randn(3, generator=g)
    mask[1, 2:] = 0
    expected, _ = FusedLinearGRPOLoss(beta=0.0, loss_type="dapo")(h, w, targets, mask, adv, num_items_in_batch=12 / 2)
    expected.backward()
    assert got[1]["loss"].item() == 0.0
    torch.testing.assert_close(got[0]["loss"], expected.detach(), rtol=1e-6, atol=0)
    for rank in range(2):
        torch.testing.assert_close(got[rank]["grad"], w.grad, rtol=1e-6, atol=1e-7)


def test_dr_grpo_takes_its_max_completion_length_after_construction():
    """Liger asks for dr_grpo's ``max_completion_length`` at ``forward`` only: constructing without it works, a
    ``forward`` without it raises, and assigning it afterwards gives the loss of a module constructed with it."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=8)
    loss_fn = FusedLinearGRPOLoss(loss_type="dr_grpo", beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_fn(h, w, targets, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref)
    loss_fn.max_completion_length = 9
    got = loss_fn(h, w, targets, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref)[0]
    assert loss_fn.config.max_len == 9
    if liger_grpo is not None:
        expected = liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, loss_type="dr_grpo", beta=0.1,
                                                      max_completion_length=9)(
            h, w, targets, mask, adv, bias=b, old_per_token_logps=old, ref_per_token_logps=ref)[0]
        assert_close(got, expected, torch.float32, "loss")


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "grpo"])
def test_an_ignored_target_is_a_masked_token(loss_type):
    """A ``-100`` target inside the attention mask gives the loss, metrics and gradients of the same token masked
    out, the default normalizer of dapo / cispo / vespo (the token count) included: it counted the ignored token."""
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=3, length=5, vocab=50, seed=3)
    mask = torch.ones_like(mask)
    ignored, masked = targets.clone(), mask.clone()
    ignored[2, 1], masked[2, 1] = fused_rl.IGNORE_INDEX, 0
    ctor = dict(loss_type=loss_type, beta=0.04, epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    forward = dict(ref_per_token_logps=ref, old_per_token_logps=old)
    got = _run_grpo_loss(FusedLinearGRPOLoss(**ctor), h, w, b, ignored, mask, adv, forward)
    expected = _run_grpo_loss(FusedLinearGRPOLoss(**ctor), h, w, b, targets, masked, adv, forward)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(a, e) for a, e in zip(got[1], expected[1]))
    assert all(torch.equal(a, e) for a, e in zip(got[2], expected[2]))


def test_liger_module_checks_its_inputs_in_one_host_sync(monkeypatch):
    """An integer ``attention_mask`` (as TRL passes it): its 0 / 1 check joins ``linear_policy_loss``'s one batched
    read of the value checks (it was a read of its own: two host syncs a step on CUDA)."""
    import fused_rl.ops
    import fused_rl.validation

    reads, run = [], fused_rl.validation.run_value_checks
    counting = lambda checks: (reads.append(len(checks)), run(checks))[1]  # noqa: E731
    monkeypatch.setattr(fused_rl.validation, "run_value_checks", counting)
    monkeypatch.setattr(fused_rl.ops, "run_value_checks", counting)
    h, w, b, targets, mask, adv, old, ref = _linear_case(batch=2, length=5, vocab=50, seed=8)
    FusedLinearGRPOLoss(beta=0.04)(h, w, targets, mask.long(), adv, bias=b, old_per_token_logps=old,
                                   ref_per_token_logps=ref)
    assert len(reads) == 1 and reads[0] > 1
    # the reference model's pass leaves the ids' check to the policy pass (it read them on its own: two syncs)
    reads.clear()
    FusedLinearGRPOLoss(beta=0.04)(h, w, targets, mask.long(), adv, bias=b, old_per_token_logps=old,
                                   ref_input=h * 0.5, ref_weight=w, ref_bias=b)
    assert len(reads) == 1 and reads[0] > 1


@pytest.mark.parametrize("bad_id", [50, -1, 10**6])
def test_out_of_range_ids_raise_with_a_reference_model(bad_id):
    """With ``ref_input`` / ``ref_weight`` the reference pass reads bad ids as 0 (no out-of-bounds read) and the
    policy pass's check raises naming them; a reference head of another vocabulary size raises too."""
    h, w, b, targets, mask, adv, old, _ = _linear_case(batch=2, length=5, vocab=50, seed=8)
    targets, mask = targets.clone(), mask.clone()
    targets[1, 2], mask[1, 2] = bad_id, True  # ids where the mask is off are not read
    loss = FusedLinearGRPOLoss(beta=0.04)
    with pytest.raises(ValueError, match=r"selected_token_ids must be in \[0, 50\)"):
        loss(h, w, targets, mask, adv, bias=b, old_per_token_logps=old, ref_input=h, ref_weight=w, ref_bias=b)
    # where the mask is off an id is not read: padding ids out of range are valid, check_inputs or not
    targets[1, 2], mask[1, 2] = bad_id, False
    expected = loss(h, w, targets.clamp(0, 49), mask, adv, bias=b, old_per_token_logps=old, ref_input=h, ref_weight=w,
                    ref_bias=b)[0]
    for check in (True, False):
        got = FusedLinearGRPOLoss(beta=0.04, check_inputs=check)(h, w, targets, mask, adv, bias=b,
                                                                 old_per_token_logps=old, ref_input=h,
                                                                 ref_weight=w, ref_bias=b)[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"ref_weight must have as many rows as lin_weight \(the vocabulary, 50\)"):
        loss(h, w, targets.clamp(0, 39), mask, adv, bias=b, old_per_token_logps=old, ref_input=h,
             ref_weight=w[:40], ref_bias=b[:40])
    # a ref_input of another batch is named (the ids were blamed: "selected_token_ids must have shape (1, 5)")
    with pytest.raises(ValueError, match=r"ref_input must have the \(B, T\) of _input, \(2, 5\), got shape "
                                         r"\(1, 5, "):
        loss(h, w, targets.clamp(0, 49), mask, adv, bias=b, old_per_token_logps=old, ref_input=h[:1], ref_weight=w,
             ref_bias=b)
    # ids of another (B, T) than _input and ref_input are the ids' error, not ref_input's
    with pytest.raises(ValueError, match=r"selected_token_ids must have shape \(2, 5\)"):
        loss(h, w, targets[:, :4].clamp(0, 49), mask, adv, bias=b, old_per_token_logps=old, ref_input=h,
             ref_weight=w, ref_bias=b)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_liger_ref_pass_tolerates_an_id_equal_to_the_vocabulary_in_padding(backend):
    """A padding id equal to ``V`` (one past the last) where the mask is 0, with ``ref_input``: the reference pass
    reads it as a valid id, as any padding id (the loss and KL of an in-range padding id); an off-by-one in that
    clean-up (``<= V``) indexed out of bounds and survived the suite (a mutation audit)."""
    torch.manual_seed(0)
    batch, length, hidden, vocab = 2, 3, 4, 5
    h = torch.randn(batch, length, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    ids = torch.tensor([[1, 2, vocab], [3, 0, 4]])  # the id V only where the mask is 0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -0.5])
    loss_fn = FusedLinearGRPOLoss(beta=0.1, backend=backend)
    ref = dict(ref_input=h.detach(), ref_weight=w.detach() * 0.9)
    loss, (kl, _) = loss_fn(h, w, ids, mask, adv, **ref)
    loss0, (kl0, _) = loss_fn(h, w, torch.where(mask.bool(), ids, 0), mask, adv, **ref)
    torch.testing.assert_close(loss, loss0)
    torch.testing.assert_close(kl, kl0)


def test_liger_module_takes_a_tensor_beta_with_the_bias_correction():
    """``use_bias_correction_kl and beta != 0`` was a tensor for a tensor ``beta``, refused as not a bool."""
    import numpy as np

    module = FusedLinearGRPOLoss(beta=torch.tensor(0.04), use_bias_correction_kl=True)
    assert module.config.kl_bias_correction
    assert type(module.beta) is float  # read at the assignment: forward branches on it (a compiled step could not)
    assert grpo_policy_loss_config("grpo", beta=torch.tensor(1)).beta == 1.0  # an integer tensor, as float() took
    assert grpo_policy_loss_config("grpo", epsilon_low=np.array(0.25)).clip_low == 0.25
    with pytest.raises(ValueError, match="must be a real number"):
        grpo_policy_loss_config("grpo", beta=torch.tensor(True))


def _small_linear_case(seed=0, B=2, T=4, H=8, V=30):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    return h, w, targets


def test_fused_linear_policy_loss_module_passes_the_token_normalizer():
    """``FusedLinearPolicyLoss.forward(token_normalizer=...)`` reaches ``linear_policy_loss`` (token-mean divides by
    it, not by the token count)."""
    from fused_rl.nn import FusedLinearPolicyLoss
    h, w, targets = _small_linear_case()
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    adv = torch.tensor([1.0, -0.5])
    cfg = fused_rl.PolicyLossConfig(agg="token-mean")
    got = FusedLinearPolicyLoss(cfg, backend="torch")(h, w, targets, adv, mask, token_normalizer=20.0).loss
    want = fused_rl.linear_policy_loss(h, w, targets, adv, mask, config=cfg, token_normalizer=20.0,
                                       backend="torch").loss
    plain = fused_rl.linear_policy_loss(h, w, targets, adv, mask, config=cfg, backend="torch").loss
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got * 20.0, plain * 7.0)


def test_liger_num_items_in_batch_is_clamped_at_one():
    """dapo's normalizer is ``max(num_items_in_batch / world_size, 1)`` (Liger): 0.25 divides as 1."""
    from fused_rl.nn import FusedLinearGRPOLoss
    h, w, targets = _small_linear_case(1)
    adv = torch.tensor([1.0, 0.5])
    loss_fn = FusedLinearGRPOLoss(beta=0.0, loss_type="dapo")
    small, _ = loss_fn(h, w, targets, torch.ones(2, 4), adv, num_items_in_batch=0.25)
    one, _ = loss_fn(h, w, targets, torch.ones(2, 4), adv, num_items_in_batch=1)
    assert one.item() != 0.0
    torch.testing.assert_close(small, one)


@pytest.mark.parametrize("ctor", [dict(loss_type="cispo", epsilon_high=1.5),
                                  dict(importance_sampling_level="sequence")])
def test_liger_clip_ratio_leaves_out_zero_advantages(ctor):
    """Liger's clip_ratio counts a ratio above its bound only where ``A > 0``: a row with ``A = 0`` (and every ratio
    ``e``) is no clipped token: 4 of the 8 tokens (the ``A = 1`` row)."""
    from fused_rl.nn import FusedLinearGRPOLoss
    h, w, targets = _small_linear_case(2)
    with torch.no_grad():
        old = torch.log_softmax(h @ w.T, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) - 1.0
    _, metrics = FusedLinearGRPOLoss(beta=0.0, **ctor)(h, w, targets, torch.ones(2, 4), torch.tensor([1.0, 0.0]),
                                                       old_per_token_logps=old)
    assert metrics[-1].item() == pytest.approx(4 / 8, abs=1e-7)
