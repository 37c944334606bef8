"""The #10 variants (rollout correction, token masks, gspo_token / gmpo / sapo / vespo / luspo, TRL's delta clip,
the "+" straight-through KL estimators, truncated-completion masking) on every backend against the reference,
fp32 and bf16, on the ragged batches of ``helpers.make_case`` (all-masked row, length-1 row,
IGNORE_INDEX target, vocabularies that are no multiple of a block, peaked and all-negative logits).

The formulas themselves are checked against a scalar derivation in ``test_loss_math.py``; here every
backend must reproduce the reference (full ``log_softmax`` + :mod:`fused_rl.loss_math`) exactly, with
the same tolerances as the original variants."""

import copy

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from helpers import compare_policy_loss, fused_backends, make_case, on_device, supports
from test_linear import compare_linear, make_linear_case

# numpy warnings of the Triton interpreter evaluating both branches of tl.where on masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

VARIANTS = {
    "gspo_token": PolicyLossConfig.preset("gspo_token", clip_low=0.05, clip_high=0.1),
    "gmpo": PolicyLossConfig(policy_loss="gmpo", clip_low=0.1, clip_high=0.15, agg="seq-mean-token-mean"),
    "sapo": PolicyLossConfig.preset("sapo", kl="k3", beta=0.05),
    "delta": PolicyLossConfig(clip_high=0.28, delta=1.3, dual_clip=3.0, entropy_coef=0.01),
    "k3+": PolicyLossConfig(kl="k3+", beta=0.2, kl_bias_correction=True),
    "k1+": PolicyLossConfig(policy_loss="cispo", kl="k1+", beta=0.2, temperature=0.7),
    "tis_token": PolicyLossConfig(rollout_is="token_truncate", rollout_is_max=1.2, kl="k2", beta=0.1),
    "mis_sequence": PolicyLossConfig(rollout_is="sequence_mask", rollout_is_min=0.5, rollout_is_max=2.0,
                                     agg="seq-mean-token-mean"),
    "off_policy_mask": PolicyLossConfig(off_policy_mask=0.02, rollout_is="token_mask", rollout_is_max=3.0),
    "top_entropy": PolicyLossConfig(top_entropy_quantile=0.3, entropy_coef=0.01, agg="seq-mean-token-sum"),
    "truncated": PolicyLossConfig.preset("grpo", mask_truncated_completions=True),
    "all": PolicyLossConfig(policy_loss="sapo", kl="low_var_kl+", beta=0.1, rollout_is="sequence_truncate",
                            rollout_is_max=2.5, off_policy_mask=0.1, top_entropy_quantile=0.6, entropy_coef=0.02,
                            mask_truncated_completions=True, agg="seq-mean-token-sum-norm", max_len=8),
    "luspo": PolicyLossConfig.preset("luspo", clip_low=0.05, clip_high=0.1, kl="k2", beta=0.1),
    "vespo": PolicyLossConfig.preset("vespo", kl="k3", beta=0.05, kl_bias_correction=True),
    # OpenRLHF's compute_approx_kl: the value clamp (small here, to cut ~half the tokens of make_case's spread) and
    # unbiased_gradient's min(r, C)-weighted k2 gradient (C cuts ~a third of the token ratios)
    "k1_clamp": PolicyLossConfig(kl="k1", beta=0.3, kl_clamp=0.3, dual_clip=3.0),
    "k2+_is": PolicyLossConfig(policy_loss="cispo", kl="k2+", beta=0.5, kl_clamp=0.05, kl_is_clip=1.1),
    "abs+_is_gspo": PolicyLossConfig(policy_loss="gspo", kl="abs+", beta=0.2, kl_clamp=0.25, kl_is_clip=1.05,
                                     agg="seq-mean-token-mean"),
    "low_var_kl+_is": PolicyLossConfig(policy_loss="sapo", kl="low_var_kl+", beta=0.2, kl_is_clip=1.1,
                                       rollout_is="token_truncate", rollout_is_max=1.5),
    # DPPO: make_case's target probabilities are ~1e-3 and the old ones ~30% off, so these bounds drop ~10-40% of the
    # tokens (on either side, by the advantage's sign); delta truncates some weights
    "dppo_tv": PolicyLossConfig(policy_loss="dppo_tv", clip_low=3e-5, clip_high=6e-5, delta=1.2, kl="k3", beta=0.05),
    "dppo_kl": PolicyLossConfig(policy_loss="dppo_kl", clip_low=2e-6, clip_high=4e-6, rollout_is="token_mask",
                                rollout_is_max=1.5, entropy_coef=0.01, agg="seq-mean-token-mean"),
    # the Entropy Mechanism's covariance selections (batch-level: every backend's two passes): kl_cov's top fifth;
    # clip_cov with cov_ratio 1, so every candidate is dropped (no random draw to differ between two runs)
    "kl_cov": PolicyLossConfig(cov_mode="kl_cov", cov_ratio=0.2, kl_cov_coef=0.5, kl="k3", beta=0.05),
    "clip_cov": PolicyLossConfig(cov_mode="clip_cov", cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=1e6, clip_high=0.28,
                                 rollout_is="token_truncate", rollout_is_max=1.5, agg="seq-mean-token-mean"),
    "vespo_mis": PolicyLossConfig(policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                                  vespo_lambda_neg=1.0, rollout_is="token_mask", rollout_is_min=0.5,
                                  rollout_is_max=1.5, off_policy_mask=0.05, entropy_coef=0.01,
                                  agg="seq-mean-token-mean"),
}
BACKENDS = fused_backends()
#: The Triton interpreter runs every program in Python: a smaller vocabulary there.
VOCAB = {"triton": 257}
_CUDA_REASONS = (fused_rl.available_backends(torch.device("cuda")) if torch.cuda.is_available()
                 else dict.fromkeys(("torch", "triton", "cuda"), "no CUDA device"))


