"""verl's fused LM-head kernels (``actor_rollout_ref.model.use_fused_kernels=True``) on fused_rl.

With ``use_fused_kernels``, verl 0.9's FSDP models (``verl.models.transformers.dense_common``'s and the VL models'
``forward_with_torch_backend`` / ``forward_with_triton_backend``) take each token's log-prob and entropy from the
last hidden state and the LM-head weight, through ``verl.utils.experimental.torch_functional.FusedLinearForPPO``
(``actor_rollout_ref.model.fused_kernel_options.impl_backend`` ``"torch"`` / ``"liger"``) or
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``"triton"``), each imported where it is called.
:func:`patch_fused_kernels` rebinds those two names to :class:`FusedLinearForPPO` and :func:`linear_cross_entropy`
here, which take both from one fused pass of :func:`fused_rl.linear_token_logprobs` (``return_entropy=True``): the
logits never exist, on any device (verl's Triton kernel is CUDA only and asks for ``H % 128 == 0``; its torch path
holds ``(512, V)`` fp32 logits, softmax and log-softmax per chunk and recomputes the logits GEMM in the backward).

Per token, with ``z = hidden @ weight.T / temperature``: ``log_prob = z[label] - logsumexp(z)`` and ``entropy =
logsumexp(z) - sum_j softmax(z)_j z_j``, both differentiable w.r.t. ``hidden`` and ``weight``.

Differences from verl (each tested): a label ``-100`` gives log-prob 0, entropy 0 and no gradient (fused_rl's ignore
index: the row is not read; verl's torch and Triton kernels have none, its ``"liger"`` path has the same), and an
out-of-range label raises (``check_inputs=True``: one host sync a call); ``chunk_size`` is checked but fused_rl
chooses its own tiles (``memory_budget_bytes``); in bf16 / fp16 the log-probs are more accurate (verl's torch path
rounds the logits to the input dtype before its fp32 softmax). Through the patch verl builds
:class:`FusedLinearForPPO` and calls :func:`linear_cross_entropy` itself: ``backend``, ``check_inputs`` and
``memory_budget_bytes`` are :func:`patch_fused_kernels`' arguments there.

A ``dist_process_group`` of more than one process is verl's vocabulary-parallel case (Megatron's fused forward,
``verl.models.mcore``, passes its tensor-parallel group with each rank's slice ``[rank V_r, (rank + 1) V_r)`` of the
output layer): :func:`fused_rl.vocab_parallel.linear_token_logprobs` runs it, one fused pass over the rank's slice
and one ``all_gather`` of three values per token, with verl's gradients (the weight slice's own, the hidden states'
partial sum of this rank, which Megatron's sequence-parallel gather reduces in its backward). Megatron's forwards bind
``linear_cross_entropy`` at their import: :func:`patch_fused_kernels` rebinds it there too.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

import torch

from .. import vocab_parallel
from ..ops import linear_token_logprobs
from ..validation import check_chunk_size

REDUCTIONS = ("none", "sum", "mean")
#: verl 0.9's Megatron model forwards, which bind ``linear_cross_entropy`` at their import (and pass the
#: tensor-parallel group)
MCORE_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")


def _tensor_parallel(group: Any) -> Any:
    """``group`` where it has more than one process (a vocabulary-parallel LM head), else None."""
    if group is None:
        return None
    import torch.distributed as dist

    return group if dist.get_world_size(group) > 1 else None


def _operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in the autocast dtype inside an autocast region of their device, as verl's ``hidden @ weight.T`` takes
    them there (verl's actor runs its forward under a bf16 autocast); else as given."""
    device = hidden.device.type
    half = (torch.float32, torch.bfloat16, torch.float16)
    if torch.is_autocast_enabled(device) and hidden.dtype in half and weight.dtype in half:
        dtype = torch.get_autocast_dtype(device)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


