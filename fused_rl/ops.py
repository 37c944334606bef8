"""Public entry points: validate once, pick a backend, run it.

Shape convention: ``logits[b, t]`` scores ``targets[b, t]``. With a Hugging Face causal LM whose
``logits[:, i]`` predicts token ``i + 1``, pass ``logits[:, P-1:-1]`` and ``targets = input_ids[:, P:]``
for a prompt of length ``P`` (the slice is a view; no copy is made).
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from .backends import get_backend
from .backends.reference import compute_dtype
from .config import PolicyLossConfig
from .loss_math import Normalizer
from .outputs import PolicyLossOutput
from .validation import (INDEX_DTYPES, LOGIT_DTYPES, _check_per_token, _is_compiling, check_flag, check_logits,
                         check_not_meta, check_rows_disjoint, check_temperature, prepare_policy_inputs,
                         run_value_checks, target_range_ok, token_logprobs_checks)


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        check_flag(value, name)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    check_inputs: bool = True,
    inplace: bool = False,
):
    """Log-probs ``log softmax(logits / temperature)[targets]`` of shape ``targets.shape``, fp32 (fp64
    for fp64 logits), differentiable w.r.t. ``logits``; with ``return_entropy`` also
    ``H = -sum_j p_j log p_j`` per position, differentiable too. ``targets == -100`` gives 0.

    ``logits``: ``(..., V)`` fp32 / bf16 / fp16 (fp64 on the reference and torch backends), unit
    stride along ``V``; ``targets``: int32 / int64 ``(...)``. ``check_inputs`` checks the targets are in range
    (one host sync; skipped while ``torch.compile`` traces). ``inplace=True`` lets the cpu / cuda / triton / torch
    backward write the gradient over ``logits`` (no new ``(..., V)`` buffer; Liger's ``inplace``) when they are a
    non-leaf buffer whose rows do not share memory (a leaf or a view of a leaf is left intact, as under
    ``torch.compile``): the logits must not be read after the backward, a second backward through the graph raises,
    and so does the backward of any other node that saved them or another view of the same buffer (two
    ``inplace=True`` calls on slices of one model output: pass ``inplace=False`` to one). Under ``create_graph=True``
    and for a batch of gradients (``is_grads_batched``) the backward is out of place.
    """
    _check_flags(return_entropy=return_entropy, check_inputs=check_inputs, inplace=inplace)
    token_logprobs_checks(logits, targets, temperature, check_inputs)
    if inplace:
        check_rows_disjoint(logits)
    be = get_backend(backend, logits.device, logits.dtype, differentiable=(logits,))
    logp, entropy = be.token_logprobs(logits, targets, float(temperature), bool(return_entropy), inplace)
    return (logp, entropy) if return_entropy else logp


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """Each position's entropy ``H = -sum_j p_j log p_j = logsumexp(z) - sum_j p_j z_j`` of ``p = softmax(z)``,
    ``z = logits / temperature``, over the last dimension: of the logits' leading shape, fp32 (fp64 for fp64
    logits), differentiable; :func:`token_logprobs`' entropy (one fused pass, no target read). A row with some ``-inf``
    logits has a finite entropy (the ``-inf`` columns have ``p_j = 0`` and add nothing); a row of only ``-inf``: NaN."""
    anchor = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)  # any valid id: unused
    return token_logprobs(logits, anchor, temperature=temperature, return_entropy=True, backend=backend,
                          check_inputs=False)[1]


def policy_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    truncated: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    config: Optional[PolicyLossConfig] = None,
    token_normalizer: Normalizer = None,
    backend: str = "auto",
    compute_entropy: bool = True,
    inplace: bool = False,
    check_inputs: bool = True,
) -> PolicyLossOutput:
    """The policy loss of ``config`` (default ``PolicyLossConfig()``) from vocabulary logits.

    ``logits (B, T, V)``, ``targets / mask / old_logprobs / ref_logprobs (B, T)``, ``advantages (B,)``
    or ``(B, T)``; the advantages, log-probs and normalizer are constants of the loss (detached: no
    gradient reaches them). ``old_logprobs=None`` means on-policy (ratio 1, gradient of ``logp``).
    ``ref_logprobs`` are read only with ``config.kl`` set (and ignored otherwise, as Liger and TRL ignore
    them at ``beta = 0``).
    ``rollout_logprobs (B, T)``: the inference engine's log-probs of the sampled tokens (NaN: a token it did not
    score, vLLM's ``None``: log-ratio 0 there, no correction and no off-policy evidence, as TRL), for
    ``config.rollout_is`` / ``config.off_policy_mask``; ``truncated (B,)`` bool: completions cut at the
    length limit, masked out with ``config.mask_truncated_completions``. ``rollout_is_weights (B, T)``
    or ``(B,)``, ``>= 0``: importance weights you computed (verl's ``rollout_is_weights``, TRL / Liger's
    ``vllm_is_ratio``), multiplying the policy term only (not the KL or entropy terms), detached.
    ``token_normalizer`` replaces the token count of ``agg="token-mean"`` (TRL's
    ``num_items_in_batch``); under ``torch.compile`` a Python number that changes every step is a graph input
    after its second value (``torch._dynamo.config.specialize_float=False``, recent torch's default), but with
    ``specialize_float=True`` each value recompiles: pass a 0-dim tensor. ``check_inputs`` runs the value
    checks (one host sync; skipped while ``torch.compile`` traces).
    ``inplace=True`` lets a single-pass backend write the gradient over ``logits`` (which must not be
    used afterwards, and whose rows must not share memory: an ``expand`` raises) when they are a non-leaf
    buffer such as a model's output or a slice of one (a leaf or a view of a leaf is left intact: out of place);
    configs and dtypes that take the two passes (sequence-level losses, fp16 logits) write it in the backward
    instead (:func:`token_logprobs`'s ``inplace``), as does the torch backend for every config; the reference
    ignores it.
    See :class:`fused_rl.PolicyLossConfig` for the formulas.
    """
    config = PolicyLossConfig() if config is None else config
    _check_flags(compute_entropy=compute_entropy, inplace=inplace, check_inputs=check_inputs)
    check_logits(logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    if inplace:
        check_rows_disjoint(logits)
    be = get_backend(backend, logits.device, logits.dtype, differentiable=(logits,))
    inputs = prepare_policy_inputs(
        tuple(logits.shape), logits.device, targets, advantages, mask,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, config=config,
        token_normalizer=token_normalizer, compute_dtype=compute_dtype(logits.dtype), check_inputs=check_inputs,
        rollout_logprobs=rollout_logprobs, truncated=truncated, rollout_is_weights=rollout_is_weights, logits=logits)
    return be.policy_loss(logits, inputs, config, compute_entropy, inplace)


def _memory_budget(memory_budget_bytes) -> Optional[int]:
    """A positive integer (Python's or numpy's) as an ``int``, or None."""
    if memory_budget_bytes is None:
        return None
    if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, numbers.Integral) \
            or memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive int or None, got {memory_budget_bytes!r}")
    return int(memory_budget_bytes)


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    for x, name in ((hidden, "hidden"), (weight, "weight")):
        if not isinstance(x, torch.Tensor) or x.dtype not in LOGIT_DTYPES:
            raise ValueError(f"{name} must be a float32, bfloat16, float16 or float64 torch.Tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
    check_not_meta(hidden, "hidden")
    if hidden.dim() != 3 or hidden.numel() == 0:
        raise ValueError(f"hidden must have non-empty shape (B, T, H), got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2] or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape (V, H={hidden.shape[2]}), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: cast one of them "
                         "(under autocast the head's output has the autocast dtype, its weight keeps its own; "
                         "fused_rl.nn's modules cast both to the wider dtype)")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(getattr(bias, 'shape', ()))}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError("bias must have the dtype and device of hidden")


def _check_linear_targets(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          targets: torch.Tensor, name: str) -> tuple:
    """:func:`_check_linear`, and an adapter's token ids ``(B, T)`` (int32 / int64) on ``hidden``'s device, named as
    its peer names them (verl's ``responses``, OpenRLHF's ``action_ids``); returns ``(B, T)``."""
    _check_linear(hidden, weight, bias)
    shape = tuple(hidden.shape[:2])
    if not isinstance(targets, torch.Tensor) or targets.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32 or int64 tensor, got "
                         f"{getattr(targets, 'dtype', type(targets).__name__)}")
    _check_per_token(targets, name, shape, hidden.device, device_owner="hidden is")
    return shape


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    truncated: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    config: Optional[PolicyLossConfig] = None,
    token_normalizer: Normalizer = None,
    backend: str = "auto",
    compute_entropy: bool = True,
    check_inputs: bool = True,
    memory_budget_bytes: Optional[int] = None,
) -> PolicyLossOutput:
    """``policy_loss`` of the logits ``hidden @ weight.T + bias`` without materializing them (fused
    backends); ``hidden (B, T, H)``, ``weight (V, H)``, ``bias (V,)``. Gradients flow to all three.
    ``memory_budget_bytes`` bounds the fused backends' ``(tokens, V)`` tile buffers (default: 1 GiB on CUDA,
    128 MiB elsewhere; the tile is ``budget // (V * bytes a token)``, at least one token). ``check_inputs``: as in
    :func:`policy_loss` (one host sync; skipped while ``torch.compile`` traces)."""
    config = PolicyLossConfig() if config is None else config
    _check_flags(compute_entropy=compute_entropy, check_inputs=check_inputs)
    _check_linear(hidden, weight, bias)
    memory_budget_bytes = _memory_budget(memory_budget_bytes)
    be = get_backend(backend, hidden.device, hidden.dtype, linear=True, differentiable=(hidden, weight, bias))
    batch, length, _ = hidden.shape
    inputs = prepare_policy_inputs(
        (batch, length, weight.shape[0]), hidden.device, targets, advantages, mask,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, config=config,
        token_normalizer=token_normalizer, compute_dtype=compute_dtype(hidden.dtype), check_inputs=check_inputs,
        rollout_logprobs=rollout_logprobs, truncated=truncated, rollout_is_weights=rollout_is_weights,
        # a -inf bias (a banned token) is a -inf logit whatever the hidden state: read at the targets on-policy
        logits=None if bias is None else bias.expand(batch, length, weight.shape[0]))
    return be.linear_policy_loss(hidden, weight, bias, inputs, config, compute_entropy, memory_budget_bytes)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    check_inputs: bool = True,
    memory_budget_bytes: Optional[int] = None,
):
    """:func:`token_logprobs` of the logits ``z = hidden @ weight.T + bias`` without materializing them
    (fused backends): ``logp = log softmax(z / tau)[targets]`` ``(B, T)`` fp32 (fp64 for fp64 input) and,
    with ``return_entropy``, ``H = -sum_j p_j log p_j``; both differentiable w.r.t. ``hidden (B, T, H)``,
    ``weight (V, H)`` and ``bias (V,)``. ``targets == -100`` gives 0 and no gradient. ``memory_budget_bytes``:
    as in :func:`linear_policy_loss`. ``check_inputs``: targets in range (one host sync; skipped while
    ``torch.compile`` traces)."""
    _check_flags(return_entropy=return_entropy, check_inputs=check_inputs)
    _check_linear(hidden, weight, bias)
    memory_budget_bytes = _memory_budget(memory_budget_bytes)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be an int32 or int64 tensor, got {getattr(targets, 'dtype', type(targets))}")
    if tuple(targets.shape) != tuple(hidden.shape[:2]) or targets.device != hidden.device:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:2])} on {hidden.device}, "
                         f"got {tuple(targets.shape)} on {targets.device}")
    check_temperature(temperature)
    if check_inputs and not _is_compiling():
        vocab = weight.shape[0]
        run_value_checks([(f"targets must be in [0, {vocab}) or -100", target_range_ok(targets, vocab))])
    be = get_backend(backend, hidden.device, hidden.dtype, linear=True, differentiable=(hidden, weight, bias))
    logp, entropy = be.linear_token_logprobs(hidden, weight, bias, targets, float(temperature), bool(return_entropy),
                                             memory_budget_bytes)
    return (logp, entropy) if return_entropy else logp
