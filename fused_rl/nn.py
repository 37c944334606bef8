"""Drop-in ``torch.nn.Module`` losses.

* :class:`FusedPolicyLoss`: ``(logits, targets, advantages, mask, ...)`` -> :class:`PolicyLossOutput`;
* :class:`FusedLinearPolicyLoss`: ``(hidden, weight, targets, advantages, mask, ...)`` -> the same, without
  materializing ``hidden @ weight.T`` (fused backends);
* :class:`FusedLinearGRPOLoss`: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` constructor, ``forward``
  arguments and ``(loss, metrics)`` return value, computed by :func:`fused_rl.linear_policy_loss`.

:func:`grpo_policy_loss_config` is the one translation of TRL / Liger GRPO options (``loss_type``,
``epsilon_low/high``, ``beta``, ``importance_sampling_level``, ...) into a :class:`PolicyLossConfig`;
the TRL trainer integration uses it too. Options fused_rl cannot express raise (never silently
computing something else).
"""

from __future__ import annotations

import functools
import numbers
import re
import sys
from typing import Optional

import torch

from .config import IGNORE_INDEX, PolicyLossConfig, finite_number, naming_arguments
from .loss_math import Normalizer, importance_ratio, ratio_bounds
from .ops import linear_policy_loss, linear_token_logprobs, policy_loss
from .outputs import PolicyLossOutput
from .validation import check_flag

#: TRL / Liger ``loss_type`` values fused_rl computes exactly.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: ``loss_type`` values whose token-mean denominator is TRL's ``num_items_in_batch``.
NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo", "vespo")
#: The :func:`grpo_policy_loss_config` argument of each PolicyLossConfig field of another name (error messages).
GRPO_ARGUMENT_OF_FIELD = {"clip_low": "epsilon_low", "clip_high": "epsilon_high", "max_len": "max_completion_length",
                          "off_policy_mask": "off_policy_mask_threshold", "rollout_is": "vllm_importance_sampling_mode",
                          "rollout_is_min": "vllm_importance_sampling_clip_min",
                          "rollout_is_max": "vllm_importance_sampling_clip_max"}


def _as_number(value):
    """A one-element tensor or 0-d numpy array (not of bools) as its Python number (Liger's math takes a tensor
    ``beta`` or ``epsilon``, and so did this mapping's ``float()``; a host sync), anything else as it is."""
    np = sys.modules.get("numpy")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_meta:
        return value.item()
    if np is not None and isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return value.item()
    return value


