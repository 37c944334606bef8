"""TRL integration: ``GRPOTrainer``'s loss through :func:`fused_rl.linear_policy_loss`.

Two equivalent entry points (written against TRL 1.16):

* ``FusedGRPOTrainer(..., fused_backend="auto")``: a ``trl.GRPOTrainer`` subclass;
* ``patch_grpo_trainer(trainer, backend="auto")``: the same change on an existing ``GRPOTrainer``.

The training forward runs the model body once, takes the last hidden state of the positions that
predict the completion tokens (``hidden[:, P-1 : P-1+C]`` for a prompt block of ``P`` and a
completion block of ``C`` columns, TRL's ``logits_to_keep = C`` and shift by one) and calls
``linear_policy_loss(hidden, lm_head.weight, completion_ids, advantages, mask, bias=lm_head.bias, ...)``
at ``temperature = args.temperature``: no ``(B, T, V)`` logits are formed by fused backends.
Generation is TRL's own. TRL's no-grad log-prob passes (old policy, reference model) keep TRL's code but call
the model's ``fused_lm_head``, which the adapter answers with :func:`fused_rl.linear_token_logprobs` on the
loss's operands: TRL's own head rounds the logits to bf16 under its default ``bf16=True`` (or for a bf16 model),
so its old log-probs against the loss's fp32-accumulated ones would put an on-policy ratio off 1 (by ~4e-4 on the
tests' tiny model, ``test_old_logprobs_are_the_loss_head_s_under_bf16_autocast``; more at real vocabularies).

Loss semantics are TRL's (see :func:`fused_rl.nn.grpo_policy_loss_config` for the mapping):
``grpo``, ``bnpo``, ``dr_grpo`` divide the loss by ``current_gradient_accumulation_steps`` in training;
``luspo`` divides by it too (a mean over sequences of their token sums); ``dapo``/``cispo``/``vespo`` use the
token-mean denominator
``max(num_items_in_batch, 1) / num_processes * current_gradient_accumulation_steps / steps_per_generation``
(training) or ``max(num_items_in_batch, 1) / num_processes`` (eval). ``beta > 0`` adds TRL's ``k3``
penalty against ``inputs["ref_per_token_logps"]``, times the importance ratio with TRL's default
``use_bias_correction_kl=True`` (fused_rl's ``kl_bias_correction``). Logged metrics are TRL's: ``kl`` (when
``beta != 0``), ``entropy``, ``clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}``
(cispo: ``cispo_clip_ratio``; vespo: ``vespo/phi_seq_mean``), with TRL's cross-process reductions.

Also honoured: ``loss_type`` ``"sapo"``, ``"luspo"`` and ``"vespo"`` (the vLLM correction inside VESPO's weight,
as TRL), ``delta``, ``top_entropy_quantile`` (its threshold over every
process's entropies, gathered as TRL's ``get_high_entropy_mask`` gathers them), ``off_policy_mask_threshold``
(against ``inputs["sampling_per_token_logps"]`` when vLLM provides them, else the old log-probs) and
``vllm_importance_sampling_correction`` (every mode, ``clip_min`` / ``clip_max``; fused_rl recomputes
TRL's ratio from the old and sampling log-probs, its log clamped to ``[-20, 20]`` (verl's safety bound, where TRL
has none: docs/migration.md); a NaN sampling log-prob, a token vLLM could not score, has
log-ratio 0 in the correction and in the off-policy mask's KL, as TRL's ``nan_to_num``). ``delta`` must exceed
``1 + epsilon_high`` (``NotImplementedError`` otherwise).

Not supported (``NotImplementedError`` at construction, naming the option): the entropy bonus (``entropy_coef != 0``
/ ``use_adaptive_entropy``), MoE router auxiliary loss, models with logit
soft-capping or logit scaling, sequence-level cispo, sapo and vespo, the vLLM correction with both clip bounds
``None`` (TRL's unbounded ratio), a subclass's own ``_compute_loss`` or loss hooks (:data:`_LOSS_HOOKS`), DeepSpeed
ZeRO-3 (its sharded ``lm_head`` is not gathered);
multimodal inputs raise at the first step. The loss config is built from the trainer's options at every step
(:func:`_checked_config`), so options assigned after construction (a ``beta`` schedule) take effect, as in TRL.
A value out of fused_rl's range raises ``ValueError`` at construction, naming the GRPOConfig option (``epsilon``
for ``PolicyLossConfig.clip_low`` and so on).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Optional

import torch

from ..config import OptionError
from ..loss_math import entropy_quantile_across, importance_ratio, kl_estimator, rollout_weights, vespo_weights
from ..nn import NUM_ITEMS_LOSS_TYPES, SUPPORTED_LOSS_TYPES, grpo_policy_loss_config
from ..ops import linear_policy_loss, linear_token_logprobs
from ..validation import binary_mask
from .hf_models import plain_lm_head_problems

try:
    import transformers
    from packaging.version import Version
    from trl import GRPOTrainer
    from trl.trainer.utils import nanmax, nanmin
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError("fused_rl.integrations.trl needs TRL (pip install 'trl>=1.16')") from exc

#: Keyword of the patched model forward: a callable ``(last_hidden_state, lm_head) -> result``.
FUSED_HEAD_KWARG = "fused_rl_head"

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                    "num_tiles", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _is_peft_model(model) -> bool:
    try:
        from accelerate.utils import is_peft_model
    except ImportError:  # pragma: no cover
        return False
    return is_peft_model(model)


def unsupported_options(trainer: GRPOTrainer) -> list[str]:
    """Every TRL option of ``trainer`` that fused_rl cannot compute exactly (empty when all are fine)."""
    args = trainer.args
    problems = []
    if trainer.loss_type not in SUPPORTED_LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r}")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        problems.append(f"entropy_coef={getattr(args, 'entropy_coef', None)!r} / use_adaptive_entropy "
                        f"(entropy bonus)")
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("router_aux_loss_coef (MoE auxiliary loss)")
    if trainer.loss_type in ("cispo", "sapo", "vespo") and trainer.importance_sampling_level == "sequence":
        problems.append(f"importance_sampling_level='sequence' with loss_type={trainer.loss_type!r}")
    if _vllm_is(trainer) and getattr(trainer, "vllm_importance_sampling_clip_min", None) is None \
            and getattr(trainer, "vllm_importance_sampling_clip_max", 3.0) is None:
        problems.append(f"vllm_importance_sampling_clip_min=None and vllm_importance_sampling_clip_max=None with "
                        f"vllm_importance_sampling_mode={trainer.vllm_importance_sampling_mode!r} (the unbounded "
                        f"ratio; fused_rl's rollout correction needs a bound)")
    problems += plain_lm_head_problems(_base_model(trainer.model).config)
    problems += _overridden_loss_hooks(trainer)
    if _zero3():
        problems.append("DeepSpeed ZeRO-3 (its lm_head is sharded to empty tensors outside the head's own forward; the "
                        "adapter does not gather it: use ZeRO-1/2, or FSDP2, whose sharded head it gathers)")
    return problems


def _zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


#: What TRL 1.16's ``_compute_loss`` calls on the trainer, and the loss itself: the fused loss computes all of it
#: itself, so a subclass's own version (``trl.experimental.gmpo.GMPOTrainer._compute_loss``, a custom
#: ``get_off_policy_mask``) would silently not run
_LOSS_HOOKS = ("_compute_loss", "_get_per_token_logps_and_entropies", "get_off_policy_mask", "get_high_entropy_mask",
               "get_gamma_weights")


def _overridden_loss_hooks(trainer: GRPOTrainer) -> list[str]:
    """The loss hooks of :data:`_LOSS_HOOKS` that ``type(trainer)`` overrides (a ``FusedGRPOTrainer`` subclass may
    override ``_compute_loss``: it then chose its loss)."""
    cls = type(trainer)
    return [f"{cls.__name__}.{name} overrides GRPOTrainer.{name} (the fused loss would not call it)"
            for name in _LOSS_HOOKS if hasattr(GRPOTrainer, name)
            and getattr(cls, name) is not getattr(GRPOTrainer, name)
            and not (name == "_compute_loss" and isinstance(trainer, FusedGRPOTrainer))]


_VESPO_ARGS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _vllm_is(trainer: GRPOTrainer) -> bool:
    return bool(getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))


def _base_model(model):
    return model.get_base_model() if _is_peft_model(model) else model


def _add_fused_head_forward(model, logprob_pass=None) -> None:
    """Wrap ``model.forward``: called with ``fused_rl_head=fn`` it runs only the body (through
    ``model.base_model``, as TRL's own fused head does) and returns ``fn(last_hidden_state, lm_head)``; called
    by TRL's log-prob passes (``fused_lm_head=True, labels=...``, the old-policy and reference log-probs) it
    returns ``logprob_pass(last_hidden_state, lm_head, labels)`` (when given; MoE router logits and pre-shifted
    labels stay with TRL's head); otherwise it is the previous forward, so generation is unchanged.

    The loss is computed inside the model's forward (not after it) so that wrappers which only see
    parameters used in the forward (DDP ``find_unused_parameters``, FSDP unsharding) see the ``lm_head``."""
    if logprob_pass is not None:
        model._fused_rl_logprob_pass = logprob_pass
    if getattr(model, "_fused_rl_head_forward", False):
        return
    previous = model.forward
    text_config = model.config.get_text_config()
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        head = kwargs.pop(FUSED_HEAD_KWARG, None)
        logprobs = getattr(self, "_fused_rl_logprob_pass", None)
        trl_pass = (head is None and logprobs is not None and kwargs.get("fused_lm_head")
                    and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None
                    and not kwargs.get("output_router_logits"))
        if head is None and not trl_pass:
            return previous(*args, **kwargs)
        labels = None
        if trl_pass:
            kwargs.pop("fused_lm_head")
            labels = kwargs.pop("labels")
            kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        hidden = getattr(self, backbone_attr)(*args, **kwargs).last_hidden_state
        if trl_pass:
            return logprobs(hidden, self.get_output_embeddings(), labels)
        return head(hidden, self.get_output_embeddings())

    model.forward = types.MethodType(forward, model)
    model._fused_rl_head_forward = True


def _head_operands(trainer: GRPOTrainer, hidden: torch.Tensor, lm_head: torch.nn.Module):
    """``(hidden, weight, bias)`` of the LM head as every fused pass of the adapter uses them (the loss and the
    log-prob passes alike, so an on-policy ratio is 1 to fp32 rounding): FSDP2's sharded head gathered, ``hidden``
    on its device, in fp32 with ``cast_lm_head_to_fp32``, and in the weight's dtype."""
    weight, bias = _full_tensor(lm_head.weight), _full_tensor(lm_head.bias)
    hidden = hidden.to(weight.device)
    if trainer.args.cast_lm_head_to_fp32:
        hidden = hidden.float()
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden, weight, bias


def _trl_logprob_pass(trainer: GRPOTrainer, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor):
    """What TRL's fused head returns for ``fused_lm_head=True`` (``log_probs`` and ``entropy`` of every next-token
    label, ``(B, L - 1)``, zero where the label is -100), computed by :func:`fused_rl.linear_token_logprobs` at
    ``trainer.temperature`` with the loss's operands (:func:`_head_operands`), autocast off: TRL's head rounds the
    logits to the autocast / model dtype (bf16: ~``|z| 2^-9``), so its old log-probs against fused_rl's current ones
    would give an on-policy ratio off 1 by that noise (spurious clipping at GSPO's 3e-4)."""
    from trl.trainer.utils import FusedCausalLMOutput

    labels = labels[:, 1:].to(lm_head.weight.device)
    valid = labels != -100  # only the scored positions, gathered as TRL's head gathers them
    h, weight, bias = _head_operands(trainer, hidden[:, :-1].to(labels.device)[valid].unsqueeze(0), lm_head)
    if h.shape[1] == 0:  # nothing scored (a chunk of truncated completions): zeros, connected to the graph as TRL's
        zeros = torch.zeros(valid.shape, device=h.device) + h.float().sum()
        return FusedCausalLMOutput(loss=zeros.sum(), log_probs=zeros, entropy=zeros.clone(), label_mask=valid)
    with torch.autocast(h.device.type, enabled=False):
        logp, entropy = linear_token_logprobs(h, weight, labels[valid].unsqueeze(0), bias=bias,
                                              temperature=trainer.temperature, return_entropy=True,
                                              backend=trainer._fused_rl_backend)
    log_probs = logp.new_zeros(valid.shape).masked_scatter(valid, logp[0])
    return FusedCausalLMOutput(loss=-log_probs.sum() / valid.sum().clamp(min=1), log_probs=log_probs,
                               entropy=entropy.new_zeros(valid.shape).masked_scatter(valid, entropy[0]),
                               label_mask=valid)


def _install(trainer: GRPOTrainer, backend: str) -> None:
    _checked_config(trainer)
    trainer._fused_rl_backend = backend
    logprob_pass = functools.partial(_trl_logprob_pass, trainer)
    _add_fused_head_forward(_base_model(trainer.model), logprob_pass)
    if trainer.ref_model is not None:
        _add_fused_head_forward(trainer.accelerator.unwrap_model(trainer.ref_model), logprob_pass)


def _checked_config(trainer: GRPOTrainer):
    """The ``PolicyLossConfig`` of the trainer's options as they are now (TRL reads ``beta``, ``epsilon_high``,
    ``temperature``, ... at every step, so a schedule changing them in a callback takes effect here too);
    ``NotImplementedError`` naming what fused_rl cannot compute, ``ValueError`` naming the GRPOConfig option."""
    problems = unsupported_options(trainer)
    if problems:
        raise NotImplementedError("fused_rl cannot compute this GRPOTrainer loss exactly; unsupported: "
                                  + "; ".join(problems))
    try:
        return _loss_config(trainer)
    except OptionError as exc:  # name the GRPOConfig option (Liger's epsilon_low is TRL's epsilon)
        option = "epsilon" if exc.argument == "epsilon_low" else exc.argument
        if not hasattr(trainer.args, option):
            raise
        value = getattr(trainer, option, getattr(trainer.args, option, None))
        raise ValueError(f"GRPOConfig.{option}={value!r} is outside what fused_rl computes: {exc.cause}") from exc


def _loss_config(trainer: GRPOTrainer):
    return grpo_policy_loss_config(
        trainer.loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, beta=trainer.beta,
        importance_sampling_level=trainer.importance_sampling_level,
        max_completion_length=trainer.max_completion_length, temperature=trainer.temperature,
        use_bias_correction_kl=bool(getattr(trainer.args, "use_bias_correction_kl", False)),
        delta=getattr(trainer.args, "delta", None),
        sapo_temperature_pos=getattr(trainer.args, "sapo_temperature_pos", 1.0),
        sapo_temperature_neg=getattr(trainer.args, "sapo_temperature_neg", 1.05),
        **{name: getattr(trainer.args, name) for name in _VESPO_ARGS if hasattr(trainer.args, name)},
        top_entropy_quantile=getattr(trainer, "top_entropy_quantile", 1.0),
        off_policy_mask_threshold=getattr(trainer, "off_policy_mask_threshold", None),
        vllm_importance_sampling_mode=trainer.vllm_importance_sampling_mode if _vllm_is(trainer) else None,
        vllm_importance_sampling_clip_min=getattr(trainer, "vllm_importance_sampling_clip_min", None),
        vllm_importance_sampling_clip_max=getattr(trainer, "vllm_importance_sampling_clip_max", 3.0))


def patch_grpo_trainer(trainer: GRPOTrainer, backend: str = "auto") -> GRPOTrainer:
    """Make an existing ``GRPOTrainer`` compute its loss with fused_rl (in place; returns it)."""
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch_grpo_trainer expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    _install(trainer, backend)
    if not isinstance(trainer, FusedGRPOTrainer):
        trainer._compute_loss = types.MethodType(_fused_compute_loss, trainer)
    return trainer


def _full_tensor(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return x
    return x.full_tensor() if isinstance(x, DTensor) else x


def _gather_entropies(self: GRPOTrainer, local: torch.Tensor) -> torch.Tensor:
    """Every process's unmasked entropies for the top-entropy threshold, gathered as TRL's
    ``get_high_entropy_mask`` does: padded across processes with a negative sentinel (entropies are
    >= 0), gathered, the sentinel dropped."""
    pad = -1e9
    gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
    return gathered[gathered != pad]


def _fused_compute_loss(self: GRPOTrainer, model, inputs: dict[str, Any]) -> torch.Tensor:
    for key in _MULTIMODAL_KEYS:
        if inputs.get(key) is not None:
            raise NotImplementedError(f"fused_rl's GRPOTrainer loss does not support multimodal input {key!r} yet")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    prompt_len, completion_len = prompt_ids.size(1), completion_ids.size(1)
    if prompt_len == 0:
        raise ValueError("fused_rl's GRPOTrainer loss needs at least one prompt column (the first completion "
                         "token is predicted from the last prompt position)")
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    bool_mask = binary_mask(mask, "completion_mask")

    advantages = inputs["advantages"]
    if advantages.dim() == 2 and advantages.shape[1] == 1:  # (B, 1), as TRL broadcasts it
        advantages = advantages.squeeze(1)
    old = inputs.get("old_per_token_logps")
    ref = inputs["ref_per_token_logps"] if self.beta != 0.0 else None
    mode = "train" if self.model.training else "eval"
    config = _checked_config(self)
    rollout = inputs.get("sampling_per_token_logps") if config.uses_rollout_logprobs else None
    if config.rollout_is is not None and rollout is None:
        raise ValueError("vllm_importance_sampling_correction needs inputs['sampling_per_token_logps']")
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    normalizer = None
    if self.loss_type in NUM_ITEMS_LOSS_TYPES:
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation

    def head(hidden: torch.Tensor, lm_head: torch.nn.Module):
        # hidden[:, i] predicts input_ids[:, i + 1]: the completion tokens are predicted by the C positions
        # before the last (P-1 .. P+C-2), taken from the end as TRL's logits_to_keep does, so positions a model
        # prepends (PEFT prompt tuning's virtual tokens) do not shift them
        hidden = hidden[:, hidden.shape[1] - completion_len - 1: hidden.shape[1] - 1]
        hidden, weight, bias = _head_operands(self, hidden, lm_head)
        across = (entropy_quantile_across(functools.partial(_gather_entropies, self))
                  if config.top_entropy_quantile < 1.0 else contextlib.nullcontext())
        with torch.autocast(hidden.device.type, enabled=False), across:
            return linear_policy_loss(hidden, weight, completion_ids, advantages, bool_mask, bias=bias,
                                      old_logprobs=old, ref_logprobs=ref, rollout_logprobs=rollout, config=config,
                                      token_normalizer=normalizer,
                                      backend=self._fused_rl_backend, compute_entropy=True)

    with self.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, **{FUSED_HEAD_KWARG: head})
    loss = out.loss if normalizer is not None else out.loss / accumulation
    _log_trl_metrics(self, config, mode, out, advantages, mask, bool_mask, old, ref, rollout)
    return loss


@torch.no_grad()
def _log_trl_metrics(self: GRPOTrainer, config, mode: str, out, advantages: torch.Tensor, mask: torch.Tensor,
                     bool_mask: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
                     rollout: Optional[torch.Tensor]) -> None:
    """TRL's ``_compute_loss`` metrics, from the detached log-probs and entropies fused_rl returns (``config``: the
    step's loss config)."""
    logp = out.logprobs
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    coef_1 = importance_ratio(logp, logp if old is None else old.to(logp.dtype), bool_mask, config)
    if self.importance_sampling_level == "sequence":
        coef_1 = coef_1[:, :1]  # TRL keeps the sequence ratio as (B, 1)

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x: torch.Tensor) -> float:
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    metrics = self._metrics[mode]
    if self.beta != 0.0:
        zeros = torch.zeros_like(logp)
        per_token_kl = torch.where(bool_mask, kl_estimator(logp, torch.where(bool_mask, ref.to(logp.dtype), zeros),
                                                           "k3"), zeros)
        if config.kl_bias_correction:  # TRL logs the ratio-weighted KL
            per_token_kl = per_token_kl * coef_1
        metrics["kl"].append(global_masked_mean(per_token_kl))
    metrics["entropy"].append(global_masked_mean(out.entropy))
    if self.loss_type == "sapo":  # TRL logs no clip ratios for the soft gate
        return
    if self.loss_type == "vespo":  # TRL's phi is (B, 1) for (B,) advantages: then a mean over sequences
        behaviour = logp if old is None else old.to(logp.dtype)
        rollout_w = None
        if config.rollout_is is not None:
            rollout_w = rollout_weights(behaviour, torch.where(bool_mask, rollout.to(logp.dtype), 0.0), bool_mask,
                                        config)[1]
        phi = vespo_weights(torch.where(bool_mask, logp - behaviour, 0.0), advantages.expand_as(logp), bool_mask,
                            config, rollout_w)
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi[:, :1] if advantages.shape[1] == 1 else phi))
        return
    if self.loss_type == "cispo":
        clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped.float()))
        return
    low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
    metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
    metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
    metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
    metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low.float()))).item())
    metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high.float()))).item())


class FusedGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss runs through :func:`fused_rl.linear_policy_loss` (see the module
    docstring for what is honoured and what raises). Extra keyword: ``fused_backend`` (default ``"auto"``)."""

    def __init__(self, *args, fused_backend: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _install(self, fused_backend)

    def _compute_loss(self, model, inputs):
        return _fused_compute_loss(self, model, inputs)


__all__ = ["FusedGRPOTrainer", "patch_grpo_trainer", "unsupported_options", "FUSED_HEAD_KWARG"]
