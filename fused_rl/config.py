"""Loss configuration: the one place where every policy-loss option is named and validated.

Every backend (reference, chunked torch, Triton, C++/CUDA) receives a :class:`PolicyLossConfig`
and nothing else describes the loss; the kernels read their compile-time switches from it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

PolicyLossName = Literal["ppo_clip", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "reinforce", "vespo", "dppo_tv",
                         "dppo_kl"]
KLName = Optional[Literal["k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k2+", "k3+", "abs+", "low_var_kl+"]]
RolloutISName = Optional[Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]]
CovModeName = Optional[Literal["clip_cov", "kl_cov"]]
AggName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

POLICY_LOSSES = ("ppo_clip", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "reinforce", "vespo", "dppo_tv", "dppo_kl")
#: ``"X+"``: the value of estimator ``X`` with the gradient of ``k2`` (straight-through).
KL_ESTIMATORS = (None, "k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k2+", "k3+", "abs+", "low_var_kl+")
#: The estimators ``kl_clamp`` applies to (k3 clamped is ``low_var_kl``, already clamped at 10).
KL_CLAMPABLE = ("k1", "k2", "abs", "k1+", "k2+", "abs+")
ROLLOUT_IS_MODES = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: The covariance-based token selections of "The Entropy Mechanism of RL for Reasoning LMs" (verl's loss modes).
COV_MODES = (None, "clip_cov", "kl_cov")
#: Losses whose ratio is clipped PPO-style (``clip_low`` / ``clip_high``, ``dual_clip``, ``delta``).
PPO_STYLE = ("ppo_clip", "gspo", "gspo_token")
#: DPPO's losses: a truncated-IS policy gradient whose trust region is a divergence mask (``clip_low`` / ``clip_high``
#: the divergence bounds, ``delta`` the truncation of the weight).
DPPO = ("dppo_tv", "dppo_kl")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

#: Target id meaning "no token here": log-prob 0, entropy 0, zero gradient, and masked in the loss.
IGNORE_INDEX = -100
#: The smallest sampling temperature: below it vLLM's sampler (``_SAMPLING_EPS``) decodes greedily, so there is no
#: sampling distribution to take log-probs of, and ``logits / temperature`` overflows fp32 for logits ~1e-38 / tau.
MIN_TEMPERATURE = 1e-5
#: The kernels compute in float32 (and the custom ops carry the float fields as a float32 tensor): a field's value
#: must stay finite there, so below this magnitude (the first that rounds to float32's inf).
FLOAT32_ROUNDS_TO_INF = float.fromhex("0x1.ffffffp+127")


#: The float fields, in :attr:`PolicyLossConfig.float_values` order: the values the custom ops take as a tensor.
FLOAT_FIELDS = ("clip_low", "clip_high", "dual_clip", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
                "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "beta", "rollout_is_min",
                "rollout_is_max", "off_policy_mask", "top_entropy_quantile", "temperature", "entropy_coef", "kl_clamp",
                "kl_is_clip", "cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef")


def _literal(values: dict[str, Any]) -> str:
    """:attr:`PolicyLossConfig.literal` of the field values ``values``."""
    items = ("..." if name in FLOAT_FIELDS and value is not None else repr(value) for name, value in values.items())
    return "(" + ", ".join(items) + ",)"


def literal_fields(literal: str) -> dict[str, Any]:
    """The fields of :attr:`PolicyLossConfig.literal`, each set float ``Ellipsis``: the structure a fake
    implementation reads (``kl``, ``policy_loss``, ...) without the values."""
    return dict(zip(PolicyLossConfig.__dataclass_fields__, ast.literal_eval(literal)))


def finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real too
        raise ValueError(f"PolicyLossConfig.{name} must be a real number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        number = math.inf
    # not math.isfinite: dynamo traces comparisons of a symbolic float
    if not -FLOAT32_ROUNDS_TO_INF < number < FLOAT32_ROUNDS_TO_INF:
        raise ValueError(f"PolicyLossConfig.{name} must be finite in float32 (|x| < 3.4e38), the kernels' "
                         f"precision, got {value!r}")
    return number


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy loss to compute, and how to aggregate it.

    With ``r_t = exp(logp_t - old_t)``, advantage ``A``, ``d_t = ref_t - logp_t``, mask ``m`` and
    ``sg`` the stop-gradient, the per-token loss is
    ``l_t = c_t * pg_t + beta * kl_t - entropy_coef * H_t`` where ``c_t`` (detached, 1 by default) is
    the product of the rollout correction and the token masks below (and of the ``rollout_is_weights``
    argument, importance weights the caller computed):

    * ``policy_loss`` (``pg_t``):
        - ``"ppo_clip"``: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)`` (``clip_low >= 1``: no lower
          clip, TRL's and Liger's ``epsilon = 1``); with ``dual_clip=c``
          the result is further capped at ``-c A`` where ``A < 0``; with ``delta`` (TRL's two-sided
          clip, ``> 1 + clip_high``) the unclipped term uses ``min(r, delta)``.
        - ``"gspo"``: as ppo_clip, with ``r`` replaced by the sequence ratio
          ``s_i = exp(sum_t m (logp - old) / sum_t m)`` on every token of sequence ``i``.
        - ``"gspo_token"``: GSPO-token, as gspo with ``s_it = exp(sg(log s_i) + logp_t - sg(logp_t))``:
          the value of ``s_i``, the gradient of a token ratio (per-token advantages).
        - ``"gmpo"``: GMPO (verl ``geo_mean``), ``-A * exp(sum_t m x_t / sum_t m)`` on every token, with
          the sign-aware log-space clip ``x_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -clip_low,
          clip_high))`` (``clip_low`` / ``clip_high`` are log-ratio bounds here).
        - ``"sapo"``: SAPO, ``-A * 4/tau * sigmoid(tau (r - 1))`` with ``tau = sapo_temperature_pos``
          where ``A > 0``, else ``sapo_temperature_neg``.
        - ``"cispo"``: ``-sg(min(r, 1+clip_high)) * A * logp``.
        - ``"reinforce"``: ``-A * logp``.
        - ``"dppo_tv"``, ``"dppo_kl"``: DPPO ("Rethinking the trust region in LLM RL", arXiv 2602.04879; verl
          ``loss_mode="dppo_tv"`` / ``"dppo_kl"``), ``-sg(min(r, delta)) * A * logp * sg(k_t)`` (``delta`` the
          truncation of the importance weight, verl's ``clip_ratio_c``; ``None``: none) with the trust-region mask
          ``k_t`` of the token probabilities ``p = exp(logp)``, ``q = exp(old)``: ``dppo_tv``: ``k_t = 1[p - q <=
          clip_high]`` where ``A > 0``, else ``1[p - q >= -clip_low]``; ``dppo_kl`` with the binary KL
          ``D = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))``: ``k_t = 1[D <= clip_high or p <= q]``
          where ``A > 0``, else ``1[D <= clip_low or p >= q]`` (a token is dropped only when its update moves
          ``p`` further past the divergence bound in the direction of its advantage). Without ``delta`` an
          overflowed ``r`` (an old log-prob ~88 below the current one) is an infinite weight where ``A != 0``
          (verl clamps the log-ratio at 20 and truncates at ``clip_ratio_c``; set ``delta``), except on a token
          another option drops (a mask, a zero rollout weight): 0 there, its gradient too.
        - ``"vespo"``: VESPO (TRL / Liger ``loss_type="vespo"``), ``-sg(phi_i) * A * logp`` with the sequence
          weight ``phi_i = exp(lam + k log w_i - lam w_i)`` (a Gamma density in ``w_i``, 1 at ``w_i = 1``), ``k, lam
          = vespo_k_pos, vespo_lambda_pos`` where ``A >= 0``, else ``vespo_k_neg, vespo_lambda_neg`` (``lam >= 0``,
          used as ``max(lam, 1e-4)``, as TRL and Liger), and
          ``log w_i = clamp(sum_t m clamp(log r_t, -20, 20) + sum_t m log_is_t, log 1e-8, 20)`` (a sum, not a mean),
          ``log_is_t = clamp(log c_t, log 1e-8, 20)`` of the token-level rollout correction ``c_t`` below, which
          enters ``w_i`` instead of multiplying the loss (TRL's ``get_gamma_weights``); a non-finite ``phi`` is 0.
          Only a token-level ``rollout_is`` (a sequence-level one raises), and no ``rollout_is_weights`` argument.
    * ``kl`` (estimator of KL(pi || ref), added as ``beta * kl``): ``k1 = -d``, ``k2 = d^2/2``,
      ``k3 = exp(d) - d - 1``, ``abs = |d|``, ``low_var_kl = clamp(k3, -10, 10)``; ``"X+"`` is
      straight-through: the value of ``X`` with the gradient of ``k2`` (``k2 + sg(X - k2)``; ``"k2+"`` is ``k2``
      unless ``kl_clamp`` cuts its value or ``kl_is_clip`` weights its gradient).
    * ``kl_clamp=c`` (k1, k2, abs and their ``"X+"``): the value is ``clamp(kl, -c, c)``, no gradient where it is
      cut (an ``"X+"`` keeps k2's); OpenRLHF's ``compute_approx_kl`` clamps every estimator at 10 (its k3 is
      ``low_var_kl``).
    * ``kl_is_clip=C`` (``"X+"`` estimators): k2's gradient is weighted by ``sg(min(r_t, C))``, ``r_t = exp(logp_t -
      old_t)`` the token ratio (1 on-policy) whatever ``policy_loss``: OpenRLHF's ``unbiased_gradient`` (``C =
      KL_IS_WEIGHT_CLIP = 10``), the off-policy estimate ``E_old[w k1 grad logp]`` of the reverse KL's gradient.
    * ``kl_bias_correction``: the KL term is ``beta * r * kl`` with the (differentiable) importance
      ratio ``r`` (sequence ratio for gspo / gmpo; gspo_token: its value, with the token's own gradient
      ``d r_t / d logp_t = r_t``, as TRL), DeepSeek-V3.2's unbiased KL gradient
      off-policy; TRL's ``use_bias_correction_kl``. For k3 and the ``"X+"`` estimators its gradient is the
      exact slope, not autograd's cancelling product (:func:`fused_rl.loss_math.bias_corrected_kl`).
    * ``rollout_is`` (needs ``rollout_logprobs``, the sampler's log-probs): importance weight
      ``rho = exp(old - rollout)`` (``old = sg(logp)`` on-policy) of the training policy against the
      inference engine, per token (``token_*``) or per sequence (``sequence_*``: ``exp(sum_t m (old -
      rollout))``; a NaN rollout log-prob, a token the engine did not score, has log-ratio 0; the log-ratio is
      clamped to ``[-20, 20]`` before the ``exp``, verl's safety bound: ``rho`` cannot overflow); ``*_truncate``:
      ``c *= clamp(rho, rollout_is_min, rollout_is_max)``; ``*_mask``: ``c *= rho 1[rollout_is_min <= rho <=
      rollout_is_max]`` (a ``None`` bound is no bound; defaults ``None`` and 2.0, verl's ``rollout_is_threshold``;
      TRL's ``vllm_importance_sampling_clip_max`` defaults to 3.0).
      TRL's ``vllm_importance_sampling_*``, verl's ``rollout_correction``.
    * ``off_policy_mask=delta``: DeepSeek-V3.2's off-policy sequence mask: ``c *= 0`` on sequences with
      ``A < 0`` whose mean ``sum_t m (q - sg(logp)) / sum_t m`` exceeds ``delta``, ``q`` the rollout
      log-probs if given (a NaN one adds 0), else ``old`` (TRL's ``off_policy_mask_threshold``).
    * ``top_entropy_quantile=rho < 1``: ``c *= 1[H_t >= quantile_{1-rho}(H)]``, the quantile (linear
      interpolation) over the batch's unmasked tokens (every process's inside
      :func:`fused_rl.loss_math.entropy_quantile_across`): train only the highest-entropy fraction
      ("Beyond the 80/20 rule", TRL's ``top_entropy_quantile``). The entropy comes from the same pass.
    * ``cov_mode`` ("The Entropy Mechanism of RL for Reasoning LMs", Cui et al. 2025; verl ``loss_mode="clip_cov"`` /
      ``"kl_cov"``): with the centred covariance ``cov_t = (A_t - mean A) (sg(logp_t) - mean sg(logp))`` over the
      batch's unmasked tokens and ``n = max(floor(cov_ratio * #unmasked), 1)`` (the product in double precision, as
      verl's ``int(ratio * N)``):
        - ``"clip_cov"`` (ppo_clip without ``dual_clip`` / ``delta``): ``c *= 0`` on ``n`` tokens drawn uniformly
          at random (torch's generator of the device: ``torch.manual_seed`` fixes them, though compiled code draws
          other tokens than eager code under the same seed) from the unmasked ones with
          ``clip_cov_lb < cov_t < clip_cov_ub`` whose clipped term is not the active one (``-A clip(r) <= -A r``),
          all of them when there are fewer;
        - ``"kl_cov"``: the ``n`` unmasked tokens of largest ``cov_t`` get ``+ kl_cov_coef |logp - old|``
          (``old = sg(logp)`` on-policy: nothing), added to their policy term.
    * ``mask_truncated_completions``: sequences flagged in the ``truncated`` argument are masked out.
    * ``entropy_coef``: the per-token loss gets ``- entropy_coef * H_t``.
    * ``agg`` over masked per-token losses ``l``:
        - ``"token-mean"``: ``sum(l m) / sum(m)`` (or ``/ token_normalizer``);
        - ``"seq-mean-token-mean"``: ``mean_i(sum_t l m / sum_t m)`` over all ``B`` rows;
        - ``"seq-mean-token-sum"``: ``mean_i(sum_t l m)``;
        - ``"seq-mean-token-sum-norm"``: ``sum(l m) / (B * max_len)``, ``max_len`` defaulting to
          the padded length ``T``.
    * ``temperature`` (``>= MIN_TEMPERATURE = 1e-5``): log-probs are those of ``softmax(logits / temperature)``.
    """

    policy_loss: PolicyLossName = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl: KLName = None
    beta: float = 0.0
    kl_bias_correction: bool = False
    kl_clamp: Optional[float] = None
    kl_is_clip: Optional[float] = None
    rollout_is: RolloutISName = None
    rollout_is_min: Optional[float] = None
    rollout_is_max: Optional[float] = 2.0
    off_policy_mask: Optional[float] = None
    top_entropy_quantile: float = 1.0
    cov_mode: CovModeName = None
    cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    mask_truncated_completions: bool = False
    agg: AggName = "token-mean"
    max_len: Optional[int] = None
    temperature: float = 1.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"PolicyLossConfig.policy_loss must be one of {POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.kl not in KL_ESTIMATORS:
            raise ValueError(f"PolicyLossConfig.kl must be one of {KL_ESTIMATORS}, got {self.kl!r}")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"PolicyLossConfig.agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"PolicyLossConfig.rollout_is must be one of {ROLLOUT_IS_MODES}, got {self.rollout_is!r}")
        if self.cov_mode not in COV_MODES:
            raise ValueError(f"PolicyLossConfig.cov_mode must be one of {COV_MODES}, got {self.cov_mode!r}")
        floats = {name: finite_number(name, getattr(self, name))
                  for name in ("clip_low", "clip_high", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                               "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "beta", "top_entropy_quantile",
                               "temperature", "entropy_coef", "cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef")}
        if floats["clip_low"] < 0.0:  # >= 1: no lower clip (1 - clip_low <= 0 <= r), as TRL's epsilon = 1 means
            raise ValueError(f"PolicyLossConfig.clip_low must be >= 0, got {self.clip_low!r}")
        if floats["clip_high"] < 0.0:
            raise ValueError(f"PolicyLossConfig.clip_high must be >= 0, got {self.clip_high!r}")
        for name in ("dual_clip", "delta"):
            value = getattr(self, name)
            if value is None:
                continue
            floats[name] = finite_number(name, value)
            readers = PPO_STYLE + (DPPO if name == "delta" else ())
            if self.policy_loss not in readers:
                raise ValueError(f"PolicyLossConfig.{name} applies to {readers} only, not {self.policy_loss!r}")
        if self.dual_clip is not None and floats["dual_clip"] <= 1.0:
            raise ValueError(f"PolicyLossConfig.dual_clip must be > 1 (or None), got {self.dual_clip!r}")
        if self.policy_loss in DPPO:
            if self.delta is not None and floats["delta"] <= 0.0:
                raise ValueError(f"PolicyLossConfig.delta (dppo's truncation of the importance weight) must be > 0 "
                                 f"(or None), got {self.delta!r}")
        elif self.delta is not None and floats["delta"] <= 1.0 + floats["clip_high"]:
            raise ValueError(f"PolicyLossConfig.delta must be > 1 + clip_high = {1.0 + floats['clip_high']!r} "
                             f"(or None), got {self.delta!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not floats[name] > 4.0 / FLOAT32_ROUNDS_TO_INF:  # the loss's 4 / tau, finite in float32
                raise ValueError(f"PolicyLossConfig.{name} must be > 1.2e-38 (4 / tau finite in float32), got "
                                 f"{getattr(self, name)!r}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):  # the loss uses max(lam, 1e-4), as TRL and Liger
            if floats[name] < 0.0:
                raise ValueError(f"PolicyLossConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if floats["beta"] < 0.0:
            raise ValueError(f"PolicyLossConfig.beta must be >= 0, got {self.beta!r}")
        if floats["beta"] > 0.0 and self.kl is None:
            raise ValueError("PolicyLossConfig.beta > 0 needs a KL estimator: set kl to one of "
                             + ", ".join(repr(k) for k in KL_ESTIMATORS[1:]))
        for name in ("kl_bias_correction", "mask_truncated_completions"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PolicyLossConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.kl_bias_correction and self.kl is None:
            raise ValueError("PolicyLossConfig.kl_bias_correction multiplies the KL term: set kl (and beta)")
        self._check_kl_options(floats)
        for name in ("rollout_is_min", "rollout_is_max", "off_policy_mask"):
            value = getattr(self, name)
            if value is not None:
                floats[name] = finite_number(name, value)
                if floats[name] < 0.0:
                    raise ValueError(f"PolicyLossConfig.{name} must be >= 0 (or None), got {value!r}")
        if self.rollout_is is not None:
            lo, hi = floats.get("rollout_is_min"), floats.get("rollout_is_max")
            if lo is None and hi is None:
                raise ValueError("PolicyLossConfig.rollout_is needs rollout_is_max and/or rollout_is_min")
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"PolicyLossConfig.rollout_is_min ({lo}) must be <= rollout_is_max ({hi})")
            if self.policy_loss == "vespo" and self.rollout_is.startswith("sequence"):
                raise ValueError("PolicyLossConfig.policy_loss='vespo' takes a token-level rollout correction "
                                 f"(token_truncate / token_mask, as TRL), got rollout_is={self.rollout_is!r}")
        self._check_cov_options(floats)
        if not 0.0 <= floats["top_entropy_quantile"] <= 1.0:
            raise ValueError(f"PolicyLossConfig.top_entropy_quantile must be in [0, 1], "
                             f"got {self.top_entropy_quantile!r}")
        if floats["temperature"] < MIN_TEMPERATURE:
            raise ValueError(f"PolicyLossConfig.temperature must be >= {MIN_TEMPERATURE} (below it samplers decode "
                             f"greedily), got {self.temperature!r}")
        if self.max_len is not None:
            if isinstance(self.max_len, bool) or not isinstance(self.max_len, numbers.Integral) or self.max_len <= 0:
                raise ValueError(f"PolicyLossConfig.max_len must be a positive int (or None), got {self.max_len!r}")
            object.__setattr__(self, "max_len", int(self.max_len))
            if self.agg != "seq-mean-token-sum-norm":
                raise ValueError("PolicyLossConfig.max_len is only used by agg='seq-mean-token-sum-norm'")
        # Normalize numeric fields to float so equal configs hash (and compile) identically.
        for name, value in floats.items():
            object.__setattr__(self, name, value)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        object.__setattr__(self, "_literal", _literal(values))
        # the same config without rollout correction (the tiled route's kernel config of a folded sequence-level
        # correction), also formed once here
        object.__setattr__(self, "_literal_without_rollout", _literal({**values, "rollout_is": None}))

    def _check_kl_options(self, floats: dict[str, float]) -> None:
        """``kl_clamp`` and ``kl_is_clip``: positive, on the estimators they apply to, without
        ``kl_bias_correction``; their float values go into ``floats``."""
        for name in ("kl_clamp", "kl_is_clip"):
            value = getattr(self, name)
            if value is None:
                continue
            floats[name] = finite_number(name, value)
            if floats[name] <= 0.0:
                raise ValueError(f"PolicyLossConfig.{name} must be > 0 (or None), got {value!r}")
            if self.kl_bias_correction:
                why = ("two off-policy corrections of the KL gradient, choose one" if name == "kl_is_clip" else
                       "the bias-corrected KL's exact slopes know low_var_kl's clamp only")
                raise ValueError(f"PolicyLossConfig.{name} with kl_bias_correction is not supported: {why}")
        if self.kl_clamp is not None and self.kl not in KL_CLAMPABLE:
            plus = "+" if self.kl is not None and self.kl.endswith("+") else ""
            hints = {"k3": f" (k3 clamped to [-10, 10] is kl='low_var_kl{plus}')",
                     "low_var_kl": " (low_var_kl is k3 already clamped to [-10, 10])"}
            hint = hints.get((self.kl or "").rstrip("+"), "")
            raise ValueError(f"PolicyLossConfig.kl_clamp applies to kl in {KL_CLAMPABLE}, got kl={self.kl!r}{hint}")
        if self.kl_is_clip is not None and (self.kl is None or not self.kl.endswith("+")):
            raise ValueError("PolicyLossConfig.kl_is_clip weights the k2 gradient of a straight-through estimator: "
                             f"set kl to one ending in '+' (k2's own gradient: 'k2+'), got kl={self.kl!r}")

    def _check_cov_options(self, floats: dict[str, float]) -> None:
        """``cov_mode``'s options: ``0 < cov_ratio <= 1``, ``clip_cov_lb < clip_cov_ub``, ``kl_cov_coef >= 0``;
        clip_cov on ppo_clip without ``dual_clip`` / ``delta`` (its candidates exclude the clipped tokens)."""
        if not 0.0 < floats["cov_ratio"] <= 1.0:
            raise ValueError(f"PolicyLossConfig.cov_ratio must be in (0, 1], got {self.cov_ratio!r}")
        if not floats["clip_cov_lb"] < floats["clip_cov_ub"]:
            raise ValueError(f"PolicyLossConfig.clip_cov_lb ({self.clip_cov_lb!r}) must be < clip_cov_ub "
                             f"({self.clip_cov_ub!r})")
        if floats["kl_cov_coef"] < 0.0:
            raise ValueError(f"PolicyLossConfig.kl_cov_coef must be >= 0, got {self.kl_cov_coef!r}")
        if self.cov_mode == "clip_cov" and (self.policy_loss != "ppo_clip" or self.dual_clip is not None
                                            or self.delta is not None):
            raise ValueError("PolicyLossConfig.cov_mode='clip_cov' drops tokens whose PPO clip is inactive: it needs "
                             "policy_loss='ppo_clip' without dual_clip or delta (verl's clip_cov objective), got "
                             f"policy_loss={self.policy_loss!r}, dual_clip={self.dual_clip!r}, delta={self.delta!r}")

    @property
    def literal(self) -> str:
        """The config's structure, computed once at construction: the Python literal of its field tuple with
        each set :data:`FLOAT_FIELDS` value written ``...`` (unset ones ``None``). The custom ops receive a
        config as this ``str`` and :attr:`float_values` (a tensor, :func:`fused_rl.backends.custom_ops.config_args`),
        so under ``torch.compile`` the string is a constant that a new float value (a ``beta`` schedule) leaves
        unchanged: the float is a graph input, not a new graph. :meth:`from_literal` inverts it."""
        return self._literal

    @property
    def float_values(self) -> tuple[float, ...]:
        """The :data:`FLOAT_FIELDS` values, in order, ``nan`` for an unset optional one."""
        return tuple(math.nan if getattr(self, name) is None else getattr(self, name) for name in FLOAT_FIELDS)

    @classmethod
    def from_literal(cls, literal: str, float_values: Iterable[float]) -> "PolicyLossConfig":
        """The config of :attr:`literal` (or :attr:`literal_without_rollout`) and :attr:`float_values`."""
        fields = literal_fields(literal)
        for name, value in zip(FLOAT_FIELDS, float_values):
            if fields[name] is Ellipsis:
                fields[name] = value
        return cls(**fields)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PolicyLossConfig":
        """A named recipe, with field overrides. See :data:`PRESETS` for each mapping.

        ``beta > 0`` in ``overrides`` selects the ``k3`` estimator unless ``kl`` is given, as TRL does;
        ``kl_bias_correction`` stays False (verl's and Liger's default) unless given: TRL 1.16's GRPOConfig
        defaults ``use_bias_correction_kl=True``, the same loss value with another gradient, so pass
        ``kl_bias_correction=True`` to reproduce a default TRL run.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        unknown = set(overrides) - set(cls.__dataclass_fields__)  # dynamo traces this; not dataclasses.fields
        if unknown:
            raise ValueError(f"unknown PolicyLossConfig field(s) in overrides: {sorted(unknown)}")
        fields.update(overrides)
        if name == "dr_grpo" and fields.get("max_len") is None:
            raise ValueError("preset 'dr_grpo' needs max_len (TRL's max_completion_length): Dr. GRPO divides by a "
                             "constant, not by the batch's padded length (agg='seq-mean-token-sum-norm' without "
                             "max_len does that)")
        if fields.get("beta", 0.0) and fields.get("kl") is None and "kl" not in overrides:
            fields["kl"] = "k3"
        return cls(**fields)

    def replace(self, **changes: Any) -> "PolicyLossConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def unused_fields(self, names: Iterable[str]) -> dict[str, str]:
        """Of the field ``names`` (those a caller set explicitly), each one this config never reads, in the loss or
        its metrics -> why: ``clip_low`` outside ppo_clip / gspo / gspo_token / gmpo / dppo, ``clip_high`` also outside
        cispo, ``sapo_temperature_*`` outside sapo, ``vespo_*`` outside vespo, ``rollout_is_min`` / ``_max``
        without ``rollout_is``, ``cov_ratio`` without ``cov_mode``, ``clip_cov_lb`` / ``_ub`` and ``kl_cov_coef``
        outside clip_cov / kl_cov, ``kl_is_clip`` at ``beta = 0`` (it weights the KL's gradient only; the KL metric
        is the same). (Construction refuses the other such fields when they differ from their defaults:
        ``dual_clip``, ``delta``, ``max_len``, ``kl_bias_correction``, ``kl_clamp``, ``kl_is_clip`` without ``kl``.)
        The library's functions take such fields without a word; the bundled trainer refuses them."""
        clipped = ("ppo_clip", "gspo", "gspo_token", "gmpo") + DPPO
        readers = {"clip_low": (self.policy_loss in clipped, f"is not used by policy_loss {self.policy_loss!r}"),
                   "clip_high": (self.policy_loss in clipped + ("cispo",),
                                 f"is not used by policy_loss {self.policy_loss!r}"),
                   **{name: (self.policy_loss == "sapo", "is only used by policy_loss 'sapo'")
                      for name in ("sapo_temperature_pos", "sapo_temperature_neg")},
                   **{name: (self.policy_loss == "vespo", "is only used by policy_loss 'vespo'")
                      for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
                   **{name: (self.rollout_is is not None, "is only used with rollout_is")
                      for name in ("rollout_is_min", "rollout_is_max")},
                   "cov_ratio": (self.cov_mode is not None, "is only used with cov_mode"),
                   **{name: (self.cov_mode == "clip_cov", "is only used with cov_mode 'clip_cov'")
                      for name in ("clip_cov_lb", "clip_cov_ub")},
                   "kl_cov_coef": (self.cov_mode == "kl_cov", "is only used with cov_mode 'kl_cov'"),
                   "kl_is_clip": (self.beta != 0.0, "only weights the KL's gradient: it does nothing at beta = 0")}
        return {name: readers[name][1] for name in names if name in readers and not readers[name][0]}

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def needs_entropy(self) -> bool:
        """True when the loss reads the entropy (bonus or top-entropy mask), whatever ``compute_entropy``."""
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0

    @property
    def uses_rollout_logprobs(self) -> bool:
        """True when ``rollout_logprobs`` enter the loss (rollout correction, off-policy mask)."""
        return self.rollout_is is not None or self.off_policy_mask is not None

    @property
    def is_sequence_level(self) -> bool:
        """True when a token's loss depends on other tokens of its sequence (sequence ratios, sequence
        masks); the loss stays row-local: each sequence depends only on its own tokens."""
        return (self.policy_loss in ("gspo", "gspo_token", "gmpo", "vespo") or self.off_policy_mask is not None
                or (self.rollout_is is not None and self.rollout_is.startswith("sequence")))

    @property
    def is_batch_level(self) -> bool:
        """True when a token's loss depends on the whole batch beyond the aggregation weights (the
        top-entropy quantile, the covariance selection of ``cov_mode``): fused-linear tiles cannot finish a token
        before all are seen."""
        return self.top_entropy_quantile < 1.0 or self.cov_mode is not None

    @property
    def literal_without_rollout(self) -> str:
        """:attr:`literal` of this config with ``rollout_is=None`` (formed at construction, as :attr:`literal`)."""
        return self._literal_without_rollout

    @property
    def has_token_local_policy(self) -> bool:
        """The token-local options of :attr:`has_token_epilogue`, whatever the rollout correction."""
        return (self.policy_loss in ("ppo_clip", "sapo", "cispo", "reinforce") + DPPO
                and self.off_policy_mask is None and not self.is_batch_level)

    @property
    def has_token_epilogue(self) -> bool:
        """True when the kernels' closed-form per-token epilogue (Triton, C++/CUDA) covers this config:
        every token-local option (ppo_clip with dual clip / ``delta``, sapo, cispo, reinforce, dppo; every KL
        estimator, straight-through ones included, ``kl_clamp``, ``kl_is_clip`` and ``kl_bias_correction``;
        token-level rollout correction); otherwise (sequence ratios and masks, the top-entropy quantile, cov_mode) the
        backends use the two-pass composition with :mod:`fused_rl.loss_math`."""
        return self.has_token_local_policy and (self.rollout_is is None or self.rollout_is.startswith("token"))


#: Presets and the TRL ``GRPOTrainer`` ``loss_type`` they reproduce (TRL 0.2x / 1.x semantics):
#:
#: * ``grpo``    -> TRL ``loss_type="grpo"``: ppo_clip, per-sequence token mean, then batch mean.
#: * ``bnpo``    -> TRL ``"bnpo"``: ppo_clip, mean over all unmasked tokens of the local batch.
#: * ``dapo``    -> TRL ``"dapo"``: ppo_clip with clip-higher (0.2 / 0.28), token mean whose
#:   denominator is the token count of the whole accumulated batch (pass it as ``token_normalizer``,
#:   TRL's ``num_items_in_batch``).
#: * ``dr_grpo`` -> TRL ``"dr_grpo"``: ppo_clip, ``sum / (B * max_completion_length)``; pass
#:   ``max_len=max_completion_length`` (required: without it the divisor would be each batch's padded length).
#: * ``gspo``    -> TRL ``importance_sampling_level="sequence"`` with ``loss_type="grpo"`` and the
#:   GSPO paper's clip range 3e-4 / 4e-4.
#: * ``cispo``   -> TRL ``"cispo"``: truncated IS weight ``min(r, eps_max)`` with TRL's
#:   ``epsilon_high = eps_max = 1 + clip_high = 5.0`` (the ScaleRL recommendation), token mean
#:   over the accumulated batch.
#: * ``ppo``     -> classic PPO-clip (eps 0.2), token mean.
#: * ``gspo_token`` -> the GSPO paper's GSPO-token (sequence ratio value, token gradient), gspo's clip range.
#: * ``gmpo``    -> verl ``policy_loss.loss_mode="geo_mean"`` (GMPO paper: log-space clip 0.4 / 0.4), mean over
#:   sequences.
#: * ``sapo``    -> TRL ``loss_type="sapo"`` (temperatures 1.0 / 1.05; TRL aggregates as ``"grpo"``).
#: * ``luspo``   -> TRL ``loss_type="luspo"`` with ``importance_sampling_level="sequence"`` (LUSPO: GSPO whose
#:   sequence losses are summed over their tokens, weighting a sequence by its length), gspo's clip range.
#: * ``vespo``   -> TRL ``loss_type="vespo"`` (k / lambda 2, 3 for ``A >= 0`` and 3, 2 below), token mean over the
#:   accumulated batch (TRL's ``num_items_in_batch``) as dapo.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"),
    "bnpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="token-mean"),
    "dapo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.28, agg="token-mean"),
    "dr_grpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum-norm"),
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    "cispo": dict(policy_loss="cispo", clip_low=0.0, clip_high=4.0, agg="token-mean"),
    "ppo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="token-mean"),
    "gspo_token": dict(policy_loss="gspo_token", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    "gmpo": dict(policy_loss="gmpo", clip_low=0.4, clip_high=0.4, agg="seq-mean-token-mean"),
    "sapo": dict(policy_loss="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, agg="seq-mean-token-mean"),
    "luspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-sum"),
    "vespo": dict(policy_loss="vespo", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                  agg="token-mean"),
}


class OptionError(ValueError):
    """A ``PolicyLossConfig.<field>`` ValueError of a function that builds the config from another library's
    options (:func:`naming_arguments`), named by the ``argument`` it came from and that argument's value
    (``epsilon_low=-0.1: PolicyLossConfig.clip_low must be >= 0, got -0.1``); ``cause`` the config's error."""

    def __init__(self, argument: str, value: Any, cause: ValueError) -> None:
        super().__init__(f"{argument}={value!r}: {cause}")
        self.argument, self.cause = argument, cause


def naming_arguments(argument_of_field: dict[str, str]):
    """A decorator: the function raises :class:`OptionError` for a ``PolicyLossConfig.<field>`` ValueError of one
    of its arguments (``argument_of_field`` maps the fields whose argument has another name), the names its callers
    passed; other errors pass unchanged."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except ValueError as exc:
                field = re.match(r"PolicyLossConfig\.(\w+)", str(exc))
                arguments = inspect.signature(fn).bind(*args, **kwargs)
                arguments.apply_defaults()
                name = None if field is None else argument_of_field.get(field.group(1), field.group(1))
                if name not in arguments.arguments:
                    raise
                raise OptionError(name, arguments.arguments[name], exc) from exc

        return wrapper

    return decorate
