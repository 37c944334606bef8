"""Shared test inputs and comparisons against the reference.

Every backend test draws its inputs here so that all of them see the hard cases: vocabularies that
are not a multiple of any block, peaked rows (one logit far above the rest), all-negative rows
(``randn - 30``: a kernel whose running max starts at 0 gets these wrong), all-masked rows,
length-1 responses, and ``IGNORE_INDEX`` targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.backends import base as base_backend

LOGIT_KINDS = ("randn", "peaked", "negative")

#: (atol, rtol) for backend-vs-reference comparisons per input dtype. bf16/fp16 backends are compared
#: with the fp32 reference evaluated on the *same* rounded inputs, so only accumulation error remains.
#: fp32 backends are compared with the fp64 oracle under the rule of :func:`expected_results`; these fp32
#: entries are the fp32-vs-fp32 ones, used where the fp32 reference itself departs from the oracle.
TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-4),
    torch.bfloat16: (2e-3, 2e-3),
    torch.float16: (2e-3, 2e-3),
}
#: Gradients of bf16/fp16 logits are rounded to that dtype once: 2^-8 / 2^-11 relative error.
GRAD_TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-6, 1e-4),
    torch.bfloat16: (1e-4, 8e-3),
    torch.float16: (1e-5, 1e-3),
}


def make_logits(shape, kind: str = "randn", dtype=torch.float32, generator: Optional[torch.Generator] = None,
                scale: float = 2.0) -> torch.Tensor:
    """Random logits of ``shape (..., V)``: ``randn * scale``, ``peaked`` (one entry +25 per row), or
    ``negative`` (``randn - 200``, every logit far below 0: below -88, where ``exp`` of a logit underflows fp32, so a
    running max that starts at 0 instead of -inf gives ``log 0``)."""
    x = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    if kind == "peaked":
        idx = torch.randint(0, shape[-1], shape[:-1] + (1,), generator=generator)
        x.scatter_add_(-1, idx, torch.full(idx.shape, 25.0))
    elif kind == "negative":
        x = x - 200.0
    elif kind != "randn":
        raise ValueError(kind)
    return x.to(dtype)


@dataclass
class PolicyCase:
    logits: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    rollout: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None

    def kwargs(self) -> dict:
        extra = {k: v for k, v in (("rollout_logprobs", self.rollout), ("truncated", self.truncated)) if v is not None}
        return dict(old_logprobs=self.old, ref_logprobs=self.ref, **extra)


def make_case(batch: int = 4, length: int = 6, vocab: int = 1000, *, kind: str = "randn",
              dtype=torch.float32, seed: int = 0, per_token_adv: bool = False, off_policy: bool = True,
              with_ref: bool = True, ignore_some: bool = True, spread: float = 0.3) -> PolicyCase:
    """A ragged batch: row 0 fully masked (when ``batch > 2``), row 1 a length-1 response, the rest
    random right padding, a few ``IGNORE_INDEX`` targets. ``old`` / ``ref`` are the reference log-probs
    perturbed by ``spread`` so ratios land on both sides of the clip range."""
    g = torch.Generator().manual_seed(seed)
    logits = make_logits((batch, length, vocab), kind, dtype, g)
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    if batch > 2:
        lengths[0] = 0
        lengths[1] = 1
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if ignore_some and batch * length > 4:
        targets[-1, -1] = fused_rl.IGNORE_INDEX
    adv_shape = (batch, length) if per_token_adv else (batch,)
    advantages = torch.randn(adv_shape, generator=g)
    with torch.no_grad():
        lp = fused_rl.reference.token_logprobs(logits, targets, check_inputs=False)
    # noisy log-probs stay log-probs (<= 0: the loss refuses values above validation.LOGPROB_SLACK)
    old = (lp + spread * torch.randn(lp.shape, generator=g)).clamp(max=0.0) if off_policy else None
    ref = (lp + spread * torch.randn(lp.shape, generator=g)).clamp(max=0.0) if with_ref else None
    return PolicyCase(logits, targets, advantages, mask, old, ref)


#: A spread of configs covering every policy_loss x kl x agg option at least once.
CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(clip_low=0.1, clip_high=0.3, dual_clip=3.0, kl="k3", beta=0.05, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="gspo", clip_low=0.05, clip_high=0.1, agg="seq-mean-token-mean"),
    PolicyLossConfig(policy_loss="cispo", clip_high=0.2, kl="k1", beta=0.1, agg="seq-mean-token-sum"),
    PolicyLossConfig(policy_loss="reinforce", kl="k2", beta=0.2, agg="seq-mean-token-sum-norm", max_len=9),
    PolicyLossConfig(kl="abs", beta=0.1, agg="seq-mean-token-mean", temperature=0.7, entropy_coef=-0.02),
    PolicyLossConfig(kl="low_var_kl", beta=0.3, temperature=1.3),
    PolicyLossConfig.preset("dapo", kl="k3", beta=0.2, kl_bias_correction=True),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 grad: bool = False, scale: float = 1.0, equal_nan: bool = False, extra_atol: float = 0.0) -> None:
    """``equal_nan``: NaN where the reference is NaN passes (a metric of an overflowed term, e.g. the
    bias-corrected k3 ``r * k3`` of ``r = 0``, ``k3 = inf``, with ``beta = 0``: the loss is finite)."""
    atol, rtol = (GRAD_TOLERANCES if grad else TOLERANCES)[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol * scale + extra_atol,
                               rtol=rtol * scale, equal_nan=equal_nan, msg=lambda m: f"{what}: {m}")


def magnitude_scale(logits: torch.Tensor, temperature: float) -> float:
    """Tolerance factor for logits far from 0: fp32 holds ``z = logits / tau`` to ``|z| 2^-24``, so two
    correct implementations (``x / tau`` vs ``x * (1 / tau)``, FMA or not) differ in proportion to
    ``|z|``; 1 up to ``|z| = 100`` (real LM logits), linear beyond (the fuzz's ``z - 1000`` at tau 0.3)."""
    x = logits.detach().float().abs()
    return max(1.0, float(torch.where(torch.isfinite(x), x, 0.0).max()) / temperature / 100.0)


def same_layout(x: torch.Tensor) -> torch.Tensor:
    """A leaf copy of ``x`` with its strides, gaps included (``clone`` of a ``logits[:, :-1]`` view is
    contiguous, so a kernel would never see the view's batch stride)."""
    x = x.detach()
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


#: fp32's unit roundoff (a correctly rounded fp32 operation is off by at most this, relative).
U32 = 2.0 ** -24
#: The fp32-vs-fp64-oracle rule of :func:`expected_results`: ``ORACLE_ULPS`` unit roundoffs of the magnitude
#: scale of each value (a log-sum-exp over V = 1000 entries is off by ~30 u; 16 failed on randomized fuzz examples),
#: plus ``ORACLE_RTOL`` relative (about 170 ulps, for accumulation over the vocabulary).
ORACLE_ULPS = 64.0
ORACLE_RTOL = 1e-5

Atol = Union[float, torch.Tensor]


@contextlib.contextmanager
def _loss_math_calls(seen: list):
    """Within the block the reference backend's calls of ``loss_math.compute_policy_loss`` (per-token log-probs
    and entropies to loss) are appended to ``seen`` as ``(args, kwargs, gathered)``: ``gathered`` the entropies
    an active ``entropy_quantile_across`` gather returned in that call (``None`` without one)."""
    original, gather = base_backend.compute_policy_loss, fused_rl.loss_math._entropy_gather
    gathered = []

    def record(local):
        gathered.append(gather(local))
        return gathered[-1]

    def spy(*args, **kwargs):
        gathered.clear()
        out = original(*args, **kwargs)
        seen.append((args, kwargs, gathered[-1] if gathered else None))
        return out

    base_backend.compute_policy_loss = spy
    fused_rl.loss_math._entropy_gather = None if gather is None else record
    try:
        yield
    finally:
        base_backend.compute_policy_loss = original
        fused_rl.loss_math._entropy_gather = gather


#: Step of the central difference of ``dL/dlogp`` in :func:`_token_coefficients` (fp64: ~1e-10 relative error).
FD_STEP = 2.0 ** -20


def _token_coefficients(args, kwargs, gathered) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, |dL/dH|)`` from the loss math's inputs (fp64), ``c_t = |dL/dlogp_t| + |dL/dH_t| + |d(dL/dlogp_t)/de|``
    (B, T), with ``e`` a shift of every token's log-prob (an error of ``e`` moves the loss by ``~ sum_t c_t e``,
    the logits gradient's coefficient ``dL/dlogp_t`` by ``~ c_t e``: its slope dominates where it is small, e.g.
    ``beta (1 - exp(d))`` of k3 at ``d ~ 0``). The slope is a central difference over ``e = +-FD_STEP``. A
    gathered top-entropy threshold is reused (``gathered``), not gathered again."""
    logp, *rest = args
    entropy = kwargs.get("entropy")

    def grads(shift):
        lp = (logp.detach() + shift).requires_grad_(True)
        ent = None if entropy is None else entropy.detach().requires_grad_(True)
        loss, _ = fused_rl.loss_math.compute_policy_loss(lp, *rest, **{**kwargs, "entropy": ent})
        g = torch.autograd.grad(loss, [x for x in (lp, ent) if x is not None], allow_unused=True)
        return [torch.zeros_like(logp) if x is None else x for x in g] + [torch.zeros_like(logp)] * (2 - len(g))

    previous = fused_rl.loss_math._entropy_gather
    fused_rl.loss_math._entropy_gather = None if gathered is None else (lambda local: gathered)
    try:
        (g, e), (g_up, _), (g_down, _) = grads(0.0), grads(FD_STEP), grads(-FD_STEP)
    finally:
        fused_rl.loss_math._entropy_gather = previous
    return g.abs() + e.abs() + ((g_up - g_down) / (2 * FD_STEP)).abs(), e.abs()


def _reference_values(fn, leaves, dtype, grad_names, coefficients: bool = False):
    """``fn(*xs)`` (the reference) on ``leaves`` cast to ``dtype`` (fresh leaves; a ``None`` grad name: no
    gradient), its loss backpropagated: ``({name: value}, xs, coef)``, names ``loss``, ``logprobs``,
    ``entropy``, ``metric <m>`` and ``grad_names``; ``coef``: :func:`_token_coefficients` if asked for."""
    xs = [None if x is None else x.detach().to(dtype).requires_grad_(name is not None)
          for x, name in zip(leaves, grad_names)]
    seen = []
    with _loss_math_calls(seen):
        out = fn(*xs)
    out.loss.backward()
    values = {"loss": out.loss.detach(), "logprobs": out.logprobs, "entropy": out.entropy,
              **{f"metric {k}": v for k, v in out.metrics.items()},
              **{name: x.grad for x, name in zip(xs, grad_names) if name is not None}}
    (call,) = seen
    return values, xs, _token_coefficients(*call) if coefficients else (None, None)


def _within(actual: torch.Tensor, expected: torch.Tensor, atol: Atol, rtol: float, equal_nan: bool) -> torch.Tensor:
    """Elementwise ``|actual - expected| <= atol + rtol |expected|`` (equal infinities pass; NaN = NaN with
    ``equal_nan``)."""
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    ok = ((a - e).abs() <= atol + rtol * e.abs()) | (a == e)
    return ok | (a.isnan() & e.isnan()) if equal_nan else ok


@dataclass
class Expected:
    """What a backend's results are checked against (:func:`expected_results`): ``values`` with ``tols``
    (name -> ``(atol, rtol)``, atol a float or a per-element tensor) and a ``fallback``: a function giving a
    second reference's values and tolerances, run the first time an element misses ``values``: for fp32 inputs
    the fp32 reference (``values`` are the fp64 oracle's), for bf16 / fp16 inputs the fp64 oracle (``values``
    are the fp32 reference's)."""

    values: dict
    tols: dict
    fallback: Optional[Callable[[], tuple[dict, dict]]] = None
    _fallback: Optional[tuple[dict, dict]] = dataclasses.field(default=None, repr=False)

    def check(self, name: str, actual: torch.Tensor, equal_nan: bool = False) -> None:
        expected = self.values[name]
        atol, rtol = self.tols[name]
        ok = _within(actual, expected, atol, rtol, equal_nan)
        if not ok.all() and self.fallback is not None:
            # Where the two references themselves disagree by more than the tolerance, either answer is legitimate
            # for an fp32 computation, and those elements (only those) are compared with the second reference.
            # fp32 inputs: fp32 departs from fp64 by more than rounding where a ratio at a clip bound (or an
            # entropy at the top-entropy threshold) lands on the other side of it, or a value overflows to inf in
            # fp32 only (exp(100); the bias-corrected k3 r * k3 of r = 0, k3 = inf is NaN in fp32 but finite in
            # fp64). bf16 / fp16 inputs: where the policy and KL terms of a token's gradient nearly cancel, the fp32
            # reference is ~1e-3 off the exact value (a fuzz example: 2.5e-3, at a 32x cancellation), and a fused
            # backend computing in fp32 may land nearer the exact value than the reference does.
            if self._fallback is None:
                self._fallback = self.fallback()
            ref_values, ref_tols = self._fallback
            departs = ~_within(ref_values[name], expected, atol, rtol, equal_nan)
            ok = ok | (departs & _within(actual, ref_values[name], *ref_tols[name], equal_nan))
        if ok.all():
            return
        a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
        bound = torch.as_tensor(atol, dtype=torch.float64, device=e.device) + rtol * e.abs()
        excess = torch.where(ok, torch.zeros_like(e), torch.nan_to_num((a - e).abs() - bound, nan=float("inf")))
        worst = int(excess.flatten().argmax())
        raise AssertionError(
            f"{name}: {int((~ok).sum())} / {ok.numel()} elements beyond the tolerance; worst at flat index {worst}: "
            f"got {a.flatten()[worst].item():.9g}, expected {e.flatten()[worst].item():.9g} (bound "
            f"{bound.expand_as(e).flatten()[worst].item():.3g}, {expected.dtype} "
            f"{'oracle' if expected.dtype == torch.float64 else 'reference'})")


def expected_results(fn: Callable, leaves: Sequence[Optional[torch.Tensor]], grad_names: Sequence[Optional[str]],
                     dtype: torch.dtype, temperature: float, old_tols: Callable[[str], tuple[Atol, float]],
                     zscale: Callable[[list], float],
                     grad_bounds: Callable[[torch.Tensor, torch.Tensor, list], dict]) -> Expected:
    """The reference's results on ``leaves`` (``fn(*leaves) -> PolicyLossOutput``) and their tolerances.

    * bf16 / fp16 (and fp64) inputs: the fp32 (fp64) reference on the same inputs, tolerances ``old_tols(name)``
      (:data:`TOLERANCES`, :data:`GRAD_TOLERANCES`; set by the output rounding); bf16 / fp16: where the fp32
      reference is itself farther than that from the fp64 oracle, :meth:`Expected.check` accepts the oracle's
      value under the same tolerances.
    * fp32 inputs: the reference run in fp64 on the same values (the oracle), and one rule, ``atol = K u s M``,
      ``rtol = ORACLE_RTOL``, ``K = ORACLE_ULPS``, ``u = 2^-24``; ``s = max(1, |z|_max / tau)`` bounds the
      logits (``zscale(leaves64)``: an fp32 logit, and so ``z - max z`` and ``log sum exp``, is off by
      ``~ u s``), and ``M`` is how that logit error reaches the value:

      - ``logprobs``, ``entropy``: ``M = 1``;
      - ``metric <m>``: the fp32-vs-fp32 tolerances ``old_tols`` (a metric's error is its tokens' errors times
        their slopes of either sign, no bound of the loss's kind: a rule from the slope to a common shift of the
        log-probs failed on randomized fuzz examples; metrics are diagnostics);
      - ``loss``: ``M = sum_t c_t`` with ``c_t = |dL/dlogp_t| + |dL/dH_t| + |d(dL/dlogp_t)/dlogp|``
        (:func:`_token_coefficients`: first-order propagation of the per-token error ``u s`` into the loss and
        into the logits gradient's coefficients; the aggregation weights scale it, a normalizer of 2^20 too);
      - gradients: per element, ``M = grad_bounds(c, |dL/dH|, leaves64)``: for the logits,
        :func:`logits_gradient_bound` (the size of the entry's terms); for the fused linear, that bound carried
        through ``|h| |W|^T + |b|`` (``test_linear.abs_gemm_bounds``); plus ``K 2^-126`` (fp32's least normal: an
        entry near it underflows or is flushed to 0).

      A wrong formula off by ``1e-3`` of a term misses this; where the fp32 reference itself departs from the
      oracle by more (a clip-side flip, an fp32-only overflow) :meth:`Expected.check` falls back to it.
    """
    if dtype == torch.float64:
        values, _, _ = _reference_values(fn, leaves, torch.float64, grad_names)
        return Expected(values, {name: old_tols(name) for name in values})
    if dtype != torch.float32:
        values, _, _ = _reference_values(fn, leaves, torch.float32, grad_names)

        def oracle():
            exact, _, _ = _reference_values(fn, leaves, torch.float64, grad_names)
            return exact, {name: old_tols(name) for name in exact}

        return Expected(values, {name: old_tols(name) for name in values}, oracle)
    values, xs, (coef, ent_coef) = _reference_values(fn, leaves, torch.float64, grad_names, coefficients=True)
    unit = ORACLE_ULPS * U32 * zscale(xs)
    loss_scale = float(coef.sum())
    loss_scale = loss_scale if math.isfinite(loss_scale) else 0.0  # an inf loss must be inf, a NaN one NaN
    tols = {name: old_tols(name) for name in values if name.startswith("metric ")}
    tols.update({"logprobs": (unit, ORACLE_RTOL), "entropy": (unit, ORACLE_RTOL),
                 "loss": (unit * loss_scale, ORACLE_RTOL)})
    # + K times fp32's least normal: an entry c p_v near or below 1e-38 is rounded in absolute terms or underflows
    # to 0 (2^-126 alone failed on a randomized fuzz example: 2.3e-38 in fp64, 0 in fp32)
    tols.update({name: (unit * bound + ORACLE_ULPS * 2.0 ** -126, ORACLE_RTOL)
                 for name, bound in grad_bounds(coef, ent_coef, xs).items()})

    def fallback():
        ref_values, _, _ = _reference_values(fn, leaves, torch.float32, grad_names)
        return ref_values, {name: old_tols(name) for name in ref_values}

    return Expected(values, tols, fallback)


def logits_gradient_bound(logits: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor, ent_coef: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """``(c_t (p_v + 1[v = t]) + |dL/dH_t| p_v |log p_v + H_t|) / tau`` of shape ``logits``: the size of the
    logits gradient's entries (``dL/dlogp_t (1[v = t] - p_v) / tau`` and the entropy term's
    ``-dL/dH_t p_v (log p_v + H_t) / tau``), on which a relative error of the coefficient or of ``p_v`` acts;
    ``p`` is the (fp64) softmax of ``logits / tau``."""
    logp = torch.log_softmax(logits.detach() / temperature, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.where(torch.isfinite(logp), logp, 0.0)).sum(-1, keepdim=True)
    hit = torch.zeros_like(p).scatter_(-1, targets.clamp(min=0).unsqueeze(-1).to(p.device), 1.0)
    bound = coef.unsqueeze(-1) * (p + hit) + ent_coef.unsqueeze(-1) * p * (logp + entropy).abs()
    return torch.nan_to_num(bound / temperature, nan=0.0)


def compare_policy_loss(backend: str, case: PolicyCase, config: PolicyLossConfig, *,
                        token_normalizer=None, tol_scale: float = 1.0, dlogits_atol: float = 0.0,
                        **backend_kwargs) -> None:
    """Loss, logprobs, entropy, metrics and dlogits of ``backend`` against :func:`expected_results`: the fp64
    oracle under its rule for fp32 logits (dlogits: ``M`` of :func:`logits_gradient_bound`), the fp32 reference
    on the same logits for bf16 / fp16. ``tol_scale`` multiplies the fp32-vs-fp32 and 16-bit tolerances (see
    :func:`magnitude_scale`), ``dlogits_atol`` adds to the dlogits' absolute one; the oracle rule scales itself."""
    dtype = case.logits.dtype

    def reference(logits):
        return fused_rl.reference.policy_loss(logits, case.targets, case.advantages, case.mask, config=config,
                                              token_normalizer=token_normalizer, **case.kwargs())

    def old_tols(name):
        atol, rtol = (GRAD_TOLERANCES if name == "dlogits" else TOLERANCES)[dtype]
        return atol * tol_scale + (dlogits_atol if name == "dlogits" else 0.0), rtol * tol_scale

    def zscale(xs):
        x = xs[0].detach().abs()
        return max(1.0, float(torch.where(torch.isfinite(x), x, 0.0).max()) / config.temperature)

    def grad_bounds(coef, ent_coef, xs):
        return {"dlogits": logits_gradient_bound(xs[0], case.targets, coef, ent_coef, config.temperature)}

    expected = expected_results(reference, [case.logits], ["dlogits"], dtype, config.temperature, old_tols, zscale,
                                grad_bounds)
    leaf = same_layout(case.logits).requires_grad_(True)
    assert leaf.stride() == case.logits.stride()
    # in place needs a non-leaf buffer, as model logits are (over a leaf the backends ignore it): a
    # differentiable copy into a buffer of the same layout
    logits = same_layout(leaf).copy_(leaf) if backend_kwargs.get("inplace") else leaf
    got = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=config,
                               token_normalizer=token_normalizer, backend=backend, **case.kwargs(),
                               **backend_kwargs)
    got.loss.backward()
    expected.check("loss", got.loss)
    expected.check("logprobs", got.logprobs)
    assert (got.logprobs <= 0).all(), "a positive log-prob"
    if expected.values["entropy"] is not None:
        assert got.entropy is not None
        expected.check("entropy", got.entropy)
    assert set(got.metrics) == set(k[len("metric "):] for k in expected.values if k.startswith("metric "))
    for name, value in got.metrics.items():
        expected.check(f"metric {name}", value, equal_nan=True)
    assert leaf.grad is not None and leaf.grad.dtype == dtype
    assert torch.isfinite(leaf.grad).all()
    expected.check("dlogits", leaf.grad)


def on_device(case, device):
    """A copy of the (policy or linear) case dataclass with every tensor on ``device``."""
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x
    return dataclasses.replace(case, **{f.name: move(getattr(case, f.name)) for f in dataclasses.fields(case)})


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter from the repository root (an import of ``fused_rl`` there is this
    checkout's), its output captured as text."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=timeout)


def triton_interpreter_reason() -> Optional[str]:
    """Why the Triton kernels cannot run in the CPU interpreter of this installation (None: they can): the triton
    backend's own reasons (Triton missing or older than the kernels need, an interpreter that fails with this
    numpy), whatever ``TRITON_INTERPRET`` the test process has."""
    from fused_rl.backends import triton as triton_backend

    return triton_backend._import_error() or triton_backend._interpreter_error()


def lm_head_inputs(seed: int, tokens: tuple, hidden: int, vocab: int, kind: str = "randn"):
    """fp32 CPU hidden states ``(*tokens, hidden)``, an LM head ``(vocab, hidden)`` and token ids ``tokens``, whose
    logits are of order 3 (``"randn"``), peaked (a few ids far above the rest) or all near ``-60 / tau``
    (``"negative"``: a constant hidden feature against a large negative weight column, a bias folded in)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.4
    if kind == "peaked":
        w[torch.randint(0, vocab, (5,), generator=g)] *= 8.0
    elif kind == "negative":
        h[..., 0] = 1.0
        w[:, 0] = -60.0
    return h, w, torch.randint(0, vocab, tokens, generator=g)


def fused_backends(device: str = "cpu") -> list[str]:
    """Every backend other than the reference that can run on ``device`` in this installation."""
    return [name for name, reason in fused_rl.available_backends(torch.device(device)).items()
            if reason is None and name != "reference"]


def supports(backend: str, dtype: torch.dtype, device: str = "cpu") -> bool:
    from fused_rl.backends import get_backend

    return dtype in get_backend(backend, torch.device(device)).dtypes


#: DPPO's epilogue cases (test_triton / test_native): each side of each trust-region mask, with a KL term, rollout
#: correction, the entropy bonus and the weight's truncation on some; for inputs with ``|logp - old| ~ 0.6``.
DPPO_EPILOGUE_CONFIGS = [
    PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.05, clip_high=0.1),
    PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.08, clip_high=0.03, delta=1.5, kl="k3", beta=0.1,
                     rollout_is="token_truncate", rollout_is_max=1.5),
    PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.02, clip_high=0.05, delta=2.0, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.05, clip_high=0.02, kl="k2+", beta=0.2, kl_clamp=10.0,
                     kl_is_clip=1.2),
]


def assert_dppo_regions_reached(config: PolicyLossConfig, logp: torch.Tensor, old: torch.Tensor,
                                adv: torch.Tensor) -> None:
    """The (valid, off-policy) inputs reach both sides of DPPO's trust-region mask for ``A > 0`` and ``A <= 0``,
    ``dppo_kl``'s ``p <= q`` / ``p >= q`` exemptions beyond its bound, and both sides of ``delta``."""
    if config.policy_loss not in ("dppo_tv", "dppo_kl"):
        return
    p, q = logp.double().exp(), old.double().exp()
    if config.policy_loss == "dppo_tv":
        over_high, over_low = p - q > config.clip_high, p - q < -config.clip_low
    else:
        div = q * (old.double() - logp.double()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        over_high, over_low = div > config.clip_high, div > config.clip_low
        assert (over_high & (p <= q) & (adv > 0)).any() and (over_low & (p >= q) & (adv < 0)).any()
        over_high, over_low = over_high & (p > q), over_low & (p < q)
    for side, over in ((adv > 0, over_high), (adv <= 0, over_low)):
        assert (side & over).any() and (side & ~over).any()
    if config.delta is not None:
        r = (logp - old).exp()
        assert (r > config.delta).any() and (r < config.delta).any()


#: DPPO's binary KL where ``p ~ 1``: ``logp = -1e-7`` (as fp32 ``exp`` rounds it, ``1 - p`` ~1.2e-7), ``q = exp(-0.5)``:
#: ``D`` ~5.6 with the ``1e-8`` smoothing of ``1 - p`` (~4.7 with ``1e-6``), so bounds 5.2 drop the ``A > 0`` token
#: (``p > q``) and keep the ``A < 0`` one (``p >= q`` exempts it): slopes ``0`` and ``-w A = exp(0.5 - 1e-7)``.
DPPO_NEAR_ONE = dict(logp=[-1e-7, -1e-7], old=[-0.5, -0.5], adv=[1.0, -1.0],
                     config=PolicyLossConfig(policy_loss="dppo_kl", clip_low=5.2, clip_high=5.2),
                     slopes=[0.0, math.exp(0.5 - 1e-7)])

#: DPPO's binary KL at ``p = 1`` exactly (``logp = 0``): only the ``1e-8`` smoothing keeps ``log((1 - q) / (1 - p))``
#: finite, and with it ``D`` (~6.6 <= the bounds 10; ``DPPO_NEAR_ONE``'s ``p`` rounds the same without the
#: smoothing): kept, slope ``-r A``.
DPPO_AT_ONE = dict(logp=[0.0], old=[-0.5], adv=[1.0],
                   config=PolicyLossConfig(policy_loss="dppo_kl", clip_low=10.0, clip_high=10.0),
                   slopes=[-math.exp(0.5)])

#: Ratios exactly at a bound (``expf(logp - old)`` equals it in fp32), ``A = -1``: dual_clip's ``min(.., -c A)``
#: ties its other side at ``r = c`` and splits the gradient in half (torch.minimum's rule: slope ``0.5 r``); TRL's
#: two-sided ``min(r, delta)`` passes it at ``r = delta`` (torch.clamp's closed bound: slope ``r``).
EPILOGUE_TIES = [
    dict(config=PolicyLossConfig(dual_clip=3.0, clip_low=0.2, clip_high=0.28), logp=float.fromhex("-0x1.cd82bp-1"),
         old=-2.0, adv=-1.0, loss=3.0, slope=1.5),
    dict(config=PolicyLossConfig(clip_high=0.28, delta=1.4), logp=float.fromhex("-0x1.53b9eap-1"), old=-1.0,
         adv=-1.0, loss=torch.tensor(1.4).item(), slope=torch.tensor(1.4).item()),
]


def check_token_logprobs_inplace(backend: str, shape: tuple = (3, 5, 1000), dtype=torch.float32,
                                 temperature: float = 0.7, device: str = "cpu") -> None:
    """``token_logprobs(inplace=True)`` with upstream gradients of both outputs: the logits (a non-leaf buffer) are
    intact after the forward and hold, after the backward, the out-of-place gradient bit for bit (what reaches the
    leaf they came from); a ``-100`` target's row is zero. The reference, which does not write in place, leaves them
    intact."""
    g = torch.Generator().manual_seed(4)
    x0 = make_logits(shape, kind="peaked", dtype=dtype, generator=g).to(device)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets.view(-1)[1] = fused_rl.IGNORE_INDEX
    targets = targets.to(device)
    g_logp, g_ent = (torch.randn(shape[:-1], generator=g).to(device) for _ in range(2))

    def backward(x, inplace):
        logp, ent = fused_rl.token_logprobs(x, targets, temperature=temperature, return_entropy=True,
                                            backend=backend, inplace=inplace)
        assert torch.equal(x.detach(), x0)  # nothing written in the forward
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()

    expected = x0.clone().requires_grad_(True)
    backward(expected, False)
    leaf = x0.clone().requires_grad_(True)
    buf = leaf * 1  # a model output: non-leaf
    backward(buf, True)
    assert torch.equal(leaf.grad, expected.grad)
    writes = backend != "reference"
    assert torch.equal(buf.detach(), leaf.grad if writes else x0)
    assert torch.all(leaf.grad.view(-1, shape[-1])[1] == 0)


@contextlib.contextmanager
def peer_modules(*packages: str):
    """Modules of ``packages`` (top-level names: a peer's stand-ins and what was loaded under them) imported inside
    the block are dropped after it and those present before restored: a stand-in ``verl`` package left in
    ``sys.modules`` would be found by the next test's imports."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in packages}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in packages]:
            del sys.modules[name]
        sys.modules.update(saved)
