"""Chunked torch backend: the vocabulary work in row chunks, never holding more than a chunk of
fp32 probabilities. Runs on any device; it is the fallback where no compiled kernel is available.

Forward per row (``z = logits / tau``):  ``m = max logits``, ``zs = (logits - m) / tau``, ``s = sum exp(zs)``,
``logp = zs_target - log s``, ``H = log s - E_p[zs]``. The raw max is subtracted before the division by ``tau``,
so ``zs`` is rounded relative to ``logits - m``, not to ``|logits|``.
Backward per row: ``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau``.

Both halves are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` sees
two opaque calls instead of unrolling the chunk loop.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..config import IGNORE_INDEX
from .base import Backend
from .custom_ops import grad_writable_in_place, host_floats, host_reading_op, register_token_ops

#: Elements of one fp32 chunk (8 MiB); a few such temporaries are alive at once.
CHUNK_ELEMENTS = 1 << 21


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(logits: torch.Tensor, first: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first_row, (n, V) view)`` blocks covering the leading dims in row-major order, without copying
    whenever the rows of each leading index are evenly strided (true for slices like ``logits[:, :-1]``)."""
    vocab = logits.shape[-1]
    try:
        yield first, logits.view(-1, vocab)
        return
    except RuntimeError:
        pass
    # not flat: split the first dim (a 2-D tensor with unit V stride always views, so this ends)
    rows_per = logits[0].numel() // vocab if logits.shape[0] else 0
    for b in range(logits.shape[0]):
        yield from _row_blocks(logits[b], first + b * rows_per)


