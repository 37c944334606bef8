"""verl-style entry points on fused_rl's loss math (no verl import needed), following verl 0.9.1 (PyPI).

* :func:`get_policy_loss_fn` returns, for a verl ``loss_mode``, a function with the signature and return value of
  verl 0.9.1's registered policy losses (``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` & co.):
  ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)`` ->
  ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})`` (fewer where verl returns fewer:
  gpg none; dro, kl_cov, bypass_mode's reinforce ``ppo_kl``; clip_cov no lower fraction; bypass_mode adds verl's
  ``rollout_corr/*`` diagnostics), on per-token log-probs you computed; register it with
  ``verl.trainer.ppo.core_algos.register_policy_loss``.
* :func:`compute_policy_loss` is the same loss returning the older 4-tuple ``(pg_loss, pg_clipfrac, ppo_kl,
  pg_clipfrac_lower)`` (every mode, the metrics verl does not return 0).
* :func:`compute_policy_loss_from_hidden` is the fused version: it takes the actor's last hidden states
  and ``lm_head`` weight instead of ``log_prob`` and goes through :func:`fused_rl.linear_policy_loss`
  (no ``(B, T, V)`` logits), folding verl's KL loss (``use_kl_loss`` / ``kl_loss_coef`` / ``kl_loss_type``) and
  entropy term (``entropy_coeff``) into the same pass, as verl 0.9.1's ``ppo_loss`` (``workers/utils/losses.py``)
  adds them.
* :func:`policy_loss_config_from_verl` is the mapping itself.

Option mapping (``config`` is verl's actor config: a dict, ``DictConfig`` or object with attributes):

=========================================  ===================================================
verl                                       fused_rl
=========================================  ===================================================
``policy_loss.loss_mode="vanilla"``        ``policy_loss="ppo_clip"``, ``dual_clip=clip_ratio_c``
``policy_loss.loss_mode="gspo"``           ``policy_loss="gspo_token"``
``policy_loss.loss_mode="geo_mean"``       ``policy_loss="gmpo"`` (clip_ratio_low/high are log bounds), the mean
                                           over all ``B`` responses whatever ``loss_agg_mode``
``policy_loss.loss_mode="gpg"``            ``policy_loss="reinforce"``
``policy_loss.loss_mode="sapo"``           ``policy_loss="sapo"``, always ``seq-mean-token-mean``
``tau_pos``, ``tau_neg`` (1.0, 1.05)       ``sapo_temperature_pos``, ``sapo_temperature_neg``
``policy_loss.loss_mode="cispo"``          ``policy_loss="cispo"``, ``clip_high=clip_ratio_high``; only with
                                           ``clip_ratio_low >= 1`` (verl's lower bound ``1 - clip_ratio_low``
                                           then never binds; else ``NotImplementedError``)
``policy_loss.loss_mode="dppo_tv"/"dppo_kl"`` ``policy_loss="dppo_tv"/"dppo_kl"``, ``clip_low/high`` the divergence
                                           bounds, ``delta=clip_ratio_c`` (verl: ``config.get("clip_ratio_c", 20.0)``)
``policy_loss.loss_mode="clip_cov"``       ``policy_loss="ppo_clip"`` (no dual clip), ``cov_mode="clip_cov"``,
                                           ``cov_ratio=clip_cov_ratio``, ``clip_cov_lb/ub`` (verl's defaults
                                           0.0002, 1, 5); verl draws with ``torch.randperm``, fused_rl with
                                           ``torch.rand`` keys on the device (the same distribution)
``policy_loss.loss_mode="kl_cov"``         ``policy_loss="ppo_clip"`` unclipped (``clip_low=1``, ``clip_high=``
                                           :data:`UNCLIPPED`), ``cov_mode="kl_cov"``, ``cov_ratio=kl_cov_ratio``,
                                           ``kl_cov_coef=ppo_kl_coef`` (0.0002, 1)
``policy_loss.loss_mode="bypass_mode"``    ``old_log_prob`` are the rollout log-probs; ``rollout_correction.loss_type``
                                           ``"ppo_clip"``: as vanilla; ``"reinforce"``: ``policy_loss="reinforce"``
                                           with fused_rl's on-policy ``rollout_is`` (``pi / pi_rollout`` from the
                                           current log-probs; ``rollout_is`` token / sequence, threshold ``upper``:
                                           ``*_truncate``, ``"lower_upper"``: ``*_mask``); ``rollout_rs`` and
                                           ``rollout_is_batch_normalize`` from the current log-probs
                                           (:mod:`fused_rl.integrations.verl_rollout`; fused: a no-grad
                                           log-prob pass first); the ``rollout_is_weights`` argument ignored, as
                                           verl
``policy_loss.loss_mode="dro"``            ``policy_loss="reinforce"``, ``kl="k2"`` against ``old_log_prob``,
                                           ``beta=policy_loss.dro_beta``; not with ``rollout_is_weights`` (verl
                                           weights the penalty too) or, fused, ``use_kl_loss``
``clip_ratio``, ``clip_ratio_low/high``    ``clip_low``, ``clip_high`` (low/high default to clip_ratio)
``clip_ratio_c`` (default 3.0)             ``dual_clip`` (vanilla); dppo's ``delta`` (there verl's default is 20)
``loss_agg_mode``                          ``agg`` (same names; ``token-sum``: ``token-mean`` over ``1 / dp_size``)
``global_batch_info``                      ``dp_size``, ``batch_num_tokens``: ``token_normalizer =
                                           batch_num_tokens / dp_size``; ``global_batch_size``: the ``seq-mean-*``
                                           loss over ``global_batch_size / dp_size`` responses (else the local
                                           non-empty ones); ``loss_scale_factor``: ``max_len`` of
                                           ``seq-mean-token-sum-norm`` (else ``T``)
``kl_loss_type`` kl/k1, mse/k2, abs,       ``kl`` k1, k2, abs, ``low_var_kl``; with a ``"+"`` suffix
low_var_kl/k3 (each with ``"+"``)          the straight-through ``k1+``, ``abs+``, ``low_var_kl+``
``kl_loss_coef`` (with ``use_kl_loss``)    ``beta``
``entropy_coeff``                          ``entropy_coef``
=========================================  ===================================================

Differences from verl, all documented in ``docs/migration.md``:

* verl clamps ``log_prob - old_log_prob`` to ``[-20, 20]`` before ``exp`` (vanilla, sapo, cispo, dppo) and GSPO's log
  ratio at 10; fused_rl does not: identical whenever the log ratio stays inside those bounds (``ppo_kl`` is verl's, from
  the clamped log ratio).
* verl's token means divide by ``sum(mask)`` unclamped (NaN for an empty batch) and a response's token mean by
  ``count + 1e-8``; fused_rl clamps the counts at 1 and divides by ``count`` (0 loss, 0 gradient for empty rows).
* verl's GSPO ratio ``sg(s_i) * pi / sg(pi)`` is fused_rl's ``gspo_token`` exactly (fused_rl's plain
  ``gspo`` spreads ``s_i / |y_i|`` over the tokens instead: the same gradient for advantages constant
  over each response).
* GMPO's ``pg_clipfrac`` / ``pg_clipfrac_lower`` are verl's: the tokens whose log-ratio is outside
  ``[-clip_low, clip_high]`` with ``A > 0`` / ``A < 0`` (whether or not the sign-aware min picks the clipped
  term; fused_rl's own ``clip_frac`` counts only where it does). The loss and its gradient are verl's.
* :func:`compute_policy_loss_from_hidden` raises when the policy term and the KL / entropy terms would need two
  aggregations (verl aggregates sapo's policy term by ``seq-mean-token-mean`` and geo_mean's by a mean over all
  ``B`` responses, the KL and entropy terms by ``loss_agg_mode`` and ``global_batch_info``; one fused pass has one
  aggregation): sapo with another ``loss_agg_mode``, geo_mean with a KL or entropy term.
* The metrics are 0-dim detached tensors (verl's ``.item()`` floats: no host sync here; verl's ``Metric`` takes
  either).
* verl's cispo weight is ``sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``, two-sided; fused_rl's cispo
  truncates above only, so ``clip_ratio_low < 1`` raises ``NotImplementedError``. ``pg_clipfrac`` is verl's
  (tokens whose weight is truncated, ``r > 1 + clip_ratio_high``, whatever the sign of ``A``), sapo's is 0.
* ``bypass_mode``'s rejection sampling (``rollout_rs``) and applied ``rollout_is_batch_normalize``: the loss
  functions apply them (the policy term aggregated over the kept tokens, as verl; fused, the KL and entropy terms
  over every token, as verl's actor), while :func:`policy_loss_config_from_verl` raises ``NotImplementedError``
  for them (a config cannot hold a batch's current log-probs); an all-rejected or all-masked batch gives a zero loss
  and finite diagnostics (verl: a NaN loss, a raise); a NaN threshold raises (verl: a NaN loss); a NaN rollout
  log-prob (with ``check_inputs=False``) has log-ratio 0 in the correction. Other loss modes and
  ``kl_loss_type="full"`` raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..config import AGGREGATIONS, IGNORE_INDEX, OptionError, PolicyLossConfig
from ..loss_math import (Normalizer, compute_policy_loss as _compute_policy_loss, config_scalar, dppo_keep,
                         masked_mean, metrics as loss_metrics, responses_factor)
from ..ops import _check_linear_targets, linear_policy_loss, linear_token_logprobs
from ..outputs import PolicyLossOutput
from ..validation import _fail, adapter_inputs, positive_integer
from .verl_rollout import WEIGHT_CAP, BypassCorrection, correct, parse_rejection

#: Every loss mode verl 0.9.1 registers.
LOSS_MODES = ("vanilla", "gspo", "geo_mean", "gpg", "sapo", "cispo", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov",
              "bypass_mode")
#: verl's ``loss_agg_mode`` values: fused_rl's aggregations and ``token-sum`` (verl 0.9).
LOSS_AGG_MODES = AGGREGATIONS + ("token-sum",)
#: verl's bound of ``log_prob - old_log_prob`` before ``exp`` in vanilla, sapo, cispo and dppo (and their ``ppo_kl``).
LOG_RATIO_CLAMP = 20.0
_CLAMPED_LOG_RATIO = ("vanilla", "sapo", "cispo", "dppo_tv", "dppo_kl")
#: ``clip_high`` of kl_cov's unclipped ``-A r`` as fused_rl's ppo_clip (``clip_low = 1``: no lower bound either).
UNCLIPPED = 1e30
#: verl 0.9.1's defaults of the Entropy Mechanism losses' ``policy_loss`` options (``None`` there means these).
_COV_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                 "ppo_kl_coef": 1.0}
_KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "abs": "abs", "low_var_kl": "low_var_kl",
             "k3": "low_var_kl"}
# "X+": the value of X with the gradient of k2 (k2+ is k2 itself)
_KL_TYPES.update({f"{name}+": ("k2" if ours == "k2" else f"{ours}+") for name, ours in list(_KL_TYPES.items())})


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _get_number(config: Any, name: str, default: float) -> float:
    """verl's numeric option ``name`` as a float; a bool or a string (``kl_loss_coef: true``, ``"0.2"``) raises,
    named as verl names it, rather than being read as 1.0 / parsed."""
    value = _get(config, name, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"verl {name} must be a number, got {value!r}")
    return float(value)


def _loss_mode(config: Any, loss_mode: Optional[str]) -> str:
    return loss_mode or _get(_get(config, "policy_loss"), "loss_mode", "vanilla")


def _loss_scale_factor(config: Any, actor: bool) -> Optional[int]:
    """verl's ``loss_scale_factor``: the registered losses read ``global_batch_info``'s; the actor's ``ppo_loss`` (the
    fused entry point, ``actor``) first overwrites that with the top-level option (None included)."""
    value = _get(config, "loss_scale_factor") if actor else _get(_get(config, "global_batch_info"),
                                                                  "loss_scale_factor")
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        raise ValueError("verl loss_scale_factor must be a Python integer (it sets fused_rl's max_len), not a tensor")
    return positive_integer(value, "verl loss_scale_factor")


def _check_loss_mode(loss_mode: str) -> None:
    if loss_mode not in LOSS_MODES:
        raise NotImplementedError(f"verl policy_loss.loss_mode={loss_mode!r} is not one of verl 0.9.1's loss modes "
                                  f"that fused_rl maps: {LOSS_MODES}")


def policy_loss_config_from_verl(
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    *,
    response_length: int,
    loss_mode: Optional[str] = None,
    temperature: float = 1.0,
    kl: bool = False,
    entropy: bool = False,
    actor: bool = False,
) -> PolicyLossConfig:
    """The :class:`PolicyLossConfig` of verl's loss: with :func:`verl_normalization`'s token normalizer and factor,
    ``factor * loss(config)`` is verl 0.9.1's.

    ``kl=True`` folds verl's actor KL loss in (``kl_loss_coef``, ``kl_loss_type``, used when
    ``use_kl_loss`` is true; absent it is false, verl's ``ActorConfig`` default); ``entropy=True`` folds
    ``entropy_coeff`` in. ``response_length`` is the padded ``T`` (``seq-mean-token-sum-norm``'s divisor unless
    ``loss_scale_factor`` is set: ``global_batch_info``'s, or with ``actor`` (verl's ``ppo_loss``) the top-level
    option). sapo reads ``tau_pos`` / ``tau_neg`` (verl's ``ActorConfig`` defaults 1.0 /
    1.05), cispo ``clip_ratio_high`` (``clip_ratio_low`` must be >= 1).

    bypass_mode's rejection sampling (``rollout_rs``) and applied batch-normalized weights depend on the batch of
    current log-probs, which a config cannot say: those raise ``NotImplementedError`` here (:func:`compute_policy_loss`,
    :func:`get_policy_loss_fn` and :func:`compute_policy_loss_from_hidden` apply them).
    """
    if _loss_mode(config, loss_mode) == "bypass_mode" and _bypass_correction(config).needs_current_logprobs:
        raise NotImplementedError(
            "verl bypass_mode's rollout_correction.rollout_rs / rollout_is_batch_normalize come from the current "
            "log-probs, which a PolicyLossConfig cannot express: use compute_policy_loss, get_policy_loss_fn or "
            "compute_policy_loss_from_hidden, which apply them")
    return _config_from_verl(config, loss_agg_mode, response_length=response_length, loss_mode=loss_mode,
                             temperature=temperature, kl=kl, entropy=entropy, actor=actor)


def _config_from_verl(config: Any, loss_agg_mode: str, *, response_length: int, loss_mode: Optional[str],
                      temperature: float = 1.0, kl: bool = False, entropy: bool = False, actor: bool = False,
                      explicit_weights: bool = False) -> PolicyLossConfig:
    """:func:`policy_loss_config_from_verl`; bypass_mode's reinforce without its weights with ``explicit_weights``
    (the caller passes them, and applies the rejection: :func:`fused_rl.integrations.verl_rollout.correct`)."""
    loss_mode = _loss_mode(config, loss_mode)
    _check_loss_mode(loss_mode)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise NotImplementedError(f"verl loss_agg_mode={loss_agg_mode!r} is not supported by fused_rl; "
                                  f"supported: {LOSS_AGG_MODES}")
    clip_ratio = _get_number(config, "clip_ratio", 0.2)
    fields: dict[str, Any] = dict(clip_low=_get_number(config, "clip_ratio_low", clip_ratio),
                                  clip_high=_get_number(config, "clip_ratio_high", clip_ratio),
                                  temperature=temperature)
    policy_agg = loss_agg_mode
    if loss_mode == "bypass_mode":
        loss_mode, rollout = _bypass(config, explicit_weights)  # verl's vanilla, or reinforce (+ correction)
        fields.update(rollout)
    if loss_mode == "vanilla":
        clip_ratio_c = _get_number(config, "clip_ratio_c", 3.0)
        if not clip_ratio_c > 1.0:
            raise ValueError(f"verl clip_ratio_c must be > 1 (dual-clip PPO), got {clip_ratio_c!r}")
        fields.update(policy_loss="ppo_clip", dual_clip=clip_ratio_c)
    elif loss_mode == "gspo":
        fields.update(policy_loss="gspo_token")
    elif loss_mode == "geo_mean":
        fields.update(policy_loss="gmpo")
        policy_agg = "seq-mean-token-mean"  # verl's geo_mean: the mean over the B responses' values
    elif loss_mode == "sapo":
        del fields["clip_low"], fields["clip_high"]  # unused by sapo
        fields.update(policy_loss="sapo", sapo_temperature_pos=_get_number(config, "tau_pos", 1.0),
                      sapo_temperature_neg=_get_number(config, "tau_neg", 1.05))
        policy_agg = "seq-mean-token-mean"  # verl's sapo ignores loss_agg_mode
    elif loss_mode == "cispo":
        if not fields["clip_low"] >= 1.0:
            raise NotImplementedError(
                f"verl's cispo weight is clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high), two-sided; fused_rl's "
                f"cispo truncates above only (min(r, 1 + clip_high)), so clip_ratio_low={fields['clip_low']!r} (a "
                "lower bound 1 - clip_ratio_low > 0) cannot be expressed: set clip_ratio_low >= 1 (no lower bound, "
                "as in the CISPO paper) to map it")
        fields.update(policy_loss="cispo", clip_low=0.0)  # clip_low: unused by cispo
    elif loss_mode in ("dppo_tv", "dppo_kl"):
        # clip_ratio(_low/_high) are the divergence bounds; verl reads the weight's truncation with
        # config.get("clip_ratio_c", 20.0) (an ActorConfig's own default is 3.0)
        fields.update(policy_loss=loss_mode, delta=_get_number(config, "clip_ratio_c", 20.0))
    elif loss_mode in ("clip_cov", "kl_cov"):
        fields.update(_cov_fields(config, loss_mode))
    elif loss_mode == "dro":  # -A logp + dro_beta / 2 (logp - old)^2: reinforce and k2 against the old log-probs
        del fields["clip_low"], fields["clip_high"]
        fields.update(policy_loss="reinforce", kl="k2", beta=_dro_beta(config))
    elif loss_mode == "gpg":
        fields.update(policy_loss="reinforce")
    fields["agg"] = "token-mean" if policy_agg == "token-sum" else policy_agg
    if policy_agg == "seq-mean-token-sum-norm":
        fields["max_len"] = _loss_scale_factor(config, actor) or _response_length(response_length)
    if kl and _get(config, "use_kl_loss", False):  # verl's ActorConfig default
        if loss_mode == "dro":
            raise NotImplementedError("verl loss_mode='dro' with use_kl_loss: DRO's penalty is fused_rl's k2 KL term "
                                      "against the old log-probs, and one fused pass has one KL term; use "
                                      "compute_policy_loss on per-token log-probs with verl's own KL loss")
        kl_type = _get(config, "kl_loss_type", "low_var_kl")
        if kl_type not in _KL_TYPES:
            raise NotImplementedError(f"verl kl_loss_type={kl_type!r} is not supported by fused_rl; "
                                      f"supported: {sorted(_KL_TYPES)}")
        fields.update(kl=_KL_TYPES[kl_type], beta=_get_number(config, "kl_loss_coef", 0.001))
    if entropy:
        fields["entropy_coef"] = _get_number(config, "entropy_coeff", 0.0)
    try:
        return PolicyLossConfig(**fields)
    except ValueError as exc:  # named by verl's option (clip_ratio_low=-0.1), as the TRL / OpenRLHF mappings do
        field = re.match(r"PolicyLossConfig\.(\w+)", str(exc))
        option = None if field is None else {**_VERL_OPTION_OF_FIELD, **_VERL_OPTION_OF_MODE_FIELD.get(loss_mode, {})
                                             }.get(field.group(1))
        if option is None:
            raise
        raise OptionError(f"verl {option}", fields[field.group(1)], exc) from exc


def _response_length(value: Any) -> int:
    """verl's padded response length as a positive int (int(4.5) divided by 4); a one-element tensor is read (a host
    sync: the config needs the number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    return positive_integer(value, "response_length")


