"""Chunked torch implementation of the fused linear policy loss: the logits ``z = h W^T + b`` are
produced one tile of tokens at a time and consumed at once, so no ``(N, V)`` tensor ever exists.

Per tile of ``n`` tokens (over the whole vocabulary, fp32; fp64 for fp64 inputs; the raw max subtracted
before the scaling by ``1 / tau``, so ``zs`` is rounded relative to ``z - m``, not to ``|z|``)::

    m = max z,  zs = (z - m) / tau,  s = sum exp(zs),  p = exp(zs) / s
    logp = zs_target - log s,  H = log s - E_p[zs]
    dz   = (g_logp (onehot - p) + g_H p (E_p[zs] - zs)) / tau
    grad_h = dz @ W,  grad_W += dz^T h (fp32 accumulator),  grad_b += sum_rows dz

``g_logp`` and ``g_H`` (the derivatives of the loss w.r.t. the tile's per-token log-probs and
entropies) come from autograd of ``sum(w * l)`` with ``l`` from the single definition of the loss
math, :func:`fused_rl.loss_math.per_token_loss`, evaluated on the tile's ``O(n)`` leaf vectors. The
loss is row-local (each sequence depends only on its own tokens, gspo included), so a tile that holds
whole sequences (any tokens at all for the token-level variants) has its exact coefficients as soon
as its logits are known: everything is done in the forward, in one pass, and the backward only
multiplies the stored gradients by ``grad_output``. A gspo sequence longer than one tile takes two
passes over its tiles (stats, then gradients), still never more than one tile of logits.

Memory: one tile keeps two ``(n, V)`` buffers alive (shifted logits and ``p``, the gradient is
written in place), so ``n = memory_budget_bytes // (2 * V * itemsize)`` (see :func:`chunk_tokens`),
plus the ``(V, H)`` fp32 weight-gradient accumulator (only when ``weight`` requires grad) and, for
bf16 / fp16 inputs, one fp32 copy of ``W``.

Masked tokens (mask off or target ``IGNORE_INDEX``): on CPU their rows are never gathered (padding
costs nothing); on other devices tiles are fixed slices of the flattened batch (no host sync) and
masked rows get zero coefficients (their hidden rows are zeroed first, so NaN padding stays out).

Both operations are ``torch.library`` custom ops with fake implementations and registered autograd,
so ``torch.compile`` sees one opaque call per operation.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..config import IGNORE_INDEX, PolicyLossConfig
from ..loss_math import aggregation_weights, compute_policy_loss, metrics, per_token_loss
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs
from .custom_ops import (autocast_free_op, config_args, config_from_args, host_floats, is_batched,
                         refuse_double_backward)

#: Bytes of logits-sized temporaries one tile may hold (two ``(n, V)`` buffers). ``None`` -> default.
MEMORY_BUDGET_BYTES: Optional[int] = None
#: Default budget: 128 MiB, i.e. 524 tokens per tile at V = 32000 in fp32.
DEFAULT_MEMORY_BUDGET_BYTES = 128 << 20
#: Default budget on CUDA (this module's tiles and the tiled route's of :mod:`.tiled_linear`): 1 GiB, 1046
#: tokens a tile here and 1395 in the tiled route's mixed mode at V = 128256. Thin tiles cost GEMM efficiency
#: on a GPU and one read + write of the fp32 weight gradient each, and a sequence longer than a tile takes two
#: passes in the sequence-level configs; issue 4 allows 1.5 GB beyond the weight gradient. Tiled route on an
#: H200 at N = 8192, H = 4096, V = 128256 bf16: 41-44 ms forward + backward (triton), 1034 MiB beyond the weight
#: gradient and the returned gradients; 1.35 GiB tiles: triton no faster, cuda 2-3 ms faster, 1388 MiB, too
#: close to the bound (docs/tiled_linear.md).
CUDA_DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
#: Force the tile size in tokens (``None``: derive it from the budget).
CHUNK_TOKENS: Optional[int] = None
#: Gather only the valid token rows (``None``: on CPU only, where it needs no device sync).
GATHER_VALID: Optional[bool] = None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`linear_token_grad` returns a gradient in: the input's, except fp32 for fp16, whose
    range a loss scale (GradScaler's 65536) overflows. (A loss op keeps its gradients in their fp32
    accumulators until the backward: ``_Grads.results(cast=False)``.)"""
    return torch.float32 if dtype == torch.float16 else dtype


