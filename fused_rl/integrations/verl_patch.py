"""Importing this module puts fused_rl under verl's log-probs and entropies in the importing process: it runs
:func:`fused_rl.integrations.verl_lm_head.patch_fused_kernels` (verl's fused LM-head kernels,
``use_fused_kernels=True``) and :func:`fused_rl.integrations.verl_logits.patch_torch_functional` (verl's
``logprobs_from_logits`` / ``entropy_from_logits`` on the logits, its default path). For verl's Ray workers::

    actor_rollout_ref.model.external_lib=fused_rl.integrations.verl_patch

(verl imports ``model.external_lib`` in each worker when it builds the model config, before the engine;
``VERL_USE_EXTERNAL_MODULES=fused_rl.integrations.verl_patch`` does the same wherever ``verl`` is imported)."""

from .verl_lm_head import patch_fused_kernels
from .verl_logits import patch_torch_functional

#: verl's own functions, to restore: ``"fused_kernels"`` (linear_cross_entropy, FusedLinearForPPO) and
#: ``"torch_functional"`` ({module name: {name: function}})
PREVIOUS = {"fused_kernels": patch_fused_kernels(), "torch_functional": patch_torch_functional()}

__all__ = ["PREVIOUS"]
