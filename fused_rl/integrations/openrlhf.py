"""OpenRLHF's actor loss on fused_rl's loss math (no OpenRLHF import needed).

:class:`PolicyLoss` takes the constructor of OpenRLHF's ``openrlhf.models.PolicyLoss`` (read at openrlhf 0.11.2,
``models/loss.py``) and two entry points:

* ``forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size, batch_num_tokens,
  global_batch_size)`` -> ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``: OpenRLHF's call and return
  value, on per-token log-probs you computed (:func:`fused_rl.loss_math.compute_policy_loss`); a drop-in for the
  trainer's ``actor_loss_fn``;
* :meth:`PolicyLoss.forward_from_hidden`: the fused version, from the actor's last hidden states and ``lm_head``
  weight through :func:`fused_rl.linear_policy_loss` (no ``(B, T, V)`` logits), folding OpenRLHF's KL loss
  (``--algo.kl.use_loss``, every estimator, ``unbiased_gradient`` too) and entropy loss (``--actor.entropy_coef``)
  into the same pass, as OpenRLHF's ``PolicyTrainer.training_step`` adds them: ``actor_loss + kl_coef * kl_loss -
  entropy_coef * entropy_loss``.

:func:`log_probs_from_logits` and :func:`compute_entropy` are OpenRLHF's functions of those names on the fused
kernels, and :func:`patch_actor` makes OpenRLHF's ``Actor.forward`` call them.

Option mapping (:func:`policy_loss_config_from_openrlhf`):

==============================================  ==========================================================
OpenRLHF                                        fused_rl
==============================================  ==========================================================
``policy_loss_type="ppo"``                      ``policy_loss="ppo_clip"``
``policy_loss_type="gspo"``                     ``policy_loss="gspo"`` (the sequence ratio with its full
                                                gradient), always per sample, as OpenRLHF forces
``clip_eps_low``, ``clip_eps_high``             ``clip_low``, ``clip_high``
``dual_clip``                                   ``dual_clip`` (ppo and gspo, as OpenRLHF)
``token_level_loss`` (``--actor.loss_agg_mode``)  ``agg="token-mean"``, else ``"seq-mean-token-mean"`` over the
                                                non-empty responses
``batch_num_tokens``, ``dp_size``               ``token_normalizer = batch_num_tokens / dp_size``
``global_batch_size``, ``dp_size``              the per-sample mean times ``B * dp_size / global_batch_size``
``is_correction_*`` (ppo)                       ``rollout_is_weights``, computed here from ``old_log_probs``
                                                and ``rollout_log_probs`` (:func:`is_correction_weights`)
``is_correction_*`` (gspo)                      the ratio against ``rollout_log_probs``, no weights (OpenRLHF)
``kl_coef``                                     ``beta``
``kl_estimator="k1"`` / ``"k2"``                ``kl="k1"`` / ``"k2"`` with ``kl_clamp=10`` (OpenRLHF clamps
                                                every estimator's value to ``[-10, 10]``)
``kl_estimator="k3"``                           ``kl="low_var_kl"`` (k3 clamped to ``[-10, 10]``)
``unbiased_gradient`` (``--algo.kl``)           the ``"X+"`` estimator (k2's gradient) with ``kl_is_clip=10``
                                                (OpenRLHF's ``KL_IS_WEIGHT_CLIP``): k2's gradient times
                                                ``sg(min(exp(log_probs - old_log_probs), 10))``
``entropy_coef``                                ``entropy_coef``
``temperature`` (the actor's)                   ``temperature``
==============================================  ==========================================================

Differences from OpenRLHF, all documented in ``docs/migration.md``:

* OpenRLHF clamps ppo's ``log_probs - old_log_probs`` to ``[-20, 20]`` before ``exp`` (a constant ratio, no
  gradient, beyond); fused_rl does not: identical while the log ratio stays inside.
* A kept token's importance weight ``exp(old - rollout)`` has its log clamped to ``[-20, 20]``
  (:data:`fused_rl.loss_math.ROLLOUT_LOG_RHO_BOUND`; OpenRLHF's can overflow to ``inf`` inside a kept response);
  the gates read the unclamped statistic, in fp32 (OpenRLHF: the inputs' dtype, bf16 rounding ``1 - 1e-6`` to 1).
* ``is_correction_threshold`` with ``low > high`` raises (OpenRLHF drops every token).
* OpenRLHF's means divide by ``sum(mask)`` unclamped (NaN for an empty batch) and a response's token mean by
  ``count + 1e-8``; fused_rl clamps the counts at 1 and divides by ``count``.
* With a per-sample policy loss, a KL or entropy term raises ``NotImplementedError``: OpenRLHF aggregates those per
  token, and one fused pass has one aggregation.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from ..config import PolicyLossConfig, naming_arguments
from ..loss_math import (ROLLOUT_LOG_RHO_BOUND, compute_policy_loss as _compute_policy_loss, importance_ratio,
                         masked_mean, ratio_bounds, responses_factor)
from ..ops import _check_linear_targets, linear_policy_loss, token_entropy, token_logprobs
from ..outputs import PolicyLossOutput
from ..validation import _fail, adapter_inputs, positive_integer

POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_CORRECTION_LEVELS = ("off", "token", "seq")
IS_CORRECTION_MODES = ("mask", "clip")
IS_CORRECTION_GATINGS = ("ratio", "binary_kl", "tv")
#: OpenRLHF's clamp of the sampled-token probabilities in the binary-KL / TV gates (keeps the logs finite).
PROB_CLAMP = 1e-6
#: OpenRLHF's ``kl_estimator`` -> fused_rl's ``kl`` (before the ``unbiased_gradient`` ``"+"``); every value is
#: clamped to ``[-KL_VALUE_CLAMP, KL_VALUE_CLAMP]`` there (k3 clamped is ``low_var_kl``).
KL_FROM_OPENRLHF = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
KL_VALUE_CLAMP = 10.0
#: OpenRLHF's ``KL_IS_WEIGHT_CLIP``: the bound of ``unbiased_gradient``'s importance weight ``pi / pi_old``.
KL_IS_WEIGHT_CLIP = 10.0

Count = Union[None, int, float, torch.Tensor]


def _check_is_correction(level: str, mode: str, gating: str, threshold) -> tuple[float, float]:
    """OpenRLHF's constructor checks of the train/rollout correction, and ``low <= high`` (OpenRLHF would drop every
    token); returns ``(low, high)`` (the thresholds are not read when ``level="off"``)."""
    for value, name, choices in ((level, "is_correction_level", IS_CORRECTION_LEVELS),
                                 (mode, "is_correction_mode", IS_CORRECTION_MODES),
                                 (gating, "is_correction_gating", IS_CORRECTION_GATINGS)):
        if value not in choices:
            _fail(f"{name} must be one of {'/'.join(choices)}, got {value!r}")
    if mode == "clip" and (level == "seq" or gating != "ratio"):  # also with level "off", as OpenRLHF
        _fail("is_correction_mode='clip' needs is_correction_level='token' and is_correction_gating='ratio' "
              "(only the token ratio is a weight that can be clamped)")
    if level == "off":
        return -float("inf"), float("inf")
    try:
        low, high = (float(x) for x in threshold)
    except (TypeError, ValueError):
        _fail(f"is_correction_threshold must be two numbers (low, high), got {threshold!r}")
    if not low <= high:  # also NaN
        _fail(f"is_correction_threshold must satisfy low <= high, got {threshold!r}")
    if gating != "ratio" and level != "off" and low > 0:
        _fail(f"is_correction_gating={gating!r} takes an upper bound only (low must be 0, got {low})")
    return low, high


def is_correction_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                          level: str, mode: str, gating: str, low: float, high: float,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's train/rollout correction as ``(weights, filtered)``, both ``(B, T)`` and detached.

    With ``w_t = exp(old_t - rollout_t)`` (the trainer's old policy against the sampler) and the gated statistic
    ``s``: ``gating="ratio"``: ``w_t`` (``level="seq"``: the geometric mean ``exp(mean_t m log w_t)``);
    ``"binary_kl"``: ``p log(p / q) + (1 - p) log((1 - p) / (1 - q))``; ``"tv"``: ``|p - q|``, with ``p =
    exp(rollout)``, ``q = exp(old)`` clamped to ``[1e-6, 1 - 1e-6]`` (``level="seq"``: the masked mean over the
    response); computed in fp32 (fp64 for fp64 inputs). ``mode="clip"``: ``weights = clamp(s, low, high)``;
    ``mode="mask"``: ``weights = w_t 1[low <= s <= high]`` (a dropped unit has weight 0, a kept token its own
    ``w_t``, its log clamped to ``[-20, 20]``: a token far off inside a kept response or under a divergence gate
    cannot overflow the loss). ``filtered``: ``s`` outside ``[low, high]``
    (an empty response counts as filtered at ``level="seq"``, as OpenRLHF's NaN mean), at every position: average
    it over the mask (``level="token"``) or take a row's value (``"seq"``). Masked positions have weight 1. The
    options are checked as OpenRLHF's constructor checks them (``ValueError``).
    """
    _check_is_correction(level, mode, gating, (low, high))
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    m = mask.to(dtype)
    old, rollout = old_log_probs.detach().to(dtype), rollout_log_probs.detach().to(dtype)
    log_w = torch.where(mask, old - rollout, torch.zeros_like(old))
    count = m.sum(dim=1, keepdim=True)

    def sequence_mean(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(mask, x, torch.zeros_like(x)).sum(dim=1, keepdim=True) / count.clamp(min=1)
                ).expand_as(x)

    if gating == "ratio":
        stat = torch.exp(sequence_mean(log_w) if level == "seq" else log_w)
    else:
        p = torch.exp(rollout).clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
        q = torch.exp(old).clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
        if gating == "binary_kl":
            stat = p * torch.log(p / q) + (1.0 - p) * torch.log((1.0 - p) / (1.0 - q))
        else:
            stat = (p - q).abs()
        if level == "seq":
            stat = sequence_mean(stat)
    keep = (stat >= low) & (stat <= high)
    if level == "seq":
        keep = keep & (count > 0)
    if mode == "clip":
        weights = stat.clamp(low, high)
    else:
        weights = torch.where(keep, torch.exp(log_w.clamp(-ROLLOUT_LOG_RHO_BOUND, ROLLOUT_LOG_RHO_BOUND)), 0.0)
    one = torch.ones_like(weights)
    return torch.where(mask, weights, one), ~keep