def _chunks(logits: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    for first, block in _row_blocks(logits):
        for start in range(0, block.shape[0], rows):
            yield first + start, block[start:start + rows]


@host_reading_op("fused_rl::torch_token_stats", mutates_args=())
def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                with_entropy: bool, grad_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns flat ``(logp, entropy, lse)`` of length ``N = prod(logits.shape[:-1])`` (``entropy``
    empty unless ``with_entropy``). Rows whose target is ``IGNORE_INDEX`` give ``logp = H = 0``. ``temperature``:
    a ``custom_ops.host_floats`` of one value ``tau``; ``grad_in_place``: the backward runs
    :func:`token_grad_inplace`.

    ``lse`` is ``(2, N)``: the raw row max ``m = max logits`` and ``log s`` (``s = sum exp((logits - m) / tau)``)
    kept apart, so the backward's ``p = exp((logits - m) / tau - log s)`` does not lose ``log s`` to the
    rounding of ``m / tau + log s`` (``1 - p`` of a near-certain token at ``|z| ~ 1e3`` would be 0)."""
    cdtype = _compute_dtype(logits.dtype)
    tau = float(temperature)
    flat_targets = targets.reshape(-1)
    n = flat_targets.numel()
    logp = torch.empty(n, dtype=cdtype, device=logits.device)
    lse = torch.empty(2, n, dtype=cdtype, device=logits.device)
    entropy = torch.empty(n if with_entropy else 0, dtype=cdtype, device=logits.device)
    for start, chunk in _chunks(logits):
        stop = start + chunk.shape[0]
        t = flat_targets[start:stop]
        ignored = t == IGNORE_INDEX
        z = chunk.to(cdtype)
        m = z.amax(dim=-1, keepdim=True)
        # an all -inf row shifts by 0 (s = 0: logp NaN, as log_softmax gives); a NaN or +inf max stays, so
        # the row is NaN as in the reference
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        zs = (z - m) / tau
        e = torch.exp(zs)
        s = e.sum(dim=-1)
        log_s = torch.log(s)
        zt = zs.gather(-1, torch.where(ignored, 0, t).long().unsqueeze(-1)).squeeze(-1)
        zero = torch.zeros_like(zt)
        logp[start:stop] = torch.where(ignored, zero, zt - log_s)
        lse[0, start:stop] = m.squeeze(-1)
        lse[1, start:stop] = log_s
        if with_entropy:
            # H = log s - E_p[z - m], on the shifted logits: no cancellation of two large |lse| terms
            ez = (e * torch.where(e > 0, zs, torch.zeros_like(zs))).sum(dim=-1) / s
            entropy[start:stop] = torch.where(ignored, zero, log_s - ez)
    return logp, entropy, lse


@token_stats.register_fake
def _(logits, targets, temperature, with_entropy, grad_in_place=False):
    n = targets.numel()
    cdtype = _compute_dtype(logits.dtype)
    return (logits.new_empty(n, dtype=cdtype), logits.new_empty(n if with_entropy else 0, dtype=cdtype),
            logits.new_empty((2, n), dtype=cdtype))


@host_reading_op("fused_rl::torch_token_grad", mutates_args=())
def token_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
               entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
               temperature: torch.Tensor) -> torch.Tensor:
    """``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau`` with ``p = exp(zs - log s)``,
    ``zs = (logits - m) / tau`` and ``E[z] - z = (log s - H) - zs`` (``lse = (m, log s)`` of :func:`token_stats`);
    contiguous, in the logits dtype."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    out_rows = out.view(-1, logits.shape[-1])
    for start, _, g in _grad_chunks(logits, targets, lse, g_logp, entropy, g_entropy, float(temperature)):
        out_rows[start:start + g.shape[0]] = g
    return out


@host_reading_op("fused_rl::torch_token_grad_inplace", mutates_args=("logits",))
def token_grad_inplace(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
                       entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
                       temperature: torch.Tensor) -> None:
    """:func:`token_grad` written over ``logits``, chunk by chunk (each chunk's gradient formed before it is
    stored over the chunk: the chunks are views of the logits)."""
    for _, chunk, g in _grad_chunks(logits, targets, lse, g_logp, entropy, g_entropy, float(temperature)):
        chunk.copy_(g)


def _grad_chunks(logits, targets, lse, g_logp, entropy, g_entropy, tau: float):
    """``(first row, the rows' (n, V) view of the logits, their dlogits in the logits dtype)`` per chunk."""
    cdtype = _compute_dtype(logits.dtype)
    flat_targets = targets.reshape(-1)
    for start, chunk in _chunks(logits):
        stop = start + chunk.shape[0]
        t = flat_targets[start:stop]
        ignored = (t == IGNORE_INDEX).unsqueeze(-1)
        zs = (chunk.to(cdtype) - lse[0, start:stop].unsqueeze(-1)) / tau
        log_s = lse[1, start:stop].unsqueeze(-1)
        p = torch.exp(zs - log_s)
        gl = torch.where(ignored, 0.0, g_logp[start:stop].to(cdtype).unsqueeze(-1))
        g = -gl * p
        g.scatter_add_(-1, torch.where(ignored.squeeze(-1), 0, t).long().unsqueeze(-1), gl)
        if g_entropy is not None and entropy is not None:
            ge = torch.where(ignored, 0.0, g_entropy[start:stop].to(cdtype).unsqueeze(-1))
            ezs = log_s - entropy[start:stop].unsqueeze(-1)
            g += ge * torch.where(p > 0, p * (ezs - zs), torch.zeros_like(p))
        # ignored rows: exactly 0 (not 0 * NaN from logits never read for the loss)
        yield start, chunk, torch.where(ignored, 0.0, g / tau).to(logits.dtype)


register_token_ops(token_stats, token_grad, token_grad_inplace)


class TorchBackend(Backend):
    """Chunked eager torch on any device (the portable fallback)."""

    name = "torch"
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def token_logprobs(self, logits, targets, temperature, return_entropy, inplace=False):
        logp, entropy, _ = token_stats(logits, targets, host_floats((temperature,)), bool(return_entropy),
                                       inplace and grad_writable_in_place(logits))
        lead = targets.shape
        return logp.reshape(lead), (entropy.reshape(lead) if return_entropy else None)

    def linear_policy_loss(self, hidden, weight, bias, inputs, config, compute_entropy, memory_budget_bytes=None):
        """Tiles of tokens x the whole vocabulary, gradients computed in the forward; see
        :mod:`fused_rl.backends.torch_linear`."""
        from . import torch_linear

        return torch_linear.linear_policy_loss(hidden, weight, bias, inputs, config, compute_entropy,
                                               memory_budget_bytes)

    def linear_token_logprobs(self, hidden, weight, bias, targets, temperature, return_entropy,
                              memory_budget_bytes=None):
        from . import torch_linear

        return torch_linear.linear_token_logprobs(hidden, weight, bias, targets, temperature, return_entropy,
                                                  memory_budget_bytes)