def device_backends(cpu=("torch", "cpu", "triton"), gpu=("torch", "triton", "cuda")):
    """``(device, backend)`` parameters: each of ``cpu`` that runs on CPU tensors here, then each of
    ``gpu`` on CUDA tensors, marked ``cuda`` (what ``bench/gpu_check.sh`` selects) and skipped without
    a GPU. Ids: the backend name on CPU, ``cuda-<backend>`` on the GPU."""
    params = [pytest.param("cpu", name, id=name) for name in cpu if name in BACKENDS]
    for name in gpu:
        reason = _CUDA_REASONS[name]
        params.append(pytest.param("cuda", name, id=f"cuda-{name}", marks=[
            pytest.mark.cuda, pytest.mark.skipif(reason is not None, reason=str(reason))]))
    return params


#: The token-local variants (``has_token_epilogue``), which the triton backend runs in one pass, and more
#: combinations of their options (token rollout masks with both bounds / truncation with a lower bound only).
SINGLE_PASS = {name: config for name, config in VARIANTS.items() if config.has_token_epilogue}
SINGLE_PASS.update({
    "tis_mask_sapo": PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5,
                                      rollout_is="token_mask", rollout_is_min=0.8, rollout_is_max=1.25, kl="abs+",
                                      beta=0.1),
    "tis_min_delta": PolicyLossConfig(delta=1.25, dual_clip=2.0, rollout_is="token_truncate", rollout_is_min=0.9,
                                      rollout_is_max=None, kl="k3", beta=0.1, kl_bias_correction=True,
                                      entropy_coef=0.01, agg="seq-mean-token-mean"),
})
needs_triton = pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend is unavailable here")