@naming_arguments(GRPO_ARGUMENT_OF_FIELD)
def grpo_policy_loss_config(
    loss_type: str = "dapo",
    *,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None,
    temperature: float = 1.0,
    delta: Optional[float] = None,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: Optional[float] = None,
    vllm_importance_sampling_mode: Optional[str] = None,
    vllm_importance_sampling_clip_min: Optional[float] = None,
    vllm_importance_sampling_clip_max: Optional[float] = 3.0,
) -> PolicyLossConfig:
    """The :class:`PolicyLossConfig` of a TRL ``GRPOTrainer`` / Liger ``LigerFusedLinearGRPOLoss`` setup.

    With ``r`` the token ratio (``importance_sampling_level="token"``) or the sequence ratio
    ``exp(mean_t log r_t)`` (``"sequence"``, fused_rl's ``gspo``):

    * ``grpo``: ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, ``agg="seq-mean-token-mean"``;
    * ``bnpo``: same surrogate, ``agg="token-mean"`` over the local batch;
    * ``dr_grpo``: same surrogate, ``agg="seq-mean-token-sum-norm"`` with ``max_len=max_completion_length``;
    * ``dapo``: same surrogate, ``agg="token-mean"``; pass TRL's normalizer as ``token_normalizer``;
    * ``cispo``: ``-sg(min(r, epsilon_high)) A logp`` (TRL's ``epsilon_high`` is the cap itself, so
      ``clip_high = epsilon_high - 1``), ``agg="token-mean"``;
    * ``sapo``: ``-A 4/tau sigmoid(tau (r - 1))`` with TRL's ``sapo_temperature_pos/neg``, aggregated as grpo;
    * ``luspo``: the grpo surrogate (gspo with ``importance_sampling_level="sequence"``, as the LUSPO paper),
      ``agg="seq-mean-token-sum"`` (TRL 1.16's ``(l m).sum(-1).mean()``: a sequence weighted by its length);
    * ``vespo``: fused_rl's ``policy_loss="vespo"`` with ``vespo_k_pos`` ... ``vespo_lambda_neg``, ``agg="token-mean"``
      (TRL's ``num_items_in_batch`` normalizer, as dapo); the vLLM correction (token modes only) enters its weight;
    * ``beta > 0``: ``+ beta * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1`` (TRL's estimator), times
      ``r`` with ``use_bias_correction_kl`` (False by default, as Liger's; TRL 1.16's GRPOConfig defaults it
      to True: pass it);
    * ``delta``: TRL's two-sided clip (``min(r, delta)`` in the unclipped term);
    * ``top_entropy_quantile``, ``off_policy_mask_threshold``: fused_rl's ``top_entropy_quantile`` /
      ``off_policy_mask``; ``vllm_importance_sampling_mode`` (with ``use_vllm`` and the correction on;
      ``None`` otherwise) and its ``clip_min`` / ``clip_max``: ``rollout_is`` / ``rollout_is_min`` /
      ``rollout_is_max`` (pass the sampler's log-probs as ``rollout_logprobs``).

    Raises ``NotImplementedError`` for sequence-level cispo, sapo and vespo and for ``delta <= 1 + epsilon_high``;
    ``ValueError`` for options out of range (e.g. cispo with ``epsilon_high < 1``, dr_grpo without
    ``max_completion_length``, vespo with a sequence-level vLLM correction, ``delta`` with cispo / sapo / vespo).
    """
    # the numbers as numbers before any arithmetic or comparison on them (float("0.2") took a string, bool("False")
    # is True, and "2" <= 1.2 raised a TypeError); None only where an option may be absent
    for field, value in dict(clip_low=epsilon_low, clip_high=epsilon_high, beta=beta, temperature=temperature,
                             delta=delta, sapo_temperature_pos=sapo_temperature_pos,
                             sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
                             vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                             vespo_lambda_neg=vespo_lambda_neg,
                             top_entropy_quantile=top_entropy_quantile, off_policy_mask=off_policy_mask_threshold,
                             rollout_is_min=vllm_importance_sampling_clip_min,
                             rollout_is_max=vllm_importance_sampling_clip_max).items():
        if value is not None or field not in ("clip_high", "delta", "off_policy_mask", "rollout_is_min",
                                              "rollout_is_max"):
            finite_number(field, _as_number(value))
    check_flag(use_bias_correction_kl, "use_bias_correction_kl")
    if epsilon_high is None:
        epsilon_high = epsilon_low
    if loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; fused_rl supports {SUPPORTED_LOSS_TYPES}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    kl = dict(kl="k3", beta=float(beta), kl_bias_correction=bool(use_bias_correction_kl)) if beta != 0.0 else {}
    kl.update(top_entropy_quantile=float(top_entropy_quantile), off_policy_mask=off_policy_mask_threshold,
              temperature=temperature)
    if vllm_importance_sampling_mode is not None:
        kl.update(rollout_is=vllm_importance_sampling_mode, rollout_is_min=vllm_importance_sampling_clip_min,
                  rollout_is_max=vllm_importance_sampling_clip_max)
    if delta is not None and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"delta (two-sided clipping) applies to the clipped losses, not loss_type={loss_type!r}")
    if delta is not None and delta <= 1.0 + epsilon_high:
        raise NotImplementedError(f"delta={delta!r} <= 1 + epsilon_high={1.0 + epsilon_high!r}: fused_rl's two-sided "
                                  "clip needs delta above the clip range (TRL accepts it)")
    if loss_type == "sapo":
        if importance_sampling_level == "sequence":
            raise NotImplementedError("loss_type='sapo' with importance_sampling_level='sequence' is not supported "
                                      "by fused_rl; use importance_sampling_level='token'")
        return PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=float(sapo_temperature_pos),
                                sapo_temperature_neg=float(sapo_temperature_neg), agg="seq-mean-token-mean", **kl)
    if loss_type == "vespo":
        if importance_sampling_level == "sequence":
            raise NotImplementedError("loss_type='vespo' with importance_sampling_level='sequence' is not supported "
                                      "by fused_rl (VESPO forms its sequence weight itself; TRL warns, Liger raises); "
                                      "use importance_sampling_level='token'")
        return PolicyLossConfig(policy_loss="vespo", vespo_k_pos=float(vespo_k_pos),
                                vespo_lambda_pos=float(vespo_lambda_pos), vespo_k_neg=float(vespo_k_neg),
                                vespo_lambda_neg=float(vespo_lambda_neg), agg="token-mean", **kl)
    if loss_type == "cispo":
        if importance_sampling_level == "sequence":
            raise NotImplementedError("loss_type='cispo' with importance_sampling_level='sequence' is not supported "
                                      "by fused_rl (nor by Liger); use importance_sampling_level='token'")
        if epsilon_high < 1.0:
            raise ValueError(f"loss_type='cispo' caps the ratio at epsilon_high, which fused_rl needs >= 1 "
                             f"(clip_high = epsilon_high - 1); got epsilon_high={epsilon_high!r}")
        return PolicyLossConfig(policy_loss="cispo", clip_low=0.0, clip_high=float(epsilon_high) - 1.0,
                                agg="token-mean", **kl)
    agg = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
           "dapo": "token-mean", "luspo": "seq-mean-token-sum"}[loss_type]
    extra = {}
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        integral = isinstance(max_completion_length, numbers.Integral) and not isinstance(max_completion_length, bool)
        # a numpy int as an int; anything else to the config's check (int(4.5) divided by 4 where Liger takes 4.5)
        extra["max_len"] = int(max_completion_length) if integral else max_completion_length
    policy = "gspo" if importance_sampling_level == "sequence" else "ppo_clip"
    return PolicyLossConfig(policy_loss=policy, clip_low=float(epsilon_low), clip_high=float(epsilon_high), agg=agg,
                            delta=delta, **kl, **extra)