@naming_arguments({"clip_low": "clip_eps_low", "clip_high": "clip_eps_high", "beta": "kl_coef"})
def policy_loss_config_from_openrlhf(
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    token_level_loss: bool = True,
    policy_loss_type: str = "ppo",
    *,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    kl_unbiased_gradient: bool = False,
    entropy_coef: Optional[float] = None,
    temperature: float = 1.0,
) -> PolicyLossConfig:
    """The :class:`PolicyLossConfig` of OpenRLHF's actor loss (see the module docstring's table); ``kl_coef = 0``
    leaves the KL loss out (OpenRLHF's ``--algo.kl.use_loss`` off or ``init_coef = 0``), ``entropy_coef=None`` the
    entropy loss. ``kl_estimator`` and ``kl_unbiased_gradient`` are ``--algo.kl.estimator`` and
    ``--algo.kl.unbiased_gradient`` (``compute_approx_kl``'s, read at openrlhf 0.11.2)."""
    if policy_loss_type not in POLICY_LOSS_TYPES:
        _fail(f"policy_loss_type must be one of {'/'.join(POLICY_LOSS_TYPES)}, got {policy_loss_type!r}")
    per_sample = policy_loss_type == "gspo" or not token_level_loss
    if kl_estimator not in KL_FROM_OPENRLHF:
        _fail(f"kl_estimator must be one of {'/'.join(KL_FROM_OPENRLHF)}, got {kl_estimator!r}")
    kl = kl_clamp = kl_is_clip = None
    if kl_coef != 0.0:
        kl = KL_FROM_OPENRLHF[kl_estimator] + ("+" if kl_unbiased_gradient else "")
        kl_clamp = None if kl.startswith("low_var_kl") else KL_VALUE_CLAMP
        kl_is_clip = KL_IS_WEIGHT_CLIP if kl_unbiased_gradient else None
    entropy = 0.0 if entropy_coef is None else entropy_coef
    if per_sample and (kl is not None or entropy != 0.0):
        raise NotImplementedError(
            "OpenRLHF aggregates a per-sample policy loss (gspo, or loss_agg_mode='seq-mean-token-mean') per sample "
            "but its KL and entropy losses per token, which one fused pass cannot; use forward() on log-probs with "
            "OpenRLHF's own aggregate_loss for the KL / entropy terms")
    return PolicyLossConfig(policy_loss="ppo_clip" if policy_loss_type == "ppo" else "gspo",
                            clip_low=clip_eps_low, clip_high=clip_eps_high, dual_clip=dual_clip,
                            agg="seq-mean-token-mean" if per_sample else "token-mean", kl=kl,
                            beta=kl_coef if kl is not None else 0.0, kl_clamp=kl_clamp, kl_is_clip=kl_is_clip,
                            entropy_coef=entropy, temperature=temperature)


