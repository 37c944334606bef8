"""Bad input is rejected with a ValueError naming the argument, on every backend, before any work."""

import functools
import math

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig, validation
from helpers import fused_backends, run_python

BACKENDS = ["reference", "torch"]


def good(B=2, T=3, V=11):
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B, T, V, generator=g), targets=torch.randint(0, V, (B, T), generator=g),
                advantages=torch.randn(B, generator=g), mask=torch.ones(B, T, dtype=torch.bool))


def call(backend, **changes):
    args = good()
    kw = {k: changes.pop(k) for k in list(changes) if k in ("old_logprobs", "ref_logprobs", "config",
                                                            "token_normalizer")}
    args.update(changes)
    return fused_rl.policy_loss(args["logits"], args["targets"], args["advantages"], args["mask"],
                                backend=backend, **kw)


CASES = [
    (dict(logits=torch.randn(2, 3, 11).long()), "logits must be float"),
    (dict(logits=torch.randn(6, 11)), r"logits must have shape \(B, T, V\)"),
    (dict(logits=torch.randn(0, 3, 11)), "logits is empty"),
    (dict(logits=torch.randn(2, 3, 11, 2)[..., 0]), "stride"),
    (dict(logits=torch.randn(2, 3, 2, 2)[..., 0]), r"stride\(-1\) == 1"),  # a vocabulary of 2 is checked too
    (dict(targets=torch.zeros(2, 3)), "targets must be an int32 or int64"),
    (dict(targets=torch.zeros(2, 4, dtype=torch.long)), "targets must have shape"),
    (dict(targets=torch.full((2, 3), 11)), r"targets must be in \[0, 11\)"),
    (dict(targets=torch.full((2, 3), -1)), r"targets must be in \[0, 11\)"),
    (dict(advantages=torch.ones(3)), "advantages must have shape"),
    (dict(advantages=torch.ones(2, dtype=torch.long)), "advantages must be a floating"),
    (dict(advantages=torch.tensor([1.0, float("nan")])), "advantages contain NaN"),
    (dict(mask=torch.ones(2, 4)), "mask must have shape"),
    (dict(mask=torch.full((2, 3), 2.0)), "mask must contain only 0 and 1"),
    (dict(mask=None), "mask is required"),
    (dict(old_logprobs=torch.full((2, 3), float("nan"))), "old_logprobs contain NaN"),
    # a negative log-likelihood (-log p, e.g. a per-token cross-entropy) passed for the log-probs
    (dict(old_logprobs=torch.full((2, 3), 0.7)), r"old_logprobs must be log-probabilities \(<= 0\)"),
    (dict(ref_logprobs=torch.full((2, 3), 2.3), config=PolicyLossConfig(kl="k3", beta=0.1)),
     r"ref_logprobs must be log-probabilities \(<= 0\).*negative log-likelihood"),
    (dict(ref_logprobs=torch.ones(2, 2), config=PolicyLossConfig(kl="k3", beta=0.1)), "ref_logprobs must have shape"),
    (dict(config=PolicyLossConfig(kl="k3", beta=0.1)), "needs ref_logprobs"),
    (dict(token_normalizer=0), "token_normalizer must be a positive"),
    (dict(token_normalizer=torch.tensor(-1.0)), "token_normalizer must be positive"),
    (dict(token_normalizer=torch.tensor(True)), "token_normalizer must be a number"),
    (dict(token_normalizer=5, config=PolicyLossConfig(agg="seq-mean-token-mean")), "only applies to agg='token-mean'"),
    (dict(config="grpo"), "config must be a PolicyLossConfig"),
    (dict(targets=torch.zeros(2, 3, dtype=torch.long, device="meta")), "targets is on meta"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("changes, match", CASES, ids=[m for _, m in CASES])
def test_policy_loss_rejects(backend, changes, match):
    with pytest.raises(ValueError, match=match):
        call(backend, **changes)


def test_unknown_backend_and_explicit_unavailable_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        call("fast")
    for name, reason in fused_rl.available_backends(torch.device("cpu")).items():
        if reason is not None:
            with pytest.raises(RuntimeError, match=name):
                call(name)


def test_out_of_range_targets_allowed_where_masked_and_ignore_index():
    args = good()
    args["targets"][0, 2] = 10_000
    args["mask"][0, 2] = False
    args["targets"][1, 0] = fused_rl.IGNORE_INDEX  # ignored target: treated as masked
    for backend in BACKENDS:
        logits = args["logits"].clone().requires_grad_(True)
        out = fused_rl.policy_loss(logits, args["targets"], args["advantages"], args["mask"], backend=backend)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert logits.grad[0, 2].abs().max() == 0 and logits.grad[1, 0].abs().max() == 0
        assert out.logprobs[0, 2] == 0 and out.logprobs[1, 0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_zero_mask_gives_zero_loss_and_grad(backend):
    args = good()
    logits = args["logits"].requires_grad_(True)
    cfg = PolicyLossConfig(kl="k3", beta=0.1, entropy_coef=0.01)
    out = fused_rl.policy_loss(logits, args["targets"], args["advantages"], torch.zeros(2, 3),
                               ref_logprobs=torch.zeros(2, 3), config=cfg, backend=backend)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_rejects(backend):
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="targets must have shape"):
        fused_rl.token_logprobs(x, torch.zeros(2, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 5\)"):
        fused_rl.token_logprobs(x, torch.full((2, 3), 5), backend=backend)
    with pytest.raises(ValueError, match="temperature"):
        fused_rl.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long), temperature=0.0, backend=backend)
    with pytest.raises(ValueError, match="logits must be float"):
        fused_rl.token_logprobs(x.to(torch.complex64), torch.zeros(2, 3, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match="logits must have shape"):  # token_entropy: the same checks
        fused_rl.token_entropy(x[0, 0], backend=backend)
    with pytest.raises(ValueError, match="logits is empty"):
        fused_rl.token_entropy(x[:, :, :0], backend=backend)
    with pytest.raises(ValueError, match="temperature"):
        fused_rl.token_entropy(x, temperature=-1.0, backend=backend)


def test_linear_policy_loss_rejects():
    h, w = torch.randn(2, 3, 4), torch.randn(7, 4)
    t, a, m = torch.zeros(2, 3, dtype=torch.long), torch.ones(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"weight must have shape \(V, H=4\)"):
        fused_rl.reference.linear_policy_loss(h, torch.randn(7, 5), t, a, m)
    with pytest.raises(ValueError, match="weight dtype"):
        fused_rl.reference.linear_policy_loss(h, w.double(), t, a, m)
    with pytest.raises(ValueError, match="bias must have shape"):
        fused_rl.reference.linear_policy_loss(h, w, t, a, m, bias=torch.zeros(6))
    with pytest.raises(ValueError, match=r"targets must be in \[0, 7\)"):
        fused_rl.reference.linear_policy_loss(h, w, torch.full((2, 3), 7), a, m)
    with pytest.raises(ValueError, match="hidden must have"):
        fused_rl.reference.linear_policy_loss(h[0], w, t, a, m)


def test_check_inputs_false_skips_value_checks_only():
    args = good()
    out = fused_rl.policy_loss(args["logits"], args["targets"], torch.tensor([float("nan"), 1.0]), args["mask"],
                               check_inputs=False, backend="torch")
    assert torch.isnan(out.loss)  # the caller opted out; structural checks still run:
    with pytest.raises(ValueError, match="advantages must have shape"):
        fused_rl.policy_loss(args["logits"], args["targets"], torch.ones(3), args["mask"], check_inputs=False)


def test_reference_module_takes_no_backend():
    args = good()
    with pytest.raises(TypeError, match="no backend"):
        fused_rl.reference.policy_loss(*args.values(), backend="torch")


@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
@pytest.mark.parametrize("config", [PolicyLossConfig(), PolicyLossConfig(policy_loss="gspo")], ids=["ppo", "gspo"])
def test_advantages_and_normalizer_are_constants_on_every_backend(backend, config):
    """Advantages from an undetached value head (PPO), or a normalizer that requires grad, get no
    gradient on any backend (once: a gradient on reference / torch, None on cpu, an error on triton)."""
    args = good()
    adv = (args["advantages"] * 1.0).requires_grad_(True)
    norm = torch.tensor(5.0, requires_grad=True) if config.agg == "token-mean" else None
    x = args["logits"].clone().requires_grad_(True)
    out = fused_rl.policy_loss(x, args["targets"], adv, args["mask"], config=config, backend=backend,
                               token_normalizer=norm)
    out.loss.backward()
    assert adv.grad is None and (norm is None or norm.grad is None)
    x_ref = args["logits"].clone().requires_grad_(True)
    expected = fused_rl.policy_loss(x_ref, args["targets"], args["advantages"], args["mask"], config=config,
                                    backend="reference", token_normalizer=None if norm is None else 5.0)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("backend", ["reference"] + [b for b in fused_backends() if b in ("torch", "cpu")])
def test_linear_advantages_are_constants(backend):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    adv = torch.randn(2, generator=g).requires_grad_(True)
    out = fused_rl.linear_policy_loss(hidden, weight, torch.randint(0, 11, (2, 3), generator=g), adv,
                                      torch.ones(2, 3, dtype=torch.bool), backend=backend)
    out.loss.backward()
    assert adv.grad is None and hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("backend", ["reference"] + [b for b in fused_backends() if b in ("torch", "cpu")])
def test_linear_nan_hidden_at_masked_rows_reaches_no_gradient(backend):
    """Pad positions' hidden states can be NaN (fully masked attention rows): never read for the loss,
    they reach neither the loss nor any gradient, through the matmul included."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 8, generator=g)
    weight, bias = torch.randn(11, 8, generator=g), torch.randn(11, generator=g)
    targets, adv = torch.randint(0, 11, (2, 3), generator=g), torch.randn(2, generator=g)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    grads = []
    for pad in (0.0, float("nan")):
        h = hidden.clone()
        h[~mask] = pad
        leaves = [x.clone().requires_grad_(True) for x in (h, weight, bias)]
        out = fused_rl.linear_policy_loss(leaves[0], leaves[1], targets, adv, mask, bias=leaves[2], backend=backend)
        out.loss.backward()
        t = torch.where(mask, targets, -100)
        lp = fused_rl.linear_token_logprobs(leaves[0], leaves[1], t, bias=leaves[2], backend=backend)
        grads.append([out.loss.detach(), lp.detach()] + [x.grad for x in leaves])
    clean, padded = grads
    for a, b in zip(clean, padded):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("backend", fused_backends())
def test_inplace_refuses_rows_that_share_memory(backend):
    """``inplace=True`` over logits whose rows alias (one prompt's logits expanded over a group, or over time)
    would write several rows' gradients into one place (a wrong gradient on cpu / triton): refused; a sliced
    view (disjoint rows) and ``inplace=False`` are fine."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 5, 40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (4, 5), generator=g)
    adv, mask = torch.randn(4, generator=g), torch.ones(4, 5, dtype=torch.bool)
    for shared in (lambda x: x.expand(4, 5, 40), lambda x: x[:, :1].expand(4, 5, 40)):
        with pytest.raises(ValueError, match="rows do not share memory"):
            fused_rl.policy_loss(shared(base * 1.0), targets, adv, mask, backend=backend, inplace=True)
    grads = []
    for be, inplace in ((backend, False), ("reference", False)):
        x = base.detach().clone().requires_grad_(True)
        fused_rl.policy_loss((x * 1.0).expand(4, 5, 40), targets, adv, mask, backend=be,
                             inplace=inplace).loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    full = torch.randn(4, 7, 40, generator=g, requires_grad=True)
    fused_rl.policy_loss((full * 1.0)[:, 1:-1], targets, adv, mask, backend=backend,
                         inplace=True).loss.backward()  # a slice: disjoint rows
    assert torch.isfinite(full.grad).all()


@pytest.mark.parametrize("backend", fused_backends())
def test_inplace_refuses_rows_that_overlap_partially(backend):
    """Rows that overlap by a single element (row stride ``V - 1``), or a batch stride inside the span of the
    time rows below it (``2 V + 5 < 3 V``), share memory too: refused with ``inplace=True``. A batch stride
    clearing the span (``3 V``) is accepted, and so is any stride of a size-1 dimension (never stepped: 0 here),
    with the reference's gradient."""
    g = torch.Generator().manual_seed(7)
    vocab = 40
    targets = torch.randint(0, vocab, (2, 3), generator=g)
    adv, mask = torch.randn(2, generator=g), torch.ones(2, 3, dtype=torch.bool)
    base = torch.randn(4 * 3 * vocab, generator=g, requires_grad=True)
    for strides in ((3 * (vocab - 1), vocab - 1, 1), (2 * vocab + 5, vocab, 1)):
        with pytest.raises(ValueError, match="rows do not share memory"):
            fused_rl.policy_loss((base * 1.0).as_strided((2, 3, vocab), strides), targets, adv, mask,
                                 backend=backend, inplace=True)
    for shape, strides in (((2, 3, vocab), (3 * vocab, vocab, 1)), ((2, 1, vocab), (vocab, 0, 1))):
        grads = []
        for be, inplace in ((backend, True), ("reference", False)):
            x = base.detach().clone().requires_grad_(True)
            fused_rl.policy_loss((x * 1.0).as_strided(shape, strides), targets[:, :shape[1]], adv,
                                 mask[:, :shape[1]], backend=be, inplace=inplace).loss.backward()
            grads.append(x.grad)
        assert grads[1].abs().sum() > 0
        torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", [b for b in fused_backends() if b in ("cpu", "triton")])
def test_inplace_leaves_a_leaf_and_its_views_intact(backend):
    """``inplace=True`` writes the gradient over the logits only when they are a non-leaf buffer (model output,
    or a slice of one): over a leaf, or a view of one (``leaf[:, P-1:-1]``), it would overwrite the leaf's
    values. The gradient is the reference's either way."""
    args = good(B=2, T=4, V=40)
    leaf = args["logits"].clone().requires_grad_(True)
    ref = args["logits"].clone().requires_grad_(True)
    for x, be in ((leaf, backend), (ref, "reference")):
        fused_rl.policy_loss(x[:, 1:], args["targets"][:, 1:], args["advantages"], args["mask"][:, 1:], backend=be,
                             inplace=be != "reference").loss.backward()
    assert torch.equal(leaf.detach(), args["logits"])
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", fused_backends())
def test_token_logprobs_inplace_is_a_permission(backend):
    """``token_logprobs(inplace=True)`` writes the backward's gradient over the logits only where that is safe and
    reaches the caller: not over a leaf or a view of one, not over 4-D logits whose rows the kernels read from a
    copy (a transposed batch), not under ``torch.compile``; rows that share memory are refused; a node that saved
    the logits (a soft-cap ``tanh``) and a second backward raise instead of reading the gradient as logits. Every
    gradient is the reference's."""
    g = torch.Generator().manual_seed(9)
    x0 = torch.randn(2, 3, 4, 40, generator=g)
    targets = torch.randint(0, 40, (2, 3, 4), generator=g)

    def grad(make, be=backend, inplace=True, compiled=False):
        leaf = x0.clone().requires_grad_(True)
        x = make(leaf)
        fn = functools.partial(fused_rl.token_logprobs, backend=be, inplace=inplace)
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        ids = torch.randint(0, 40, x.shape[:-1], generator=torch.Generator().manual_seed(1))
        (fn(x, ids) ** 2).sum().backward()
        return leaf, x

    for make in (lambda leaf: leaf, lambda leaf: leaf[:, :, 1:].transpose(0, 1),
                 lambda leaf: (leaf * 1).transpose(0, 2)):
        (want, _), (leaf, _) = grad(make, "reference", False), grad(make)
        assert torch.equal(leaf.detach(), x0)
        torch.testing.assert_close(leaf.grad, want.grad, atol=1e-6, rtol=1e-5)
    (want, _), (leaf, x) = grad(lambda leaf: leaf * 1, "reference", False), grad(lambda leaf: leaf * 1, compiled=True)
    assert torch.equal(x.detach(), x0)
    torch.testing.assert_close(leaf.grad, want.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="rows do not share memory"):
        fused_rl.token_logprobs((x0[:, :1] * 1).expand(2, 3, 4, 40), targets, backend=backend, inplace=True)
    leaf = x0.clone().requires_grad_(True)
    logp = fused_rl.token_logprobs(torch.tanh(leaf), targets, backend=backend, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()  # tanh's backward reads its output: the logits, now the gradient
    logp = fused_rl.token_logprobs(leaf * 1, targets, backend=backend, inplace=True)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


@pytest.mark.parametrize("backend", fused_backends())
def test_token_logprobs_inplace_create_graph_and_batched_gradients(backend):
    """``token_logprobs(inplace=True)`` on a non-leaf: under ``create_graph=True`` the backward is out of place, so a
    second-order gradient raises by name (the in-place gradient would be a constant of the new graph: a gradient
    penalty silently dropped); a batch of gradients (``is_grads_batched``) of either output, the entropy's alone
    included, is the reference's (the in-place op has no batching rule)."""
    g = torch.Generator().manual_seed(3)
    x0, targets = torch.randn(2, 3, 40, generator=g), torch.randint(0, 40, (2, 3), generator=g)
    leaf = x0.clone().requires_grad_(True)
    logits = leaf * 1
    (grad,) = torch.autograd.grad(fused_rl.token_logprobs(logits, targets, backend=backend, inplace=True).sum(),
                                  logits, create_graph=True)
    assert torch.equal(logits.detach(), x0)  # not written: the out-of-place gradient
    with pytest.raises(RuntimeError, match="second-order gradient"):
        (grad.pow(2).sum() + leaf.sum()).backward()
    batch = torch.randn(3, 2, 3, generator=g)
    for output in (0, 1):
        grads = []
        for be, inplace in ((backend, True), ("reference", False)):
            leaf = x0.clone().requires_grad_(True)
            outs = fused_rl.token_logprobs(leaf * 1, targets, return_entropy=True, backend=be, inplace=inplace)
            grads.append(torch.autograd.grad(outs[output], leaf, grad_outputs=batch, is_grads_batched=True)[0])
        torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_numpy_scalar_arguments():
    np = pytest.importorskip("numpy")
    args = good()
    expected = fused_rl.policy_loss(**args, token_normalizer=4.0, config=PolicyLossConfig(temperature=0.5))
    got = fused_rl.policy_loss(**args, token_normalizer=np.int64(4),
                               config=PolicyLossConfig(temperature=np.float32(0.5)))
    torch.testing.assert_close(got.loss, expected.loss)
    for arr in (np.array(4.0), np.array([4], dtype=np.int32)):  # arrays as tensors (torch.compile: numpy scalars too)
        got = fused_rl.policy_loss(**args, token_normalizer=arr, config=PolicyLossConfig(temperature=0.5))
        torch.testing.assert_close(got.loss, expected.loss)
    for bad, message in ((np.array("4"), "a real number or tensor, got a numpy <U1"),
                         (np.array(True), "got a bool tensor"), (np.array([4.0, 4.0]), "must be a scalar"),
                         (np.array(-4.0), "must be positive and finite")):
        with pytest.raises(ValueError, match=message):
            fused_rl.policy_loss(**args, token_normalizer=bad)
    with pytest.raises(ValueError, match=r"positive and finite in fp32 \(a tensor normalizer is cast to it\)"):
        fused_rl.policy_loss(**args, token_normalizer=torch.tensor(1e300, dtype=torch.float64))  # inf in fp32
    torch.testing.assert_close(fused_rl.token_logprobs(args["logits"], args["targets"], temperature=np.float64(0.5)),
                               fused_rl.token_logprobs(args["logits"], args["targets"], temperature=0.5))
    for bad in (np.bool_(True), "0.5", float("nan"), np.float32("inf"), 0.0, np.float64(1e-38)):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            fused_rl.token_logprobs(args["logits"], args["targets"], temperature=bad)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's numpy: finfo.min * log2(e)
@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
def test_on_policy_target_with_logit_minus_inf_raises(backend):
    """On-policy, a sampled token whose logit is -inf (probability 0) at a valid position has the undefined ratio
    ``exp(-inf + inf)``, and the backends disagreed (the reference's NaN loss and gradient, the C++ kernel's NaN loss
    with a finite gradient, the Triton kernel's finite loss): it raises on every one. -inf elsewhere in the row
    (p = 0 entries), at a masked position or behind an IGNORE_INDEX target is fine, so is an off-policy -inf
    target (r = 0: ``test_hardening.test_neg_inf_logits_have_p_zero_even_at_the_target``), and
    ``check_inputs=False`` skips the check."""
    args = good()
    logits, targets = args["logits"].clone(), args["targets"].clone()
    rows = torch.arange(3)
    logits[0, rows, (targets[0] + 1) % 11] = float("-inf")  # legitimate p = 0 entries
    logits[1, 2, targets[1, 2]] = float("-inf")
    mask = args["mask"].clone()
    mask[1, 2] = False
    targets[0, 1] = fused_rl.IGNORE_INDEX
    logits[0, 1, 0] = float("-inf")  # the clamped index of an IGNORE_INDEX target
    out = fused_rl.policy_loss(logits, targets, args["advantages"], mask, backend=backend)
    assert torch.isfinite(out.loss)
    mask[1, 2] = True
    with pytest.raises(ValueError, match=r"targets have logit -inf \(over the temperature\) where mask is set "
                                         r"\(on-policy"):
        fused_rl.policy_loss(logits, targets, args["advantages"], mask, backend=backend)
    fused_rl.policy_loss(logits, targets, args["advantages"], mask, backend=backend, check_inputs=False)
    old = torch.full(targets.shape, -2.0)
    out = fused_rl.policy_loss(logits, targets, args["advantages"], mask, old_logprobs=old, backend=backend)
    assert torch.isfinite(out.loss)
    # a finite finfo.min logit is -inf over a temperature below 1 (the triton kernel's loss was finite, the others NaN)
    logits[1, 2, targets[1, 2]] = torch.finfo(torch.float32).min
    out = fused_rl.policy_loss(logits, targets, args["advantages"], mask, backend=backend)
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match=r"targets have logit -inf \(over the temperature\)"):
        fused_rl.policy_loss(logits, targets, args["advantages"], mask, backend=backend,
                             config=PolicyLossConfig(temperature=0.5))


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "triton"])
def test_linear_on_policy_target_with_a_minus_inf_bias_raises(backend):
    """The fused-linear form of the check above: a -inf bias entry (a banned token) is a -inf logit whatever the
    hidden state; on-policy at a valid target it raises (the reference's NaN gradient against finite gradients of
    a NaN loss on cpu / triton); a -inf bias elsewhere, at a masked target, or off-policy is fine."""
    if backend != "reference" and fused_rl.available_backends()[backend] is not None:
        pytest.skip(fused_rl.available_backends()[backend])
    g = torch.Generator().manual_seed(5)
    hidden, weight, bias = torch.randn(2, 3, 8, generator=g), torch.randn(11, 8, generator=g), torch.zeros(11)
    targets = torch.tensor([[1, 2, 3], [4, 5, 6]])
    advantages, mask = torch.randn(2, 3, generator=g), torch.ones(2, 3, dtype=torch.bool)
    bias[[0, 5]] = float("-inf")
    mask[1, 1] = False
    out = fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, bias=bias, backend=backend)
    assert torch.isfinite(out.loss)
    mask[1, 1] = True
    with pytest.raises(ValueError, match=r"targets have logit -inf \(over the temperature\) where mask is set "
                                         r"\(on-policy"):
        fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, bias=bias, backend=backend)
    out = fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, bias=bias, backend=backend,
                                      old_logprobs=torch.full((2, 3), -2.0))
    assert torch.isfinite(out.loss)
    bias[5] = torch.finfo(torch.float32).min  # -inf over a temperature below 1
    with pytest.raises(ValueError, match=r"targets have logit -inf \(over the temperature\)"):
        fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, bias=bias, backend=backend,
                                    config=PolicyLossConfig(temperature=0.5))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