#: The verl option each PolicyLossConfig field of :func:`_config_from_verl` comes from (error messages) ...
_VERL_OPTION_OF_FIELD = {"clip_low": "clip_ratio_low (or clip_ratio)", "clip_high": "clip_ratio_high (or clip_ratio)",
                         "dual_clip": "clip_ratio_c", "delta": "clip_ratio_c", "sapo_temperature_pos": "tau_pos",
                         "sapo_temperature_neg": "tau_neg", "beta": "kl_loss_coef", "entropy_coef": "entropy_coeff",
                         "rollout_is_min": "rollout_is_threshold", "rollout_is_max": "rollout_is_threshold"}
#: ... and where it depends on the loss mode.
_VERL_OPTION_OF_MODE_FIELD = {
    "kl_cov": {"cov_ratio": "policy_loss.kl_cov_ratio", "kl_cov_coef": "policy_loss.ppo_kl_coef"},
    "clip_cov": {"cov_ratio": "policy_loss.clip_cov_ratio", "clip_cov_lb": "policy_loss.clip_cov_lb",
                 "clip_cov_ub": "policy_loss.clip_cov_ub"},
    "dro": {"beta": "policy_loss.dro_beta"}}


def _dro_beta(config: Any) -> float:
    """verl's ``policy_loss.dro_beta``, which DRO requires positive (verl raises the same ``ValueError``)."""
    beta = _get(_get(config, "policy_loss"), "dro_beta")
    if beta is None or isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not beta > 0:
        raise ValueError(f"verl policy_loss.dro_beta must be a positive value when using DRO, got {beta!r}")
    return float(beta)


