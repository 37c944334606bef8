"""The tiled fused linear loss (chunked matmuls feeding the single-pass logits kernels,
``fused_rl.backends.tiled_linear``) of the ``cpu``, ``triton`` and ``cuda`` backends against the reference
(full fp32 logits, ``log_softmax``, loss math, autograd). Without a GPU the triton backend runs in the
interpreter on CPU tensors: its shapes stay tiny (B*T <= 24, V <= 1000); with one, the triton and
cuda tests run on CUDA tensors (16-bit inputs then take the real mixed GEMM mode)."""

import dataclasses

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.backends import get_backend, tiled_linear, torch_linear
from fused_rl.backends.custom_ops import host_floats
from helpers import CONFIGS, on_device
from test_linear import (LINEAR_GRAD_TOLERANCES, _leaves, abs_gemm_bounds, assert_close, compare_linear,
                         make_linear_case, opcheck_args)
from test_variants import VARIANTS, with_extras

cid = lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}{'-biascorr' if c.kl_bias_correction else ''}"

GPU = "cuda" if torch.cuda.is_available() else "cpu"  # where the triton tests run
#: the ops' temperature 0.7: a one-value host tensor (custom_ops.host_floats), as the backends pass it
TAU = host_floats((0.7,))
_available = fused_rl.available_backends(torch.device("cpu"))
_gpu_available = fused_rl.available_backends(torch.device(GPU))
needs_cpu = pytest.mark.skipif(_available["cpu"] is not None, reason=str(_available["cpu"]))
needs_triton = pytest.mark.skipif(_gpu_available["triton"] is not None, reason=str(_gpu_available["triton"]))
needs_cuda = pytest.mark.skipif(GPU != "cuda" or _gpu_available["cuda"] is not None,
                                reason=str(_gpu_available["cuda"]) if GPU == "cuda" else "no CUDA device")


pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def on_gpu(fn):
    """``pytest.mark.cuda`` (what ``bench/gpu_check.sh`` selects) on tests that run on CUDA tensors here."""
    return pytest.mark.cuda(fn) if GPU == "cuda" else fn


def _two_passes(config, device) -> bool:
    """Whether the tiled route runs ``config`` in its two passes (not the single pass, not torch_linear)."""
    return not tiled_linear.runs_tiled(config) and (config.is_batch_level
                                                    or tiled_linear._sequences_in_two_passes(torch.device(device)))


@pytest.fixture(params=["default", "cuda"])
def route(request, monkeypatch):
    """``default``: the device's route of sequence-level configs (the CPU: torch_linear's one pass); ``cuda``:
    CUDA's, the two tiled passes."""
    if request.param == "cuda":
        monkeypatch.setattr(tiled_linear, "_sequences_in_two_passes", lambda device: True)
    return request.param


def _valid(case) -> int:
    return int((case.mask & (case.targets != fused_rl.IGNORE_INDEX)).sum())