def test_temperature_bound(backend):
    """At ``MIN_TEMPERATURE`` (vLLM's greedy threshold) log-probs of logits ~+-100 (z ~ 1e7) are finite, within
    fp32 rounding of ``x / tau`` of an fp64 log_softmax, with finite gradients; below it every entry point
    raises (at 1e-38 ``logits / tau`` overflowed to a NaN log-prob on every backend)."""
    from fused_rl.config import MIN_TEMPERATURE

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 300, generator=g) * 30
    x[0, 0] -= 1e4
    targets = torch.randint(0, 300, (2, 3), generator=g)
    expected = torch.log_softmax(x.double() / MIN_TEMPERATURE, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logits = x.clone().requires_grad_(True)
    logp, entropy = fused_rl.token_logprobs(logits, targets, temperature=MIN_TEMPERATURE, return_entropy=True,
                                            backend=backend)
    logp.sum().backward()
    torch.testing.assert_close(logp.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    below = MIN_TEMPERATURE * 0.99
    with pytest.raises(ValueError, match="temperature must be a finite number >= 1e-05"):
        fused_rl.token_logprobs(x, targets, temperature=below, backend=backend)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 1e-05"):
        fused_rl.linear_token_logprobs(torch.randn(2, 3, 4), torch.randn(300, 4), targets, temperature=below,
                                       backend=backend)
    with pytest.raises(ValueError, match="PolicyLossConfig.temperature must be >= 1e-05"):
        PolicyLossConfig(temperature=1e-38)


@pytest.mark.parametrize("backend", [b for b in fused_backends() if b in ("cpu", "triton", "torch")])
def test_double_backward_is_refused_where_the_gradient_is_precomputed(backend):
    """The single-pass and fused-linear ops return gradients computed in the forward, constants to
    autograd: ``create_graph=True`` raises instead of silently dropping the second-order terms."""
    args = good()
    x = args["logits"].clone().requires_grad_(True)
    lin = [torch.randn(2, 3, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)]
    losses = [fused_rl.linear_policy_loss(*lin, args["targets"], args["advantages"], args["mask"],
                                          backend=backend).loss]
    inputs = [lin[0]]
    if backend != "torch":  # the chunked torch policy_loss is two passes with a recomputing backward
        losses.append(fused_rl.policy_loss(x, args["targets"], args["advantages"], args["mask"], backend=backend).loss)
        inputs.append(x)
    for loss, inp in zip(losses, inputs):
        with pytest.raises(RuntimeError, match="no double backward"):
            torch.autograd.grad(loss, inp, create_graph=True)
    x_ref = args["logits"].clone().requires_grad_(True)
    ref = fused_rl.policy_loss(x_ref, args["targets"], args["advantages"], args["mask"], backend="reference").loss
    (g,) = torch.autograd.grad(ref, x_ref, create_graph=True)
    assert g.requires_grad


@pytest.mark.parametrize("backend", [b for b in fused_backends() if b in ("cpu", "triton", "torch")])
def test_second_order_through_the_recomputing_ops_is_refused_by_name(backend):
    """token_logprobs and the two-pass policy losses (gspo) recompute the logits gradient in the backward:
    ``create_graph=True`` gives a first-order gradient equal to the reference's, and differentiating that
    gradient again raises with the alternative named (not torch's "no autograd formula registered")."""
    args = good()
    x = args["logits"].clone().requires_grad_(True)
    lp = fused_rl.token_logprobs(x, args["targets"], backend=backend)
    gspo = PolicyLossConfig(policy_loss="gspo", agg="seq-mean-token-mean")
    loss = fused_rl.policy_loss(x, args["targets"], args["advantages"], args["mask"], config=gspo, backend=backend).loss
    x_ref = args["logits"].clone().requires_grad_(True)
    lp_ref = fused_rl.token_logprobs(x_ref, args["targets"], backend="reference")
    loss_ref = fused_rl.policy_loss(x_ref, args["targets"], args["advantages"], args["mask"], config=gspo,
                                    backend="reference").loss
    for out, ref in ((lp.sum(), lp_ref.sum()), (loss, loss_ref)):
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (g_ref,) = torch.autograd.grad(ref, x_ref, create_graph=True)
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
        with pytest.raises(RuntimeError, match="no backward of its own.*backend='reference'"):
            g.pow(2).sum().backward()
    # linear_token_logprobs (the tiled two passes on cpu / triton, the chunked torch one on torch): the same for h
    h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(11, 8)
    h_ref = h.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fused_rl.linear_token_logprobs(h, w, args["targets"], backend=backend).sum(), h,
                               create_graph=True)
    (g_ref,) = torch.autograd.grad(fused_rl.linear_token_logprobs(h_ref, w, args["targets"], backend="reference").sum(),
                                   h_ref, create_graph=True)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no backward of its own.*backend='reference'"):
        g.pow(2).sum().backward()


def _functorch_calls(backend):
    args = good()
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    t, a, m = args["targets"], args["advantages"], args["mask"]
    return args["logits"], h, [
        ("policy_loss", lambda x: fused_rl.policy_loss(x, t, a, m, backend=backend).loss, "logits"),
        ("token_logprobs", lambda x: fused_rl.token_logprobs(x, t, backend=backend).sum(), "logits"),
        ("linear_policy_loss", lambda x: fused_rl.linear_policy_loss(x, w, t, a, m, backend=backend).loss, "hidden"),
        ("linear_token_logprobs", lambda x: fused_rl.linear_token_logprobs(x, w, t, backend=backend).sum(), "hidden"),
    ]


@pytest.mark.parametrize("backend", ["auto"] + fused_backends())
def test_torch_func_transforms_are_refused_by_name_on_fused_backends(backend):
    """The fused ops are custom ops with no torch.func rules: ``torch.func.grad`` / ``vmap`` raise naming
    the reference (not torch's "must override the setup_context staticmethod")."""
    logits, hidden, calls = _functorch_calls(backend)
    for name, fn, arg in calls:
        x = logits if arg == "logits" else hidden
        with pytest.raises(RuntimeError, match="without torch.func rules.*backend='reference'"):
            torch.func.grad(fn)(x)
        with pytest.raises(RuntimeError, match="without torch.func rules.*backend='reference'"):
            torch.func.vmap(fn)(x.unsqueeze(0))


@pytest.mark.parametrize("backend", ["auto"] + fused_backends())
def test_forward_mode_ad_is_refused_by_name_on_fused_backends(backend):
    """A forward-mode dual input (``torch.autograd.forward_ad``) is refused naming the reference: a custom op
    drops its tangent with no error, and the output's ``None`` tangent reads as a zero directional derivative.
    The weight of the fused-linear functions counts too; a dual level whose inputs carry no tangent is no dual."""
    import torch.autograd.forward_ad as fwAD

    logits, hidden, calls = _functorch_calls(backend)
    for name, fn, arg in calls:
        x = logits if arg == "logits" else hidden
        with fwAD.dual_level():
            with pytest.raises(RuntimeError, match="without forward-mode AD.*backend='reference'"):
                fn(fwAD.make_dual(x, torch.randn_like(x)))
            torch.testing.assert_close(fn(x), fn(x.clone()), msg=name)  # no tangent: runs
    args = good()
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="without forward-mode AD"):
        fused_rl.linear_policy_loss(h, fwAD.make_dual(w, torch.ones_like(w)), args["targets"], args["advantages"],
                                    args["mask"], backend=backend)


