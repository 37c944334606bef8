"""Triton kernels over vocabulary logits ``(B, T, V)`` (any ``stride(0)``, ``stride(1)``; unit stride along V).

One program per row ``n = b * T + t`` on grid axis 0 (up to 2^31 - 1 rows, no 65,535 limit); all
pointer offsets are int64. Per row, with ``z = x / tau`` accumulated in fp32 whatever the input dtype:

* **stats** (one read of the row): online ``m = max z``, ``s = sum exp(z - m)`` and
  ``q = sum exp(z - m) (z - m)`` over blocks of ``BLOCK_V`` (``m`` starts at ``-inf``, masked lanes
  load ``-inf``), giving ``lse = m + log s``, ``logp = z_target - lse`` and
  ``H = -sum p log p = log s - q / s``;
* **grad** (one read + one write): ``dlogits_j = (g_logp (onehot_j - p_j) + g_H p_j (E[z] - z_j)) / tau``
  with ``p_j = exp(z_j - lse)`` and ``E[z] = lse - H``, from the saved per-row ``lse`` (and ``H``);
* **fused policy loss** (stats loop, then the epilogue of :mod:`fused_rl.kernels.epilogue` on the
  row's scalars, then the grad loop with ``g_logp = w dl/dlogp``, ``g_H = w dl/dH``): writes the
  per-token ``logp, H, w l, r, kl`` and ``dlogits`` (optionally over the logits themselves).

Rows whose target is ``IGNORE_INDEX`` (the callers also set it at masked positions) read nothing and
get ``logp = H = 0`` and zero ``dlogits``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .epilogue import token_epilogue

IGNORE_INDEX = -100

#: Upper bound of BLOCK_V (None: the heuristic of :func:`block_config`). Tests set a small value.
MAX_BLOCK_V: Optional[int] = None


def block_config(vocab: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)``: blocks of up to 8192 elements for 2-byte logits and 4096 for fp32
    (16 KiB per block load, 16-32 elements per thread), i.e. 19 / 38 blocks per row at V = 151936;
    4 warps up to 1024 elements, 8 up to 4096, 16 above."""
    cap = MAX_BLOCK_V if MAX_BLOCK_V is not None else (8192 if dtype.itemsize <= 2 else 4096)
    block = min(triton.next_power_of_2(vocab), triton.next_power_of_2(cap))
    block = max(block, 16)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    return block, warps


@triton.jit
def _row_offset(row, T, s0, s1):
    b = row // T
    t = row - b * T
    return b * s0 + t * s1