def is_weights(shape, seed: int = 0, per_sequence: bool = False) -> torch.Tensor:
    """Caller-side importance weights in ``[0, 2)`` with exact zeros (a masked-out sample), ``(B, T)`` or
    ``(B,)``."""
    g = torch.Generator().manual_seed(seed + 7)
    w = 2.0 * torch.rand(shape[:1] if per_sequence else shape, generator=g)
    w[1::4] = 0.0
    return w


def with_extras(case, config, seed: int = 0, weights: str = ""):
    """``case`` whose ``kwargs()`` also carry ``rollout_logprobs`` (the old / current log-probs moved by
    0.3 randn, so the weights fall on both sides of the bounds; NaN, unscored, at ~15% of the valid tokens) and
    ``truncated`` when ``config`` uses them, and ``rollout_is_weights`` of :func:`is_weights` with
    ``weights="token"`` / ``"sequence"``."""
    extra = {}
    if weights:
        extra["rollout_is_weights"] = is_weights(tuple(case.targets.shape), seed, weights == "sequence").to(
            case.targets.device)
    g = torch.Generator().manual_seed(seed + 99)
    if config.uses_rollout_logprobs:
        base = case.old if case.old is not None else fused_rl.reference.token_logprobs(
            case.logits.float(), torch.where(case.mask, case.targets, fused_rl.IGNORE_INDEX), check_inputs=False)
        rollout = (base + 0.3 * torch.randn(base.shape, generator=g).to(base.device)).clamp(max=0.0)
        # tokens the engine did not score (vLLM's None -> NaN): log-ratio 0 on every backend
        unscored = case.mask & (torch.rand(base.shape, generator=g).to(base.device) < 0.15)
        extra["rollout_logprobs"] = torch.where(unscored, float("nan"), rollout)
    if config.mask_truncated_completions:
        extra["truncated"] = torch.arange(case.targets.shape[0], device=case.targets.device) % 3 == 2
    base_kwargs = case.kwargs()
    case = copy.copy(case)
    case.kwargs = lambda: {**base_kwargs, **extra}
    return case


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_reference(name, device, backend, dtype):
    _compare_backend(device, backend, dtype, name, VARIANTS[name], (("randn", True, ""), ("peaked", False, ""),
                                                                    ("negative", True, "")))


def _compare_backend(device, backend, dtype, name, config, runs):
    """``compare_policy_loss`` on ragged 5 x 6 cases on ``device``, one per ``(logit kind, off-policy,
    weights)``."""
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")
    vocab = VOCAB.get(backend, 1000) if device == "cpu" else 1000
    for kind, off_policy, weights in runs:
        case = make_case(batch=5, length=6, vocab=vocab, kind=kind, dtype=dtype, seed=len(name),
                         off_policy=off_policy, per_token_adv=name == "gspo_token")
        compare_policy_loss(backend, with_extras(on_device(case, device), config, weights=weights), config)


@needs_triton
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("name", list(SINGLE_PASS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_single_pass(name, inplace, dtype, monkeypatch):
    """The token-local variants take the triton single-pass kernel, never the base composition, with
    the gradient in a new buffer or over the logits, and match the reference."""
    from fused_rl.backends import base, triton as tb

    calls = []
    for op in ("policy_fwd", "policy_fwd_inplace"):
        def spy(*args, _op=op, _fn=getattr(tb, op)):
            calls.append(_op)
            return _fn(*args)
        monkeypatch.setattr(tb, op, spy)
    composed = []
    original = base.Backend.policy_loss

    def base_spy(self, *args, **kwargs):
        composed.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(base.Backend, "policy_loss", base_spy)
    config = SINGLE_PASS[name]
    for kind, off_policy in (("randn", True), ("peaked", False)):
        case = make_case(batch=5, length=6, vocab=VOCAB["triton"], kind=kind, dtype=dtype, seed=len(name) + 1,
                         off_policy=off_policy)
        compare_policy_loss("triton", with_extras(case, config), config, inplace=inplace)
    assert calls == ["policy_fwd_inplace" if inplace else "policy_fwd"] * 2
    assert "triton" not in composed and composed == ["reference"] * 2


@needs_triton
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_triton_compile_fullgraph_token_rollout_is(inplace):
    """``torch.compile(fullgraph=True)`` of the single pass with token rollout correction (the
    rollout log-probs and the config literal through the custom op) matches eager, metrics included."""
    config = SINGLE_PASS["tis_mask_sapo"]
    case = with_extras(make_case(vocab=VOCAB["triton"], seed=4), config)

    def loss_fn(logits):
        logits = logits * 1.0  # a non-leaf, as from an lm_head (in-place mode overwrites it)
        out = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=config,
                                   backend="triton", check_inputs=False, inplace=inplace, **case.kwargs())
        return out.loss, out.metrics["rollout_is_mean"], out.metrics["rollout_is_clip_frac"]

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    eager = loss_fn(x1)
    (2.0 * eager[0]).backward()
    got = compiled(x2)
    (2.0 * got[0]).backward()
    assert 0 < eager[2] < 1  # some tokens masked, some kept
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x2.grad, x1.grad)


