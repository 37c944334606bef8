"""Advantage estimators. Rewards of one prompt's ``G`` samples are consecutive: ``rewards[g*G:(g+1)*G]``.

* :func:`grpo`  ``A_i = (R_i - mean(R)) / (std(R) + eps)`` with the *population* std (``scale=False``:
  ``A_i = R_i - mean(R)``, Dr. GRPO's centring only). The centred estimator ``(1/G) sum_i A_i g_i``
  (``scale=False``, sequence scores ``g_i``) has expectation ``(1 - 1/G) grad J`` at an on-policy point: the
  group mean contains the sample's own reward. TRL's ``scale_rewards="group"`` divides by the Bessel-corrected
  std plus ``1e-4`` (about ``sqrt((G-1)/G)`` times these), as verl's ``compute_grpo_outcome_advantage`` (``+ 1e-6``)
  and OpenRLHF's ``group_norm`` (``+ 1e-9``) do; its ``"batch"`` (one std over the batch) is not offered. Computed
  in units of a power of two at the group's largest ``|R|`` (exact): fp64 rewards of any size give at most
  ``sqrt(G - 1)``.
* :func:`rloo`  ``A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean(R))`` (unbiased).
* :func:`kimi_length_reward` Kimi k1.5's length term
  ``lambda_i = 1/2 - (T_i - T_min)/(T_max - T_min)``: ``lambda_i`` if correct, ``min(0, lambda_i)`` if
  not, 0 for a group whose lengths are all equal.
* :func:`gae`   generalized advantage estimation over per-token rewards.
"""

from __future__ import annotations

import math
import numbers

import torch

from .validation import binary_mask


def _groups(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor (groups of consecutive samples), got shape "
                         f"{tuple(x.shape)}")
    if x.numel() % group_size:
        raise ValueError(f"{name} has {x.numel()} entries, not a multiple of group_size={group_size}")
    return x.reshape(-1, group_size)


def _float_groups(x: torch.Tensor, group_size: int, name: str) -> tuple[torch.Tensor, torch.dtype]:
    """``(the detached groups in float64, the output dtype: float64 for float64 input, else float32)``; float64
    is exact for every floating dtype and for integers up to ``2**53`` (float32 merged integers past ``2**24``)."""
    g = _groups(x, group_size, name).detach()
    if g.is_complex():
        raise ValueError(f"{name} must be real numbers, got {g.dtype}")
    out_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.double()
    if not torch.isfinite(g).all():
        raise ValueError(f"{name} contain NaN or inf")
    return g, out_dtype


def _advantages_out(a: torch.Tensor, dtype: torch.dtype, name: str,
                    why: str = "the rewards' spread within a group is too large") -> torch.Tensor:
    """``a`` flattened in ``dtype``; finite rewards whose advantages do not fit ``dtype`` raise."""
    out = a.to(dtype).reshape(-1)
    if not torch.isfinite(out).all():
        raise ValueError(f"{name} advantages overflow {dtype}: {why}")
    return out


def grpo(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages ``(R_i - mean) / (std_pop + eps)`` per group (``scale=False``: ``R_i - mean``);
    needs ``group_size >= 2``.

    ``[1, 0, 0, 0] -> [sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)]``; equal rewards -> zeros.
    """
    if not 0 < eps < math.inf:  # the stabilizer: equal rewards get 0 / eps = 0, not 0 / 0 (inf: all zeros)
        raise ValueError(f"eps must be > 0 and finite, got {eps!r}")
    if not isinstance(scale, bool):  # TRL's scale_rewards="none" is truthy: it would divide by the std
        raise ValueError(f"scale must be a bool (True: divide by the group std, False: Dr. GRPO's centring), "
                         f"got {scale!r}")
    r, out_dtype = _float_groups(rewards, group_size, "rewards")
    if group_size < 2:  # a one-sample group is its own baseline: every advantage would be 0, silently
        raise ValueError(f"grpo needs group_size >= 2 (samples of one prompt), got {group_size!r}")
    eps_t = torch.full_like(r[:, :1], eps)
    if scale:
        # in units of s, the power of two at or below the group's largest |R| (|R| / s < 2): (R - mean) / (std + eps)
        # = (y - mean_y) / (std_y + eps / s) for y = R / s, exact (integer rewards equal to their group's mean stay
        # exactly 0), and no square or difference overflows (fp64 rewards spread past 1e154 gave zeros)
        exponent = torch.frexp(r.abs().amax(dim=1, keepdim=True)).exponent - 1
        size = torch.ldexp(torch.ones_like(r[:, :1]), exponent)
        r, eps_t = r / size, eps_t / size
    # In fp64, about the group's first reward: a group of equal rewards is then exactly 0 before the
    # division (in fp32 the mean of eight 1/3 is 1 ulp off, std ~1e-8, and / (std + eps) made that 0.03).
    x = r - r[:, :1]
    centred = x - x.mean(dim=1, keepdim=True)
    if scale:
        denom = x.std(dim=1, unbiased=False, keepdim=True) + eps_t
        centred = centred / torch.where(denom > 0, denom, torch.ones_like(denom))  # 0: eps / s underflowed, x = 0
    return _advantages_out(centred, out_dtype, "grpo")


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages ``R_i - sum_{j != i} R_j / (G - 1)``; needs ``G >= 2``. In fp64 about the
    group's first reward, as :func:`grpo`: equal rewards give exactly 0 and no group sum overflows."""
    r, out_dtype = _float_groups(rewards, group_size, "rewards")
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size!r}")
    x = r - r[:, :1]
    baseline = (x.sum(dim=1, keepdim=True) - x) / (group_size - 1)
    return _advantages_out(x - baseline, out_dtype, "rloo")


