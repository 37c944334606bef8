"""Differential fuzzing of every available backend against the reference, extreme values, scale
limits of the indexing, determinism, and no writes to caller tensors on error.

Each test runs every fused backend of this installation on CPU tensors and, where a GPU is present,
every fused backend of the GPU on CUDA tensors (those parameters carry ``pytest.mark.cuda``, which
``bench/gpu_check.sh`` selects): inputs are built on the CPU and moved, results compared on the CPU."""

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.config import KL_ESTIMATORS
from fused_rl.loss_math import per_token_loss
from helpers import (PolicyCase, assert_close, compare_policy_loss, fused_backends, magnitude_scale, on_device,
                     supports)
from strategies import (configs, cov_choice_is_a_tie, entropy_choice_is_a_tie, fit_inputs, fuzz_settings,
                        loss_tokens, ratio_at_a_bound)

BACKENDS = fused_backends()
CUDA_BACKENDS = fused_backends("cuda") if torch.cuda.is_available() else []


def on(backends, cuda_backends=None):
    """``(backend, device)`` parameters: ``backends`` on "cpu", then ``cuda_backends`` (default: every
    fused GPU backend) on "cuda", marked ``cuda``."""
    cuda_backends = CUDA_BACKENDS if cuda_backends is None else cuda_backends
    return [pytest.param(b, "cpu", id=b) for b in backends] + [
        pytest.param(b, "cuda", id=f"{b}-cuda", marks=pytest.mark.cuda) for b in cuda_backends]


#: Triton's interpreter runs every program in Python, and on a GPU every new config compiles: fewer
#: examples there.
EXAMPLES = {("triton", "cpu"): 6, ("triton", "cuda"): 16}


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
    # not 0: with a zero clip bound, r = 1 +- 1 ulp would put a token on either side of it depending on how
    # a backend rounds its log-probs (the reference's vs the CPU-built old ones; found on the CPU too)
    spread = draw(st.sampled_from([0.01, 0.3, 2.0]))
    noisy = lambda: (lp + spread * torch.randn(B, T, generator=g)).clamp(max=0.0)  # still log-probs
    old = noisy() if draw(st.booleans()) else None
    ref = noisy()
    if old is not None:
        old = torch.where(mask, old, torch.zeros_like(old))
    ref = torch.where(mask, ref, torch.zeros_like(ref))
    finite = lambda x: torch.where(torch.isfinite(x), x, 0.0)
    rollout = torch.where(mask, noisy(), torch.zeros_like(lp))
    return PolicyCase(logits, targets, adv, mask, old, finite(ref), rollout=finite(rollout),
                      truncated=torch.rand(B, generator=g) < 0.3)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_differential_fuzz(backend, device, dtype):
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")

    @fuzz_settings(EXAMPLES.get((backend, device), 40), HealthCheck.data_too_large)
    @given(case=cases(dtype), config=configs())
    def check(case, config):
        case = fit_inputs(config, case)
        x = case.logits.float().requires_grad_(True)
        out = fused_rl.reference.policy_loss(x, case.targets, case.advantages, case.mask, config=config,
                                             **case.kwargs())
        if not torch.isfinite(out.loss):
            return  # e.g. k3 of a 1e4 log-ratio overflows in the reference too: nothing to compare
        scale = magnitude_scale(case.logits, config.temperature)
        tokens = loss_tokens(case)
        if entropy_choice_is_a_tie(out.entropy, tokens, config, 1e-5 * scale) \
                or ratio_at_a_bound(config, out.logprobs, case.old, tokens, 1e-5 * scale) \
                or cov_choice_is_a_tie(config, out.logprobs, case.advantages, tokens, 1e-5 * scale):
            return
        out.loss.backward()
        # a near-certain target's 1 - p carries the rounding of d = (z - m) - log s, a few |z| 2^-24, times
        # its coefficient (at most max |dlogits|): beyond magnitude_scale's relative model when |z| ~ 1e3 and
        # a batch of 1-3 tokens makes the coefficient ~1 (reference and kernels alike)
        z_max = float(torch.nan_to_num(case.logits.detach().float().abs(), posinf=0.0).max()) / config.temperature
        dlogits_atol = float(torch.nan_to_num(x.grad.abs()).max()) * z_max * 2.0 ** -22
        compare_policy_loss(backend, on_device(case, device), config, tol_scale=scale, dlogits_atol=dlogits_atol)

    check()


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_differential_fuzz(backend, device, dtype):
    """``token_logprobs`` (the stats pass and the separate gradient pass) against the reference on the same
    draws, with random upstream gradients of both outputs (a masked-out ``IGNORE_INDEX`` target included):
    log-probs, entropies and the logits gradient."""
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")

    @fuzz_settings(EXAMPLES.get((backend, device), 40), HealthCheck.data_too_large)
    @given(case=cases(dtype), temperature=st.sampled_from([1.0, 0.3, 1.7]), seed=st.integers(0, 2**16))
    def check(case, temperature, seed):
        g = torch.Generator().manual_seed(seed)
        targets = torch.where(case.mask, case.targets, torch.full_like(case.targets, fused_rl.IGNORE_INDEX))
        g_logp, g_ent = torch.randn(targets.shape, generator=g), torch.randn(targets.shape, generator=g)
        x_ref = case.logits.detach().float().requires_grad_(True)
        lp_ref, ent_ref = fused_rl.token_logprobs(x_ref, targets, temperature=temperature, return_entropy=True,
                                                  backend="reference")
        if not (torch.isfinite(lp_ref).all() and torch.isfinite(ent_ref).all()):
            return  # a row of only -inf: NaN on every backend (test_undefined_rows_token_logprobs)
        ((lp_ref * g_logp).sum() + (ent_ref * g_ent).sum()).backward()
        x = case.logits.detach().to(device).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(x, targets.to(device), temperature=temperature, return_entropy=True,
                                          backend=backend)
        ((lp * g_logp.to(device)).sum() + (ent * g_ent.to(device)).sum()).backward()
        scale = magnitude_scale(case.logits, temperature)
        z_max = float(torch.nan_to_num(case.logits.float().abs(), posinf=0.0).max()) / temperature
        extra = float(x_ref.grad.abs().max()) * z_max * 2.0 ** -22  # as in test_differential_fuzz
        assert_close(lp.cpu(), lp_ref, dtype, "logprobs", scale=scale)
        assert_close(ent.cpu(), ent_ref, dtype, "entropy", scale=scale)
        assert (lp <= 0).all() and (ent >= 0).all()
        assert_close(x.grad.cpu(), x_ref.grad, dtype, "dlogits", grad=True, scale=scale, extra_atol=extra)

    check()


@pytest.mark.parametrize("backend, device", on(BACKENDS + ["reference"]))
def test_deterministic(backend, device):
    from helpers import make_case

    case = on_device(make_case(vocab=1000, seed=9), device)
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


@pytest.mark.parametrize("backend, device", on(BACKENDS + ["reference"]))
def test_nothing_written_on_error(backend, device):
    from helpers import make_case

    case = on_device(make_case(vocab=100, seed=1), device)
    logits = case.logits.clone()
    before = logits.clone()
    bad = case.advantages.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="advantages contain NaN"):
        fused_rl.policy_loss(logits, case.targets, bad, case.mask, backend=backend, inplace=True, **case.kwargs())
    assert torch.equal(logits, before)