def test_forward_mode_ad_runs_on_the_reference():
    """The reference's forward-mode tangent is the directional derivative: the gradient dotted with the tangent."""
    import torch.autograd.forward_ad as fwAD

    logits, hidden, calls = _functorch_calls("reference")
    for name, fn, arg in calls:
        x = logits if arg == "logits" else hidden
        v = torch.randn_like(x)
        x_ag = x.clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(fn(x_ag), x_ag)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, v))).tangent
        torch.testing.assert_close(tangent, (gradient * v).sum(), msg=name)


def test_torch_func_grad_runs_on_the_reference():
    logits, hidden, calls = _functorch_calls("reference")
    for name, fn, arg in calls:
        x = logits if arg == "logits" else hidden
        x_ag = x.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(fn(x_ag), x_ag)
        torch.testing.assert_close(torch.func.grad(fn)(x), expected, msg=name)


def test_torch_func_vmap_runs_on_the_reference_with_its_value_checks():
    """``vmap`` over the reference with ``check_inputs`` on (the default): the value checks read their values from
    under vmap's wrapper (reading the wrapper raised torch's "Cannot access data pointer of Tensor that doesn't have
    storage"; under ``grad`` too on torch <= 2.8), the results equal a loop, and a bad target in one sample of the
    batch is refused."""
    logits, hidden, calls = _functorch_calls("reference")
    for name, fn, arg in calls:
        x = logits if arg == "logits" else hidden
        xs = torch.stack([x, 2.0 * x])
        torch.testing.assert_close(torch.func.vmap(fn)(xs), torch.stack([fn(xs[0]), fn(xs[1])]), msg=name)
    args = good()
    loss = lambda t: fused_rl.policy_loss(args["logits"], t, args["advantages"], args["mask"],  # noqa: E731
                                          backend="reference").loss
    targets = torch.stack([args["targets"], args["targets"].flip(0)])
    torch.testing.assert_close(torch.func.vmap(loss)(targets), torch.stack([loss(targets[0]), loss(targets[1])]))
    targets[1, 0, 0] = _V
    with pytest.raises(ValueError, match=r"targets must be in \[0, 11\)"):
        torch.func.vmap(loss)(targets)


