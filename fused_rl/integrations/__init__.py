"""Adapters for existing RL trainers.

* :mod:`fused_rl.integrations.trl`: ``FusedGRPOTrainer`` (a TRL ``GRPOTrainer`` whose loss runs through
  :func:`fused_rl.linear_policy_loss`) and ``patch_grpo_trainer`` (the same on an existing trainer);
* :mod:`fused_rl.integrations.verl`: verl 0.9's registered policy losses (``get_policy_loss_fn``) and the
  functional ``compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)``
  on fused_rl's loss math, ``global_batch_info`` included, and the mapping of verl actor options onto
  :class:`fused_rl.PolicyLossConfig`; :mod:`fused_rl.integrations.verl_lm_head`: verl's fused LM-head kernels
  (``use_fused_kernels``: ``FusedLinearForPPO``, ``linear_cross_entropy``) on one fused pass, and
  ``patch_fused_kernels``; :mod:`fused_rl.integrations.verl_logits`: verl's ``logprobs_from_logits`` /
  ``entropy_from_logits`` (its default path) on the fused kernels, and ``patch_torch_functional`` (importing
  :mod:`fused_rl.integrations.verl_patch` runs both patches: verl's ``external_lib``);
* :mod:`fused_rl.integrations.openrlhf`: OpenRLHF's ``PolicyLoss`` (constructor, ``forward`` and its five
  returned values) on fused_rl's loss math, with the fused ``forward_from_hidden``, and the actor's
  ``log_probs_from_logits`` / ``compute_entropy`` on the fused kernels (``patch_actor``);
* :mod:`fused_rl.integrations.liger`: Liger-Kernel's logits-level ``triton_grpo_loss`` and
  ``fused_selective_log_softmax`` (same signatures and return values);
* :mod:`fused_rl.integrations.megatron`: Megatron-Core's ``vocab_parallel_cross_entropy`` and verl's Megatron-engine
  log-prob / entropy functions on vocabulary-parallel logits (:mod:`fused_rl.vocab_parallel`), and
  ``patch_verl_megatron``.

:mod:`fused_rl.integrations.hf_models`: the check that a transformers model's logits are its plain LM
head's (shared by the TRL adapter and the bundled trainer).

The Liger-Kernel fused-linear drop-in (``FusedLinearGRPOLoss``) lives in :mod:`fused_rl.nn`. Submodules import
their framework lazily: importing this package never needs TRL, verl, OpenRLHF or Megatron.
"""

__all__ = ["hf_models", "liger", "megatron", "openrlhf", "patching", "trl", "verl", "verl_lm_head", "verl_logits"]
