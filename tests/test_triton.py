"""The Triton backend against the reference, on the CPU interpreter (``TRITON_INTERPRET=1``, set here
unless the environment says otherwise) and, marked ``cuda``, on a GPU (run with ``TRITON_INTERPRET=0``).

Small shapes (4 x 6 tokens) and ``BLOCK_V = 256`` keep the interpreter fast while every vocabulary
(1000, 4099) ends in a partial block.
"""

import dataclasses
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported (they are lazy)

import pytest
import torch

pytest.importorskip("triton")

import fused_rl  # noqa: E402
from fused_rl import PolicyLossConfig  # noqa: E402
from fused_rl.backends import get_backend  # noqa: E402
from fused_rl.loss_math import kl_estimator, metrics as loss_metrics, per_token_loss  # noqa: E402
from helpers import (CONFIGS, DPPO_AT_ONE, DPPO_EPILOGUE_CONFIGS, DPPO_NEAR_ONE, EPILOGUE_TIES,  # noqa: E402
                     LOGIT_KINDS, assert_close, assert_dppo_regions_reached, compare_policy_loss, make_case,
                     check_token_logprobs_inplace, make_logits, on_device, run_python,
                     triton_interpreter_reason)

# numpy warnings of the interpreter evaluating both branches of tl.where on masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
#: Why the CPU runs are skipped (None: they run): no interpreter asked for, or one that cannot run here (Triton
#: 3.6's with numpy 2.4, e.g.: the triton backend says so on the CPU, and the tests skip saying why).
CPU_REASON = triton_interpreter_reason() if INTERPRET else "CPU runs need TRITON_INTERPRET=1"

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(CPU_REASON is not None, reason=str(CPU_REASON))),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU and TRITON_INTERPRET unset/0")]),
]
TOKEN_CONFIGS = [c for c in CONFIGS if c.has_token_epilogue]


def cfg_id(c):
    return f"{c.policy_loss}-{c.kl}-{c.agg}-t{c.temperature}-e{c.entropy_coef}-d{c.dual_clip}"


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    from fused_rl.kernels import logits as K

    monkeypatch.setattr(K, "MAX_BLOCK_V", 256)
    return K


@pytest.fixture(params=["rows", "split"])
def layout(request, monkeypatch, small_blocks):
    """The single pass as the row kernel (a program a row) and split (``SPLIT_CHUNK = 256``: 4 programs a row at
    V = 1000, 17 at 4099, their statistics combined; two launches in the interpreter, one on a GPU)."""
    monkeypatch.setattr(small_blocks, "SPLIT_CHUNK", None if request.param == "rows" else 256)
    return request.param


# --------------------------------------------------------------------------- the epilogue helper
#: Each option of the epilogue alone and combined (the inputs below reach both sides of every bound).
EPILOGUE_CONFIGS = TOKEN_CONFIGS + [
    PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=2.0, kl="k1", beta=0.3),
    PolicyLossConfig(policy_loss="cispo", clip_low=0.0, clip_high=0.5, kl="k3", beta=0.2, entropy_coef=0.1),
    PolicyLossConfig(policy_loss="reinforce", kl="abs", beta=0.5, entropy_coef=0.03),
    PolicyLossConfig(kl="low_var_kl", beta=1.0),
    PolicyLossConfig(kl="k2", beta=0.0),  # kl metric without a KL term in the loss
    # sapo: default temperatures, then others on each side
    PolicyLossConfig(policy_loss="sapo"),
    PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=2.5, sapo_temperature_neg=0.4, kl="k2", beta=0.1),
    # TRL's two-sided delta, alone, with the dual clip, with a KL term
    PolicyLossConfig(clip_high=0.28, delta=1.5),
    PolicyLossConfig(clip_low=0.2, clip_high=0.2, delta=1.4, dual_clip=2.0, kl="k3", beta=0.1),
    # the straight-through estimators
    PolicyLossConfig(kl="k1+", beta=0.3),
    PolicyLossConfig(policy_loss="cispo", clip_high=0.3, kl="k3+", beta=0.2),
    PolicyLossConfig(policy_loss="reinforce", kl="abs+", beta=0.4, entropy_coef=0.02),
    PolicyLossConfig(policy_loss="sapo", kl="low_var_kl+", beta=0.5),
    # OpenRLHF's value clamp (both signs for k1) and unbiased_gradient's min(r, C)-weighted k2 gradient
    PolicyLossConfig(kl="k1", beta=0.3, kl_clamp=10.0),
    PolicyLossConfig(policy_loss="cispo", kl="k2", beta=0.2, kl_clamp=10.0, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="reinforce", kl="abs", beta=0.0, kl_clamp=5.0),
    PolicyLossConfig(kl="k1+", beta=0.3, kl_clamp=10.0, kl_is_clip=1.2),
    PolicyLossConfig(policy_loss="sapo", kl="k2+", beta=0.2, kl_clamp=10.0, kl_is_clip=1.2),
    PolicyLossConfig(kl="low_var_kl+", beta=0.5, kl_is_clip=0.9, rollout_is="token_mask", rollout_is_max=1.5),
    # kl_bias_correction (the kl output is r kl), also as a metric only and with a "+" estimator
    PolicyLossConfig(kl="k3", beta=0.3, kl_bias_correction=True),
    PolicyLossConfig(kl="abs", beta=0.0, kl_bias_correction=True),
    PolicyLossConfig(policy_loss="cispo", kl="low_var_kl+", beta=0.2, kl_bias_correction=True),
    PolicyLossConfig(policy_loss="sapo", kl="k1", beta=0.2, kl_bias_correction=True),
    # token rollout correction: truncate / mask with max only, min only, both
    PolicyLossConfig(rollout_is="token_truncate", rollout_is_max=1.5),
    PolicyLossConfig(rollout_is="token_truncate", rollout_is_min=0.7, rollout_is_max=None),
    PolicyLossConfig(policy_loss="sapo", rollout_is="token_truncate", rollout_is_min=0.7, rollout_is_max=1.5,
                     kl="k3", beta=0.1),
    PolicyLossConfig(rollout_is="token_mask", rollout_is_max=1.5, dual_clip=2.5),
    PolicyLossConfig(policy_loss="cispo", rollout_is="token_mask", rollout_is_min=0.7, rollout_is_max=None),
    PolicyLossConfig(policy_loss="reinforce", rollout_is="token_mask", rollout_is_min=0.7, rollout_is_max=1.5,
                     entropy_coef=0.05),
    # everything at once
    PolicyLossConfig(clip_high=0.28, delta=1.5, dual_clip=2.0, kl="k3+", beta=0.2, kl_bias_correction=True,
                     rollout_is="token_mask", rollout_is_min=0.6, rollout_is_max=1.6, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=0.8, kl="abs", beta=0.3, kl_bias_correction=True,
                     rollout_is="token_truncate", rollout_is_min=0.8, rollout_is_max=1.3, entropy_coef=-0.02),
] + DPPO_EPILOGUE_CONFIGS


