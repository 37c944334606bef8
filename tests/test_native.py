"""The C++ CPU kernels (backend "cpu") and the CUDA kernels (backend "cuda") against the reference,
and the shared epilogue header against autograd of fused_rl.loss_math."""

import itertools
import os

import pytest
import torch

if os.environ.get("FUSED_RL_REQUIRE_NATIVE") == "1":  # CI: a missing extension is a failure, not a skip
    import fused_rl._C  # noqa: F401
else:
    pytest.importorskip("fused_rl._C", reason="the native extension is not built (python setup.py build_ext --inplace)")

import fused_rl  # noqa: E402
from fused_rl import PolicyLossConfig, _C  # noqa: E402
from fused_rl.backends import get_backend, native  # noqa: E402
from fused_rl.backends.custom_ops import config_args, host_floats  # noqa: E402
from fused_rl.loss_math import kl_estimator, per_token_loss  # noqa: E402
from helpers import (CONFIGS, DPPO_AT_ONE, DPPO_EPILOGUE_CONFIGS, DPPO_NEAR_ONE, EPILOGUE_TIES,  # noqa: E402
                     LOGIT_KINDS, assert_close, assert_dppo_regions_reached, compare_policy_loss, make_case,
                     check_token_logprobs_inplace, make_logits, on_device, same_layout)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
cfg_id = lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}-t{c.temperature}"  # noqa: E731


@pytest.fixture(params=["auto", "baseline"])
def isa(request):
    """Run a test on the AVX2 build (when the CPU has it) and on the baseline build."""
    _C.cpu_set_isa(1 if request.param == "baseline" else 0)
    yield _C.cpu_isa()
    _C.cpu_set_isa(-1)  # the default again: FUSED_RL_CPU_ISA=baseline keeps the other tests on the baseline build


# ------------------------------------------------------------------------------ policy_loss vs reference
@pytest.mark.parametrize("config", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_policy_loss_matches_reference(config, kind, dtype, vocab):
    compare_policy_loss("cpu", make_case(vocab=vocab, kind=kind, dtype=dtype, seed=3), config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_isa_builds(isa, dtype):
    for config in CONFIGS[:2]:
        compare_policy_loss("cpu", make_case(batch=3, length=5, vocab=4099, kind="peaked", dtype=dtype, seed=8), config)


def test_isa_setting_returns_to_the_environment_default():
    """``cpu_set_isa(-1)`` (the fixture's teardown) restores ``FUSED_RL_CPU_ISA=baseline``: the teardown's
    ``cpu_set_isa(0)`` put every later test of a ``FUSED_RL_CPU_ISA=baseline`` run on the AVX2 build. A mode other
    than -1, 0, 1 is refused (7 was taken as baseline)."""
    import subprocess
    import sys

    code = ("from fused_rl import _C; a = _C.cpu_isa(); _C.cpu_set_isa(0); b = _C.cpu_isa(); _C.cpu_set_isa(-1); "
            "print(a, b, _C.cpu_isa())")
    env = {**os.environ, "FUSED_RL_CPU_ISA": "baseline"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, auto, again = out.split()
    assert first == again == "baseline" and auto in ("avx2+fma", "baseline")
    with pytest.raises(ValueError, match="mode must be -1, 0 or 1"):
        _C.cpu_set_isa(7)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3]], ids=cfg_id)