def _fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, backend: str,
           check_inputs: bool, memory_budget_bytes: Optional[int], group: Any = None) -> tuple:
    """``(log_prob, entropy)`` of ``labels.shape`` for ``hidden (*labels.shape, H)``, one fused pass (over this
    process's vocabulary shard, :mod:`fused_rl.vocab_parallel`, with a tensor-parallel ``group``). Zero tokens give
    empty outputs, as verl's, still tied to both operands (a backward through them gives zero gradients)."""
    if labels.numel() == 0:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] \
                or weight.dtype != hidden.dtype or weight.shape[0] == 0:
            raise ValueError(f"the weight must be a (V, H={hidden.shape[-1]}) tensor of the hidden states' dtype "
                             f"{hidden.dtype}, got {getattr(weight, 'dtype', type(weight))} "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        empty = (hidden.reshape(-1, hidden.shape[-1]) @ weight[:1].t()).reshape(labels.shape)
        empty = empty.to(torch.float64 if empty.dtype == torch.float64 else torch.float32)
        return empty, empty.clone()
    flat = hidden.reshape(1, -1, hidden.shape[-1])
    options = dict(temperature=temperature, return_entropy=True, backend=backend, check_inputs=check_inputs,
                   memory_budget_bytes=memory_budget_bytes)
    if group is None:
        logp, entropy = linear_token_logprobs(flat, weight, labels.reshape(1, -1), **options)
    else:
        logp, entropy = vocab_parallel.linear_token_logprobs(flat, weight, labels.reshape(1, -1), group=group,
                                                             **options)
    return logp.view(labels.shape), entropy.view(labels.shape)


def _check_labels(hidden: torch.Tensor, labels: torch.Tensor, name: str, tokens: tuple) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise ValueError(f"hidden states and {name} must be torch.Tensors")
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {labels.dtype}")
    if tuple(labels.shape) != tokens:
        raise ValueError(f"{name} must have shape {tokens} (one per token of the hidden states "
                         f"{tuple(hidden.shape)}), got {tuple(labels.shape)}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: Optional[float] = 1.0, reduction: Optional[str] = "none",
                         dist_process_group: Any = None, *, backend: str = "auto", check_inputs: bool = True,
                         memory_budget_bytes: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``: ``hidden (..., H)``, ``weight (V, H)``,
    ``labels`` with ``hidden``'s leading shape (or as many tokens: verl's kernel flattens both); returns ``(log_probs,
    entropy)`` fp32 (fp64 for fp64 input) over the flattened tokens, ``(N,)`` each, as verl's kernel;
    ``reduction="sum"`` / ``"mean"`` reduces the log-probs to a scalar (their sum / mean over the ``N`` tokens), the
    entropy stays ``(N,)``. ``temperature`` / ``reduction`` ``None`` mean 1 / ``"none"``, as verl's."""
    temperature = 1.0 if temperature is None else temperature
    reduction = "none" if reduction is None else reduction
    group = _tensor_parallel(dist_process_group)

    def checks() -> torch.Tensor:
        """The labels, of the hidden states' leading shape; raises on a bad reduction, hidden or labels (with a
        group, on every process: :func:`fused_rl.vocab_parallel.agreed_checks`)."""
        if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            raise ValueError(f"hidden must be a tensor of shape (..., H), got {tuple(getattr(hidden, 'shape', ()))}")
        tokens = tuple(hidden.shape[:-1])
        shaped = labels
        if isinstance(labels, torch.Tensor) and tuple(labels.shape) != tokens \
                and labels.numel() == hidden[..., 0].numel():
            # verl's kernel flattens hidden and labels separately (Megatron's fused forward: (s, 1, h) with (1, s))
            shaped = labels.reshape(tokens)
        _check_labels(hidden, shaped, "labels", tokens)
        return shaped

    labels = checks() if group is None else vocab_parallel.agreed_checks(checks, hidden, group, check_inputs)
    hidden, weight = _operands(hidden, weight)
    logp, entropy = _fused(hidden, weight, labels, temperature, backend, check_inputs, memory_budget_bytes, group)
    logp, entropy = logp.reshape(-1), entropy.reshape(-1)
    reduction = reduction.lower()
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO``: ``forward(hidden_states (B, T, H) or (N,
    H), vocab_weights (V, H), input_ids (B, T) or (N,), temperature=1.0) -> (log_probs, entropy)`` of ``input_ids``'s
    shape, log-probs fp32, entropy in ``hidden_states``' dtype (verl's torch path; its ``"liger"`` path: the same
    values, and the same ``-100`` ignore index). Inside an autocast region both operands are first cast to its dtype, as
    verl's matmul takes them (the entropy keeps the dtype of the given hidden states, as verl's output buffer).
    ``impl_backend`` (``"torch"`` or ``"liger"``) is checked as verl checks it, ``chunk_size`` (verl's tokens per chunk;
    verl does not check it) must be a positive int; both run fused_rl's ``backend`` (``"auto"``: the fastest for the
    device), tiled by ``memory_budget_bytes`` (None: fused_rl's default). ``input_ids`` of a narrower integer dtype
    (uint8, int8, int16) are taken as int64, as verl's forward takes them."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch", *, backend: str = "auto",
                 check_inputs: bool = True, memory_budget_bytes: Optional[int] = None):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        check_chunk_size(chunk_size)
        self.chunk_size, self.impl_backend = chunk_size, impl_backend
        self.backend, self.check_inputs, self.memory_budget_bytes = backend, check_inputs, memory_budget_bytes

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(getattr(hidden_states, 'shape', ()))}")
        if isinstance(input_ids, torch.Tensor) and input_ids.dtype in (torch.uint8, torch.int8, torch.int16):
            input_ids = input_ids.long()  # verl's forward takes input_ids.to(torch.int64)
        _check_labels(hidden_states, input_ids, "input_ids", tuple(hidden_states.shape[:-1]))
        dtype = hidden_states.dtype
        hidden, weight = _operands(hidden_states, vocab_weights)
        logp, entropy = _fused(hidden, weight, input_ids, temperature, self.backend, self.check_inputs,
                               self.memory_budget_bytes)
        return logp.float(), entropy.to(dtype)


