"""Shared test inputs and comparisons against the reference.

Every backend test draws its inputs here so that all of them see the hard cases: vocabularies that
are not a multiple of any block, peaked rows (one logit far above the rest), all-negative rows
(``randn - 30``: a kernel whose running max starts at 0 gets these wrong), all-masked rows,
length-1 responses, and ``IGNORE_INDEX`` targets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

import fused_rl
from fused_rl import PolicyLossConfig

LOGIT_KINDS = ("randn", "peaked", "negative")

#: (atol, rtol) for backend-vs-reference comparisons per input dtype. bf16/fp16 backends are compared
#: with the fp32 reference evaluated on the *same* rounded inputs, so only accumulation error remains.
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
    ``negative`` (``randn - 30``, every logit far below 0)."""
    x = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    if kind == "peaked":
        idx = torch.randint(0, shape[-1], shape[:-1] + (1,), generator=generator)
        x.scatter_add_(-1, idx, torch.full(idx.shape, 25.0))
    elif kind == "negative":
        x = x - 30.0
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


def compare_policy_loss(backend: str, case: PolicyCase, config: PolicyLossConfig, *,
                        token_normalizer=None, tol_scale: float = 1.0, dlogits_atol: float = 0.0,
                        **backend_kwargs) -> None:
    """Loss, logprobs, entropy, metrics and dlogits of ``backend`` against the fp32 reference on the
    same (possibly bf16) logits; ``tol_scale`` multiplies the tolerances (see :func:`magnitude_scale`),
    ``dlogits_atol`` adds to the dlogits' absolute one."""
    dtype = case.logits.dtype
    ref_logits = case.logits.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
    ref_logits.requires_grad_(True)
    expected = fused_rl.reference.policy_loss(ref_logits, case.targets, case.advantages, case.mask,
                                              config=config, token_normalizer=token_normalizer, **case.kwargs())
    expected.loss.backward()
    leaf = same_layout(case.logits).requires_grad_(True)
    assert leaf.stride() == case.logits.stride()
    # in place needs a non-leaf buffer, as model logits are (over a leaf the backends ignore it): a
    # differentiable copy into a buffer of the same layout
    logits = same_layout(leaf).copy_(leaf) if backend_kwargs.get("inplace") else leaf
    got = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=config,
                               token_normalizer=token_normalizer, backend=backend, **case.kwargs(),
                               **backend_kwargs)
    got.loss.backward()
    k = tol_scale
    assert_close(got.loss, expected.loss, dtype, "loss", scale=k)
    assert_close(got.logprobs, expected.logprobs, dtype, "logprobs", scale=k)
    assert (got.logprobs <= 0).all(), "a positive log-prob"
    if expected.entropy is not None:
        assert got.entropy is not None
        assert_close(got.entropy, expected.entropy, dtype, "entropy", scale=k)
    assert set(got.metrics) == set(expected.metrics)
    for name, value in expected.metrics.items():
        assert_close(got.metrics[name], value, dtype, f"metric {name}", scale=k, equal_nan=True)
    assert leaf.grad is not None and leaf.grad.dtype == dtype
    assert torch.isfinite(leaf.grad).all()
    assert_close(leaf.grad, ref_logits.grad, dtype, "dlogits", grad=True, scale=k, extra_atol=dlogits_atol)


def on_device(case, device):
    """A copy of the (policy or linear) case dataclass with every tensor on ``device``."""
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x
    return dataclasses.replace(case, **{f.name: move(getattr(case, f.name)) for f in dataclasses.fields(case)})


def fused_backends(device: str = "cpu") -> list[str]:
    """Every backend other than the reference that can run on ``device`` in this installation."""
    return [name for name, reason in fused_rl.available_backends(torch.device(device)).items()
            if reason is None and name != "reference"]


def supports(backend: str, dtype: torch.dtype, device: str = "cpu") -> bool:
    from fused_rl.backends import get_backend

    return dtype in get_backend(backend, torch.device(device)).dtypes
