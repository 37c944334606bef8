"""The O(N) policy-loss math: the only definition of every loss variant.

Everything here works on per-token ``(B, T)`` vectors (log-probs, entropies, advantages, mask),
never on the vocabulary. Every backend computes ``logp`` / ``entropy`` its own way (full
``log_softmax``, chunked torch, Triton, C++) and then either calls :func:`compute_policy_loss`
directly or, for fused single-pass kernels, must agree with it (the tests check that).

Conventions (``m`` the boolean mask, ``r = exp(logp - old)``, ``d = ref - logp``):

* masked positions never reach the loss or metrics: values there (padding, NaN, inf) are replaced
  by neutral ones with ``torch.where`` before any arithmetic, so ``0 * nan`` cannot poison a sum;
* on-policy (``old=None``) means ``old = sg(logp)``: ``r == 1`` but ``d r / d logp == 1``;
* the loss is ``sum_t w_t * l_t`` with the aggregation weights of :func:`aggregation_weights`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, NamedTuple, Optional, Union

import torch

from .config import DPPO, PolicyLossConfig

Normalizer = Union[None, int, float, torch.Tensor]


def aggregation_weights(mask: torch.Tensor, config: PolicyLossConfig,
                        token_normalizer: Normalizer = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights ``w`` (B, T) of ``dtype`` with ``loss = sum(w * l)``.

    * token-mean:              ``w = m / N``, ``N = token_normalizer`` or ``max(sum(m), 1)``
    * seq-mean-token-mean:     ``w = m / (B * max(sum_t m, 1))``
    * seq-mean-token-sum:      ``w = m / B``
    * seq-mean-token-sum-norm: ``w = m / (B * max_len)``, ``max_len`` defaulting to ``T``
    """
    m = mask.to(dtype)
    batch, length = m.shape
    if config.agg == "token-mean":
        if token_normalizer is None:
            denom = m.sum().clamp(min=1.0)
        elif isinstance(token_normalizer, torch.Tensor):
            denom = token_normalizer.to(device=m.device, dtype=dtype)
        else:
            denom = float(token_normalizer)
        return m / denom
    if token_normalizer is not None:
        raise ValueError(f"token_normalizer only applies to agg='token-mean', not {config.agg!r}")
    if config.agg == "seq-mean-token-mean":
        return m / (m.sum(dim=1, keepdim=True).clamp(min=1.0) * batch)
    if config.agg == "seq-mean-token-sum":
        return m / batch
    max_len = config.max_len if config.max_len is not None else length
    return m / float(batch * max_len)


def kl_estimator(logp: torch.Tensor, ref: torch.Tensor, kind: str, clamp: Optional[float] = None,
                 weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) with ``d = ref - logp``.

    k1 ``-d``; k2 ``d^2 / 2``; k3 ``exp(d) - d - 1`` (``+inf`` at ``d = +inf``, a ``-inf`` log-prob: not
    ``expm1(inf) - inf = NaN``); abs ``|d|``; low_var_kl ``clamp(k3, -10, 10)``;
    ``"X+"``: straight-through, the value of ``X`` with the gradient of ``k2`` (``k2 + sg(X - k2)``).
    ``clamp`` (``config.kl_clamp``): the value is ``clamp(kl, -clamp, clamp)``, a zero gradient where cut (also at an
    infinite ``d``: not ``0 * inf``), k2's for ``"X+"``. ``weight`` (``"X+"`` only; ``sg(min(r, config.kl_is_clip))``):
    k2's gradient times it.
    """
    if kind.endswith("+"):
        # X's value exactly (k2 + sg(X - k2) rounds X to k2's ulp: 10 came out 6 at d = -8000 in fp32), plus a 0 with
        # k2's derivatives; X's value also at an infinite d (a -inf log-prob), as the fused epilogues give
        slope = _k2_slope(ref - logp)
        if weight is not None:
            slope = weight.detach() * slope
        return kl_estimator(logp, ref, kind[:-1], clamp).detach() + slope
    if weight is not None:
        raise ValueError(f"a weight of the k2 gradient needs a straight-through ('X+') estimator, got {kind!r}")
    if clamp is not None:
        value = kl_estimator(logp, ref, kind).detach()
        bound = config_scalar(value, clamp)  # a graph input under torch.compile, not a constant per value
        cut = (value > bound) | (value < -bound)
        # the estimator again at d = 0 where cut: those tokens' zero slope is 0, not 0 * inf at an infinite d
        kept = kl_estimator(torch.where(cut, ref, logp), ref, kind)
        return torch.where(cut, value.clamp(min=-bound, max=bound), kept)
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        # d taken as 0 in the subtraction at d = +inf: the value inf, and no 0 * inf = NaN in where's backward
        return torch.expm1(d) - torch.where(torch.isposinf(d), torch.zeros_like(d), d)
    if kind == "abs":
        return d.abs()
    if kind == "low_var_kl":
        # d is clamped to [-20, 20] first (as verl does): it changes no value, since k3 > 10 there,
        # but keeps exp(d) finite so the zero gradient of the outer clamp is not 0 * inf = NaN.
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.expm1(d) - d).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def kl_gradient_weight(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                       config: PolicyLossConfig) -> Optional[torch.Tensor]:
    """``sg(min(r_t, config.kl_is_clip))`` with the token ratio ``r_t = exp(logp_t - old_t)`` whatever
    ``config.policy_loss`` (1 on-policy, ``old = sg(logp)``; 1 at masked positions), or ``None`` without
    ``config.kl_is_clip``: OpenRLHF's ``unbiased_gradient`` weight of the straight-through KL's k2 gradient."""
    if config.kl_is_clip is None:
        return None
    log_r = torch.where(mask, logp.detach() - old.detach(), torch.zeros_like(logp))
    return torch.exp(log_r).clamp(max=config_scalar(log_r, config.kl_is_clip))


def _k2_slope(d: torch.Tensor) -> torch.Tensor:
    """0 in value, with k2's derivatives in ``d`` (``d``, 1): ``u sg(d) + u^2 / 2``, ``u = d - sg(d)``; no overflow at
    any finite ``d`` (``d^2 / 2`` is inf beyond ``|d| ~ 2.6e19`` in fp32), 0 with zero derivatives at an infinite
    one (a ``-inf`` log-prob or reference log-prob: as the fused epilogues)."""
    d = torch.where(torch.isinf(d), torch.zeros_like(d), d)
    d_sg = d.detach()
    u = d - d_sg
    return u * d_sg + 0.5 * u * u


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t m x / max(sum_t m, 1)`` per row, shape ``(B, 1)`` (``x`` already 0 where masked)."""
    count = mask.sum(dim=1, keepdim=True).clamp(min=1).to(x.dtype)
    return x.sum(dim=1, keepdim=True) / count


