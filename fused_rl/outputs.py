"""Result types of the public loss functions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class PolicyLossOutput:
    """What ``policy_loss`` / ``linear_policy_loss`` return.

    * ``loss``: 0-dim, differentiable;
    * ``logprobs``: ``(B, T)`` fp32 log-probs of the targets (detached; 0 at masked positions);
    * ``entropy``: ``(B, T)`` fp32 entropy of the tempered softmax (detached; 0 at masked
      positions), or ``None`` with ``compute_entropy=False``;
    * ``metrics``: 0-dim detached fp32 tensors (no host sync): ``kl_mean``, ``clip_frac_low``,
      ``clip_frac_high``, ``clip_frac``, ``clip_frac_dual``, ``ratio_mean`` and, with entropy,
      ``entropy_mean``; all averaged over masked tokens.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