class FusedPolicyLoss(torch.nn.Module):
    """``policy_loss`` as a module: ``forward(logits, targets, advantages, mask, old_logprobs=None,
    ref_logprobs=None, token_normalizer=None, rollout_logprobs=None, truncated=None,
    rollout_is_weights=None)`` returns a
    :class:`PolicyLossOutput`.

    ``logits (B, T, V)`` (any row strides, unit vocabulary stride), ``targets/mask (B, T)``,
    ``advantages (B,)`` or ``(B, T)``. See :class:`PolicyLossConfig` for the formulas.
    """

    def __init__(self, config: Optional[PolicyLossConfig] = None, *, backend: str = "auto",
                 compute_entropy: bool = True, inplace: bool = False, check_inputs: bool = True) -> None:
        super().__init__()
        self.config = PolicyLossConfig() if config is None else config
        if not isinstance(self.config, PolicyLossConfig):
            raise ValueError(f"config must be a PolicyLossConfig, got {type(self.config).__name__}")
        self.backend = backend
        self.compute_entropy = compute_entropy
        self.inplace = inplace
        self.check_inputs = check_inputs

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                old_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
                token_normalizer: Normalizer = None, rollout_logprobs: Optional[torch.Tensor] = None,
                truncated: Optional[torch.Tensor] = None,
                rollout_is_weights: Optional[torch.Tensor] = None) -> PolicyLossOutput:
        return policy_loss(logits, targets, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                           rollout_logprobs=rollout_logprobs, truncated=truncated,
                           rollout_is_weights=rollout_is_weights,
                           config=self.config, token_normalizer=token_normalizer, backend=self.backend,
                           compute_entropy=self.compute_entropy, inplace=self.inplace,
                           check_inputs=self.check_inputs)

    def extra_repr(self) -> str:
        return f"config={self.config}, backend={self.backend!r}"


