"""The bundled trainer's PPO path against independent, straightforward computations: GAE over the completion
tokens with the sequence reward on the last one, advantage whitening over the loss tokens, the clipped value
loss (``0.5 max((V - R)^2, (V_clip - R)^2)``, token mean over the minibatch, times ``vf_coef``) and the value
head's shift convention (the value at target ``t`` is read from the hidden state that predicts token ``t``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fused_rl.train.config import load_config

SMALL_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def small(tmp_path, **kw):
    base = dict(run_dir=str(tmp_path / "run"), steps=4, warmup_steps=0, prompts_per_step=4, group_size=4,
                max_new_tokens=4, threads=1, progress=False, plot=False, eval_every=0, backend="auto",
                algorithm="ppo", model_config=dict(SMALL_MODEL))
    base.update(kw)
    return load_config(None, [], **base)


def trainer(tmp_path, **kw):
    from fused_rl.train.trainer import Trainer

    return Trainer(small(tmp_path, **kw), quiet=True)


# ---------------------------------------------------------------------------------------------- references
def reference_gae(rewards, values, mask, gamma, lam):
    """Per row, a plain loop over the valid positions only: the reward on the last one, V after it 0."""
    adv = torch.zeros(values.shape, dtype=torch.float64)
    for i in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if mask[i, t]]
        a, next_v = 0.0, 0.0
        for k, t in enumerate(reversed(idx)):
            r = float(rewards[i]) if k == 0 else 0.0
            delta = r + gamma * next_v - float(values[i, t])
            a = delta + gamma * lam * a
            adv[i, t] = a
            next_v = float(values[i, t])
    returns = torch.where(mask, adv + values.double(), torch.zeros_like(adv))
    return adv, returns


def reference_whiten(adv, mask):
    x = adv[mask]
    mean, std = x.mean(), x.std(unbiased=False)
    return torch.where(mask, (adv - mean) / (std + 1e-8), torch.zeros_like(adv))


# ---------------------------------------------------------------------------------------------- GAE
def test_gae_hand_numbers():
    """gamma = lam = 1: A_t = R - V_t and the returns are R on every valid token; gamma = 0.5, lam = 0.5 on
    three tokens with V = [0.5, 0.25, 0], R = 1: delta = [0.5 * 0.25 - 0.5, 0.5 * 0 - 0.25, 1] =
    [-0.375, -0.25, 1], A_2 = 1, A_1 = -0.25 + 0.25 = 0, A_0 = -0.375 + 0 = -0.375."""
    from fused_rl.advantages import gae

    v = torch.tensor([[0.5, 0.25, 0.0, 9.0]])
    m = torch.tensor([[True, True, True, False]])
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.375, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 1.0, 0.0]]))


@pytest.mark.parametrize("gamma, lam, mask_truncated", [(1.0, 0.95, False), (0.9, 0.7, False), (0.8, 0.5, True)])
def test_trainer_advantages_match_an_independent_gae_and_whitening(tmp_path, gamma, lam, mask_truncated):
    """``Trainer.advantages``: the sequence reward on the last loss token (EOS or, kept truncated, the last one),
    no bootstrap after it, returns = GAE + V before whitening, advantages whitened with the masked mean and std;
    with ``mask_truncated_completions`` the truncated rows take no part (zero advantages and returns)."""
    kw = dict(loss_options=dict(mask_truncated_completions=True)) if mask_truncated else {}
    t = trainer(tmp_path, gamma=gamma, lam=lam, truncation="none", **kw)
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0],   # EOS at 2
                         [1, 1, 1, 1, 1, 1],   # truncated
                         [1, 0, 0, 0, 0, 0],   # EOS first
                         [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    truncated = torch.tensor([False, True, False, False])
    batch = SimpleNamespace(mask=mask, truncated=truncated, rewards=torch.tensor([1.0, -0.5, 0.25, 2.0]),
                            lengths=mask.sum(1))
    values = torch.randn(4, 6, generator=gen)
    adv, returns = t.advantages(batch, values)
    kept = mask & ~truncated.unsqueeze(1) if mask_truncated else mask
    ref_adv, ref_ret = reference_gae(batch.rewards, values, kept, gamma, lam)
    torch.testing.assert_close(returns.double(), ref_ret, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv.double(), reference_whiten(ref_adv, kept), atol=1e-5, rtol=1e-5)
    assert float(adv[kept].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv[kept].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("reward", [0.1, -0.1, 7.7])
@pytest.mark.parametrize("rows, width", [(16, 4), (512, 64)])
def test_equal_advantages_whiten_to_zero(tmp_path, reward, rows, width):
    """Advantages with no spread (gamma = lam = 1, the zero-initialised head's V = 0, every completion the same
    reward, e.g. all truncated under ``truncation: penalize``) have std 0 and whiten to 0. The whitening's sums
    were float32: the mean came out one ulp off the advantages (7.7 + 4.8e-7), the variance 0, and the ulp
    divided by ``0 + 1e-8`` gave advantages up to 47 of one sign on every token."""
    t = trainer(tmp_path, gamma=1.0, lam=1.0)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[0, 2:] = False  # an early EOS: still the same advantage on each valid token
    batch = SimpleNamespace(mask=mask, truncated=torch.zeros(rows, dtype=torch.bool),
                            rewards=torch.full((rows,), reward), lengths=mask.sum(1))
    adv, returns = t.advantages(batch, torch.zeros(rows, width))
    assert float(adv.abs().max()) < 1e-6
    torch.testing.assert_close(returns, torch.where(mask, reward, 0.0))


# ---------------------------------------------------------------------------------------------- value head
def hidden(t, batch):
    """The base model's last hidden state at the positions predicting the completion tokens, computed here."""
    out = t.policy.lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids, use_cache=False)
    return out.last_hidden_state[:, batch.prompt_len - 1:-1]


