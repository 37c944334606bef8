"""The chunked torch backend against the reference."""

import pytest
import torch

import fused_rl
from fused_rl.backends import torch_chunked
from helpers import (CONFIGS, LOGIT_KINDS, assert_close, check_token_logprobs_inplace, compare_policy_loss, make_case,
                     make_logits)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}")
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_matches_reference(config, kind, dtype):
    compare_policy_loss("torch", make_case(vocab=1000, kind=kind, dtype=dtype, seed=3), config)


def test_small_chunks_and_sliced_logits(monkeypatch):
    """Chunk boundaries inside a sequence and a non-contiguous (B, T-1, V) view of HF-style logits."""
    monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", 3 * 4099)
    case = make_case(batch=3, length=7, vocab=4099, seed=5)
    full = make_logits((3, 8, 4099), generator=torch.Generator().manual_seed(1))
    case.logits = full[:, :-1]
    assert not case.logits.is_contiguous()
    compare_policy_loss("torch", case, CONFIGS[1])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_grad_of_both_outputs(temperature):
    g = torch.Generator().manual_seed(2)
    x = make_logits((2, 5, 333), "peaked", generator=g)
    t = torch.randint(0, 333, (2, 5), generator=g)
    t[0, 0] = fused_rl.IGNORE_INDEX
    wl, we = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    results = {}
    for backend in ("reference", "torch"):
        xb = x.clone().requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xb, t, temperature=temperature, return_entropy=True, backend=backend)
        ((lp * wl).sum() + (ent * we).sum()).backward()
        results[backend] = (lp, ent, xb.grad)
    for a, b, what in zip(results["torch"], results["reference"], ("logp", "entropy", "grad")):
        assert_close(a, b, torch.float32, what, grad=what == "grad")
    assert results["torch"][0][0, 0] == 0 and results["torch"][2][0, 0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 1000), (7, 4099), (2, 2, 3, 257)], ids=str)
def test_token_logprobs_inplace(monkeypatch, dtype, shape):
    """The chunked backward written over the logits, chunk by chunk (3-row chunks: the gradient of a chunk formed
    before it is stored over it)."""
    monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", 3 * shape[-1])
    check_token_logprobs_inplace("torch", shape, dtype)


@pytest.mark.parametrize("layout", ["slice", "transpose", "4d"])
def test_token_logprobs_inplace_over_a_non_flat_view(monkeypatch, layout):
    """Non-flat logits (a slice ``full[:, :-1]`` of a model output, a transpose, a 4-D slice: no ``(-1, V)`` view,
    the ``_row_blocks`` fallback; 2-row chunks): each chunk's gradient is written over the logits' own rows, not over
    a copy of them, so the leaf gets the out-of-place gradient bit for bit, the logits hold it, and the rest of the
    buffer they slice is untouched."""
    monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", 2 * 64)
    view, shape = {"slice": (lambda b: b[:, :-1], (3, 6, 64)), "transpose": (lambda b: b.transpose(0, 1), (4, 3, 64)),
                   "4d": (lambda b: b[:, :, 1:], (2, 3, 4, 64))}[layout]
    g = torch.Generator().manual_seed(7)
    x0 = make_logits(shape, kind="peaked", generator=g)
    targets = torch.randint(0, 64, view(x0).shape[:-1], generator=g)
    targets.view(-1)[1] = fused_rl.IGNORE_INDEX
    g_logp, g_ent = (torch.randn(targets.shape, generator=g) for _ in range(2))
    grads = []
    for inplace in (False, True):
        leaf = x0.clone().requires_grad_(True)
        full = leaf * 1
        logits = view(full)
        logp, ent = fused_rl.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend="torch",
                                            inplace=inplace)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[1], grads[0])
    assert torch.equal(logits.detach(), view(grads[0]))  # written over the logits' rows
    untouched = torch.ones(shape, dtype=torch.bool)
    view(untouched).fill_(False)
    assert torch.equal(full.detach()[untouched], x0[untouched])


