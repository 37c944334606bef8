"""Differential fuzzing of the fused linear policy loss (``fused_rl.linear_policy_loss``) of every fused
backend against the reference (full fp32 logits, ``log_softmax``, loss math, autograd): hypothesis draws
the config from every field of ``PolicyLossConfig`` (all policy losses, KL estimators and aggregations,
dual clip, ``delta``, the KL bias correction, rollout correction, the off-policy mask, the top-entropy
quantile, truncated completions, temperature, entropy bonus), the shapes (vocabularies off the kernels'
blocks, length-1 and all-masked rows, left or right padding), bias or none, a frozen weight, a token
normalizer, fp32 / bf16 / fp16 inputs, the tile size, gathered or fixed-slice tiles and, for 16-bit
inputs, the GEMM mode (the mixed one emulated on CPU). Loss, log-probs, entropy, every metric and all
three gradients are compared by ``test_linear.compare_linear`` (fp32: with the fp64 oracle under the rule of
``helpers.expected_results``; 16-bit: with the fp32 reference, plus the mixed mode's rounding bound where it
runs). CUDA parameters (marked ``cuda``) where a GPU is present."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.backends import tiled_linear, torch_linear
from helpers import fused_backends, on_device, supports
from strategies import (configs, cov_choice_is_a_tie, entropy_choice_is_a_tie, fit_inputs, fuzz_settings,
                        loss_tokens, ratio_at_a_bound)
from test_linear import LinearCase, compare_linear

CUDA_BACKENDS = fused_backends("cuda") if torch.cuda.is_available() else []
PARAMS = [pytest.param(b, "cpu", id=b) for b in fused_backends()] + [
    pytest.param(b, "cuda", id=f"{b}-cuda", marks=pytest.mark.cuda) for b in CUDA_BACKENDS]
#: Triton's interpreter runs every program in Python, and on a GPU every new config compiles.
EXAMPLES = {("triton", "cpu"): 6, ("triton", "cuda"): 12}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@st.composite
def linear_cases(draw, dtype) -> LinearCase:
    """A case whose ``old`` / ``ref`` / ``rollout`` hold only the noise around the log-probs: :func:`_fits`
    adds the log-probs at the config's temperature."""
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    H = draw(st.sampled_from([8, 24]))
    V = draw(st.sampled_from([2, 17, 257, 1000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)
    bias = torch.randn(V, generator=g) if draw(st.booleans()) else None
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    pos = torch.arange(T).unsqueeze(0)
    mask = pos >= (T - lengths).unsqueeze(1) if draw(st.booleans()) else pos < lengths.unsqueeze(1)
    hidden = torch.where(mask.unsqueeze(-1), hidden, torch.full_like(hidden, float("nan")))  # padding unread
    adv = torch.randn((B, T) if draw(st.booleans()) else (B,), generator=g)
    cast = lambda x: None if x is None else x.to(dtype)
    # not 0: with a zero clip bound, r = 1 +- 1 ulp would put a token on either side of it depending on how
    # a backend rounds its log-probs (as in test_hardening's GPU cases)
    spread = draw(st.sampled_from([0.01, 0.3, 2.0]))
    noise = lambda: torch.where(mask, spread * torch.randn(B, T, generator=g), torch.zeros(B, T))
    old = noise() if draw(st.booleans()) else None
    truncated = torch.rand(B, generator=g) < 0.3
    return LinearCase(cast(hidden), cast(weight), cast(bias), targets, adv, mask, old, noise(), rollout=noise(),
                      truncated=truncated)


def _fits(config: PolicyLossConfig, case: LinearCase) -> LinearCase:
    """The case with old / ref / rollout log-probs as the log-probs of the (rounded) inputs at the config's
    temperature plus the case's noise, and just the inputs ``config`` reads (``strategies.fit_inputs``)."""
    bias = None if case.bias is None else case.bias.float()
    with torch.no_grad():
        lp = fused_rl.reference.linear_token_logprobs(torch.nan_to_num(case.hidden.float()), case.weight.float(),
                                                      case.targets, bias=bias, temperature=config.temperature,
                                                      check_inputs=False)
    lp = torch.where(case.mask, lp, torch.zeros_like(lp))
    shift = lambda noise: None if noise is None else (lp + noise).clamp(max=0.0)  # still log-probs
    return fit_inputs(config, dataclasses.replace(case, old=shift(case.old), ref=shift(case.ref),
                                                  rollout=shift(case.rollout)))


@pytest.mark.parametrize("backend, device", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_linear_differential_fuzz(backend, device, dtype):
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")

    @fuzz_settings(EXAMPLES.get((backend, device), 150), HealthCheck.data_too_large, HealthCheck.filter_too_much)
    @given(case=linear_cases(dtype), config=configs(), tile=st.sampled_from([None, 1, 3, 7]),
           gather=st.sampled_from([None, False]), mode=st.sampled_from([None, "mixed"]), frozen=st.booleans(),
           normalizer=st.sampled_from([None, 5.0, 2.0 ** 20]), entropy=st.booleans())
    def check(case, config, tile, gather, mode, frozen, normalizer, entropy):
        case = _fits(config, case)
        with torch.no_grad():
            ref_logp, ref_entropy = fused_rl.reference.linear_token_logprobs(
                torch.nan_to_num(case.hidden.float()), case.weight.float(), case.targets,
                bias=None if case.bias is None else case.bias.float(), temperature=config.temperature,
                return_entropy=True, check_inputs=False)
        tokens = loss_tokens(case)
        if entropy_choice_is_a_tie(ref_entropy, tokens, config, 1e-5) \
                or ratio_at_a_bound(config, ref_logp, case.old, tokens, 1e-5) \
                or cov_choice_is_a_tie(config, ref_logp, case.advantages, tokens, 1e-5):
            return
        normalizer = normalizer if config.agg == "token-mean" else None  # the others refuse one
        saved = (tiled_linear.CHUNK_TOKENS, torch_linear.CHUNK_TOKENS, torch_linear.GATHER_VALID,
                 tiled_linear.GEMM_MODE)
        try:
            tiled_linear.CHUNK_TOKENS = torch_linear.CHUNK_TOKENS = tile
            torch_linear.GATHER_VALID = gather
            tiled_linear.GEMM_MODE = mode
            compare_linear(on_device(case, device), config, frozen_weight=frozen, token_normalizer=normalizer,
                           compute_entropy=entropy, backend=backend)
        finally:
            (tiled_linear.CHUNK_TOKENS, torch_linear.CHUNK_TOKENS, torch_linear.GATHER_VALID,
             tiled_linear.GEMM_MODE) = saved

    check()
