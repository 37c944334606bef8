"""verl's log-prob and entropy functions on logits (``verl.utils.torch_functional``), on fused_rl's fused pass.

verl's actor engines without fused kernels (``use_fused_kernels=False``, verl's default: the FSDP, automodel and
torchtitan engines, the prefix-grouper forward, the naive rollout) compute each token's log-prob with
``logprobs_from_logits(logits, labels)`` (flash-attn's Triton cross entropy where it is installed, else a
``logsumexp`` or ``log_softmax`` per row) and its entropy with ``entropy_from_logits(logits)`` (a whole
``softmax(logits)`` and ``softmax * logits``, two more ``(N, V)`` buffers kept for the backward; or
``entropy_from_logits_with_chunking``, fp32 copies of 2048 rows at a time). Here each is one
:func:`fused_rl.token_logprobs` pass: the logits are read by the fused kernel, no ``(N, V)`` buffer is formed but the
gradient (written over the logits with ``inplace_backward=True``, as flash-attn's), on any device and backend.

:func:`patch_torch_functional` rebinds the three names in ``verl.utils.torch_functional`` and in the modules that
import ``logprobs_from_logits`` by name (:data:`VERL_MODULES`); importing :mod:`fused_rl.integrations.verl_patch`
(verl's ``external_lib``) runs it.

Differences from verl's (each tested): the log-probs and entropies are fp32 (fp64 for fp64 logits) whatever the
logits' dtype (verl's ``entropy_from_logits`` and its non-flash-attn log-probs keep bf16 logits' dtype, computing
the softmax in bf16); a label ``-100`` gives 0 and no gradient (flash-attn's ignore index; verl's fallback would
index with it) and any other label outside ``[0, V)`` raises (``check_inputs=True``, one host sync a call); a row
with some ``-inf`` logits has a finite entropy (verl's: NaN, ``0 * -inf``; a row of only ``-inf``: NaN on both);
``entropy_from_logits_with_chunking`` takes any leading shape (verl's only ``(N, V)``), ``chunk_size`` checked but
unused (the fused pass has no ``(chunk, V)`` buffer to bound); zero tokens raise (verl's entropy gives an empty
tensor).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..ops import token_entropy, token_logprobs
from ..validation import check_chunk_size, check_flag
from .patching import rebind

#: verl 0.9's modules holding the names: ``torch_functional`` defines them (the engines read the entropy functions
#: from it when they are built), the others import ``logprobs_from_logits`` from it when they are imported
VERL_MODULES = ("verl.utils.torch_functional", "verl.workers.engine.fsdp.transformer_impl",
                "verl.workers.engine.automodel.transformer_impl", "verl.workers.engine.torchtitan.transformer_impl",
                "verl.trainer.ppo.prefix_grouper_utils", "verl.workers.rollout.naive.naive_rollout")


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *,
                         backend: str = "auto", check_inputs: bool = True) -> torch.Tensor:
    """verl's ``logprobs_from_logits``: ``log softmax(logits)[labels]`` over the last dimension, of ``labels``' shape,
    fp32 (fp64 for fp64 logits), differentiable. ``inplace_backward=True`` (verl's default, which it turns off when
    it also takes the entropy of the same logits) writes the logits' gradient over them, as flash-attn's kernel does
    (:func:`fused_rl.token_logprobs`'s ``inplace``: a leaf is left intact, and a backward that would read the
    overwritten logits raises instead of reading the gradient)."""
    check_flag(inplace_backward, "inplace_backward")
    return token_logprobs(logits, labels, backend=backend, check_inputs=check_inputs, inplace=inplace_backward)


def entropy_from_logits(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """verl's ``entropy_from_logits``: ``H = logsumexp(z) - sum_j softmax(z)_j z_j`` over the last dimension, of the
    logits' leading shape, fp32 (fp64 for fp64 logits), differentiable."""
    return token_entropy(logits, backend=backend)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048, *,
                                      backend: str = "auto") -> torch.Tensor:
    """verl's ``entropy_from_logits_with_chunking``: :func:`entropy_from_logits` (whose fused pass keeps no
    ``(chunk_size, V)`` buffer); ``chunk_size`` must be a positive int."""
    check_chunk_size(chunk_size)
    return entropy_from_logits(logits, backend=backend)


def patch_torch_functional(*, backend: str = "auto", check_inputs: bool = True,
                           modules: Optional[tuple] = None) -> dict:
    """Make verl's engines take log-probs and entropies from fused_rl: rebinds ``logprobs_from_logits``,
    ``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` wherever each of ``modules`` (default
    :data:`VERL_MODULES`: ``verl.utils.torch_functional`` is imported, the others patched if imported; one imported
    later takes the patched names from it) has them, with the given ``backend`` and ``check_inputs`` (``False``: no
    host sync a call, labels unchecked). An engine reads the entropy function when it is built: patch before (verl
    imports ``external_lib`` before it builds the engine). It patches this process only: call it in verl's workers
    (``actor_rollout_ref.model.external_lib=fused_rl.integrations.verl_patch`` does, with the defaults). Returns
    ``{module name: {name: previous}}`` for restoring."""
    return rebind({
        "logprobs_from_logits": functools.partial(logprobs_from_logits, backend=backend, check_inputs=check_inputs),
        "entropy_from_logits": functools.partial(entropy_from_logits, backend=backend),
        "entropy_from_logits_with_chunking": functools.partial(entropy_from_logits_with_chunking, backend=backend)},
        modules, VERL_MODULES)


__all__ = ["logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking",
           "patch_torch_functional", "VERL_MODULES"]