def log_importance_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                         config: PolicyLossConfig) -> torch.Tensor:
    """``log r_t = logp_t - old_t``; for gspo and gmpo the log sequence ratio
    ``log s_i = sum_t m (logp - old) / max(sum_t m, 1)`` broadcast over the sequence (the geometric mean
    of the token ratios; gmpo clips its terms in :func:`policy_gradient_loss`); for gspo_token
    ``sg(log s_i) + logp_t - sg(logp_t)``. Masked positions have ``log r = 0``."""
    log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
    if config.policy_loss in ("gspo", "gmpo"):
        log_ratio = _sequence_mean(log_ratio, mask).expand_as(logp)
    elif config.policy_loss == "gspo_token":
        # a -inf log-prob (a sampled token the training logits mask) has s_it = 0 and no slope: 0, not -inf - -inf
        token = torch.where(mask & torch.isfinite(logp), logp - logp.detach(), torch.zeros_like(logp))
        log_ratio = _sequence_mean(log_ratio, mask).detach() + token
    return log_ratio


def ratio_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(log_ratio)``, a constant (no gradient) where it overflows to inf: a token whose ratio
    overflows (``log r > 88`` in fp32, e.g. an old log-prob of -9999 from an inference engine) but whose
    loss is clipped there has dl/dr = 0, so dl/dlogp = 0, as the fused epilogues compute it; autograd of
    ``exp`` would make it ``0 * inf = NaN`` and with it every weight's gradient (where the loss does
    depend on r it is inf anyway). Plain torch ops: double backward, forward AD, ``vmap`` and
    ``torch.compile`` work as for ``exp``; a NaN log-ratio stays NaN with a NaN gradient."""
    value = torch.exp(log_ratio.detach())
    overflow = torch.isinf(value)
    return torch.where(overflow, value, torch.exp(torch.where(overflow, torch.zeros_like(log_ratio), log_ratio)))


def importance_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                     config: PolicyLossConfig) -> torch.Tensor:
    """``r_t = exp(log r_t)`` with ``log r_t`` from :func:`log_importance_ratio` (a constant where it
    overflows to inf: :func:`ratio_exp`)."""
    return ratio_exp(log_importance_ratio(logp, old, mask, config))


def _ratio_kind(config: PolicyLossConfig) -> str:
    """How the importance ratio ``r`` of ``config.policy_loss`` depends on the log-probs: ``"sequence"`` (gspo,
    gmpo: ``s = exp(mean_t m (logp - old))`` on every token of the row), ``"gspo_token"`` (``s``'s value, ``d r_t /
    d logp_t = r_t``, ``old`` only under the stop-gradient) or ``"token"`` (``r_t = exp(logp_t - old_t)``)."""
    if config.policy_loss in ("gspo", "gmpo"):
        return "sequence"
    return "gspo_token" if config.policy_loss == "gspo_token" else "token"


#: Beyond this gap ``d = ref - logp`` the bias-corrected k3 takes ``r expm1(d)`` as ``exp(log r + d) - r`` (token
#: ratio: ``exp(ref - old) - r``): ``exp(d)`` overflows fp32 past 88 where ``r`` is small enough for the product to
#: be finite (an old log-prob far above the new one), or is infinite where ``r = 0`` (a ``-inf`` log-prob
#: off-policy); past 20 the form has no cancellation (``r <= 2.1e-9 exp(log r + d)``). The kernels' epilogues
#: switch at the same gap.
KL_BIAS_FAR = 20.0


def _times(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``r x``, but 0 where one factor is 0 and the other infinite, with no ``0 * inf`` in its derivatives either:
    ``r = 0`` (the ratio of a ``-inf`` log-prob) times a KL term that grows only polynomially in ``d`` (``d``,
    ``d^2``, ``|d|``: its limit; k3's exponential term takes :data:`KL_BIAS_FAR`'s form); an overflowed
    ``r = inf`` times an exactly 0 slope (low_var_kl outside its clamps); and a zero upstream gradient or tangent
    times an infinite part (a token that does not reach the output adds nothing)."""
    zero = ((r == 0) & torch.isinf(x)) | (torch.isinf(r) & (x == 0))
    return torch.where(zero, torch.zeros_like(r), r) * torch.where(zero, torch.zeros_like(x), x)


class _KLParts(NamedTuple):
    """The parts of ``r kl`` (:func:`_ratio_kl_parts`)."""

    value: torch.Tensor  # r kl
    through_r: torch.Tensor  # r kl as the derivative r carries (d r / d logp = r): 0 where r overflowed (a constant)
    r_slope: torch.Tensor  # r K', K' = d kl / d logp
    own: torch.Tensor  # d (r kl) / d logp for a token-level ratio: through_r + r K' (k3: -r d, without cancelling)
    rd: torch.Tensor  # r d
    r_em1: Optional[torch.Tensor]  # k3: r expm1(d)
    overflow: torch.Tensor  # r = inf


def _ratio_kl_parts(logp, ref, r, log_r, log_rd, kind: str) -> _KLParts:
    """The parts of ``r kl`` for :func:`bias_corrected_kl`, each the limit where ``r`` is 0 or infinite and meets a
    term that is infinite or 0 (:func:`_times`): ``log_r`` the log of ``r`` (with its derivatives), ``log_rd = log r
    + d``, ``kl`` the estimator ``kind`` of ``d = ref - logp``, ``K' = d kl / d logp`` (``"X+"``: ``-d``, k2's);
    k3's ``r kl = r expm1(d) - r d`` with ``r expm1(d)`` taken as ``exp(log_rd) - r`` past :data:`KL_BIAS_FAR` (``r
    exp(d)``, finite, where ``exp(d)`` alone overflows) for a finite ``r``. ``value`` carries the derivatives of the
    product (k3+ past the switch too: its value times ``r / sg(r)`` plus ``r`` times k2's slope)."""
    d = ref - logp
    zeros = torch.zeros_like(d)
    rd = _times(r, d)
    base = kind.rstrip("+")
    r_em1 = None
    if base == "k3":
        far = (d > KL_BIAS_FAR) & torch.isfinite(r)
        logp_near = torch.where(far, ref, logp)  # d = 0 in the unselected branch: no inf in its derivatives
        near = ref - logp_near
        r_em1 = torch.where(far, torch.exp(torch.where(far, log_rd, zeros)) - r, _times(r, torch.expm1(near)))
        far_value = r_em1 - rd
        if kind == "k3+":  # k3's value, the derivatives of r k2
            log_unit = torch.where(torch.isfinite(log_r), log_r - log_r.detach(), zeros)  # exp: r / sg(r)
            far_value = far_value.detach() * torch.exp(log_unit) + _times(r, _k2_slope(d))
        value = torch.where(far, far_value, _times(r, kl_estimator(logp_near, ref, kind)))
    else:
        value = _times(r, kl_estimator(logp, ref, kind))
    if kind.endswith("+") or base == "k2":
        r_slope = -rd
    elif base == "k3":
        r_slope = -r_em1
    elif base == "k1":
        r_slope = r
    elif base == "abs":
        r_slope = -_times(r, torch.sign(d))
    else:  # low_var_kl: -expm1(d) inside both of its clamps (as autograd of kl_estimator), else 0
        dc = d.clamp(min=-20.0, max=20.0)
        em1 = torch.expm1(dc)
        inside = (d >= -20.0) & (d <= 20.0) & (em1 - dc >= -10.0) & (em1 - dc <= 10.0)
        r_slope = -_times(r, torch.where(inside, em1, zeros))
    overflow = torch.isinf(r)
    through_r = torch.where(overflow, zeros, value)
    own = -rd if kind == "k3" else through_r + r_slope
    return _KLParts(value, through_r, r_slope, own, rd, r_em1, overflow)