@pytest.fixture
def tiles(request, monkeypatch):
    """``auto``: the default tile rule; ``small``: 3-token tiles (boundaries inside sequences; the
    delegated configs get 3-token torch_linear tiles too); ``fixed``: 3-token fixed slices (the
    no-gather path used off CPU: masked rows computed, target ``IGNORE_INDEX``, hidden zeroed)."""
    mode = getattr(request, "param", "auto")
    if mode in ("small", "fixed"):
        monkeypatch.setattr(tiled_linear, "CHUNK_TOKENS", 3)
        monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 3)
    if mode == "fixed":
        monkeypatch.setattr(torch_linear, "GATHER_VALID", False)
    return mode


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records ``(kernel, tile rows)`` of every single-pass kernel call of the tiled op."""
    calls = []
    for name, fn in list(tiled_linear.KERNELS.items()):
        def spy(z, *args, _fn=fn, _name=name, **kwargs):
            calls.append((_name, z.shape[0]))
            return _fn(z, *args, **kwargs)
        monkeypatch.setitem(tiled_linear.KERNELS, name, spy)
    return calls


# ----------------------------------------------------------------------------------------- cpu backend
@needs_cpu
@pytest.mark.parametrize("config", CONFIGS, ids=cid)
@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_matches_reference(config, vocab, bias, dtype, kernel_calls, two_pass_calls):
    case = make_linear_case(vocab=vocab, bias=bias, dtype=dtype, seed=vocab + bias)
    compare_linear(case, config, backend="cpu")
    # token-level configs run the native kernel (one tile of the valid tokens); the others its two passes
    assert kernel_calls == ([("native", _valid(case))] if tiled_linear.runs_tiled(config) else [])
    assert bool(two_pass_calls) == _two_passes(config, "cpu")


@needs_cpu
@pytest.mark.parametrize("tiles", ["small", "fixed"], indirect=True)
@pytest.mark.parametrize("config", CONFIGS, ids=cid)
def test_cpu_tile_boundaries(config, tiles, kernel_calls):
    """3-token tiles cut sequences; with fixed slices masked rows (NaN hidden in the padding) are
    computed and must contribute nothing."""
    case = make_linear_case(batch=5, length=7, vocab=1000, seed=11, per_token_adv=True)
    compare_linear(case, config, backend="cpu")
    if tiled_linear.runs_tiled(config):
        rows = case.mask.numel() if tiles == "fixed" else _valid(case)
        assert [n for _, n in kernel_calls] == [min(3, rows - s) for s in range(0, rows, 3)]


@needs_cpu
@pytest.mark.parametrize("tiles", ["auto", "small"], indirect=True)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cpu_variants(name, tiles, route, kernel_calls, two_pass_calls):
    """The #10 variants: those with a token epilogue (token rollout correction included) run the single pass, and
    a sequence rollout correction off-policy (its weights folded into the advantages); the others (masks,
    sequence ratios, ...) torch_linear on the CPU, and on CUDA (``route``) the two passes (statistics, then the
    loss math and a gradient pass), as a batch-level one (the entropy quantile) everywhere."""
    config = VARIANTS[name]
    case = make_linear_case(batch=5, length=7, vocab=1000, seed=len(name))
    compare_linear(with_extras(case, config), config, backend="cpu")
    assert bool(kernel_calls) == tiled_linear.runs_tiled(config, off_policy=True)
    assert bool(two_pass_calls) == _two_passes(config, "cpu")
    assert tiled_linear.runs_tiled(config) == (config.has_token_epilogue or name == "mis_sequence")


@needs_cpu
@pytest.mark.parametrize("tiles", ["auto", "small"], indirect=True)
@pytest.mark.parametrize("rollout_is", ["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"])
@pytest.mark.parametrize("on_policy", [True, False], ids=["on_policy", "off_policy"])
def test_cpu_rollout_correction(rollout_is, on_policy, tiles, kernel_calls):
    """Rollout correction on the tiled route: token level in the kernel (on- and off-policy: on-policy the weight
    reads the current log-prob), sequence level off-policy folded into the advantages; sequence level on-policy
    needs a sequence's current log-probs first, so the two passes run it. Rollout log-probs near the policy's
    (weights on both sides of the bounds), NaN (unscored) at some tokens."""
    config = PolicyLossConfig(rollout_is=rollout_is, rollout_is_min=0.7, rollout_is_max=1.4, kl="k3", beta=0.05,
                              clip_high=0.28, agg="seq-mean-token-mean")
    case = make_linear_case(batch=5, length=7, vocab=1000, seed=3, spread=0.2)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lp = fused_rl.reference.linear_token_logprobs(case.hidden, case.weight, case.targets, bias=case.bias,
                                                      check_inputs=False)
    rollout = (lp + 0.1 * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
    rollout[torch.rand(lp.shape, generator=g) < 0.15] = float("nan")
    case = dataclasses.replace(case, old=None if on_policy else case.old, rollout=rollout)
    compare_linear(case, config, backend="cpu")
    tiled = rollout_is.startswith("token") or not on_policy
    assert tiled_linear.runs_tiled(config, off_policy=not on_policy) == tiled
    assert bool(kernel_calls) == tiled


@needs_cpu
@pytest.mark.parametrize("kind", ["peaked", "negative"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_hard_logits(kind, dtype):
    compare_linear(make_linear_case(vocab=4099, kind=kind, dtype=dtype, seed=5), CONFIGS[1], backend="cpu")


@needs_cpu
@pytest.mark.parametrize("tiles", ["auto", "fixed"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_frozen_weight_allocates_no_weight_gradient(dtype, tiles, monkeypatch):
    allocated = []
    original = torch_linear._Grads.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        allocated.append((self.h is not None, self.w is not None, self.b is not None))

    monkeypatch.setattr(torch_linear._Grads, "__init__", spy)
    compare_linear(make_linear_case(vocab=1000, dtype=dtype, seed=2), CONFIGS[1], frozen_weight=True, backend="cpu")
    assert allocated == [(True, False, True)]


@needs_cpu
@pytest.mark.parametrize("config", [c for c in CONFIGS if tiled_linear.runs_tiled(c)][:3], ids=cid)
def test_cpu_without_gradients_runs_the_statistics_pass_alone(config, monkeypatch):
    """Under ``no_grad`` the tiled cpu path reads each tile once for its statistics (``native_token_stats``) and
    writes no dlogits over it (the single pass did, for nothing): the same loss, log-probs, entropy and metrics as
    the call that wants gradients."""
    from fused_rl.backends import native

    case = make_linear_case(vocab=1000, seed=9)
    kwargs = dict(bias=case.bias, old_logprobs=case.old, ref_logprobs=case.ref, config=config, backend="cpu")
    args = (case.hidden, case.weight, case.targets, case.advantages, case.mask)
    with_grad = fused_rl.linear_policy_loss(case.hidden.clone().requires_grad_(True), *args[1:], **kwargs)
    calls = []
    for name in ("token_stats", "policy_fwd_inplace", "policy_fwd_into"):
        fn = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _fn=fn, _name=name: (calls.append(_name), _fn(*a))[1])
    with torch.no_grad():
        out = fused_rl.linear_policy_loss(*args, **kwargs)
    assert calls == ["token_stats"]
    assert torch.equal(out.loss, with_grad.loss.detach())
    assert torch.equal(out.logprobs, with_grad.logprobs) and torch.equal(out.entropy, with_grad.entropy)
    assert all(torch.equal(out.metrics[k], with_grad.metrics[k]) for k in with_grad.metrics)


@needs_cpu
def test_cpu_only_hidden_requires_grad_and_token_normalizer():
    case = make_linear_case(vocab=1000, bias=False, seed=4)
    h = case.hidden.clone().requires_grad_(True)
    out = fused_rl.linear_policy_loss(h, case.weight, case.targets, case.advantages, case.mask, config=CONFIGS[0],
                                      token_normalizer=torch.tensor(17.0), backend="cpu", **case.kwargs())
    out.loss.backward()
    rh = torch.nan_to_num(case.hidden).requires_grad_(True)
    expected = fused_rl.reference.linear_policy_loss(rh, case.weight, case.targets, case.advantages, case.mask,
                                                     config=CONFIGS[0], token_normalizer=torch.tensor(17.0),
                                                     **case.kwargs())
    expected.loss.backward()
    assert_close(out.loss, expected.loss, torch.float32, "loss")
    assert_close(h.grad, rh.grad, torch.float32, "grad_hidden", grad=True)


@needs_cpu
def test_cpu_no_entropy_sliced_hidden_and_second_backward():
    """``compute_entropy=False``, a non-contiguous ``hidden[:, :-1]``; the stored gradients are scaled
    out of place, so a second backward (``retain_graph``) gives the same gradients."""
    case = make_linear_case(batch=3, length=6, vocab=1000, seed=8)
    full = torch.randn(3, 7, case.hidden.shape[-1], generator=torch.Generator().manual_seed(3))
    full[:, :-1] = case.hidden
    case.hidden = full
    compare_linear(case, CONFIGS[0], compute_entropy=False, hidden_view=lambda x: x[:, :-1], backend="cpu")
    h, w, b = _leaves(make_linear_case(vocab=1000, seed=3), torch.float32)
    c = make_linear_case(vocab=1000, seed=3)
    out = fused_rl.linear_policy_loss(h, w, c.targets, c.advantages, c.mask, bias=b, backend="cpu", **c.kwargs())
    (2.0 * out.loss).backward(retain_graph=True)
    first = w.grad.clone()
    w.grad = None
    (2.0 * out.loss).backward()
    torch.testing.assert_close(w.grad, first)


@pytest.fixture
def two_pass_calls(monkeypatch):
    """Records ``(kernel, "stats" / "grad", tile rows)`` of every call of the two-pass tile kernels."""
    calls = []
    for name, fns in list(tiled_linear.TWO_PASS_KERNELS.items()):
        def spy(fn, part, name=name):
            def call(z, *args, **kwargs):
                calls.append((name, part, z.shape[0]))
                return fn(z, *args, **kwargs)
            return call
        monkeypatch.setitem(tiled_linear.TWO_PASS_KERNELS, name, (spy(fns[0], "stats"), spy(fns[1], "grad")))
    return calls


_TWO_PASS_BACKENDS = [pytest.param("cpu", marks=needs_cpu),
                      pytest.param("triton", marks=[needs_triton] + ([pytest.mark.cuda] if GPU == "cuda" else [])),
                      pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])]


@pytest.mark.parametrize("backend", _TWO_PASS_BACKENDS)
@pytest.mark.parametrize("tiles", ["auto", "small", "fixed"], indirect=True)
@pytest.mark.parametrize("dtype, mode", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "mixed")],
                         ids=["fp32", "bf16", "bf16-mixed"])
@pytest.mark.parametrize("used", ["both", "logp", "entropy"])
def test_linear_token_logprobs_two_passes(backend, tiles, dtype, mode, used, two_pass_calls, monkeypatch):
    """``linear_token_logprobs`` on the tiled backends: the statistics kernel over each tile, and in the backward
    each tile recomputed for the gradient kernel with arbitrary upstream gradients of the log-probs and / or
    entropies (an unused output: no entropy term); an ``IGNORE_INDEX`` target gives 0 and no gradient. In the
    mixed GEMM mode the gradients may also differ by the rounding of each ``dz`` to bf16 (``2^-8 |dz|``, carried
    through the GEMMs as ``test_linear.mixed_mode_slack``)."""
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", mode)
    vocab = 300 if backend == "triton" and GPU == "cpu" else 1000  # the interpreter: a small vocabulary
    device = "cpu" if backend == "cpu" else GPU
    case = on_device(make_linear_case(batch=3, length=5, vocab=vocab, seed=9, dtype=dtype), device)
    case.hidden = torch.nan_to_num(case.hidden)
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = (torch.randn(3, 5, generator=g).to(device) for _ in range(2))
    res = {}
    for name in ("reference", backend):
        h, w, b = _leaves(case, torch.float32 if name == "reference" else dtype)
        logp, ent = fused_rl.linear_token_logprobs(h, w, case.targets, bias=b, temperature=0.7, return_entropy=True,
                                                   backend=name)
        loss = {"both": (logp * g_logp).sum() + (ent * g_ent).sum(), "logp": (logp * g_logp).sum(),
                "entropy": (ent * g_ent).sum()}[used]
        loss.backward()
        res[name] = (logp, ent, h.grad, w.grad, b.grad)
    slack = (0.0, 0.0, 0.0)
    if mode == "mixed":
        leaves = _leaves(case, torch.float32)
        z = torch.nn.functional.linear(*(x.detach() for x in leaves)).requires_grad_(True)
        lp, ent = fused_rl.reference.token_logprobs(z, case.targets, temperature=0.7, return_entropy=True)
        ({"both": (lp * g_logp).sum() + (ent * g_ent).sum(), "logp": (lp * g_logp).sum(),
          "entropy": (ent * g_ent).sum()}[used]).backward()
        slack = abs_gemm_bounds(z.grad.abs() * 2.0 ** -8, leaves, lambda x: x)
    for got, exp, what in zip(res[backend][:2], res["reference"][:2], ("logp", "entropy")):
        assert_close(got, exp, dtype, what)
    atol, rtol = LINEAR_GRAD_TOLERANCES[dtype]
    for got, exp, extra, what in zip(res[backend][2:], res["reference"][2:], slack, ("gh", "gw", "gb")):
        excess = (got.float() - exp).abs() - (atol + rtol * exp.abs() + extra)
        assert excess.max() <= 0, (what, excess.max().item())
    assert res[backend][0][-1, -1] == 0 and (res[backend][2][-1, -1] == 0).all()
    kernel = "triton" if backend == "triton" else "native"
    assert {(k, part) for k, part, _ in two_pass_calls} == {(kernel, "stats"), (kernel, "grad")}


@needs_cpu
def test_auto_picks_the_tiled_cpu_backend(kernel_calls):
    assert get_backend("auto", torch.device("cpu"), torch.float32, linear=True).name == "cpu"
    case = make_linear_case(vocab=1000, seed=1)
    fused_rl.linear_policy_loss(case.hidden, case.weight, case.targets, case.advantages, case.mask, bias=case.bias,
                                **case.kwargs())
    assert kernel_calls and all(k == "native" for k, _ in kernel_calls)


@needs_cpu
@pytest.mark.parametrize("tiles", ["fixed"], indirect=True)
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[3], CONFIGS[2]], ids=cid)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_mixed_gemm_mode(config, dtype, tiles, monkeypatch):
    """The mixed GEMM mode (16-bit operands, fp32 logits and gradients; CUDA's default for bf16, opt-in for
    fp16) emulated on CPU: the tile logic around it, with ``dz`` rounded to the input dtype once (for
    fp16 in units of the largest aggregation weight, see ``test_linear.mixed_mode_slack``); gspo (CONFIGS[2])
    takes CUDA's two passes, whose gradient pass writes ``dz`` in units of the largest upstream gradient."""
    monkeypatch.setattr(tiled_linear, "_sequences_in_two_passes", lambda device: True)
    assert tiled_linear._mode(torch.device("cuda"), torch.bfloat16) == "mixed"
    assert tiled_linear._mode(torch.device("cuda"), torch.float16) == "fp32"  # default: see the module doc
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed")
    assert tiled_linear._mode(torch.device("cuda"), dtype) == "mixed"
    assert tiled_linear._mode(torch.device("cuda"), torch.float32) == "fp32"
    compare_linear(make_linear_case(vocab=1000, dtype=dtype, seed=13), config, backend="cpu")
    compare_linear(make_linear_case(vocab=4099, dtype=dtype, seed=14), config, frozen_weight=True, backend="cpu")