# --------------------------------------------------------------------------------- bad-input fuzz
_B, _T, _V, _H = 2, 3, 11, 4  # good()'s shape, and a hidden size


def _valid_inputs():
    """:func:`good`'s call plus every optional input of the four public functions."""
    g = torch.Generator().manual_seed(1)
    return dict(good(_B, _T, _V), old=torch.randn(_B, _T, generator=g) - 3, ref=torch.randn(_B, _T, generator=g) - 3,
                rollout=torch.randn(_B, _T, generator=g) - 3, hidden=torch.randn(_B, _T, _H, generator=g),
                weight=torch.randn(_V, _H, generator=g), bias=torch.randn(_V, generator=g),
                truncated=torch.zeros(_B, dtype=torch.bool), is_weights=torch.ones(_B, _T))


#: Wrong shapes, dtypes, layouts, values and types of every argument (some are accepted: a float 0/1 mask,
#: an omitted bias, a smaller vocabulary); ``config``, ``token_normalizer`` and ``temperature`` values too.
_MUTATIONS = {
    "logits": lambda: [torch.randn(_B, _T), torch.randn(_B, _T, 0), torch.randn(_B, _T, 2 * _V).half()[..., ::2],
                       torch.randn(_B, _T, _V).to(torch.int32), torch.randn(1, _B, _T, _V),
                       torch.full((_B, _T, _V), float("nan")), torch.randn(_V, _T, _B).permute(2, 1, 0),
                       torch.randn(_B, _T, 1)],
    "targets": lambda: [torch.randint(0, _V, (_B, _T)).float(), torch.randint(0, _V, (_B, _T)).to(torch.int16),
                        torch.full((_B, _T), _V), torch.full((_B, _T), -5), torch.randint(0, _V, (_B,)),
                        torch.randint(0, _V, (_B, _T, 1)), torch.randint(0, _V, (_T, _B)).t()],
    "advantages": lambda: [torch.randn(_B, _T + 1), torch.randn(_B, 1), torch.randn(()),
                           torch.tensor([float("inf"), 0.0]), torch.randn(_B).double(), torch.randn(_B).half(),
                           torch.randint(0, 2, (_B,))],
    "mask": lambda: [torch.ones(_B, _T), torch.ones(_B, _T, dtype=torch.int64), torch.full((_B, _T), 0.5),
                     torch.ones(_B, _T + 1, dtype=torch.bool), torch.zeros(_B, _T, dtype=torch.bool),
                     torch.ones(_T, _B, dtype=torch.bool).t()],
    "old": lambda: [None, torch.randn(_B, _T + 1), torch.full((_B, _T), float("-inf")), torch.randn(_B, _T).double(),
                    torch.randn(_B, _T).bfloat16(), torch.randn(_B)],
    "ref": lambda: [torch.randn(_B, 2), torch.full((_B, _T), float("nan"))],
    "rollout": lambda: [None, torch.randn(_B, _T + 1), torch.full((_B, _T), float("nan"))],
    "hidden": lambda: [torch.randn(_B, _T, _H + 1), torch.randn(_B, _T), torch.randn(_B, _T, _H).double(),
                       torch.randn(_B, _T, _H).bfloat16(), torch.randn(_B, _T, _H).long(), torch.randn(_B, _T, 0)],
    "weight": lambda: [torch.randn(_V, _H + 1), torch.randn(_V), torch.randn(_V, _H).bfloat16(),
                       torch.randn(_H, _V).t(), torch.randn(0, _H)],
    "bias": lambda: [torch.randn(_V + 1), torch.randn(_V, 1), torch.randn(_V).double(), None],
    "truncated": lambda: [torch.zeros(_B + 1, dtype=torch.bool), torch.zeros(_B),
                          torch.zeros(_B, _T, dtype=torch.bool)],
    "is_weights": lambda: [torch.ones(_B, _T + 1), -torch.ones(_B, _T), torch.full((_B, _T), float("nan"))],
    "config": lambda: [PolicyLossConfig(kl="k3", beta=0.1), PolicyLossConfig(rollout_is="token_truncate"),
                       PolicyLossConfig(mask_truncated_completions=True), PolicyLossConfig(off_policy_mask=0.1),
                       PolicyLossConfig(top_entropy_quantile=0.5),
                       PolicyLossConfig(policy_loss="gspo", agg="seq-mean-token-mean"),
                       PolicyLossConfig(temperature=0.5)],
    "token_normalizer": lambda: [0.0, -1.0, float("nan"), torch.tensor([1.0, 2.0]), torch.tensor(float("inf")), "x", 3],
    "temperature": lambda: [0.0, -1.0, float("nan"), "1", torch.tensor(1.0)],
}