def default_budget(device: Optional[torch.device]) -> int:
    """``MEMORY_BUDGET_BYTES`` if set, else the device's default (1 GiB on CUDA, 128 MiB elsewhere)."""
    if MEMORY_BUDGET_BYTES:
        return int(MEMORY_BUDGET_BYTES)
    return CUDA_DEFAULT_MEMORY_BUDGET_BYTES if device is not None and device.type == "cuda" \
        else DEFAULT_MEMORY_BUDGET_BYTES


def chunk_tokens(num_tokens: int, vocab: int, dtype: torch.dtype, memory_budget_bytes: Optional[int] = None,
                 device: Optional[torch.device] = None) -> int:
    """Tokens per tile: ``CHUNK_TOKENS`` if set, else ``budget // (2 * vocab * itemsize)`` (the two ``(V, n)``
    tile buffers) with the budget ``memory_budget_bytes`` (the public argument), else :func:`default_budget`;
    clamped to ``[1, num_tokens]``."""
    if CHUNK_TOKENS is not None:
        n = int(CHUNK_TOKENS)
    else:
        budget = memory_budget_bytes or default_budget(device)
        n = int(budget) // (2 * vocab * torch.empty((), dtype=_compute_dtype(dtype)).element_size())
    return max(1, min(n, max(num_tokens, 1)))


def _gather_valid(device: torch.device) -> bool:
    return GATHER_VALID if GATHER_VALID is not None else device.type == "cpu"


# --------------------------------------------------------------------------------------------- tiles
class _Tile:
    """The tokens ``idx`` (flat positions in ``B * T``) of one tile, and the rows ``[r0, r1)`` that
    hold them (``sel``: their positions inside that ``(r1 - r0, T)`` block)."""

    __slots__ = ("idx", "r0", "r1", "sel", "contiguous")

    def __init__(self, idx, r0, r1, sel, contiguous):
        self.idx, self.r0, self.r1, self.sel, self.contiguous = idx, r0, r1, sel, contiguous


def _span_tile(start: int, stop: int, length: int, device) -> _Tile:
    r0, r1 = start // length, (stop - 1) // length + 1
    idx = torch.arange(start, stop, device=device)
    return _Tile(idx, r0, r1, idx - r0 * length, (start, stop))


def _index_tile(idx: torch.Tensor, length: int, r0: int, r1: int) -> _Tile:
    return _Tile(idx, r0, r1, idx - r0 * length, None)


def _groups(valid: torch.Tensor, n_tile: int, rowwise: bool) -> Iterator[list[_Tile]]:
    """Groups of tiles whose loss coefficients are computed together: each group is whole sequences
    when ``rowwise`` (gspo), any tokens otherwise. A group of one tile is done in one pass."""
    batch, length = valid.shape
    device = valid.device
    if _gather_valid(device):
        flat = valid.reshape(-1).nonzero().squeeze(-1)
        if not rowwise:
            rows = torch.div(flat, length, rounding_mode="floor")
            bounds = rows.tolist()
            for s in range(0, flat.numel(), n_tile):
                e = min(s + n_tile, flat.numel())
                yield [_index_tile(flat[s:e], length, bounds[s], bounds[e - 1] + 1)]
            return
        counts = valid.sum(dim=1).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        b = 0
        while b < batch:
            if counts[b] == 0:
                b += 1
                continue
            if counts[b] > n_tile:  # one long sequence: several tiles, two passes
                idx = flat[offsets[b]:offsets[b + 1]]
                yield [_index_tile(idx[s:s + n_tile], length, b, b + 1) for s in range(0, idx.numel(), n_tile)]
                b += 1
                continue
            e, total = b, 0
            while e < batch and total + counts[e] <= n_tile:
                total += counts[e]
                e += 1
            yield [_index_tile(flat[offsets[b]:offsets[e]], length, b, e)]
            b = e
        return
    total = batch * length
    if not rowwise:
        for s in range(0, total, n_tile):
            yield [_span_tile(s, min(s + n_tile, total), length, device)]
        return
    if length > n_tile:
        for b in range(batch):
            yield [_span_tile(s, min(s + n_tile, (b + 1) * length), length, device)
                   for s in range(b * length, (b + 1) * length, n_tile)]
        return
    rows = n_tile // length
    for b in range(0, batch, rows):
        e = min(b + rows, batch)
        yield [_span_tile(b * length, e * length, length, device)]


