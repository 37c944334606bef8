"""The slow, obviously correct backend: a full-precision ``log_softmax`` over the whole vocabulary.

It materializes ``(B, T, V)`` fp32 log-probs (fp64 for fp64 input) and lets torch autograd do the
backward; every other backend is tested against it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..config import IGNORE_INDEX, PolicyLossConfig
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs
from .base import Backend


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                        return_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logp = log_softmax(z / tau)[target]`` and ``H = -sum_j p_j log p_j`` (``0 log 0 = 0``); rows whose
    target is ``IGNORE_INDEX`` are replaced by zeros first (0 out, no gradient, even from NaN logits)."""
    ignored = targets == IGNORE_INDEX
    z = logits.to(compute_dtype(logits.dtype)) / temperature
    # a scalar fill, not zeros_like: the quotient is freed on reassignment, so no third (N, V) tensor is alive;
    # out of place, so torch.func.vmap over targets or the mask works with shared logits
    z = torch.where(ignored.unsqueeze(-1), 0.0, z)
    logp_all = F.log_softmax(z, dim=-1)
    safe_targets = torch.where(ignored, torch.zeros_like(targets), targets).long()
    logp = logp_all.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros_like(logp)
    logp = torch.where(ignored, zero, logp)
    entropy = None
    if return_entropy:
        finite_logp = torch.where(torch.isfinite(logp_all), logp_all, torch.zeros_like(logp_all))
        entropy = torch.where(ignored, zero, -(logp_all.exp() * finite_logp).sum(-1))
    return logp, entropy


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                valid: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T + bias`` in full precision, from ``hidden`` zeroed at the rows not ``valid`` (a
    NaN there would reach ``weight.grad`` through the matmul even with a zero logits gradient)."""
    dtype = compute_dtype(hidden.dtype)
    hidden = torch.where(valid.unsqueeze(-1), hidden.to(dtype), torch.zeros((), dtype=dtype, device=hidden.device))
    # full precision under the caller's autocast too (its backward GEMMs, run by autograd within the caller's
    # autocast region, are autocast's: the fused ops compute their gradients in the forward and have none)
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden, weight.to(dtype), None if bias is None else bias.to(dtype))


class ReferenceBackend(Backend):
    name = "reference"
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def token_logprobs(self, logits, targets, temperature, return_entropy, inplace=False):
        return full_token_logprobs(logits, targets, temperature, return_entropy)

    def linear_policy_loss(self, hidden, weight, bias, inputs: PolicyInputs, config: PolicyLossConfig,
                           compute_entropy: bool, memory_budget_bytes=None) -> PolicyLossOutput:
        """Materialize ``logits = hidden @ weight.T + bias`` in full precision, then :meth:`policy_loss`
        (no tiles: ``memory_budget_bytes`` does not apply)."""
        logits = full_logits(hidden, weight, bias, inputs.mask)
        return self.policy_loss(logits, inputs, config, compute_entropy, inplace=False)

    def linear_token_logprobs(self, hidden, weight, bias, targets, temperature, return_entropy,
                              memory_budget_bytes=None):
        """Materialize the full-precision logits, then :func:`full_token_logprobs`."""
        logits = full_logits(hidden, weight, bias, targets != IGNORE_INDEX)
        return full_token_logprobs(logits, targets, temperature, return_entropy)