def _run_api(api, backend, a, config, extra):
    """One call of ``api`` (and its backward when the differentiable input is floating point)."""
    if api in ("policy", "linear"):
        kw = dict(old_logprobs=a["old"], ref_logprobs=a["ref"], config=config, backend=backend)
        if config is not None and config.rollout_is:
            kw["rollout_logprobs"] = a["rollout"]
        if config is not None and config.mask_truncated_completions:
            kw["truncated"] = a["truncated"]
        if "is_weights" in extra:
            kw["rollout_is_weights"] = a["is_weights"]
        if "token_normalizer" in extra:
            kw["token_normalizer"] = extra["token_normalizer"]
        if api == "policy":
            x = a["logits"].clone().requires_grad_(a["logits"].is_floating_point())
            out = fused_rl.policy_loss(x, a["targets"], a["advantages"], a["mask"], **kw).loss
        else:
            x = a["hidden"].clone().requires_grad_(a["hidden"].is_floating_point())
            out = fused_rl.linear_policy_loss(x, a["weight"], a["targets"], a["advantages"], a["mask"], bias=a["bias"],
                                              **kw).loss
    else:
        kw = {"temperature": extra["temperature"]} if "temperature" in extra else {}
        if api == "token":
            x = a["logits"].clone().requires_grad_(a["logits"].is_floating_point())
            out = fused_rl.token_logprobs(x, a["targets"], backend=backend, **kw).sum()
        else:
            x = a["hidden"].clone().requires_grad_(a["hidden"].is_floating_point())
            out = fused_rl.linear_token_logprobs(x, a["weight"], a["targets"], bias=a["bias"], backend=backend,
                                                 **kw).sum()
    if x.requires_grad:
        out.backward()


