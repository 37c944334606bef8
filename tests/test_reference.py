"""The reference implementation: float64 gradcheck end to end and numerically hard inputs."""

import math

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from helpers import CONFIGS, make_case


# cispo's sg(min(r, 1+eps)) weight has no finite-difference twin; test_loss_math checks it instead.
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.policy_loss != "cispo"],
                         ids=lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}")
def test_gradcheck_float64_policy_loss(config):
    case = make_case(batch=3, length=4, vocab=6, dtype=torch.float64, seed=2)
    old = case.old.double()
    ref = case.ref.double()

    def f(logits):
        return fused_rl.reference.policy_loss(logits, case.targets, case.advantages.double(), case.mask,
                                              old_logprobs=old, ref_logprobs=ref, config=config).loss

    assert torch.autograd.gradcheck(f, (case.logits.clone().requires_grad_(True),))


def test_gradcheck_float64_linear():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 5, (2, 3), generator=g)
    cfg = PolicyLossConfig(kl="k2", beta=0.3, entropy_coef=0.1, temperature=0.9)
    ref = torch.randn(2, 3, dtype=torch.float64, generator=g) - 2
    old = torch.randn(2, 3, dtype=torch.float64, generator=g) - 2  # explicit: on-policy sg(logp) has no FD twin

    def f(h, w, b):
        return fused_rl.reference.linear_policy_loss(h, w, t, torch.tensor([1.0, -0.5], dtype=torch.float64),
                                                     torch.ones(2, 3), bias=b, old_logprobs=old, ref_logprobs=ref,
                                                     config=cfg).loss

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_minus_inf_logits_give_finite_entropy_and_gradient():
    logits = torch.tensor([[[0.0, -float("inf"), 1.0, -float("inf")]]], requires_grad=True)
    cfg = PolicyLossConfig(entropy_coef=0.5)
    out = fused_rl.reference.policy_loss(logits, torch.tensor([[2]]), torch.tensor([1.0]), torch.ones(1, 1),
                                         config=cfg)
    out.loss.backward()
    p = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    assert out.entropy.item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 1] == 0


def test_extreme_logits_in_fp32():
    logits = torch.tensor([[[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]]])
    lp, ent = fused_rl.reference.token_logprobs(logits, torch.tensor([[0, 1]]), return_entropy=True)
    assert lp[0, 0].item() == 0.0 and lp[0, 1].item() == pytest.approx(-math.log(3))
    assert ent[0, 0].item() == 0.0 and ent[0, 1].item() == pytest.approx(math.log(3), rel=1e-6)


def test_temperature_divides_logits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 9, generator=g)
    t = torch.randint(0, 9, (2, 4), generator=g)
    a = fused_rl.reference.token_logprobs(x, t, temperature=0.5)
    b = fused_rl.reference.token_logprobs(x * 2, t)
    torch.testing.assert_close(a, b)


def test_bf16_logits_are_upcast_before_softmax():
    x = (torch.randn(1, 2, 50000) * 3).to(torch.bfloat16)
    t = torch.tensor([[3, 7]])
    lp = fused_rl.reference.token_logprobs(x, t)
    assert lp.dtype == torch.float32
    exact = torch.log_softmax(x.double(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp.double(), exact, rtol=1e-6, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's own
@pytest.mark.parametrize("cfg", [PolicyLossConfig(policy_loss="sapo", kl="k3", beta=0.1),
                                 PolicyLossConfig(policy_loss="gspo", kl="k3", beta=0.1, kl_bias_correction=True),
                                 PolicyLossConfig(kl="k3", beta=0.1, kl_bias_correction=True)],
                         ids=["sapo", "gspo-bias-corrected", "ppo-bias-corrected"])
def test_reference_works_with_torch_func_vmap_and_jvp(cfg):
    """The reference is plain torch (and one autograd Function with a generated vmap rule and a ``jvp``: the
    bias-corrected KL): per-sample gradients by ``vmap(grad(...))`` equal a loop of ``grad``, and a forward-mode
    ``jvp`` equals a central difference (the overflow-safe ratio is plain ops too)."""
    from torch.func import grad, jvp, vmap

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 3, 20, generator=g, dtype=torch.float64)
    t = torch.randint(0, 20, (4, 1, 3), generator=g)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64)
    m = torch.ones(4, 1, 3, dtype=torch.bool)
    old = torch.full((4, 1, 3), -3.0, dtype=torch.float64)

    def f(xi, ti, ai, mi, oi):
        return fused_rl.reference.policy_loss(xi, ti, ai, mi, old_logprobs=oi, ref_logprobs=oi, config=cfg,
                                              check_inputs=False).loss

    per_sample = vmap(grad(f))(x, t, adv, m, old)
    looped = torch.stack([grad(f)(x[i], t[i], adv[i], m[i], old[i]) for i in range(4)])
    torch.testing.assert_close(per_sample, looped)
    v = torch.randn(x[0].shape, generator=g, dtype=torch.float64)
    one = lambda xi: f(xi, t[0], adv[0], m[0], old[0])
    _, tangent = jvp(one, (x[0],), (v,))
    eps = 1e-6
    torch.testing.assert_close(tangent, (one(x[0] + eps * v) - one(x[0] - eps * v)) / (2 * eps), atol=1e-8, rtol=1e-6)


def test_reference_vmap_over_targets_and_masks_with_shared_logits():
    """``vmap`` over candidate targets (some ``-100``) or masks with one unbatched logits tensor: the ignored rows'
    fill is out of place (an in-place fill of the shared quotient with a batched mask is refused by vmap), and
    the results equal a loop."""
    from torch.func import vmap

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 11, generator=g)
    targets = torch.randint(0, 11, (4, 2, 3), generator=g)
    targets[0, 0, 0] = targets[2, 1, 2] = fused_rl.IGNORE_INDEX
    logp = lambda t: fused_rl.reference.token_logprobs(x, t, check_inputs=False)
    torch.testing.assert_close(vmap(logp)(targets), torch.stack([logp(t) for t in targets]))
    masks = torch.rand(4, 2, 3, generator=g) > 0.3
    adv = torch.randn(2, generator=g)
    loss = lambda mk: fused_rl.reference.policy_loss(x, targets[1], adv, mk, check_inputs=False).loss
    torch.testing.assert_close(vmap(loss)(masks), torch.stack([loss(mk) for mk in masks]))