def test_on_policy_per_token_adv_and_normalizer(config):
    case = make_case(vocab=777, seed=11, off_policy=False, per_token_adv=True)
    norm = 17.0 if config.agg == "token-mean" else None
    compare_policy_loss("cpu", case, config, token_normalizer=norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sliced_logits_int32_targets(dtype):
    """A non-contiguous (B, T-1, V) view of HF-style logits and int32 targets, without a copy."""
    case = make_case(batch=3, length=7, vocab=4099, dtype=dtype, seed=5)
    full = make_logits((3, 8, 4099), generator=torch.Generator().manual_seed(1), dtype=dtype)
    case.logits = full[:, :-1]
    case.targets = case.targets.to(torch.int32)
    assert not case.logits.is_contiguous()
    for config in CONFIGS:
        compare_policy_loss("cpu", case, config)


def _at_odd_address(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` starting one byte past an aligned address (``torch.frombuffer`` with a byte offset)."""
    raw = bytearray(x.numel() * x.element_size() + 8)
    out = torch.frombuffer(raw, dtype=x.dtype, offset=1, count=x.numel()).view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % x.element_size() != 0
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32], ids=str)
def test_tensors_at_any_byte_address(dtype, target_dtype):
    """Logits, targets and per-token inputs at an odd address (``torch.frombuffer`` / ``numpy`` views): the kernels
    read them by memcpy (a ``float*`` / ``int64_t*`` read there is undefined behaviour, found by UBSan) and give the
    reference's results."""
    case = make_case(batch=3, length=5, vocab=1000, dtype=dtype, seed=8)
    case.logits = _at_odd_address(case.logits)
    case.targets = _at_odd_address(case.targets.to(target_dtype))
    case.advantages = _at_odd_address(case.advantages)
    case.old = _at_odd_address(case.old)
    case.ref = _at_odd_address(case.ref)
    compare_policy_loss("cpu", case, CONFIGS[1])
    torch.testing.assert_close(fused_rl.token_logprobs(case.logits, case.targets, backend="cpu"),
                               fused_rl.token_logprobs(case.logits, case.targets, backend="reference"),
                               **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def test_masked_vocabulary_entries():
    """-inf logits (a masked vocabulary) give p = 0 and a zero, finite gradient there."""
    case = make_case(batch=3, length=5, vocab=1000, seed=6)
    logits = case.logits.clone()
    logits[..., 500:] = float("-inf")
    case.targets = case.targets % 500
    case.logits = logits
    compare_policy_loss("cpu", case, CONFIGS[1])


def _check_inplace(backend, case, config):
    """inplace=True writes the gradient over the logits buffer (a non-leaf, as model logits are); the
    gradient equals the out-of-place one bit for bit. The single pass writes it in the forward; fp16 logits and the
    configs without a token epilogue (gspo, ...) take the two passes (fp16: their gradient formed after the loss
    scale), whose backward writes it, as the torch backend's (two passes for every config)."""
    two_pass = backend == "torch" or case.logits.dtype == torch.float16 or not config.has_token_epilogue
    expected = case.logits.detach().clone().requires_grad_(True)
    # two passes round after the upstream scale (2 here), so their gradient is not 2 x the unscaled one bit for bit
    (fused_rl.policy_loss(expected, case.targets, case.advantages, case.mask, config=config, backend=backend,
                          **case.kwargs()).loss * (2.0 if two_pass else 1.0)).backward()
    base = case.logits.detach().clone().requires_grad_(True)
    buf = base.clone()
    out = fused_rl.policy_loss(buf, case.targets, case.advantages, case.mask, config=config, backend=backend,
                               inplace=True, **case.kwargs())
    overwritten = not torch.equal(buf.detach(), case.logits)  # by dlogits in the forward
    assert overwritten == (not two_pass)
    (2.0 * out.loss).backward()
    torch.testing.assert_close(base.grad, expected.grad * (1.0 if two_pass else 2.0), rtol=0, atol=0)
    assert torch.equal(buf.detach(), base.grad)  # the buffer holds the gradient, either way


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace(dtype):
    _check_inplace("cpu", make_case(batch=3, length=6, vocab=1000, dtype=dtype, seed=2), CONFIGS[1])
    _check_inplace("cpu", make_case(batch=3, length=6, vocab=1000, dtype=dtype, seed=2),
                   PolicyLossConfig(policy_loss="gspo", agg="seq-mean-token-mean", kl="k3", beta=0.1))


def _kernel_args(case, config):
    """The flat per-token arguments the native policy ops take (as NativeBackend.policy_loss builds them)."""
    from fused_rl.loss_math import aggregation_weights

    mask = case.mask
    targets = torch.where(mask, case.targets, torch.full_like(case.targets, fused_rl.IGNORE_INDEX)).contiguous()
    adv = case.advantages[:, None].expand(mask.shape).reshape(-1).contiguous()
    w = aggregation_weights(mask, config, None).reshape(-1).float().contiguous()
    flat = lambda x: x.reshape(-1).float().contiguous()  # noqa: E731
    return targets, adv, flat(case.old), flat(case.ref), None, w, *config_args(config)


def test_bf16_dlogits_round_half_to_even(isa):
    """fp32 logits, bf16 dlogits on exact halfway cases: zero logits over V = 1024 (p = 2^-10 exactly) and a
    reinforce advantage of ``1 + 2^-8``, so every non-target dlogit is ``(1 + 2^-8) 2^-10``, halfway between two
    bf16 values with an even lower one: round half to even keeps ``2^-10`` (half up would give ``1 + 2^-7``),
    bitwise torch's rounding of the fp32 single pass's dlogits."""
    V = 1024
    logits = torch.zeros(1, 4, V)
    targets = torch.tensor([[0, 5, 700, 1023]])
    flat = torch.zeros(4)
    args = (targets, torch.full((4,), 1 + 2**-8), flat, flat, None, torch.ones(4),
            *config_args(PolicyLossConfig(policy_loss="reinforce")))
    _, _, dlogits = native.policy_fwd(logits, *args)
    bits = dlogits.view(torch.int32)
    assert (((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)).sum() == 4 * (V - 1)
    out = torch.empty(logits.shape, dtype=torch.bfloat16)
    native.policy_fwd_into(logits, out, *args)
    assert torch.equal(out.view(torch.int16), dlogits.to(torch.bfloat16).view(torch.int16))
    assert (out.float().abs() == 2**-10).sum() == 4 * (V - 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_of_a_near_certain_target(isa, temperature):
    """p(target) = 1 - ~5e-6, the rest of the mass in the second vocabulary block (so that S = 1 + eps is exact to
    fp32 relative precision in the kernel's sum): the target's gradient ``(1 - p) / tau`` keeps ~1e-7 relative
    precision by ``-expm1(d)`` (``1 - exp(d)`` in fp32 quantizes ``1 - p`` to 6e-8 steps, ~1% here)."""
    V = 4096
    g = torch.Generator().manual_seed(0)
    x = torch.full((1, 4, V), -1000.0)
    x[..., 2048:] = torch.randn(1, 4, V - 2048, generator=g) * 0.5 - 20.0
    x = x * temperature
    targets = torch.tensor([[3, 100, 500, 2047]])
    x[0, torch.arange(4), targets[0]] = 0.0
    xx = x.clone().requires_grad_(True)
    fused_rl.token_logprobs(xx, targets, temperature=temperature, backend="cpu").sum().backward()
    x64 = x.double().requires_grad_(True)
    torch.log_softmax(x64 / temperature, -1).gather(-1, targets[..., None]).sum().backward()
    idx = (0, torch.arange(4), targets[0])
    assert (x64.grad[idx] > 1e-6).all() and (x64.grad[idx] < 2e-5).all()
    torch.testing.assert_close(xx.grad[idx].double(), x64.grad[idx], rtol=1e-4, atol=0)


def test_policy_target_equal_to_the_vocabulary_size_is_nan(isa):
    """A target == V (past the row's end; only ``check_inputs=False`` lets one through) in the single pass: NaN
    logp and a NaN dlogits row, as for any target outside [0, V), not the next row's first logit."""
    case = make_case(batch=2, length=3, vocab=1000, seed=1)
    targets, *rest = _kernel_args(case, CONFIGS[1])
    targets = targets.clone()
    targets.view(-1)[0] = 1000
    logp, _, dlogits = native.policy_fwd(case.logits, targets, *rest)
    assert torch.isnan(logp.view(-1)[0]) and torch.isnan(dlogits.view(-1, 1000)[0]).all()
    assert torch.isfinite(logp.view(-1)[1:]).all()


def test_policy_and_grad_kernels_offsets_beyond_int32(isa):
    """The single-pass policy kernel and the two-pass gradient kernel on two rows 2^31 + 8 elements apart (the
    stats kernel's case in test_hardening; untouched pages cost nothing): bitwise the same rows stored densely (16-byte
    aligned as those, so that the CUDA kernels' vector loads take the same path: at 2^31 + 3 the emulation's entropy
    differs in the last bit, a different summation order)."""
    V, gap = 1000, 2**31 + 8
    storage = torch.empty(gap + V, dtype=torch.bfloat16)
    rows = (torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    storage[:V] = rows[0]
    storage[gap:gap + V] = rows[1]
    far = storage.as_strided((1, 2, V), (gap + V, gap, 1))
    targets, temp = torch.tensor([[5, 17]]), host_floats([0.7])
    g_logp, g_ent = torch.tensor([1.0, -0.5]), torch.tensor([0.3, 0.2])
    results = []
    for x in (far, rows.view(1, 2, V).clone()):
        logp, ent, lse = native.token_stats(x, targets, temp, True)
        dlogits = native.token_grad(x, targets, lse, g_logp, ent, g_ent, temp)
        policy = native.policy_fwd(x, targets, torch.tensor([1.0, -1.0]), logp - 0.1, logp + 0.2, None,
                                   torch.tensor([0.5, 0.5]), *config_args(CONFIGS[1]))
        results.append((logp, ent, dlogits, *policy))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[1][2].abs().max() > 0 and results[1][5].abs().max() > 0


@pytest.mark.parametrize("vocab", [1024, 1003])
@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16], ids=str)
def test_policy_fwd_into_rounds_the_fp32_gradient_once(odtype, vocab, isa):
    """fp32 logits, 16-bit dlogits written by the kernel (the tiled fused linear's mixed mode): bitwise the
    fp32 single pass's dlogits rounded once, with the same logp and entropy; vocabulary 1024 (aligned rows:
    the vector stores) and 1003 (a tail, unaligned rows), a fully masked row, ignored targets. Other dtype
    pairs, an aliased output and a wrong shape are refused."""
    case = make_case(batch=3, length=5, vocab=vocab, seed=6)
    args = _kernel_args(case, CONFIGS[1])
    logp, ent, dlogits = native.policy_fwd(case.logits, *args)
    out = torch.full(case.logits.shape, 7.0, dtype=odtype)
    logp16, ent16 = native.policy_fwd_into(case.logits, out, *args)
    assert torch.equal(out, dlogits.to(odtype)) and torch.equal(logp16, logp) and torch.equal(ent16, ent)
    assert dlogits.abs().max() > 0
    with pytest.raises(ValueError, match="bf16 / fp16 for fp32 logits"):
        native.policy_fwd_into(case.logits.to(torch.bfloat16), out.to(torch.float16), *args)
    with pytest.raises(ValueError, match="shares the logits' storage"):
        native.policy_fwd_into(case.logits, case.logits.view(case.logits.shape), *args)
    with pytest.raises(ValueError, match="the logits' shape"):
        native.policy_fwd_into(case.logits, out[:, :-1], *args)


def test_policy_ops_row_layouts(isa):
    """The registered policy ops on layouts the library's own callers never pass (3-D, one device): a 2-D or 4-D
    input to ``policy_fwd`` gets the 3-D input's results (the 4-D output rows were strided by ``shape[1] V``,
    past the buffer's end), and the in-place / into ops, which take the output's row strides from its dims 0
    and 1 (a 2-D input had its rows written one element apart), refuse other ranks and an ``out`` whose rows
    share memory (on another device: ``test_cuda_policy_fwd_into_refuses_an_out_on_another_device``)."""
    case = make_case(batch=2, length=6, vocab=300, seed=4)
    args = _kernel_args(case, CONFIGS[1])
    want = native.policy_fwd(case.logits, *args)
    for shape in ((12, 300), (2, 2, 3, 300)):
        got = native.policy_fwd(case.logits.reshape(shape), *args)
        for g, w in zip(got, want):
            assert torch.equal(g.reshape(w.shape), w)
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)"):
        native.policy_fwd_inplace(case.logits.clone().reshape(12, 300), *args)
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)"):
        native.policy_fwd_into(case.logits.reshape(2, 2, 3, 300), torch.empty(2, 2, 3, 300), *args)
    with pytest.raises(ValueError, match="out must have rows that do not share memory"):
        native.policy_fwd_into(case.logits, torch.empty(1, 6, 300).expand(2, 6, 300), *args)


def test_policy_fwd_keeps_a_reshaped_copy_alive(isa):
    """A > 3-D input that cannot be viewed as ``(-1, T, V)`` is copied by the launcher; the copy was freed before
    the kernel read it (38 MB here: above glibc's largest mmap threshold, so the read faulted, or read reused
    memory: NaN log-probs). Now it lives through the call and the results are the contiguous input's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 4, 400_000, generator=g).transpose(0, 1)  # (2, 3, 4, V), not viewable as rows
    targets = torch.randint(0, 400_000, (24,), generator=g)
    adv, w = torch.randn(24, generator=g), torch.full((24,), 1 / 24)
    config = config_args(CONFIGS[1])
    got = native.policy_fwd(x, targets, adv, None, None, None, w, *config)
    want = native.policy_fwd(x.contiguous(), targets, adv, None, None, None, w, *config)
    for a, b in zip(got, want):
        assert torch.equal(a.reshape(b.shape), b)


def test_fp16_subnormal_logits_under_flush_denormal(isa):
    """``torch.set_flush_denormal(True)`` (DAZ / FTZ in the calling thread): the fp16 decoder rescaled an fp32
    subnormal by ``2^112``, which DAZ read as 0, so subnormal fp16 logits became 0 on one thread (and not on
    the pool's other threads). It builds the fp32 bits without a subnormal now: the fp64 reference's values on
    1 and 2 threads."""
    bits = torch.arange(1, 0x400, 16, dtype=torch.int16)[:64]  # positive fp16 subnormals
    x = bits.view(torch.float16).reshape(1, 1, -1)
    x = torch.cat([x, -x], 1)  # (1, 2, 64)
    targets = torch.tensor([[63, 63]])
    want = fused_rl.token_logprobs(x.double(), targets, return_entropy=True, backend="reference")
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = fused_rl.token_logprobs(x, targets, return_entropy=True, backend="cpu")
            for a, b in zip(got, want):
                torch.testing.assert_close(a.double(), b, atol=1e-7, rtol=0)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def test_inplace_ignored_for_leaf():
    case = make_case(batch=3, length=4, vocab=300, seed=2)
    x = case.logits.clone().requires_grad_(True)
    fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIGS[0], backend="cpu",
                         inplace=True, **case.kwargs()).loss.backward()
    assert torch.equal(x.detach(), case.logits) and x.grad.data_ptr() != x.data_ptr()


def test_second_backward_raises_a_clear_error():
    """The stored gradient is scaled in place by the first backward: a second one through the same graph
    is refused by name (not torch's 'modified by an inplace operation')."""
    case = make_case(batch=3, length=4, vocab=300, seed=2)
    out = fused_rl.policy_loss(case.logits.clone().requires_grad_(True), case.targets, case.advantages, case.mask,
                               config=CONFIGS[0], backend="cpu", **case.kwargs())
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="supports one backward only"):
        out.loss.backward()


@pytest.mark.parametrize("scale", [0.0, 2.5])
def test_single_pass_gradient_is_scaled_by_the_incoming_gradient(scale):
    """The stored single-pass gradient times the backward's incoming gradient, 0 included (``(0 * loss)``, a
    zeroed loss term, has a zero gradient): the reference's gradient of ``scale * loss``."""
    case = make_case(batch=3, length=4, vocab=300, seed=2)
    grads = []
    for backend in ("cpu", "reference"):
        x = case.logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIGS[0], backend=backend,
                                   **case.kwargs())
        (scale * out.loss).backward()
        grads.append(x.grad)
    assert_close(grads[0], grads[1], torch.float32, "dlogits", grad=True)
    assert (grads[0].abs().max() > 0) == (scale != 0)


def test_inplace_on_sliced_view():
    case = make_case(batch=3, length=7, vocab=1000, seed=9)
    full = make_logits((3, 8, 1000), generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    ref = full.detach().clone().requires_grad_(True)
    fused_rl.policy_loss(ref[:, :-1], case.targets, case.advantages, case.mask, config=CONFIGS[0],
                         backend="reference", **case.kwargs()).loss.backward()
    fused_rl.policy_loss((full * 1.0)[:, :-1], case.targets, case.advantages, case.mask, config=CONFIGS[0],
                         backend="cpu", inplace=True, **case.kwargs()).loss.backward()
    assert_close(full.grad, ref.grad, torch.float32, "dlogits", grad=True)


def test_no_grad_and_compute_entropy_false():
    case = make_case(vocab=500, seed=7)
    for config in (CONFIGS[0], CONFIGS[1]):
        with torch.no_grad():
            got = fused_rl.policy_loss(case.logits, case.targets, case.advantages, case.mask, config=config,
                                       backend="cpu", **case.kwargs())
        exp = fused_rl.reference.policy_loss(case.logits, case.targets, case.advantages, case.mask, config=config,
                                             **case.kwargs())
        assert_close(got.loss, exp.loss, torch.float32, "loss")
        x = case.logits.clone().requires_grad_(True)
        got = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=config, backend="cpu",
                                   compute_entropy=False, **case.kwargs())
        exp = fused_rl.reference.policy_loss(case.logits, case.targets, case.advantages, case.mask, config=config,
                                             compute_entropy=False, **case.kwargs())
        assert (got.entropy is None) == (exp.entropy is None)
        assert set(got.metrics) == set(exp.metrics)


def test_hugepage_outputs(monkeypatch):
    """The opt-in FUSED_RL_HUGEPAGES path (madvise on the fresh dlogits buffer) changes no value."""
    monkeypatch.setattr(native, "USE_HUGEPAGES", True)
    monkeypatch.setattr(native, "HUGEPAGE_MIN_BYTES", 0)
    compare_policy_loss("cpu", make_case(batch=4, length=64, vocab=4099, seed=13), CONFIGS[1])


def test_many_rows():
    """More rows than a 65,535 grid dimension would allow."""
    case = make_case(batch=2, length=35000, vocab=8, seed=1)
    compare_policy_loss("cpu", case, CONFIGS[0])


# ------------------------------------------------------------------------------ token_logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 5, 333), (10, 4099), (2, 2, 3, 257)], ids=str)
def test_token_logprobs_grad_of_both_outputs(temperature, dtype, shape):
    g = torch.Generator().manual_seed(2)
    x = make_logits(shape, "peaked", generator=g, dtype=dtype)
    lead = shape[:-1]
    t = torch.randint(0, shape[-1], lead, generator=g)
    t.view(-1)[0] = fused_rl.IGNORE_INDEX
    wl, we = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    results = {}
    for backend in ("reference", "cpu"):
        xb = (x.float() if backend == "reference" else x).clone().requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xb, t, temperature=temperature, return_entropy=True, backend=backend)
        ((lp * wl).sum() + (ent * we).sum()).backward()
        results[backend] = (lp, ent, xb.grad)
    for a, b, what in zip(results["cpu"], results["reference"], ("logp", "entropy", "grad")):
        assert_close(a, b, dtype, what, grad=what == "grad")
    assert results["cpu"][0].view(-1)[0] == 0 and results["cpu"][2].reshape(-1, shape[-1])[0].abs().max() == 0


# ------------------------------------------------------------------------------ exact zeros of one-hot rows
def one_hot_rows(kind: str, temperature: float, dtype: torch.dtype = torch.float32):
    """``(logits, targets)`` of (2, 3, V) rows whose target has p = 1 in fp32, so that the reference's logp and
    H are exactly 0: "gap" (V = 300) and "gap-blocks" (V = 4099, the target in the CPU kernel's last block of
    2048, the earlier blocks' sums rescaled by exp(-gap)): every other z = x / tau at least 104 below the
    target's (exp(-104) is 0 in fp32); "single": one finite logit, the rest -inf; "vocab1": V = 1."""
    g = torch.Generator().manual_seed(5)
    V = {"gap": 300, "gap-blocks": 4099, "single": 300, "vocab1": 1}[kind]
    logits = torch.randn(2, 3, V, generator=g) * 3
    low = 2 * 2048 if kind == "gap-blocks" else 0
    targets = torch.randint(low, V, (2, 3), generator=g)
    top = logits.amax(-1) + (106 + 10 * torch.rand(2, 3, generator=g)) * temperature
    if kind == "single":
        logits.fill_(-torch.inf)
    logits.scatter_(-1, targets[..., None], top[..., None])
    return logits.to(dtype), targets


def check_one_hot_rows(backend: str, kind: str, temperature: float, dtype: torch.dtype, device: str = "cpu") -> None:
    """logp = H = 0 and dlogits = 0 exactly, as the reference's log_softmax gives: the row max's own term is
    exp(0) = 1 and its z - max z exactly 0 ((x - max x) / tau; x / tau - max z contracted into an FMA keeps the
    residual of the max's product: H ~ 5e-8 at tau != 1, which broke the H = 0 ties of top_entropy_quantile)."""
    logits, targets = (t.to(device) for t in one_hot_rows(kind, temperature, dtype))
    for be in ("reference", backend):
        x = (logits.float() if be == "reference" else logits).requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(x, targets, temperature=temperature, return_entropy=True, backend=be)
        (lp.sum() + ent.sum()).backward()
        assert (lp == 0).all() and (ent == 0).all() and (x.grad == 0).all(), (be, lp, ent)
    mask = torch.ones(targets.shape, dtype=torch.bool, device=device)
    out = fused_rl.policy_loss(logits, targets, torch.randn(2, device=device), mask,
                               config=PolicyLossConfig(temperature=temperature), backend=backend)
    assert (out.logprobs == 0).all() and (out.entropy == 0).all()


@pytest.mark.parametrize("backend, isa, dtype", [
    *(pytest.param("cpu", isa, dtype, id=f"cpu-{isa}-{dtype}") for isa in ("auto", "baseline") for dtype in DTYPES),
    pytest.param("triton", "auto", torch.float32, id="triton")], indirect=["isa"])
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.7])
@pytest.mark.parametrize("kind", ["gap", "gap-blocks", "single", "vocab1"])
def test_one_hot_rows_give_exact_zeros(backend, isa, dtype, kind, temperature):
    reason = fused_rl.available_backends()[backend]
    if reason is not None:
        pytest.skip(reason)
    check_one_hot_rows(backend, kind, temperature, dtype)


def check_top_entropy_ties(backend: str, device: str = "cpu") -> None:
    """top_entropy_quantile over tokens whose H is 0 in the reference (one-hot rows at tau = 0.7): a noisy H
    there breaks the ties and keeps other tokens (the loss was 0.063 against the reference's 0.367)."""
    g = torch.Generator().manual_seed(0)
    tau = 0.7
    logits = torch.randn(3, 4, 300, generator=g)
    logits[:, :, 0] += 110 * tau + 10 * torch.rand(3, 4, generator=g)
    logits[0, :2] = torch.randn(2, 300, generator=g)
    targets = torch.zeros(3, 4, dtype=torch.long)
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.randn(3, generator=g)
    config = PolicyLossConfig(top_entropy_quantile=0.5, temperature=tau)
    logits, targets, adv, mask = (t.to(device) for t in (logits, targets, adv, mask))
    out, ref = (fused_rl.policy_loss(logits, targets, adv, mask, config=config, backend=be)
                for be in (backend, "reference"))
    assert (out.entropy[1:] == 0).all()
    assert_close(out.loss, ref.loss, torch.float32, "loss")
    assert out.metrics["entropy_mask_frac"] == ref.metrics["entropy_mask_frac"]


def test_top_entropy_quantile_ties_of_one_hot_rows(isa):
    check_top_entropy_ties("cpu")


def test_token_logprobs_without_entropy_sliced():
    g = torch.Generator().manual_seed(3)
    full = make_logits((3, 9, 1000), "negative", generator=g)
    x = full[:, 1:].clone().requires_grad_(True)
    t = torch.randint(0, 1000, (3, 8), generator=g, dtype=torch.int32)
    lp = fused_rl.token_logprobs(full[:, 1:], t, backend="cpu")
    ref = fused_rl.token_logprobs(x, t, backend="reference")
    assert_close(lp, ref, torch.float32, "logp")


# ------------------------------------------------------------------------------ compile, determinism, routing
def test_compile_fullgraph():
    case = make_case(vocab=257, seed=4)
    for config in (CONFIGS[1], CONFIGS[2]):
        def loss_fn(logits):
            return fused_rl.policy_loss(logits, case.targets, case.advantages, case.mask, config=config,
                                        backend="cpu", check_inputs=False, **case.kwargs()).loss

        compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
        x1 = case.logits.clone().requires_grad_(True)
        x2 = case.logits.clone().requires_grad_(True)
        loss_fn(x1).backward()
        compiled(x2).backward()
        torch.testing.assert_close(x2.grad, x1.grad)

    def lp_fn(logits):
        lp, ent = fused_rl.token_logprobs(logits, case.targets, return_entropy=True, backend="cpu", check_inputs=False)
        return (lp * 2).sum() + ent.sum()

    x1 = case.logits.clone().requires_grad_(True)
    x2 = case.logits.clone().requires_grad_(True)
    lp_fn(x1).backward()
    torch.compile(lp_fn, fullgraph=True, backend="aot_eager")(x2).backward()
    torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("n", [0, -5, 2 ** 31 - 1, 2.5, True, "2"])
def test_thread_count_is_a_positive_integer(n):
    """0 / -5 were taken as OpenMP's default, 2^31 - 1 aborted the process (libgomp out of memory), 2.5 was 2."""
    with pytest.raises(ValueError, match=r"set_num_threads takes None or an integer in \[1, 65536\]"):
        native.set_num_threads(n)
    try:  # an integer tensor or numpy int is a number
        native.set_num_threads(torch.tensor(3))
        assert native._threads() == 3
    finally:
        native.set_num_threads(None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitwise_deterministic_across_runs_and_threads(dtype):
    case = make_case(batch=5, length=9, vocab=4099, dtype=dtype, seed=12)
    config = CONFIGS[1]
    outs = []
    try:
        for threads in (1, 2, 3, 1, 2):
            native.set_num_threads(threads)
            x = case.logits.clone().requires_grad_(True)
            out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=config, backend="cpu",
                                       **case.kwargs())
            out.loss.backward()
            lp, ent = fused_rl.token_logprobs(case.logits, case.targets, return_entropy=True, backend="cpu")
            outs.append((out.loss, out.logprobs, out.entropy, x.grad, lp, ent))
    finally:
        native.set_num_threads(None)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_auto_routing():
    cpu = torch.device("cpu")
    assert get_backend("auto", cpu, torch.float32).name == "cpu"
    assert get_backend("auto", cpu, torch.bfloat16).name == "cpu"
    assert get_backend("auto", cpu, torch.float64).name == "torch"
    with pytest.raises(ValueError):
        get_backend("cpu", cpu, torch.float64)
    reasons = fused_rl.available_backends(cpu)
    assert reasons["cpu"] is None and reasons["cuda"]


def test_info_runs(capsys):
    from fused_rl import info
    info.main()
    out = capsys.readouterr().out
    assert "cpu" in out and "fused_rl" in out


# ------------------------------------------------------------------------------ the epilogue header
EPILOGUE_CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(clip_low=0.1, clip_high=0.3),
    PolicyLossConfig(dual_clip=2.0, clip_low=0.2, clip_high=0.28),
    PolicyLossConfig(policy_loss="cispo", clip_high=0.3),
    PolicyLossConfig(policy_loss="reinforce"),
    PolicyLossConfig(entropy_coef=0.05),
    PolicyLossConfig(policy_loss="reinforce", entropy_coef=-0.02, kl="k1", beta=0.3),
] + [PolicyLossConfig(kl=k, beta=0.2) for k in ("k1", "k2", "k3", "abs", "low_var_kl")] + [
    PolicyLossConfig(policy_loss="cispo", kl="low_var_kl", beta=0.5, entropy_coef=0.1),
    PolicyLossConfig(dual_clip=3.0, kl="k3", beta=0.05, entropy_coef=0.01),
    PolicyLossConfig(kl="k2", beta=0.0),  # kl reported, not in the loss
    # the options of issue 10 that are token-local, alone and combined
    PolicyLossConfig(policy_loss="sapo"),
    PolicyLossConfig(policy_loss="sapo", sapo_temperature_pos=3.0, sapo_temperature_neg=0.5, kl="k3", beta=0.1),
    PolicyLossConfig(clip_high=0.28, delta=1.4),
    PolicyLossConfig(delta=1.5, dual_clip=3.0, kl="k1", beta=0.1, entropy_coef=0.01),
] + [PolicyLossConfig(kl=k, beta=0.2) for k in ("k1+", "k3+", "abs+", "low_var_kl+")] + [
    PolicyLossConfig(kl="k3", beta=0.3, kl_bias_correction=True),
    PolicyLossConfig(policy_loss="cispo", kl="low_var_kl+", beta=0.2, kl_bias_correction=True),
    PolicyLossConfig(rollout_is="token_truncate", rollout_is_max=1.3),
    PolicyLossConfig(rollout_is="token_truncate", rollout_is_min=0.8, rollout_is_max=None, kl="k2", beta=0.1),
    PolicyLossConfig(rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=1.5),
    PolicyLossConfig(policy_loss="sapo", rollout_is="token_mask", rollout_is_max=2.0, delta=None, kl="k3+",
                     beta=0.1, kl_bias_correction=True, entropy_coef=0.02),
    # OpenRLHF's value clamp and unbiased_gradient's min(r, C)-weighted k2 gradient
    PolicyLossConfig(kl="k1", beta=0.3, kl_clamp=10.0),
    PolicyLossConfig(policy_loss="reinforce", kl="k2", beta=0.2, kl_clamp=10.0),
    PolicyLossConfig(kl="abs+", beta=0.2, kl_clamp=4.0, kl_is_clip=1.3),
    PolicyLossConfig(policy_loss="cispo", kl="k2+", beta=0.4, kl_clamp=10.0, kl_is_clip=1.3, entropy_coef=0.01),
    PolicyLossConfig(policy_loss="sapo", kl="low_var_kl+", beta=0.2, kl_is_clip=0.8, rollout_is="token_truncate",
                     rollout_is_max=1.5),
] + DPPO_EPILOGUE_CONFIGS


def _epilogue(config, logp, ent, adv, old, ref, rollout, w):
    n = logp.numel()
    loss, gl, ge = (torch.empty(n) for _ in range(3))
    _C.epilogue(n, logp.data_ptr(), ent.data_ptr(), adv.data_ptr(), native._ptr(old), native._ptr(ref),
                native._ptr(rollout), w.data_ptr(), native.epilogue_params(config), loss.data_ptr(), gl.data_ptr(),
                ge.data_ptr())
    return loss, gl, ge


def _cfg_name(c):
    return (f"{c.policy_loss}-{c.kl}-d{c.dual_clip}-delta{c.delta}-bias{int(c.kl_bias_correction)}-{c.rollout_is}"
            f"-e{c.entropy_coef}-klclamp{c.kl_clamp}-klis{c.kl_is_clip}")


@pytest.mark.parametrize("config", EPILOGUE_CONFIGS, ids=_cfg_name)
@pytest.mark.parametrize("on_policy", [False, True])
def test_epilogue_matches_autograd_of_loss_math(config, on_policy):
    g = torch.Generator().manual_seed(0)
    n = 4000
    logp = -torch.rand(n, generator=g) * 6
    # log-ratios spread over both sides of every clip bound (and past the dual-clip cap)
    old = None if on_policy else logp - torch.randn(n, generator=g) * 0.8
    # |d| beyond 20 (k3 beyond 10 for low_var_kl, and r k3's product-rule cancellation for kl_bias_correction)
    ref = logp + torch.randn(n, generator=g) * 12.0
    ref[:8] = logp[:8]  # d == 0 exactly (abs: zero subgradient)
    rollout = (logp if old is None else old) + torch.randn(n, generator=g) * 0.5
    adv = torch.randn(n, generator=g)
    adv[8:16] = 0.0
    ent = torch.rand(n, generator=g) * 3
    w = torch.rand(n, generator=g) / n
    mask = torch.ones(1, n, dtype=torch.bool)
    use_rollout = config.rollout_is is not None

    # The reference in fp64, the tolerance set by the kernel's fp32 alone.
    f64 = lambda x: x.double().view(1, n)  # noqa: E731
    lp = f64(logp).requires_grad_(True)
    en = f64(ent).requires_grad_(True)
    loss_t, _, _, _ = per_token_loss(lp, f64(adv), mask, config, old_logprobs=None if old is None else f64(old),
                                     ref_logprobs=f64(ref) if config.kl else None, entropy=en,
                                     rollout_logprobs=f64(rollout) if use_rollout else None)
    (loss_t * f64(w)).sum().backward()
    got_loss, got_gl, got_ge = _epilogue(config, logp, ent, adv, old, ref if config.kl else None,
                                         rollout if use_rollout else None, w)
    torch.testing.assert_close(got_loss, loss_t.detach().view(-1).float(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_gl, lp.grad.view(-1).float(), rtol=2e-5, atol=1e-9)
    exp_ge = torch.zeros(n) if en.grad is None else en.grad.view(-1).float()
    torch.testing.assert_close(got_ge, exp_ge, rtol=1e-6, atol=1e-12)
    if on_policy:
        return
    r = torch.exp(logp - old)  # the inputs did reach every branch
    if config.policy_loss == "ppo_clip":
        assert ((r < 1 - config.clip_low) & (adv > 0)).any() and ((r > 1 + config.clip_high) & (adv > 0)).any()
        assert ((r < 1 - config.clip_low) & (adv < 0)).any() and ((r > 1 + config.clip_high) & (adv < 0)).any()
        if config.dual_clip is not None:
            assert ((r > config.dual_clip) & (adv < 0)).any()
        if config.delta is not None:
            assert ((r > config.delta) & (adv < 0)).any()
    if use_rollout:
        rho = torch.exp(old - rollout)
        lo, hi = config.rollout_is_min, config.rollout_is_max
        assert (lo is None or (rho < lo).any()) and (hi is None or (rho > hi).any())
    if config.kl_clamp is not None:  # the clamp cuts and keeps values
        value = kl_estimator(logp, ref, config.kl.rstrip("+"))
        assert (value > config.kl_clamp).any() and (value.abs() < config.kl_clamp).any()
    if config.kl_is_clip is not None:
        assert (r > config.kl_is_clip).any() and (r < config.kl_is_clip).any()
    assert_dppo_regions_reached(config, logp, old, adv)


@pytest.mark.parametrize("case", [DPPO_NEAR_ONE, DPPO_AT_ONE], ids=["near_one", "at_one"])
def test_epilogue_dppo_binary_kl_near_one(case):
    """The header's binary KL where ``p ~ 1`` (its ``1e-8`` smoothing, against ``1e-6``, decides:
    ``helpers.DPPO_NEAR_ONE``) and at ``p = 1`` (it keeps the token: ``helpers.DPPO_AT_ONE``)."""
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    n = len(case["logp"])
    _, slopes, _ = _epilogue(case["config"], f(case["logp"]), torch.zeros(n), f(case["adv"]), f(case["old"]), None,
                             None, torch.ones(n))
    torch.testing.assert_close(slopes, f(case["slopes"]))


@pytest.mark.parametrize("tie", EPILOGUE_TIES, ids=["dual_clip", "delta"])
def test_epilogue_ratio_exactly_at_a_bound(tie):
    """``helpers.EPILOGUE_TIES``: dual_clip's tie splits the gradient, delta's closed bound passes it."""
    f = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    loss, slope, _ = _epilogue(tie["config"], f(tie["logp"]), torch.zeros(1), f(tie["adv"]), f(tie["old"]), None,
                               None, torch.ones(1))
    assert loss.item() == tie["loss"] and slope.item() == tie["slope"]


def test_epilogue_params_reject_sequence_level_configs():
    with pytest.raises(ValueError, match="no token epilogue"):
        native.epilogue_params(PolicyLossConfig(policy_loss="gmpo"))
    with pytest.raises(ValueError, match="no token epilogue"):
        native.epilogue_params(PolicyLossConfig(rollout_is="sequence_mask"))


@pytest.mark.parametrize("config", [c for c in EPILOGUE_CONFIGS[-18:]], ids=_cfg_name)
def test_new_options_take_the_single_pass(config, monkeypatch):
    """The token-local options of issue 10 (and dppo) run the C++ single pass (never the base composition), equal to
    the reference, out of place and in place."""
    def composition(*args, **kwargs):
        raise AssertionError("the two-pass composition (token_logprobs + loss math) was used")

    monkeypatch.setattr(native.NativeBackend, "token_logprobs", composition)
    calls = []
    for name in ("policy_fwd", "policy_fwd_inplace"):
        op = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _op=op, _n=name: calls.append(_n) or _op(*a))
    case = make_case(batch=4, length=7, vocab=1000, seed=5)
    if config.rollout_is is not None:
        rollout = case.old + 0.3 * torch.randn(case.old.shape, generator=torch.Generator().manual_seed(2))
        base_kwargs = case.kwargs()
        case.kwargs = lambda: {**base_kwargs, "rollout_logprobs": rollout}
    compare_policy_loss("cpu", case, config)
    _check_inplace("cpu", case, config)
    assert calls == ["policy_fwd", "policy_fwd", "policy_fwd_inplace"]


# ------------------------------------------------------------------------------ CUDA (run where a GPU is present)
def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reason = fused_rl.available_backends(torch.device("cuda"))["cuda"]
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("kind", ["gap", "gap-blocks", "single", "vocab1"])
def test_cuda_one_hot_rows_give_exact_zeros(backend, kind, temperature):
    """The GPU kernels on the rows of :func:`check_one_hot_rows` (the CUDA kernel's max subtracted before its
    scaling, as on CPU; the emulator checks it with FMA contraction, this on the hardware's ``ex2.approx``)."""
    reason = fused_rl.available_backends("cuda")[backend]
    if reason is not None:
        pytest.skip(reason)
    check_one_hot_rows(backend, kind, temperature, torch.float32, device="cuda")
    if kind == "gap":
        check_top_entropy_ties(backend, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab,kind", list(itertools.product([1000, 4099], LOGIT_KINDS)))
def test_cuda_policy_loss_matches_reference(config, dtype, vocab, kind):
    _cuda_or_skip()
    compare_policy_loss("cuda", on_device(make_case(vocab=vocab, kind=kind, dtype=dtype, seed=3), "cuda"), config)


@pytest.mark.cuda
def test_cuda_policy_fwd_into_refuses_an_out_on_another_device():
    """A CPU ``out`` for CUDA logits: the kernel would store through a host pointer (an illegal address)."""
    _cuda_or_skip()
    case = on_device(make_case(batch=2, length=3, vocab=300, seed=4), "cuda")
    with pytest.raises(ValueError, match="out must be on the logits' device"):
        native.policy_fwd_into(case.logits, torch.empty(case.logits.shape), *_kernel_args(case, CONFIGS[1]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_sliced_inplace_and_token_logprobs(dtype):
    _cuda_or_skip()
    case = on_device(make_case(batch=3, length=7, vocab=4099, dtype=dtype, seed=5), "cuda")
    case.logits = make_logits((3, 8, 4099), generator=torch.Generator().manual_seed(1), dtype=dtype).cuda()[:, :-1]
    compare_policy_loss("cuda", case, CONFIGS[1])
    _check_inplace("cuda", on_device(make_case(batch=3, length=6, vocab=1000, dtype=dtype, seed=2), "cuda"), CONFIGS[1])
    x = same_layout(case.logits).requires_grad_(True)
    assert x.stride() == (8 * 4099, 4099, 1)  # the view's batch stride, not a contiguous copy's
    lp, ent = fused_rl.token_logprobs(x, case.targets, return_entropy=True, temperature=0.7, backend="cuda")
    (lp.sum() + ent.sum()).backward()
    xr = case.logits.detach().float().requires_grad_(True)
    lpr, entr = fused_rl.token_logprobs(xr, case.targets, return_entropy=True, temperature=0.7, backend="reference")
    (lpr.sum() + entr.sum()).backward()
    assert_close(lp, lpr, dtype, "logp")
    assert_close(ent, entr, dtype, "entropy")
    assert_close(x.grad, xr.grad, dtype, "grad", grad=True)


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [-2.5, 1.0])
def test_cuda_grad_output_scaling(scale):
    """The stored dlogits times grad_output by the CUDA scale kernel (g read on the device; with g == 1 it
    returns at once), on bf16 rows of 1000 (16-byte aligned: 128-bit loads) and 1001 entries (unaligned)."""
    _cuda_or_skip()
    case = on_device(make_case(batch=3, length=7, vocab=1000, dtype=torch.bfloat16, seed=9), "cuda")
    for logits in (case.logits, make_logits((3, 8, 1001), generator=torch.Generator().manual_seed(2),
                                            dtype=torch.bfloat16).cuda()[:, :-1]):
        xr = logits.detach().float().requires_grad_(True)
        x = logits.detach().clone().requires_grad_(True)
        for leaf, backend in ((xr, "reference"), (x, "cuda")):
            out = fused_rl.policy_loss(leaf, case.targets, case.advantages, case.mask, config=CONFIGS[1],
                                       backend=backend, **case.kwargs())
            (out.loss * scale).backward()
        assert_close(x.grad, xr.grad, torch.bfloat16, "scaled dlogits", grad=True)


@pytest.mark.parametrize("name", ["reverse", "streaming"])
def test_cuda_switches(name):
    """The CUDA kernels' on / off tuning knobs of the gradient sweep (order, cache policy): on by default
    (the H200 sweep's best); tests/test_cuda_sim.py checks that they change no bit of the results."""
    if not getattr(native._C, "has_cuda", False):
        pytest.skip("built without the CUDA part")
    get, set_ = getattr(native._C, f"cuda_{name}"), getattr(native._C, f"cuda_set_{name}")
    assert get() is True
    try:
        set_(False)
        assert get() is False
    finally:
        set_(True)


@pytest.mark.parametrize("name, default, good, bad, message", [
    ("rows_per_sm", 2, 4, (0, 65), r"\[1, 64\]"),
    ("unroll", 4, 2, (0, 3, 8), "1, 2 or 4"),
    ("threads", 1024, 256, (0, 32, 100, 2048), r"multiple of 32 in \[64, 1024\]"),
])
def test_cuda_tuning_knobs(name, default, good, bad, message):
    """The CUDA kernels' tuning knobs of the benchmark's sweep, blocks per SM of the grid, 128-bit loads
    in flight per thread and threads per block: the default, an accepted value, and other values rejected
    with the range;
    compiled in wherever nvcc built the CUDA part (no GPU needed; tests/test_cuda_sim.py checks that the
    results are bitwise the same whatever their values)."""
    if not getattr(native._C, "has_cuda", False):
        pytest.skip("built without the CUDA part")
    get, set_ = getattr(native._C, f"cuda_{name}"), getattr(native._C, f"cuda_set_{name}")
    assert get() == default
    try:
        set_(good)
        assert get() == good
        for value in bad:
            with pytest.raises(ValueError, match=message):
                set_(value)
        assert get() == good
    finally:
        set_(default)


def test_info_names_versions_the_native_build_and_every_backend_on_both_devices(capsys, monkeypatch):
    """Each line of ``fused_rl.info``: the package's own version, each library's own version, whether the
    extension has CUDA kernels (also for a build of the other kind), and every backend on cpu and cuda with the
    reason it is unavailable."""
    import importlib.metadata

    from fused_rl import info

    real = native._C

    class OtherBuild:  # the extension, with has_cuda flipped
        has_cuda = not real.has_cuda

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(native, "_C", OtherBuild())
    info.main()
    assert f"CUDA kernels: {'built' if not real.has_cuda else 'not built'}\n" in capsys.readouterr().out
    monkeypatch.setattr(native, "_C", real)
    info.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fused_rl {fused_rl.__version__} ({fused_rl.__file__})"
    assert f"transformers: {importlib.metadata.version('transformers')}" in lines
    assert f"triton: {importlib.metadata.version('triton')}" in lines
    built = "built" if native._C.has_cuda else "not built"
    assert any(line.startswith("native extension: ") and line.endswith(f"CUDA kernels: {built}") for line in lines)
    for dev in ("cpu", "cuda"):
        section = lines[lines.index(f"backends on {dev}:") + 1:]
        for name, reason in fused_rl.available_backends(torch.device(dev)).items():
            assert f"  {name:10s} {'available' if reason is None else 'unavailable: ' + reason}" in section


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 1000), (7, 4099), (2, 2, 3, 257)], ids=str)
def test_token_logprobs_inplace(dtype, shape):
    check_token_logprobs_inplace("cpu", shape, dtype)
