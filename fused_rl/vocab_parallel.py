"""Log-probs and entropy of a vocabulary-parallel (tensor-parallel) LM head, without the logits.

Each process ``r`` of ``group`` (``R`` of them) holds rows ``[r V_r, (r + 1) V_r)`` of the LM-head weight (Megatron's
``ColumnParallelLinear`` output layer, verl's ``linear_cross_entropy`` with a tensor-parallel ``dist_process_group``)
and the same hidden states and (global) token ids. With ``z = hidden @ W^T / temperature``:

* each process runs one fused pass (:func:`fused_rl.linear_token_logprobs`) over its shard, reading its target where
  the token is in its shard and otherwise a stand-in column ``c`` (the row index modulo ``V_r``), which gives the
  shard's ``lse_r = logsumexp_{j in r} z_j = z_c - log p_r(c)`` (``z_c`` one dot product per row, in fp32) and, with
  ``return_entropy``, its entropy ``H_r``;
* one ``all_gather`` of ``(lse_r, [z_t if t in r else 0], H_r)`` per token, and then, on every process alike:
  ``LSE = logsumexp_r lse_r``, ``w_r = exp(lse_r - LSE)``,
  ``log p(t) = z_t - LSE`` and ``H = sum_r w_r H_r + sum_r w_r (LSE - lse_r)`` (the entropy of a mixture: the
  shards' entropies plus that of the shard weights ``w``).

Gradients follow Megatron's and verl's tensor-parallel convention: every process computes the same loss from the
outputs, and each one's gradient is that loss's gradient through its own shard's statistics (the gather's backward
hands each process its own row, no collective): the weight gradient is the shard's own, the hidden-state gradient is
this process's partial sum, whose sum over the group is the whole gradient (Megatron's
``copy_to_tensor_model_parallel_region`` / sequence-parallel gather all-reduce it in their backward). Only one
``all_gather`` (of ``2`` or ``3`` fp32 values per token) runs in the forward, none in the backward.

The stand-in column's one-hot gradient cancels (the dot product adds what the fused pass's ``log p_r(c)`` takes away);
spreading the stand-ins over the shard's columns keeps that cancellation to one row's contribution per column, within
the rounding of a 16-bit gradient. Logits are finite here (no bias argument: Megatron's and verl's LM heads have none).
Memory beyond the fused pass's: the dot products' backward forms its own ``(V_r, H)`` weight gradient (in the weight's
dtype, added to the fused pass's by autograd) and ``(N, H)`` hidden gradient; the statistics are ``O(R N)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .config import IGNORE_INDEX
from .ops import _check_flags, _check_linear, _memory_budget, linear_token_logprobs as _linear_token_logprobs
from .validation import INDEX_DTYPES, _is_compiling, check_temperature, run_value_checks

#: Rows per chunk of :class:`_RowDot` (a ``(rows, H)`` fp32 product at a time).
ROW_DOT_CHUNK = 4096


class _RowDot(torch.autograd.Function):
    """``z_n = hidden_n . weight[sel_n]`` for ``hidden (N, H)``, ``sel (N,)`` in ``[0, V)``, in ``dtype`` (fp32 or
    fp64: the products of 16-bit inputs are exact there), in chunks of rows: no ``(N, H)`` fp32 copy is kept."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, sel: torch.Tensor, dtype: torch.dtype):
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], ROW_DOT_CHUNK):
            rows = slice(start, start + ROW_DOT_CHUNK)
            out[rows] = torch.linalg.vecdot(hidden[rows].to(dtype), weight[sel[rows]].to(dtype))
        ctx.save_for_backward(hidden, weight, sel)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, sel = ctx.saved_tensors
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ROW_DOT_CHUNK):
            rows = slice(start, start + ROW_DOT_CHUNK)
            g = grad[rows].unsqueeze(-1)
            if grad_h is not None:
                grad_h[rows] = g * weight[sel[rows]].to(grad.dtype)
            if grad_w is not None:
                grad_w.index_add_(0, sel[rows], (g * hidden[rows].to(grad.dtype)).to(weight.dtype))
        return grad_h, grad_w, None, None


