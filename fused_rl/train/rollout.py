"""Rollouts: sample ``G`` completions per prompt with ``model.generate`` and score them.

Layout of a rollout batch of ``N = prompts * G`` sequences (samples of one prompt are consecutive):
``input_ids (N, P + T)`` = left-padded prompt (``P``) + completion right-padded to
``T = max_new_tokens``; ``targets = input_ids[:, P:]``; ``mask (N, T)`` marks completion tokens up to and
including the first EOS (``truncation="mask"``: without the truncated rows). A completion with no EOS within
``max_new_tokens`` is *truncated*.
With ``sampler_logprobs=True`` the rollout keeps the log-probs of the sampled tokens under the distribution
they were drawn from (the logits after ``generate``'s temperature and top-p warpers), which the loss's
rollout correction (``rollout_is``, ``off_policy_mask``) compares with the training forward's. They are
gathered step by step (:class:`SamplerLogprobs`), never stored as ``(N, T, V)`` scores, and are 0 wherever
``mask`` is False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .tasks import RewardFunctionError, batch_fields, call_reward


class SamplerLogprobs:
    """A ``generate`` logits processor that returns the logits unchanged and records, per step,
    ``log_softmax`` of them after the sampling warpers ``generate`` applies next (HF's own
    ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``, top-k off, as :func:`generate` samples); the
    log-prob of the token drawn from a step is gathered at the next step (and by :meth:`finish` for the
    last), so one ``(N, V)`` row block is alive at a time."""

    def __init__(self, temperature: float, top_p: float):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                           + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
        self.pending: Optional[torch.Tensor] = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(self.warpers(input_ids, scores.float().clone()), -1)
        return scores

    def finish(self, generated: torch.Tensor, length: int) -> torch.Tensor:
        """``(N, length)`` fp32 log-probs of the ``generated (N, steps)`` tokens, 0 past them."""
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, generated[:, len(self.steps):len(self.steps) + 1]).squeeze(-1))
            self.pending = None
        out = torch.zeros((generated.shape[0], length), dtype=torch.float32, device=generated.device)
        if self.steps:
            out[:, :len(self.steps)] = torch.stack(self.steps, 1)
        return out


@dataclass
class Rollout:
    input_ids: torch.Tensor  # (N, P + T)
    attention_mask: torch.Tensor  # (N, P + T)
    position_ids: torch.Tensor  # (N, P + T)
    prompt_len: int
    targets: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T) bool
    truncated: torch.Tensor  # (N,) bool
    rewards: torch.Tensor  # (N,) fp32, final reward (after truncation penalty)
    lengths: torch.Tensor  # (N,) completion tokens including the EOS (before truncation masking)
    prompts: list = field(default_factory=list)
    completions: list = field(default_factory=list)
    reward_parts: dict = field(default_factory=dict)  # reward name -> (N,) tensor
    sampler_logprobs: Optional[torch.Tensor] = None  # (N, T) fp32, 0 where ``mask`` is False (module docstring)

    def select(self, idx: torch.Tensor) -> "Rollout":
        """The sub-batch of rows ``idx`` (tensors only; text lists follow)."""
        il = idx.tolist()
        return Rollout(self.input_ids[idx], self.attention_mask[idx], self.position_ids[idx], self.prompt_len,
                       self.targets[idx], self.mask[idx], self.truncated[idx], self.rewards[idx], self.lengths[idx],
                       [self.prompts[i] for i in il] if self.prompts else [],
                       [self.completions[i] for i in il] if self.completions else [],
                       {k: v[idx] for k, v in self.reward_parts.items()},
                       None if self.sampler_logprobs is None else self.sampler_logprobs[idx])


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        attn[i, width - len(s):] = 1
    return ids.to(device), attn.to(device)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, group_size: int, max_new_tokens: int, temperature: float,
             top_p: float, greedy: bool = False, sampler_logprobs: bool = False, device=None):
    """``(input_ids, attention_mask, prompt_len, completion ids (N, T), mask (N, T), truncated (N,),
    sampler log-probs (N, T) or None)``."""
    device = device or next(model.parameters()).device
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    encoded = [e for e in encoded for _ in range(group_size)]
    prompt_ids, prompt_attn = left_pad(encoded, tokenizer.pad_token_id, device)
    from transformers import GenerationConfig, LogitsProcessorList

    # Sampling must be exactly softmax(top_p(logits / temperature)), what SamplerLogprobs records and the
    # loss assumes. generate() fills every field our config leaves unset from model.generation_config (a
    # checkpoint's repetition_penalty, no_repeat_ngram_size, min_p, suppress_tokens, ...), so that is
    # swapped for a default one during the call.
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    stop = list(tokenizer.stop_token_ids)
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=stop, use_cache=True, **sampling)
    recorder = SamplerLogprobs(temperature, top_p) if sampler_logprobs and not greedy else None
    was_training, model_config = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_attn, generation_config=config,
                             logits_processor=LogitsProcessorList([recorder] if recorder is not None else []))
    finally:
        model.generation_config = model_config
        model.train(was_training)
    P = prompt_ids.shape[1]
    comp = out[:, P:]
    if comp.shape[1] < max_new_tokens:
        pad = torch.full((comp.shape[0], max_new_tokens - comp.shape[1]), tokenizer.pad_token_id,
                         dtype=comp.dtype, device=comp.device)
        comp = torch.cat([comp, pad], 1)
    is_eos = torch.isin(comp, torch.tensor(stop, dtype=comp.dtype, device=comp.device))
    # mask: positions up to and including the first stop token (everything when there is none)
    after_first_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    mask = ~after_first_eos
    truncated = ~is_eos.any(1)
    comp = torch.where(mask, comp, torch.full_like(comp, tokenizer.pad_token_id))
    logprobs = None
    if recorder is not None:
        logprobs = recorder.finish(out[:, P:], max_new_tokens)
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    return prompt_ids, prompt_attn, P, comp, mask, truncated, logprobs


def decode_completions(tokenizer, comp: torch.Tensor, mask: torch.Tensor) -> list[str]:
    texts = []
    for row, m in zip(comp.tolist(), mask.tolist()):
        ids = [t for t, keep in zip(row, m) if keep and t not in tokenizer.stop_token_ids]
        texts.append(tokenizer.decode(ids))
    return texts


def score(reward_fns: list, weights: list[float], prompts: list[str], completions: list[str],
          batch: dict) -> tuple[torch.Tensor, dict]:
    """``(the weighted sum of the rewards (N,) float32, {reward name: its (N,) values})``; a weighted sum that
    overflows float32 raises :class:`RewardFunctionError` naming the reward that made it."""
    total = torch.zeros(len(completions), dtype=torch.float32)
    parts = {}
    for (name, fn), w in zip(reward_fns, weights):
        values = call_reward(name, fn, prompts, completions, batch)
        parts[name] = values
        total += w * values
        if not torch.isfinite(total).all():
            raise RewardFunctionError(f"reward function {name!r}: its values times its weight {w} make the "
                                      f"weighted reward sum overflow float32 (max {float(values.abs().max())})")
    return total, parts


def rollout(model, tokenizer, examples: list[dict], reward_fns: list, weights: list[float], *, group_size: int,
            max_new_tokens: int, temperature: float, top_p: float, truncation: str = "mask",
            truncation_penalty: float = 0.0, greedy: bool = False, sampler_logprobs: bool = False,
            device=None) -> Rollout:
    """Generate ``group_size`` completions for each example and score them (see the module docstring)."""
    prompts = [e["prompt"] for e in examples]
    prompt_ids, prompt_attn, P, comp, mask, truncated, logprobs = generate(
        model, tokenizer, prompts, group_size=group_size, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, greedy=greedy, sampler_logprobs=sampler_logprobs, device=device)
    completions = decode_completions(tokenizer, comp, mask)
    rep_prompts = [p for p in prompts for _ in range(group_size)]
    fields = {k: [v for v in vals for _ in range(group_size)] for k, vals in batch_fields(examples).items()}
    rewards, parts = score(reward_fns, weights, rep_prompts, completions, fields)
    trunc_cpu = truncated.cpu()
    if truncation == "penalize":
        rewards = torch.where(trunc_cpu, torch.full_like(rewards, truncation_penalty), rewards)
    loss_mask = mask
    if truncation == "mask":
        loss_mask = mask & ~truncated.unsqueeze(1)
    if logprobs is not None:  # 0 wherever the loss mask is False, dropped truncated rows included
        logprobs = torch.where(loss_mask, logprobs, torch.zeros_like(logprobs))
    input_ids = torch.cat([prompt_ids, comp], 1)
    attention_mask = torch.cat([prompt_attn, mask.long()], 1)
    return Rollout(input_ids, attention_mask, position_ids_from(attention_mask), P, comp, loss_mask, truncated,
                   rewards.to(comp.device), mask.sum(1), rep_prompts, completions, parts, logprobs)