def test_value_at_token_t_is_read_before_token_t(tmp_path):
    """The rollout's values are the head on the hidden state that predicts token ``t`` (TRL's
    ``value[:, context_length - 1:-1]``): V_t does not depend on token t itself, V_{t+1} does."""
    t = trainer(tmp_path)
    torch.nn.init.normal_(t.policy.value_head.weight)
    torch.manual_seed(0)
    batch = t.collect()
    _, values = t._logprobs(t.policy, batch, with_values=True)
    head = t.policy.value_head
    with torch.no_grad():
        expect = (hidden(t, batch) @ head.weight.T + head.bias).squeeze(-1)
        torch.testing.assert_close(values, expect, atol=1e-5, rtol=1e-5)
        ids = batch.input_ids.clone()
        P = batch.prompt_len
        ids[:, P + 1] = (ids[:, P + 1] + 1 - 3) % (len(t.tokenizer) - 3) + 3  # another character
        changed = SimpleNamespace(**{**vars(batch), "input_ids": ids, "targets": ids[:, P:]})
        _, v2 = t._logprobs(t.policy, changed, with_values=True)
    torch.testing.assert_close(v2[:, :2], values[:, :2])
    assert (v2[:, 2] - values[:, 2]).abs().max() > 1e-4


@pytest.mark.parametrize("offset, micro", [(0.0, 0), (0.5, 4), (-0.3, 8)])
def test_value_loss_gradient_and_metric_match_an_independent_computation(tmp_path, offset, micro):
    """With zero advantages the policy loss has no gradient, so the update's gradient is ``vf_coef`` times the
    gradient of ``0.5 mean_tokens max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)``, V_old the
    rollout's values (shifted here by ``offset`` so that clipping bites), over the backbone too (the head shares
    it), accumulated over micro-batches to the minibatch's token mean; ``value_loss`` logs its value."""
    vf_coef, clip = 0.3, 0.2
    t = trainer(tmp_path, vf_coef=vf_coef, value_clip=clip, max_grad_norm=0.0, micro_batch_size=micro,
                truncation="none")
    torch.nn.init.normal_(t.policy.value_head.weight, std=0.5)
    t.optimizer.step = lambda: None
    torch.manual_seed(0)
    batch = t.collect()
    returns = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))
    returns = torch.where(batch.mask, returns, torch.zeros_like(returns))
    t.advantages = lambda b, v: (torch.zeros(b.mask.shape), returns)
    logprobs = t._logprobs
    t._logprobs = lambda module, b, with_values=False: (
        (lambda lp, v: (lp, None if v is None else v + offset))(*logprobs(module, b, with_values)))
    metrics = t.update(batch)
    got = {n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None}

    t.policy.zero_grad(set_to_none=True)
    head = t.policy.value_head
    v = (hidden(t, batch) @ head.weight.T + head.bias).squeeze(-1)
    v_old = v.detach() + offset
    v_clip = v_old + (v - v_old).clamp(-clip, clip)
    m = batch.mask
    per_token = 0.5 * torch.maximum((v - returns) ** 2, (v_clip - returns) ** 2)
    loss = vf_coef * per_token[m].sum() / m.sum()
    loss.backward()
    want = {n: p.grad for n, p in t.policy.named_parameters() if p.grad is not None}
    assert any(n.startswith("lm.model.layers") for n in want)
    for n, g in want.items():
        torch.testing.assert_close(got.get(n, torch.zeros_like(g)), g, atol=1e-6, rtol=1e-4, msg=n)
    assert metrics["value_loss"] == pytest.approx(loss.item() / vf_coef, rel=1e-5)
    if offset:
        frac = float(((v_clip - returns) ** 2 > (v - returns) ** 2)[m].float().mean())
        assert 0.0 < metrics["value_clip_frac"] == pytest.approx(frac, abs=1e-6)