class _GatherRows(torch.autograd.Function):
    """``(R, *local.shape)``: every process's ``local``, in rank order. Every process computes the same loss of the
    result, so the gradient of its own ``local`` is its own row of the result's gradient (no collective)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank = dist.get_rank(group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def shard_statistics(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                     temperature: float, return_entropy: bool, backend: str,
                     memory_budget_bytes: Optional[int]) -> torch.Tensor:
    """This shard's ``(lse_r, z_t or 0, [H_r])`` per token, ``(2 or 3, B, T)`` fp32 (fp64 for fp64 input),
    differentiable: one fused pass over the shard plus one dot product per row (module docstring). ``targets`` are
    global ids (``IGNORE_INDEX`` rows: 0 statistics' gradient, any value)."""
    vocab = weight.shape[0]
    local = targets.long() - vocab_start
    in_shard = (local >= 0) & (local < vocab)
    stand_in = torch.arange(targets.numel(), device=targets.device).view(targets.shape) % vocab
    sel = torch.where(in_shard, local, stand_in)
    ignored = targets == IGNORE_INDEX
    out = _linear_token_logprobs(hidden, weight, torch.where(ignored, IGNORE_INDEX, sel), temperature=temperature,
                                 return_entropy=return_entropy, backend=backend, check_inputs=False,
                                 memory_budget_bytes=memory_budget_bytes)
    logp = out[0] if return_entropy else out
    flat = hidden.reshape(-1, hidden.shape[-1])
    z_sel = (_RowDot.apply(flat, weight, sel.reshape(-1), logp.dtype) / temperature).view(targets.shape)
    rows = [z_sel - logp, torch.where(in_shard, z_sel, torch.zeros_like(z_sel))]
    return torch.stack(rows + [out[1]] if return_entropy else rows)


def combine(gathered: torch.Tensor, ignored: torch.Tensor, return_entropy: bool):
    """``(log p(t), H or None)`` of every shard's :func:`shard_statistics`, ``gathered (R, 2 or 3, B, T)`` (module
    docstring's formulas); 0 at ``ignored`` tokens."""
    lse = gathered[:, 0]
    total = torch.logsumexp(lse, dim=0)
    zero = torch.zeros_like(total)
    # <= 0 as computed: the owner's lse_r = z_t - log p_r(t) >= z_t (the fused pass's log-probs are <= 0), LSE >= lse_r
    logp = torch.where(ignored, zero, gathered[:, 1].sum(0) - total)
    if not return_entropy:
        return logp, None
    w = torch.exp(lse - total)
    entropy = (w * (gathered[:, 2] + (total - lse))).sum(0)
    return logp, torch.where(ignored, zero, entropy)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, group: Any = None,
                          temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                          check_inputs: bool = True, memory_budget_bytes: Optional[int] = None):
    """:func:`fused_rl.linear_token_logprobs` of a vocabulary-parallel LM head: ``hidden (B, T, H)`` and ``targets
    (B, T)`` (global token ids, ``-100`` ignored) the same on every process of ``group`` (``None``: the default
    group), ``weight (V_r, H)`` this process's rows ``[rank V_r, (rank + 1) V_r)`` of the whole ``(R V_r, H)``
    weight. Returns ``log p(t)`` ``(B, T)`` (and ``H``) of the whole vocabulary, fp32 (fp64 for fp64 input), the
    same on every process; gradients per the module docstring (the hidden states' is this process's partial sum).
    Every process of ``group`` must call it (one ``all_gather``; with ``check_inputs`` one more of the shard
    sizes, which must be equal, and one host sync for the target range)."""
    _check_flags(return_entropy=return_entropy, check_inputs=check_inputs)
    _check_linear(hidden, weight, None)
    memory_budget_bytes = _memory_budget(memory_budget_bytes)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in INDEX_DTYPES:
        raise ValueError(f"targets must be an int32 or int64 tensor, got {getattr(targets, 'dtype', type(targets))}")
    if tuple(targets.shape) != tuple(hidden.shape[:2]) or targets.device != hidden.device:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:2])} on {hidden.device}, "
                         f"got {tuple(targets.shape)} on {targets.device}")
    check_temperature(temperature)
    world, rank, vocab = dist.get_world_size(group), dist.get_rank(group), weight.shape[0]
    if check_inputs and not _is_compiling():
        sizes = [torch.empty(1, dtype=torch.int64, device=hidden.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([vocab], device=hidden.device), group=group)
        whole = world * vocab
        run_value_checks([
            (f"every process's weight shard must have V_r = {vocab} rows (equal shards)",
             (torch.cat(sizes) == vocab).all()),
            (f"targets must be in [0, {whole}) (the {world} shards' vocabulary) or {IGNORE_INDEX}",
             (((targets >= 0) & (targets < whole)) | (targets == IGNORE_INDEX)).all())])
    stats = shard_statistics(hidden, weight, targets, rank * vocab, float(temperature), bool(return_entropy),
                             backend, memory_budget_bytes)
    logp, entropy = combine(_GatherRows.apply(stats, group), targets == IGNORE_INDEX, return_entropy)
    return (logp, entropy) if return_entropy else logp


__all__ = ["linear_token_logprobs", "shard_statistics", "combine"]