def test_policy_loss_inplace_two_passes():
    """The torch backend's policy loss (two passes for every config) writes its gradient over non-leaf logits in
    the backward with ``inplace=True``: the out-of-place gradient, bit for bit."""
    from test_native import _check_inplace

    _check_inplace("torch", make_case(batch=3, length=6, vocab=1000, seed=2), CONFIGS[1])


def test_row_blocks_of_a_non_flat_view_are_views():
    """``token_logprobs`` takes ``(..., V)`` logits: a 4-D (or higher) view that cannot be flattened was copied
    whole (``reshape``) in the forward and again in the backward; its row blocks are views now, in row-major
    order with the right first-row indices, and the results are the contiguous input's."""
    g = torch.Generator().manual_seed(6)
    base = torch.randn(3, 2, 4, 5, 37, generator=g)
    x = base.transpose(0, 1)[:, :, 1:]  # (2, 3, 3, 5, 37): no (-1, V) view
    blocks = list(torch_chunked._row_blocks(x))
    assert len(blocks) > 1
    assert all(b.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for _, b in blocks)
    firsts = [first for first, _ in blocks]
    assert firsts == [sum(b.shape[0] for _, b in blocks[:i]) for i in range(len(blocks))]
    torch.testing.assert_close(torch.cat([b for _, b in blocks]), x.reshape(-1, 37), atol=0, rtol=0)
    t = torch.randint(0, 37, x.shape[:-1], generator=g)
    got, want = (fused_rl.token_logprobs(y, t, return_entropy=True, backend="torch") for y in (x, x.contiguous()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (2, 3), generator=g)

    def f(x):
        lp, ent = fused_rl.token_logprobs(x, t, temperature=0.8, return_entropy=True, backend="torch")
        return lp, ent

    assert torch.autograd.gradcheck(f, (x,))


def test_compile_fullgraph():
    case = make_case(vocab=257, seed=4)
    cfg = CONFIGS[1]

    def loss_fn(logits):
        return fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=cfg,
                                    backend="torch", check_inputs=False, **case.kwargs()).loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    loss_fn(x1).backward()
    compiled(x2).backward()
    torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_compile_fullgraph_top_entropy_quantile(backend):
    """The batch quantile of the entropies is read with a tensor index: no data-dependent int, so the
    batch-level config traces in one graph too."""
    if backend not in fused_rl.available_backends(torch.device("cpu")) or \
            fused_rl.available_backends(torch.device("cpu"))[backend] is not None:
        pytest.skip(f"{backend} unavailable")
    case = make_case(vocab=257, seed=5)
    cfg = fused_rl.PolicyLossConfig(top_entropy_quantile=0.3)

    def loss_fn(logits):
        return fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=cfg,
                                    backend=backend, check_inputs=False).loss

    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    loss_fn(x1).backward()
    torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(x2).backward()
    torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_compile_fullgraph_bias_corrected_kl(backend, policy):
    """The bias-corrected KL's autograd Function traces in one graph (Dynamo refuses one with a custom ``jvp``:
    the forward-mode subclass is used only outside ``torch.compile``) and matches eager."""
    if fused_rl.available_backends(torch.device("cpu")).get(backend, "missing") is not None:
        pytest.skip(f"{backend} unavailable")
    case = make_case(vocab=257, seed=6)
    cfg = fused_rl.PolicyLossConfig(policy_loss=policy, kl="k3", beta=0.2, kl_bias_correction=True)

    def loss_fn(logits):
        return fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=cfg,
                                    backend=backend, check_inputs=False, **case.kwargs()).loss

    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    loss_fn(x1).backward()
    torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(x2).backward()
    torch.testing.assert_close(x2.grad, x1.grad)


def test_policy_loss_returns_the_entropy_by_default():
    """``compute_entropy`` defaults to True: the output's entropy and its mean metric are there without asking."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 50, generator=g)
    t = torch.randint(0, 50, (2, 3), generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = fused_rl.policy_loss(x, t, torch.tensor([1.0, -1.0]), mask, backend="torch")
    assert out.entropy is not None
    want = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    torch.testing.assert_close(out.entropy, want, rtol=1e-5, atol=1e-6)