def test_mixed_bias_gradient_sums_the_16_bit_dz_in_fp32():
    """The mixed GEMM mode's bias gradient sums each tile's 16-bit ``dz`` rows in fp32 (the module doc: fp32
    accumulation in the bias sum), not in bf16 (one rounding of each tile's sum): hand-computed bf16 rows whose fp32
    sums bf16 cannot hold (``1 + 3 * 2^-9`` rounds to ``1 + 2^-7`` in bf16)."""
    h = torch.zeros(1, 4, 2, dtype=torch.bfloat16)
    w = torch.zeros(4, 2, dtype=torch.bfloat16)
    grads = tiled_linear._MixedGrads(h, w, False, False, True, torch.float32)
    eps = 2.0 ** -9
    dz = torch.tensor([[1.0, -1.0, eps, 3.0], [eps, -eps, eps, 4 * eps], [eps, -eps, 0.0, 4 * eps],
                       [eps, -eps, 0.0, 4 * eps]], dtype=torch.float64)
    for _ in range(2):  # two tiles
        grads.add_mixed(None, dz.to(torch.bfloat16), None, None, None)
    assert grads.b.dtype == torch.float32
    torch.testing.assert_close(grads.b.double(), 2 * dz.sum(dim=0), rtol=0, atol=0)


