"""verl 0.9.1's ``bypass_mode`` rollout correction from the current log-probs (verl's
``trainer/ppo/rollout_corr_helper.py``): importance weights, optionally batch-normalized, rejection sampling
(``rollout_rs``) and the ``rollout_corr/*`` diagnostics, all detached (verl computes them under ``no_grad``).

In bypass_mode verl's ``old_log_prob`` are the rollout log-probs, so everything here is a function of the current
log-probs ``logp`` and the rollout ones: ``log r = logp - rollout`` per unmasked token (0 where the rollout log-prob
is NaN, a token the engine did not score, as :func:`fused_rl.loss_math.rollout_weights` reads it; padding is never
read), ``l = clamp(log r, -20, 20)``.

* **Weights** (``rollout_is`` token / sequence; threshold ``upper`` truncates, ``"lower_upper"`` masks):
  :func:`fused_rl.loss_math.rollout_weights`. ``rollout_is_batch_normalize`` divides them by their batch mean
  (token level: over the tokens; sequence level: of each non-empty response's weight over those responses; over
  every process when ``torch.distributed`` is initialized, as verl) when that mean is > 1e-8.
* **Rejection** (``rollout_rs``: comma-separated options, one threshold each or one shared): the statistic of ``l``,
  k1 ``-l``, k2 ``l^2 / 2``, k3 ``exp(l) - 1 - l`` (:func:`fused_rl.loss_math.kl_estimator` with ``d = l``), per
  token (``token_k*``) or per response (``seq_sum_k*`` / ``seq_mean_k*``: the masked sum / mean; ``seq_max_k2`` /
  ``_k3``: the max). k1 keeps ``log(lower) <= stat <= log(upper)`` (threshold ``"lower_upper"``, or ``upper`` alone
  with ``lower = 1 / upper``), k2 / k3 ``stat <= upper``; a token stays in the loss when every option keeps it (a
  sequence option keeps or drops the whole response). The loss then aggregates over the kept tokens.

The diagnostics are verl's names and definitions, as 0-dim detached fp32 tensors (no host sync; verl's are
``.item()`` floats), computed on the mask before rejection. verl raises for an all-masked batch, and for an
effective sample size of no weight; here those are finite: masked means and extrema over no token 0 (so the
chi-square divergences ``E[.] - 1`` are -1), the effective sample size 0. The ``*_std``
metrics are exact (verl's means divide by ``count + 1e-8``, which leaves a variance of ~1e-8 x^2 for a constant x).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import PolicyLossConfig
from ..loss_math import ROLLOUT_LOG_RHO_BOUND, _sequence_mean, kl_estimator, rollout_weights

#: verl 0.9.1's ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``).
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
#: verl's floor of the batch mean below which ``rollout_is_batch_normalize`` leaves the weights as they are.
NORMALIZE_FLOOR = 1e-8
#: The largest importance weight, ``exp(20)`` (the log-ratio's bound): a threshold at or above it truncates nothing.
WEIGHT_CAP = math.exp(ROLLOUT_LOG_RHO_BOUND)


@dataclass(frozen=True)
class Rejection:
    """One ``rollout_rs`` option: ``option`` (one of :data:`REJECTION_OPTIONS`), ``upper`` and, for k1, ``lower``
    (ratio bounds; the statistic is compared with their logs)."""

    option: str
    upper: float
    lower: Optional[float] = None

    @property
    def kind(self) -> str:
        return self.option[-2:]

    @property
    def level(self) -> str:
        """``"token"``, or the per-response reduction ``"sum"`` / ``"mean"`` / ``"max"``."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def bounds(self) -> tuple[Optional[float], float]:
        """The statistic's ``(lower, upper)`` bounds: k1's log ratio bounds, else ``(None, upper)``."""
        if self.kind == "k1":
            return math.log(self.lower), math.log(self.upper)
        return None, self.upper


