"""fused_rl: fused-kernel policy losses (GRPO, PPO and variants) for RL fine-tuning of LLMs.

Public API: :class:`PolicyLossConfig`, :func:`token_logprobs`, :func:`token_entropy`, :func:`policy_loss`,
:func:`linear_policy_loss`, :func:`linear_token_logprobs`, the :mod:`fused_rl.reference` twins, and
:mod:`fused_rl.advantages`; drop-in loss modules in :mod:`fused_rl.nn`; trainer integrations in
:mod:`fused_rl.integrations` (imported on demand); a tensor-parallel LM head's log-probs in
:mod:`fused_rl.vocab_parallel` (imported on demand).
"""

from . import advantages, nn, reference
from .backends import available_backends
from .config import IGNORE_INDEX, PRESETS, PolicyLossConfig
from .ops import linear_policy_loss, linear_token_logprobs, policy_loss, token_entropy, token_logprobs
from .outputs import PolicyLossOutput

__version__ = "0.1.0"

__all__ = [
    "PolicyLossConfig",
    "PolicyLossOutput",
    "PRESETS",
    "IGNORE_INDEX",
    "token_logprobs",
    "token_entropy",
    "policy_loss",
    "linear_policy_loss",
    "linear_token_logprobs",
    "reference",
    "advantages",
    "nn",
    "available_backends",
]