def test_update_gradient_is_policy_token_mean_plus_vf_coef_times_value_loss(tmp_path):
    """One full-batch update (ratio 1, so nothing clips): the gradient is that of
    ``-mean_tokens(A_t exp(logp_t - sg(logp_t))) + vf_coef * 0.5 mean_tokens (V_t - R_t)^2`` with ``A`` and
    ``R`` from an independent GAE of the rollout's values and the log-probs at the sampling temperature; EOS
    ended and truncated rows (``truncation: none``, no bootstrap) mixed."""
    vf_coef, gamma, lam, temperature = 0.7, 0.9, 0.8, 0.7
    t = trainer(tmp_path, vf_coef=vf_coef, gamma=gamma, lam=lam, temperature=temperature, max_grad_norm=0.0,
                truncation="none", max_new_tokens=6, task_args={"min_digits": 1, "max_digits": 5})
    torch.nn.init.normal_(t.policy.value_head.weight, std=0.5)
    t.optimizer.step = lambda: None
    torch.manual_seed(0)
    batch = t.collect()
    assert 0 < int(batch.truncated.sum()) < len(batch.truncated)
    metrics = t.update(batch)
    got = {n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None}

    t.policy.zero_grad(set_to_none=True)
    m = batch.mask
    h = hidden(t, batch)
    head = t.policy.value_head
    v = (h @ head.weight.T + head.bias).squeeze(-1)
    ref_adv, returns = reference_gae(batch.rewards, v.detach(), m, gamma, lam)
    adv = reference_whiten(ref_adv, m).float()
    logits = (h @ t.policy.lm_head.weight.T) / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    policy = -(adv * torch.exp(logp - logp.detach()))[m].sum() / m.sum()
    value = 0.5 * ((v - returns.float()) ** 2)[m].sum() / m.sum()
    (policy + vf_coef * value).backward()
    for n, p in t.policy.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)
    assert metrics["value_loss"] == pytest.approx(value.item(), rel=1e-5)
    assert metrics["loss"] == pytest.approx(policy.item(), abs=1e-5)


