"""The reference implementation: float64 gradcheck end to end and numerically hard inputs."""

import math

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from helpers import CONFIGS, assert_close, fused_backends, make_case, make_logits, supports


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


def _categorical_by_hand(z: torch.Tensor, targets: torch.Tensor):
    """float64 ``(log p[target], H)`` of ``softmax(z)`` from ``torch.distributions`` (not fused_rl)."""
    dist = torch.distributions.Categorical(logits=z.double())
    return dist.log_prob(targets.clamp(min=0)), dist.entropy()


def test_token_logprobs_by_hand_with_an_ignored_nan_row():
    """Log-probs and entropies of ``softmax(x / tau)`` against ``torch.distributions.Categorical``; an
    ``IGNORE_INDEX`` row holding NaN logits gives 0, 0 and a zero (not NaN) gradient, and its entropy is 0, not
    the entropy of whatever the row is replaced by."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 3, 9, generator=g) * 3
    t = torch.randint(0, 9, (2, 3), generator=g)
    t[1, 2] = fused_rl.IGNORE_INDEX
    x[1, 2] = float("nan")
    tau = 0.6
    keep = t != fused_rl.IGNORE_INDEX
    want_lp, want_ent = _categorical_by_hand(torch.where(keep.unsqueeze(-1), x, 0.0) / tau, t)
    xr = x.clone().requires_grad_(True)
    lp, ent = fused_rl.reference.token_logprobs(xr, t, temperature=tau, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp[keep].double(), want_lp[keep], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[keep].double(), want_ent[keep], rtol=1e-5, atol=1e-6)
    assert lp[1, 2].item() == 0.0 and ent[1, 2].item() == 0.0
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(xr.grad).all() and (xr.grad[1, 2] == 0).all()


def test_policy_loss_by_hand_in_float64():
    """Loss, gradient, log-probs, entropy and metrics of the reference against float64 math written out here
    (``Categorical`` of ``logits / tau``): off-policy ppo_clip with every ratio inside the clip range
    (``l = -A r + beta (logp - ref) - c H``), a k1 KL, an entropy bonus with ``compute_entropy=False`` (the config
    still needs the entropy), a token normalizer, and a masked position whose target is out of range."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    t = torch.randint(0, 7, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    t[0, 2] = 10_000  # masked: never read
    adv = torch.tensor([0.5, -1.5], dtype=torch.float64)
    tau, beta, coef, norm = 0.7, 0.2, 0.3, 4.0
    xh = x.clone().requires_grad_(True)
    logp, ent = _categorical_by_hand(xh / tau, torch.where(mask, t, 0))
    shift = torch.tensor([[0.05, -0.03, 0.0], [0.02, -0.01, 0.04]], dtype=torch.float64)
    old = (logp.detach() + shift).clamp(max=0.0)  # ratios exp(logp - old) in [0.95, 1.03]: no clipping
    ref = (logp.detach() - 0.4).clamp(max=0.0)
    ratio = torch.exp(logp - old)
    per_token = -adv[:, None] * ratio + beta * (logp - ref) - coef * ent
    want = torch.where(mask, per_token, 0.0).sum() / norm
    want.backward()
    cfg = PolicyLossConfig(kl="k1", beta=beta, entropy_coef=coef, temperature=tau)
    xr = x.clone().requires_grad_(True)
    out = fused_rl.reference.policy_loss(xr, t, adv, mask, old_logprobs=old, ref_logprobs=ref, config=cfg,
                                         token_normalizer=norm, compute_entropy=False)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xr.grad, xh.grad, rtol=1e-10, atol=1e-12)
    zero = torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(out.logprobs, torch.where(mask, logp.detach(), zero), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.entropy, torch.where(mask, ent.detach(), zero), rtol=1e-10, atol=1e-12)
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad  # detached
    n = mask.sum()
    for name, value in (("ratio_mean", ratio), ("kl_mean", logp - ref), ("entropy_mean", ent)):
        torch.testing.assert_close(out.metrics[name].double(), torch.where(mask, value.detach(), zero).sum() / n,
                                   rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_token_logprobs_by_hand(dtype):
    """The fused-linear reference computes ``z = (h W^T + b) / tau`` in fp32 from the rounded inputs (not in the
    inputs' dtype, not under a CPU autocast of its own): log-probs, entropies and the gradients of ``h``, ``W``,
    ``b`` against ``Categorical`` of the float64 logits; an ``IGNORE_INDEX`` row whose hidden state is NaN gives 0
    and no gradient."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 3, 16, generator=g).to(dtype)
    w = (torch.randn(11, 16, generator=g) / 2).to(dtype)
    b = torch.randn(11, generator=g).to(dtype)
    t = torch.randint(0, 11, (2, 3), generator=g)
    t[0, 1] = fused_rl.IGNORE_INDEX
    h[0, 1] = float("nan")
    tau = 0.8
    keep = t != fused_rl.IGNORE_INDEX
    leaves64 = [x.double().requires_grad_(True) for x in (h, w, b)]
    z = (torch.where(keep.unsqueeze(-1), leaves64[0], 0.0) @ leaves64[1].T + leaves64[2]) / tau
    want_lp, want_ent = _categorical_by_hand(z, t)
    wl, we = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    (torch.where(keep, want_lp * wl + want_ent * we, 0.0)).sum().backward()
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    lp, ent = fused_rl.reference.linear_token_logprobs(leaves[0], leaves[1], t, bias=leaves[2], temperature=tau,
                                                       return_entropy=True)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp[keep].double(), want_lp[keep].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[keep].double(), want_ent[keep].detach(), rtol=1e-5, atol=1e-5)
    assert lp[0, 1].item() == 0.0 and ent[0, 1].item() == 0.0
    (lp * wl.float() + ent * we.float()).sum().backward()
    for got, want, name in zip(leaves, leaves64, ("hidden", "weight", "bias")):
        assert got.grad.dtype == dtype, name
        rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)  # one rounding to bf16
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=rtol, atol=atol, msg=name)
    assert (leaves[0].grad[0, 1] == 0).all()


def test_policy_loss_importance_weights_by_hand():
    """The two ways of weighting the policy term, against float64 math written out here: the sampler's
    log-probs with ``rollout_is="token_truncate"`` (``w = min(exp(old - rollout), 1.5)``) and caller-computed
    ``rollout_is_weights``; ``l = -A r w`` (every ratio inside the clip range), token mean."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64) / 2  # log-probs near -log 6: old + log 2 stays < 0
    t = torch.randint(0, 6, (2, 3), generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    xh = x.clone().requires_grad_(True)
    logp, _ = _categorical_by_hand(xh, t)
    old = (logp.detach() - 0.02).clamp(max=0.0)
    ratio = torch.exp(logp - old)
    rho = torch.tensor([[2.0, 0.5, 1.2], [3.0, 1.0, 0.8]], dtype=torch.float64)
    weights = torch.tensor([[0.0, 1.5, 0.7], [1.0, 2.0, 0.25]], dtype=torch.float64)
    cases = [(dict(rollout_logprobs=old - rho.log(), config=PolicyLossConfig(rollout_is="token_truncate",
                                                                              rollout_is_max=1.5)),
              rho.clamp(max=1.5)),
             (dict(rollout_is_weights=weights), weights)]
    for kwargs, w in cases:
        want = (-adv[:, None] * ratio * w).mean()
        (want_grad,) = torch.autograd.grad(want, xh, retain_graph=True)
        xr = x.clone().requires_grad_(True)
        out = fused_rl.reference.policy_loss(xr, t, adv, mask, old_logprobs=old, compute_entropy=False, **kwargs)
        out.loss.backward()
        torch.testing.assert_close(out.loss, want.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(xr.grad, want_grad, rtol=1e-10, atol=1e-12)


def test_default_config_is_ppo_clip_at_0_2_with_a_token_mean_by_hand():
    """``config=None`` is ``PolicyLossConfig()``: ppo_clip with ``eps = 0.2`` on both sides, token mean, no KL or
    entropy term: ``l = max(-A r, -A clip(r, 0.8, 1.2))`` written out here in float64, ratios far from the bounds
    on both sides of them."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) / 2
    t = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([[1.0, 1.0, -2.0], [-0.5, 0.5, 1.0]], dtype=torch.float64)
    xh = x.clone().requires_grad_(True)
    logp, _ = _categorical_by_hand(xh, t)
    ratio_wanted = torch.tensor([[1.25, 0.7, 0.7], [1.3, 1.1, 1.0]], dtype=torch.float64)
    old = logp.detach() - ratio_wanted.log()
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    want = torch.where(mask, per_token, 0.0).sum() / mask.sum()
    want.backward()
    xr = x.clone().requires_grad_(True)
    out = fused_rl.reference.policy_loss(xr, t, adv, mask, old_logprobs=old)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xr.grad, xh.grad, rtol=1e-10, atol=1e-12)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 5)  # (0, 0) above 1.2 at A > 0, (0, 2) below at A < 0


@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["randn", "peaked"])  # peaked rows' entropies are ~1e-9: below the tolerance
def test_token_entropy_every_backend(backend, dtype, kind):
    """``fused_rl.token_entropy``: ``-sum_j p_j log p_j`` of ``softmax(logits / 0.7)`` (peaked logits, a row with
    ``-inf`` columns, ``V = 1001``) and its logits gradient (random upstream gradient) within the dtype's tolerance
    of float64 of the same rounded logits; fp32 values whatever the logits' dtype."""
    if not supports(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    g = torch.Generator().manual_seed(0)
    z = make_logits((3, 4, 1001), kind=kind, generator=g)
    z[1, 2, 500:] = float("-inf")
    z = z.to(dtype)
    upstream = torch.randn(3, 4, generator=g, dtype=torch.float64)
    x, exact_x = z.clone().requires_grad_(), z.double().requires_grad_()
    entropy = fused_rl.token_entropy(x, temperature=0.7, backend=backend)
    scaled = exact_x / 0.7
    finite = torch.where(torch.isinf(scaled), 0.0, scaled)  # the -inf columns: p = 0, nothing added
    exact = scaled.logsumexp(-1) - (scaled.softmax(-1) * finite).sum(-1)
    assert entropy.dtype == torch.float32 and entropy.shape == (3, 4)
    assert_close(entropy.double(), exact, torch.float32, "entropy", scale=3.0)
    (entropy.double() * upstream).sum().backward()
    (exact * upstream).sum().backward()
    assert_close(x.grad.double(), exact_x.grad, dtype, "gradient", grad=True, scale=3.0)


def test_token_entropy_reads_no_targets(monkeypatch):
    """``fused_rl.token_entropy`` runs :func:`fused_rl.token_logprobs` on in-range placeholder ids without checking
    them (no host sync a call), with its ``temperature`` and ``backend``."""
    from fused_rl import ops

    seen, real = [], ops.token_logprobs
    monkeypatch.setattr(ops, "token_logprobs", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    fused_rl.token_entropy(torch.randn(2, 5), temperature=0.5, backend="torch")
    assert seen == [dict(temperature=0.5, return_entropy=True, backend="torch", check_inputs=False)]