def _ratio(logp, ref, old, mask, ratio_kind: str):
    """``(r, log r, log r + d)`` of a ratio kind (:func:`_ratio_kind`) on masked inputs, carrying their derivatives:
    token ``r = exp(logp - old)`` (``log r + d = ref - old``: finite at a ``-inf`` log-prob, whose ``r`` is 0);
    sequence ``s = exp(mean_t m (logp - old))`` on every token; gspo_token ``s``'s value with the token's own
    slope (0 at a ``-inf`` log-prob, as :func:`log_importance_ratio`)."""
    if ratio_kind == "token":
        log_r = logp - old
        return torch.exp(log_r), log_r, ref - old
    log_s = _sequence_mean(logp - old, mask).expand_as(logp)
    if ratio_kind == "gspo_token":
        log_s = log_s.detach() + torch.where(torch.isfinite(logp), logp - logp.detach(), torch.zeros_like(logp))
    return torch.exp(log_s), log_s, log_s + (ref - logp)


class _RatioTimesKL(torch.autograd.Function):
    """``r kl`` (see :func:`bias_corrected_kl`) on masked inputs (0 at masked positions), with a backward of its own:
    the exact gradients, formed from the incoming per-token gradient ``g`` with differentiable ops (so a double
    backward is exact too) and ``vmap`` by torch's generated rule; forward mode: :class:`_RatioTimesKLWithJvp`.
    A sequence ratio's parts are formed in fp64 (``log s + d`` of large terms; ``s exp(d)`` finite to ``d ~ 700``;
    the row means of the backward), gspo_token's rounded back to the input dtype."""

    generate_vmap_rule = True

    @staticmethod
    def _parts(logp, ref, old, mask, kind: str, ratio_kind: str) -> _KLParts:
        if ratio_kind == "token":
            return _ratio_kl_parts(logp, ref, *_ratio(logp, ref, old, mask, ratio_kind), kind)
        parts = _ratio_kl_parts(logp.double(), ref.double(), *_ratio(logp.double(), ref.double(), old.double(), mask,
                                                                    ratio_kind), kind)
        if ratio_kind == "gspo_token":
            parts = _KLParts(*(None if x is None or x.dtype == torch.bool else x.to(logp.dtype) for x in parts))
        return parts

    @staticmethod
    def forward(logp, ref, old, mask, kind: str, ratio_kind: str):
        value = _RatioTimesKL._parts(logp, ref, old, mask, kind, ratio_kind).value
        return torch.where(mask, value.to(logp.dtype), torch.zeros_like(logp))

    @staticmethod
    def setup_context(ctx, inputs, output):
        logp, ref, old, mask, kind, ratio_kind = inputs
        ctx.save_for_backward(logp, ref, old, mask)
        ctx.save_for_forward(logp, ref, old, mask)
        ctx.kind, ctx.ratio_kind = kind, ratio_kind

    @staticmethod
    def backward(ctx, g):
        logp, ref, old, mask = ctx.saved_tensors
        kind, ratio_kind = ctx.kind, ctx.ratio_kind
        zeros = torch.zeros_like(logp)
        g = torch.where(mask, g, zeros)  # the masked outputs are the constant 0
        p = _RatioTimesKL._parts(logp, ref, old, mask, kind, ratio_kind)
        if ratio_kind == "sequence":
            # d (sum_t g_t s kl_t) / d logp_u = g_u s K'_u + mean_t g_t s kl_t; k3 as (mean_t g_t s e_t - g_u s e_u) -
            # mean_t g_t s d_t, e = expm1(d) (terms of size s exp(d) and the spread of near-equal d cancel in fp32);
            # an overflowed s carries no derivative of its own
            g64 = g.double()
            through_s = _sequence_mean(_times(g64, p.through_r), mask)
            if kind == "k3":
                ge = _times(g64, p.r_em1)
                inner = torch.where(p.overflow, -ge,
                                    (_sequence_mean(ge, mask) - ge) - _sequence_mean(_times(g64, p.rd), mask))
            else:
                inner = through_s + _times(g64, p.r_slope)
            grad_logp = inner.to(logp.dtype)
            grad_old = (-through_s).expand_as(logp).to(logp.dtype)
        else:
            grad_logp = _times(g, p.own)
            grad_old = None if ratio_kind == "gspo_token" else -_times(g, p.through_r)  # gspo_token: old under sg
        grad_ref = (-_times(g.to(p.r_slope.dtype), p.r_slope)).to(logp.dtype)
        masked = lambda x: None if x is None else torch.where(mask, x, zeros)
        return masked(grad_logp), masked(grad_ref), masked(grad_old), None, None, None


class _RatioTimesKLWithJvp(_RatioTimesKL):
    """:class:`_RatioTimesKL` with forward mode, used outside ``torch.compile`` (Dynamo does not trace an autograd
    Function with a custom ``jvp``)."""

    @staticmethod
    def jvp(ctx, t_logp, t_ref, t_old, *_):
        """Forward mode, term by term: ``(r kl + r K') t_logp - r K' t_ref - r kl t_old`` for a token-level gradient
        (no ``t_old`` term for gspo_token: its ``old`` is under the stop-gradient); ``s K'_t (t_logp,t - t_ref,t) +
        s kl_t mean_u (t_logp,u - t_old,u)`` for the sequence ratio."""
        logp, ref, old, mask = ctx.saved_tensors
        zeros = torch.zeros_like(logp)
        tangent = lambda t: zeros if t is None else torch.where(mask, t, zeros)
        t_logp, t_ref, t_old = tangent(t_logp), tangent(t_ref), tangent(t_old)
        p = _RatioTimesKL._parts(logp, ref, old, mask, ctx.kind, ctx.ratio_kind)
        r_slope, through_r = p.r_slope.to(logp.dtype), p.through_r.to(logp.dtype)
        if ctx.ratio_kind == "sequence":
            out = _times(r_slope, t_logp - t_ref) + _times(through_r, _sequence_mean(t_logp - t_old, mask))
        else:
            out = _times(p.own, t_logp) - _times(r_slope, t_ref)
            if ctx.ratio_kind == "token":
                out = out - _times(through_r, t_old)
        return torch.where(mask, out, zeros)