@dataclass(frozen=True)
class BypassCorrection:
    """verl's ``policy_loss.rollout_correction`` of bypass_mode: ``loss_type`` (``"ppo_clip"`` / ``"reinforce"``);
    ``weights`` the :class:`PolicyLossConfig` of the importance weights (``rollout_is`` / ``_min`` / ``_max``;
    None when verl computes none), ``batch_normalize``, ``rejection`` (empty: none); ``upper`` / ``lower`` verl's
    threshold as given (``inf`` allowed: the config's ``rollout_is_max`` is then :data:`WEIGHT_CAP`, the same
    weights), which the metrics read."""

    loss_type: str
    weights: Optional[PolicyLossConfig]
    batch_normalize: bool
    rejection: tuple[Rejection, ...]
    upper: float = 2.0
    lower: Optional[float] = None

    @property
    def applied_weights(self) -> bool:
        """The weights multiply the policy term (reinforce; ppo_clip's are for the metrics only)."""
        return self.loss_type == "reinforce" and self.weights is not None

    @property
    def needs_current_logprobs(self) -> bool:
        """The loss's mask or weights depend on the batch of current log-probs (rejection; applied normalized
        weights), beyond what fused_rl's per-token on-policy ``rollout_is`` computes in the pass."""
        return bool(self.rejection) or (self.applied_weights and self.batch_normalize)


@dataclass(frozen=True)
class Corrected:
    """:func:`correct`'s result: the loss ``mask`` (bool, after rejection), the applied ``weights`` (``(B, T)``,
    None unless :attr:`BypassCorrection.applied_weights`) and verl's ``rollout_corr/*`` ``metrics``."""

    mask: torch.Tensor
    weights: Optional[torch.Tensor]
    metrics: dict[str, torch.Tensor]


def _positive(value: str, what: str) -> float:
    try:
        x = float(value)
    except ValueError as exc:
        raise ValueError(f"verl rollout_correction.rollout_rs_threshold: {what} {value!r} is not a number") from exc
    if not x > 0:
        raise ValueError(f"verl rollout_correction.rollout_rs_threshold: {what} must be positive, got {value!r}")
    return x


def parse_rejection(options: Any, thresholds: Any) -> tuple[Rejection, ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold``: options comma-separated (repeats dropped), thresholds a
    number or a comma-separated string, one shared by every option or one per option; a k1 option's threshold is
    ``"lower_upper"`` or ``upper`` (``lower = 1 / upper``), the others' a single ``upper``; bounds positive,
    ``lower <= upper`` (``ValueError`` otherwise, as verl)."""
    if not isinstance(options, str):
        raise ValueError(f"verl rollout_correction.rollout_rs must be a comma-separated string, got {options!r}")
    names = list(dict.fromkeys(name.strip() for name in options.split(",") if name.strip()))
    if not names:
        raise ValueError("verl rollout_correction.rollout_rs must name at least one option")
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(f"verl rollout_correction.rollout_rs option {name!r} is not one of {REJECTION_OPTIONS}")
    if isinstance(thresholds, numbers.Real) and not isinstance(thresholds, bool):
        specs = [str(thresholds)]
    elif isinstance(thresholds, str):
        specs = [spec.strip() for spec in thresholds.split(",") if spec.strip()]
    else:
        raise ValueError("verl rollout_correction.rollout_rs_threshold must be a number or a comma-separated string "
                         f"(required with rollout_rs), got {thresholds!r}")
    if len(specs) not in (1, len(names)):
        raise ValueError(f"verl rollout_correction.rollout_rs_threshold: one threshold shared by the options or one "
                         f"per option ({len(names)}), got {len(specs)}")
    specs = specs * len(names) if len(specs) == 1 else specs
    parsed = []
    for name, spec in zip(names, specs):
        if name.endswith("k1"):
            lower_text, upper_text = spec.split("_", 1) if "_" in spec else (None, spec)
            upper = _positive(upper_text, f"{name}'s upper bound")
            lower = 1.0 / upper if lower_text is None else _positive(lower_text, f"{name}'s lower bound")
            if lower > upper:
                raise ValueError(f"verl rollout_correction.rollout_rs_threshold: {name}'s bounds must be lower <= "
                                 f"upper, got {spec!r}")
            parsed.append(Rejection(name, upper, lower))
        elif "_" in spec:
            raise ValueError(f"verl rollout_correction.rollout_rs_threshold: {name} takes a single upper bound, "
                             f"got {spec!r}")
        else:
            parsed.append(Rejection(name, _positive(spec, f"{name}'s bound")))
    return tuple(parsed)


# --- masked reductions (bool masks; empty: 0) -------------------------------------------------------------------
def _mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(m x) / max(sum(m), 1)`` over every element (0 for an empty mask), in ``x``'s dtype: the variances below
    subtract two of these, which :func:`fused_rl.loss_math.masked_mean`'s fp32 would round for fp64 input."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1).to(x.dtype)


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked mean, ``(B,)`` (0 for an empty row, as verl's ``sum / (count + 1e-8)``)."""
    return _sequence_mean(torch.where(mask, x, torch.zeros_like(x)), mask).squeeze(-1)


def _row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1)