def test_chunk_rule(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tiled_linear.chunk_tokens(4096, 32000, torch.float32, cpu) == (128 << 20) // (4 * 32000) == 1048
    assert tiled_linear.chunk_tokens(8192, 128256, torch.bfloat16, cuda, mixed=True) == (1 << 30) // (6 * 128256)
    assert tiled_linear.chunk_tokens(100, 32000, torch.float32, cpu) == 100
    assert tiled_linear.chunk_tokens(10, 10**9, torch.float32, cpu) == 1
    monkeypatch.setattr(torch_linear, "MEMORY_BUDGET_BYTES", 4 * 1000 * 7)
    assert tiled_linear.chunk_tokens(4096, 1000, torch.float32, cpu) == 7
    assert tiled_linear.chunk_tokens(4096, 1000, torch.float32, cpu, memory_budget_bytes=4 * 1000 * 9) == 9
    monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 5)
    assert tiled_linear.chunk_tokens(4096, 1000, torch.float32, cpu) == 5
    monkeypatch.setattr(tiled_linear, "CHUNK_TOKENS", 6)
    assert tiled_linear.chunk_tokens(4096, 1000, torch.float32, cpu) == 6


@needs_cpu
def test_cpu_compile_fullgraph():
    case = make_linear_case(vocab=257, seed=4)
    case.hidden = torch.nan_to_num(case.hidden)
    cfg = CONFIGS[1]

    def loss_fn(h, w, b):
        out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, case.mask, bias=b, config=cfg,
                                          backend="cpu", check_inputs=False, **case.kwargs())
        return out.loss, out.metrics["clip_frac"]

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager_leaves, comp_leaves = _leaves(case, torch.float32), _leaves(case, torch.float32)
    e_loss, e_aux = loss_fn(*eager_leaves)
    c_loss, c_aux = compiled(*comp_leaves)
    e_loss.backward()
    c_loss.backward()
    torch.testing.assert_close(c_loss, e_loss)
    torch.testing.assert_close(c_aux, e_aux)
    for a, b in zip(comp_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)