def bias_corrected_kl(logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                      config: PolicyLossConfig) -> torch.Tensor:
    """``r_t kl_t`` (DeepSeek-V3.2's bias-corrected KL) for every ``config.kl``, ``r`` the ratio of
    :func:`importance_ratio`, with exact gradients: ``K'`` is the slope ``kl`` carries, ``d = ref - logp``: k1
    ``K' = 1``, k2 ``-d``, k3 ``-expm1(d)``, abs ``-sign(d)``, low_var_kl ``-expm1(d)`` inside its clamps (else 0),
    ``"X+"`` ``-d`` (k2's); ``g`` the per-token gradient of the output.

    * a ratio whose gradient is token-level (``d r_t / d logp_t = r_t``: every policy loss but gspo and gmpo;
      gspo_token's value is the sequence ratio): ``d (r kl) / d logp = r (kl + K')``: k3 ``-r d``; ``"X+"``
      ``r (X - d)``;
    * the sequence ratio ``s`` of gspo and gmpo (``d s / d logp_u = s / n``, ``n`` the row's valid tokens):
      ``d (sum_t g_t s kl_t) / d logp_u = s (g_u K'_u + mean_t g_t kl_t)``: k3 ``s ((mean_t g_t e_t - g_u e_u) -
      mean_t g_t d_t)`` with ``e = expm1(d)``; ``"X+"`` ``s (mean_t g_t X_t - g_u d_u)``; in fp64.

    Autograd of the product would add ``r kl`` and ``r K'`` as two terms that cancel: k3's ``r expm1(d)``
    (in fp32: -32 for the exact -20 at ``d = 20``; for gspo's one-token row, a logit gradient 1.78 for the
    exact 1.8 at ``d = 16``), ``"abs+"``'s ``r |d|`` against ``-r d`` (the exact 0 at ``d > 0`` came out
    ``ulp(r |d|)``: 3.2 relative error of a gradient at ``r = e^20``). So the product has a backward of its own
    (:class:`_RatioTimesKL`), written with differentiable ops: a double backward differentiates the exact slope
    (an earlier ``sg(slope) (logp - sg(logp))`` form had the right first derivative but no second one); the
    ``ref`` and ``old`` gradients (no such cancellation) are the product rule's. 0 where masked.

    Far off-policy, where ``r`` is small and ``d`` large, each term is its limit (:func:`_ratio_kl_parts`): at a
    ``-inf`` log-prob (``r = 0``, ``d = inf``) a token-level ``r kl`` is ``exp(ref - old)`` for k3 and k3+ and 0 for
    the others, its ``logp`` gradient 0 (k3+: ``r (k3 - d) -> exp(ref - old)``; the plain product was ``0 * inf =
    NaN``); past :data:`KL_BIAS_FAR` (before fp32's ``exp(d)`` overflows at 88), k3's ``r kl`` is
    ``exp(ref - old) - r (d + 1)``, finite (the product was ``inf``). An overflowed ``r``
    (an old log-prob far below the new one) is a constant in the backward and forward mode, as :func:`ratio_exp`
    makes it: ``r kl`` is ``+-inf`` (0 for a zero term), its ``logp`` gradient ``r K'`` (0 for a zero slope), its
    ``old`` gradient 0; second derivatives there are not defined (NaN). A sequence ratio
    (gspo, gmpo, gspo_token's value) at a ``-inf`` log-prob: 0 for the estimators other than k3, k3's ``s exp(d)``
    NaN (``exp(-inf + inf)``; its limit is ``+inf`` for a row of two tokens or more).
    """
    zeros = torch.zeros_like(logp)
    masked = lambda x: torch.where(mask, x, zeros)
    fn = _RatioTimesKL if torch.compiler.is_compiling() else _RatioTimesKLWithJvp
    return fn.apply(masked(logp), masked(ref), masked(old), mask, config.kl, _ratio_kind(config))


def weighted(coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``coef * x``, but 0 where ``coef == 0`` and ``x`` is infinite: a token with no weight (``A = 0``, a
    dropped token) adds nothing, also where its term overflowed (an overflowed ratio, a ``-inf`` log-prob),
    not ``0 * inf = NaN``; a NaN ``x`` (a diverged row) stays NaN. The kernels' epilogues apply the same rule."""
    return torch.where((coef == 0) & torch.isinf(x), torch.zeros_like(x), coef * x)


#: VESPO's bounds of ``log w`` (TRL's ``get_gamma_weights``: ``log 1e-8`` below, 20 above).
VESPO_LOG_W_MIN, VESPO_LOG_W_MAX = math.log(1e-8), 20.0
#: VESPO's least rate ``lam`` (TRL's ``get_gamma_weights`` and Liger clamp it there: 0 is allowed and means this).
VESPO_LAMBDA_MIN = 1e-4


def vespo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig,
                  rollout_is: Optional[torch.Tensor] = None) -> torch.Tensor:
    """VESPO's sequence weight ``phi`` (detached, ``(B, T)``: ``k`` and ``lam`` follow each token's ``A``):
    ``phi = exp(lam + k log w - lam w)``, ``log w = clamp(sum_t m clamp(log r_t, -20, 20) + sum_t m clamp(log c_t,
    log 1e-8, 20), log 1e-8, 20)`` with ``log_ratio`` the token log-ratios and ``rollout_is`` the token-level
    rollout correction ``c_t`` (or ``None``); ``k, lam = vespo_k_pos, vespo_lambda_pos`` where ``A >= 0``, else
    the ``_neg`` pair, ``lam`` at least :data:`VESPO_LAMBDA_MIN` (as TRL and Liger); a non-finite ``phi`` is 0
    (TRL's ``nan_to_num``)."""
    zeros = torch.zeros_like(log_ratio)
    log_w = torch.where(mask, log_ratio.detach().clamp(min=-20.0, max=20.0), zeros).sum(dim=1, keepdim=True)
    if rollout_is is not None:
        log_is = rollout_is.detach().log().clamp(min=VESPO_LOG_W_MIN, max=VESPO_LOG_W_MAX)
        log_w = log_w + torch.where(mask, log_is, zeros).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(min=VESPO_LOG_W_MIN, max=VESPO_LOG_W_MAX)
    pos = advantages >= 0
    k = torch.where(pos, zeros + config.vespo_k_pos, zeros + config.vespo_k_neg)
    lam = torch.where(pos, zeros + config.vespo_lambda_pos, zeros + config.vespo_lambda_neg).clamp(min=VESPO_LAMBDA_MIN)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, zeros)