#: Caller-computed importance weights (verl's rollout_is_weights, Liger's vllm_is_ratio) on single-pass
#: configs (folded into the kernels' advantages) and on composition-only ones (gmpo, sequence masks).
WEIGHTED = {name: VARIANTS[name] for name in ("sapo", "delta", "k3+", "k1+", "tis_token", "gmpo", "off_policy_mask",
                                               "dppo_tv")}
WEIGHTED.update(ppo_dual=PolicyLossConfig(dual_clip=3.0, kl="k3", beta=0.1, entropy_coef=0.01),
                cispo=PolicyLossConfig(policy_loss="cispo", clip_high=0.5, kl="k2", beta=0.1),
                reinforce=PolicyLossConfig(policy_loss="reinforce", agg="seq-mean-token-sum"))


@pytest.mark.parametrize("name", list(WEIGHTED))
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_is_weights_backend_matches_reference(name, device, backend, dtype):
    _compare_backend(device, backend, dtype, name, WEIGHTED[name],
                     (("randn", True, "token"), ("negative", False, "sequence")))


@pytest.mark.parametrize("name", list(WEIGHTED))
@pytest.mark.parametrize("device,backend", device_backends())
def test_rollout_is_weights_fused_linear_matches_reference(name, device, backend):
    """torch_linear (the weights in its loss math) and the tiled kernels (folded into the advantages)."""
    config = WEIGHTED[name]
    vocab = VOCAB.get(backend, 1000) if device == "cpu" else 1000
    case = on_device(make_linear_case(batch=5, length=7, vocab=vocab, seed=len(name)), device)
    compare_linear(with_extras(case, config, weights="token"), config, backend=backend)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("device,backend", device_backends(cpu=("torch",)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_matches_reference(name, device, backend, dtype):
    """torch_linear on the CPU (the tiled kernels' variants: ``test_tiled_linear.py``), and on the GPU
    every backend (tiled for token-local configs without rollout correction, torch_linear otherwise)."""
    if not supports(backend, dtype, device):
        pytest.skip(f"{backend} does not take {dtype}")
    config = VARIANTS[name]
    case = on_device(make_linear_case(batch=5, length=7, vocab=1000, dtype=dtype, seed=len(name)), device)
    compare_linear(with_extras(case, config), config, backend=backend)


@pytest.mark.parametrize("name", ["gmpo", "mis_sequence", "off_policy_mask", "top_entropy"])
def test_fused_linear_small_tiles(name, monkeypatch):
    """Sequence-level variants over tiles that cut sequences (two passes), and the batch-level quantile."""
    from fused_rl.backends import torch_linear

    monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 3)
    config = VARIANTS[name]
    case = make_linear_case(batch=5, length=7, vocab=1000, seed=3, per_token_adv=True)
    compare_linear(with_extras(case, config), config)


@pytest.mark.parametrize("policy", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("device,backend", device_backends())
def test_dppo_zero_advantage_with_an_overflowed_ratio_adds_nothing(policy, device, backend):
    """A token with ``A = 0`` whose ratio overflows (an old log-prob of -9999, an engine's placeholder), kept by the
    trust region (``p - q >= -clip_low``), adds nothing (not ``inf * 0 = NaN``) on every backend, without ``delta``."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 3, 16, generator=g).to(device).requires_grad_(True)
    targets = torch.tensor([[1, 2, 3]], device=device)
    adv = torch.tensor([[1.0, 0.0, -1.0]], device=device)
    old = torch.tensor([[-2.0, -9999.0, -3.0]], device=device)
    out = fused_rl.policy_loss(logits, targets, adv, torch.ones(1, 3, dtype=torch.bool, device=device),
                               old_logprobs=old, config=PolicyLossConfig(policy_loss=policy, clip_low=0.1),
                               backend=backend)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 1] == 0).all() and (logits.grad[0, 0] != 0).any()


#: Ways to drop token (0, 1) of :func:`_dppo_dropped_case` (its ratio overflowed, its trust region keeps it): a zero
#: caller weight, a token rollout mask (rho = e^-20), the off-policy mask (row 0, A < 0, far from the behaviour
#: log-probs 0), the top-entropy quantile (its logits are peaked: the lowest entropy).
DROPS = {
    "weights": (dict(), lambda old: dict(rollout_is_weights=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))),
    "token_mask": (dict(rollout_is="token_mask", rollout_is_min=0.5),
                   lambda old: dict(rollout_logprobs=old + torch.tensor([[0.0, 30.0, 0.0], [0.0, 0.0, 0.0]]))),
    "off_policy_mask": (dict(off_policy_mask=0.0), lambda old: dict(rollout_logprobs=torch.zeros(2, 3))),
    "top_entropy": (dict(top_entropy_quantile=0.5), lambda old: dict()),
}


def _dppo_dropped_case(device):
    """Two rows of three tokens: row 0 with ``A = -1`` and token (0, 1)'s old log-prob -9999 (an engine's
    placeholder: its ratio overflows to inf, the trust region keeps it since ``p - q >= -clip_low``)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 3, 16, generator=g)
    logits[0, 1, 4] += 30.0
    old = torch.tensor([[-2.0, -9999.0, -3.0], [-2.5, -1.5, -3.0]])
    return (logits.to(device), torch.tensor([[1, 4, 3], [0, 5, 9]], device=device),
            torch.tensor([-1.0, 1.0], device=device), torch.ones(2, 3, dtype=torch.bool, device=device), old)