@needs_cpu
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, False, False)],
                         ids=["all", "hidden", "none"])
def test_op_passes_opcheck(mixed, dtype, need):
    """``torch.library.opcheck`` of the tiled op (native kernel): schema, fake outputs equal to the real
    ones in shape and dtype (fp32 gradients, empty ones included, and the 0-dim unit), AOT dispatch."""
    if mixed and dtype == torch.float32:
        pytest.skip("the mixed mode is for 16-bit inputs")
    h, w, b, targets, adv, valid, weights, old, ref, config = opcheck_args(dtype)
    args = (h, w, b, targets, adv, valid, weights, old, ref, None, *config, True, *need, 7, "native", mixed)
    torch.library.opcheck(tiled_linear.tiled_linear_policy_loss_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_cpu
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed"])
def test_two_passes_first_order_create_graph_then_a_clear_error(mixed, monkeypatch):
    """``create_graph=True`` works for the first-order gradient (it raised autograd's ``out=`` error); a second
    backward through it raises the named error pointing to the reference backend."""
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed" if mixed else None)
    case = make_linear_case(batch=3, length=5, vocab=300, seed=4, dtype=torch.bfloat16 if mixed else torch.float32)
    case.hidden = torch.nan_to_num(case.hidden)  # no mask here: every row is read
    h, w, b = _leaves(case, case.hidden.dtype)
    logp = fused_rl.linear_token_logprobs(h, w, case.targets, bias=b, backend="cpu")
    (gh,) = torch.autograd.grad(logp.sum(), h, create_graph=True)
    (expected,) = torch.autograd.grad(fused_rl.linear_token_logprobs(h, w, case.targets, bias=b, backend="cpu").sum(),
                                      h)
    torch.testing.assert_close(gh, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no backward of its own.*backend='reference'"):
        gh.sum().backward()


@needs_cpu
def test_two_passes_mixed_unit_reads_no_ignored_row(monkeypatch):
    """In mixed mode the gradient pass scales by the largest upstream gradient of the rows it reads: an inf one at
    an ``IGNORE_INDEX`` target (no row read, no gradient) left every gradient NaN."""
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed")
    case = make_linear_case(batch=3, length=5, vocab=300, seed=4, dtype=torch.bfloat16)
    case.hidden = torch.nan_to_num(case.hidden)  # no mask here: every row is read
    targets = case.targets.clone()
    targets[0, 0] = fused_rl.IGNORE_INDEX
    g = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))
    g[0, 0] = float("inf")
    h, w, b = _leaves(case, torch.bfloat16)
    torch.autograd.backward(fused_rl.linear_token_logprobs(h, w, targets, bias=b, backend="cpu"), g)
    assert all(bool(torch.isfinite(x.grad).all()) for x in (h, w, b))