def config_scalar(like: torch.Tensor, value: float) -> torch.Tensor:
    """A config float as a 0-dim tensor of ``like``'s dtype and device (``ones * value``), for a ``clamp`` bound or
    any arithmetic on the float: under ``torch.compile`` dynamo keeps a Python float that changes between steps an
    input of the graph only where it meets a tensor directly; as ``clamp``'s scalar bound (or ``full_like``'s fill)
    it is a constant, and torch < 2.12 (checked on 2.11) also specializes one that Python arithmetic touches first
    (``1 - clip_low``, ``-clip_low``): a new graph per value either way. So ``1 - c`` is ``1 - config_scalar(x, c)``,
    rounded in ``x``'s dtype as the fused kernels round it."""
    return like.new_ones(()) * value


def ratio_bounds(like: torch.Tensor, config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip range of the ratio, ``(1 - clip_low, 1 + clip_high)``, as :func:`config_scalar` tensors."""
    return 1.0 - config_scalar(like, config.clip_low), 1.0 + config_scalar(like, config.clip_high)


#: The smoothing of ``1 - p`` in DPPO's binary KL (verl's ``compute_policy_loss_dppo_kl``).
DPPO_BINARY_KL_EPS = 1e-8


def dppo_keep(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
              config: PolicyLossConfig) -> torch.Tensor:
    """DPPO's trust-region mask ``k_t`` (bool, detached) of :class:`PolicyLossConfig`: with ``p = exp(logp)``, ``q =
    exp(old)`` (in fp32 at least, as the kernels), ``dppo_tv`` keeps ``p - q <= clip_high`` where ``A > 0``, else
    ``p - q >= -clip_low``; ``dppo_kl`` keeps ``D <= clip_high or p <= q`` where ``A > 0``, else ``D <= clip_low or p
    >= q``, ``D = q (old - logp) + (1 - q) log((1 - q + eps) / (1 - p + eps))`` the binary KL of ``q`` and ``p``
    (``eps`` = :data:`DPPO_BINARY_KL_EPS`). A NaN ``logp`` is never kept."""
    dtype = torch.promote_types(logp.dtype, torch.float32)
    lp, lq = logp.detach().to(dtype), old.detach().to(dtype)
    p, q = lp.exp(), lq.exp()
    low, high = config_scalar(p, config.clip_low), config_scalar(p, config.clip_high)
    if config.policy_loss == "dppo_tv":
        up, down = p - q <= high, p - q >= -low
    else:
        eps = DPPO_BINARY_KL_EPS
        divergence = q * (lq - lp) + (1.0 - q) * torch.log((1.0 - q + eps) / (1.0 - p + eps))
        up, down = (divergence <= high) | (p <= q), (divergence <= low) | (p >= q)
    return torch.where(advantages > 0, up, down)


def policy_gradient_loss(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                         config: PolicyLossConfig, log_ratio: Optional[torch.Tensor] = None,
                         mask: Optional[torch.Tensor] = None, phi: Optional[torch.Tensor] = None,
                         keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token surrogate (to minimize) of ``config.policy_loss``; see :class:`PolicyLossConfig`.
    gmpo also needs the masked token log-ratios ``log_ratio`` and the ``mask``; vespo its weights ``phi``
    (:func:`vespo_weights`); dppo its trust-region mask ``keep`` (:func:`dppo_keep`)."""
    a = advantages
    if config.policy_loss in ("ppo_clip", "gspo", "gspo_token"):
        low, high = ratio_bounds(ratio, config)
        clipped = ratio.clamp(min=low, max=high)
        unclipped = ratio if config.delta is None else ratio.clamp(max=config_scalar(ratio, config.delta))
        loss = torch.maximum(weighted(-a, unclipped), -a * clipped)  # A = 0: 0 also for an overflowed r
        if config.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -config_scalar(a, config.dual_clip) * a), loss)
        return loss
    if config.policy_loss == "gmpo":
        if log_ratio is None or mask is None:
            raise ValueError("gmpo needs the token log-ratios and the mask")
        sign = torch.sign(a)
        clipped = log_ratio.clamp(min=-config_scalar(log_ratio, config.clip_low),
                                  max=config_scalar(log_ratio, config.clip_high))
        # A = 0 (a group of equal rewards): x = 0, also where log r is -inf (not 0 * -inf = NaN)
        x = torch.where(sign == 0, torch.zeros_like(log_ratio), sign * torch.minimum(sign * log_ratio, sign * clipped))
        # ratio_exp: an overflowed term is a constant, so a dropped token (weight 0) gets 0 gradient, not 0 * inf
        return -a * ratio_exp(_sequence_mean(torch.where(mask, x, torch.zeros_like(x)), mask))
    if config.policy_loss == "sapo":
        zeros = torch.zeros_like(ratio)
        tau = torch.where(a > 0, zeros + config.sapo_temperature_pos, zeros + config.sapo_temperature_neg)
        # sigmoid as exp(logsigmoid): autograd's slope is then s sigmoid(-x) (logsigmoid's backward), exact in the
        # tail, where sigmoid's own s (1 - s) is 0 once s rounds to 1 (x > 17 in fp32, 37 in fp64)
        return -a * torch.exp(torch.nn.functional.logsigmoid(tau * (ratio - 1.0))) * (4.0 / tau)
    if config.policy_loss == "cispo":
        return weighted(-ratio.clamp(max=ratio_bounds(ratio, config)[1]).detach() * a, logp)
    if config.policy_loss == "vespo":
        if phi is None:
            raise ValueError("vespo needs its weights phi")
        return weighted(-phi.detach() * a, logp)
    if config.policy_loss in DPPO:
        if keep is None:
            raise ValueError("dppo needs its trust-region mask keep")
        w = ratio.detach() if config.delta is None else ratio.detach().clamp(max=config_scalar(ratio, config.delta))
        # a dropped token or A = 0: 0, also where w or logp is infinite
        return weighted(torch.where(keep & (a != 0), -w * a, torch.zeros_like(w)), logp)
    return weighted(-a, logp)  # reinforce


#: Bound of the rollout correction's log-ratio before its ``exp`` (verl's ``SAFETY_BOUND`` in
#: ``rollout_corr_helper.py``): ``e^-20 <= rho <= e^20``, so a long sequence's summed log-ratio cannot overflow
#: ``rho`` to ``inf`` where no ``rollout_is_max`` truncates it (``inf * 0`` made the loss of an ``A = 0`` row NaN).
ROLLOUT_LOG_RHO_BOUND = 20.0