def _all_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over every element, as verl's ``.mean()`` over every row (0 for none, an empty batch)."""
    return x.sum() / max(x.numel(), 1)


def _extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """``x.amax()`` / ``x.amin()`` (0 for an empty ``x``)."""
    if x.numel() == 0:
        return x.new_zeros(())
    return x.amax() if largest else x.amin()


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = _extreme(torch.where(mask, x, torch.full_like(x, -math.inf)), largest=True)
    return torch.where(mask.any(), out, torch.zeros_like(out))


def _min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -_max(-x, mask)


def _std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked sample standard deviation (``n - 1``; 0 for ``n <= 1``), as verl's ``values.std()``."""
    n = mask.sum().to(x.dtype)
    dev = torch.where(mask, x - _mean(x, mask), torch.zeros_like(x))
    return torch.where(n > 1, (dev.square().sum() / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))


def _clamped_std(x: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """verl's spread of ``clamp(x, low, high)``: ``sqrt(max(E[x^2] - E[x]^2, 0))`` (0 with one token or none)."""
    c = x.clamp(min=low, max=high)
    var = (_mean(c.square(), mask) - _mean(c, mask).square()).clamp(min=0)
    return torch.where(mask.sum() > 1, var.sqrt(), torch.zeros_like(var))


def _global_mean(total: torch.Tensor, count: torch.Tensor, floor: float) -> torch.Tensor:
    """``total / count``, both summed over every process when torch.distributed is initialized (verl's
    ``distributed_masked_mean``: ``count`` unfloored there), else ``count`` floored at ``floor``."""
    if dist.is_available() and dist.is_initialized():
        total, count = total.clone(), count.clone()
        dist.all_reduce(total)
        dist.all_reduce(count)
        return total / count
    return total / count.clamp(min=floor)


# --- the three parts --------------------------------------------------------------------------------------------
def _weights(corr: BypassCorrection, logp, rollout, mask, log_r) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weights (normalized when asked) and verl's ``rollout_is_*`` metrics (of the weights before
    normalization)."""
    cfg = corr.weights
    rho, w = rollout_weights(logp, rollout, mask, cfg)
    upper, icepop = corr.upper, corr.lower is not None
    lower = corr.lower if icepop else 1.0 / upper
    rows = mask.any(dim=-1)
    out: dict[str, torch.Tensor] = {}
    if cfg.rollout_is.startswith("sequence"):
        log_sum = _row_sum(log_r, mask)  # verl: every row, an empty one's 0 included
        out["rollout_is_max"] = _extreme(log_sum, largest=True).clamp(max=ROLLOUT_LOG_RHO_BOUND).exp()
        out["rollout_is_min"] = _extreme(log_sum, largest=False).exp()
        out["rollout_is_mean"] = _mean(w, mask)
        out["rollout_is_ratio_fraction_high"] = _all_mean((log_sum > _log(upper)).to(w.dtype))
        out["rollout_is_ratio_fraction_low"] = _all_mean((log_sum < _log(lower)).to(w.dtype))
    else:
        out["rollout_is_mean"] = _mean(w, mask)
        out["rollout_is_ratio_fraction_high"] = _mean((rho > upper).to(w.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = _mean((rho < lower).to(w.dtype), mask)
        out["rollout_is_max"], out["rollout_is_min"] = _max(w, mask), _min(w, mask)
    out["rollout_is_std"] = _clamped_std(w, mask, 0.0, upper)
    clamped = w.clamp(min=0.0, max=upper)
    second_moment = _mean((clamped / (_mean(clamped, mask) + 1e-8)).square(), mask)
    # no weight (all masked, or every one 0): verl raises, here 0 effective samples
    out["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment,
                                                    torch.zeros_like(second_moment))
    seq_w, seq_rho = _row_mean(w, mask), _row_mean(rho, mask)  # every row, as verl
    every = torch.ones_like(rows)
    out["rollout_is_seq_mean"], out["rollout_is_seq_std"] = _all_mean(seq_w), _std(seq_w, every)
    out["rollout_is_seq_max"], out["rollout_is_seq_min"] = _extreme(seq_w, True), _extreme(seq_w, False)
    out["rollout_is_seq_max_deviation"] = _extreme((seq_w - 1.0).abs(), True)
    out["rollout_is_seq_fraction_high"] = _all_mean((seq_rho > upper).to(w.dtype))
    out["rollout_is_seq_fraction_low"] = _all_mean((seq_rho < lower).to(w.dtype))
    if icepop:
        out["rollout_is_oob_ratio"] = _mean(((rho < lower) | (rho > upper)).to(w.dtype), mask)
    if corr.batch_normalize:
        if cfg.rollout_is.startswith("token"):
            total, count = torch.where(mask, w, torch.zeros_like(w)).sum(), mask.sum().to(w.dtype)
        else:
            total, count = torch.where(rows, seq_w, torch.zeros_like(seq_w)).sum(), rows.sum().to(w.dtype)
        batch_mean = _global_mean(total, count, NORMALIZE_FLOOR)
        use = batch_mean > NORMALIZE_FLOOR
        w = torch.where(use, w / batch_mean, w)
        out["rollout_is_batch_norm_factor"] = torch.where(use, batch_mean, torch.ones_like(batch_mean))
    return w, out


def _rejection(options: tuple[Rejection, ...], mask: torch.Tensor,
               log_r: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The kept tokens (bool) and verl's ``rollout_rs_*`` metrics."""
    bounded = log_r.clamp(min=-ROLLOUT_LOG_RHO_BOUND, max=ROLLOUT_LOG_RHO_BOUND)
    rows = mask.any(dim=-1)
    zero = torch.zeros_like(bounded)
    keep = torch.ones_like(mask)
    out: dict[str, torch.Tensor] = {}
    for opt in options:
        stat = kl_estimator(zero, bounded, opt.kind)  # "k1" / "k2" / "k3" of d = l
        lo, hi = opt.bounds
        if opt.level == "token":
            per_seq = None
        elif opt.level == "max":
            per_seq = _max_rows(stat, mask)
        else:
            per_seq = (_row_sum if opt.level == "sum" else _row_mean)(stat, mask)
        value = stat if per_seq is None else per_seq.unsqueeze(-1).expand_as(stat)
        kept = value <= hi if lo is None else (value >= lo) & (value <= hi)
        keep = keep & kept
        out.update(_rejection_metrics(opt, value, per_seq, stat, mask, rows, kept))
    dropped = mask & ~keep
    out["rollout_rs_masked_fraction"] = _mean(dropped.to(bounded.dtype), mask)
    out["rollout_rs_seq_masked_fraction"] = _all_mean(dropped.any(dim=-1).to(bounded.dtype))  # verl: every row
    return mask & keep, out


