"""The backend interface: what an implementation of the vocabulary work must provide.

A backend implements the ``O(N * V)`` part only:

* ``token_logprobs(logits, targets, temperature, return_entropy, inplace=False)``: differentiable ``(B, T)``
  log-probs (and entropy) of ``softmax(logits / temperature)`` at the targets, ``IGNORE_INDEX``
  rows giving 0 and no gradient (``inplace``: a permission to write the logits' gradient over them in the
  backward, which a backend may ignore);

and inherits :meth:`Backend.policy_loss`, which applies the single definition of the loss math
(:func:`fused_rl.loss_math.compute_policy_loss`) on top. Backends with a fused single-pass kernel
override ``policy_loss`` and are tested against this composition.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import IGNORE_INDEX, PolicyLossConfig
from ..loss_math import compute_policy_loss
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs


class Backend:
    """Base class; subclasses set ``name`` and implement :meth:`token_logprobs`."""

    name: str = "base"
    #: Logit dtypes the backend accepts.
    dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)

    @property
    def has_linear(self) -> bool:
        """Whether this backend implements the fused-linear operations."""
        return type(self).linear_policy_loss is not Backend.linear_policy_loss

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """``None`` when usable on ``device``, else a sentence saying why not."""
        return None

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       return_entropy: bool, inplace: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def policy_loss(self, logits: torch.Tensor, inputs: PolicyInputs, config: PolicyLossConfig,
                    compute_entropy: bool, inplace: bool = False) -> PolicyLossOutput:
        """``token_logprobs`` then the shared loss math; masked rows are not read (target ignored).

        ``inplace`` is a permission, not a request: handed to ``token_logprobs``, whose backward may write the
        gradient over the logits."""
        targets = torch.where(inputs.mask, inputs.targets, torch.full_like(inputs.targets, IGNORE_INDEX))
        want_entropy = compute_entropy or config.needs_entropy
        logp, entropy = self.token_logprobs(logits, targets, config.temperature, want_entropy, inplace)
        loss, metrics = compute_policy_loss(
            logp, inputs.advantages, inputs.mask, config,
            old_logprobs=inputs.old, ref_logprobs=inputs.ref, entropy=entropy, rollout_logprobs=inputs.rollout,
            rollout_is_weights=inputs.is_weights, token_normalizer=inputs.token_normalizer)
        return PolicyLossOutput(loss=loss, logprobs=logp.detach(),
                                entropy=None if entropy is None else entropy.detach(), metrics=metrics)

    def linear_policy_loss(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           inputs: PolicyInputs, config: PolicyLossConfig, compute_entropy: bool,
                           memory_budget_bytes: Optional[int] = None) -> PolicyLossOutput:
        raise NotImplementedError(f"backend {self.name!r} has no fused-linear implementation")

    def linear_token_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              targets: torch.Tensor, temperature: float, return_entropy: bool,
                              memory_budget_bytes: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`token_logprobs` of the logits ``hidden @ weight.T + bias``, differentiable w.r.t.
        ``hidden``, ``weight`` and ``bias``; ``memory_budget_bytes`` bounds the tiles of a tiled backend."""
        raise NotImplementedError(f"backend {self.name!r} has no fused-linear implementation")