def rollout_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                    config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rho, w)``, detached: the importance weight ``rho = exp(clamp(old - rollout, -20, 20))`` of the training
    policy against the sampler (per sequence: ``exp(clamp(sum_t m (old - rollout), -20, 20))``, broadcast; the
    bound is :data:`ROLLOUT_LOG_RHO_BOUND`, verl's) and the factor ``w`` applied to the policy term:
    ``clamp(rho, min, max)`` (``*_truncate``) or ``rho 1[min <= rho <= max]`` (``*_mask``). Masked positions get
    ``rho = w = 1``; a NaN ``rollout`` log-prob (a token the inference engine did not score, vLLM's ``None``) has
    log-ratio 0, as TRL's ``nan_to_num``: no correction of its own, nothing added to its sequence's sum."""
    diff = torch.where(mask & ~torch.isnan(rollout), old.detach() - rollout, torch.zeros_like(old))
    if config.rollout_is.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True).expand_as(old)
    rho = torch.exp(diff.clamp(min=-ROLLOUT_LOG_RHO_BOUND, max=ROLLOUT_LOG_RHO_BOUND))
    lo, hi = config.rollout_is_min, config.rollout_is_max
    if config.rollout_is.endswith("truncate"):
        w = rho.clamp(min=None if lo is None else config_scalar(rho, lo),
                      max=None if hi is None else config_scalar(rho, hi))
    else:
        keep = torch.ones_like(mask) if lo is None else rho >= lo
        if hi is not None:
            keep = keep & (rho <= hi)
        w = torch.where(keep, rho, torch.zeros_like(rho))
    one = torch.ones_like(rho)
    return torch.where(mask, rho, one), torch.where(mask, w, one)


def off_policy_keep(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    config: PolicyLossConfig) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (bool, detached): keep a token unless its ``A < 0`` and
    its sequence's mean ``sum_t m (behaviour - sg(logp)) / sum_t m`` exceeds ``config.off_policy_mask``; a NaN
    ``behaviour`` (rollout) log-prob, a token the engine did not score, adds 0 to the sum (TRL's ``nan_to_num``)
    and still counts in ``sum_t m``."""
    kl = torch.where(mask & ~torch.isnan(behaviour), behaviour.detach() - logp.detach(), torch.zeros_like(logp))
    return (advantages >= 0) | (_sequence_mean(kl, mask) <= config.off_policy_mask)


EntropyGather = Callable[[torch.Tensor], torch.Tensor]
#: The gather of :func:`entropy_quantile_across` while its block runs (a module global, not a ContextVar:
#: torch.compile traces a global's read, with a guard on it, but not ``ContextVar.get``).
_entropy_gather: Optional[EntropyGather] = None


@contextlib.contextmanager
def entropy_quantile_across(gather: EntropyGather) -> Iterator[None]:
    """Within the block, ``top_entropy_quantile``'s threshold is the quantile of the unmasked entropies of
    every process, as TRL's ``get_high_entropy_mask`` takes it: ``gather(local)`` receives this process's
    1-D tensor of unmasked entropies (fp32; fp64 for fp64 inputs) and returns their concatenation over the
    processes (the order
    does not matter), e.g. :func:`fused_rl.distributed.all_gather_1d` or accelerate's
    ``pad_across_processes`` + ``gather``. Each process keeps its own mask and normalizer. Eager mode (the
    gather's variable length costs a host sync), process-wide while the block runs (not per thread); the
    gather runs once per loss call (each backend evaluates the threshold in its O(N) loss math, between
    its stats and gradient passes)."""
    global _entropy_gather
    previous, _entropy_gather = _entropy_gather, gather
    try:
        yield
    finally:
        _entropy_gather = previous


def _quantile_of_sorted(values: torch.Tensor, count: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The ``q`` quantile of the first ``count`` entries of the ascending 1-D ``values``, linearly
    interpolated as ``torch.quantile`` does on them in ``q``'s dtype (TRL's ``get_high_entropy_mask``: on the
    entropies ``.float()``), with a tensor index (no data-dependent int under torch.compile); ``values[0]`` when
    ``count`` is 0. In bf16 entropies' own dtype the position was off by up to 1/512 of ``count``; an fp32
    position past 2^24 may round beyond the last entry: clamped to it."""
    pos = (count - 1).clamp(min=0).to(q.dtype) * q
    lo = pos.floor()
    idx = torch.minimum(torch.stack([lo, pos.ceil()]).long(), (count - 1).clamp(min=0))
    low, high = values.gather(0, idx).to(q.dtype).unbind()
    lo_idx, hi_idx = idx.unbind()
    return torch.where(hi_idx > lo_idx, torch.lerp(low, high, pos - lo), low)


def top_entropy_keep(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """``m & (H >= q)`` (bool, detached) with ``q`` the ``(1 - quantile)`` quantile of the unmasked
    entropies (of every process inside :func:`entropy_quantile_across`), linearly interpolated as
    ``torch.quantile`` does; computed by one sort, without a host sync or a size limit (locally)."""
    h = entropy.detach()
    gather = _entropy_gather
    if gather is None:
        values = torch.where(mask, h, torch.full_like(h, float("inf"))).reshape(-1).sort().values
        count = mask.sum()
    else:
        values = gather(h[mask]).reshape(-1).sort().values
        if values.numel() == 0:  # no unmasked token anywhere: nothing to keep (as TRL)
            return torch.zeros_like(mask)
        count = torch.tensor(values.numel(), device=values.device)
    # in fp32 at least, q = fp32(1 - quantile) (TRL: torch.quantile(entropies.float(), 1 - quantile))
    dtype = torch.promote_types(h.dtype, torch.float32)
    threshold = _quantile_of_sorted(values, count, (1.0 - config_scalar(count.double(), quantile)).to(dtype))
    return mask & (h.to(dtype) >= threshold)


def covariance_selection(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         config: PolicyLossConfig) -> torch.Tensor:
    """The tokens (bool, detached) ``cov_mode`` selects among the unmasked ones of the batch, on the device without a
    host sync: with ``cov_t = (A_t - mean A) (sg(logp_t) - mean sg(logp))`` (means over the unmasked tokens) and ``n =
    max(floor(cov_ratio * #unmasked), 1)``, kl_cov's ``n`` largest ``cov_t`` (ties by position), or ``n`` of clip_cov's
    candidates (``clip_cov_lb < cov_t < clip_cov_ub``, the PPO clip not active: ``-A clip(r) <= -A r``) drawn
    uniformly from torch's generator of the device (each candidate a ``torch.rand`` key, the ``n`` smallest kept);
    every candidate when there are fewer."""
    zeros = torch.zeros_like(advantages)
    count = mask.sum()
    denom = count.clamp(min=1).to(advantages.dtype)
    lp = torch.where(mask, logp.detach(), zeros)
    a = torch.where(mask, advantages, zeros)
    cov = (a - a.sum() / denom) * (lp - lp.sum() / denom)
    if config.cov_mode == "kl_cov":
        candidates, keys = mask, -cov
    else:
        r = ratio.detach()
        low, high = ratio_bounds(r, config)
        clip_active = -a * r.clamp(min=low, max=high) > -a * r
        candidates = mask & ~clip_active & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        keys = torch.rand(mask.shape, device=mask.device)
    flat = torch.where(candidates, keys, torch.full_like(keys, float("inf"))).reshape(-1)
    order = flat.argsort(stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    wanted = (count.to(torch.float64) * config.cov_ratio).floor().clamp(min=1)  # verl's int(ratio * N), in double
    return candidates & (rank.view(mask.shape) < wanted)


class TokenTerms(NamedTuple):
    """Per-token pieces of the loss, all ``(B, T)``: ``loss`` (0 where masked), the importance ``ratio``,
    the KL estimate (``None`` without ``config.kl``) and ``extras``, detached tensors for the metrics:
    ``log_ratio`` (gmpo's and vespo's token log-ratios), ``vespo_phi`` (:func:`vespo_weights`), ``rollout_rho`` /
    ``rollout_is`` (:func:`rollout_weights`), ``dppo_keep`` (:func:`dppo_keep`), ``cov_selected``
    (:func:`covariance_selection`),
    ``off_policy_keep`` and ``entropy_keep`` (the masks), only those the config uses."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: Optional[torch.Tensor]
    extras: dict


def per_token_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> TokenTerms:
    """Per-token loss ``l_t = c_t pg_t + beta * kl_t - entropy_coef * H_t`` (0 where masked; ``kl_t``
    times the ratio ``r_t`` with ``config.kl_bias_correction``; ``c_t`` the detached product of the
    rollout weight (vespo: inside its ``phi`` instead), the off-policy / top-entropy masks and the given
    ``rollout_is_weights`` (importance weights ``>= 0`` computed by the caller, e.g. verl's ``rollout_is_weights``
    or TRL / Liger's ``vllm_is_ratio``; refused by vespo), 1 when none is configured).

    Each row ``b`` depends only on row ``b`` of the inputs (sequence ratios and masks included),
    except with ``config.is_batch_level`` (the top-entropy quantile is over all given rows). Shapes
    ``(B, T)``; ``mask`` boolean.
    """
    zeros = torch.zeros_like(logp)
    old = logp.detach() if old_logprobs is None else old_logprobs
    a = torch.where(mask, advantages, zeros)
    ratio = importance_ratio(logp, old, mask, config)
    safe_logp = torch.where(mask, logp, zeros)
    extras: dict = {}
    scale = rollout_w = None
    if config.rollout_is is not None:
        if rollout_logprobs is None:
            raise ValueError(f"config.rollout_is={config.rollout_is!r} needs rollout_logprobs")
        rho, rollout_w = rollout_weights(old, torch.where(mask, rollout_logprobs, zeros), mask, config)
        extras["rollout_rho"], extras["rollout_is"] = rho, rollout_w
    log_ratio = phi = trust = None
    if config.policy_loss in DPPO:
        extras["dppo_keep"] = trust = dppo_keep(logp, old, a, config)
    if config.policy_loss in ("gmpo", "vespo"):
        log_ratio = torch.where(mask, logp - old, zeros)
        extras["log_ratio"] = log_ratio.detach()
    if config.policy_loss == "vespo":
        if rollout_is_weights is not None:
            raise ValueError("policy_loss='vespo' folds importance weights into its sequence weight: pass the "
                             "sampler's log-probs with config.rollout_is instead of rollout_is_weights")
        extras["vespo_phi"] = phi = vespo_weights(log_ratio, a, mask, config, rollout_w)
    if config.cov_mode is not None:
        extras["cov_selected"] = selected = covariance_selection(logp, ratio, a, mask, config)
        if config.cov_mode == "clip_cov":  # the selected tokens dropped
            scale = (~selected).to(logp.dtype)
    if config.off_policy_mask is not None:
        behaviour = old if rollout_logprobs is None else torch.where(mask, rollout_logprobs, zeros)
        extras["off_policy_keep"] = keep = off_policy_keep(logp, behaviour, a, mask, config)
        scale = keep.to(logp.dtype) if scale is None else scale * keep
    if config.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("config.top_entropy_quantile < 1 needs the entropy")
        extras["entropy_keep"] = keep = top_entropy_keep(entropy, mask, config.top_entropy_quantile)
        scale = keep.to(logp.dtype) if scale is None else scale * keep
    if rollout_w is not None and config.policy_loss != "vespo":  # vespo's is inside phi
        scale = rollout_w if scale is None else scale * rollout_w
    if rollout_is_weights is not None:
        w = torch.where(mask, rollout_is_weights.detach(), torch.ones_like(logp))
        scale = w if scale is None else scale * w
    if trust is not None and scale is not None:
        # dppo without delta: a dropped token's weight may be an overflowed r, whose gradient times the zero scale
        # would be 0 * inf = NaN; out of the mask it is 0
        trust = trust & (scale != 0)
    loss = policy_gradient_loss(safe_logp, ratio, a, config, log_ratio=log_ratio, mask=mask, phi=phi, keep=trust)
    if config.cov_mode == "kl_cov":  # + coef |logp - old| on the selected tokens' policy term
        gap = (safe_logp - torch.where(mask, old, zeros)).abs()
        loss = loss + torch.where(selected, config.kl_cov_coef * gap, zeros)
    if scale is not None:  # a dropped token (scale 0) adds 0, also where its loss is inf
        loss = weighted(scale, loss)
    kl = None
    if config.kl is not None:
        if ref_logprobs is None:
            raise ValueError(f"config.kl={config.kl!r} needs ref_logprobs")
        safe_ref = torch.where(mask, ref_logprobs, zeros)
        if config.kl_bias_correction:
            kl = bias_corrected_kl(logp, safe_ref, old, mask, config)
        else:
            kl = torch.where(mask, kl_estimator(safe_logp, safe_ref, config.kl, config.kl_clamp,
                                                kl_gradient_weight(safe_logp, old, mask, config)), zeros)
        if config.beta != 0.0:
            loss = loss + config.beta * kl
    if config.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("config.entropy_coef != 0 needs the entropy")
        loss = loss - config.entropy_coef * torch.where(mask, entropy, zeros)
    return TokenTerms(torch.where(mask, loss, zeros), ratio, kl, extras)


def compute_policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    token_normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics from per-token log-probs: ``loss = sum_t w_t l_t`` with ``l`` from
    :func:`per_token_loss` and ``w`` from :func:`aggregation_weights`.

    Shapes: all ``(B, T)``; ``advantages`` already broadcast; ``mask`` boolean. Metrics are
    detached 0-dim fp32 tensors averaged over masked tokens (no host sync).
    """
    terms = per_token_loss(logp, advantages, mask, config, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                           entropy=entropy, rollout_logprobs=rollout_logprobs,
                           rollout_is_weights=rollout_is_weights)
    weights = aggregation_weights(mask, config, token_normalizer, dtype=logp.dtype)
    loss = (terms.loss * weights).sum()
    return loss, metrics(terms.ratio, advantages, mask, config, terms.kl, entropy, terms.extras)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(m x) / max(sum(m), 1)`` over the boolean ``mask``, detached fp32 (the metrics' mean)."""
    m = mask.to(torch.float32)
    return torch.where(mask, x.detach().to(torch.float32), torch.zeros_like(m)).sum() / m.sum().clamp(min=1.0)


def responses_factor(mask: torch.Tensor, dtype: torch.dtype, dp_size=1, global_count=None) -> torch.Tensor:
    """A peer's per-response mean over ``global_count / dp_size`` responses (``None``: the local ones with a token)
    as a factor on fused_rl's mean over the ``B`` rows: ``B dp_size / global_count``, or ``B / max(#non-empty, 1)``
    (0-dim ``dtype``, no host sync)."""
    if global_count is None:
        return mask.shape[0] / mask.any(dim=1).sum().clamp(min=1).to(dtype)
    return mask.shape[0] * dp_size / torch.as_tensor(global_count, dtype=dtype, device=mask.device)


def clip_fractions_per_sequence(config: PolicyLossConfig) -> bool:
    """Whether :func:`metrics`' clip fractions are fractions of the ``B`` sequences (gspo: one ratio a sequence),
    not of the tokens: a mean over several batches weights them by their sequences."""
    return config.policy_loss == "gspo"


def metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig,
            kl: Optional[torch.Tensor], entropy: Optional[torch.Tensor],
            extras: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Masked means over the unmasked tokens.

    Clip fractions follow TRL (``low``: ``r < 1-clip_low`` and ``A < 0``; ``high``: ``r > 1+clip_high``
    and ``A > 0``; gmpo: the token log-ratio beyond ``-clip_low`` / ``clip_high``); cispo's ``high``
    counts every truncated weight ``r > 1+clip_high``; dppo's the tokens its trust-region mask drops (``high``: ``A >
    0``, ``low``: ``A <= 0``; ``clip_frac`` is verl's ``pg_clipfrac``); ``dual``: tokens with ``A < 0`` and ``r > c``
    (the dual clip's condition; with a ``delta`` below ``c`` it is ``delta``'s cap ``-delta A`` that binds
    there). For gspo (one ratio a sequence) they are fractions of the ``B`` sequences, as TRL's
    ``importance_sampling_level="sequence"`` counts them (a sequence counts if any of its tokens does). With the
    options that use them (``extras`` of :class:`TokenTerms`):
    ``rollout_is_mean`` (the applied rollout weight), ``rollout_is_clip_frac`` (tokens whose ``rho`` is
    outside ``[rollout_is_min, rollout_is_max]``), ``vespo_phi_mean`` (vespo's weight), ``off_policy_mask_frac`` and
    ``entropy_mask_frac``
    (tokens dropped by each mask), ``cov_frac`` (the tokens ``cov_mode`` selects: clip_cov drops them, kl_cov
    penalizes them)."""
    extras = {} if extras is None else extras
    ratio = ratio.detach()
    a = torch.where(mask, advantages, torch.zeros_like(advantages))

    def mean(x: torch.Tensor) -> torch.Tensor:
        return masked_mean(x, mask)

    false = torch.zeros_like(mask)
    low = high = dual = false
    if config.policy_loss in ("ppo_clip", "gspo", "gspo_token"):
        lo, hi = ratio_bounds(ratio, config)
        low, high = (ratio < lo) & (a < 0), (ratio > hi) & (a > 0)
        if config.dual_clip is not None:
            # for A < 0 the clipped surrogate is |A| max(u, 1 - clip_low) (u = r, or min(r, delta)); the cap |A| c
            # binds when u > c, counted as r > c (a delta below c binds first: its cap, counted here too)
            dual = (a < 0) & (ratio > config.dual_clip)
    elif config.policy_loss == "gmpo":
        log_ratio = extras["log_ratio"]
        low = (log_ratio < -config_scalar(log_ratio, config.clip_low)) & (a < 0)
        high = (log_ratio > config.clip_high) & (a > 0)
    elif config.policy_loss == "cispo":
        high = ratio > ratio_bounds(ratio, config)[1]
    elif config.policy_loss in DPPO:  # tokens outside the trust region, split as the mask is: A > 0 or not
        dropped = ~extras["dppo_keep"]
        low, high = dropped & ~(a > 0), dropped & (a > 0)
    clip_mean = mean
    if clip_fractions_per_sequence(config):
        clip_mean = lambda x: (x & mask).any(dim=-1).to(torch.float32).mean()  # noqa: E731
    out = {
        "kl_mean": mean(kl) if kl is not None else torch.zeros((), dtype=torch.float32, device=mask.device),
        "clip_frac_low": clip_mean(low),
        "clip_frac_high": clip_mean(high),
        "clip_frac": clip_mean(low | high),
        "clip_frac_dual": clip_mean(dual),
        "ratio_mean": mean(ratio),
    }
    if entropy is not None:
        out["entropy_mean"] = mean(entropy)
    if config.rollout_is is not None:
        rho = extras["rollout_rho"]
        outside = torch.zeros_like(mask)
        if config.rollout_is_min is not None:
            outside = outside | (rho < config.rollout_is_min)
        if config.rollout_is_max is not None:
            outside = outside | (rho > config.rollout_is_max)
        out["rollout_is_mean"] = mean(extras["rollout_is"])
        out["rollout_is_clip_frac"] = mean(outside)
    if config.policy_loss == "vespo":
        out["vespo_phi_mean"] = mean(extras["vespo_phi"])
    if config.off_policy_mask is not None:
        out["off_policy_mask_frac"] = mean(~extras["off_policy_keep"])
    if config.top_entropy_quantile < 1.0:
        out["entropy_mask_frac"] = mean(~extras["entropy_keep"])
    if config.cov_mode is not None:
        out["cov_frac"] = mean(extras["cov_selected"])
    return out