def _tile_inputs(tile: _Tile, hidden_flat, targets_flat, valid_flat, cdtype):
    if tile.contiguous is not None:
        s, e = tile.contiguous
        ok = valid_flat[s:e]
        h = torch.where(ok.unsqueeze(-1), hidden_flat[s:e], torch.zeros((), dtype=hidden_flat.dtype,
                                                                          device=hidden_flat.device))
        t = torch.where(ok, targets_flat[s:e], torch.zeros_like(targets_flat[s:e]))
    else:
        ok = None
        h = hidden_flat.index_select(0, tile.idx)
        t = targets_flat.index_select(0, tile.idx)
    return h.to(cdtype), t.long(), ok


class _Workspace:
    """The two ``V x n_tile`` buffers every tile reuses (allocated once per call: no allocator churn,
    no fresh pages to fault in per tile, and a peak that does not depend on the allocator)."""

    def __init__(self, n_tile: int, vocab: int, dtype, device):
        self.n_tile, self.vocab, self.dtype, self.device = n_tile, vocab, dtype, device
        self.bufs = None

    def get(self, n: int):
        """Two contiguous ``(V, n)`` views."""
        if self.bufs is None:
            self.bufs = [torch.empty(self.vocab * self.n_tile, dtype=self.dtype, device=self.device)
                         for _ in range(2)]
        return tuple(b[:self.vocab * n].view(self.vocab, n) for b in self.bufs)


#: Elements of the temporary of the blocked column dot product in the entropy (4 MiB fp32).
_DOT_BLOCK_ELEMENTS = 1 << 20