def patch_fused_kernels(kernel_module: Any = None, functional_module: Any = None, *, backend: str = "auto",
                        check_inputs: bool = True, memory_budget_bytes: Optional[int] = None) -> tuple:
    """Make verl's fused-kernel model forwards run on fused_rl: rebinds ``linear_cross_entropy`` in
    ``kernel_module`` (``verl.utils.kernel.linear_cross_entropy``, imported here when None) and
    ``FusedLinearForPPO`` in ``functional_module`` (``verl.utils.experimental.torch_functional``) to this module's,
    with the given ``backend``, ``check_inputs`` (``False``: no host sync a call, out-of-range labels unchecked) and
    ``memory_budget_bytes``. verl imports both names where its forwards call them, so the patch takes effect on the
    next forward. It patches this process only: in verl's Ray workers, set ``actor_rollout_ref.model.external_lib=
    fused_rl.integrations.verl_patch`` (verl imports it in each worker; it patches with the defaults) or call this
    there (from your own ``external_lib`` module, for other options). verl's Megatron forwards
    (:data:`MCORE_MODULES`) import ``linear_cross_entropy`` when they are imported: those already imported that still
    hold verl's function are rebound too (one imported later takes the patched name). Returns the previous pair, to
    restore with ``kernel_module.linear_cross_entropy, functional_module.FusedLinearForPPO = previous`` (and the
    Megatron modules' ``linear_cross_entropy = previous[0]``)."""
    if kernel_module is None:
        import verl.utils.kernel.linear_cross_entropy as kernel_module
    if functional_module is None:
        import verl.utils.experimental.torch_functional as functional_module
    options = dict(backend=backend, check_inputs=check_inputs, memory_budget_bytes=memory_budget_bytes)

    class PatchedFusedLinearForPPO(FusedLinearForPPO):
        def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
            super().__init__(chunk_size, impl_backend, **options)

    previous = (kernel_module.linear_cross_entropy, functional_module.FusedLinearForPPO)
    kernel_module.linear_cross_entropy = functools.partial(linear_cross_entropy, **options)
    functional_module.FusedLinearForPPO = PatchedFusedLinearForPPO
    for name in MCORE_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "linear_cross_entropy", None) is previous[0]:
            module.linear_cross_entropy = kernel_module.linear_cross_entropy
    return previous


__all__ = ["linear_cross_entropy", "FusedLinearForPPO", "patch_fused_kernels", "REDUCTIONS", "MCORE_MODULES"]