def _rollout_is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """verl's ``rollout_is_threshold``: a number (or numeric string) ``upper`` (TIS: truncate), or ``"lower_upper"``
    (IcePop: mask), each bound positive, ``lower <= upper`` (verl's ``_parse_rollout_is_threshold``)."""
    if isinstance(spec, str) and "_" in spec:
        parts = spec.split("_", 1)
    elif isinstance(spec, (str, numbers.Real)) and not isinstance(spec, bool):
        parts = [None, spec]
    else:
        raise ValueError(f"verl rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    try:
        lower, upper = (None if p is None else float(p) for p in parts)
    except ValueError as exc:
        raise ValueError(f"verl rollout_is_threshold {spec!r} is not a number or a 'lower_upper' string") from exc
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"verl rollout_is_threshold {spec!r}: bounds must be positive, lower <= upper")
    return upper, lower


def _bypass_correction(config: Any) -> BypassCorrection:
    """verl's bypass_mode ``policy_loss.rollout_correction``, parsed and checked as verl does: ``loss_type``
    ``"ppo_clip"`` (default) / ``"reinforce"``; weights when ``rollout_is`` (``"token"`` / ``"sequence"``) and
    ``rollout_is_threshold`` (default 2.0; an explicit None: no weights) are set: fused_rl's on-policy ``rollout_is``
    truncated at ``upper`` or masked outside ``"lower_upper"``; ``rollout_is_batch_normalize``; ``rollout_rs`` with
    ``rollout_rs_threshold`` (:func:`fused_rl.integrations.verl_rollout.parse_rejection`)."""
    corr = _get(_get(config, "policy_loss"), "rollout_correction")
    if corr is None:
        raise ValueError("verl loss_mode='bypass_mode' needs policy_loss.rollout_correction (verl raises too)")

    def option(name: str, default: Any) -> Any:  # verl's rollout_corr_config.get: an explicit None stays None
        return corr.get(name, default) if isinstance(corr, Mapping) else getattr(corr, name, default)

    loss_type = option("loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"verl rollout_correction.loss_type must be 'reinforce' or 'ppo_clip', got {loss_type!r}")
    level, threshold = option("rollout_is", None), option("rollout_is_threshold", 2.0)
    weights = None
    if level is not None and threshold is not None:  # else verl computes no weights
        if level not in ("token", "sequence"):
            raise ValueError(f"verl rollout_correction.rollout_is must be 'token', 'sequence' or None, got {level!r}")
        upper, lower = _rollout_is_threshold(threshold)
        if lower is not None and math.isinf(lower):
            raise ValueError(f"verl rollout_is_threshold {threshold!r}: the lower bound must be finite")
        kind = f"{level}_{'truncate' if lower is None else 'mask'}"
        # no weight exceeds WEIGHT_CAP: a larger (or infinite) upper bound is that one (a lower one above it: itself)
        bound = upper if upper <= WEIGHT_CAP else max(WEIGHT_CAP, lower or 0.0)
        weights = PolicyLossConfig(policy_loss="reinforce", rollout_is=kind, rollout_is_min=lower, rollout_is_max=bound)
    else:
        upper, lower = 2.0, None
    rs = option("rollout_rs", None)
    rejection = () if rs is None else parse_rejection(rs, option("rollout_rs_threshold", None))
    return BypassCorrection(loss_type, weights, bool(option("rollout_is_batch_normalize", False)), rejection,
                            upper, lower)


def _bypass(config: Any, explicit_weights: bool = False) -> tuple[str, dict[str, Any]]:
    """verl's ``bypass_mode`` (``old_log_prob`` are the rollout log-probs): ``("vanilla", {})`` for its
    ``rollout_correction.loss_type="ppo_clip"`` (verl's vanilla, its importance weights for metrics only), else
    ``("bypass_reinforce", fields)``: reinforce, with the weights ``pi / pi_rollout`` from the current log-probs as
    fused_rl's on-policy ``rollout_is`` (in the pass) unless ``explicit_weights`` (the caller passes them as
    ``rollout_is_weights``: :func:`fused_rl.integrations.verl_rollout.correct`)."""
    corr = _bypass_correction(config)
    if corr.loss_type == "ppo_clip":
        return "vanilla", {}
    fields: dict[str, Any] = dict(policy_loss="reinforce")
    if corr.weights is not None and not explicit_weights:
        fields.update(rollout_is=corr.weights.rollout_is, rollout_is_min=corr.weights.rollout_is_min,
                      rollout_is_max=corr.weights.rollout_is_max)
    return "bypass_reinforce", fields


def _metric_mode(config: Any, mode: str) -> str:
    """The loss mode whose metrics (and inputs) a call has: bypass_mode's dispatch, else ``mode``."""
    return _bypass(config)[0] if mode == "bypass_mode" else mode


def _old_of(metric_mode: str, old: torch.Tensor) -> Optional[torch.Tensor]:
    """The old log-probs of the loss: none for bypass_mode's reinforce (its ``old_log_prob`` are the rollout ones, its
    importance weights ``pi / pi_rollout`` fused_rl's on-policy rollout correction)."""
    return None if metric_mode == "bypass_reinforce" else old


def _cov_fields(config: Any, loss_mode: str) -> dict[str, Any]:
    """clip_cov: verl's PPO objective (no dual clip) with fused_rl's ``cov_mode="clip_cov"``; kl_cov: its unclipped
    ``-A r`` (ppo_clip with ``clip_low = 1``, ``clip_high =`` :data:`UNCLIPPED`) with ``cov_mode="kl_cov"``."""
    policy = _get(config, "policy_loss")
    option = lambda name: _get_number(policy, name, _COV_DEFAULTS[name])  # noqa: E731
    if loss_mode == "clip_cov":
        return dict(policy_loss="ppo_clip", cov_mode="clip_cov", cov_ratio=option("clip_cov_ratio"),
                    clip_cov_lb=option("clip_cov_lb"), clip_cov_ub=option("clip_cov_ub"))
    return dict(policy_loss="ppo_clip", clip_low=1.0, clip_high=UNCLIPPED, cov_mode="kl_cov",
                cov_ratio=option("kl_cov_ratio"), kl_cov_coef=option("ppo_kl_coef"))


def _refuse_dro_weights(mode: str, rollout_is_weights: Optional[torch.Tensor]) -> None:
    if mode == "dro" and rollout_is_weights is not None:
        raise NotImplementedError("verl loss_mode='dro' with rollout_is_weights: verl weights DRO's quadratic penalty "
                                  "too, which fused_rl's KL term (the penalty here) never is")


def verl_normalization(config: Any, loss_agg_mode: str, loss_mode: str, mask: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> tuple[Normalizer, torch.Tensor]:
    """``(token_normalizer, factor)``: verl 0.9.1's ``agg_loss(..., **config.global_batch_info)`` as fused_rl's
    aggregation of :func:`policy_loss_config_from_verl`'s config (``mask (B, T)`` boolean; ``factor`` a 0-dim
    tensor, no host sync). With ``dp_size`` (1 when absent), ``batch_num_tokens`` and ``global_batch_size`` from
    ``global_batch_info``:

    * ``token-mean``: ``sum(l m) / batch_num_tokens * dp_size`` (``sum(m)`` when None): normalizer
      ``batch_num_tokens / dp_size``;
    * ``token-sum``: ``sum(l m) * dp_size``: normalizer ``1 / dp_size``;
    * ``seq-mean-*``: the responses' values summed over ``global_batch_size / dp_size`` (when None, the local
      count of non-empty responses): factor ``B dp_size / global_batch_size`` on fused_rl's mean over ``B`` rows;
    * geo_mean: verl's mean over the ``B`` responses, ``global_batch_info`` unread: factor 1.

    verl raises for ``dp_size > 1`` without the global count; so does this.
    """
    info = _get(config, "global_batch_info")
    dp_size = positive_integer(_get(info, "dp_size", 1), "verl global_batch_info.dp_size")
    one = torch.ones((), dtype=dtype, device=mask.device)
    if loss_mode == "geo_mean":
        return None, one
    policy_agg = "seq-mean-token-mean" if loss_mode == "sapo" else loss_agg_mode
    if policy_agg == "token-sum":
        return 1.0 / dp_size, one
    if policy_agg == "token-mean":
        tokens = _get(info, "batch_num_tokens")
        if tokens is None and dp_size > 1:
            raise ValueError("verl global_batch_info: batch_num_tokens is required when dp_size > 1")
        return (None if tokens is None else tokens / dp_size), one
    rows = _get(info, "global_batch_size")
    if rows is None and dp_size > 1:
        raise ValueError("verl global_batch_info: global_batch_size is required when dp_size > 1")
    return None, responses_factor(mask, dtype, dp_size, rows)


def _verl_rollout_weights(weights: Optional[torch.Tensor], mask: torch.Tensor, mode: str) -> Optional[torch.Tensor]:
    """``rollout_is_weights`` as verl applies them: per token, but for geo_mean one weight a response, the geometric
    mean ``exp(sum_t m log(w + 1e-10) / (sum_t m + 1e-8))`` of its tokens' (verl's ``compute_policy_loss_geo_mean``),
    as ``(B,)``."""
    if weights is None or mode != "geo_mean" or weights.dim() != 2:
        return weights
    m = mask.to(torch.float64)
    log_w = torch.where(mask, torch.log(weights.detach().to(torch.float64) + 1e-10), 0.0)
    return torch.exp(log_w.sum(dim=-1) / (m.sum(dim=-1) + 1e-8)).to(weights.dtype)


def _check_verl_inputs(shape: tuple, device: torch.device, device_owner: str, old_log_prob: torch.Tensor,
                       advantages: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is_weights: Optional[torch.Tensor], check_inputs: bool) -> torch.Tensor:
    """verl's per-token arguments checked under verl's names (:func:`fused_rl.validation.adapter_inputs`)."""
    return adapter_inputs(shape, device, device_owner, check_inputs, logprobs=(("old_log_prob", old_log_prob),),
                          advantages=("advantages", advantages), mask=("response_mask", response_mask),
                          weights=("rollout_is_weights", rollout_is_weights))


def _verl_metrics(out_metrics: dict[str, torch.Tensor], config: PolicyLossConfig, old: torch.Tensor,
                  logp: torch.Tensor, mask: torch.Tensor, loss_mode: str, advantages: torch.Tensor):
    """verl's ``(pg_clipfrac, ppo_kl, pg_clipfrac_lower)``; ``ppo_kl = masked mean(old - logp)``, the log ratio
    clamped to ``[-20, 20]`` first in vanilla, sapo, cispo and dppo (as verl)."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = logp.detach() - old
    if loss_mode in _CLAMPED_LOG_RATIO:
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ppo_kl = masked_mean(-log_ratio, mask)
    if loss_mode == "gpg":  # verl's gpg returns no metrics
        return zero, zero.clone(), zero.clone()
    if loss_mode in ("sapo", "dro", "bypass_reinforce"):  # sapo: 0 clip fractions; dro, reinforce: ppo_kl alone
        return zero, ppo_kl, zero.clone()
    if loss_mode == "clip_cov":  # the dropped tokens (verl's corr == 0), ppo_kl; no pg_clipfrac_lower
        return out_metrics["cov_frac"], ppo_kl, zero
    if loss_mode == "kl_cov":  # verl's ppo_kl here is the masked mean |log r|, alone
        return zero, masked_mean(log_ratio.abs(), mask), zero.clone()
    if loss_mode in ("dppo_tv", "dppo_kl"):  # the dropped tokens; the kept ones whose weight is truncated
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(log_ratio)
        kept = dppo_keep(logp, old, adv, config)
        return out_metrics["clip_frac"], ppo_kl, masked_mean(kept & (log_ratio.exp() > config.delta), mask)
    if loss_mode == "geo_mean":  # verl: token log-ratios outside the bounds, split by the advantage's sign
        clipped = (log_ratio < -config_scalar(log_ratio, config.clip_low)) | (log_ratio > config.clip_high)
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
        return masked_mean(clipped & (adv > 0), mask), ppo_kl, masked_mean(clipped & (adv < 0), mask)
    # cispo: fused_rl's clip_frac is verl's, the tokens with r > 1 + clip_ratio_high (clip_ratio_low >= 1)
    return out_metrics["clip_frac"], ppo_kl, out_metrics["clip_frac_dual"] if loss_mode == "vanilla" else zero


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    loss_mode: Optional[str] = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's policy loss ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` from per-token
    log-probs ``(B, T)``, computed by :func:`fused_rl.loss_math.compute_policy_loss` and aggregated as verl 0.9.1's
    ``agg_loss`` with ``config.global_batch_info`` (:func:`verl_normalization`).

    ``pg_clipfrac``: masked fraction of tokens where the clipped term is active (``r > 1+clip_high, A > 0``
    or ``r < 1-clip_low, A < 0``; cispo: ``r > 1+clip_high``, any ``A``; geo_mean: log-ratio outside the bounds and
    ``A > 0``; dppo: the tokens outside the trust region; clip_cov: the dropped tokens; gpg, sapo, dro, kl_cov,
    bypass_mode's reinforce: 0); ``pg_clipfrac_lower``: where the dual-clip cap ``-c A`` binds (vanilla: ``A < 0, r >
    c``; geo_mean: log-ratio outside the bounds and ``A < 0``; dppo: the kept tokens with ``r > clip_ratio_c``; else
    0); ``ppo_kl``: masked mean of ``old_log_prob - log_prob`` (vanilla, sapo, cispo, dppo: the log ratio clamped to
    ``[-20, 20]`` first, as verl; kl_cov: of ``|log r|``).
    The loss mode comes from ``config.policy_loss.loss_mode`` (or ``loss_mode``), default ``"vanilla"``.
    ``rollout_is_weights`` (verl's rollout correction, ``(B, T)``, computed by verl) multiplies the policy
    term per token, as verl's ``pg_losses * rollout_is_weights``.

    Inputs are checked as every fused_rl entry point checks them (``ValueError`` naming verl's argument):
    ``log_prob`` a floating ``(B, T)`` tensor; ``old_log_prob`` and ``response_mask`` ``(B, T)`` on its device;
    ``advantages`` and ``rollout_is_weights`` ``(B, T)`` as verl's, or ``(B,)``, one value a response, broadcast
    over its tokens. With ``check_inputs`` (one host sync): a 0/1 ``response_mask`` and, where it is set, finite
    ``advantages``, finite ``old_log_prob <= 0.5`` (log-probs) and finite ``rollout_is_weights >= 0``; padding
    positions are never read and may hold anything.
    """
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        loss_mode, check_inputs)[:4]


def _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                 loss_mode, check_inputs):
    """:func:`compute_policy_loss`'s four values and bypass_mode's ``rollout_corr/*`` metrics (else ``{}``)."""
    if not isinstance(log_prob, torch.Tensor):
        _fail(f"log_prob must be a torch.Tensor, got {type(log_prob).__name__}")
    if log_prob.dim() != 2 or not log_prob.is_floating_point():
        _fail(f"log_prob must be a floating (B, T) tensor, got {log_prob.dtype} of shape {tuple(log_prob.shape)}")
    shape = tuple(log_prob.shape)
    mask = _check_verl_inputs(shape, log_prob.device, "log_prob is", old_log_prob, advantages, response_mask,
                              rollout_is_weights, check_inputs)
    mode = _loss_mode(config, loss_mode)
    _refuse_dro_weights(mode, rollout_is_weights)
    cfg = _config_from_verl(config, loss_agg_mode, response_length=shape[1], loss_mode=mode, explicit_weights=True)
    weights = _verl_rollout_weights(rollout_is_weights, mask, mode)
    extra: dict[str, torch.Tensor] = {}
    if mode == "bypass_mode":  # verl ignores rollout_is_weights: its weights and mask come from the log-probs
        fixed = correct(_bypass_correction(config), log_prob, old_log_prob, mask)
        mask, weights, extra = fixed.mask, fixed.weights, fixed.metrics
    normalizer, factor = verl_normalization(config, loss_agg_mode, mode, mask, log_prob.dtype)
    old = old_log_prob.detach().to(log_prob.dtype)
    metric_mode = _metric_mode(config, mode)

    def per_token(x: torch.Tensor) -> torch.Tensor:  # a (B,) tensor: one value a response, over its tokens
        return (x if x.dim() == 2 else x.unsqueeze(1).expand(shape)).detach().to(log_prob.dtype)

    adv = per_token(advantages)
    weights = None if weights is None else per_token(weights)
    loss, metrics = _compute_policy_loss(log_prob, adv, mask, cfg, old_logprobs=_old_of(metric_mode, old),
                                         rollout_is_weights=weights, ref_logprobs=old if mode == "dro" else None,
                                         token_normalizer=normalizer)
    return (loss * factor,) + _verl_metrics(metrics, cfg, old, log_prob, mask, metric_mode, adv) + (extra,)


