"""Loss configuration: the one place where every policy-loss option is named and validated.

Every backend (reference, chunked torch, Triton, C++/CUDA) receives a :class:`PolicyLossConfig`
and nothing else describes the loss; the kernels read their compile-time switches from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

PolicyLossName = Literal["ppo_clip", "gspo", "cispo", "reinforce"]
KLName = Optional[Literal["k1", "k2", "k3", "abs", "low_var_kl"]]
AggName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "reinforce")
KL_ESTIMATORS = (None, "k1", "k2", "k3", "abs", "low_var_kl")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

#: Target id meaning "no token here": log-prob 0, entropy 0, zero gradient, and masked in the loss.
IGNORE_INDEX = -100


def _finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"PolicyLossConfig.{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"PolicyLossConfig.{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy loss to compute, and how to aggregate it.

    With ``r_t = exp(logp_t - old_t)``, advantage ``A``, ``d_t = ref_t - logp_t`` and mask ``m``:

    * ``policy_loss``:
        - ``"ppo_clip"``: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``; with ``dual_clip=c``
          the result is further capped at ``-c A`` where ``A < 0``.
        - ``"gspo"``: as ppo_clip, with ``r`` replaced by the sequence ratio
          ``s_i = exp(sum_t m (logp - old) / sum_t m)`` on every token of sequence ``i``.
        - ``"cispo"``: ``-sg(min(r, 1+clip_high)) * A * logp``.
        - ``"reinforce"``: ``-A * logp``.
    * ``kl`` (estimator of KL(pi || ref), added as ``beta * kl``): ``k1 = -d``, ``k2 = d^2/2``,
      ``k3 = exp(d) - d - 1``, ``abs = |d|``, ``low_var_kl = clamp(k3, -10, 10)``.
    * ``kl_bias_correction``: the KL term is ``beta * r * kl`` with the (differentiable) importance
      ratio ``r`` (gspo: the sequence ratio), DeepSeek-V3.2's unbiased KL gradient off-policy; TRL's
      ``use_bias_correction_kl``.
    * ``entropy_coef``: the per-token loss gets ``- entropy_coef * H_t``.
    * ``agg`` over masked per-token losses ``l``:
        - ``"token-mean"``: ``sum(l m) / sum(m)`` (or ``/ token_normalizer``);
        - ``"seq-mean-token-mean"``: ``mean_i(sum_t l m / sum_t m)`` over all ``B`` rows;
        - ``"seq-mean-token-sum"``: ``mean_i(sum_t l m)``;
        - ``"seq-mean-token-sum-norm"``: ``sum(l m) / (B * max_len)``, ``max_len`` defaulting to
          the padded length ``T``.
    * ``temperature``: log-probs are those of ``softmax(logits / temperature)``.
    """

    policy_loss: PolicyLossName = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    kl: KLName = None
    beta: float = 0.0
    kl_bias_correction: bool = False
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
        clip_low = _finite_number("clip_low", self.clip_low)
        clip_high = _finite_number("clip_high", self.clip_high)
        if not 0.0 <= clip_low < 1.0:
            raise ValueError(f"PolicyLossConfig.clip_low must be in [0, 1), got {self.clip_low!r}")
        if clip_high < 0.0:
            raise ValueError(f"PolicyLossConfig.clip_high must be >= 0, got {self.clip_high!r}")
        if self.dual_clip is not None:
            c = _finite_number("dual_clip", self.dual_clip)
            if c <= 1.0:
                raise ValueError(f"PolicyLossConfig.dual_clip must be > 1 (or None), got {self.dual_clip!r}")
            if self.policy_loss not in ("ppo_clip", "gspo"):
                raise ValueError(f"PolicyLossConfig.dual_clip applies to ppo_clip/gspo only, not {self.policy_loss!r}")
        beta = _finite_number("beta", self.beta)
        if beta < 0.0:
            raise ValueError(f"PolicyLossConfig.beta must be >= 0, got {self.beta!r}")
        if beta > 0.0 and self.kl is None:
            raise ValueError("PolicyLossConfig.beta > 0 needs a KL estimator: set kl to one of 'k1','k2','k3','abs','low_var_kl'")
        if not isinstance(self.kl_bias_correction, bool):
            raise ValueError(f"PolicyLossConfig.kl_bias_correction must be a bool, got {self.kl_bias_correction!r}")
        if self.kl_bias_correction and self.kl is None:
            raise ValueError("PolicyLossConfig.kl_bias_correction multiplies the KL term: set kl (and beta)")
        temperature = _finite_number("temperature", self.temperature)
        if temperature <= 0.0:
            raise ValueError(f"PolicyLossConfig.temperature must be > 0, got {self.temperature!r}")
        _finite_number("entropy_coef", self.entropy_coef)
        if self.max_len is not None:
            if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= 0:
                raise ValueError(f"PolicyLossConfig.max_len must be a positive int (or None), got {self.max_len!r}")
            if self.agg != "seq-mean-token-sum-norm":
                raise ValueError("PolicyLossConfig.max_len is only used by agg='seq-mean-token-sum-norm'")
        # Normalize numeric fields to float so equal configs hash (and compile) identically.
        for name, value in (("clip_low", clip_low), ("clip_high", clip_high), ("beta", beta),
                            ("temperature", temperature), ("entropy_coef", float(self.entropy_coef))):
            object.__setattr__(self, name, value)
        if self.dual_clip is not None:
            object.__setattr__(self, "dual_clip", float(self.dual_clip))

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PolicyLossConfig":
        """A named recipe, with field overrides. See :data:`PRESETS` for each mapping.

        ``beta > 0`` in ``overrides`` selects the ``k3`` estimator unless ``kl`` is given, as TRL does.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown PolicyLossConfig field(s) in overrides: {sorted(unknown)}")
        fields.update(overrides)
        if fields.get("beta", 0.0) and fields.get("kl") is None and "kl" not in overrides:
            fields["kl"] = "k3"
        return cls(**fields)

    def replace(self, **changes: Any) -> "PolicyLossConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def is_sequence_level(self) -> bool:
        """True when a token's loss depends on other tokens' log-probs (gspo's sequence ratio)."""
        return self.policy_loss == "gspo"

    @property
    def has_token_epilogue(self) -> bool:
        """True when the kernels' closed-form per-token epilogue (Triton, C++/CUDA) covers this config;
        otherwise the backends use the two-pass composition with :mod:`fused_rl.loss_math`."""
        return not self.is_sequence_level and not self.kl_bias_correction


#: Presets and the TRL ``GRPOTrainer`` ``loss_type`` they reproduce (TRL 0.2x / 1.x semantics):
#:
#: * ``grpo``    -> TRL ``loss_type="grpo"``: ppo_clip, per-sequence token mean, then batch mean.
#: * ``bnpo``    -> TRL ``"bnpo"``: ppo_clip, mean over all unmasked tokens of the local batch.
#: * ``dapo``    -> TRL ``"dapo"``: ppo_clip with clip-higher (0.2 / 0.28), token mean whose
#:   denominator is the token count of the whole accumulated batch (pass it as ``token_normalizer``,
#:   TRL's ``num_items_in_batch``).
#: * ``dr_grpo`` -> TRL ``"dr_grpo"``: ppo_clip, ``sum / (B * max_completion_length)``; pass
#:   ``max_len=max_completion_length``.
#: * ``gspo``    -> TRL ``importance_sampling_level="sequence"`` with ``loss_type="grpo"`` and the
#:   GSPO paper's clip range 3e-4 / 4e-4.
#: * ``cispo``   -> TRL ``"cispo"``: truncated IS weight ``min(r, eps_max)`` with TRL's
#:   ``epsilon_high = eps_max = 1 + clip_high = 5.0`` (the ScaleRL recommendation), token mean
#:   over the accumulated batch.
#: * ``ppo``     -> classic PPO-clip (eps 0.2), token mean.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"),
    "bnpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="token-mean"),
    "dapo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.28, agg="token-mean"),
    "dr_grpo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum-norm"),
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    "cispo": dict(policy_loss="cispo", clip_low=0.0, clip_high=4.0, agg="token-mean"),
    "ppo": dict(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2, agg="token-mean"),
}