@triton.jit
def _row_stats(x_row, tgt, valid, V, temperature, BLOCK_V: tl.constexpr, WITH_ENT: tl.constexpr):
    """``(lse, logp, H)`` of one row (garbage where not ``valid``; the caller masks)."""
    m = float("-inf")
    s = 0.0
    q = 0.0
    v_lim = tl.where(valid, V, 0)  # an ignored row loads nothing
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < v_lim, other=float("-inf")).to(tl.float32)
        z = x / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(z - m_safe)
        if WITH_ENT:
            zc = tl.where(e > 0.0, z - m_safe, 0.0)
            shift = tl.where(s > 0.0, m - m_safe, 0.0)
            q = alpha * (q + shift * s) + tl.sum(e * zc, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    s = tl.where(s > 0.0, s, 1.0)  # ignored rows (nothing loaded): finite garbage, masked by the caller
    log_s = tl.log(s)
    lse = m_fin + log_s
    zt = tl.load(x_row + tl.where(valid, tgt, 0)).to(tl.float32) / temperature  # in-row address even if ignored
    logp = zt - lse
    ent = 0.0
    if WITH_ENT:
        ent = log_s - q / s
    return lse, logp, ent


@triton.jit
def _row_grad(x_row, out_row, tgt, valid, V, temperature, lse, ez, g_logp, g_h,
              BLOCK_V: tl.constexpr, GRAD_ENT: tl.constexpr):
    """Writes ``(g_logp (onehot - p) + g_h p (ez - z)) / tau`` over the row (zeros if not ``valid``)."""
    v_lim = tl.where(valid, V, 0)  # an ignored row loads nothing (and stores zeros)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inb = cols < V
        x = tl.load(x_row + cols, mask=cols < v_lim, other=float("-inf")).to(tl.float32)
        z = x / temperature
        p = tl.exp(z - lse)
        g = tl.where(cols == tgt, g_logp, 0.0) - g_logp * p
        if GRAD_ENT:
            g += g_h * tl.where(p > 0.0, p * (ez - z), 0.0)
        g = tl.where(valid, g / temperature, 0.0)
        tl.store(out_row + cols, g.to(out_row.dtype.element_ty), mask=inb)


@triton.jit
def _stats_kernel(x_ptr, xs0, xs1, T, V, tgt_ptr, logp_ptr, ent_ptr, lse_ptr, temperature,
                  BLOCK_V: tl.constexpr, WITH_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(tgt_ptr + row).to(tl.int32)
    valid = tgt != IGNORE_INDEX
    x_row = x_ptr + _row_offset(row, T, xs0, xs1)
    lse, logp, ent = _row_stats(x_row, tgt, valid, V, temperature, BLOCK_V, WITH_ENT)
    tl.store(logp_ptr + row, tl.where(valid, logp, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    if WITH_ENT:
        tl.store(ent_ptr + row, tl.where(valid, ent, 0.0))


@triton.jit
def _grad_kernel(x_ptr, xs0, xs1, T, V, tgt_ptr, out_ptr, os0, os1, lse_ptr, glogp_ptr, ent_ptr, gent_ptr,
                 temperature, BLOCK_V: tl.constexpr, GRAD_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(tgt_ptr + row).to(tl.int32)
    valid = tgt != IGNORE_INDEX
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(glogp_ptr + row).to(tl.float32)
    ez = 0.0
    g_h = 0.0
    if GRAD_ENT:
        ez = lse - tl.load(ent_ptr + row)
        g_h = tl.load(gent_ptr + row).to(tl.float32)
    _row_grad(x_ptr + _row_offset(row, T, xs0, xs1), out_ptr + _row_offset(row, T, os0, os1), tgt, valid, V,
              temperature, lse, ez, g_logp, g_h, BLOCK_V, GRAD_ENT)


@triton.jit
def _policy_kernel(x_ptr, xs0, xs1, T, V, tgt_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, out_ptr, os0, os1,
                   logp_ptr, ent_ptr, loss_ptr, ratio_ptr, kl_ptr,
                   temperature, clip_low, clip_high, dual_clip, beta, entropy_coef,
                   POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, KL: tl.constexpr, ADD_KL: tl.constexpr,
                   ADD_ENT: tl.constexpr, ON_POLICY: tl.constexpr, WITH_ENT: tl.constexpr,
                   WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(tgt_ptr + row).to(tl.int32)
    valid = tgt != IGNORE_INDEX
    x_row = x_ptr + _row_offset(row, T, xs0, xs1)
    lse, logp, ent = _row_stats(x_row, tgt, valid, V, temperature, BLOCK_V, WITH_ENT)
    logp = tl.where(valid, logp, 0.0)
    if WITH_ENT:
        ent = tl.where(valid, ent, 0.0)
    adv = tl.load(adv_ptr + row)
    w = tl.load(w_ptr + row)
    old = 0.0
    ref = 0.0
    if not ON_POLICY:
        old = tl.load(old_ptr + row)
    if KL != 0:
        ref = tl.load(ref_ptr + row)
    loss, dlogp, dh, ratio, kl = token_epilogue(logp, ent, old, ref, adv, valid, clip_low, clip_high, dual_clip,
                                                beta, entropy_coef, POLICY, HAS_DUAL, KL, ADD_KL, ADD_ENT,
                                                ON_POLICY)
    tl.store(logp_ptr + row, logp)
    if WITH_ENT:
        tl.store(ent_ptr + row, ent)
    tl.store(loss_ptr + row, w * loss)
    tl.store(ratio_ptr + row, ratio)
    if KL != 0:
        tl.store(kl_ptr + row, kl)
    if WRITE_GRAD:
        _row_grad(x_row, out_ptr + _row_offset(row, T, os0, os1), tgt, valid, V, temperature, lse, lse - ent,
                  w * dlogp, w * dh, BLOCK_V, ADD_ENT)


@triton.jit
def _scale_kernel(x_ptr, s0, s1, T, V, g_ptr, BLOCK_V: tl.constexpr):
    """Row ``n`` of ``x`` (``(B, T, V)``, any row strides) ``*= g`` in place, ``g`` a 0-dim tensor read
    on the device: no host sync, and no memory traffic at all when ``g == 1``."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + _row_offset(row, T, s0, s1)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            m = cols < V
            x = tl.load(x_row + cols, mask=m).to(tl.float32)
            tl.store(x_row + cols, (x * g).to(x_row.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- launchers
def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """A ``(B, T, V)`` view of ``(..., V)`` logits (a copy only if the leading dims cannot be viewed so)."""
    if logits.dim() == 3:
        return logits
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    try:
        return logits.view(-1, logits.shape[-2], logits.shape[-1])
    except RuntimeError:
        return logits.reshape(-1, logits.shape[-2], logits.shape[-1])


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """Flat fp32 ``(logp, entropy, lse)`` (``entropy`` empty unless ``with_entropy``)."""
    x = as_rows(logits)
    B, T, V = x.shape
    n = B * T
    tgt = targets.reshape(-1)
    logp = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=x.device)
    block, warps = block_config(V, x.dtype)
    _stats_kernel[(n,)](x, x.stride(0), x.stride(1), T, V, tgt, logp, ent if with_entropy else logp, lse,
                        float(temperature), BLOCK_V=block, WITH_ENT=bool(with_entropy), num_warps=warps)
    return logp, ent, lse


def token_grad(logits, targets, lse, g_logp, entropy, g_entropy, temperature, out=None):
    """dlogits ``(B, T, V)`` in the logits dtype (contiguous unless ``out`` is given)."""
    x = as_rows(logits)
    B, T, V = x.shape
    o = torch.empty((B, T, V), dtype=x.dtype, device=x.device) if out is None else as_rows(out)
    grad_ent = entropy is not None and g_entropy is not None
    block, warps = block_config(V, x.dtype)
    g_logp = g_logp.reshape(-1).contiguous()
    ent = entropy.reshape(-1).contiguous() if grad_ent else lse
    g_ent = g_entropy.reshape(-1).contiguous() if grad_ent else g_logp
    _grad_kernel[(B * T,)](x, x.stride(0), x.stride(1), T, V, targets.reshape(-1), o, o.stride(0), o.stride(1),
                           lse, g_logp, ent, g_ent, float(temperature), BLOCK_V=block, GRAD_ENT=grad_ent,
                           num_warps=warps)
    return o.view(logits.shape) if out is None else out


def policy_fused(logits, targets, advantages, weights, old, ref, out, temperature, epilogue: dict,
                 with_entropy: bool, write_grad: bool):
    """Single pass of the token-level policy loss. ``targets`` flat with masked positions already
    ``IGNORE_INDEX``; ``advantages``, ``weights``, ``old``, ``ref`` flat fp32 (``old=None``: on-policy).
    Writes dlogits into ``out`` (``(B, T, V)``, any row strides; may be ``logits`` itself) when
    ``write_grad``. Returns flat fp32 ``(logp, entropy, w * l, ratio, kl)``."""
    x = as_rows(logits)
    B, T, V = x.shape
    n = B * T
    dev = x.device
    new = lambda k: torch.empty(k, dtype=torch.float32, device=dev)
    logp, loss, ratio = new(n), new(n), new(n)
    ent = new(n if with_entropy else 0)
    kl = new(n if epilogue["KL"] != 0 else 0)
    o = as_rows(out) if write_grad else x
    block, warps = block_config(V, x.dtype)
    _policy_kernel[(n,)](
        x, x.stride(0), x.stride(1), T, V, targets, advantages, weights,
        advantages if old is None else old, advantages if ref is None else ref,
        o, o.stride(0), o.stride(1), logp, ent if with_entropy else logp, loss, ratio,
        kl if epilogue["KL"] != 0 else logp, float(temperature),
        WITH_ENT=bool(with_entropy), WRITE_GRAD=bool(write_grad), BLOCK_V=block, num_warps=warps, **epilogue)
    return logp, ent, loss, ratio, kl


def scale_(x: torch.Tensor, g: torch.Tensor) -> None:
    """In-place ``x *= g`` for ``(..., V)`` ``x`` with any row strides; ``g`` a one-element tensor."""
    r = as_rows(x)
    B, T, V = r.shape
    block, warps = block_config(V, r.dtype)
    _scale_kernel[(B * T,)](r, r.stride(0), r.stride(1), T, V, g.reshape(()).to(torch.float32), BLOCK_V=block,
                            num_warps=warps)