class PolicyLoss(torch.nn.Module):
    """OpenRLHF's ``PolicyLoss`` on fused_rl (see the module docstring): the same constructor, checks and
    ``forward``; :meth:`forward_from_hidden` is the fused version.

    Per token, with ``r = exp(log_probs - old_log_probs)`` (gspo: the sequence ratio ``exp(mean_t m (log_probs -
    old))`` on every token) and the correction weight ``c`` (:func:`is_correction_weights`, 1 when off),
    ``l_t = c_t max(-r A, -clip(r, 1 - clip_eps_low, 1 + clip_eps_high) A)``, with ``dual_clip`` further capped at
    ``-dual_clip A`` where ``A < 0``. ``token_level_loss``: ``sum(m l) / N`` with ``N = batch_num_tokens /
    dp_size`` (local ``sum(m)`` when ``batch_num_tokens`` is None); else the sum of the responses' token means over
    ``global_batch_size / dp_size`` (the local count of non-empty responses when None).
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: Optional[float] = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold=(0.5, 5.0)) -> None:
        super().__init__()
        self.config = policy_loss_config_from_openrlhf(clip_eps_low, clip_eps_high, dual_clip, token_level_loss,
                                                       policy_loss_type)
        self.policy_loss_type = policy_loss_type
        self.is_correction = (is_correction_level, is_correction_mode, is_correction_gating)
        self.is_correction_bounds = _check_is_correction(*self.is_correction, is_correction_threshold)

    @classmethod
    def from_openrlhf(cls, loss_fn) -> "PolicyLoss":
        """This module with the options of an OpenRLHF ``PolicyLoss`` instance (e.g. a trainer's
        ``actor_loss_fn``)."""
        return cls(loss_fn.clip_eps_low, loss_fn.clip_eps_high, loss_fn.dual_clip, loss_fn.token_level_loss,
                   loss_fn.policy_loss_type, loss_fn.is_correction_level, loss_fn.is_correction_mode,
                   loss_fn.is_correction_gating, loss_fn.is_correction_threshold)

    def extra_repr(self) -> str:
        level, mode, gating = self.is_correction
        return f"{self.config}, is_correction=({level!r}, {mode!r}, {gating!r}, {self.is_correction_bounds})"

    @property
    def _correcting(self) -> bool:
        return self.is_correction[0] != "off"

    def _inputs(self, shape: tuple, device: torch.device, device_owner: str, old_log_probs, advantages,
                action_mask, rollout_log_probs, dp_size, check_inputs: bool) -> torch.Tensor:
        """Checks of OpenRLHF's per-token arguments under its names; returns the boolean mask."""
        positive_integer(dp_size, "dp_size")
        if action_mask is None:
            action_mask = torch.ones(shape, dtype=torch.bool, device=device)
        if self._correcting and rollout_log_probs is None:
            _fail(f"is_correction_level={self.is_correction[0]!r} needs rollout_log_probs (the inference engine's)")
        logprobs = (("old_log_probs", old_log_probs),) + ((("rollout_log_probs", rollout_log_probs),)
                                                          if self._correcting else ())
        return adapter_inputs(shape, device, device_owner, check_inputs, logprobs=logprobs,
                              advantages=("advantages", advantages), mask=("action_mask", action_mask))

    def _behaviour_and_weights(self, old: torch.Tensor, rollout: Optional[torch.Tensor], mask: torch.Tensor):
        """``(log-probs the ratio is taken against, correction weights or None, filtered or None)``: with the
        correction on, gspo's ratio is against the rollout log-probs (no weights); ppo's weights come from
        :func:`is_correction_weights`."""
        if not self._correcting:
            return old, None, None
        if self.policy_loss_type == "gspo":
            return rollout.detach().to(old.dtype), None, None
        weights, filtered = is_correction_weights(old, rollout, mask, *self.is_correction, *self.is_correction_bounds)
        return old, weights.to(old.dtype), filtered

    def _scale(self, loss: torch.Tensor, mask: torch.Tensor, dp_size: int, global_batch_size: Count) -> torch.Tensor:
        """A per-sample loss over ``global_batch_size / dp_size`` responses (local: the non-empty ones) instead of
        fused_rl's ``B`` rows."""
        if self.config.agg == "token-mean":
            return loss
        return loss * responses_factor(mask, loss.dtype, dp_size, global_batch_size)

    def _normalizer(self, dp_size: int, batch_num_tokens: Count) -> Count:
        if self.config.agg != "token-mean" or batch_num_tokens is None:
            return None
        return batch_num_tokens / dp_size

    def _metrics(self, logp: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, rollout: Optional[torch.Tensor], filtered: Optional[torch.Tensor]):
        """OpenRLHF's ``(clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``: the masked fraction of tokens whose clipped
        surrogate is below the unclipped one, the masked mean of ``old - log_probs``, and with the ppo correction
        the masked mean of ``rollout - old`` and the filtered fraction (of the ``B`` responses at ``level="seq"``)."""
        logp = logp.detach()
        ratio = importance_ratio(logp, behaviour, mask, self.config)
        low, high = ratio_bounds(ratio, self.config)
        clipped = ((ratio > high) & (advantages > 0)) | ((ratio < low) & (advantages < 0))
        clip_ratio, ppo_kl = masked_mean(clipped, mask), masked_mean(old - logp, mask)
        if filtered is None:
            return clip_ratio, ppo_kl, None, None
        vllm_kl = masked_mean(rollout.detach() - old, mask)
        if self.is_correction[0] == "seq":
            return clip_ratio, ppo_kl, vllm_kl, filtered.any(dim=1).to(torch.float32).mean()
        return clip_ratio, ppo_kl, vllm_kl, masked_mean(filtered, mask)

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                dp_size: int = 1, batch_num_tokens: Count = None, global_batch_size: Count = None, *,
                check_inputs: bool = True):
        """OpenRLHF's ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` from per-token ``log_probs (B, T)``
        (``vllm_kl`` / ``is_filter_ratio`` None unless ppo with the correction on). ``advantages`` ``(B, T)`` or
        ``(B,)``; ``action_mask`` None means every token. With ``check_inputs`` (one host sync): a 0/1 mask and,
        where it is set, finite advantages and finite log-probs ``<= 0.5``."""
        if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or not log_probs.is_floating_point():
            _fail(f"log_probs must be a floating (B, T) tensor, got "
                  f"{getattr(log_probs, 'dtype', type(log_probs).__name__)} of shape "
                  f"{tuple(getattr(log_probs, 'shape', ()))}")
        shape = tuple(log_probs.shape)
        mask = self._inputs(shape, log_probs.device, "log_probs is", old_log_probs, advantages, action_mask,
                            rollout_log_probs, dp_size, check_inputs)
        dtype = torch.promote_types(torch.promote_types(log_probs.dtype, old_log_probs.dtype), advantages.dtype)
        log_probs = log_probs.to(dtype)  # bf16 log-probs against fp32 old ones: fp32, as OpenRLHF's arithmetic
        adv = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(shape)).detach().to(dtype)
        old = old_log_probs.detach().to(dtype)
        behaviour, weights, filtered = self._behaviour_and_weights(old, rollout_log_probs, mask)
        loss, _ = _compute_policy_loss(log_probs, adv, mask, self.config, old_logprobs=behaviour,
                                       rollout_is_weights=weights,
                                       token_normalizer=self._normalizer(dp_size, batch_num_tokens))
        loss = self._scale(loss, mask, dp_size, global_batch_size)
        return (loss,) + self._metrics(log_probs, old, behaviour, adv, mask, rollout_log_probs, filtered)

    def forward_from_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, action_ids: torch.Tensor, old_log_probs: torch.Tensor,
        advantages: torch.Tensor, action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None, dp_size: int = 1, batch_num_tokens: Count = None,
        global_batch_size: Count = None, *, bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
        base_log_probs: Optional[torch.Tensor] = None, kl_coef: float = 0.0, kl_estimator: str = "k1",
        kl_unbiased_gradient: bool = False, entropy_coef: Optional[float] = None, backend: str = "auto",
        check_inputs: bool = True,
    ) -> tuple:
        """The fused OpenRLHF actor loss from the hidden states that predict ``action_ids (B, T)``.

        ``hidden (B, T, H)`` is the actor's last hidden state at the positions predicting the actions (OpenRLHF's
        ``logits[:, -T-1:-1]``), ``weight (V, H)`` / ``bias`` the ``lm_head``, ``temperature`` the actor's (it
        divides the logits, for the log-probs and the entropy). Returns ``(loss, clip_ratio, ppo_kl, vllm_kl,
        is_filter_ratio, out)``: ``loss = actor_loss + kl_coef * kl_loss - entropy_coef * entropy_loss`` as
        OpenRLHF's ``training_step`` sums them (``kl_loss`` OpenRLHF's ``compute_approx_kl`` against
        ``base_log_probs``, the reference model's, when ``kl_coef != 0``: ``kl_estimator`` k1 / k2 / k3, OpenRLHF's
        default k1, its value clamped to ``[-10, 10]``, with ``kl_unbiased_gradient`` the k2 gradient weighted by
        ``min(exp(log_probs - old_log_probs), 10)``; ``entropy_loss`` when ``entropy_coef`` is not None), each
        aggregated per token like the policy loss; ``out`` the :class:`PolicyLossOutput` (detached ``logprobs`` /
        ``entropy``; ``out.metrics["kl_mean"]`` / ``["entropy_mean"]`` are local masked means, OpenRLHF's logged
        ``kl`` / ``entropy_loss`` when ``batch_num_tokens`` is None). Pass ``kl_coef`` only where OpenRLHF adds the
        KL loss (``--algo.kl.use_loss`` with ``init_coef > 0``: ``kl_ctl``), else 0.

        Checks as :meth:`forward` against ``hidden``'s ``(B, T)`` and device (``action_ids`` int32 / int64);
        :func:`fused_rl.linear_policy_loss` then checks the rest under its own names (``action_ids`` in ``[0, V)``
        as ``targets``, ``base_log_probs`` as ``ref_logprobs``): with ``check_inputs``, two host syncs.
        """
        shape = _check_linear_targets(hidden, weight, bias, action_ids, "action_ids")
        mask = self._inputs(shape, hidden.device, "hidden is", old_log_probs, advantages, action_mask,
                            rollout_log_probs, dp_size, check_inputs)
        if kl_coef != 0.0 and base_log_probs is None:
            _fail("kl_coef != 0 needs base_log_probs (the reference model's log-probs)")
        config = policy_loss_config_from_openrlhf(
            self.config.clip_low, self.config.clip_high, self.config.dual_clip, self.config.agg == "token-mean",
            self.policy_loss_type, kl_coef=kl_coef, kl_estimator=kl_estimator,
            kl_unbiased_gradient=kl_unbiased_gradient, entropy_coef=entropy_coef, temperature=temperature)
        old = old_log_probs.detach().to(torch.promote_types(hidden.dtype, torch.float32))
        behaviour, weights, filtered = self._behaviour_and_weights(old, rollout_log_probs, mask)
        out: PolicyLossOutput = linear_policy_loss(
            hidden, weight, action_ids, advantages, mask, bias=bias, old_logprobs=behaviour,
            ref_logprobs=base_log_probs if config.kl is not None else None, rollout_is_weights=weights,
            config=config, token_normalizer=self._normalizer(dp_size, batch_num_tokens), backend=backend,
            compute_entropy=True, check_inputs=check_inputs)
        loss = self._scale(out.loss, mask, dp_size, global_batch_size)
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(shape)
        metrics = self._metrics(out.logprobs, old.float(), behaviour.float(), adv.detach().float(), mask,
                                rollout_log_probs, filtered)
        return (loss,) + metrics + (out,)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                          backend: str = "auto", check_inputs: bool = True) -> torch.Tensor:
    """OpenRLHF's ``openrlhf.models.utils.log_probs_from_logits``: ``log softmax(logits / temperature)[labels]``,
    differentiable, from :func:`fused_rl.token_logprobs` (one fused pass over the logits; OpenRLHF's fp32 path takes
    the flash-attn cross entropy or a chunked ``logsumexp``, its bf16 / fp16 path a ``log_softmax`` per row).
    Differences: the result is fp32 whatever the logits' dtype (fp64 for fp64; OpenRLHF's bf16 path returns bf16
    log-probs of a bf16 ``log_softmax``), and ``temperature != 1`` does not divide the caller's logits in place
    (OpenRLHF's ``logits.div_``)."""
    return token_logprobs(logits, labels, temperature=temperature, backend=backend, check_inputs=check_inputs)


