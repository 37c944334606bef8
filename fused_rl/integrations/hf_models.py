"""What a Hugging Face causal LM must satisfy for the fused-linear loss, which reads ``lm_head.weight``
(and bias) and computes ``logits = hidden @ W^T + b``: no logit soft-capping and no logit scaling.
A model with either would sample from other logits than the loss trains (on random tiny configs, the largest
log-prob gap to the model's own logits: 11.8 nats with Gemma-2's soft-capping 2, 5.3 with Granite's
``logits_scaling`` 8)."""

from __future__ import annotations

#: Model config fields that scale the logits after the LM head (Cohere, Granite, MiniCPM, ...).
LOGIT_SCALE_ATTRS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def plain_lm_head_problems(config) -> list[str]:
    """The fields of a transformers model ``config`` (its text config for multimodal ones) that make its
    logits other than ``hidden @ lm_head.weight^T + bias``; empty when there are none."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = []
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        problems.append(f"final_logit_softcapping={text_config.final_logit_softcapping!r} (model config)")
    for name in LOGIT_SCALE_ATTRS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1:
            problems.append(f"{name}={value!r} (model config logit scaling)")
    return problems
