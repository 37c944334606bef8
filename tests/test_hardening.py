"""Differential fuzzing of every available backend against the reference, extreme values, scale
limits of the indexing, determinism, and no writes to caller tensors on error."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.config import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from helpers import PolicyCase, compare_policy_loss, fused_backends, magnitude_scale, supports

BACKENDS = fused_backends()
#: Triton's interpreter runs every program in Python: fewer examples there.
EXAMPLES = {"triton": 6}


@st.composite
def configs(draw):
    policy = draw(st.sampled_from(POLICY_LOSSES))
    kl = draw(st.sampled_from(KL_ESTIMATORS))
    agg = draw(st.sampled_from(AGGREGATIONS))
    return PolicyLossConfig(
        policy_loss=policy, kl=kl, agg=agg,
        beta=draw(st.sampled_from([0.0, 0.05, 1.0])) if kl else 0.0,
        clip_low=draw(st.sampled_from([0.0, 0.1, 0.2])), clip_high=draw(st.sampled_from([0.0, 0.2, 0.28, 4.0])),
        dual_clip=draw(st.sampled_from([None, 3.0])) if policy in ("ppo_clip", "gspo") else None,
        max_len=draw(st.sampled_from([None, 12])) if agg == "seq-mean-token-sum-norm" else None,
        temperature=draw(st.sampled_from([1.0, 0.3, 1.7])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, -0.1])),
    )


@st.composite
def cases(draw, dtype):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    V = draw(st.sampled_from([2, 3, 17, 255, 257, 1000]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["randn", "huge", "identical", "neg_inf", "negative"]))
    z = torch.randn(B, T, V, generator=g) * 3
    if kind == "huge":
        z = z * 3000  # |z| up to ~1e4
    elif kind == "identical":
        z = torch.full((B, T, V), draw(st.sampled_from([0.0, -50.0, 7.5])))
    elif kind == "negative":
        z = z - 1000.0
    targets = torch.randint(0, V, (B, T), generator=g)
    if kind == "neg_inf" and V > 2:
        blocked = torch.rand(B, T, V, generator=g) < 0.5
        blocked.scatter_(-1, targets.unsqueeze(-1), False)  # the sampled token is never impossible
        z = z.masked_fill(blocked, float("-inf"))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    pos = torch.arange(T).unsqueeze(0)
    left = draw(st.booleans())
    mask = pos >= (T - lengths).unsqueeze(1) if left else pos < lengths.unsqueeze(1)
    adv = torch.randn((B, T) if draw(st.booleans()) else (B,), generator=g)
    logits = z.to(dtype)
    with torch.no_grad():
        lp = fused_rl.reference.token_logprobs(logits, targets, check_inputs=False)
    spread = draw(st.sampled_from([0.0, 0.3, 2.0]))
    old = (lp + spread * torch.randn(B, T, generator=g)) if draw(st.booleans()) else None
    ref = lp + spread * torch.randn(B, T, generator=g)
    if old is not None:
        old = torch.where(mask, old, torch.zeros_like(old))
    ref = torch.where(mask, ref, torch.zeros_like(ref))
    return PolicyCase(logits, targets, adv, mask, old, torch.where(torch.isfinite(ref), ref, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_differential_fuzz(backend, dtype):
    if not supports(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")

    @settings(max_examples=EXAMPLES.get(backend, 40), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(dtype), config=configs())
    def check(case, config):
        out = fused_rl.reference.policy_loss(case.logits.float(), case.targets, case.advantages, case.mask,
                                             config=config, **case.kwargs())
        if not torch.isfinite(out.loss):
            return  # e.g. k3 of a 1e4 log-ratio overflows in the reference too: nothing to compare
        compare_policy_loss(backend, case, config, tol_scale=magnitude_scale(case.logits, config.temperature))

    check()


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_deterministic(backend):
    from helpers import make_case

    case = make_case(vocab=1000, seed=9)
    cfg = PolicyLossConfig(kl="k3", beta=0.1, entropy_coef=0.01)
    results = []
    for _ in range(2):
        x = case.logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=cfg, backend=backend,
                                   **case.kwargs())
        out.loss.backward()
        results.append((out.loss, out.logprobs, out.entropy, x.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_nothing_written_on_error(backend):
    from helpers import make_case

    case = make_case(vocab=100, seed=1)
    logits = case.logits.clone()
    before = logits.clone()
    bad = case.advantages.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="advantages contain NaN"):
        fused_rl.policy_loss(logits, case.targets, bad, case.mask, backend=backend, inplace=True, **case.kwargs())
    assert torch.equal(logits, before)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"] + ["reference"])
def test_more_rows_than_a_grid_dimension(backend):
    """N = 70,000 > 65,535 rows (a kernel launching one program per token along grid y/z breaks)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 70_000, 8, generator=g)
    targets = torch.randint(0, 8, (1, 70_000), generator=g)
    got = fused_rl.token_logprobs(logits, targets, backend=backend)
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_beyond_int32(backend):
    """Two rows 2^31 + 3 elements apart in one storage (a strided view; untouched pages cost nothing):
    any int32 offset arithmetic reads the wrong row."""
    V, gap = 1000, 2**31 + 3
    storage = torch.empty(gap + V, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(2, V, generator=g) * 2).to(torch.bfloat16)
    storage[:V] = rows[0]
    storage[gap:gap + V] = rows[1]
    logits = storage.as_strided((1, 2, V), (gap + V, gap, 1))
    targets = torch.tensor([[5, 17]])
    got = fused_rl.token_logprobs(logits, targets, backend=backend)
    expected = torch.log_softmax(rows.float(), -1).gather(-1, targets.view(2, 1)).view(1, 2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
