"""Megatron-Core's vocabulary-parallel cross entropy, and verl's Megatron log-prob / entropy functions, on fused_rl.

With tensor parallelism, Megatron's output layer leaves each rank the logits of its slice of the vocabulary
(``(..., V / tp)``), and ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` takes the loss from them: an
fp32 copy of the slice, its softmax kept for the backward, three all-reduces. verl's Megatron engine
(``verl.workers.engine.megatron.transformer_impl``) takes each token's log-prob as its negation
(``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits``) and the entropy from its own
``vocab_parallel_entropy`` (another softmax of the slice, in the logits' dtype, on a clone of the logits). Here each
is one :func:`fused_rl.vocab_parallel.token_logprobs` pass: the logits' slice is read by the fused kernel (its largest
entry once more), no ``(..., V / tp)`` buffer but the gradient, one ``all_gather`` of two values per token (three with
the entropy; and, with ``check_inputs``, one of the slice sizes and each process's check results, and a host sync:
a process's bad argument raises on every process).

The tensor-parallel group is Megatron's (``megatron.core.parallel_state.get_tensor_model_parallel_group()`` at each
call) unless a ``group`` is given. Gradients are Megatron's: each rank's logits gradient its own slice's.

Differences from Megatron's (each tested): a target ``-100`` gives 0 and no gradient, any other target outside the
whole vocabulary raises (``check_inputs=True``, one host sync; Megatron's gives ``log sum exp`` for a target in no
slice); ``label_smoothing > 0`` raises ``NotImplementedError``; the log-probs are those of the slices' exact
``logsumexp`` in fp32 (Megatron's work in fp32 too; verl's ``vocab_parallel_entropy`` works in the logits' dtype and
returns it: bf16 for bf16 logits, fp32 here); no double backward (``create_graph=True`` raises); under
``torch.compile`` the call runs eagerly (a graph break).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .. import vocab_parallel
from ..validation import check_chunk_size
from .patching import rebind

#: verl 0.9's modules that bind the three names at their import (:func:`patch_verl_megatron`)
VERL_MODULES = ("verl.utils.megatron.tensor_parallel", "verl.workers.engine.megatron.transformer_impl")


def _group(group: Any) -> Any:
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, group: Any = None, backend: str = "auto",
                                 check_inputs: bool = True) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy``: ``-log softmax(logits)[target]`` over the whole vocabulary,
    fp32 (fp64 for fp64 logits) of ``target``'s shape, from this rank's slice ``vocab_parallel_logits (..., V / tp)``
    and the global ``target (...)``."""
    group = _group(group)

    def checks() -> None:
        if label_smoothing > 0.0:  # Megatron's takes a value <= 0 as none
            raise NotImplementedError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r} is not "
                                      "supported by fused_rl (policy losses take the log-prob of the sampled token)")

    vocab_parallel.agreed_checks(checks, vocab_parallel_logits, group, check_inputs)  # raised on every process
    return -vocab_parallel.token_logprobs(vocab_parallel_logits, target, group=group, backend=backend,
                                          check_inputs=check_inputs)


def vocab_parallel_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, group: Any = None,
                                         backend: str = "auto", check_inputs: bool = True) -> torch.Tensor:
    """verl's ``vocab_parallel_log_probs_from_logits``: each token's log-prob (the negated cross entropy)."""
    return vocab_parallel.token_logprobs(logits, labels, group=_group(group), backend=backend,
                                         check_inputs=check_inputs)


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, *, group: Any = None,
                           backend: str = "auto") -> torch.Tensor:
    """verl's ``vocab_parallel_entropy``: each position's entropy over the whole vocabulary, fp32, of the logits'
    leading shape, differentiable (verl's ``(total_nnz, V / tp)`` logits, or any leading shape). The logits are
    not modified (verl's backward writes into them and restores them)."""
    # the pass also takes the log-prob of token 0 (on the first rank's slice), which nothing reads
    targets = torch.zeros(vocab_parallel_logits.shape[:-1], dtype=torch.int64, device=vocab_parallel_logits.device)
    return vocab_parallel.token_logprobs(vocab_parallel_logits, targets, group=_group(group), return_entropy=True,
                                         backend=backend, check_inputs=False)[1]


def vocab_parallel_entropy_with_chunking(vocab_parallel_logits: torch.Tensor, chunk_size: int = 2048, *,
                                         group: Any = None, backend: str = "auto") -> torch.Tensor:
    """verl's ``vocab_parallel_entropy_with_chunking`` (``(batch, seq, ..., V / tp)`` logits, ``chunk_size`` tokens of
    the sequence at a time): :func:`vocab_parallel_entropy`, whose fused pass has no ``(..., V)`` buffer to chunk;
    ``chunk_size`` must be a positive int."""
    check_chunk_size(chunk_size)
    if vocab_parallel_logits.dim() < 3:  # verl's slices the second dimension: of 2-D logits, the vocabulary
        raise ValueError("vocab_parallel_entropy_with_chunking takes (batch, seq, ..., V / tp) logits, got shape "
                         f"{tuple(vocab_parallel_logits.shape)}")
    return vocab_parallel_entropy(vocab_parallel_logits, group=group, backend=backend)


def patch_verl_megatron(*, group: Any = None, backend: str = "auto", check_inputs: bool = True,
                        modules: Optional[tuple] = None) -> dict:
    """Make verl's Megatron engine take log-probs and entropies from fused_rl: rebinds
    ``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy`` and ``vocab_parallel_entropy_with_chunking``
    in each of ``modules`` (default :data:`VERL_MODULES`; ``verl.utils.megatron.tensor_parallel`` is imported, the
    engine module is patched if imported: one imported later takes the patched names from the first) to this
    module's, with the given options. It patches this process only: call it in verl's workers (e.g. from an
    ``external_lib`` module). Returns ``{module name: {name: previous}}`` for restoring."""
    options = dict(group=group, backend=backend)
    return rebind({
        "vocab_parallel_log_probs_from_logits": functools.partial(vocab_parallel_log_probs_from_logits,
                                                                  check_inputs=check_inputs, **options),
        "vocab_parallel_entropy": functools.partial(vocab_parallel_entropy, **options),
        "vocab_parallel_entropy_with_chunking": functools.partial(vocab_parallel_entropy_with_chunking, **options)},
        modules, VERL_MODULES)


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
           "vocab_parallel_entropy_with_chunking", "patch_verl_megatron", "VERL_MODULES"]