def test_minibatch_updates_clip_around_the_rollout_values(tmp_path):
    """``num_iterations = 2`` epochs of shuffled minibatches of 4 of the 16 sequences, real AdamW steps: every
    step's gradient is ``vf_coef`` times that of the clipped value loss on its rows, normalised by their token
    count, with V_old the values before the first step (not the previous minibatch's); ``value_loss`` is the
    mean over the steps and ``value_clip_frac`` the clipped share of all trained tokens."""
    from fused_rl.train.config import SEED_LIMIT

    vf_coef, clip, mb = 0.5, 0.05, 4
    t = trainer(tmp_path, vf_coef=vf_coef, value_clip=clip, max_grad_norm=0.0, minibatch_size=mb, num_iterations=2,
                micro_batch_size=2, lr=3e-2, truncation="none", seed=3)
    torch.nn.init.normal_(t.policy.value_head.weight, std=0.5)
    torch.manual_seed(0)
    batch = t.collect()
    n = batch.mask.shape[0]
    v_old = t._logprobs(t.policy, batch, with_values=True)[1]
    returns = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))
    returns = torch.where(batch.mask, returns, torch.zeros_like(returns))
    t.advantages = lambda b, v: (torch.zeros(b.mask.shape), returns)
    steps, real_step = [], t.optimizer.step
    t.optimizer.step = lambda: (steps.append(({k: x.clone() for k, x in t.policy.state_dict().items()},
                                              {k: p.grad.clone() for k, p in t.policy.named_parameters()
                                               if p.grad is not None})), real_step())[-1]
    metrics = t.update(batch)
    gen = torch.Generator().manual_seed((t.cfg.seed * 1_000_003 + 0 * 101 + 0) % SEED_LIMIT)
    orders = [torch.randperm(n, generator=gen) for _ in range(2)]
    rows = [order[s:s + mb] for order in orders for s in range(0, n, mb)]
    assert len(steps) == len(rows) == 8
    losses, clipped, tokens = [], 0, 0
    for (state, got), idx in zip(steps, rows):
        t.policy.load_state_dict(state)
        t.policy.zero_grad(set_to_none=True)
        sub = batch.select(idx)
        head = t.policy.value_head
        v = (hidden(t, sub) @ head.weight.T + head.bias).squeeze(-1)
        old, r, m = v_old[idx], returns[idx], sub.mask
        v_clip = old + (v - old).clamp(-clip, clip)
        per_token = torch.maximum((v - r) ** 2, (v_clip - r) ** 2)
        loss = vf_coef * 0.5 * per_token[m].sum() / m.sum()
        loss.backward()
        for name, p in t.policy.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(got.get(name, torch.zeros_like(p.grad)), p.grad, atol=1e-6, rtol=1e-4,
                                           msg=name)
        losses.append(loss.item() / vf_coef)
        clipped += int(((v_clip - r) ** 2 > (v - r) ** 2)[m].sum())
        tokens += int(m.sum())
    assert clipped > 0
    assert metrics["value_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert metrics["value_clip_frac"] == pytest.approx(clipped / tokens, abs=1e-6)


def test_reference_model_is_the_start_lm_without_a_value_head(tmp_path):
    """With ``beta > 0`` the frozen reference is a copy of the initial LM (equal weights, no gradient) and carries
    no value head: only the policy's is trained and read."""
    t = trainer(tmp_path, beta=0.05)
    assert t.policy.value_head is not None and t.ref.value_head is None
    ref, policy = dict(t.ref.named_parameters()), dict(t.policy.named_parameters())
    assert set(ref) == {name for name in policy if not name.startswith("value_head.")}
    for name, p in ref.items():
        assert not p.requires_grad and p.data_ptr() != policy[name].data_ptr()
        torch.testing.assert_close(p, policy[name], atol=0, rtol=0)
    assert t.ref.compute_dtype == t.policy.compute_dtype and not t.ref.training


def test_advantages_of_no_spread_whiten_to_zero(tmp_path):
    """Equal GAE advantages (gamma = lam = 1, V = 0: A = R = 0.1 on each of 53 tokens) whiten to exactly 0: their
    float64 variance ``E[A^2] - mean^2`` comes out -1.7e-18 there, clamped to 0 (its square root was NaN on every
    token) (mutation audit)."""
    t = trainer(tmp_path, gamma=1.0, lam=1.0)
    batch = SimpleNamespace(rewards=torch.tensor([0.1]), mask=torch.ones(1, 53, dtype=torch.bool),
                            truncated=torch.zeros(1, dtype=torch.bool))
    adv, returns = t.advantages(batch, torch.zeros(1, 53))
    assert torch.equal(adv, torch.zeros(1, 53))
    torch.testing.assert_close(returns, torch.full((1, 53), 0.1))