@needs_cpu
def test_two_passes_mixed_all_zero_upstream_gradients_give_zero_gradients(monkeypatch):
    """In mixed mode the gradient pass writes ``dz`` in units of the largest upstream gradient, and keeps the unit 1
    where every one is 0 (gspo's two passes over a GRPO batch whose groups all had equal rewards: every advantage
    0): the gradients are exactly 0, not ``0 / 0`` NaN."""
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed")
    monkeypatch.setattr(tiled_linear, "_sequences_in_two_passes", lambda device: True)
    case = make_linear_case(batch=3, length=5, vocab=300, seed=4, dtype=torch.bfloat16)
    case.hidden = torch.nan_to_num(case.hidden)
    h, w, b = _leaves(case, torch.bfloat16)
    out = fused_rl.linear_policy_loss(h, w, case.targets, torch.zeros_like(case.advantages), case.mask, bias=b,
                                      config=CONFIGS[2], backend="cpu", **case.kwargs())
    out.loss.backward()
    assert out.loss.item() == 0.0
    for name, x in zip(("hidden", "weight", "bias"), (h, w, b)):
        assert x.grad is not None and (x.grad == 0).all(), name


@needs_cpu
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp"])
def test_two_pass_ops_pass_opcheck(mixed, with_entropy):
    """``torch.library.opcheck`` of the two-pass ops (native kernels): the statistics op with its autograd (the
    gradient op inside its backward) and the gradient op alone."""
    h, w, b, targets, *_ = opcheck_args(torch.bfloat16)
    torch.library.opcheck(tiled_linear.tiled_linear_token_stats_op, (h, w, b, targets, TAU, with_entropy, 7, "native",
                                                                     mixed),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    with torch.no_grad():
        _, ent, lse = tiled_linear.tiled_linear_token_stats_op(h, w, b, targets, TAU, True, 7, "native", mixed)
    g = torch.randn(targets.shape, generator=torch.Generator().manual_seed(0))
    args = (h.detach(), w.detach(), b.detach(), targets, lse, g, ent if with_entropy else None,
            g if with_entropy else None, TAU, True, True, True, 7, "native", mixed)
    torch.library.opcheck(tiled_linear.tiled_linear_token_grad_op, args, test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------- triton backend (interpreter on CPU; CUDA tensors on a GPU)
@on_gpu
@needs_triton
@pytest.mark.parametrize("tiles", ["auto", "fixed"], indirect=True)
@pytest.mark.parametrize("config", CONFIGS, ids=cid)
def test_triton_matches_reference(config, tiles, kernel_calls, two_pass_calls, monkeypatch):
    monkeypatch.setattr(tiled_linear, "_sequences_in_two_passes", lambda device: True)  # CUDA's route
    compare_linear(on_device(make_linear_case(batch=4, length=5, vocab=1000, seed=21), GPU), config, backend="triton")
    assert all(call[0] == "triton" for call in kernel_calls + two_pass_calls)
    assert bool(kernel_calls) == tiled_linear.runs_tiled(config) != bool(two_pass_calls)


@on_gpu
@needs_triton
@pytest.mark.parametrize("tiles", ["small"], indirect=True)
@pytest.mark.parametrize("name", ["sapo", "delta", "k3+", "k1+", "tis_token", "mis_sequence", "dppo_tv"])
def test_triton_token_local_variants(name, tiles, kernel_calls):
    """sapo, delta, the "+" estimators with kl_bias_correction, token rollout correction (the kernel reads the
    rollout log-probs) and a sequence one off-policy (folded into the advantages) run tiled on the triton
    kernel."""
    config = VARIANTS[name]
    case = make_linear_case(batch=4, length=5, vocab=300, seed=len(name))
    compare_linear(with_extras(on_device(case, GPU), config), config, backend="triton")
    assert all(k == "triton" for k, _ in kernel_calls)
    assert kernel_calls and tiled_linear.runs_tiled(config)


@on_gpu
@needs_triton
@pytest.mark.parametrize("tiles", ["small"], indirect=True)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_dtypes_bias_small_tiles(dtype, bias, tiles):
    compare_linear(on_device(make_linear_case(batch=4, length=6, vocab=300, bias=bias, dtype=dtype, seed=22), GPU),
                   CONFIGS[5], backend="triton")


@on_gpu
@needs_triton
@pytest.mark.parametrize("tiles", ["small"], indirect=True)
@pytest.mark.parametrize("mode", ["fp32", "mixed"])
def test_triton_split_single_pass_on_the_tiles(mode, tiles, kernel_calls, monkeypatch):
    """The tiles through the split single pass (``SPLIT_CHUNK = 64``: 5 programs a row at V = 300), fp32 tiles
    to fp32 / bf16 gradients and the mixed mode's bf16 ``dz``: the reference's values."""
    from fused_rl.kernels import logits as K

    monkeypatch.setattr(K, "SPLIT_CHUNK", 64)
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", mode)
    for dtype in ((torch.bfloat16,) if mode == "mixed" else (torch.float32, torch.bfloat16)):
        compare_linear(on_device(make_linear_case(batch=3, length=5, vocab=300, dtype=dtype, seed=25), GPU),
                       CONFIGS[5], backend="triton")
    assert kernel_calls and all(k == "triton" for k, _ in kernel_calls)


@on_gpu
@needs_triton
@pytest.mark.parametrize("tiles", ["fixed"], indirect=True)
def test_triton_frozen_weight_and_mixed_mode(tiles, monkeypatch):
    compare_linear(on_device(make_linear_case(batch=3, length=5, vocab=300, seed=23), GPU), CONFIGS[1],
                   frozen_weight=True, backend="triton")
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed")
    for dtype in (torch.bfloat16, torch.float16):
        compare_linear(on_device(make_linear_case(batch=3, length=5, vocab=300, dtype=dtype, seed=24), GPU),
                       CONFIGS[6], backend="triton")


# ------------------------------------------------------------------------- cuda backend (GPU only)
@on_gpu
@needs_cuda
@pytest.mark.parametrize("tiles", ["auto", "small"], indirect=True)
@pytest.mark.parametrize("config", CONFIGS, ids=cid)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_reference(config, dtype, tiles):
    compare_linear(on_device(make_linear_case(vocab=4099, dtype=dtype, seed=31), "cuda"), config, backend="cuda")


@on_gpu
@needs_triton
@pytest.mark.skipif(GPU != "cuda", reason="the default mixed mode of bf16 inputs is CUDA's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_triton_gpu_default_mode_frozen_weight(dtype):
    """On CUDA the default modes (bf16 mixed, fp16 and fp32 in fp32); frozen weight, bias."""
    case = on_device(make_linear_case(vocab=4099, dtype=dtype, seed=32), "cuda")
    compare_linear(case, CONFIGS[1], backend="triton")
    compare_linear(case, CONFIGS[0], frozen_weight=True, backend="triton")