def compute_entropy(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """OpenRLHF's ``openrlhf.models.utils.compute_entropy``: ``H = logsumexp(z) - sum_j softmax(z)_j z_j`` over the
    last dimension, differentiable, from :func:`fused_rl.token_entropy` (one fused pass; OpenRLHF's is
    compiled with ``torch.compile``, which fuses it too and keeps only the logits and per-row statistics); fp32 (fp64
    for fp64 logits). A row with ``-inf`` logits has a finite entropy (OpenRLHF's: NaN, ``0 * -inf``)."""
    return token_entropy(logits, backend=backend)


def patch_actor(actor_module=None, *, backend: str = "auto", check_inputs: bool = True) -> tuple:
    """Make OpenRLHF's ``Actor.forward`` take its log-probs and entropies from :func:`log_probs_from_logits` and
    :func:`compute_entropy` (it calls the names ``openrlhf.models.actor`` imported from ``openrlhf.models.utils``;
    ``actor_module``: that module, imported here when None), with the given ``backend`` and ``check_inputs``
    (``False``: no host sync a call, out-of-range labels unchecked). It patches this process only: call it in each
    Ray worker that builds OpenRLHF's ``Actor``, not (only) in the driver. Returns the previous pair, to restore with
    ``actor_module.log_probs_from_logits, actor_module.compute_entropy = previous``. The actor still casts its
    logits to fp32 and scales them by the temperature before these run."""
    if actor_module is None:
        import openrlhf.models.actor as actor_module
    previous = (actor_module.log_probs_from_logits, actor_module.compute_entropy)
    actor_module.log_probs_from_logits = functools.partial(log_probs_from_logits, backend=backend,
                                                           check_inputs=check_inputs)
    actor_module.compute_entropy = functools.partial(compute_entropy, backend=backend)
    return previous


__all__ = ["PolicyLoss", "is_correction_weights", "policy_loss_config_from_openrlhf", "POLICY_LOSS_TYPES",
           "log_probs_from_logits", "compute_entropy", "patch_actor"]