def kimi_length_reward(lengths: torch.Tensor, correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Kimi k1.5 (Sec. 2.3.3) length reward, unweighted: for lengths 100 / 300 / 500 in a group spanning
    100..500 it is +0.5 / 0 / -0.5 when correct and 0 / 0 / -0.5 when not.

    ``lengths`` are token counts (>= 0) of any integer or floating dtype; float32 (float64 for float64
    lengths) out. ``T_i - T_min`` and ``T_max - T_min`` are taken exactly (integers as int64, floats in
    float64), then divided in float64: no span overflows (``0 <= T_max - T_min <= T_max``) and integer
    lengths past float32's last exact integer (``2**24``) keep their differences.
    """
    t = _groups(lengths, group_size, "lengths")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"lengths must be token counts (an integer or floating dtype), got {t.dtype}")
    if t.is_floating_point():
        t = t.double()  # exact for every floating dtype
        if not torch.isfinite(t).all():
            raise ValueError("lengths contain NaN or inf")
    else:
        t = t.long()
    if (t < 0).any():
        raise ValueError(f"lengths must be >= 0 (token counts), got {t.min().item()}")
    c = _groups(correct, group_size, "correct")
    if c.shape != t.shape:
        raise ValueError("correct must have the shape of lengths")
    if c.dtype != torch.bool:
        if not ((c == 0) | (c == 1)).all():
            raise ValueError("correct must be boolean or 0/1")
        c = c != 0
    t_min = t.min(dim=1, keepdim=True).values
    span = t.max(dim=1, keepdim=True).values - t_min
    ratio = (t - t_min).double() / torch.where(span > 0, span, torch.ones_like(span)).double()  # in [0, 1]
    lam = 0.5 - ratio
    reward = torch.where(c.to(t.device), lam, lam.clamp(max=0.0))
    reward = torch.where(span > 0, reward, torch.zeros_like(reward)).reshape(-1)
    return reward.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over ``(B, T)`` per-token rewards and values with ``mask`` marking response tokens.

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last response token is 0) and
    ``A_t = delta_t + gamma lam A_{t+1}``; masked positions are skipped (they neither receive nor pass on
    advantage), so left and right padding both work. With ``gamma = lam = 1``,
    ``A_t = sum_{k >= t} r_k - V_t``. Returns ``(advantages, returns = advantages + values)``, zero
    where masked, float32 (float64 for float64 rewards); the scan runs in float64 and rounds once (a float32 scan
    drifted ~200 ulp by T = 32k at ``gamma = lam = 1``).
    """
    for x, name in ((rewards, "rewards"), (values, "values"), (mask, "mask")):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a (B, T) tensor")
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma!r}, {lam!r}")
    m = binary_mask(mask, "mask")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = torch.where(m, rewards.detach().double(), 0.0)
    v = torch.where(m, values.detach().double(), 0.0)
    if not (torch.isfinite(r).all() and torch.isfinite(v).all()):
        raise ValueError("rewards and values must be finite where mask is set")
    # Masked positions neither receive nor pass on advantage: move each row's kept tokens to its front, in order
    # (a stable sort of the mask), run plain GAE there (past the last kept token, V and delta are 0), move back.
    order = torch.argsort((~m).to(torch.uint8), dim=1, stable=True)
    r_kept, v_kept = r.gather(1, order), v.gather(1, order)
    v_next = torch.cat([v_kept[:, 1:], v_kept.new_zeros(v_kept.shape[0], 1)], dim=1)
    adv_kept = discounted_suffix_sums(r_kept + gamma * v_next - v_kept, gamma * lam)
    adv = torch.where(m, torch.zeros_like(r).scatter(1, order, adv_kept), 0.0)
    returns = torch.where(m, adv + v, 0.0)
    return tuple(_advantages_out(x, dtype, "gae", "the rewards or values are too large").reshape(x.shape)
                 for x in (adv, returns))


def discounted_suffix_sums(x: torch.Tensor, c: float, block: int = 256) -> torch.Tensor:
    """``y_t = sum_{k >= t} c^(k - t) x_k`` along dim 1 (so ``y_t = x_t + c y_{t+1}``), in ``x``'s dtype.

    By blocks of ``block`` positions: inside a block, one product with the ``(block, block)`` matrix of
    ``c^(k - t)`` (``k >= t``); between blocks, ``y`` at a block's positions gains ``c^(block - t)`` times ``y`` at the
    next block's first position, a loop over ``T / block`` blocks instead of ``T`` positions (GAE at T = 32k: 1 s
    as a per-position loop)."""
    rows, length = x.shape
    c = float(c)
    if length == 0:
        return x.clone()
    block = min(block, length)
    blocks = -(-length // block)
    xb = torch.nn.functional.pad(x, (0, blocks * block - length)).reshape(rows, blocks, block)
    t = torch.arange(block, dtype=x.dtype, device=x.device)
    lag = t[None, :] - t[:, None]  # [t, k] = k - t
    powers = torch.where(lag >= 0, torch.tensor(c, dtype=x.dtype, device=x.device) ** lag.clamp(min=0), 0.0)
    inside = xb @ powers.T  # [.., t] = sum_k powers[t, k] x_k
    carry_weight = torch.tensor(c, dtype=x.dtype, device=x.device) ** (block - t)
    out = torch.empty_like(inside)
    carry = x.new_zeros(rows)
    for b in range(blocks - 1, -1, -1):
        out[:, b] = inside[:, b] + carry_weight * carry[:, None]
        carry = out[:, b, 0]
    return out.reshape(rows, blocks * block)[:, :length]