#: verl's metric names of the modes that return fewer than the three.
_METRIC_NAMES = {"gpg": (), "dro": ("actor/ppo_kl",), "kl_cov": ("actor/ppo_kl",),
                 "bypass_reinforce": ("actor/ppo_kl",), "clip_cov": ("actor/pg_clipfrac", "actor/ppo_kl")}


def get_policy_loss_fn(loss_mode: str, *, check_inputs: bool = True):
    """verl 0.9.1's registered policy loss ``loss_mode`` on fused_rl: a function ``(old_log_prob, log_prob,
    advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None)`` -> ``(pg_loss,
    pg_metrics)`` with verl's metric names (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``;
    gpg: none; bypass_mode also verl's ``rollout_corr/*`` diagnostics, :mod:`fused_rl.integrations.verl_rollout`)
    as 0-dim detached tensors (verl's are ``.item()`` floats; its ``Metric`` reads either, so the host
    sync happens where verl records them, not in the loss); see :func:`compute_policy_loss`. Use it by name in verl with
    ``register_policy_loss("fused_" + loss_mode)(get_policy_loss_fn(loss_mode))``. ``loss_agg_mode`` defaults as
    verl's function of that mode does (gspo, sapo: ``seq-mean-token-mean``; else ``token-mean``)."""
    _check_loss_mode(loss_mode)  # an unsupported mode raises now, not at the first step
    default_agg = "seq-mean-token-mean" if loss_mode in ("gspo", "sapo") else "token-mean"

    def policy_loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = default_agg,
                       config: Any = None, rollout_is_weights: Optional[torch.Tensor] = None):
        loss, *metrics, extra = _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                             config, rollout_is_weights, loss_mode, check_inputs)
        names = _METRIC_NAMES.get(_metric_mode(config, loss_mode))
        if names is not None:  # as verl: gpg none, dro, kl_cov and bypass's reinforce ppo_kl alone, clip_cov no lower
            return loss, dict(zip(names, metrics[1:2] if names == ("actor/ppo_kl",) else metrics)) | extra
        return loss, dict(zip(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"), metrics)) | extra

    policy_loss_fn.__name__ = f"compute_policy_loss_{loss_mode}"
    return policy_loss_fn


def compute_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    responses: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    *,
    bias: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    loss_mode: Optional[str] = None,
    backend: str = "auto",
    rollout_is_weights: Optional[torch.Tensor] = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossOutput]:
    """The fused verl actor loss from the hidden states that predict ``responses``.

    ``hidden (B, T, H)`` is the actor's last hidden state at the positions predicting ``responses (B, T)``
    (verl's ``logits[:, -T-1:-1]`` positions), ``weight (V, H)`` / ``bias`` the ``lm_head``, ``temperature``
    verl's rollout temperature (verl divides the logits by it). Returns verl's
    ``(policy_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` plus the :class:`PolicyLossOutput` (detached
    ``logprobs`` / ``entropy`` for logging). ``policy_loss`` includes ``kl_loss_coef * kl_loss`` when
    ``use_kl_loss`` is true (absent: false, as verl's default; then ``ref_log_prob`` is required), and ``- entropy_coeff
    * entropy_loss``, each aggregated with ``loss_agg_mode`` and ``global_batch_info`` as verl 0.9.1's ``ppo_loss``
    does. ``rollout_is_weights`` as in :func:`compute_policy_loss` (the policy term only).

    bypass_mode: verl's ``rollout_corr/*`` diagnostics are added to the output's ``metrics``; with rejection
    sampling or applied batch-normalized weights a no-grad :func:`fused_rl.linear_token_logprobs` pass computes the
    current log-probs first (one more logits GEMM and softmax pass, nothing stored), and the rejection enters the
    policy term's weights (verl aggregates the policy loss over the kept tokens, its entropy and KL losses over every
    token).

    Checks as :func:`compute_policy_loss`, against ``hidden``'s ``(B, T)`` and device (``responses``: int32 /
    int64; ``advantages`` / ``rollout_is_weights`` may be ``(B,)`` here too); :func:`fused_rl.linear_policy_loss`
    then checks the rest under its own names (``responses`` in ``[0, V)`` as ``targets``, ``ref_log_prob`` as
    ``ref_logprobs``): with ``check_inputs``, two host syncs (three with bypass_mode's log-prob pass).
    """
    shape = _check_linear_targets(hidden, weight, bias, responses, "responses")
    mask = _check_verl_inputs(shape, hidden.device, "hidden is", old_log_prob, advantages, response_mask,
                              rollout_is_weights, check_inputs)
    mode = _loss_mode(config, loss_mode)
    _refuse_dro_weights(mode, rollout_is_weights)
    if _get(config, "use_kl_loss", False) and ref_log_prob is None:  # verl's actor reads data["ref_log_prob"]
        raise ValueError("verl use_kl_loss=True needs ref_log_prob (the KL loss would silently be left out)")
    corr = _bypass_correction(config) if mode == "bypass_mode" else None
    two_passes = corr is not None and corr.needs_current_logprobs
    cfg = _config_from_verl(config, loss_agg_mode, response_length=shape[1], loss_mode=mode, temperature=temperature,
                            kl=ref_log_prob is not None, entropy=True, actor=True, explicit_weights=two_passes)
    if mode in ("sapo", "geo_mean") and (cfg.kl is not None or cfg.entropy_coef != 0.0) and (
            mode == "geo_mean" or loss_agg_mode != "seq-mean-token-mean"):
        # verl aggregates sapo's policy term by seq-mean-token-mean and geo_mean's by a mean over all B responses,
        # its KL and entropy terms by loss_agg_mode over the non-empty (or global) responses; one fused pass has one
        raise NotImplementedError(
            f"verl loss_mode={mode!r} with loss_agg_mode={loss_agg_mode!r} and a KL loss or entropy_coeff: verl "
            "aggregates the policy term and the KL / entropy terms differently (sapo: seq-mean-token-mean; geo_mean: "
            "a mean over all B responses), which one fused pass cannot; use compute_policy_loss on per-token "
            "log-probs with verl's own agg_loss for the KL and entropy terms"
            + (", or loss_agg_mode='seq-mean-token-mean'" if mode == "sapo" else ""))
    weights = None if mode == "bypass_mode" else _verl_rollout_weights(rollout_is_weights, mask, mode)  # verl ignores
    kept = mask
    if two_passes:  # the rejection / normalized weights need the batch's current log-probs first: a no-grad pass
        with torch.no_grad():
            current = linear_token_logprobs(hidden, weight, responses.masked_fill(~mask, IGNORE_INDEX), bias=bias,
                                            temperature=temperature, backend=backend, check_inputs=check_inputs)
        fixed = correct(corr, current, old_log_prob, mask)
        kept = fixed.mask
        # verl aggregates the policy loss over the kept tokens, the entropy and KL losses over all: the policy term's
        # weights carry the difference
        weights = _kept_factor(config, loss_agg_mode, mask, kept, torch.promote_types(hidden.dtype, torch.float32))
        weights = weights if fixed.weights is None else weights * fixed.weights.to(weights.dtype)
    normalizer, factor = verl_normalization(config, loss_agg_mode, mode, mask)
    metric_mode = _metric_mode(config, mode)
    out = linear_policy_loss(hidden, weight, responses, advantages, mask, bias=bias,
                             old_logprobs=_old_of(metric_mode, old_log_prob),
                             ref_logprobs=old_log_prob if mode == "dro" else (ref_log_prob if cfg.kl is not None
                                                                             else None), config=cfg,
                             rollout_logprobs=old_log_prob if cfg.rollout_is else None, rollout_is_weights=weights,
                             token_normalizer=normalizer, backend=backend, compute_entropy=True,
                             check_inputs=check_inputs)
    old = old_log_prob.detach().to(out.logprobs.dtype)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(shape)
    pass_metrics = out.metrics
    if corr is not None:  # verl's rollout_corr/* metrics (in one pass, from the pass's own log-probs)
        out.metrics.update((fixed if two_passes else correct(corr, out.logprobs, old_log_prob, mask)).metrics)
        if corr.rejection:  # verl's policy metrics are over the kept tokens
            pass_metrics = loss_metrics(torch.exp(out.logprobs - old), adv.detach().to(old.dtype), kept, cfg, None,
                                        None)
    loss = out.loss * factor.to(out.loss.dtype)
    return (loss,) + _verl_metrics(pass_metrics, cfg, old, out.logprobs, kept, metric_mode, adv) + (out,)


def _kept_factor(config: Any, loss_agg_mode: str, mask: torch.Tensor, kept: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """The per-token factor ``f`` on the policy term with which fused_rl's aggregation over ``mask`` is verl's over
    the ``kept`` tokens (bypass_mode's rejection): ``f = k`` times ``sum(m) / sum(k)`` for token-mean without
    ``global_batch_info.batch_num_tokens``; for the ``seq-mean-*`` modes ``S_m / S_k`` without
    ``global_batch_size`` (``S``: the responses with a token) and, for seq-mean-token-mean, ``n_i / k_i`` (response
    i's token and kept-token counts); token-sum: ``k``. In ``dtype``; 0 where a token is not kept."""
    info = _get(config, "global_batch_info")
    k = kept.to(dtype)

    def share(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:  # where part = 0, k = 0 too
        return total.to(dtype) / part.clamp(min=1).to(dtype)

    if loss_agg_mode == "token-mean":
        return k * share(mask.sum(), kept.sum()) if _get(info, "batch_num_tokens") is None else k
    if loss_agg_mode == "token-sum":
        return k
    if loss_agg_mode == "seq-mean-token-mean":
        k = k * share(mask.sum(dim=-1, keepdim=True), kept.sum(dim=-1, keepdim=True))
    if _get(info, "global_batch_size") is None:
        k = k * share(mask.any(dim=-1).sum(), kept.any(dim=-1).sum())
    return k

__all__ = ["compute_policy_loss", "compute_policy_loss_from_hidden", "get_policy_loss_fn",
           "policy_loss_config_from_verl", "verl_normalization", "LOSS_MODES", "LOSS_AGG_MODES"]