def _column_dot(e: torch.Tensor, zs: torch.Tensor) -> torch.Tensor:
    """``sum_v e[v, i] * zs[v, i]`` for ``(V, n)`` tiles, in row blocks (small temporary), with the terms of
    ``e = 0`` (a ``-inf`` logit: ``zs = -inf``) 0, not NaN."""
    rows = max(1, _DOT_BLOCK_ELEMENTS // e.shape[1])
    out = torch.zeros(e.shape[1], dtype=e.dtype, device=e.device)
    for start in range(0, e.shape[0], rows):
        eb = e[start:start + rows]
        out.add_(torch.where(eb > 0, eb * zs[start:start + rows], 0.0).sum(dim=0))
    return out


def _tile_stats(h, t, weight_c, bias_c, inv_tau: float, with_entropy: bool, ws: _Workspace):
    """``(state, logp, H)`` of the tile; ``state = (zs, e, 1/s[, E_p[zs]])`` with the shifted tempered
    logits ``zs = (z - m) / tau`` and ``e = exp(zs)``, ``p = e / s``. The tile is vocabulary-major: ``zs`` and
    ``e`` are ``(V, n)`` (``zs^T = W h^T`` is the faster GEMM orientation for thin token tiles, and
    ``grad_W += dz^T h`` needs no transpose). ``H`` and ``E_p[zs]`` only ``with_entropy``."""
    zs, e = ws.get(h.shape[0])
    if bias_c is None:
        torch.mm(weight_c, h.t(), out=zs)
    else:
        torch.addmm(bias_c.unsqueeze(1), weight_c, h.t(), out=zs)
    m = zs.amax(dim=0, keepdim=True)
    zs.sub_(m)  # before the scaling by 1/tau: zs is rounded relative to z - m, not to |z|
    if inv_tau != 1.0:
        zs.mul_(inv_tau)
    torch.exp(zs, out=e)
    s = e.sum(dim=0, keepdim=True)
    log_s = torch.log(s).squeeze(0)
    logp = zs.gather(0, t.unsqueeze(0)).squeeze(0) - log_s
    inv_s = s.reciprocal()  # p = e * inv_s is never formed: the scale folds into the coefficients
    if not with_entropy:
        return (zs, e, inv_s), logp, None
    ez = _column_dot(e, zs) * inv_s.squeeze(0)
    return (zs, e, inv_s, ez), logp, log_s - ez


def _tile_dlogits(state, t, g_logp, g_ent, inv_tau: float) -> torch.Tensor:
    """``dz = (g_logp (onehot - p) + g_H p (E_p[zs] - zs)) / tau`` with ``p = e / s``, written over ``zs``
    (``(V, n)``, i.e. ``dz^T``)."""
    zs, e, inv_s = state[:3]
    gl = (g_logp * inv_tau).unsqueeze(0)
    if g_ent is None:
        torch.mul(e, gl.neg() * inv_s, out=zs)
    else:
        ge = (g_ent * inv_tau).unsqueeze(0)
        zs.sub_(state[3].unsqueeze(0)).mul_(ge.neg() * inv_s).sub_(gl * inv_s).mul_(e)
        rows = max(1, _DOT_BLOCK_ELEMENTS // e.shape[1])  # p = 0 (a -inf logit, zs = -inf): 0, not 0 * inf,
        for start in range(0, e.shape[0], rows):          # with a block-sized mask, not a (V, n) one
            zs[start:start + rows].masked_fill_(e[start:start + rows] == 0, 0.0)
    zs.scatter_add_(0, t.unsqueeze(0), gl)
    return zs


class _Grads:
    """Gradient buffers of the linear layer, all three in the accumulation dtype ``cdtype`` (fp32 for
    16-bit inputs); the weight / bias accumulators exist only when wanted (the weight one is written,
    not zero-filled, by the first tile)."""

    def __init__(self, hidden, weight, need_h, need_w, need_b, cdtype):
        n_tok = hidden.shape[0] * hidden.shape[1]
        self.cdtype = cdtype
        self.h = torch.zeros(n_tok, hidden.shape[2], dtype=cdtype, device=hidden.device) if need_h else None
        self.w = torch.empty(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
        self.w_written = False
        self.b = torch.zeros(weight.shape[0], dtype=cdtype, device=weight.device) if need_b else None

    def add(self, tile: _Tile, dz_t, h, weight_c, ok):
        """``dz_t``: the tile's ``(V, n)`` logits gradient (transposed)."""
        if self.h is not None:
            self.put_h(tile, torch.mm(dz_t.t(), weight_c), ok)
        if self.w is not None:
            if self.w_written:
                self.w.addmm_(dz_t, h)
            else:
                torch.mm(dz_t, h, out=self.w)
                self.w_written = True
        if self.b is not None:
            self.b.add_(dz_t.sum(dim=1))

    def put_h(self, tile: _Tile, gh, ok):
        """The tile's hidden-gradient rows (zero where ``ok`` is False, for fixed-slice tiles)."""
        if tile.contiguous is not None:
            s, e = tile.contiguous
            self.h[s:e] = torch.where(ok.unsqueeze(-1), gh, torch.zeros((), dtype=gh.dtype, device=gh.device))
        else:
            self.h.index_copy_(0, tile.idx, gh.to(self.h.dtype))

    def results(self, hidden, weight, cast: bool = True):
        """``(grad_hidden, grad_weight, grad_bias)``, rounded to :func:`grad_dtype` if ``cast``, else left
        in the accumulation dtype (for a loss op, whose backward, :func:`scale_grads`, rounds them once
        when it multiplies them by ``grad_output``: one pass over the ``(V, H)`` accumulator instead of a
        cast here and a multiply there, and one rounding)."""
        if self.w is not None and not self.w_written:
            self.w.zero_()
        hdtype, wdtype = (grad_dtype(hidden.dtype), grad_dtype(weight.dtype)) if cast else (self.cdtype,) * 2
        return (hidden.new_empty(0, dtype=hdtype) if self.h is None else self.h.view(hidden.shape).to(hdtype),
                weight.new_empty(0, dtype=wdtype) if self.w is None else self.w.to(wdtype),
                weight.new_empty(0, dtype=wdtype) if self.b is None else self.b.to(wdtype))


def _prepare(hidden, weight, bias):
    cdtype = _compute_dtype(hidden.dtype)
    weight_c = weight.to(cdtype).contiguous()
    bias_c = None if bias is None else bias.to(cdtype)
    return cdtype, hidden.reshape(-1, hidden.shape[-1]), weight_c, bias_c


# ------------------------------------------------------------------------------- fused policy loss
@contextlib.contextmanager
def _autograd_inside_op():
    """Record autograd inside a custom op's implementation: the dispatcher calls it with the autograd
    keys excluded (and grad mode off); re-enable both for the ``O(chunk)`` loss-math graph only."""
    DK = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DK.AutogradFunctionality, DK.AutogradOther, DK.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


def _coefficients(tile_groups: list[_Tile], logp_parts, ent_parts, config, adv, valid, weights, old, ref,
                  rollout, is_weights, length: int, need_grad: bool):
    """Loss of the group and ``(g_logp, g_H)`` per tile, by autograd of ``sum(w * l)`` on the rows
    ``[r0, r1)`` that hold the group (tokens outside the group are masked there)."""
    r0, r1 = tile_groups[0].r0, tile_groups[-1].r1
    block = (r1 - r0, length)
    cd = logp_parts[0].dtype
    sel = torch.cat([tl.sel for tl in tile_groups]) if len(tile_groups) > 1 else tile_groups[0].sel
    lp_vals = torch.cat(logp_parts) if len(logp_parts) > 1 else logp_parts[0]
    with _autograd_inside_op():
        lp_vals = lp_vals.detach().requires_grad_(need_grad)
        logp_b = torch.zeros(block[0] * block[1], dtype=cd, device=lp_vals.device).index_put((sel,), lp_vals)
        leaves = [lp_vals]
        ent_b = None
        if ent_parts is not None:
            ent_vals = (torch.cat(ent_parts) if len(ent_parts) > 1 else ent_parts[0]).detach()
            ent_vals.requires_grad_(need_grad and config.needs_entropy_grad)
            if config.needs_entropy_grad:
                leaves.append(ent_vals)
            ent_b = torch.zeros(block[0] * block[1], dtype=cd, device=lp_vals.device).index_put((sel,), ent_vals)
            ent_b = ent_b.view(block)
        in_group = torch.zeros(block[0] * block[1], dtype=torch.bool, device=lp_vals.device)
        in_group[sel] = True
        mask_b = in_group.view(block) & valid[r0:r1]
        rows = lambda x: None if x is None else x[r0:r1]
        loss_t = per_token_loss(logp_b.view(block), adv[r0:r1], mask_b, config, old_logprobs=rows(old),
                                ref_logprobs=rows(ref), entropy=ent_b, rollout_logprobs=rows(rollout),
                                rollout_is_weights=rows(is_weights)).loss
        loss = (loss_t * weights[r0:r1]).sum()
        if not need_grad:
            return loss.detach(), [(None, None)] * len(tile_groups)
        grads = torch.autograd.grad(loss, leaves)
    g_logp = grads[0]
    g_ent = grads[1] if len(grads) > 1 else None
    out, s = [], 0
    for tl in tile_groups:
        n = tl.sel.numel()
        out.append((g_logp[s:s + n], None if g_ent is None else g_ent[s:s + n]))
        s += n
    return loss.detach(), out


@autocast_free_op("fused_rl::torch_linear_policy_loss")
def linear_policy_loss_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    advantages: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, old: Optional[torch.Tensor],
    ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor], is_weights: Optional[torch.Tensor],
    config_literal: str, config_floats: torch.Tensor, with_entropy: bool, need_h: bool, need_w: bool, need_b: bool,
    n_tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, logp (B,T), entropy (B,T) or empty, grad_hidden, grad_weight, grad_bias)``; each
    gradient is empty unless its ``need_*`` flag is set. ``weights`` are the aggregation weights;
    ``with_entropy`` must be set when ``config.needs_entropy``."""
    config = config_from_args(config_literal, config_floats)
    batch, length, _ = hidden.shape
    cdtype, hidden_flat, weight_c, bias_c = _prepare(hidden, weight, bias)
    inv_tau = 1.0 / config.temperature
    if config.needs_entropy and not with_entropy:  # the fake implementation's entropy shape is with_entropy's
        raise ValueError("with_entropy must be set for a config that reads the entropy")
    need_grad = need_h or need_w or need_b
    targets_flat = targets.reshape(-1)
    valid_flat = valid.reshape(-1)
    logp = torch.zeros(batch * length, dtype=cdtype, device=hidden.device)
    entropy = torch.zeros(batch * length if with_entropy else 0, dtype=cdtype, device=hidden.device)
    grads = _Grads(hidden, weight, need_h, need_w, need_b, cdtype)
    ws = _Workspace(min(n_tile, batch * length), weight.shape[0], cdtype, hidden.device)
    loss = torch.zeros((), dtype=cdtype, device=hidden.device)
    for group in _groups(valid, n_tile, config.is_sequence_level):
        one_pass = len(group) == 1
        kept, lp_parts, ent_parts = [], [], []
        for tile in group:
            h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, cdtype)
            tile_state, lp, ent = _tile_stats(h, t, weight_c, bias_c, inv_tau, with_entropy, ws)
            if ok is not None:
                zero = torch.zeros_like(lp)
                lp = torch.where(ok, lp, zero)
                ent = None if ent is None else torch.where(ok, ent, zero)
            lp_parts.append(lp)
            ent_parts.append(ent)
            kept.append((h, t, ok, tile_state) if one_pass else None)
            del tile_state
        g_loss, coeffs = _coefficients(group, lp_parts, ent_parts if with_entropy else None, config, advantages,
                                       valid, weights, old, ref, rollout, is_weights, length, need_grad)
        loss = loss + g_loss
        for tile, lp, ent in zip(group, lp_parts, ent_parts):
            logp[tile.idx] = lp
            if with_entropy:
                entropy[tile.idx] = ent
        if not need_grad:
            continue
        for tile, state, (g_lp, g_ent) in zip(group, kept, coeffs):
            if state is None:  # second pass of a long sequence: recompute the tile
                h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, cdtype)
                tile_state = _tile_stats(h, t, weight_c, bias_c, inv_tau, config.needs_entropy_grad, ws)[0]
            else:
                h, t, ok, tile_state = state
            grads.add(tile, _tile_dlogits(tile_state, t, g_lp, g_ent, inv_tau), h, weight_c, ok)
        del kept, state
    gh, gw, gb = grads.results(hidden, weight, cast=False)
    return (loss, logp.view(batch, length), entropy.view(batch, length) if with_entropy else entropy, gh, gw, gb)


@linear_policy_loss_op.register_fake
def _(hidden, weight, bias, targets, advantages, valid, weights, old, ref, rollout, is_weights, config_literal,
      config_floats, with_entropy, need_h, need_w, need_b, n_tile):
    return fake_loss_outputs(hidden, weight, with_entropy, need_h, need_w, need_b, _compute_dtype(hidden.dtype))


def fake_loss_outputs(hidden, weight, with_entropy, need_h, need_w, need_b, dtype):
    """Fake ``(loss, logp, entropy, grad_hidden, grad_weight, grad_bias)`` of a fused-linear loss op
    (this one and :mod:`fused_rl.backends.tiled_linear`'s), values and gradients in the accumulation
    dtype ``dtype`` (``_Grads.results(cast=False)``: :func:`scale_grads` rounds the gradients)."""
    batch, length, _ = hidden.shape
    return (hidden.new_empty((), dtype=dtype), hidden.new_empty((batch, length), dtype=dtype),
            hidden.new_empty((batch, length) if with_entropy else (0,), dtype=dtype),
            *fake_grads(hidden, weight, need_h, need_w, need_b, dtype=dtype))


def fake_grads(hidden, weight, need_h, need_w, need_b, dtype: Optional[torch.dtype] = None):
    """Fake ``(grad_hidden, grad_weight, grad_bias)`` of :class:`_Grads` (empty where not needed): in
    ``dtype`` if given (``results(cast=False)``), else in :func:`grad_dtype` of the hidden states / weight."""
    hdtype, wdtype = (dtype, dtype) if dtype is not None else (grad_dtype(hidden.dtype), grad_dtype(weight.dtype))
    return (hidden.new_empty(hidden.shape if need_h else (0,), dtype=hdtype),
            weight.new_empty(weight.shape if need_w else (0,), dtype=wdtype),
            weight.new_empty((weight.shape[0],) if need_b else (0,), dtype=wdtype))


def scale_grads(ctx, g_loss, grads=None):
    """The stored ``grads`` (default ``ctx.saved_tensors``: ``(grad_hidden, grad_weight, grad_bias)``) times
    ``g_loss`` (``grad_output``), in the inputs' dtypes
    (the product in the stored dtype, e.g. the fp32 accumulator of the weight gradient, rounded once to
    the input dtype on store: one pass over it, no temporary); None where not needed."""
    grads = ctx.saved_tensors if grads is None else grads
    if is_batched(g_loss):
        return tuple((g * g_loss.to(g.dtype)).to(dtype) if need else None
                     for g, need, dtype in zip(grads, ctx.flags, ctx.dtypes))
    return tuple(torch.mul(g, g_loss.to(g.dtype), out=torch.empty(g.shape, dtype=dtype, device=g.device))
                 if need else None for g, need, dtype in zip(grads, ctx.flags, ctx.dtypes))


def _loss_setup_context(ctx, inputs, output):
    _, _, _, gh, gw, gb = output
    need_h, need_w, need_b = inputs[14], inputs[15], inputs[16]
    ctx.flags = (need_h, need_w, need_b)
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype, inputs[1].dtype)
    ctx.save_for_backward(gh, gw, gb)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero (V, H) / (N, H) grads for the non-differentiable outputs


def _loss_backward(ctx, g_loss, *_):
    refuse_double_backward("chunked fused-linear policy")
    if g_loss is None:  # set_materialize_grads(False): nothing reached the loss
        return (None,) * 18
    return scale_grads(ctx, g_loss) + (None,) * 15


linear_policy_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup_context)


def _needs_grad(x: Optional[torch.Tensor]) -> bool:
    return x is not None and x.requires_grad and torch.is_grad_enabled()


def linear_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       inputs: PolicyInputs, config: PolicyLossConfig, compute_entropy: bool,
                       memory_budget_bytes: Optional[int] = None) -> PolicyLossOutput:
    """The backend method: aggregation weights and metrics on ``(B, T)`` vectors around one op call.

    A batch-level config (the top-entropy quantile, ``cov_mode``: no token's coefficient is known before every
    token's entropy / log-prob is) takes two passes instead: :func:`linear_token_logprobs` (stats; its backward
    recomputes the tiles) and :func:`fused_rl.loss_math.compute_policy_loss` on the ``(B, T)`` vectors."""
    batch, length, _ = hidden.shape
    want_ent = compute_entropy or config.needs_entropy
    if config.is_batch_level:
        return two_pass_policy_loss(
            lambda *args: linear_token_logprobs(*args, memory_budget_bytes=memory_budget_bytes),
            hidden, weight, bias, inputs, config, want_ent)
    cdtype = _compute_dtype(hidden.dtype)
    weights = aggregation_weights(inputs.mask, config, inputs.token_normalizer, dtype=cdtype)
    n_tile = chunk_tokens(batch * length, weight.shape[0], hidden.dtype, memory_budget_bytes, hidden.device)
    loss, logp, entropy, _, _, _ = linear_policy_loss_op(
        hidden, weight, bias, inputs.targets, inputs.advantages, inputs.mask, weights, inputs.old, inputs.ref,
        inputs.rollout, inputs.is_weights, *config_args(config), bool(want_ent), _needs_grad(hidden),
        _needs_grad(weight), _needs_grad(bias), n_tile)
    entropy = entropy if want_ent else None
    terms = per_token_loss(logp, inputs.advantages, inputs.mask, config, old_logprobs=inputs.old,
                           ref_logprobs=inputs.ref, entropy=entropy, rollout_logprobs=inputs.rollout)
    return PolicyLossOutput(loss=loss, logprobs=logp, entropy=entropy,
                            metrics=metrics(terms.ratio, inputs.advantages, inputs.mask, config, terms.kl, entropy,
                                            terms.extras))


def two_pass_policy_loss(token_logprobs, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         inputs: PolicyInputs, config: PolicyLossConfig, want_ent: bool) -> PolicyLossOutput:
    """The loss in two passes: ``token_logprobs(hidden, weight, bias, targets, temperature, want_ent)`` (a
    fused-linear ``linear_token_logprobs``: statistics, its backward recomputing the tiles) and
    :func:`fused_rl.loss_math.compute_policy_loss` with autograd on the ``(B, T)`` vectors: any config."""
    targets = torch.where(inputs.mask, inputs.targets, torch.full_like(inputs.targets, IGNORE_INDEX))
    logp, entropy = token_logprobs(hidden, weight, bias, targets, config.temperature, want_ent)
    loss, mets = compute_policy_loss(logp, inputs.advantages, inputs.mask, config, old_logprobs=inputs.old,
                                     ref_logprobs=inputs.ref, entropy=entropy, rollout_logprobs=inputs.rollout,
                                     rollout_is_weights=inputs.is_weights, token_normalizer=inputs.token_normalizer)
    return PolicyLossOutput(loss=loss, logprobs=logp.detach(), entropy=None if entropy is None else entropy.detach(),
                            metrics=mets)


# --------------------------------------------------------------------------- linear token logprobs
def _token_groups(valid: torch.Tensor, n_tile: int) -> Iterator[_Tile]:
    for group in _groups(valid, n_tile, rowwise=False):
        yield group[0]


@autocast_free_op("fused_rl::torch_linear_token_stats")
def linear_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       targets: torch.Tensor, temperature: torch.Tensor, with_entropy: bool,
                       n_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy or empty)`` of shape ``targets.shape`` for ``softmax((h W^T + b) / tau)``;
    ``IGNORE_INDEX`` targets give 0; ``temperature``: ``tau`` as a ``custom_ops.host_floats``."""
    batch, length, _ = hidden.shape
    cdtype, hidden_flat, weight_c, bias_c = _prepare(hidden, weight, bias)
    valid = targets != IGNORE_INDEX
    targets_flat, valid_flat = targets.reshape(-1), valid.reshape(-1)
    logp = torch.zeros(batch * length, dtype=cdtype, device=hidden.device)
    entropy = torch.zeros(batch * length if with_entropy else 0, dtype=cdtype, device=hidden.device)
    ws = _Workspace(min(n_tile, batch * length), weight.shape[0], cdtype, hidden.device)
    for tile in _token_groups(valid, n_tile):
        h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, cdtype)
        _, lp, ent = _tile_stats(h, t, weight_c, bias_c, 1.0 / float(temperature), with_entropy, ws)
        if ok is not None:
            lp = torch.where(ok, lp, torch.zeros_like(lp))
            ent = None if ent is None else torch.where(ok, ent, torch.zeros_like(ent))
        logp[tile.idx] = lp
        if with_entropy:
            entropy[tile.idx] = ent
    return logp.view(batch, length), entropy.view(batch, length) if with_entropy else entropy


@linear_token_stats.register_fake
def _(hidden, weight, bias, targets, temperature, with_entropy, n_tile):
    cdtype = _compute_dtype(hidden.dtype)
    return (hidden.new_empty(targets.shape, dtype=cdtype),
            hidden.new_empty(targets.shape if with_entropy else (0,), dtype=cdtype))


@autocast_free_op("fused_rl::torch_linear_token_grad")
def linear_token_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      targets: torch.Tensor, g_logp: torch.Tensor, g_entropy: Optional[torch.Tensor],
                      temperature: torch.Tensor, need_h: bool, need_w: bool, need_b: bool,
                      n_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute each tile and apply ``dz = (g_logp (onehot - p) + g_H p (E_p[zs] - zs)) / tau``; returns
    ``(grad_hidden, grad_weight, grad_bias)``, empty where not needed."""
    cdtype, hidden_flat, weight_c, bias_c = _prepare(hidden, weight, bias)
    inv_tau = 1.0 / float(temperature)
    valid = targets != IGNORE_INDEX
    targets_flat, valid_flat = targets.reshape(-1), valid.reshape(-1)
    gl_flat = g_logp.reshape(-1).to(cdtype)
    ge_flat = None if g_entropy is None else g_entropy.reshape(-1).to(cdtype)
    grads = _Grads(hidden, weight, need_h, need_w, need_b, cdtype)
    ws = _Workspace(min(n_tile, targets.numel()), weight.shape[0], cdtype, hidden.device)
    for tile in _token_groups(valid, n_tile):
        h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, cdtype)
        tile_state = _tile_stats(h, t, weight_c, bias_c, inv_tau, ge_flat is not None, ws)[0]
        gl = gl_flat[tile.idx]
        ge = None if ge_flat is None else ge_flat[tile.idx]
        if ok is not None:
            gl = torch.where(ok, gl, torch.zeros_like(gl))
            ge = None if ge is None else torch.where(ok, ge, torch.zeros_like(ge))
        grads.add(tile, _tile_dlogits(tile_state, t, gl, ge, inv_tau), h, weight_c, ok)
    return grads.results(hidden, weight)


@linear_token_grad.register_fake
def _(hidden, weight, bias, targets, g_logp, g_entropy, temperature, need_h, need_w, need_b, n_tile):
    return fake_grads(hidden, weight, need_h, need_w, need_b)


def no_double_backward(ctx, *grads):
    raise RuntimeError("fused_rl: the gradient of linear_token_logprobs (and of the fused-linear losses that "
                       "recompute it) has no backward of its own (a second-order gradient through "
                       "create_graph=True); use backend='reference' for higher-order gradients")


linear_token_grad.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _stats_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, with_entropy, n_tile = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, temperature)
    ctx.args = (with_entropy, n_tile)
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # an unused entropy output: g_entropy None, no entropy term recomputed


def _stats_backward(ctx, g_logp, g_entropy):
    hidden, weight, bias, targets, temperature = ctx.saved_tensors
    with_entropy, n_tile = ctx.args
    if g_logp is None and g_entropy is None:
        return (None,) * 7
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    if g_logp is None:
        g_logp = torch.zeros(targets.shape, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
    gh, gw, gb = linear_token_grad(hidden, weight, bias, targets, g_logp, g_entropy if with_entropy else None,
                                   temperature, need_h, need_w, need_b, n_tile)
    return (gh.to(hidden.dtype) if need_h else None, gw.to(weight.dtype) if need_w else None,
            gb.to(weight.dtype) if need_b else None, None, None, None, None)


linear_token_stats.register_autograd(_stats_backward, setup_context=_stats_setup_context)


def linear_token_logprobs(hidden, weight, bias, targets, temperature: float, return_entropy: bool,
                          memory_budget_bytes: Optional[int] = None):
    n_tile = chunk_tokens(targets.numel(), weight.shape[0], hidden.dtype, memory_budget_bytes, hidden.device)
    logp, entropy = linear_token_stats(hidden, weight, bias, targets, host_floats((temperature,)), bool(return_entropy),
                                       n_tile)
    return logp, (entropy if return_entropy else None)