def epi_id(c):
    parts = [c.policy_loss, str(c.kl), f"b{c.beta}"]
    if c.dual_clip is not None:
        parts.append(f"dual{c.dual_clip}")
    if c.delta is not None:
        parts.append(f"delta{c.delta}")
    if c.policy_loss == "sapo":
        parts.append(f"tau{c.sapo_temperature_pos}-{c.sapo_temperature_neg}")
    if c.kl_bias_correction:
        parts.append("biascorr")
    if c.kl_clamp is not None:
        parts.append(f"klclamp{c.kl_clamp}")
    if c.kl_is_clip is not None:
        parts.append(f"klis{c.kl_is_clip}")
    if c.rollout_is is not None:
        parts.append(f"{c.rollout_is}-{c.rollout_is_min}-{c.rollout_is_max}")
    if c.entropy_coef:
        parts.append(f"e{c.entropy_coef}")
    return "-".join(parts) + f"-{c.agg}-ch{c.clip_high}"


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("config", EPILOGUE_CONFIGS, ids=epi_id)
@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_matches_autograd_of_loss_math(config, on_policy, device):
    """``token_epilogue``'s (l, dl/dlogp, dl/dH, r, kl) against autograd of ``loss_math.per_token_loss``."""
    from fused_rl.kernels.epilogue import apply_epilogue

    g = torch.Generator().manual_seed(7)
    n = 512
    logp = (-5 * torch.rand(n, generator=g)).to(device)
    ent = (3 * torch.rand(n, generator=g)).to(device)
    old = None if on_policy else logp + 0.6 * torch.randn(n, generator=g).to(device)
    ref = logp + 8 * torch.randn(n, generator=g).to(device)  # |d| up to ~25: every low_var_kl clamp side
    adv = torch.randn(n, generator=g).to(device)
    valid = (torch.rand(n, generator=g) < 0.85).to(device)
    behaviour = logp if old is None else old
    rollout = None
    if config.rollout_is is not None:  # rho = exp(behaviour - rollout) in ~[0.3, 3]: both sides of the bounds
        rollout = behaviour + 0.4 * torch.randn(n, generator=g).to(device)
        rollout[~valid] = float("nan")
    logp[~valid] = float("nan")  # masked garbage must not leak
    # the reference in fp64: its own rounding is then not what the fp32 kernel is held to
    lp = logp.double().requires_grad_(True)
    h = ent.double().requires_grad_(True)
    view = lambda x: None if x is None else x.double().view(1, n)
    loss_t, ratio, kl, extras = per_token_loss(lp.view(1, n), view(adv), valid.view(1, n), config,
                                               old_logprobs=view(old), ref_logprobs=view(ref),
                                               entropy=h.view(1, n), rollout_logprobs=view(rollout))
    loss_t.sum().backward()
    got = apply_epilogue(logp, ent, old, ref, adv, valid, config, rollout=rollout)
    names = ("loss", "dloss/dlogp", "dloss/dH", "ratio", "kl")
    h_grad = h.grad if h.grad is not None else torch.zeros_like(h)
    expected = (loss_t.view(n), lp.grad, h_grad, ratio.view(n), kl.view(n) if kl is not None else None)
    for name, a, b in zip(names, got, expected):
        if b is None:
            continue
        torch.testing.assert_close(a, b.detach().float(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # both sides of every clip, bound and mask are exercised
    r, a = ratio.detach().view(n)[valid], adv[valid]
    if not on_policy and config.policy_loss == "ppo_clip":
        mets = loss_metrics(ratio.detach(), adv.view(1, n), valid.view(1, n), config, None, None, extras)
        assert 0 < mets["clip_frac_low"] and 0 < mets["clip_frac_high"] and mets["clip_frac"] < 1
        if config.dual_clip is not None:
            assert 0 < mets["clip_frac_dual"] < 1
        if config.delta is not None:  # the delta bound binds (A < 0) and is passed (A > 0)
            assert ((r > config.delta) & (a < 0)).any() and ((r > config.delta) & (a > 0)).any()
    if not on_policy:
        assert_dppo_regions_reached(config, logp[valid], old[valid], a)
    if config.kl is not None and config.kl.startswith("low_var_kl"):
        d = (ref - logp)[valid]
        assert (d > 20).any() and (d < -20).any() and ((d.abs() < 2)).any()
    if config.kl_clamp is not None:  # cut on each side the estimator reaches, kept elsewhere
        value = kl_estimator(logp[valid], ref[valid], config.kl.rstrip("+"))
        assert (value > config.kl_clamp).any() and (value.abs() < config.kl_clamp).any()
        assert (value < -config.kl_clamp).any() == (config.kl.rstrip("+") == "k1")
    if config.kl_is_clip is not None and not on_policy:
        assert (r > config.kl_is_clip).any() and (r < config.kl_is_clip).any()
    if config.rollout_is is not None:
        rho = extras["rollout_rho"].view(n)[valid]
        lo, hi = config.rollout_is_min, config.rollout_is_max
        inside = torch.ones_like(rho, dtype=torch.bool)
        for bound, outside in ((lo, rho < (lo or 0.0)), (hi, rho > (hi or 0.0))):
            if bound is not None:
                assert outside.any()
                inside &= ~outside
        assert inside.any()
        if config.rollout_is == "token_mask":
            assert (extras["rollout_is"].view(n)[valid] == 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_dppo_binary_kl_near_one(device):
    """The Triton binary KL where ``p ~ 1`` (its ``1e-8`` smoothing, against ``1e-6``, decides:
    ``helpers.DPPO_NEAR_ONE``; without any, ``helpers.DPPO_AT_ONE``)."""
    from fused_rl.kernels.epilogue import apply_epilogue

    near = DPPO_NEAR_ONE
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    got = apply_epilogue(f(near["logp"]), f([0.0, 0.0]), f(near["old"]), None, f(near["adv"]),
                         torch.ones(2, dtype=torch.bool, device=device), near["config"])
    torch.testing.assert_close(got[1].cpu(), torch.tensor(near["slopes"]))


# --------------------------------------------------------------------------- policy_loss vs reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ci", range(len(CONFIGS)), ids=lambda i: cfg_id(CONFIGS[i]))
@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_matches_reference(ci, dtype, device, layout):
    kind = LOGIT_KINDS[ci % len(LOGIT_KINDS)]
    case = on_device(make_case(vocab=1000, kind=kind, dtype=dtype, seed=3 + ci), device)
    compare_policy_loss("triton", case, CONFIGS[ci])


@pytest.mark.parametrize("kind,dtype", [(k, torch.float32) for k in LOGIT_KINDS] + [("peaked", torch.float16)])
@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_logit_kinds_on_policy_per_token_adv(kind, dtype, device, layout):
    cfg = PolicyLossConfig(clip_low=0.1, clip_high=0.3, dual_clip=3.0, kl="k3", beta=0.05, entropy_coef=0.01,
                           temperature=0.8)
    case = on_device(make_case(vocab=1000, kind=kind, dtype=dtype, seed=11, off_policy=False, per_token_adv=True),
                     device)
    compare_policy_loss("triton", case, cfg)


@pytest.mark.parametrize("device", DEVICES)
def test_vocab_4099_sliced_view_int32_targets_temperature(device, monkeypatch, small_blocks, layout):
    """V = 4099 (partial last block), a non-contiguous ``logits[:, :-1]`` view (no copy), int32 targets,
    and a capped grid: 2 programs loop over the row tiles."""
    monkeypatch.setattr(small_blocks, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(small_blocks, "TILE_ELEMENTS", 512)  # 2 rows of 256 per tile: 8 tiles for 15 rows
    case = on_device(make_case(batch=3, length=5, vocab=4099, seed=5), device)
    full = make_logits((3, 6, 4099), "peaked", generator=torch.Generator().manual_seed(1)).to(device)
    case.logits = full[:, :-1]  # sliced on the device: moving a view there would copy it to a contiguous tensor
    case.targets = case.targets.to(torch.int32)
    assert not case.logits.is_contiguous()
    cfg = PolicyLossConfig(policy_loss="cispo", clip_high=0.2, kl="low_var_kl", beta=0.1, temperature=1.7,
                           entropy_coef=0.02)
    compare_policy_loss("triton", case, cfg, token_normalizer=torch.tensor(7.0, device=device))
    compare_policy_loss("triton", case, CONFIGS[2])  # gspo: the two-pass composition on the same view
    for cfg in CONFIGS:  # every other config without a token epilogue (kl_bias_correction) goes the same way
        if not cfg.has_token_epilogue and not cfg.is_sequence_level:
            compare_policy_loss("triton", case, cfg)


@pytest.mark.parametrize("device", DEVICES)
def test_token_normalizer_and_compute_entropy_off(device):
    case = on_device(make_case(vocab=1000, seed=8, dtype=torch.bfloat16), device)
    cfg = PolicyLossConfig(clip_high=0.28)
    compare_policy_loss("triton", case, cfg, token_normalizer=13)
    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    off = _loss(case, x1, cfg, backend="triton", token_normalizer=13, compute_entropy=False)
    on = _loss(case, x2, cfg, backend="triton", token_normalizer=13)
    off.loss.backward()
    on.loss.backward()
    assert off.entropy is None and "entropy_mean" not in off.metrics
    torch.testing.assert_close(off.loss, on.loss)
    torch.testing.assert_close(x1.grad, x2.grad)


# --------------------------------------------------------------------------- token_logprobs (two passes)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_grad_of_both_outputs(temperature, dtype, device):
    g = torch.Generator().manual_seed(2)
    x = make_logits((2, 5, 1000), "peaked", dtype=dtype, generator=g).to(device)
    t = torch.randint(0, 1000, (2, 5), generator=g).to(device)
    t[0, 0] = fused_rl.IGNORE_INDEX
    wl, we = torch.randn(2, 5, generator=g).to(device), torch.randn(2, 5, generator=g).to(device)
    results = {}
    for backend in ("reference", "triton"):
        xb = (x.float() if backend == "reference" else x).clone().requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xb, t, temperature=temperature, return_entropy=True, backend=backend)
        ((lp * wl).sum() + (ent * we).sum()).backward()
        results[backend] = (lp, ent, xb.grad)
    for a, b, what in zip(results["triton"], results["reference"], ("logp", "entropy", "grad")):
        assert_close(a, b, dtype, what, grad=what == "grad")
    assert results["triton"][0][0, 0] == 0 and results["triton"][2][0, 0].abs().max() == 0
    assert results["triton"][2].dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 1000), (7, 4099), (2, 2, 3, 257)], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_inplace(shape, dtype, device):
    check_token_logprobs_inplace("triton", shape, dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_shapes_int32_and_logp_only_grad(device, monkeypatch, small_blocks):
    """2-D ``(N, V)`` and 4-D inputs, int32 targets, a row-strided 2-D view, gradient of logp only;
    a single program looping over all row tiles."""
    monkeypatch.setattr(small_blocks, "MAX_PROGRAMS", 1)
    monkeypatch.setattr(small_blocks, "TILE_ELEMENTS", 512)
    g = torch.Generator().manual_seed(4)
    base = make_logits((7, 1100), "negative", generator=g).to(device)
    x2 = base[:, :1000]  # row stride 1100
    t = torch.randint(0, 1000, (7,), generator=g, dtype=torch.int32).to(device)
    xa = x2.clone().requires_grad_(True)
    xb = x2.clone().requires_grad_(True)
    ref = fused_rl.token_logprobs(xa, t, backend="reference")
    got = fused_rl.token_logprobs(xb, t, backend="triton")
    ref.sum().backward()
    got.sum().backward()
    assert_close(got, ref, torch.float32, "logp")
    assert_close(xb.grad, xa.grad, torch.float32, "grad", grad=True)
    x4 = make_logits((2, 2, 3, 257), generator=g).to(device)
    t4 = torch.randint(0, 257, (2, 2, 3), generator=g).to(device)
    lp, ent = fused_rl.token_logprobs(x4, t4, return_entropy=True, backend="triton")
    lp_r, ent_r = fused_rl.token_logprobs(x4, t4, return_entropy=True, backend="reference")
    assert_close(lp, lp_r, torch.float32, "logp 4d")
    assert_close(ent, ent_r, torch.float32, "entropy 4d")


# --------------------------------------------------------------------------- single-pass specifics
def _loss(case, logits, cfg, **kw):
    return fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=cfg, **case.kwargs(), **kw)


@pytest.mark.parametrize("vocab", [1000, 100])
@pytest.mark.parametrize("device", DEVICES)
def test_grad_loop_order_and_cache_hints_change_nothing(device, vocab, monkeypatch, small_blocks):
    """The single pass's tuning knobs (gradient loop from the row's end, eviction hints, prefetch of the
    next block): the reference's values, bitwise the same whatever their setting; V = 1000 in blocks of
    256 (a partial last block) and V = 100 (one partial block: the prefetch past it loads nothing)."""
    case = on_device(make_case(vocab=vocab, seed=4, dtype=torch.bfloat16), device)
    outs = []
    for reverse, hints, prefetch in ((False, False, False), (True, False, False), (True, True, False),
                                     (False, False, True), (True, True, True)):
        monkeypatch.setattr(small_blocks, "GRAD_REVERSE", reverse)
        monkeypatch.setattr(small_blocks, "CACHE_HINTS", hints)
        monkeypatch.setattr(small_blocks, "PREFETCH", prefetch)
        x = case.logits.clone().requires_grad_(True)
        out = _loss(case, x, CONFIGS[1], backend="triton")
        out.loss.backward()
        outs.append((out.loss, out.logprobs, out.entropy, x.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    compare_policy_loss("triton", case, CONFIGS[1])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_scaling_and_single_backward(device, layout):
    """The stored gradient is scaled by ``grad_output`` on the device (no ``== 1`` host check)."""
    case = on_device(make_case(vocab=1000, seed=9), device)
    cfg = CONFIGS[1]
    xr = case.logits.clone().requires_grad_(True)
    xt = case.logits.clone().requires_grad_(True)
    (_loss(case, xr, cfg, backend="reference").loss * -2.5).backward()
    out = _loss(case, xt, cfg, backend="triton")
    (out.loss * -2.5).backward()
    assert_close(xt.grad, xr.grad, torch.float32, "scaled dlogits", grad=True)
    out2 = _loss(case, case.logits.clone().requires_grad_(True), cfg, backend="triton")
    out2.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        out2.loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_writes_grad_over_logits(dtype, device, layout):
    case = on_device(make_case(vocab=1000, seed=10, dtype=dtype), device)
    full = make_logits((4, 7, 1000), generator=torch.Generator().manual_seed(3), dtype=dtype).to(device)
    case.logits = full[:, 1:].clone()
    cfg = CONFIGS[5]  # temperature 0.7, entropy bonus
    xr = case.logits.float().clone().requires_grad_(True)
    _loss(case, xr, cfg, backend="reference").loss.backward()
    # a non-leaf, non-contiguous view as from an HF model: the gradient lands in its storage
    buf = full.clone().requires_grad_(True)
    view = buf * 1.0
    logits = view[:, 1:]
    out = _loss(case, logits, cfg, backend="triton", inplace=True)
    out.loss.backward()
    assert_close(buf.grad[:, 1:], xr.grad, dtype, "inplace dlogits", grad=True)
    assert (buf.grad[:, 0] == 0).all()
    assert_close(logits.detach(), xr.grad, dtype, "logits storage holds dlogits", grad=True)
    assert_close(view.detach()[:, 0], full[:, 0], dtype, "untouched column")


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_ignored_for_leaf(device):
    """Over a leaf the gradient would alias its own ``.grad``: ``inplace=True`` is then not taken."""
    case = on_device(make_case(batch=3, length=4, vocab=300, seed=2), device)
    x = case.logits.clone().requires_grad_(True)
    _loss(case, x, CONFIGS[0], backend="triton", inplace=True).loss.backward()
    xr = case.logits.clone().requires_grad_(True)
    _loss(case, xr, CONFIGS[0], backend="reference").loss.backward()
    assert torch.equal(x.detach(), case.logits) and x.grad.data_ptr() != x.data_ptr()
    assert_close(x.grad, xr.grad, torch.float32, "dlogits", grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_failed_check_writes_nothing(device):
    case = on_device(make_case(vocab=1000, seed=12), device)
    case.targets[2, 0] = 1000  # out of range where mask is set
    case.mask[2, 0] = True
    logits = case.logits.clone().requires_grad_(True)
    before = logits.detach().clone()
    with pytest.raises(ValueError, match="targets must be in"):
        _loss(case, logits, CONFIGS[0], backend="triton", inplace=True)
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_path_matches(device, layout):
    case = on_device(make_case(vocab=1000, seed=13), device)
    with torch.no_grad():
        got = _loss(case, case.logits, CONFIGS[3], backend="triton")
        ref = _loss(case, case.logits, CONFIGS[3], backend="reference")
    assert got.loss.grad_fn is None
    assert_close(got.loss, ref.loss, torch.float32, "loss")
    for k in ref.metrics:
        assert_close(got.metrics[k], ref.metrics[k], torch.float32, k)


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_bonus_with_compute_entropy_off(device):
    """``compute_entropy=False`` with a config that needs the entropy (``entropy_coef``): the single pass still
    computes it for the loss (its gradient term included) and returns it, as the reference does."""
    case = on_device(make_case(vocab=1000, seed=14), device)
    cfg = PolicyLossConfig(clip_high=0.28, entropy_coef=0.2)
    outs, grads = {}, {}
    for backend in ("reference", "triton"):
        x = case.logits.clone().requires_grad_(True)
        outs[backend] = _loss(case, x, cfg, backend=backend, compute_entropy=False)
        outs[backend].loss.backward()
        grads[backend] = x.grad
    got, want = outs["triton"], outs["reference"]
    assert got.entropy is not None and set(got.metrics) == set(want.metrics)
    assert_close(got.entropy, want.entropy, torch.float32, "entropy")
    assert_close(got.loss, want.loss, torch.float32, "loss")
    assert_close(grads["triton"], grads["reference"], torch.float32, "dlogits", grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_writes_no_gradient(device, monkeypatch):
    """Under ``torch.no_grad`` logits that require grad get no gradient buffer (the single pass runs with
    ``write_grad=False``), and ``inplace=True`` leaves them intact (nothing to write)."""
    from fused_rl.backends import triton as triton_backend

    calls = []
    for name in ("policy_fwd", "policy_fwd_inplace"):
        op = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name, lambda *a, op=op, name=name: calls.append((name, a[-1])) or op(*a))
    case = on_device(make_case(vocab=300, seed=15), device)
    buf = case.logits.clone().requires_grad_(True)
    logits = buf * 1.0  # a non-leaf model output
    before = logits.detach().clone()
    with torch.no_grad():
        out = _loss(case, logits, CONFIGS[1], backend="triton", inplace=True)
        ref = _loss(case, case.logits, CONFIGS[1], backend="reference")
    assert calls == [("policy_fwd", False)]
    assert torch.equal(logits.detach(), before)
    assert_close(out.loss, ref.loss, torch.float32, "loss")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_per_token_inputs(device, monkeypatch, small_blocks):
    """Per-token inputs that are strided views (every other column of a wider tensor: a flat view with stride
    2, not a copy) reach the kernels as the values they view: old / ref log-probs of the single pass, targets of
    the two-pass ``token_logprobs``."""
    case = on_device(make_case(vocab=500, seed=16), device)
    wide = lambda x: torch.stack([x, torch.full_like(x, -7.0)], -1).flatten(1)[:, ::2]  # noqa: E731
    case.old, case.ref = wide(case.old), wide(case.ref)
    assert case.old.reshape(-1).stride() == (2,)
    compare_policy_loss("triton", case, CONFIGS[1])
    g = torch.Generator().manual_seed(1)
    x = make_logits((3, 4, 500), generator=g).to(device)
    t = torch.randint(0, 500, (3, 8), generator=g).to(device)[:, ::2]
    lp, ent = fused_rl.token_logprobs(x, t, return_entropy=True, backend="triton")
    lp_r, ent_r = fused_rl.token_logprobs(x, t.contiguous(), return_entropy=True, backend="reference")
    assert_close(lp, lp_r, torch.float32, "logp")
    assert_close(ent, ent_r, torch.float32, "entropy")


def test_float64_logits_are_refused_by_name():
    """The kernels take fp32 / bf16 / fp16: fp64 logits on ``backend="triton"`` raise before any kernel runs."""
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    t = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="does not support torch.float64"):
        fused_rl.token_logprobs(x, t, backend="triton")


COMPILE_CASES = [
    pytest.param(1, False, "aot_eager", id="ppo-dual-k3-ent"),
    pytest.param(1, True, "aot_eager", id="ppo-dual-k3-ent-inplace"),
    pytest.param(2, False, "aot_eager", id="gspo"),
    pytest.param(1, False, "inductor", id="ppo-inductor", marks=pytest.mark.skipif(
        not HAS_CUDA or INTERPRET, reason="inductor variant on CUDA only")),
]


@pytest.mark.parametrize("ci,inplace,compile_backend", COMPILE_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(ci, inplace, compile_backend, device):
    """``torch.compile(fullgraph=True)`` traces policy_loss (no graph break) and matches eager, with a
    ``grad_output`` of 2 (the on-device scaling of the stored gradient)."""
    case = on_device(make_case(vocab=257, seed=4), device)
    cfg = CONFIGS[ci]

    def loss_fn(logits):
        logits = logits * 1.0  # a non-leaf, as from an lm_head (in-place mode overwrites it)
        out = fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=cfg,
                                   backend="triton", check_inputs=False, inplace=inplace, **case.kwargs())
        return out.loss, out.metrics["clip_frac"]

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=compile_backend)
    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    l1, c1 = loss_fn(x1)
    (2.0 * l1).backward()
    l2, c2 = compiled(x2)
    (2.0 * l2).backward()
    torch.testing.assert_close(l2, l1)
    torch.testing.assert_close(c2, c1)
    torch.testing.assert_close(x2.grad, x1.grad)


def test_kernels_compile_for_sm90():
    """Ahead-of-time code generation for sm_90 (no GPU needed): what the interpreter cannot check."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "bench", "compile_sm90.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr):
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sm_90 compile OK" in res.stdout
    import re

    locals_ = re.findall(r"LOCAL:(\d+)", res.stdout)
    assert locals_ and all(v == "0" for v in locals_), res.stdout  # no register spills
    for line in res.stdout.splitlines():  # 16-byte vector loads of the logits at V = 151936
        if line.startswith(("bf16 stats", "bf16 grad", "bf16 policy", "bf16 scale")):
            assert "vec16" in line, line
    # the eviction hints reach the PTX; a barrier orders the target logit's load before the block stores
    assert "bf16 policy REVERSE=1 HINTS=1 PREFETCH=0 cache-hints ordered" in res.stdout
    assert "bf16 policy REVERSE=1 HINTS=1 PREFETCH=1 cache-hints ordered" in res.stdout
    # the split pass's synchronization in the PTX (barrier, acq_rel arrival, acquire wait, L2 reads), and one row
    assert "UNORDERED" not in res.stdout and "bf16 policy split CHUNK=8192 warps=4 ordered" in res.stdout
    assert "bf16 policy split N=1" in res.stdout
    assert "bf16 policy bench-config SASS loops:" in res.stdout  # the instruction counts docs/triton.md cites
    # the first split candidate (the sweep's first, kernels/logits.py SPLIT_CANDIDATES) issues fewer sm_90
    # instructions a column than the row kernel (where nvdisasm is there to count them)
    row = re.search(r"bf16 policy bench-config SASS loops:\S* a block \(([\d.]+) a column\)", res.stdout)
    split = re.search(r"bf16 policy split CHUNK=\d+ warps=\d+ ordered SASS/column:([\d.]+)", res.stdout)
    assert row and split, res.stdout
    if float(row.group(1)) > 0:
        assert float(split.group(1)) < float(row.group(1)), (split.group(0), row.group(0))


# --------------------------------------------------------------------------- availability, heuristics
def test_unavailable_reason(monkeypatch):
    be = get_backend("reference", torch.device("cpu"))  # registry import
    from fused_rl.backends import _REGISTRY

    tb = _REGISTRY["triton"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine, compiled kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tb.unavailable_reason(torch.device("cuda")) is None
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tb.unavailable_reason(torch.device("cpu")) == triton_interpreter_reason()  # None where it runs
    monkeypatch.delenv("TRITON_INTERPRET")
    reason = tb.unavailable_reason(torch.device("cpu"))
    assert isinstance(reason, str) and "CUDA" in reason
    with pytest.raises(RuntimeError, match="cannot run"):
        get_backend("triton", torch.device("cpu"))
    assert get_backend("auto", torch.device("cpu")).name != "triton"
    assert be.name == "reference"


def test_old_interpreter_with_new_numpy_names_the_reason(monkeypatch):
    """Triton < 3.7's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses: the
    backend says so instead of failing inside the first kernel; so does a Triton older than ``MIN_TRITON`` (3.4),
    compiled too (3.1's frontend refuses the kernels)."""
    import numpy
    import triton

    from fused_rl.backends import _REGISTRY
    from fused_rl.backends import triton as triton_backend

    tb = _REGISTRY["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for triton_version, numpy_version, broken in [("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False),
                                                   ("3.7.0", "2.5.2", False), ("3.10.1", "2.4.0", False)]:
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        triton_backend._CHECKS.clear()
        reason = tb.unavailable_reason(torch.device("cpu"))
        if broken:
            assert "triton >= 3.7 or numpy < 2.4" in reason, reason
        else:
            assert reason is None, (triton_version, numpy_version, reason)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    triton_backend._CHECKS.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels on a GPU are not affected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tb.unavailable_reason(torch.device("cuda")) is None
    for old in ("3.1.0", "3.3.1"):  # older than the kernels need: unavailable, compiled or not
        monkeypatch.setattr(triton, "__version__", old)
        triton_backend._CHECKS.clear()
        assert f"triton {old} is older than 3.4" in tb.unavailable_reason(torch.device("cuda"))
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    triton_backend._CHECKS.clear()
    assert tb.unavailable_reason(torch.device("cuda")) is None
    monkeypatch.undo()
    triton_backend._CHECKS.clear()


def test_missing_triton_registers_a_reason():
    """Without triton, importing fused_rl works and backend='triton' names the reason."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now raises ImportError\n"
        "import torch, fused_rl\n"
        "r = fused_rl.available_backends(torch.device('cuda'))['triton']\n"
        "assert r and 'not installed' in r, r\n"
        "try:\n"
        "    fused_rl.token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), backend='triton')\n"
        "except RuntimeError as e: print('OK', e)\n"
    )
    res = run_python(code)
    assert res.returncode == 0 and "OK backend 'triton' is unavailable" in res.stdout, res.stderr[-2000:]


def test_block_heuristic(monkeypatch):
    from fused_rl.kernels import logits as K

    monkeypatch.setattr(K, "MAX_BLOCK_V", None)
    assert K.block_config(151936, torch.bfloat16) == (1, 8192, 8)
    assert K.block_config(151936, torch.float32) == (1, 4096, 8)
    assert K.block_config(1000, torch.bfloat16) == (4, 1024, 8)
    monkeypatch.setattr(K, "MAX_BLOCK_V", 256)
    assert K.block_config(1000, torch.float32) == (16, 256, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA device")
def test_triton_is_not_available_for_cuda_without_a_device():
    """``fused_rl.info`` and ``auto`` on a CUDA device need one: without it the triton backend says so."""
    assert "no CUDA device" in fused_rl.available_backends(torch.device("cuda"))["triton"]


# --------------------------------------------------------------------------- CUDA-only scale checks
def _gpu_backend_or_skip(backend):
    reason = fused_rl.available_backends(torch.device("cuda"))[backend]
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_large_vocab_default_blocks(backend, monkeypatch):
    """V = 151936 (Qwen) bf16 with the default block sizes, against the reference (the CUDA C++ kernel
    too: its per-row loop and L2 re-read at a real vocabulary)."""
    from fused_rl.kernels import logits as K

    _gpu_backend_or_skip(backend)
    monkeypatch.setattr(K, "MAX_BLOCK_V", None)
    case = on_device(make_case(batch=4, length=16, vocab=151936, dtype=torch.bfloat16, seed=1), "cuda")
    compare_policy_loss(backend, case, CONFIGS[1])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_many_rows_and_int64_offsets(backend, monkeypatch):
    """N > 65,535 rows, and N * V > 2^31 elements (offsets past int32)."""
    from fused_rl.kernels import logits as K

    _gpu_backend_or_skip(backend)
    monkeypatch.setattr(K, "MAX_BLOCK_V", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = 70_000, 512
    x = torch.randn(1, n, v, device="cuda", generator=g)
    t = torch.randint(0, v, (1, n), device="cuda", generator=g)
    got = fused_rl.token_logprobs(x, t, backend=backend)
    ref = fused_rl.token_logprobs(x, t, backend="reference")
    assert_close(got, ref, torch.float32, "70k rows")
    n, v = 14_200, 151_936  # 2.16e9 elements of bf16 (4.3 GB)
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    xr = x.detach().requires_grad_(True)
    lp = fused_rl.token_logprobs(xr, t, backend=backend)
    lp[-8:].sum().backward()
    tail = x[-8:].float().requires_grad_(True)
    lp_ref = torch.log_softmax(tail, -1).gather(-1, t[-8:].long().unsqueeze(-1)).squeeze(-1)
    lp_ref.sum().backward()
    assert_close(lp[-8:], lp_ref, torch.bfloat16, "logp past 2^31")
    assert_close(xr.grad[-8:], tail.grad, torch.bfloat16, "grad past 2^31", grad=True)
    assert xr.grad[:-8].abs().max() == 0


class _OneProgramMissing:
    """Stands in for ``_policy_split_kernel``: after the interpreter's PHASE 1 launch, row ``row``'s arrival count
    is one short, as if one of its programs had never arrived (what the GPU's wait gives up on)."""

    def __init__(self, kernel, row):
        self.kernel, self.row = kernel, row

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            if kwargs["PHASE"] == 1:
                kwargs["sync_ptr"][self.row] -= 1
        return launch


@pytest.mark.parametrize("device", DEVICES[:1])
def test_split_row_with_a_missing_program_is_nan_not_a_partial_sum(device, monkeypatch, small_blocks):
    """The split single pass combines a row's statistics only once all its programs have arrived; where they did
    not (on a GPU: the wait gave up after ``MAX_POLLS``), that row's log-prob, loss and ``dlogits`` are NaN (so the
    loss is NaN), not values from part of the row; every other row is as when all arrived."""
    monkeypatch.setattr(small_blocks, "SPLIT_CHUNK", 256)
    case = on_device(make_case(batch=3, length=4, vocab=1000, seed=21), device)
    bad = int((case.mask & (case.targets != fused_rl.IGNORE_INDEX)).flatten().nonzero()[-1])  # a loss token's row
    results = []
    for kernel in (small_blocks._policy_split_kernel, _OneProgramMissing(small_blocks._policy_split_kernel, bad)):
        monkeypatch.setattr(small_blocks, "_policy_split_kernel", kernel)
        x = case.logits.clone().requires_grad_(True)
        out = _loss(case, x, CONFIGS[1], backend="triton")
        out.loss.backward()
        results.append((out.loss, out.logprobs.flatten(), x.grad.flatten(0, 1)))
    (loss, logp, grad), (bad_loss, bad_logp, bad_grad) = results
    assert torch.isfinite(loss) and torch.isnan(bad_loss)
    assert torch.isnan(bad_logp[bad]) and torch.isnan(bad_grad[bad]).all()
    others = torch.arange(logp.numel()) != bad
    assert torch.equal(bad_logp[others], logp[others]) and torch.equal(bad_grad[others], grad[others])


@pytest.mark.parametrize("device", DEVICES[:1])
def test_split_one_launch_form_in_the_interpreter(device, monkeypatch, small_blocks):
    """The GPU's one-launch form (``PHASE`` 0: tickets, the wait, the give-up) where programs run one after the
    other, with the wait cut to 3 polls: a row's last program finds all of the row arrived and writes its chunk as
    the row kernel does (the ticket -> (row, chunk) map and the statistics read after the wait); each earlier one
    waits for programs that have not run, gives up (the first one waiting out its 3 polls, the rest at once on the
    flag it set), and makes its chunk NaN and the loss NaN; ignored rows wait for nothing and stay 0."""
    monkeypatch.setattr(small_blocks, "SPLIT_CHUNK", 256)
    case = on_device(make_case(batch=3, length=4, vocab=1000, seed=22), device)
    x = case.logits.clone().requires_grad_(True)
    _loss(case, x, CONFIGS[1], backend="triton").loss.backward()
    syncs = []
    original = small_blocks._policy_split_kernel

    class _KeepSync:  # the launch's counters: the tickets taken and the give-up flag
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                syncs.append(kwargs["sync_ptr"])
                return original[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(small_blocks, "_policy_split_kernel", _KeepSync())
    monkeypatch.setattr(small_blocks, "_split_phases", lambda: (0,))
    monkeypatch.setattr(small_blocks, "SPLIT_MAX_POLLS", 3)
    y = case.logits.clone().requires_grad_(True)
    out = _loss(case, y, CONFIGS[1], backend="triton")
    out.loss.backward()
    assert torch.isnan(out.loss)
    (sync,) = syncs
    n = case.mask.numel()
    assert sync[n] == 4 * n and sync[n + 1] == 1  # every item ticketed once; the flag set
    valid = (case.mask & (case.targets != fused_rl.IGNORE_INDEX)).flatten()
    got, want = y.grad.flatten(0, 1), x.grad.flatten(0, 1)
    last = 3 * 256  # the last of the 4 chunks of V = 1000
    assert valid.any() and (~valid).any()
    torch.testing.assert_close(got[valid, last:], want[valid, last:], rtol=1e-5, atol=1e-7)
    assert torch.isnan(got[valid, :last]).all()
    assert (got[~valid] == 0).all()


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("device", DEVICES)
def test_split_pass_on_drawn_shapes(seed, device, monkeypatch, small_blocks):
    """The split single pass against the reference on drawn shapes: vocabularies from 17 to 1100 over chunks of 16,
    64 or 256 columns (2 to 69 programs a row, the last chunk partial or not), 1-3 x 1-5 tokens, every logit kind
    and dtype, a token-level config drawn from the suite's."""
    import random

    draw = random.Random(seed)
    chunk = draw.choice([16, 64, 256])
    vocab = draw.choice([2 * chunk, 3 * chunk + 1, draw.randint(17, 1100), draw.randint(700, 1100)])
    monkeypatch.setattr(small_blocks, "SPLIT_CHUNK", chunk)
    monkeypatch.setattr(small_blocks, "MAX_BLOCK_V", 64)
    case = make_case(batch=draw.randint(1, 3), length=draw.randint(1, 5), vocab=vocab, kind=draw.choice(LOGIT_KINDS),
                     dtype=draw.choice([torch.float32, torch.bfloat16]), seed=100 + seed)
    launches = []
    launch = small_blocks._launch_split
    monkeypatch.setattr(small_blocks, "_launch_split", lambda *a: (launches.append(a[3]), launch(*a)))
    compare_policy_loss("triton", on_device(case, device), draw.choice(TOKEN_CONFIGS))
    assert launches == [-(-vocab // chunk)] or vocab <= chunk


def test_kernel_constants_are_the_loss_maths():
    """The bias-corrected k3's switch gap (``loss_math.KL_BIAS_FAR``) as the Triton epilogue and the C++ header spell
    it: compiled Triton reads only constexpr globals, C++ a constant of its own."""
    import re
    from pathlib import Path

    from fused_rl.kernels import epilogue
    from fused_rl.loss_math import KL_BIAS_FAR

    header = (Path(__file__).parents[1] / "csrc" / "policy_epilogue.h").read_text()
    assert epilogue.KL_BIAS_FAR.value == KL_BIAS_FAR
    assert float(re.search(r"constexpr float kKlBiasFar = ([0-9.]+)f;", header).group(1)) == KL_BIAS_FAR


# --------------------------------------------------------------------------- epilogue at bounds and overflow
# (cases a mutation-testing round found untested)
def _at_bound_epilogue(device, cfg, logp, old, ref, adv, rollout=None):
    """``apply_epilogue`` on fp32 vectors of ``device``, every token valid; ``None`` stays ``None``."""
    from fused_rl.kernels.epilogue import apply_epilogue

    f = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    valid = torch.ones(len(logp), dtype=torch.bool, device=device)
    return [x.cpu() for x in apply_epilogue(f(logp), torch.zeros(len(logp), device=device), f(old), f(ref), f(adv),
                                            valid, cfg, rollout=f(rollout))]


def _at_bound_autograd(cfg, logp, old, ref, adv, rollout=None, dtype=torch.float64):
    """``(loss, d loss / d logp)`` per token by autograd of ``loss_math.per_token_loss``, on the CPU."""
    n = len(logp)
    lp = torch.tensor(logp, dtype=dtype).view(1, n).requires_grad_(True)
    row = lambda x: None if x is None else torch.tensor(x, dtype=dtype).view(1, n)  # noqa: E731
    terms = per_token_loss(lp, row(adv), torch.ones(1, n, dtype=torch.bool), cfg, old_logprobs=row(old),
                           ref_logprobs=row(ref), rollout_logprobs=row(rollout))
    terms.loss.sum().backward()
    return terms.loss.detach().view(n), lp.grad.view(n)


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_abs_kl_has_zero_slope_where_ref_equals_logp(device):
    """``|d|``'s slope at ``d = 0`` (ref == policy, e.g. the first step) is 0, as torch's sign / abs."""
    cfg = PolicyLossConfig(policy_loss="reinforce", kl="abs", beta=0.5)
    got = _at_bound_epilogue(device, cfg, [-1.0, -2.0], None, [-1.0, -2.0], [0.0, 1.0])
    _, grad = _at_bound_autograd(cfg, [-1.0, -2.0], None, [-1.0, -2.0], [0.0, 1.0])
    torch.testing.assert_close(got[1], grad.float())
    assert got[1][0].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_dppo_binary_kl_at_p_one(device):
    """``helpers.DPPO_AT_ONE``: at ``p = 1`` the ``1e-8`` smoothing keeps the token."""
    case = DPPO_AT_ONE
    got = _at_bound_epilogue(device, case["config"], case["logp"], case["old"], None, case["adv"])
    torch.testing.assert_close(got[1], torch.tensor(case["slopes"]))


@pytest.mark.parametrize("tie", EPILOGUE_TIES, ids=["dual_clip", "delta"])
@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_ratio_exactly_at_a_bound(device, tie):
    """``helpers.EPILOGUE_TIES``: dual_clip's tie splits the gradient, delta's closed bound passes it. (A GPU's
    ``exp`` is not correctly rounded: where its ratio misses the bound there is no tie to test.)"""
    loss, slope, _, ratio, _ = _at_bound_epilogue(device, tie["config"], [tie["logp"]], [tie["old"]], None,
                                                  [tie["adv"]])
    bound = tie["config"].dual_clip or tie["config"].delta
    if device != "cpu" and ratio.item() != torch.tensor(bound).item():
        pytest.skip(f"this device's exp gives r = {ratio.item()!r}, not the bound {bound}")
    assert ratio.item() == torch.tensor(bound).item()
    assert loss.item() == tie["loss"] and slope.item() == tie["slope"]


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_dppo_zero_advantage_and_rollout_drop_with_an_overflowed_ratio(device):
    """a dppo token with ``A = 0``, or dropped by the rollout mask, whose ratio overflows (``exp(199.9)``
    in fp32) gives loss and slope 0, not ``inf * 0 = NaN``."""
    cfg = PolicyLossConfig(policy_loss="dppo_tv", clip_low=0.2, clip_high=0.2)
    got = _at_bound_epilogue(device, cfg, [-0.1, -0.1], [-200.0, -200.0], None, [0.0, 0.0])
    assert got[0].tolist() == [0.0, 0.0] and got[1].tolist() == [0.0, 0.0]
    cfg = dataclasses.replace(cfg, rollout_is="token_mask", rollout_is_max=1.5)
    got = _at_bound_epilogue(device, cfg, [-0.1, -0.1], [-200.0, -200.0], None, [-1.0, -1.0], rollout=[-205.0, -205.0])
    assert got[0].tolist() == [0.0, 0.0] and got[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_bias_corrected_kl_with_an_overflowed_ratio(device):
    """an overflowed ratio carries no derivative of its own: the logp slope is ``beta r K'`` (``-inf`` for k2
    at d = 1), as autograd of loss_math in fp32, not ``r kl + r K' = inf - inf = NaN``."""
    cfg = PolicyLossConfig(policy_loss="reinforce", kl="k2", beta=0.5, kl_bias_correction=True)
    got = _at_bound_epilogue(device, cfg, [-0.1], [-200.0], [0.9], [0.0])
    _, grad = _at_bound_autograd(cfg, [-0.1], [-200.0], [0.9], [0.0], dtype=torch.float32)
    torch.testing.assert_close(got[1], grad)
    assert got[1].item() == -math.inf


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_rollout_weight_lower_bound_is_e_minus_20(device):
    """``rho = exp(clamp(old - rollout, -20, 20))``: at ``old - rollout = -30`` the weight is ``e^-20``
    (relative check: the absolute difference from ``e^-30`` is ~2e-9, under an absolute tolerance)."""
    cfg = PolicyLossConfig(policy_loss="reinforce", rollout_is="token_truncate", rollout_is_max=2.0)
    got = _at_bound_epilogue(device, cfg, [-1.0], [-1.0], None, [1.0], rollout=[29.0])
    loss, _ = _at_bound_autograd(cfg, [-1.0], [-1.0], None, [1.0], rollout=[29.0])
    torch.testing.assert_close(got[0], loss.float(), rtol=1e-5, atol=0.0)
    assert got[0].item() == pytest.approx(math.exp(-20.0), rel=1e-5)


@pytest.mark.parametrize("split", [None, 16])
@pytest.mark.parametrize("device", DEVICES)
def test_targets_on_chunk_and_block_boundaries(device, monkeypatch, split):
    """Targets at the first column of every split chunk / logits block (0, 16, 32, 48) and at the last column
    (63): the chunk that holds the target (and only it) adds ``a`` at the target entry."""
    from fused_rl.kernels import logits as K
    monkeypatch.setattr(K, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(K, "SPLIT_CHUNK", split)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).to(device)
    t = torch.tensor([[0, 16, 32], [48, 63, 15]], device=device)
    adv = torch.tensor([1.0, -0.5], device=device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    cfg = fused_rl.PolicyLossConfig(temperature=0.7)
    grads, losses = [], []
    for backend in ("triton", "reference"):
        xb = x.clone().requires_grad_(True)
        out = fused_rl.policy_loss(xb, t, adv, mask, config=cfg, backend=backend)
        out.loss.backward()
        grads.append(xb.grad)
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