def _max_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked max, 0 for an empty row (verl's ``_sequence_max``)."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    out = torch.where(mask, x, torch.full_like(x, -math.inf)).amax(dim=-1)
    return torch.where(mask.any(dim=-1), out, torch.zeros_like(out))


def _rejection_metrics(opt: Rejection, value, per_seq, stat, mask, rows, kept) -> dict[str, torch.Tensor]:
    """verl's ``compute_rs_metrics`` of one option and its masked fractions (``value``: the statistic each token is
    judged by; ``per_seq``: the per-response one of a sequence option, else None)."""
    p = f"rollout_rs_{opt.option}"
    lo, hi = opt.bounds
    dtype = value.dtype
    seq = _row_mean(stat, mask) if per_seq is None else per_seq
    out = {f"{p}_mean": _mean(value, mask)}
    judged, judged_mask = (value, mask) if per_seq is None else (seq, rows)
    out[f"{p}_max"], out[f"{p}_min"] = _max(judged, judged_mask), _min(judged, judged_mask)
    out[f"{p}_fraction_high"] = _mean((judged > hi).to(dtype), judged_mask)
    out[f"{p}_fraction_low"] = (_mean((judged < lo).to(dtype), judged_mask) if lo is not None
                                else torch.zeros((), dtype=dtype, device=value.device))
    out[f"{p}_std"] = _clamped_std(value, mask, 0.0 if lo is None else lo, hi)
    out[f"{p}_seq_mean"], out[f"{p}_seq_std"] = _mean(seq, rows), _std(seq, rows)
    out[f"{p}_seq_max"], out[f"{p}_seq_min"] = _max(seq, rows), _min(seq, rows)
    out[f"{p}_seq_max_deviation"] = _max(seq.abs(), rows)
    out[f"{p}_seq_fraction_high"] = _mean((seq > hi).to(dtype), rows)
    if lo is not None:
        out[f"{p}_seq_fraction_low"] = _mean((seq < lo).to(dtype), rows)
    dropped = mask & ~kept
    out[f"{p}_masked_fraction"] = _mean(dropped.to(dtype), mask)
    out[f"{p}_seq_masked_fraction"] = _mean(dropped.any(dim=-1).to(dtype), rows)
    return out


def _off_policy(logp: torch.Tensor, mask: torch.Tensor, log_r: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's ``compute_offpolicy_metrics``: perplexities (per response ``exp(-mean_t logp)``, averaged over every
    row), the KL estimators k1 ``E[-log r]`` / k3 ``E[r - 1 - log r]``, the chi-square divergences."""
    rollout = logp - log_r  # the rollout log-probs (the current ones where the engine gave NaN)
    train_mean, rollout_mean = _row_mean(logp, mask), _row_mean(rollout, mask)
    diff = rollout_mean - train_mean
    bounded = log_r.clamp(min=-ROLLOUT_LOG_RHO_BOUND, max=ROLLOUT_LOG_RHO_BOUND)
    seq_bounded = _row_sum(log_r, mask).clamp(min=-ROLLOUT_LOG_RHO_BOUND, max=ROLLOUT_LOG_RHO_BOUND)
    return {"training_ppl": _all_mean(torch.exp(-train_mean)), "training_log_ppl": _all_mean(-train_mean),
            "kl": _mean(-log_r, mask), "k3_kl": _mean(kl_estimator(torch.zeros_like(log_r), log_r, "k3"), mask),
            "rollout_ppl": _all_mean(torch.exp(-rollout_mean)), "rollout_log_ppl": _all_mean(-rollout_mean),
            "log_ppl_diff": _all_mean(diff), "log_ppl_abs_diff": _all_mean(diff.abs()),
            "log_ppl_diff_max": _extreme(diff, True), "log_ppl_diff_min": _extreme(diff, False),
            "ppl_ratio": _all_mean(torch.exp(diff)), "chi2_token": _mean(torch.exp(2.0 * bounded), mask) - 1.0,
            "chi2_seq": _all_mean(torch.exp(2.0 * seq_bounded)) - 1.0}


def correct(corr: BypassCorrection, logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Corrected:
    """verl's ``compute_rollout_correction_and_rejection_mask(logp, rollout, mask, ...)`` of bypass_mode: the
    weights (when verl computes them), the rejection, the ``rollout_corr/*`` metrics. ``logp`` / ``rollout``
    ``(B, T)`` (``logp`` detached here), ``mask`` bool."""
    with torch.no_grad():
        dtype = torch.promote_types(logp.dtype, torch.float32)
        logp, rollout = logp.detach().to(dtype), rollout.detach().to(dtype)
        log_r = torch.where(mask & ~torch.isnan(rollout), logp - rollout, torch.zeros_like(logp))
        metrics: dict[str, torch.Tensor] = {}
        weights = None
        if corr.weights is not None:
            weights, is_metrics = _weights(corr, logp, rollout, mask, log_r)
            metrics.update(is_metrics)
        kept = mask
        if corr.rejection:
            kept, rs_metrics = _rejection(corr.rejection, mask, log_r)
            metrics.update(rs_metrics)
        metrics.update(_off_policy(logp, mask, log_r))
        metrics = {f"rollout_corr/{name}": value.to(torch.float32) for name, value in metrics.items()}
    return Corrected(kept, weights if corr.applied_weights else None, metrics)


__all__ = ["REJECTION_OPTIONS", "BypassCorrection", "Corrected", "Rejection", "correct", "parse_rejection"]