@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
def test_bad_input_fuzz_raises_value_errors_only(backend):
    """One or two arguments of a valid call of each public function replaced by a wrong shape, dtype,
    layout, value or type: the call succeeds (the change was acceptable) or raises ``ValueError`` before
    any kernel runs; never another exception from deeper down (an IndexError, a torch RuntimeError, a
    kernel's assertion)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from strategies import fuzz_settings

    @fuzz_settings(60 if backend == "triton" else 300)
    @given(api=st.sampled_from(["policy", "token", "linear", "linear_token"]),
           picks=st.lists(st.tuples(st.sampled_from(sorted(_MUTATIONS)), st.integers(0, 7)), min_size=1, max_size=2,
                          unique_by=lambda p: p[0]))
    def check(api, picks):
        a, config, extra = _valid_inputs(), None, {}
        for key, i in picks:
            options = _MUTATIONS[key]()
            value = options[i % len(options)]
            if key == "config":
                config = value
            elif key in ("token_normalizer", "temperature", "is_weights"):
                extra[key] = value
                if key == "is_weights":
                    a[key] = value
            else:
                a[key] = value
        try:
            _run_api(api, backend, a, config, extra)
        except ValueError:
            pass

    check()


def test_logprob_sign_check_reads_only_valid_tokens_and_tolerates_rounding():
    """Padding may hold anything; a log-prob a little above 0 (rounding, up to ``LOGPROB_SLACK``) passes; a NaN
    is reported once, as NaN."""
    from fused_rl.validation import LOGPROB_SLACK

    old = torch.full((2, 3), -0.1)
    old[0, 0] = LOGPROB_SLACK
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    old[1, 2] = 40.0
    assert torch.isfinite(call("reference", old_logprobs=old, mask=mask).loss)
    old[0, 1] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs contain NaN") as info:
        call("reference", old_logprobs=old, mask=mask)
    assert "log-probabilities" not in str(info.value)


# --------------------------------------------------------------------------------- audit: devices, casts, flags
ALL_BACKENDS = ["reference"] + fused_backends()


def _four_calls(backend, logits, hidden, weight, targets, advantages, mask, **kw):
    """The four public functions on the given tensors (``kw`` goes to the two policy losses)."""
    return [lambda: fused_rl.policy_loss(logits, targets, advantages, mask, backend=backend, **kw),
            lambda: fused_rl.token_logprobs(logits, targets, backend=backend),
            lambda: fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, backend=backend, **kw),
            lambda: fused_rl.linear_token_logprobs(hidden, weight, targets, backend=backend)]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_meta_tensors_are_refused_by_name(backend):
    """Meta tensors hold no data: the value checks could not run (torch's "Cannot copy out of meta tensor"), the
    reference's linear loss failed in autocast, the cpu backend said it cannot run on meta while the others named
    the targets: every backend now names the argument, also when only it or a tensor normalizer is on meta."""
    args = good()
    meta = {k: v.to("meta") for k, v in args.items()}
    h, w = torch.randn(2, 3, 4), torch.randn(11, 4)
    for calls in (_four_calls(backend, meta["logits"], h.to("meta"), w.to("meta"), meta["targets"],
                              meta["advantages"], meta["mask"]),
                  _four_calls(backend, meta["logits"], h.to("meta"), w, args["targets"], args["advantages"],
                              args["mask"])):
        for fn in calls:
            with pytest.raises(ValueError, match=r"(logits|hidden) (is|are) on the meta device"):
                fn()
    with pytest.raises(ValueError, match="token_normalizer is on the meta device"):
        call(backend, token_normalizer=torch.tensor(4.0, device="meta"))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf loss at 2^-149
def test_complex_and_overflowing_scalars_are_refused(backend):
    """A complex normalizer lost its imaginary part silently; an int too large for a float passed the finite check
    and raised OverflowError from ``float()``."""
    with pytest.raises(ValueError, match="token_normalizer must be a real"):
        call(backend, token_normalizer=torch.tensor(4 + 1j))
    with pytest.raises(ValueError, match="token_normalizer must be a positive finite number"):
        call(backend, token_normalizer=10**400)
    # outside fp32's range, as a tensor normalizer after its cast: 1e-300 made the loss inf and its gradient NaN
    lo, hi = validation.FP32_POSITIVE_FINITE
    for number in (1e-300, lo, hi, 1e300):
        with pytest.raises(ValueError, match="positive and finite in fp32"):
            call(backend, token_normalizer=number)
        with pytest.raises(ValueError, match="positive and finite in fp32"):
            call(backend, token_normalizer=torch.tensor(number, dtype=torch.float64))
    for number in (math.nextafter(lo, 1), math.nextafter(hi, 0)):  # the extremes that round to a positive finite
        call(backend, token_normalizer=number)
    args = good()
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        fused_rl.token_logprobs(args["logits"], args["targets"], temperature=10**400, backend=backend)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        fused_rl.linear_token_logprobs(torch.randn(2, 3, 4), torch.randn(11, 4), args["targets"], temperature=10**400,
                                       backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_values_that_overflow_the_compute_dtype_are_refused(backend):
    """fp64 advantages / log-probs / weights are finite in fp64 but the loss reads them in fp32: 1e300 became inf
    after the checks, and every backend returned an infinite loss with NaN gradients."""
    k3 = PolicyLossConfig(kl="k3", beta=0.1)
    big = torch.full((2, 3), 1e300, dtype=torch.float64)
    for kw, match in ((dict(advantages=big[:, 0]), "advantages contain NaN or inf"),
                      (dict(old_logprobs=-big), "old_logprobs contain NaN or inf"),
                      (dict(ref_logprobs=-big, config=k3), "ref_logprobs contain NaN or inf")):
        with pytest.raises(ValueError, match=match + r".*\(as torch.float32"):
            call(backend, **kw)
    args = good()
    with pytest.raises(ValueError, match=r"rollout_is_weights must be finite.*\(as torch.float32"):
        fused_rl.policy_loss(*args.values(), rollout_is_weights=big, backend=backend)
    with pytest.raises(ValueError, match=r"advantages contain NaN or inf.*\(as torch.float32"):
        fused_rl.linear_policy_loss(torch.randn(2, 3, 4), torch.randn(11, 4), args["targets"], big[:, 0],
                                    args["mask"], backend=backend)
    out = call(backend, advantages=torch.tensor([1e30, -2.0], dtype=torch.float64))  # large, representable: fine
    assert torch.isfinite(out.loss)
    nan = torch.full((2, 3), -1.0, dtype=torch.float64)
    nan[0, 1] = float("nan")  # bad already in fp64: the plain message, without the note on the conversion
    for kw, message in ((dict(old_logprobs=nan), "old_logprobs contain NaN or inf where mask is set"),
                        (dict(advantages=nan[:, 1]), "advantages contain NaN or inf where mask is set")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            call(backend, **kw)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_flags_must_be_bools(backend):
    """``inplace="no"`` was truthy: the cpu / triton kernels wrote the gradient over the caller's logits. The flags
    take a bool (numpy's too); anything else raises on every backend."""
    np = pytest.importorskip("numpy")
    args = good()
    t, a, m = args["targets"], args["advantages"], args["mask"]
    logits = args["logits"].clone().requires_grad_(True)
    h, w = torch.randn(2, 3, 4), torch.randn(11, 4)
    for flag in ("inplace", "compute_entropy", "check_inputs"):
        with pytest.raises(ValueError, match=f"{flag} must be a bool, got 'no'"):
            fused_rl.policy_loss(logits * 1.0, t, a, m, backend=backend, **{flag: "no"})
    for flag in ("compute_entropy", "check_inputs"):
        with pytest.raises(ValueError, match=f"{flag} must be a bool, got None"):
            fused_rl.linear_policy_loss(h, w, t, a, m, backend=backend, **{flag: None})
    for flag in ("return_entropy", "check_inputs"):
        with pytest.raises(ValueError, match=f"{flag} must be a bool, got 1"):
            fused_rl.token_logprobs(logits, t, backend=backend, **{flag: 1})
        with pytest.raises(ValueError, match=f"{flag} must be a bool, got 1"):
            fused_rl.linear_token_logprobs(h, w, t, backend=backend, **{flag: 1})
    fused_rl.policy_loss(logits * 1.0, t, a, m, backend=backend, inplace=np.bool_(False), check_inputs=np.bool_(True))
    logp, entropy = fused_rl.token_logprobs(logits, t, backend=backend, return_entropy=np.bool_(True))
    assert entropy.shape == t.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_weights_are_checked_in_every_row_with_a_valid_token(backend):
    """A per-sequence ``(B,)`` ``rollout_is_weights`` entry is read where its row has a valid token, even a single
    one: a NaN there raises; in a row without one it is padding, neutral (the loss of any finite weight there)."""
    args = good()
    mask = args["mask"].clone()
    mask[0, 1:] = False
    with pytest.raises(ValueError, match="rollout_is_weights must be finite and >= 0 where mask is set"):
        fused_rl.policy_loss(args["logits"], args["targets"], args["advantages"], mask, backend=backend,
                             rollout_is_weights=torch.tensor([float("nan"), 1.0]))
    mask[1] = False
    got, want = (fused_rl.policy_loss(args["logits"], args["targets"], args["advantages"], mask, backend=backend,
                                      rollout_is_weights=torch.tensor([0.5, w])).loss for w in (float("nan"), 3.0))
    assert torch.isfinite(want) and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["reference"] + [b for b in fused_backends() if b in ("torch", "cpu")])
def test_fp16_finite_target_logit_is_finite_over_a_temperature(backend):
    """The on-policy -inf target check scales the target logit in fp32 (as the kernels do): fp16's ``finfo.min``
    over a temperature of 0.5 is -131008 there, not the fp16 overflow -inf, so it passes, with the log-probs of the
    fp32 ``log_softmax``."""
    args = good()
    logits = args["logits"].clone().half()
    logits[1, 2, args["targets"][1, 2]] = torch.finfo(torch.float16).min
    out = fused_rl.policy_loss(logits, args["targets"], args["advantages"], args["mask"], backend=backend,
                               config=PolicyLossConfig(temperature=0.5))
    want = torch.log_softmax(logits.float() / 0.5, -1).gather(-1, args["targets"].unsqueeze(-1)).squeeze(-1)
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.logprobs.float(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_number_normalizer_bounds_are_fp32_s(backend):
    """The Python-number normalizer bounds as numbers, not as ``validation.FP32_POSITIVE_FINITE`` itself: 3.5e38
    (above fp32's max, inf once cast) and 2^-150 (rounds to 0) raise; fp32's max 3.4e38 and 2^-149 pass."""
    for number in (3.5e38, 2.0 ** -150):
        with pytest.raises(ValueError, match="positive and finite in fp32"):
            call(backend, token_normalizer=number)
    for number in (3.4e38, 2.0 ** -149):
        call(backend, token_normalizer=number)


@pytest.mark.parametrize("backend", ["reference"] + fused_backends())
def test_per_token_weights_in_padding_are_not_read(backend):
    """``(B, T)`` rollout_is_weights at masked positions (and ignored targets) are padding: NaN or inf there gives
    the loss and gradient of any finite weight there (they are made neutral, so that ``A w`` stays finite)."""
    args = good(V=300)
    mask = args["mask"].clone()
    mask[0, 2] = mask[1, 0] = False
    targets = args["targets"].clone()
    targets[1, 1] = fused_rl.IGNORE_INDEX
    w = torch.rand(2, 3, generator=torch.Generator().manual_seed(3)) + 0.5
    results = []
    for pad in (2.0, float("nan"), float("inf")):
        weights = w.clone()
        weights[0, 2] = weights[1, 0] = weights[1, 1] = pad
        x = args["logits"].clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, targets, args["advantages"], mask, backend=backend, rollout_is_weights=weights)
        out.loss.backward()
        results.append((out.loss, x.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
    assert torch.isfinite(results[0][0]) and results[0][1].abs().sum() > 0


def test_out_of_range_targets_of_a_truncated_row_are_refused():
    """With ``mask_truncated_completions`` a truncated row leaves the loss, but a target outside the vocabulary where
    ``mask`` is set is still a bad input (a wrong tokenizer, say), refused as in any other row."""
    args = good()
    targets = args["targets"].clone()
    targets[1, 2] = 11
    with pytest.raises(ValueError, match=r"targets must be in \[0, 11\)"):
        fused_rl.policy_loss(args["logits"], targets, args["advantages"], args["mask"], backend="reference",
                             truncated=torch.tensor([False, True]),
                             config=PolicyLossConfig(mask_truncated_completions=True))


def test_auto_on_cuda_prefers_triton_then_cuda_then_torch(monkeypatch):
    """``AUTO_ORDER`` on a CUDA device, as on a GPU machine (every backend's device check passing): triton first,
    the native CUDA kernels without triton, torch without either or for a dtype neither takes (fp64)."""
    from fused_rl.backends import _REGISTRY, get_backend

    if "triton" not in _REGISTRY or "cuda" not in _REGISTRY:
        pytest.skip("needs both optional backends registered")
    reasons = {"triton": None, "cuda": None}
    for name in reasons:
        monkeypatch.setattr(_REGISTRY[name], "unavailable_reason", lambda device, name=name: reasons[name])
    cuda = torch.device("cuda")
    assert get_backend("auto", cuda, torch.bfloat16).name == "triton"
    assert get_backend("auto", cuda, torch.float32, linear=True).name == "triton"
    assert get_backend("auto", cuda, torch.float64).name == "torch"
    reasons["triton"] = "no triton here"
    assert get_backend("auto", cuda, torch.float16).name == "cuda"
    reasons["cuda"] = "no native build"
    assert get_backend("auto", cuda, torch.float32).name == "torch"


def test_auto_on_a_device_type_without_an_order_takes_torch():
    """A device type ``AUTO_ORDER`` does not list (an Apple or Intel GPU) gets the portable torch backend, never the
    slow reference."""
    from fused_rl.backends import get_backend

    for kind in ("mps", "xpu"):
        assert get_backend("auto", torch.device(kind), torch.float32).name == "torch"
        assert get_backend("auto", torch.device(kind), torch.float32, linear=True).name == "torch"


def test_an_installation_without_an_optional_backend_module_still_imports():
    """A build that ships without ``fused_rl.backends.native`` (or triton's module): ``import fused_rl`` works and
    the missing backends say they are not built in."""
    code = (
        "import sys\n"
        "sys.modules['fused_rl.backends.native'] = None  # the module itself is absent\n"
        "sys.modules['fused_rl.backends.triton'] = None\n"
        "import torch, fused_rl\n"
        "r = fused_rl.available_backends('cpu')\n"
        "assert r['reference'] is None and r['torch'] is None, r\n"
        "for name in ('triton', 'cpu', 'cuda'):\n"
        "    assert 'not built into this installation' in r[name], r\n"
        "assert fused_rl.backends.get_backend('auto', torch.device('cpu'), torch.float32).name == 'torch'\n"
        "print('OK')\n"
    )
    res = run_python(code)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]


def test_available_backends_lists_every_backend_name():
    reasons = fused_rl.available_backends(torch.device("cpu"))
    assert set(reasons) == {"reference", "torch", "triton", "cpu", "cuda"}
    assert reasons["reference"] is None and reasons["torch"] is None


def test_rows_sharing_memory_are_fine_out_of_place():
    """Only ``inplace=True`` needs disjoint rows: an ``expand``-ed batch (one sequence's logits scored for several
    advantages) runs out of place, with the values of its contiguous copy."""
    args = good()
    x = args["logits"][:1].expand(2, 3, 11)
    for backend in BACKENDS:
        out = fused_rl.policy_loss(x, args["targets"], args["advantages"], args["mask"], backend=backend)
        want = fused_rl.policy_loss(x.contiguous(), args["targets"], args["advantages"], args["mask"], backend=backend)
        torch.testing.assert_close(out.loss, want.loss)


def test_linear_operands_of_another_shape_device_or_dtype_are_refused_by_name():
    h, w = torch.randn(2, 3, 4), torch.randn(7, 4)
    t, a, m = torch.zeros(2, 3, dtype=torch.long), torch.ones(2), torch.ones(2, 3)
    for fn, extra in ((fused_rl.reference.linear_policy_loss, (a, m)), (fused_rl.reference.linear_token_logprobs, ())):
        with pytest.raises(ValueError, match=r"weight must have shape \(V, H=4\), got \(0, 4\)"):
            fn(h, torch.randn(0, 4), t, *extra)
        with pytest.raises(ValueError, match="weight is on meta but hidden is on cpu"):
            fn(h, w.to("meta"), t, *extra)
        with pytest.raises(ValueError, match="bias must have the dtype and device of hidden"):
            fn(h, w, t, *extra, bias=torch.zeros(7, dtype=torch.float64))
        with pytest.raises(ValueError, match="bias must have the dtype and device of hidden"):
            fn(h, w, t, *extra, bias=torch.zeros(7, device="meta"))


def test_reference_functions_keep_the_public_names_docs_and_signatures():
    import inspect

    for name in fused_rl.reference.__all__:
        fn, op = getattr(fused_rl.reference, name), getattr(fused_rl.ops, name)
        assert fn.__name__ == name and fn.__doc__ == op.__doc__ and fn.__doc__
        assert inspect.signature(fn) == inspect.signature(op)


def test_a_backend_without_the_fused_linear_operations_is_refused_for_them(monkeypatch):
    """A registered backend that implements ``token_logprobs`` only (``has_linear`` False): named for a fused-linear
    call it raises saying so; ``auto`` passes it over."""
    from fused_rl.backends import _REGISTRY, Backend, get_backend

    class TokenOnly(Backend):
        name = "torch"

    monkeypatch.setitem(_REGISTRY, "torch", TokenOnly())
    cpu = torch.device("cpu")
    assert get_backend("torch", cpu, torch.float32).name == "torch"
    with pytest.raises(NotImplementedError, match="no fused-linear implementation"):
        get_backend("torch", cpu, torch.float32, linear=True)
    with pytest.raises(NotImplementedError, match="no fused-linear implementation"):
        get_backend("auto", torch.device("mps"), torch.float32, linear=True)


def test_linear_token_logprobs_rejects():
    h, w = torch.randn(2, 3, 4), torch.randn(7, 4)
    fn = fused_rl.reference.linear_token_logprobs
    with pytest.raises(ValueError, match=r"targets must be in \[0, 7\) or -100"):
        fn(h, w, torch.full((2, 3), 7))
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 3\)"):
        fn(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be an int32 or int64 tensor"):
        fn(h, w, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="temperature"):
        fn(h, w, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    t32 = torch.tensor([[6, 0, 3], [1, 5, 2]], dtype=torch.int32)  # int32 targets are fine
    torch.testing.assert_close(fn(h, w, t32), fn(h, w, t32.long()), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["token_logprobs", "policy_loss", "linear_token_logprobs", "linear_policy_loss"])
def test_the_default_backend_is_auto(name, monkeypatch):
    """Without ``backend=`` each public function asks ``AUTO_ORDER`` (here made to name the reference)."""
    from fused_rl.backends import AUTO_ORDER, reference as reference_backend

    calls = []
    original = getattr(reference_backend.ReferenceBackend, name)
    monkeypatch.setattr(reference_backend.ReferenceBackend, name,
                        lambda self, *a, **k: calls.append(name) or original(self, *a, **k))
    monkeypatch.setitem(AUTO_ORDER, "cpu", ("reference",))
    args = good()
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    t, a, m = args["targets"], args["advantages"], args["mask"]
    {"token_logprobs": lambda: fused_rl.token_logprobs(args["logits"], t),
     "policy_loss": lambda: fused_rl.policy_loss(args["logits"], t, a, m),
     "linear_token_logprobs": lambda: fused_rl.linear_token_logprobs(h, w, t),
     "linear_policy_loss": lambda: fused_rl.linear_policy_loss(h, w, t, a, m)}[name]()
    assert calls == [name]