class FusedLinearPolicyLoss(torch.nn.Module):
    """``linear_policy_loss`` as a module: ``forward(hidden, weight, targets, advantages, mask, bias=None,
    old_logprobs=None, ref_logprobs=None, token_normalizer=None, rollout_logprobs=None,
    truncated=None, rollout_is_weights=None)``; the logits ``hidden @ weight.T + bias``
    are never materialized by fused backends. ``hidden (B, T, H)``, ``weight (V, H)``, ``bias (V,)``.
    ``memory_budget_bytes``: the tile buffers' budget of :func:`fused_rl.linear_policy_loss` (None: its default)."""

    def __init__(self, config: Optional[PolicyLossConfig] = None, *, backend: str = "auto",
                 compute_entropy: bool = True, check_inputs: bool = True,
                 memory_budget_bytes: Optional[int] = None) -> None:
        super().__init__()
        self.config = PolicyLossConfig() if config is None else config
        if not isinstance(self.config, PolicyLossConfig):
            raise ValueError(f"config must be a PolicyLossConfig, got {type(self.config).__name__}")
        self.backend = backend
        self.compute_entropy = compute_entropy
        self.check_inputs = check_inputs
        self.memory_budget_bytes = memory_budget_bytes

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, bias: Optional[torch.Tensor] = None, old_logprobs: Optional[torch.Tensor] = None,
                ref_logprobs: Optional[torch.Tensor] = None, token_normalizer: Normalizer = None,
                rollout_logprobs: Optional[torch.Tensor] = None,
                truncated: Optional[torch.Tensor] = None,
                rollout_is_weights: Optional[torch.Tensor] = None) -> PolicyLossOutput:
        return linear_policy_loss(hidden, weight, targets, advantages, mask, bias=bias, old_logprobs=old_logprobs,
                                  ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, truncated=truncated,
                                  rollout_is_weights=rollout_is_weights,
                                  config=self.config, token_normalizer=token_normalizer,
                                  backend=self.backend, compute_entropy=self.compute_entropy,
                                  check_inputs=self.check_inputs, memory_budget_bytes=self.memory_budget_bytes)

    def extra_repr(self) -> str:
        return f"config={self.config}, backend={self.backend!r}"


#: fused_rl's argument names in :func:`linear_policy_loss`'s ``ValueError`` messages -> Liger's ``forward`` names
#: (and, for the reference pass with :func:`linear_token_logprobs`, the ``ref_*`` ones).
_LIGER_NAMES = {"hidden": "_input", "weight": "lin_weight", "targets": "selected_token_ids", "mask": "attention_mask",
                "old_logprobs": "old_per_token_logps", "ref_logprobs": "ref_per_token_logps",
                "rollout_is_weights": "vllm_is_ratio"}
_LIGER_REF_NAMES = {"hidden": "ref_input", "weight": "ref_weight", "bias": "ref_bias", "targets": "selected_token_ids"}


def _liger_error(exc: ValueError, names: dict) -> ValueError:
    """``exc`` with each argument name of ``names`` (a whole word, not an attribute such as ``config.kl``) renamed."""
    pattern = r"(?<![\w.])(" + "|".join(names) + r")(?!\w)"
    return ValueError(re.sub(pattern, lambda m: names[m.group(1)], str(exc)))


def _widest(*xs):
    """``xs`` with the floating tensors among them cast to their widest dtype (``None`` and the rest unchanged):
    Liger takes the operands of the head in any mix of dtypes (``lin_weight`` cast to ``_input``'s, ``bias`` to
    fp32); autograd hands each gradient back in its operand's dtype."""
    floats = [x.dtype for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floats:
        return xs
    dtype = functools.reduce(torch.promote_types, floats)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in xs)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def liger_token_normalizer(loss_type: str, local_tokens: torch.Tensor, num_items_in_batch):
    """dapo / cispo / vespo's token normalizer (None for the other loss types), as Liger's:
    ``max(num_items_in_batch / world_size, 1)`` or, without it, the loss tokens of all ranks (``local_tokens``
    summed by one ``all_reduce``, on every rank, an empty one included) over the world size."""
    if loss_type not in NUM_ITEMS_LOSS_TYPES:
        return None
    world = _world_size()
    if isinstance(num_items_in_batch, torch.Tensor):
        n = num_items_in_batch.to(device=local_tokens.device, dtype=torch.float32)
    elif num_items_in_batch is not None:  # a Python number stays one: under torch.compile a tensor made
        n = float(num_items_in_batch)      # from it would be a constant of the graph, one graph per value
    else:
        n = local_tokens.to(torch.float32)
        if world > 1:
            n = n.clone()
            torch.distributed.all_reduce(n)
    return max(n / world, 1.0) if isinstance(n, float) else (n / world).clamp(min=1.0)