@pytest.mark.parametrize("backend, device", on([b for b in BACKENDS if b != "triton"] + ["reference"]))
def test_more_rows_than_a_grid_dimension(backend, device):
    """N = 70,000 > 65,535 rows (a kernel launching one program per token along grid y/z breaks; the
    Triton interpreter is too slow for it: triton runs here on the GPU only)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 70_000, 8, generator=g).to(device)
    targets = torch.randint(0, 8, (1, 70_000), generator=g).to(device)
    got = fused_rl.token_logprobs(logits, targets, backend=backend)
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_offsets_beyond_int32(backend, device):
    """Two rows 2^31 + 3 elements apart in one storage (a strided view; untouched pages cost nothing on
    the CPU, 4.3 GB on a GPU): any int32 offset arithmetic reads the wrong row."""
    V, gap = 1000, 2**31 + 3
    storage = torch.empty(gap + V, dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(2, V, generator=g) * 2).to(torch.bfloat16)
    storage[:V] = rows[0]
    storage[gap:gap + V] = rows[1]
    logits = storage.as_strided((1, 2, V), (gap + V, gap, 1))
    targets = torch.tensor([[5, 17]])
    got = fused_rl.token_logprobs(logits, targets.to(device), backend=backend).cpu()
    expected = torch.log_softmax(rows.float(), -1).gather(-1, targets.view(2, 1)).view(1, 2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- undefined rows
# A valid row whose softmax is undefined (a NaN or +inf logit, or every logit -inf) has NaN logp, entropy,
# per-token loss (so a NaN summed loss) and an all-NaN dlogits row on every backend, as log_softmax of the
# reference gives; -inf entries of an otherwise finite row are p = 0 and nothing more; the other rows keep
# the reference's values and a masked row is never read (NaN there changes nothing, its gradient is 0).
UNDEFINED_KINDS = ("nan", "inf_other", "inf_target", "all_neg_inf")
UNDEFINED_BACKENDS = on(["reference"] + BACKENDS)
UNDEFINED_CONFIGS = [
    PolicyLossConfig(),  # on-policy ppo_clip: r = 1 whatever logp is
    PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl="low_var_kl", beta=0.1, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),  # two-pass
]
BAD = (1, 1)  # the undefined row; (1, 2) is masked and NaN, (0, 1) has legitimate -inf entries


def _undefined_ids(c):
    return f"{c.policy_loss}-dual{c.dual_clip}-{c.kl}"


@pytest.fixture(params=["rows", "split"])
def small_triton_blocks(request, monkeypatch):
    """Several vocabulary blocks per row in the Triton kernels (the bad entry in a later block); the single pass
    as the row kernel and with the rows split over programs of 16 columns (``SPLIT_CHUNK``: the bad entry in
    another program than the target's), for the triton backend (the split variant of the others skips)."""
    if request.param == "split" and request.node.callspec.params.get("backend") != "triton":
        pytest.skip("the split single pass is the triton backend's")
    if "triton" in BACKENDS + CUDA_BACKENDS:
        from fused_rl.kernels import logits as K

        monkeypatch.setattr(K, "MAX_BLOCK_V", 16)
        monkeypatch.setattr(K, "SPLIT_CHUNK", None if request.param == "rows" else 16)


def _make_undefined(x: torch.Tensor, targets: torch.Tensor, kind: str, row=BAD) -> None:
    """Makes ``x[row]`` undefined in place (``x`` (..., V), the entry away from the target in a later block)."""
    t = int(targets[row])
    other = (t + 20) % x.shape[-1]
    if kind == "nan":
        x[row][other] = float("nan")
    elif kind == "inf_other":
        x[row][other] = float("inf")
    elif kind == "inf_target":
        x[row][t] = float("inf")
    elif kind == "all_neg_inf":
        x[row].fill_(float("-inf"))
    else:
        raise ValueError(kind)


def _undefined_case(kind: str, off_policy: bool = False):
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 37
    x = torch.randn(B, T, V, generator=g) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    x[0, 1, (targets[0, 1] + 1 + torch.arange(10)) % V] = float("-inf")  # legitimate p = 0 entries
    _make_undefined(x, targets, kind)
    x[1, 2] = float("nan")  # masked: never read
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        clean = torch.where(torch.isnan(x) | (x == float("inf")), torch.zeros_like(x), x)
        lp = fused_rl.reference.token_logprobs(clean, targets, check_inputs=False)
    lp = torch.where(torch.isfinite(lp), lp, -5.0)
    old = (lp + 0.3 * torch.randn(B, T, generator=g)) if off_policy else None
    ref = lp + 0.5 * torch.randn(B, T, generator=g)
    adv = torch.tensor([0.7, -1.3])
    return PolicyCase(x, targets, adv, mask, old, ref)


def _close_nan(actual, expected, dtype, what, grad=False):
    """``assert_close`` of the helpers with NaN == NaN (the undefined row's entries)."""
    from helpers import GRAD_TOLERANCES, TOLERANCES

    atol, rtol = (GRAD_TOLERANCES if grad else TOLERANCES)[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("config", UNDEFINED_CONFIGS, ids=_undefined_ids)
@pytest.mark.parametrize("kind", UNDEFINED_KINDS)
@pytest.mark.parametrize("backend, device", UNDEFINED_BACKENDS)
def test_undefined_row_policy_loss(backend, device, kind, config, small_triton_blocks):
    case = _undefined_case(kind, off_policy=config.dual_clip is not None)
    # on-policy, the all -inf row's target logit is -inf: the value checks refuse it (test_validation); here the
    # kernels' own handling of the row, as with check_inputs=False
    checks = dict(check_inputs=not (kind == "all_neg_inf" and case.old is None))
    kwargs = dict(old_logprobs=case.old, ref_logprobs=case.ref if config.kl else None, **checks)
    ref_x = case.logits.clone().requires_grad_(True)
    expected = fused_rl.reference.policy_loss(ref_x, case.targets, case.advantages, case.mask, config=config,
                                              compute_entropy=True, **kwargs)
    expected.loss.backward()
    dev = on_device(case, device)
    x = dev.logits.clone().requires_grad_(True)
    out = fused_rl.policy_loss(x, dev.targets, dev.advantages, dev.mask, config=config, compute_entropy=True,
                               backend=backend, old_logprobs=dev.old, ref_logprobs=dev.ref if config.kl else None,
                               **checks)
    out.loss.backward()
    loss, logprobs, entropy, grad = (t.cpu() for t in (out.loss, out.logprobs, out.entropy, x.grad))
    assert torch.isnan(loss)
    assert torch.isnan(logprobs[BAD]) and torch.isnan(entropy[BAD])
    assert torch.isnan(grad[BAD]).all(), grad[BAD]
    assert (grad[1, 2] == 0).all()  # the masked NaN row
    assert torch.isfinite(grad[0]).all()  # the other sequence (gspo: the bad row's sequence is all NaN)
    valid = case.mask.clone()
    valid[BAD] = False
    assert torch.isfinite(logprobs[valid]).all() and torch.isfinite(entropy[valid]).all()
    dtype = case.logits.dtype
    _close_nan(logprobs, expected.logprobs, dtype, "logprobs")
    _close_nan(entropy, expected.entropy, dtype, "entropy")
    _close_nan(grad, ref_x.grad, dtype, "dlogits", grad=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("config", UNDEFINED_CONFIGS, ids=_undefined_ids)
@pytest.mark.parametrize("backend, device", UNDEFINED_BACKENDS)
def test_nan_in_masked_rows_changes_nothing(backend, device, config, small_triton_blocks):
    """NaN / +inf logits at masked positions and IGNORE_INDEX targets: the same loss, log-probs, entropy
    and gradient as with finite logits there, and a zero gradient there."""
    case = _undefined_case("nan", off_policy=config.dual_clip is not None)
    case.targets[0, 2] = fused_rl.IGNORE_INDEX
    clean = case.logits.clone()
    _make_undefined(clean, case.targets, "inf_other", row=(1, 2))  # masked garbage of another kind
    clean[BAD] = torch.randn(clean.shape[-1])
    dirty = clean.clone()
    dirty[1, 2] = float("nan")
    dirty[0, 2] = float("nan")
    case, clean, dirty = on_device(case, device), clean.to(device), dirty.to(device)
    kwargs = dict(old_logprobs=case.old, ref_logprobs=case.ref if config.kl else None)
    outs = []
    for logits in (clean, dirty):
        x = logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=config, compute_entropy=True,
                                   backend=backend, **kwargs)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
        assert (x.grad[1, 2] == 0).all() and (x.grad[0, 2] == 0).all()
        outs.append((out.loss, out.logprobs, out.entropy, x.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend, device", UNDEFINED_BACKENDS)
def test_undefined_rows_token_logprobs(backend, device, dtype, monkeypatch):
    """``token_logprobs`` over rows of 2 full C++ blocks and a tail (Triton: 1024-entry blocks), the bad
    entry in each place a kernel could miss it; the gradient of an undefined row is NaN even where its
    upstream gradient is 0 (autograd of log_softmax: 0 * NaN)."""
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")
    if backend == "triton":
        from fused_rl.kernels import logits as K

        monkeypatch.setattr(K, "MAX_BLOCK_V", 1024)
    V = 2 * 2048 + 5
    g = torch.Generator().manual_seed(11)
    rows = []
    def row(fill=None):
        r = torch.randn(V, generator=g) * 2 if fill is None else torch.full((V,), fill)
        rows.append(r)
        return r
    inf, nan = float("inf"), float("nan")
    r = row(); r[:2048] = -inf; r[700] = nan                # NaN in an all -inf first block (skipped block)
    r = row(); r[-1] = nan                                  # NaN in the tail
    r = row(); r[3000] = inf                                # +inf in the second block
    r = row(); r[8] = inf; r[16] = -inf                     # +inf paired with a -inf
    row(-inf)                                               # every entry -inf
    r = row(-inf); r[4100] = nan                            # NaN and -inf only
    r = row(); r[5] = nan                                   # NaN at the target (5)
    r = row(); r[:2048] = -inf                              # defined: a first block of -inf
    r = row(); r[::3] = -inf                                # defined: scattered -inf
    row()                                                   # defined
    row(nan)                                                # IGNORE_INDEX target: never read
    bad = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    logits = torch.stack(rows).view(1, -1, V).to(dtype)
    n = logits.shape[1]
    targets = torch.randint(2048, V - 1, (1, n), generator=g)
    targets[0, 6] = 5
    targets[0, -1] = fused_rl.IGNORE_INDEX
    g_lp = torch.randn(1, n, generator=g)
    g_h = torch.randn(1, n, generator=g)
    g_lp[0, 0] = g_h[0, 0] = 0.0  # an undefined row with a zero upstream gradient
    results = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        x = logits.detach().clone().float().requires_grad_(True) if be == "reference" else \
            logits.detach().to(dev, copy=True).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(x, targets.to(dev), return_entropy=True, backend=be)
        (lp * g_lp.to(dev) + ent * g_h.to(dev)).sum().backward()
        results.append((lp.cpu(), ent.cpu(), x.grad.cpu()))
    (lp, ent, grad), (rlp, rent, rgrad) = results
    assert torch.isnan(lp[0, bad]).all() and torch.isnan(ent[0, bad]).all()
    assert torch.isnan(grad[0, bad]).all()
    assert torch.isfinite(lp[0, ~bad]).all() and torch.isfinite(grad[0, ~bad]).all()
    assert lp[0, -1] == 0 and ent[0, -1] == 0 and (grad[0, -1] == 0).all()
    _close_nan(lp, rlp, dtype, "logprobs")
    _close_nan(ent, rent, dtype, "entropy")
    _close_nan(grad, rgrad, dtype, "dlogits", grad=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("config", UNDEFINED_CONFIGS[:2] + [PolicyLossConfig(policy_loss="reinforce")],
                         ids=_undefined_ids)
@pytest.mark.parametrize("kind", UNDEFINED_KINDS)
@pytest.mark.parametrize("backend, device", UNDEFINED_BACKENDS)
def test_undefined_row_linear_policy_loss(backend, device, kind, config):
    """The fused linear loss (tiled single-pass kernels on cpu / triton) with one token's logits made
    undefined through its hidden state: NaN, or +inf / all -inf by fp32 overflow of ``h W^T``
    (``h = 3e38 e_0``, ``W[:, 0] = +-5`` where needed)."""
    from fused_rl.backends import get_backend

    if not get_backend(backend, torch.device(device)).has_linear:
        pytest.skip(f"{backend} has no fused-linear path")
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 2, 3, 16, 40
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    bias = torch.randn(V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    hidden[..., 0] = 0.0
    weight[:, 0] = weight[:, 0].clamp(-0.5, 0.5)  # h = 3e38 e_0 makes |z| <= 1.5e38 (finite) there
    t = int(targets[BAD])
    if kind == "nan":
        hidden[BAD][3] = float("nan")
    else:
        hidden[BAD] = 0.0
        hidden[BAD][0] = 3e38
        if kind == "inf_other":
            weight[(t + 7) % V, 0] = 5.0
        elif kind == "inf_target":
            weight[t, 0] = 5.0
        else:
            weight[:, 0] = -5.0
    hidden[1, 2] = float("nan")  # masked
    adv = torch.tensor([0.7, -1.3])
    old = torch.full((B, T), -3.0) if config.dual_clip is not None else None
    ref = torch.full((B, T), -3.0) if config.kl else None
    results = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        to = lambda v: None if v is None else v.to(dev)
        h, w, b = (v.detach().to(dev, copy=True).requires_grad_(True) for v in (hidden, weight, bias))
        out = fused_rl.linear_policy_loss(h, w, to(targets), to(adv), to(mask), bias=b, config=config,
                                          old_logprobs=to(old), ref_logprobs=to(ref), compute_entropy=True,
                                          backend=be)
        out.loss.backward()
        results.append((out.loss.cpu(), out.logprobs.cpu(), out.entropy.cpu(), h.grad.cpu()))
    (loss, logprobs, entropy, gh), (_, rlogprobs, rentropy, rgh) = results
    assert torch.isnan(loss)
    assert torch.isnan(logprobs[BAD]) and torch.isnan(entropy[BAD]) and torch.isnan(gh[BAD]).all()
    assert (gh[1, 2] == 0).all()
    valid = mask.clone()
    valid[BAD] = False
    assert torch.isfinite(logprobs[valid]).all() and torch.isfinite(gh[valid]).all()
    _close_nan(logprobs, rlogprobs, torch.float32, "logprobs")
    _close_nan(entropy, rentropy, torch.float32, "entropy")
    torch.testing.assert_close(gh, rgh, atol=1e-5, rtol=1e-4, equal_nan=True)


#: Each policy loss (ppo_clip with dual clip and delta), each KL estimator (straight-through, bias-corrected),
#: rollout correction and the entropy bonus: the epilogue's min / max / clamps must not drop a NaN logp.
UNDEFINED_EPILOGUE_CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(dual_clip=3.0),
    PolicyLossConfig(clip_high=0.28, delta=1.5, dual_clip=2.0),
    PolicyLossConfig(policy_loss="sapo"),
    PolicyLossConfig(policy_loss="cispo", clip_high=0.3),
    PolicyLossConfig(policy_loss="reinforce", entropy_coef=0.01),
    PolicyLossConfig(rollout_is="token_truncate", rollout_is_max=1.5),
    PolicyLossConfig(policy_loss="cispo", rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=1.5),
] + [PolicyLossConfig(policy_loss="reinforce", kl=k, beta=0.2) for k in KL_ESTIMATORS if k is not None] + [
    PolicyLossConfig(kl="low_var_kl", beta=0.3, kl_bias_correction=True),
    PolicyLossConfig(policy_loss="sapo", kl="k3+", beta=0.3, kl_bias_correction=True),
]


def _epilogue_inputs(on_policy: bool):
    g = torch.Generator().manual_seed(2)
    n = 64
    logp = -3 * torch.rand(n, generator=g)
    nan_at = torch.arange(n) % 4 == 1
    logp_nan = torch.where(nan_at, float("nan"), logp)
    old = None if on_policy else logp + 0.5 * torch.randn(n, generator=g)
    ref = logp + 30 * torch.randn(n, generator=g)  # |d| > 20: low_var_kl's clamps too
    rollout = (logp if old is None else old) + 0.5 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    adv[::8] = 0.0
    ent = 2 * torch.rand(n, generator=g)
    return logp, logp_nan, nan_at, old, ref, rollout, adv, ent


@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("config", UNDEFINED_EPILOGUE_CONFIGS,
                         ids=lambda c: f"{c.policy_loss}-{c.kl}-d{c.dual_clip}-{c.delta}-{c.rollout_is}")
def test_epilogue_nan_logp_native(config, on_policy):
    """``csrc/policy_epilogue.h``: l and w dl/dlogp are NaN at a NaN logp (any w), the other tokens unchanged."""
    from fused_rl.backends import native

    if native._C is None:
        pytest.skip(native.LOAD_ERROR)
    logp, logp_nan, nan_at, old, ref, rollout, adv, ent = _epilogue_inputs(on_policy)
    n = logp.numel()
    w = torch.full((n,), 0.1)
    w[2::8] = 0.0

    def run(lp):
        outs = [torch.empty(n) for _ in range(3)]
        native._C.epilogue(n, lp.data_ptr(), ent.data_ptr(), adv.data_ptr(), native._ptr(old),
                           native._ptr(ref if config.kl else None),
                           native._ptr(rollout if config.rollout_is else None), w.data_ptr(),
                           native.epilogue_params(config), *(o.data_ptr() for o in outs))
        return outs

    (loss, gl, ge), (loss0, gl0, ge0) = run(logp_nan), run(logp)
    assert torch.isnan(loss[nan_at]).all() and torch.isnan(gl[nan_at]).all()
    assert torch.equal(loss[~nan_at], loss0[~nan_at]) and torch.equal(gl[~nan_at], gl0[~nan_at])
    assert torch.isfinite(loss0).all() and torch.isfinite(gl0).all() and torch.equal(ge, ge0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("config", UNDEFINED_EPILOGUE_CONFIGS,
                         ids=lambda c: f"{c.policy_loss}-{c.kl}-d{c.dual_clip}-{c.delta}-{c.rollout_is}")
def test_epilogue_nan_logp_triton(config, on_policy):
    """``kernels/epilogue.py``: l, dl/dlogp, r (and kl) are NaN at a valid NaN logp; a masked NaN logp
    gives 0 (r = 1); the other tokens unchanged."""
    if "triton" not in BACKENDS:
        pytest.skip("triton is not available here")
    from fused_rl.kernels.epilogue import apply_epilogue

    logp, logp_nan, nan_at, old, ref, rollout, adv, ent = _epilogue_inputs(on_policy)
    valid = torch.arange(logp.numel()) % 8 != 5  # 5 mod 8 = 1 mod 4: masked NaN tokens too
    bad = nan_at & valid
    kw = dict(rollout=rollout if config.rollout_is else None)
    got = apply_epilogue(logp_nan, ent, old, ref if config.kl else None, adv, valid, config, **kw)
    clean = apply_epilogue(logp, ent, old, ref if config.kl else None, adv, valid, config, **kw)
    names = ("loss", "dloss/dlogp", "dloss/dH", "ratio", "kl")
    for name, a, b in zip(names, got, clean):
        assert torch.equal(a[~nan_at], b[~nan_at]), name
        assert torch.isfinite(b).all(), name
        if name in ("loss", "dloss/dlogp", "ratio") or (name == "kl" and config.kl):
            assert torch.isnan(a[bad]).all(), name
    masked = nan_at & ~valid
    assert masked.any()
    for name, a in zip(names, got):
        expected = 1.0 if name == "ratio" else 0.0
        assert (a[masked] == expected).all(), name


WEIGHTED_EDGE_CONFIGS = [
    PolicyLossConfig(), PolicyLossConfig(delta=1.5), PolicyLossConfig(policy_loss="reinforce"),
    PolicyLossConfig(policy_loss="cispo", clip_high=0.3),
    PolicyLossConfig(rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=2.0),
    PolicyLossConfig(policy_loss="reinforce", rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=2.0),
    PolicyLossConfig(policy_loss="cispo", rollout_is="token_truncate", rollout_is_min=0.0, rollout_is_max=2.0),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("config", WEIGHTED_EDGE_CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.delta}-{c.rollout_is}")
def test_epilogue_weighted_edge_values_match_loss_math(kernel, config):
    """Both epilogues apply ``loss_math.weighted``'s rule: a term with weight 0 (``A = 0``, a rollout mask's 0)
    adds 0 where it is infinite (an overflowed ratio, a ``-inf`` log-prob), a NaN log-prob stays NaN; the
    per-token losses equal the fp64 loss math's (NaN where it is NaN), and ``dl/dlogp`` equals its gradient
    wherever that is finite (the kernels' is NaN at a NaN log-prob, by design: test_epilogue_nan_logp_*)."""
    lp = torch.tensor([-1.0, float("-inf"), -2.0, float("-inf"), -0.5, float("nan"), -1.5, -3.0] * 2)
    old = lp.nan_to_num(neginf=-1.0) + torch.tensor([0.3, 0.0, -300.0, 0.0, 0.2, 0.0, -300.0, 0.1] * 2)
    adv = torch.tensor([0.5] * 8 + [0.0] * 8)
    rollout = old + torch.tensor([0.1, 5.0, 5.0, 0.0, 5.0, 0.0, 0.0, -0.2] * 2)  # rho e^-5: masked
    ent = torch.ones(16)
    use_rollout = config.rollout_is is not None
    f64 = lambda x: x.double().view(1, -1)  # noqa: E731
    lp64 = f64(lp).requires_grad_(True)
    expected = per_token_loss(lp64, f64(adv), torch.ones(1, 16, dtype=torch.bool), config, old_logprobs=f64(old),
                              entropy=f64(ent), rollout_logprobs=f64(rollout) if use_rollout else None).loss
    expected.sum().backward()
    expected, expected_grad = expected.view(-1).float(), lp64.grad.view(-1).float()
    if kernel == "native":
        from fused_rl.backends import native

        if native._C is None:
            pytest.skip(native.LOAD_ERROR)
        outs, w = [torch.empty(16) for _ in range(3)], torch.ones(16)
        native._C.epilogue(16, lp.data_ptr(), ent.data_ptr(), adv.data_ptr(), native._ptr(old), native._ptr(None),
                           native._ptr(rollout if use_rollout else None), w.data_ptr(),
                           native.epilogue_params(config), *(o.data_ptr() for o in outs))
        loss, grad = outs[0], outs[1]
    else:
        if "triton" not in BACKENDS:
            pytest.skip("triton is not available here")
        from fused_rl.kernels.epilogue import apply_epilogue

        loss, grad, *_ = apply_epilogue(lp, ent, old, None, adv, torch.ones(16, dtype=torch.bool), config,
                                        rollout=rollout if use_rollout else None)
    assert expected[adv == 0].nan_to_num(nan=0.0).eq(0).all() and expected[5].isnan()  # the rule, in loss_math
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    finite = torch.isfinite(expected_grad) & ~lp.isnan()
    assert torch.isfinite(grad[finite]).all()
    torch.testing.assert_close(grad[finite], expected_grad[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, device", on([b for b in BACKENDS if b in ("cpu", "triton")],
                                                 [b for b in CUDA_BACKENDS if b in ("triton", "cuda")]))
def test_out_of_range_target_with_checks_off_is_nan_not_a_stray_read(backend, device, small_triton_blocks):
    """With ``check_inputs=False`` nothing checks the targets: a kernel reads nothing outside the row and
    makes that token's log-prob, loss and logits-gradient row NaN; every other row is as the reference's."""
    g = torch.Generator().manual_seed(11)
    B, T, V = 2, 3, 37
    x = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    bad = torch.zeros(B, T, dtype=torch.bool)
    bad[0, 1], bad[1, 2], bad[0, 0], bad[1, 0] = True, True, True, True
    wild = targets.clone()
    wild[0, 1], wild[1, 2] = V + 5, -7
    wild[0, 0], wild[1, 0] = 2**32 + 3, 2**32 - 100  # int64: not token 3, not IGNORE_INDEX once cast to int32
    x[0, 1, :5] = float("-inf")  # p = 0 entries: NaN too (a kernel skipping p = 0 would leave 0 there)
    adv, mask = torch.tensor([0.4, -1.1]), torch.ones(B, T, dtype=torch.bool)
    xr = x.clone().requires_grad_(True)
    lp_ref = fused_rl.reference.token_logprobs(xr, torch.where(bad, -100, targets))
    lp_ref.sum().backward()
    xt = x.to(device, copy=True).requires_grad_(True)
    lp = fused_rl.token_logprobs(xt, wild.to(device), backend=backend, check_inputs=False)
    lp.sum().backward()
    lp, grad = lp.cpu(), xt.grad.cpu()
    assert lp[bad].isnan().all() and grad[bad].isnan().all()
    torch.testing.assert_close(lp[~bad], lp_ref[~bad], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[~bad], xr.grad[~bad], rtol=1e-5, atol=1e-6)
    xp = x.to(device, copy=True).requires_grad_(True)
    out = fused_rl.policy_loss(xp, wild.to(device), adv.to(device), mask.to(device), backend=backend,
                               check_inputs=False)
    out.loss.backward()
    grad = xp.grad.cpu()
    assert out.loss.isnan() and grad[bad].isnan().all() and not grad[~bad].isnan().any()


# --------------------------------------------------------------------------- overflowing ratios
#: Configs whose loss is constant in r at r = inf for the signs used: ppo_clip (A > 0 above the clip
#: range), dual clip (A < 0, the cap), TRL's delta, sapo (the sigmoid saturates, either sign), gspo_token
#: and gspo (a sequence ratio of exp(~100)).
OVERFLOW_CONFIGS = [
    (PolicyLossConfig(clip_low=0.2, clip_high=0.28), 1.0),
    (PolicyLossConfig(dual_clip=3.0, kl="k3", beta=0.1, entropy_coef=0.01), -1.0),
    (PolicyLossConfig(delta=1.5), 1.0),
    (PolicyLossConfig(policy_loss="sapo"), 1.0),
    (PolicyLossConfig(policy_loss="sapo"), -1.0),
    (PolicyLossConfig(policy_loss="gspo_token", clip_low=3e-4, clip_high=4e-4), 1.0),
    (PolicyLossConfig(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"), 1.0),
    # A = 0 (a group of equal rewards): -A r is 0, not 0 * inf = NaN
    (PolicyLossConfig(), 0.0),
    (PolicyLossConfig(policy_loss="gspo_token"), 0.0),
    (PolicyLossConfig(policy_loss="gspo", agg="seq-mean-token-mean"), 0.0),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("config, adv", OVERFLOW_CONFIGS,
                         ids=[f"{c.policy_loss}-d{c.dual_clip}-{c.delta}-A{a:+g}" for c, a in OVERFLOW_CONFIGS])
@pytest.mark.parametrize("backend, device", on(["reference"] + BACKENDS))
def test_overflowing_ratio_of_a_clipped_token_has_zero_gradient(backend, device, config, adv):
    """An old log-prob far below the new one (an inference engine's -200 or -9999) overflows
    ``r = exp(logp - old)`` to inf in fp32. Where the loss is clipped there (constant in r) its gradient is
    exactly 0, as with a large finite ratio (old = -50): the same loss and gradient, all finite. Autograd of
    exp would give ``0 * inf = NaN`` for that token and, through the weights, for every parameter."""
    g = torch.Generator().manual_seed(4)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        lp = fused_rl.reference.token_logprobs(logits, targets)
    noise = 0.05 * torch.randn(B, T, generator=g)
    results = []
    for far in (-200.0, -50.0):
        old = lp + noise
        old[0] = far  # every token of sequence 0: gspo's sequence ratio overflows too
        x = logits.to(device, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(x, targets.to(device), torch.tensor([adv, -adv]).to(device), mask.to(device),
                                   old_logprobs=old.to(device), ref_logprobs=lp.to(device) if config.kl else None,
                                   config=config, backend=backend)
        out.loss.backward()
        results.append((out.loss.detach().cpu(), x.grad.cpu()))
    (loss, grad), (loss_finite, grad_finite) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[0] == 0).all() if config.kl is None else torch.isfinite(grad[0]).all()
    torch.testing.assert_close(loss, loss_finite, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, grad_finite, atol=1e-7, rtol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("policy", ["ppo_clip", "gmpo"])
@pytest.mark.parametrize("drop", ["is_weights", "token_mask"])
@pytest.mark.parametrize("backend, device", on(["reference"] + BACKENDS))
def test_a_dropped_token_with_an_overflowed_ratio_adds_zero(backend, device, drop, policy):
    """A token the caller or a rollout mask drops (weight 0) adds 0 to the loss even where its ratio
    overflowed with ``A < 0`` (loss inf): not ``0 * inf = NaN``; the same loss and gradient as with a large
    finite ratio. ppo_clip: one token at old = -200 (finite: -50); gmpo: a whole row (its ``exp(mean_t x_t)``
    is the row's), mean log-ratio ~ 400 (finite: ~ 150): every backend gave NaN logits gradients there, through
    the backward of ``exp`` (a fuzz example with temperature 1.7 and an off-policy log-ratio of 3677)."""
    g = torch.Generator().manual_seed(6)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        lp = fused_rl.reference.token_logprobs(logits, targets)
    dropped, fars = ((0, 1), (-200.0, -50.0)) if policy == "ppo_clip" else ((0, slice(None)), (-400.0, -150.0))
    results = []
    for far in fars:
        old = lp + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))
        old[dropped] = far
        if drop == "is_weights":
            weights = torch.ones(B, T)
            weights[dropped] = 0.0
            config, kw = PolicyLossConfig(policy_loss=policy), dict(rollout_is_weights=weights.to(device))
        else:  # rho = exp(old - rollout) = e^-5 < rollout_is_min: masked
            rollout = old + 0.01
            rollout[dropped] = old[dropped] + 5.0
            config = PolicyLossConfig(policy_loss=policy, rollout_is="token_mask", rollout_is_min=0.5,
                                      rollout_is_max=2.0)
            kw = dict(rollout_logprobs=rollout.to(device))
        x = logits.to(device, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(x, targets.to(device), torch.tensor([-1.0, 0.5]).to(device), mask.to(device),
                                   old_logprobs=old.to(device), config=config, backend=backend, **kw)
        out.loss.backward()
        results.append((out.loss.detach().cpu(), x.grad.cpu()))
    (loss, grad), (loss_finite, grad_finite) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[dropped] == 0).all()
    torch.testing.assert_close(loss, loss_finite, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, grad_finite, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_an_unbounded_rollout_weight_saturates_at_e20(backend, device, mode):
    """With no ``rollout_is_max``, the rollout correction's log-ratio is clamped to ``[-20, 20]`` before its
    ``exp`` (verl's ``SAFETY_BOUND``): a sampler log-prob 199 nats below the trainer's gives the same finite loss
    and gradients as one 39 nats below, on every backend as on the reference. Unclamped, ``e^199`` overflowed to
    ``inf`` and ``inf * 0`` made the loss of the ``A = 0`` row, and so the whole loss and gradient, NaN."""
    g = torch.Generator().manual_seed(7)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([0.0, 0.5])
    with torch.no_grad():
        lp = fused_rl.reference.token_logprobs(logits, targets)
    old = lp + 0.05 * torch.randn(B, T, generator=g)
    config = PolicyLossConfig(rollout_is=mode, rollout_is_min=0.5, rollout_is_max=None)
    results = {}
    for be, dev in ((backend, device), ("reference", "cpu")):
        for gap in (199.0, 39.0):
            rollout = old - 0.01
            rollout[0, 1] -= gap  # in the A = 0 row
            rollout[1, 2] -= gap
            x = logits.to(dev, copy=True).requires_grad_(True)
            out = fused_rl.policy_loss(x, targets.to(dev), adv.to(dev), mask.to(dev), old_logprobs=old.to(dev),
                                       rollout_logprobs=rollout.to(dev), config=config, backend=be)
            out.loss.backward()
            results[be, gap] = (out.loss.detach().cpu(), x.grad.cpu())
    for key, (loss, grad) in results.items():
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), key
        expected_loss, expected_grad = results["reference", 39.0]
        torch.testing.assert_close(loss, expected_loss, atol=0.0, rtol=1e-6)
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", ["reinforce-dropped", "cispo-dropped", "reinforce-A0", "nan-row-dropped"])
@pytest.mark.parametrize("backend, device", on(["reference"] + BACKENDS))
def test_weight_zero_rules_agree_on_every_backend(backend, device, case):
    """A token with weight 0 (a ``rollout_is_weights`` 0, which the kernels fold into ``A``, or ``A = 0``) and a
    ``-inf`` target logit (``-A logp`` infinite) adds 0 on every backend, logits-level and fused-linear; a NaN
    logits row stays a NaN loss even where its token's weight is 0 (a diverged model is loud)."""
    g = torch.Generator().manual_seed(9)
    B, T, V, H = 2, 3, 37, 8
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.zeros(V)
    targets = torch.randint(0, V - 1, (B, T), generator=g)
    targets[0, 1] = V - 1
    bias[V - 1] = float("-inf")  # the target of token (0, 1) has p = 0: log p = -inf
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if case == "nan-row-dropped":
        logits[0, 1, 3] = float("nan")
    policy = "cispo" if case.startswith("cispo") else "reinforce"
    config = PolicyLossConfig(policy_loss=policy, clip_high=0.3)
    adv = torch.tensor([0.0, -0.7]) if case.endswith("A0") else torch.tensor([0.8, -0.7])
    weights = torch.ones(B, T)
    weights[0, 1] = 0.0
    kw = lambda dev: {} if case.endswith("A0") else dict(rollout_is_weights=weights.to(dev))  # noqa: E731
    mask = torch.ones(B, T, dtype=torch.bool)
    old = torch.full((B, T), -2.0)
    losses = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        x = logits.to(dev, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(x, targets.to(dev), adv.to(dev), mask.to(dev), old_logprobs=old.to(dev),
                                   config=config, backend=be, **kw(dev))
        out.loss.backward()
        losses.append(out.loss.detach().cpu())
        if case != "nan-row-dropped":
            assert torch.isfinite(x.grad).all()
    loss, expected = losses
    if case == "nan-row-dropped":
        assert loss.isnan() and expected.isnan()
        return
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    h = hidden.to(device, copy=True).requires_grad_(True)
    out = fused_rl.linear_policy_loss(h, weight.to(device), targets.to(device), adv.to(device), mask.to(device),
                                      bias=bias.to(device), old_logprobs=old.to(device), config=config, backend=backend,
                                      **kw(device))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(h.grad).all()
    torch.testing.assert_close(out.loss.detach().cpu(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kl", ["k3", "k3+", "k1", "k2", "abs+", "low_var_kl"])
@pytest.mark.parametrize("policy_loss, overflow", [("ppo_clip", False), ("cispo", False), ("gspo", False),
                                                    ("ppo_clip", True), ("cispo", True)])
@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_bias_corrected_kl_far_off_policy_is_finite_on_every_backend(backend, device, policy_loss, overflow, kl):
    """``kl_bias_correction`` at an off-policy token whose log-prob is ``-inf`` (``r = 0``, ``d = inf``: the limit,
    ``exp(ref - old)`` for k3, was ``0 * inf = NaN``) and at one with ``d = 95`` and ``r = e^-80`` (k3's ``r kl`` is
    ``e^15``; the product was ``inf``): a finite loss and finite gradients equal to the reference's, logits-level
    and fused-linear. gspo (a sequence ratio, whose k3 term at a ``-inf`` token is NaN) has the far token only.
    With ``overflow``, a third token's ratio overflows (``old = -9999``, ``d = 25``): the loss is ``+-inf``, not NaN
    (k3's far form was ``inf - inf``), and the other tokens' gradients the reference's."""
    g = torch.Generator().manual_seed(12)
    B, T, V, H = 2, 3, 37, 8
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.zeros(V)
    targets = torch.randint(0, V - 2, (B, T), generator=g)
    bias[V - 1], bias[V - 2] = float("-inf"), -100.0
    targets[1, 0] = V - 2  # log p ~ -100
    if policy_loss != "gspo":
        targets[0, 1] = V - 1  # log p = -inf
    if overflow:
        targets[0, 2] = V - 2
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logp = fused_rl.reference.token_logprobs(logits, targets)
    old, ref = (torch.randn(B, T, generator=g) * 0.3 + logp.clamp(min=-10.0) for _ in range(2))
    old[1, 0], ref[1, 0] = logp[1, 0] + 80.0, logp[1, 0] + 95.0
    if overflow:  # in row 0, whose A > 0 clips the policy term there
        old[0, 2], ref[0, 2] = -9999.0, logp[0, 2] + 25.0
    config = PolicyLossConfig(policy_loss=policy_loss, kl=kl, beta=0.1, kl_bias_correction=True)
    adv = torch.tensor([0.8, -0.7])
    mask = torch.ones(B, T, dtype=torch.bool)
    results = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        x = logits.to(dev, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(x, targets.to(dev), adv.to(dev), mask.to(dev), old_logprobs=old.to(dev),
                                   ref_logprobs=ref.to(dev), config=config, backend=be)
        out.loss.backward()
        results.append((out.loss.detach().cpu(), x.grad.cpu()))
    (loss, grad), (expected, expected_grad) = results
    assert torch.isfinite(expected) != overflow and not expected.isnan()
    # the overflowed token's row: an infinite coefficient times (onehot - p), whose inf / NaN pattern differs by
    # backend (the kernels form the target entry as -a p + a); the other rows are finite and agree
    others = torch.ones(B, T, dtype=torch.bool)
    others[0, 2] = not overflow
    assert torch.isfinite(expected_grad[others]).all()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[others], expected_grad[others], rtol=1e-5, atol=1e-6)
    h = hidden.to(device, copy=True).requires_grad_(True)
    out = fused_rl.linear_policy_loss(h, weight.to(device), targets.to(device), adv.to(device), mask.to(device),
                                      bias=bias.to(device), old_logprobs=old.to(device), ref_logprobs=ref.to(device),
                                      config=config, backend=backend)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach().cpu(), expected, rtol=1e-5, atol=1e-6)
    # the hidden-state gradient of a row is its logits-gradient row times W
    torch.testing.assert_close(h.grad.cpu()[others], (expected_grad @ weight)[others], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_nan_upstream_gradient_gives_a_nan_row_also_where_p_is_0(backend, device):
    """A NaN upstream gradient of a token's log-prob makes its whole logits-gradient row NaN, entries with
    p = 0 (-inf logits) included, as autograd of log_softmax does; the other rows keep their gradient."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 3, 40, generator=g)
    x[0, 0, :10] = float("-inf")
    targets = torch.tensor([[20, 3, 7]])
    upstream = torch.tensor([[float("nan"), 1.0, -0.5]])
    grads = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        xd = x.to(dev, copy=True).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xd, targets.to(dev), return_entropy=True, backend=be)
        (lp * upstream.to(dev) + 0.3 * ent).sum().backward()
        grads.append(xd.grad.cpu())
    grad, expected = grads
    assert grad[0, 0].isnan().all() and expected[0, 0].isnan().all()
    torch.testing.assert_close(grad[0, 1:], expected[0, 1:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_neg_inf_logits_have_p_zero_even_at_the_target(backend, device):
    """A ``-inf`` logit (a vocabulary mask) is ``p = 0`` with a gradient of exactly 0 (the C++ CPU kernel gave
    ``exp(-87.3) = 1.2e-38`` there), also when it is the sampled target's (the CUDA kernel's entropy factor
    was ``0 * inf = NaN`` at that entry): ``token_logprobs`` with an entropy term, and the single-pass
    policy loss with an entropy bonus, against the reference."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 45, generator=g) * 3
    targets = torch.tensor([[4, 7, 30], [1, 2, 44]])
    x[0, :, :9] = float("-inf")  # row (0, 0): a -inf target logit; rows (0, 1), (0, 2): -inf elsewhere
    x[1, 2, 40:] = float("-inf")  # a -inf target in the last (ragged) block
    upstream = torch.randn(2, 3, generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.full((2, 3), -3.0)
    config = PolicyLossConfig(entropy_coef=0.05)
    results = []
    for be, dev in ((backend, device), ("reference", "cpu")):
        xd = x.to(dev, copy=True).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xd, targets.to(dev), return_entropy=True, backend=be)
        (torch.where(lp.isinf(), 0.0, lp * upstream.to(dev)) + 0.3 * ent).sum().backward()
        xp = x.to(dev, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(xp, targets.to(dev), torch.tensor([0.7, -1.2]).to(dev), mask.to(dev),
                                   old_logprobs=old.to(dev), config=config, backend=be)
        out.loss.backward()
        results.append((xd.grad.cpu(), xp.grad.cpu(), out.loss.detach().cpu()))
    (grad, pgrad, loss), (expected, pexpected, loss_ref) = results
    masked = x == float("-inf")
    masked[0, 0, 4] = masked[1, 2, 44] = False  # the -inf targets: -upstream (1 - p) = -upstream, ...
    for got, want in ((grad, expected), (pgrad, pexpected)):
        assert (want[masked] == 0).all() and (got[masked] == 0).all()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("policy_loss, advantages", [("gspo_token", [1.0, -1.0]), ("gmpo", [0.0, 0.0]),
                                                     ("gmpo", [1.0, -1.0]), ("gspo", [1.0, -1.0])])
def test_a_neg_inf_target_logit_off_policy_has_ratio_zero_in_sequence_losses(backend, device, policy_loss,
                                                                            advantages):
    """Off-policy, a sampled token whose training logit is ``-inf`` has ``r = 0`` and a defined loss. gspo_token's
    token term ``logp - sg(logp)`` was ``-inf - -inf = NaN`` and gmpo's ``sgn(A) log r`` at ``A = 0`` (a group of
    equal rewards) ``0 * -inf = NaN``: a NaN loss and NaN gradients on every backend. gspo_token's value is gspo's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g)
    x[..., :8] = float("-inf")
    targets = torch.randint(8, 64, (2, 3), generator=g)
    targets[0, 1] = 3  # masked out in training
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.randn(2, 3, generator=g) * 0.2 - 4
    adv = torch.tensor(advantages)
    results = []
    runs = ((backend, device, policy_loss), ("reference", "cpu", policy_loss), ("reference", "cpu", "gspo"))
    for be, dev, pl in runs:
        xd = x.to(dev, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(xd, targets.to(dev), adv.to(dev), mask.to(dev), old_logprobs=old.to(dev),
                                   config=PolicyLossConfig(policy_loss=pl), backend=be)
        out.loss.backward()
        results.append((out.loss.detach().cpu(), xd.grad.cpu()))
    (loss, grad), (loss_ref, grad_ref), (loss_gspo, _) = results
    assert torch.isfinite(loss_ref) and not grad_ref.isnan().any()
    torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)
    if policy_loss == "gspo_token":
        torch.testing.assert_close(loss_ref, loss_gspo, atol=1e-6, rtol=1e-6)
    if not adv.any():
        assert loss_ref == 0 and (grad_ref == 0).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("backend, device", on(["reference"] + BACKENDS))
@pytest.mark.parametrize("kl", ["k1+", "abs+", "low_var_kl+", "k3+", "k3"])
def test_a_straight_through_kl_at_a_neg_inf_target_logit_has_its_estimators_value(backend, device, kl):
    """Off-policy, at a sampled token whose training logit is ``-inf`` (``d = ref - logp = inf``), ``"X+"``'s value is
    X's (``-inf``, ``inf``, low_var_kl's clamp 10: a finite loss; k3's ``inf``), as for ``kl = X``. The torch loss
    math's ``k2 + sg(X - k2)`` was ``inf - inf = NaN`` on the reference, torch and cpu backends; the kernels gave X.
    k3 itself, ``expm1(d) - d``, was ``inf - inf = NaN`` on every backend: it is ``+inf``, its limit."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 50, generator=g)
    targets = torch.randint(0, 50, (2, 3), generator=g)
    x[0, 1, targets[0, 1]] = float("-inf")
    mask = torch.ones(2, 3, dtype=torch.bool)
    old, ref = (torch.randn(2, 3, generator=g) - 3 for _ in range(2))
    losses = []
    for be, dev, estimator in ((backend, device, kl), ("reference", "cpu", kl.rstrip("+"))):
        out = fused_rl.policy_loss(x.to(dev), targets.to(dev), torch.tensor([0.5, -1.0], device=dev), mask.to(dev),
                                   old_logprobs=old.to(dev), ref_logprobs=ref.to(dev),
                                   config=PolicyLossConfig(kl=estimator, beta=0.1), backend=be)
        losses.append(out.loss.cpu())
    assert not losses[1].isnan() and losses[1].isfinite() == (kl == "low_var_kl+")
    assert (losses[1] == -float("inf")) == (kl == "k1+")
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("backend, device", on(["reference"] + BACKENDS))
@pytest.mark.parametrize("fields", [dict(kl="k2", kl_clamp=10.0), dict(kl="k1", kl_clamp=0.5),
                                    dict(kl="k2+", kl_clamp=10.0, kl_is_clip=10.0), dict(kl="k1+", kl_is_clip=2.0),
                                    dict(kl="low_var_kl+"), dict(policy_loss="gspo", kl="abs+", kl_clamp=1.0)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_a_clamped_or_straight_through_kl_at_an_infinite_gap_has_zero_slope(backend, device, fields):
    """At an infinite gap ``d = ref - logp`` (a ``-inf`` target logit off-policy; a ``-inf`` reference log-prob is
    refused by the input checks), a clamped KL value is the clamp with a zero slope, and an ``"X+"`` estimator's k2
    slope is 0 (weighted or not), on every backend: the gradient is the policy term's alone, finite, as the
    reference's. Autograd of the clamp and of ``k2 + sg(X - k2)`` was ``0 * inf = NaN`` on the whole logits row
    (reference, torch, cpu; triton 0)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=g)
    targets = torch.randint(0, 40, (2, 3), generator=g)
    old, ref = (torch.randn(2, 3, generator=g) - 3 for _ in range(2))
    x[0, 1, targets[0, 1]] = float("-inf")
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = PolicyLossConfig(**{"beta": 0.1, **fields})
    results = []
    for be, dev, beta in ((backend, device, config.beta), ("reference", "cpu", 0.0)):
        xx = x.to(dev).requires_grad_(True)
        out = fused_rl.policy_loss(xx, targets.to(dev), torch.tensor([0.5, -1.0], device=dev), mask.to(dev),
                                   old_logprobs=old.to(dev), ref_logprobs=ref.to(dev),
                                   config=config.replace(beta=beta), backend=be)
        out.loss.backward()
        results.append((out.loss.detach().cpu(), xx.grad.cpu()))
    (loss, grad), (_, policy_grad) = results
    assert not loss.isnan() and grad.isfinite().all()
    # the infinite token's row: its KL slope is 0, so only the policy term's gradient is left there
    torch.testing.assert_close(grad[0, 1], policy_grad[0, 1], atol=1e-6, rtol=1e-5)
    assert grad.abs().sum() > grad[0, 1].abs().sum()


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_clip_low_of_one_or_more_is_no_lower_clip(backend, device, policy_loss):
    """``clip_low >= 1`` (TRL's and Liger's ``epsilon = 1``): the lower bound ``1 - clip_low <= 0`` never binds, so
    the loss is the one without a lower clip, on every backend; 0.2 clips the low ratios of ``A < 0`` tokens."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 50, generator=g) * 3
    targets = torch.randint(0, 50, (2, 4), generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.tensor([-1.0, -0.5])
    logp = torch.log_softmax(x, -1).gather(-1, targets[..., None])[..., 0]
    old = logp + 1.0  # ratios e^-1 < 0.8: clipped at 1 - 0.2 for A < 0
    results = {}
    for clip_low in (0.2, 1.0, 3.0):
        for be, dev in ((backend, device), ("reference", "cpu")):
            xd = x.to(dev, copy=True).requires_grad_(True)
            out = fused_rl.policy_loss(xd, targets.to(dev), adv.to(dev), mask.to(dev), old_logprobs=old.to(dev),
                                       config=PolicyLossConfig(policy_loss=policy_loss, clip_low=clip_low),
                                       backend=be)
            out.loss.backward()
            results[clip_low, be] = (out.loss.detach().cpu(), xd.grad.cpu(), out.metrics["clip_frac_low"].cpu())
    for clip_low in (0.2, 1.0, 3.0):
        for got, want in zip(results[clip_low, backend], results[clip_low, "reference"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got, want in zip(results[3.0, "reference"], results[1.0, "reference"]):
        torch.testing.assert_close(got, want)
    assert results[1.0, "reference"][2] == 0 and results[0.2, "reference"][2] > 0
    assert not torch.allclose(results[1.0, "reference"][1], results[0.2, "reference"][1])


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_entropy_of_a_near_one_hot_row_is_not_negative(backend, device, temperature):
    """``H = log s - E[z - m]`` cancels to about -1e-8 on a one-hot row whose max logit is large (a fuzz
    case on the C++ kernel: ``[13869, -2641] / 0.3``; the FMA-contracted ``z - m`` of the max element is
    the rounding residual of ``x / tau``, not 0); every backend returns ``H >= 0`` (the reference's
    ``-sum p log p`` is -0.0 there), in ``token_logprobs`` and in the single pass of ``policy_loss``.
    Small logits with small gaps too (``|z| <= 100``, where fp32 holds ``H`` to the tolerance)."""
    rows = [[0.0, -g] for g in (0.0, 1.0, 3.0, 10.0, 30.0)]
    rows += [[c, c - g] for c in (13868.9648, -19609.1055) for g in (300.0, 3e3, 16509.8)]
    logits = torch.tensor(rows).view(1, -1, 2)
    targets = torch.zeros(logits.shape[:2], dtype=torch.long)
    mask = torch.ones(logits.shape[:2], dtype=torch.bool)
    x = logits.to(device).requires_grad_(True)
    _, ent = fused_rl.token_logprobs(x.detach(), targets.to(device), temperature=temperature, return_entropy=True,
                                     backend=backend)
    out = fused_rl.policy_loss(x, targets.to(device), torch.ones(1, device=device), mask.to(device),
                               config=PolicyLossConfig(temperature=temperature, entropy_coef=0.01), backend=backend)
    expected = fused_rl.token_logprobs(logits.double(), targets, temperature=temperature, return_entropy=True,
                                       backend="reference")[1]
    for got in (ent, out.entropy):
        assert (got >= 0).all(), got
        torch.testing.assert_close(got.cpu().double(), expected, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shift", [-1000.0, 1000.0])
def test_large_logits_cost_no_accuracy(backend, device, temperature, shift):
    """Log-softmax is shift-invariant, and so is every backend's rounding: the row max is subtracted from the
    raw logits before the scaling by ``1 / tau`` (scaling first rounds ``x / tau`` or ``x log2(e) / tau`` to
    ``|x| 2^-24``: the Triton kernels were 4e-5 nats off at logits near -1000, the chunked torch paths 9e-5 at
    ``tau = 0.7``). Log-probs, entropies and ``dlogits`` of ``token_logprobs`` and the single-pass
    ``policy_loss``, and the fused linear ``linear_token_logprobs`` (a bias of ``shift``), against fp64, to a
    bound that does not grow with ``|shift|`` (the fp32 reference itself, dividing first, misses it at
    ``tau = 0.7``)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 5, 300, generator=g) * 3 + shift
    targets = torch.randint(0, 300, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)
    x64 = x.double().requires_grad_(True)
    lp64, ent64 = fused_rl.token_logprobs(x64, targets, temperature=temperature, return_entropy=True,
                                          backend="reference")
    (lp64 * upstream).sum().backward()
    xd = x.to(device).requires_grad_(True)
    lp, ent = fused_rl.token_logprobs(xd, targets.to(device), temperature=temperature, return_entropy=True,
                                      backend=backend)
    (lp * upstream.to(device)).sum().backward()
    close = lambda got, want: torch.testing.assert_close(got.detach().cpu().double(), want.detach(), atol=4e-6,
                                                         rtol=1e-5)
    close(lp, lp64)
    close(ent, ent64)
    close(xd.grad, x64.grad)
    mask = torch.ones(2, 5, dtype=torch.bool)
    out = fused_rl.policy_loss(x.to(device), targets.to(device), torch.ones(2, device=device), mask.to(device),
                               config=PolicyLossConfig(temperature=temperature), backend=backend)
    close(out.logprobs, lp64)
    h = torch.randn(2, 5, 16, generator=g)
    w = torch.randn(300, 16, generator=g) * 0.3
    bias = torch.full((300,), shift)
    lin = fused_rl.linear_token_logprobs(h.to(device), w.to(device), targets.to(device),
                                         bias=bias.to(device), temperature=temperature, backend=backend)
    lin64 = fused_rl.linear_token_logprobs(h.double(), w.double(), targets, bias=bias.double(),
                                           temperature=temperature, backend="reference")
    close(lin, lin64)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_fp16_gradient_is_formed_after_the_loss_scale(backend, device):
    """fp16 logits under a GradScaler-like scale (65536) with DAPO's token normalizer (4096): the single pass
    stored ``dlogits = w_t (onehot - p)`` in fp16 in the forward, before the scale, so every entry below 6e-8
    (most of a softmax tail) was 0 where the reference, scaling first, keeps it. fp16 logits with a gradient
    take the two passes: the reference's nonzero pattern, and its values to fp16 rounding."""
    g = torch.Generator().manual_seed(8)
    rank = torch.arange(1, 1001, dtype=torch.float32)
    row = (-1.1 * rank.log())[torch.randperm(1000, generator=g)]  # a Zipf-shaped softmax, as an LM's
    logits = ((row + 0.3 * torch.randn(2, 4, 1000, generator=g)) * 2).half()
    targets = torch.randint(0, 50, (2, 4), generator=g)
    adv = torch.randn(2, 4, generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    grads = []
    for be, dev in (("reference", "cpu"), (backend, device)):
        x = logits.to(dev, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(x, targets.to(dev), adv.to(dev), mask.to(dev), backend=be, token_normalizer=4096.0)
        (out.loss * 65536.0).backward()
        grads.append(x.grad.cpu().float())
    want, got = grads
    assert ((want != 0) & (got == 0)).sum() == 0
    torch.testing.assert_close(got, want, atol=0, rtol=2e-3)


@pytest.mark.parametrize("backend, device", on(BACKENDS))
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_huge_jump_of_the_row_max_keeps_the_entropy_finite(backend, device, temperature, small_triton_blocks):
    """A row whose running max jumps by ``2e37`` between vocabulary blocks (the CUDA kernel: between threads'
    partial sums): the old sums' rescale factor ``2^d`` is 0, but the entropy's ``s d`` overflowed to ``-inf`` and
    ``0 * -inf`` made ``H`` (Triton, CUDA) NaN, and through it the whole ``dlogits`` row with an entropy bonus;
    now ``d`` is clamped where ``2^d`` is 0 anyway, and every backend gives the reference's finite values."""
    V = 100
    x = torch.full((2, 3, V), -1e37)
    x[:, :, V - 3] = 1e37  # the row max, in the last block
    x[0, 1, 4:9] = torch.tensor([1e37, 0.5, 1e37, -2.0, 1e37])  # a tie for the max in the first block too
    x[1, 2] = torch.linspace(-3.0, 3.0, V)  # an ordinary row beside them
    targets = torch.tensor([[V - 3, 5, 0], [V - 3, 7, 11]])
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = PolicyLossConfig(entropy_coef=0.01, temperature=temperature)
    results = []
    for be, dev in (("reference", "cpu"), (backend, device)):
        xd = x.to(dev).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xd.detach(), targets.to(dev), temperature=temperature,
                                          return_entropy=True, backend=be)
        out = fused_rl.policy_loss(xd, targets.to(dev), adv.to(dev), mask.to(dev), config=config, backend=be)
        out.loss.backward()
        results.append([t.detach().cpu() for t in (lp, ent, out.loss, out.logprobs, out.entropy, xd.grad)])
    for want, got, name in zip(*results, ("logp", "H", "loss", "loss logp", "loss H", "dlogits")):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("old", [-2.3, -4.9])
@pytest.mark.parametrize("backend, device", on(BACKENDS))
def test_sapo_gradient_in_the_sigmoid_tail(backend, device, old):
    """SAPO's slope ``tau s (1 - s)`` is 0 in fp32 once ``s = sigmoid(tau (r - 1))`` rounds to 1 (``x > 17``; 37 in
    fp64, the reference's): the C++ epilogue and the torch math gave 0 where the Triton epilogue's ``s sigmoid(-x)``
    gave ``e^-x`` (a randomized fuzz example against the fp64 oracle). Every backend now has the tail's exact slope,
    as the fp64 reference (``exp(logsigmoid(x))``); ``x = r - 1`` = 3.1 and 53.7 here (``logp = -0.90``)."""
    x = torch.zeros(1, 1, 5)
    x[0, 0, 2] = 1.0
    targets, mask, adv = torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([1.0])
    config = PolicyLossConfig(policy_loss="sapo")
    grads = []
    for be, dev, dtype in ((backend, device, torch.float32), ("reference", "cpu", torch.float64)):
        xx = x.to(dev, dtype, copy=True).requires_grad_(True)
        out = fused_rl.policy_loss(xx, targets.to(dev), adv.to(dev, dtype), mask.to(dev), config=config, backend=be,
                                   old_logprobs=torch.tensor([[old]], device=dev, dtype=dtype))
        out.loss.backward()
        grads.append(xx.grad.cpu().double())
    got, expected = grads
    assert expected[0, 0, 2] != 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [PolicyLossConfig(kl="k3", beta=0.1, entropy_coef=0.01),  # single pass (cpu, triton)
                                    PolicyLossConfig.preset("gspo")], ids=["ppo_clip", "gspo"])
def test_batched_backward_matches_the_reference(backend, config):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (a batch of ``grad_output``, as
    ``jacobian(vectorize=True)`` uses): the single-pass and fused-linear backwards multiply their stored gradients
    out of place there (their in-place / ``out=`` products have no batching rule: torch's internal "Batching rule
    not implemented" before); every gradient of the batch equals the reference's."""
    g = torch.Generator().manual_seed(4)
    vocab = 257 if backend == "triton" else 300
    logits = torch.randn(3, 4, vocab, generator=g)
    hidden, weight = torch.randn(3, 4, 16, generator=g), torch.randn(vocab, 16, generator=g) * 0.3
    targets = torch.randint(0, vocab, (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1, 1:] = False
    adv, kw = torch.tensor([0.5, -1.0, 2.0]), dict(old_logprobs=-torch.rand(3, 4, generator=g) * 3,
                                                   ref_logprobs=-torch.rand(3, 4, generator=g) * 3, config=config)
    grad_outputs = torch.tensor([1.0, -2.5, 3.7])

    def grads(be):
        x = logits.clone().requires_grad_(True)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fused_rl.policy_loss(x, targets, adv, mask, backend=be, **kw).loss
        linear = fused_rl.linear_policy_loss(h, w, targets, adv, mask, backend=be, **kw).loss
        return (torch.autograd.grad(loss, x, grad_outputs=grad_outputs, is_grads_batched=True)
                + torch.autograd.grad(linear, (h, w), grad_outputs=grad_outputs, is_grads_batched=True))

    for got, expected in zip(grads(backend), grads("reference")):
        assert got.shape[0] == 3
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


NAN_INPUT_CONFIGS = {
    "ppo": PolicyLossConfig(), "dual_delta": PolicyLossConfig(dual_clip=3.0, delta=1.5),
    "cispo": PolicyLossConfig(policy_loss="cispo", clip_high=4.0), "sapo": PolicyLossConfig(policy_loss="sapo"),
    "reinforce": PolicyLossConfig(policy_loss="reinforce"),
    "dppo_kl": PolicyLossConfig(policy_loss="dppo_kl", delta=2.0),
    "tis_truncate": PolicyLossConfig(policy_loss="reinforce", rollout_is="token_truncate"),
    "tis_mask": PolicyLossConfig(rollout_is="token_mask", rollout_is_min=0.5),
    "low_var_kl": PolicyLossConfig(kl="low_var_kl", beta=0.1),
    "k1_clamp": PolicyLossConfig(kl="k1", beta=0.1, kl_clamp=5.0),
    "k2+_is": PolicyLossConfig(kl="k2+", beta=0.1, kl_is_clip=2.0),
    "k3_bias": PolicyLossConfig(kl="k3", beta=0.1, kl_bias_correction=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nan_in", ["old", "ref", "rollout"])
def test_a_nan_log_prob_input_gives_what_the_reference_gives(backend, nan_in):
    """A NaN old / ref / rollout log-prob (refused by the value checks; ``check_inputs=False`` and ``torch.compile``
    skip them) gives the reference's loss and logits gradient, NaN where the reference's is: the kernels' min / max /
    clamp keep a NaN operand as torch's do (``fminf`` / ``tl.minimum`` dropped it: cispo's gradient came out finite,
    a truncated rollout weight -inf, the Triton loss finite)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 16, generator=g)
    targets = torch.randint(0, 16, (1, 3), generator=g)
    mask, adv = torch.ones(1, 3, dtype=torch.bool), torch.tensor([0.7])
    inputs = dict(old_logprobs=torch.tensor([[-2.1, -2.0, -2.5]]), ref_logprobs=torch.tensor([[-2.0, -1.0, -3.0]]),
                  rollout_logprobs=torch.tensor([[-2.2, -2.1, -2.4]]))
    inputs[f"{nan_in}_logprobs"][0, 0] = float("nan")
    for name, config in NAN_INPUT_CONFIGS.items():
        kw = dict(inputs)
        if config.kl is None:
            kw.pop("ref_logprobs")
        if config.rollout_is is None:
            kw.pop("rollout_logprobs")
        results = []
        for be in (backend, "reference"):
            x = logits.clone().requires_grad_(True)
            out = fused_rl.policy_loss(x, targets, adv, mask, config=config, backend=be, check_inputs=False, **kw)
            out.loss.backward()
            results.append((out.loss.detach(), x.grad))
        for got, expected in zip(*results):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_logits_near_the_float32_maximum_have_a_softmax(backend):
    """A row whose max is finite but above ``float32 max / log2(e)`` (~2.4e38) is a defined softmax, as the reference
    computes it: the CUDA kernel tested ``m log2(e) / tau`` for overflow instead of ``m / tau`` and made it NaN
    (``tests/test_cuda_sim.py`` runs this on its emulation)."""
    vocab = 16
    x = torch.zeros(1, 2, vocab)
    x[0, 0, 0], x[0, 0, 3], x[0, 1, 5] = 3.0e38, 1.5e38, 2.5e38
    targets = torch.tensor([[0, 5]])
    got = fused_rl.token_logprobs(x, targets, return_entropy=True, backend=backend)
    expected = fused_rl.token_logprobs(x, targets, return_entropy=True, backend="reference")
    for a, b in zip(got, expected):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
