"""Liger-Kernel's logits-level GRPO functions on fused_rl's kernels (no Liger import needed).

* :func:`triton_grpo_loss`: the arguments and return values of ``liger_kernel.transformers.grpo_loss
  .triton_grpo_loss`` (read at liger-kernel 0.8.5), computed by :func:`fused_rl.policy_loss` (``reduce=True``: one
  fused pass that also writes the gradient) or by :func:`fused_rl.token_logprobs` and the loss math
  (``reduce=False``: per-token losses that take any upstream gradient);
* :func:`fused_selective_log_softmax`: ``liger_kernel.ops.grpo_loss.fused_selective_log_softmax``, the log-probs
  of the old / reference policy without gradient.

Both take Liger's shifted layout: ``logits (B, L+1, V)``, whose position ``t < L`` scores ``completion_ids[:, t]``
(the last position is read by nothing and gets a zero gradient). The losses are those of
:func:`fused_rl.nn.grpo_policy_loss_config` (TRL's formulas: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``,
``sapo``, ``luspo``, ``vespo``, token or sequence importance sampling, ``delta``, the k3 KL with
``use_bias_correction_kl``); ``dapo`` / ``cispo`` / ``vespo`` divide by ``num_items_in_batch / world_size`` or,
without it, by the loss tokens of all ranks over the world size (:func:`fused_rl.nn.liger_token_normalizer`), and
``dr_grpo`` by ``B * max_completion_length`` (default ``L``), as Liger does.

Differences from Liger 0.8.5, each tested:

* ``inplace=True`` (Liger's default) lets the single pass of ``reduce=True`` write the gradient over the logits
  during the call (Liger writes it during the backward): do not read the logits after the call (autograd still
  raises if another node saved them). With ``reduce=False`` the backward writes it, as Liger's. A leaf tensor (or a
  view of one) is never overwritten; the reference backend never writes in place.
* ``luspo`` is TRL's ``(l m).sum(-1).mean()``: Liger's ``mean`` over ``B L`` positions of ``l n_b`` weights each
  sequence by ``n_b / L`` more (equal when every response has ``L`` tokens).
* Raise where Liger computes something it should not: ``cispo`` with ``eps_high < 1`` (the cap of the ratio itself,
  so Liger's default 0.4 caps every ratio at 0.4: pass e.g. ``eps_high=5.0``); ``vllm_is_ratio`` with ``vespo``
  (pass the sampler's log-probs to :func:`fused_rl.policy_loss` with ``rollout_is`` instead); ``delta <= 1 +
  eps_high``; a ``completion_mask`` with values other than 0 and 1 (Liger weights tokens by them).
* ``completion_ids`` may hold ``-100`` (no token); ``advantages`` may be ``(B, L)`` (or ``(B, 1)``); the logits
  need not be contiguous; ``B == 0`` gives a zero loss and metrics (``reduce=False``: empty ``(0, L)`` tensors).
* The per-token outputs and the metrics are detached fp32 (fp64 for fp64 logits; the per-token loss keeps its
  gradient); the metrics are a list, as Liger's.

Extra keyword arguments: ``backend`` (default ``"auto"``), ``check_inputs`` (as :func:`fused_rl.policy_loss`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..backends.reference import compute_dtype
from ..config import IGNORE_INDEX, PolicyLossConfig
from ..loss_math import per_token_loss
from ..nn import _liger_error, grpo_policy_loss_config, liger_clipped, liger_token_normalizer
from ..ops import policy_loss, token_logprobs
from ..validation import _fail, check_logits, prepare_policy_inputs

#: fused_rl's argument names in :func:`fused_rl.policy_loss`'s ``ValueError`` messages -> Liger's.
_NAMES = {"logits": "logits", "targets": "completion_ids", "mask": "completion_mask", "old_logprobs": "old_logp",
          "ref_logprobs": "ref_logp", "rollout_is_weights": "vllm_is_ratio"}


def _shifted(x: Optional[torch.Tensor], name: str, shape: tuple, pad_value=0, allow_seq: bool = False):
    """``x (B, L)`` padded to ``(B, L+1)`` with ``pad_value`` (the logits' unread last position); ``(B,)`` (and
    Liger's ``(B, 1)``) per-sequence values as ``(B,)`` when ``allow_seq``; None stays None."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if allow_seq and (x.dim() == 1 or (x.dim() == 2 and x.shape[1] == 1 and shape[1] != 1)):
        if x.shape[0] != shape[0]:
            _fail(f"{name} must have shape {shape}, ({shape[0]}, 1) or ({shape[0]},), got {tuple(x.shape)}")
        return x.reshape(shape[0])
    if tuple(x.shape) != shape:
        want = f"{shape}, ({shape[0]}, 1) or ({shape[0]},)" if allow_seq else f"{shape}"
        _fail(f"{name} must have shape {want} (logits are (B, L+1, V)), got {tuple(x.shape)}")
    return F.pad(x, (0, 1), value=pad_value)


def _check_shifted_logits(logits) -> tuple[int, int]:
    """``(B, L)`` of Liger's ``logits (B, L+1, V)``, checked as :func:`fused_rl.policy_loss` checks its logits (an
    empty batch, ``B == 0``, allowed)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[1] == 0 or logits.shape[2] == 0:
        raise ValueError(f"logits must be a tensor of shape (B, L+1, V), got {tuple(getattr(logits, 'shape', ()))}")
    if logits.shape[0] > 0:
        check_logits(logits)
    elif not logits.is_floating_point():
        raise ValueError(f"logits must be floating, got {logits.dtype}")
    return logits.shape[0], logits.shape[1] - 1


def _config(loss_type, importance_sampling_level, length, *, beta, eps_low, eps_high, temperature,
            max_completion_length, delta, use_bias_correction_kl, sapo, vespo) -> PolicyLossConfig:
    return grpo_policy_loss_config(
        loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=length if max_completion_length is None else max_completion_length,
        temperature=temperature, delta=delta,
        use_bias_correction_kl=bool(use_bias_correction_kl) and beta != 0.0,
        sapo_temperature_pos=sapo[0], sapo_temperature_neg=sapo[1],
        vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3])


def triton_grpo_loss(
    logits,
    old_logp,
    ref_logp,
    completion_ids,
    advantages,
    completion_mask=None,
    temperature=0.9,
    beta=0.04,
    eps_low=0.2,
    eps_high=0.4,
    inplace=True,
    loss_type="dapo",
    max_completion_length=None,
    importance_sampling_level="token",
    reduce=False,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vllm_is_ratio=None,
    delta=None,
    use_bias_correction_kl=False,
    num_items_in_batch=None,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    *,
    backend: str = "auto",
    check_inputs: bool = True,
):
    """Liger's ``triton_grpo_loss`` on fused_rl (see the module docstring for the differences).

    ``logits (B, L+1, V)``; ``old_logp`` / ``ref_logp`` / ``completion_ids`` / ``completion_mask (B, L)``
    (``old_logp=None``: on-policy; ``ref_logp`` read only with ``beta != 0``; ``completion_mask=None``: every
    token); ``advantages (B,)``; ``vllm_is_ratio (B, L)``, ``(B, 1)`` or ``(B,)``, multiplying the policy term.

    Returns ``(loss, metrics)`` with ``reduce=True``, ``metrics = [kl_mean, clip_ratio]`` (``[clip_ratio]`` at
    ``beta = 0``): the token means of the KL term (``r k3`` with ``use_bias_correction_kl``) and of Liger's
    ``is_clipped`` (:func:`fused_rl.nn.liger_clipped`); with ``reduce=False`` the ``(B, L)`` tensors
    ``(per_token_loss, per_token_kl, is_clipped)``, 0 where masked (``per_token_kl`` None at ``beta = 0``), the
    first differentiable w.r.t. ``logits``: ``l_t = c_t pg_t + beta kl_t`` of :func:`fused_rl.loss_math
    .per_token_loss`.
    """
    if not isinstance(reduce, bool) or not isinstance(inplace, bool):
        raise ValueError(f"reduce and inplace must be bools, got {reduce!r} and {inplace!r}")
    batch, length = _check_shifted_logits(logits)
    config = _config(loss_type, importance_sampling_level, length, beta=beta, eps_low=eps_low, eps_high=eps_high,
                     temperature=temperature, max_completion_length=max_completion_length, delta=delta,
                     use_bias_correction_kl=use_bias_correction_kl,
                     sapo=(sapo_temperature_pos, sapo_temperature_neg),
                     vespo=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))
    if vllm_is_ratio is not None and config.policy_loss == "vespo":
        raise NotImplementedError("loss_type='vespo' with vllm_is_ratio: Liger folds the ratio into VESPO's weight; "
                                  "fused_rl forms that weight from the sampler's log-probs: call fused_rl.policy_loss "
                                  "with rollout_logprobs and a config with policy_loss='vespo' and "
                                  "rollout_is='token_truncate' / 'token_mask'")
    shape = (batch, length)
    try:
        if not isinstance(completion_ids, torch.Tensor):
            _fail(f"completion_ids must be a torch.Tensor of token ids, got {type(completion_ids).__name__}")
        targets = _shifted(completion_ids, "completion_ids", shape, pad_value=IGNORE_INDEX)
        mask = _shifted(torch.ones(shape, dtype=torch.bool, device=logits.device) if completion_mask is None
                        else completion_mask, "completion_mask", shape)
        adv = advantages
        if isinstance(advantages, torch.Tensor) and advantages.dim() == 2:
            adv = _shifted(advantages, "advantages", shape, allow_seq=True)  # Liger reads (B, 1) as (B,)
        old = _shifted(old_logp, "old_logp", shape)
        if config.kl is not None and ref_logp is None:
            _fail(f"ref_logp is required with beta != 0 (beta={beta!r}): pass the reference log-probs (B, L) "
                  "or beta=0")
        ref = _shifted(ref_logp, "ref_logp", shape) if config.kl is not None else None
        weights = _shifted(vllm_is_ratio, "vllm_is_ratio", shape, pad_value=1, allow_seq=True)
        normalizer = None
        if reduce:
            local_tokens = ((mask != 0) & (targets != IGNORE_INDEX)).sum()
            normalizer = liger_token_normalizer(loss_type, local_tokens, num_items_in_batch)
        if batch == 0:  # after the normalizer's all_reduce, which the ranks with tokens run too
            return _no_tokens(logits, length, config, reduce)
        if reduce:
            out = policy_loss(logits, targets, adv, mask, old_logprobs=old, ref_logprobs=ref,
                              rollout_is_weights=weights, config=config, token_normalizer=normalizer,
                              backend=backend, compute_entropy=False, inplace=inplace, check_inputs=check_inputs)
            metrics = [out.metrics["kl_mean"]] if config.kl is not None else []
            valid = (mask != 0) & (targets != IGNORE_INDEX)
            hit = liger_clipped(out.logprobs, old, adv, valid, config)
            metrics.append(hit.sum().to(torch.float32) / valid.sum().clamp(min=1).to(torch.float32))
            return out.loss, metrics
        return _per_token(logits, targets, adv, mask, old, ref, weights, config, backend, check_inputs, inplace)
    except ValueError as exc:
        raise _liger_error(exc, _NAMES) from exc


def _per_token(logits, targets, advantages, mask, old, ref, weights, config, backend, check_inputs, inplace):
    """``reduce=False``: the per-token loss of the fused log-probs (their gradient recomputed in the backward from
    each row's saved statistics, for whatever upstream gradient; over the logits with ``inplace``), KL and
    ``is_clipped``, sliced to ``(B, L)``."""
    inputs = prepare_policy_inputs(
        tuple(logits.shape), logits.device, targets, advantages, mask, old_logprobs=old, ref_logprobs=ref,
        config=config, token_normalizer=None, compute_dtype=compute_dtype(logits.dtype), check_inputs=check_inputs,
        rollout_is_weights=weights, logits=logits)
    read = torch.where(inputs.mask, inputs.targets, torch.full_like(inputs.targets, IGNORE_INDEX))
    logp = token_logprobs(logits, read, temperature=config.temperature, backend=backend, check_inputs=False,
                          inplace=inplace)
    terms = per_token_loss(logp, inputs.advantages, inputs.mask, config, old_logprobs=inputs.old,
                           ref_logprobs=inputs.ref, rollout_is_weights=inputs.is_weights)
    clipped = liger_clipped(logp, inputs.old, inputs.advantages, inputs.mask, config).to(logp.dtype)
    kl = None if terms.kl is None else terms.kl.detach()[:, :-1]
    return terms.loss[:, :-1], kl, clipped[:, :-1]


def _no_tokens(logits: torch.Tensor, length: int, config: PolicyLossConfig, reduce: bool):
    """``B == 0``: a zero loss in the graph of ``logits`` (its backward gives zero gradients, as on the ranks with
    tokens) and zero metrics, or empty per-token outputs."""
    dtype = compute_dtype(logits.dtype)
    if reduce:
        loss = logits.reshape(-1)[:0].sum().to(dtype)  # a sum over no elements: 0
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        return loss, [zero.clone() for _ in range(2 if config.kl is not None else 1)]
    empty = logits.new_zeros((0, length), dtype=dtype)
    per_token = logits.reshape(-1)[:0].to(dtype).reshape(0, length)
    return per_token, (empty.clone() if config.kl is not None else None), empty


@torch.no_grad()
def fused_selective_log_softmax(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 0.9, mask=None,
                                *, backend: str = "auto", check_inputs: bool = True) -> torch.Tensor:
    """Liger's ``fused_selective_log_softmax``: ``log softmax(logits[:, t] / temperature)[input_ids[:, -L:][:, t]]``
    for ``logits (B, L+1, V)``, ``(B, L)`` fp32 (fp64 for fp64 logits) without gradient, 0 where ``mask[:, -L:]``
    is 0 (those ids are not read: padding may hold any id). ``input_ids`` (and ``mask``) may be the whole
    sequences, prompt included: their last ``L`` columns are read."""
    batch, length = _check_shifted_logits(logits)
    for x, name in ((input_ids, "input_ids"), (mask, "mask")):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != batch
                              or x.shape[1] < length):
            raise ValueError(f"{name} must have shape ({batch}, >= {length}) (logits are (B, L+1, V)), got "
                             f"{tuple(getattr(x, 'shape', ()))}")
    ids = input_ids[:, input_ids.shape[1] - length:]
    if mask is not None:
        ids = torch.where(mask[:, mask.shape[1] - length:] != 0, ids, torch.full_like(ids, IGNORE_INDEX))
    targets = F.pad(ids, (0, 1), value=IGNORE_INDEX)
    if batch == 0:
        return logits.new_zeros((0, length), dtype=compute_dtype(logits.dtype))
    try:
        return token_logprobs(logits, targets, temperature=temperature, backend=backend,
                              check_inputs=check_inputs)[:, :-1]
    except ValueError as exc:
        raise _liger_error(exc, {"targets": "input_ids"}) from exc


__all__ = ["triton_grpo_loss", "fused_selective_log_softmax"]