def liger_clipped(logp: torch.Tensor, old: Optional[torch.Tensor], advantages: torch.Tensor, mask: torch.Tensor,
                  config: PolicyLossConfig) -> torch.Tensor:
    """Liger's ``is_clipped`` per token, ``(B, T)`` bool, False where ``mask`` is: ``r < 1-eps_low, A < 0`` or
    ``r > 1+eps_high, A > 0`` with ``r`` the token ratio (gspo: the sequence ratio, on each of its tokens); cispo
    ``r > eps_high, A > 0`` (fused_rl's ``clip_frac_high`` counts every truncated weight); never for the other
    losses (sapo, vespo). ``old=None``: on-policy, ``r = 1``."""
    if config.policy_loss not in ("ppo_clip", "gspo", "cispo"):
        return torch.zeros_like(mask)
    logp = logp.detach()
    ratio = importance_ratio(logp, logp if old is None else old.to(logp.dtype), mask, config)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    low, high = ratio_bounds(ratio, config)
    hit = (ratio > high) & (adv > 0)
    if config.policy_loss != "cispo":
        hit = hit | ((ratio < low) & (adv < 0))
    return hit & mask


class FusedLinearGRPOLoss(torch.nn.Module):
    """Drop-in replacement of Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (liger-kernel 0.8.x).

    Same constructor and ``forward`` arguments, same return value ``(loss, metrics)`` with
    ``metrics = (kl_mean, clip_ratio)`` when ``beta != 0`` and ``(clip_ratio,)`` otherwise, where
    ``kl_mean = sum(k3 m) / max(sum m, 1)`` (``r k3`` with ``use_bias_correction_kl``, as Liger logs it) and
    ``clip_ratio`` is the masked fraction of tokens with
    ``r < 1-eps_low, A < 0`` or ``r > 1+eps_high, A > 0`` (cispo: ``r > eps_high, A > 0``; sequence level:
    the sequence ratio, counted on every token). See :func:`grpo_policy_loss_config` for the losses.
    ``dapo``/``cispo``/``vespo`` divide by ``num_items_in_batch / world_size`` (clamped at 1) or, without it, by
    the token count of all ranks divided by the world size, as Liger does.

    ``loss_type="sapo"`` (with ``sapo_temperature_pos/neg``; its ``clip_ratio`` is 0, as in Liger), ``"vespo"``
    (with ``vespo_k_pos`` ... ``vespo_lambda_neg``; ``clip_ratio`` 0, as in Liger), ``"luspo"`` at
    ``importance_sampling_level="sequence"`` with ``beta=0`` and no per-token ``vllm_is_ratio``, and ``delta``
    (two-sided clip of grpo / bnpo / dr_grpo / dapo / luspo) are tested equal to Liger. luspo otherwise follows
    TRL 1.16 (the sum of each sequence's masked token losses, mean over sequences): Liger 0.8.5 also sums the
    padding positions' token losses (weighted by the sequence length) where they differ from the sequence's
    (token level, the KL term, a ``(B, T)`` ``vllm_is_ratio``).
    Arguments that are accepted and have no effect on the result: ``compiled``, ``chunk_size`` (fused_rl
    picks its own chunking), the sapo parameters unless ``loss_type="sapo"``, the vespo ones unless ``"vespo"``.
    ``vllm_is_ratio`` (``(B, T)`` or ``(B, 1)``, the importance weights TRL computes against vLLM) multiplies
    the policy term, as in Liger (``rollout_is_weights`` of :func:`fused_rl.linear_policy_loss`).
    Raise where Liger computes something it should not, or fused_rl cannot: ``vllm_is_ratio`` with vespo (Liger
    folds it into VESPO's weight; fused_rl forms that from the sampler's log-probs: ``policy_loss="vespo"`` with
    ``rollout_is``, as the TRL adapter does); cispo with
    ``epsilon_high < 1`` (the weight cap itself, as TRL's; Liger's default 0.2 would cap every ratio at 0.2:
    pass e.g. ``epsilon_high=5.0``); ``delta <= 1 + epsilon_high`` (Liger: ``delta > 0``); ``delta`` with cispo,
    sapo or vespo (``ValueError``; Liger ignores it there); ``beta < 0``; an ``attention_mask`` with values
    other than 0 and 1 (Liger would weight the tokens by it). A ``-100`` in ``selected_token_ids`` is no token (for
    the loss and ``clip_ratio``). No tokens (``B == 0`` or ``T == 0``): loss 0, metrics 0, zero gradients (Liger
    0.8.5: NaN for some loss types). With ``use_ref_model=False`` the KL term is the KL to the current policy (0,
    zero gradient), exactly as in Liger. ``ref_input``/``ref_weight`` compute the reference log-probs under
    ``no_grad`` with :func:`fused_rl.linear_token_logprobs`.
    ``_input``, ``lin_weight`` and ``bias`` (and ``ref_input``, ``ref_weight``, ``ref_bias``) may differ in dtype
    (a bf16 hidden state and an fp32 ``lm_head``): the log-probs are computed in the widest of them (Liger: in
    ``_input``'s dtype, its logits rounded to it), each gradient comes back in its operand's dtype. Integer
    ``advantages`` are taken as fp32, as Liger's arithmetic promotes them. Bad input raises a ``ValueError``
    naming Liger's argument (``old_per_token_logps``, ``vllm_is_ratio``, ``selected_token_ids``, ...).

    A setting assigned after construction (``loss_fn.beta = 0.0``) takes effect, as in Liger (which reads them at
    every ``forward``): :attr:`config` is rebuilt at the assignment, outside any compiled step (a ``beta`` that an
    adaptive KL controller sets between compiled steps is a second graph, where it is symbolic, then no more; a
    structural change, ``beta`` to 0, is a new graph); settings that depend on each other can be assigned in any
    order (``loss_type = "cispo"``, then ``epsilon_high = 5.0``): an invalid combination raises at the next
    ``forward`` (or read of ``config``),
    naming the setting. Invalid constructor arguments raise at construction,
    except a missing ``max_completion_length`` of dr_grpo, which Liger needs at ``forward`` only.

    Extra keyword arguments: ``backend`` (default ``"auto"``), ``check_inputs``.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: Optional[float] = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        backend: str = "auto",
        check_inputs: bool = True,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg
        self.backend = backend
        self.check_inputs = check_inputs
        self._rebuild_config()
        # bad arguments raise at construction, except dr_grpo's missing max_completion_length, which Liger asks for
        # at forward only (it may be assigned after construction)
        if self._config is None and not (loss_type == "dr_grpo" and max_completion_length is None):
            self._build_config()

    #: The settings :attr:`config` is built from: Liger reads them at every ``forward``, so assigning one after
    #: construction (``loss_fn.beta = 0.0``) rebuilds the config.
    _CONFIG_SETTINGS = frozenset((
        "beta", "use_ref_model", "epsilon_low", "epsilon_high", "loss_type", "max_completion_length",
        "importance_sampling_level", "temperature", "delta", "use_bias_correction_kl", "sapo_temperature_pos",
        "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"))

    def __setattr__(self, name, value) -> None:
        if name in ("beta", "temperature"):
            value = _as_number(value)  # a tensor's number, read here: forward branches on beta
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                value = float(value)  # a Python float: a numpy scalar is an array of unknown value in a compiled step
        super().__setattr__(name, value)
        if name in self._CONFIG_SETTINGS and "_config" in self.__dict__:  # (__init__ builds the first one)
            self._rebuild_config()

    def _rebuild_config(self) -> None:
        """The config of the current settings, built at the assignment: outside any compiled step, so that it reaches
        ``forward`` as a constant (built inside one, a setting that changed between steps, e.g. an adaptive KL
        controller's ``beta``, is a symbolic float there, which no config can be validated on). Invalid settings
        leave None, and :attr:`config` raises when read: settings that depend on each other may be assigned one at
        a time, in any order."""
        try:
            config = self._build_config()
        except (ValueError, NotImplementedError):
            config = None
        self.__dict__["_config"] = config

    @property
    def config(self) -> PolicyLossConfig:
        """The :class:`~fused_rl.PolicyLossConfig` of the current settings (rebuilt at each assignment of one)."""
        if self._config is None:
            return self._build_config()  # invalid settings: raises, naming them
        return self._config

    def _build_config(self):
        # numbers and a bool before they are compared or combined (below, and in grpo_policy_loss_config)
        beta = finite_number("beta", _as_number(self.beta))
        check_flag(self.use_bias_correction_kl, "use_bias_correction_kl")
        for name in ("pos", "neg"):
            tau = finite_number(f"sapo_temperature_{name}", _as_number(getattr(self, f"sapo_temperature_{name}")))
            if not tau > 0:  # checked whatever the loss_type, as Liger does
                raise ValueError(f"sapo_temperature_{name} must be positive, got {tau}")
        # A KL to the current policy itself (use_ref_model=False) is 0 with zero gradient: beta drops out.
        kl_beta = self.beta if self.use_ref_model else 0.0
        return grpo_policy_loss_config(
            self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=kl_beta,
            importance_sampling_level=self.importance_sampling_level,
            max_completion_length=self.max_completion_length, temperature=self.temperature, delta=self.delta,
            use_bias_correction_kl=bool(self.use_bias_correction_kl) and beta != 0.0,
            sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg,
            vespo_k_pos=self.vespo_k_pos, vespo_lambda_pos=self.vespo_lambda_pos, vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg)

    @torch.no_grad()
    def _ref_logprobs(self, ref_input: torch.Tensor, ref_weight: torch.Tensor, ref_bias: Optional[torch.Tensor],
                      targets: torch.Tensor, lin_weight: torch.Tensor, policy_input: torch.Tensor) -> torch.Tensor:
        """The reference model's log-probs of ``targets``. Their value check (ids in ``[0, V)`` or -100 where the
        mask is set) is left to the policy pass, whose one batched host sync raises on them before anything is
        returned: here ids out of range are read as 0 (no out-of-bounds read, whatever ``check_inputs`` says:
        padding ids where the mask is off are valid input, which the policy pass never reads), so a step costs
        one host sync, not two."""
        ref_input, ref_weight, ref_bias = _widest(ref_input, ref_weight, ref_bias)
        if isinstance(ref_weight, torch.Tensor) and isinstance(lin_weight, torch.Tensor) \
                and ref_weight.dim() == lin_weight.dim() == 2 and ref_weight.shape[0] != lin_weight.shape[0]:
            raise ValueError(f"ref_weight must have as many rows as lin_weight (the vocabulary, "
                             f"{lin_weight.shape[0]}), got shape {tuple(ref_weight.shape)}")
        if isinstance(ref_input, torch.Tensor) and isinstance(policy_input, torch.Tensor) and ref_input.dim() == 3 \
                and policy_input.dim() == 3 and ref_input.shape[:2] != policy_input.shape[:2]:
            raise ValueError(f"ref_input must have the (B, T) of _input, {tuple(policy_input.shape[:2])}, got shape "
                             f"{tuple(ref_input.shape)}")
        if isinstance(targets, torch.Tensor) and isinstance(ref_weight, torch.Tensor) \
                and targets.dtype in (torch.int32, torch.int64) and ref_weight.dim() == 2:
            read = ((targets >= 0) & (targets < ref_weight.shape[0])) | (targets == IGNORE_INDEX)
            targets = torch.where(read, targets, torch.zeros((), dtype=targets.dtype, device=targets.device))
        try:
            return linear_token_logprobs(ref_input.detach(), ref_weight.detach(),
                                         targets, bias=None if ref_bias is None else ref_bias.detach(),
                                         temperature=self.temperature, backend=self.backend, check_inputs=False)
        except ValueError as exc:
            raise _liger_error(exc, _LIGER_REF_NAMES) from exc

    def forward(
        self,
        _input: torch.Tensor,
        lin_weight: torch.Tensor,
        selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        advantages: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        ref_per_token_logps: Optional[torch.Tensor] = None,
        old_per_token_logps: Optional[torch.Tensor] = None,
        ref_input: Optional[torch.Tensor] = None,
        ref_weight: Optional[torch.Tensor] = None,
        ref_bias: Optional[torch.Tensor] = None,
        vllm_is_ratio: Optional[torch.Tensor] = None,
        num_items_in_batch=None,
    ):
        if vllm_is_ratio is not None and self.config.policy_loss == "vespo":
            raise NotImplementedError("loss_type='vespo' with vllm_is_ratio: Liger folds the ratio into VESPO's "
                                      "weight; fused_rl forms that weight from the sampler's log-probs: call "
                                      "fused_rl.linear_policy_loss with rollout_logprobs and a config with "
                                      "policy_loss='vespo' and rollout_is='token_truncate' / 'token_mask'")
        if vllm_is_ratio is not None and vllm_is_ratio.dim() == 2 and vllm_is_ratio.shape[1] == 1:
            vllm_is_ratio = vllm_is_ratio.squeeze(1)  # Liger's per-sequence (B, 1) form
        config = self.config
        if isinstance(_input, torch.Tensor) and _input.dim() == 3 and _input.shape[0] * _input.shape[1] == 0:
            # the token count's all_reduce as on the ranks with tokens (an unmatched one breaks the next collective)
            liger_token_normalizer(self.loss_type, torch.zeros((), device=_input.device), num_items_in_batch)
            return self._no_tokens(_input, lin_weight, bias, selected_token_ids, attention_mask)
        ref = None
        if config.kl is not None:
            ref = ref_per_token_logps
            if ref is None:
                if ref_input is None or ref_weight is None:
                    raise ValueError("use_ref_model=True needs ref_per_token_logps or ref_input and ref_weight")
                ref = self._ref_logprobs(ref_input, ref_weight, ref_bias, selected_token_ids, lin_weight, _input)
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        # 0 / 1 values of a numeric mask are checked in linear_policy_loss's one batched host sync (Liger would weight
        # tokens by other values)
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        scored = mask  # the tokens the loss counts (-100: no token); mismatched ids raise in linear_policy_loss
        if isinstance(selected_token_ids, torch.Tensor) and selected_token_ids.shape == mask.shape:
            scored = mask & (selected_token_ids != IGNORE_INDEX)
        normalizer = liger_token_normalizer(self.loss_type, scored.sum(), num_items_in_batch)
        _input, lin_weight, bias = _widest(_input, lin_weight, bias)
        if isinstance(advantages, torch.Tensor) and not advantages.is_floating_point():
            advantages = advantages.to(torch.float32)
        try:
            out = linear_policy_loss(_input, lin_weight, selected_token_ids, advantages, attention_mask, bias=bias,
                                     old_logprobs=old_per_token_logps, ref_logprobs=ref, config=config,
                                     rollout_is_weights=vllm_is_ratio, token_normalizer=normalizer,
                                     backend=self.backend, compute_entropy=False, check_inputs=self.check_inputs)
        except ValueError as exc:
            raise _liger_error(exc, _LIGER_NAMES) from exc
        metrics = []
        if self.beta != 0.0:
            metrics.append(out.metrics["kl_mean"])
        metrics.append(self._clip_ratio(out, advantages, scored, old_per_token_logps))
        return out.loss, tuple(metrics)

    def _no_tokens(self, _input, lin_weight, bias, selected_token_ids, attention_mask):
        """A micro-batch without tokens (``B == 0`` or ``T == 0``, e.g. a rank that dynamic sampling left empty): loss
        0 and metrics 0 (Liger 0.8.5 divides 0 by 0 there for some loss types: NaN), with zero gradients for
        ``_input``, ``lin_weight`` and ``bias``
        (in the graph, so that ``backward`` and DDP's gradient all-reduce run as on the other ranks)."""
        for x, name in ((selected_token_ids, "selected_token_ids"), (attention_mask, "attention_mask")):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(_input.shape[:2]):
                raise ValueError(f"{name} must have shape {tuple(_input.shape[:2])}, "
                                 f"got {tuple(getattr(x, 'shape', ()))}")
        params = [x for x in (_input, lin_weight, bias) if isinstance(x, torch.Tensor)]
        # a sum over no elements: 0 whatever the parameters hold (0 * an inf weight would be NaN)
        loss = sum(x.reshape(-1)[:0].sum() for x in params).to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=_input.device)
        return loss, tuple(zero.clone() for _ in range(2 if self.beta != 0.0 else 1))

    def _clip_ratio(self, out: PolicyLossOutput, advantages: torch.Tensor, mask: torch.Tensor,
                    old: Optional[torch.Tensor]) -> torch.Tensor:
        hit = liger_clipped(out.logprobs, old, advantages, mask, self.config)
        return hit.sum().to(torch.float32) / mask.sum().clamp(min=1).to(torch.float32)

    def extra_repr(self) -> str:
        return f"loss_type={self.loss_type!r}, beta={self.beta}, config={self.config}, backend={self.backend!r}"


__all__ = ["FusedPolicyLoss", "FusedLinearPolicyLoss", "FusedLinearGRPOLoss", "grpo_policy_loss_config",
           "liger_clipped", "liger_token_normalizer", "SUPPORTED_LOSS_TYPES"]
