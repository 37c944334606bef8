"""Importing this module runs :func:`fused_rl.integrations.verl_lm_head.patch_fused_kernels` (verl's fused LM-head
kernels on fused_rl) in the importing process. For verl's Ray workers::

    actor_rollout_ref.model.use_fused_kernels=True \\
    actor_rollout_ref.model.external_lib=fused_rl.integrations.verl_patch

(verl imports ``model.external_lib`` in each worker when it builds the model config; ``VERL_USE_EXTERNAL_MODULES=
fused_rl.integrations.verl_patch`` does the same wherever ``verl`` is imported)."""

from .verl_lm_head import patch_fused_kernels

PREVIOUS = patch_fused_kernels()  # verl's own (linear_cross_entropy, FusedLinearForPPO), to restore

__all__ = ["PREVIOUS"]