@pytest.mark.parametrize("drop", list(DROPS))
@pytest.mark.parametrize("policy", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "reference", id="reference")] + device_backends())
def test_dppo_dropped_token_with_an_overflowed_ratio_adds_nothing(drop, policy, device, backend):
    """A dropped token adds nothing, also where dppo's weight (no ``delta``) is its overflowed ratio: its gradient
    was ``0 * inf = NaN`` on the reference and torch (the zero scale times the infinite slope) and, for a token
    rollout mask, in the kernels (the rollout weight times ``dl/dlogp``). Each backend against the reference
    with the token's advantage-free equivalent: the same loss and gradients as with that token's ``A`` set to 0."""
    options, extra = DROPS[drop]
    config = PolicyLossConfig(policy_loss=policy, clip_low=0.1, **options)
    logits, targets, adv, mask, old = _dppo_dropped_case(device)
    kwargs = {k: v.to(device) for k, v in extra(old).items()}

    def run(advantages, backend):
        x = logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, targets, advantages, mask, old_logprobs=old.to(device), config=config,
                                   backend=backend, **kwargs)
        out.loss.backward()
        return out.loss, x.grad

    loss, grad = run(adv, backend)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad[0, 1])
    assert (grad[0, 1] == 0).all() and (grad[1] != 0).any()
    # the same with A = 0 on the dropped token (finite everywhere): the reference's values
    zero_adv = adv[:, None].expand(2, 3).clone()
    zero_adv[0, 1] = 0.0
    want_loss, want_grad = run(zero_adv, "reference")
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("drop", ["weights", "token_mask", "off_policy_mask"])
@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "reference", id="reference")] + device_backends())
def test_dppo_dropped_token_with_an_overflowed_ratio_fused_linear(drop, device, backend):
    """The same from hidden states: the weight and hidden gradients finite (they were NaN on the reference and
    torch_linear), equal to the reference's with the dropped token's ``A`` set to 0."""
    options, extra = DROPS[drop]
    config = PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.1, **options)
    _, targets, adv, mask, old = _dppo_dropped_case(device)
    g = torch.Generator().manual_seed(12)
    hidden, weight = torch.randn(2, 3, 8, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
    kwargs = {k: v.to(device) for k, v in extra(old).items()}

    def run(advantages, backend):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fused_rl.linear_policy_loss(h, w, targets, advantages, mask, old_logprobs=old.to(device),
                                          config=config, backend=backend, **kwargs)
        out.loss.backward()
        return out.loss, h.grad, w.grad

    got = run(adv, backend)
    assert all(torch.isfinite(t).all() for t in got), got
    zero_adv = adv[:, None].expand(2, 3).clone()
    zero_adv[0, 1] = 0.0
    for a, b in zip(got, run(zero_adv, "reference")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_truncated_rows_contribute_nothing():
    case = make_case(batch=4, length=5, vocab=100, seed=2)
    config = PolicyLossConfig(mask_truncated_completions=True)
    truncated = torch.tensor([False, True, False, True])
    logits = case.logits.clone().requires_grad_(True)
    out = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, truncated=truncated,
                               config=config, **case.kwargs())
    out.loss.backward()
    assert (logits.grad[truncated] == 0).all()
    expected = fused_rl.policy_loss(case.logits, case.targets, case.advantages, case.mask & ~truncated[:, None],
                                    **case.kwargs())
    torch.testing.assert_close(out.loss, expected.loss)


@pytest.mark.parametrize("device, backend", [pytest.param("cpu", "reference", id="reference"), *device_backends()])
def test_off_policy_mask_with_per_token_advantages_drops_the_negative_tokens(device, backend):
    """README: with advantages ``(B, T)`` the off-policy mask's ``A < 0`` is a per-token condition, so a sequence
    past ``delta`` keeps its ``A >= 0`` tokens: the loss of reinforce (``-A logp``, token mean over all 4 tokens)
    without the middle token, which is what the mask drops."""
    case = on_device(make_case(batch=1, length=4, vocab=VOCAB.get(backend, 100), seed=3), device)
    targets, mask = case.targets, torch.ones_like(case.mask)
    logp = torch.log_softmax(case.logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    adv = torch.tensor([[1.0, -1.0, 0.5, 2.0]], device=device)
    out = fused_rl.policy_loss(case.logits, targets, adv, mask, rollout_logprobs=(logp + 1.0).clamp(max=0).float(),
                               config=PolicyLossConfig(policy_loss="reinforce", off_policy_mask=0.1), backend=backend)
    kept = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=torch.float64, device=device)
    torch.testing.assert_close(out.loss.double(), -(adv.double() * logp * kept).sum() / 4, rtol=1e-5, atol=0)
    assert out.metrics["off_policy_mask_frac"].item() == 0.25


@pytest.mark.parametrize("kwargs, message", [
    (dict(config=PolicyLossConfig(rollout_is="token_mask")), "needs rollout_logprobs"),
    (dict(rollout_logprobs=torch.zeros(4, 5)), "only used with config.rollout_is or config.off_policy_mask"),
    (dict(config=PolicyLossConfig(mask_truncated_completions=True)), "needs truncated"),
    (dict(truncated=torch.zeros(4, dtype=torch.bool)), "only used with config.mask_truncated_completions"),
    (dict(config=PolicyLossConfig(mask_truncated_completions=True), truncated=torch.zeros(4)), "bool tensor"),
    (dict(config=PolicyLossConfig(mask_truncated_completions=True), truncated=torch.zeros(5, dtype=torch.bool)),
     "truncated must have shape"),
    (dict(config=PolicyLossConfig(rollout_is="token_mask"), rollout_logprobs=torch.zeros(4, 4)),
     "rollout_logprobs must have shape"),
    (dict(config=PolicyLossConfig(rollout_is="token_mask"), rollout_logprobs=torch.full((4, 5), float("-inf"))),
     "rollout_logprobs contain inf"),
    (dict(rollout_is_weights=torch.ones(4, 4)), "rollout_is_weights must have shape"),
    (dict(rollout_is_weights=torch.ones(4, 5, dtype=torch.long)), "rollout_is_weights must be a floating"),
    (dict(rollout_is_weights=-torch.ones(4)), "rollout_is_weights must be finite and >= 0"),
    (dict(rollout_is_weights=torch.full((4, 5), float("nan"))), "rollout_is_weights must be finite and >= 0"),
    (dict(config=PolicyLossConfig.preset("vespo"), rollout_is_weights=torch.ones(4)),
     "vespo' folds importance weights into its sequence weight"),
])
def test_bad_inputs_raise(kwargs, message):
    case = make_case(batch=4, length=5, vocab=100, seed=1)
    with pytest.raises(ValueError, match=message):
        fused_rl.policy_loss(case.logits, case.targets, case.advantages, case.mask, **kwargs)


def test_modules_pass_rollout_and_truncated():
    from fused_rl.nn import FusedPolicyLoss

    case = make_case(batch=4, length=5, vocab=100, seed=4)
    config = PolicyLossConfig(rollout_is="sequence_mask", rollout_is_max=2.0, mask_truncated_completions=True)
    extra = dict(rollout_logprobs=case.old - 0.1, truncated=torch.tensor([False, False, True, False]))
    got = FusedPolicyLoss(config)(case.logits, case.targets, case.advantages, case.mask, case.old, case.ref, **extra)
    expected = fused_rl.reference.policy_loss(case.logits, case.targets, case.advantages, case.mask, config=config,
                                              **case.kwargs(), **extra)
    torch.testing.assert_close(got.loss, expected.loss)


@pytest.mark.parametrize("rollout_is", ["token_mask", "sequence_mask"])
@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "reference", id="reference")] + device_backends())
def test_rollout_mask_keeps_a_weight_at_its_bound(device, backend, rollout_is):
    """``rho`` exactly at ``rollout_is_max`` (and at ``rollout_is_min``) is kept on every backend, as the reference
    (``min <= rho <= max``): rollout log-probs equal to the old ones give ``rho = 1``, so with the bounds at 1 the
    loss and gradient are those of the config without the correction (the kernels' epilogues compare on their
    own: a strict bound there would drop every token)."""
    case = on_device(make_case(batch=3, length=5, vocab=VOCAB.get(backend, 1000) if device == "cpu" else 1000,
                               seed=3), device)
    results = []
    for config in (PolicyLossConfig(), PolicyLossConfig(rollout_is=rollout_is, rollout_is_max=1.0),
                   PolicyLossConfig(rollout_is=rollout_is, rollout_is_min=1.0, rollout_is_max=3.0)):
        logits = case.logits.clone().requires_grad_(True)
        rollout = case.old.clone() if config.rollout_is else None
        out = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, old_logprobs=case.old,
                                   rollout_logprobs=rollout, config=config, backend=backend)
        out.loss.backward()
        results.append((out.loss, logits.grad))
    assert results[0][1].abs().max() > 0
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-6, atol=1e-7)
