"""The fused linear policy loss (chunked torch backend) against the reference, which materializes the
full fp32 logits ``hidden @ weight.T + bias`` and runs ``log_softmax`` + the loss math + autograd."""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

import fused_rl
from fused_rl.backends import get_backend, tiled_linear, torch_linear
from fused_rl.backends.custom_ops import config_args
from fused_rl.backends.reference import ReferenceBackend
from fused_rl.validation import prepare_policy_inputs
from helpers import CONFIGS, GRAD_TOLERANCES, TOLERANCES, expected_results, logits_gradient_bound
from helpers import assert_close as _assert_close

HIDDEN = 96
#: grad_hidden / grad_weight are length-V / length-N dot products (not elementwise like dlogits): in
#: fp32 two summation orders differ by ~1e-6 on O(1) values, so fp32 gets atol 1e-5 (the project's
#: fp32 guideline); bf16 keeps the one-rounding tolerance of ``helpers.GRAD_TOLERANCES``.
LINEAR_GRAD_TOLERANCES = {**GRAD_TOLERANCES, torch.float32: (1e-5, 1e-4)}


def assert_close(actual, expected, dtype, what, grad=False, equal_nan=False):
    """``helpers.assert_close`` with :data:`LINEAR_GRAD_TOLERANCES` for gradients."""
    if not grad:
        return _assert_close(actual, expected, dtype, what, equal_nan=equal_nan)
    atol, rtol = LINEAR_GRAD_TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


class _TokenValuesAsLeaves(ReferenceBackend):
    """The reference backend with its per-token log-probs and entropies made autograd leaves (``self.leaves``), so
    that a backward of its loss gives the loss's derivatives with respect to them."""

    leaves: tuple = ()

    def token_logprobs(self, logits, targets, temperature, return_entropy, inplace=False):
        values = super().token_logprobs(logits, targets, temperature, return_entropy, inplace)
        self.leaves = tuple(None if x is None else x.detach().requires_grad_(True) for x in values)
        return self.leaves


def token_gradient_unit(z, case, config, token_normalizer=None) -> torch.Tensor:
    """``max_t max(|dL/dlogp_t|, |dL/dH_t|)`` of the reference loss at the logits ``z``: the unit in which the
    two-pass route's gradient kernel writes a 16-bit ``dz`` (``tiled_linear.tiled_linear_token_grad_op``)."""
    inputs = prepare_policy_inputs(tuple(z.shape), z.device, case.targets, case.advantages, case.mask, config=config,
                                   token_normalizer=token_normalizer, compute_dtype=torch.float32, check_inputs=False,
                                   **case.kwargs())
    backend = _TokenValuesAsLeaves()
    backend.policy_loss(z.detach(), inputs, config, compute_entropy=True).loss.backward()
    return torch.stack([x.grad.abs().amax() for x in backend.leaves if x is not None and x.grad is not None]).amax()


def mixed_mode_slack(case, leaves, config, hidden_view, dtype=torch.bfloat16, **loss_kwargs):
    """Per-element bounds on the gradient error that the mixed GEMM mode adds by rounding ``dz`` (the
    logits gradient) to ``dtype`` once: the unit roundoff of a ``p``-bit significand is ``2^-p``, so bf16
    (8 bits): ``|dz - bf16(dz)| <= 2^-8 |dz|`` (the bound was 2^-9, half of it, until a fuzz case hit the
    gap: ``test_linear_fuzz.py``). fp16 (11 bits): the kernel writes ``dz / u``, so ``<= 2^-11 |dz| + 2^-25 u``
    (half of fp16's subnormal spacing, in units of ``u``), with ``u = max_t w_t`` (the aggregation weights) in
    the single pass and ``u`` = :func:`token_gradient_unit` in the two passes of the other configs (a fuzz case:
    a gmpo row whose coefficient ``dL/dlogp`` was 7e-5 of the batch's largest had its ``dz`` in fp16's
    subnormals, 1% off; the bound with ``max_t w_t`` was 4e-5 for an error of 1.5e-4). For ``grad_h = dz W``,
    ``grad_W = dz^T h`` and ``grad_b = sum_t dz`` the bound is that of the same products of absolute values,
    i.e. the gradients of ``sum(bound(dz) * (|h| |W|^T + |b|))`` with respect to ``|h|, |W|, |b|``. ``dz`` is the
    reference's, from fp32 logits; a wrong formula still misses by O(|grad|)."""
    rh, rw, rb = leaves
    view = hidden_view or (lambda x: x)
    z = torch.nn.functional.linear(view(rh.detach()), rw.detach(), None if rb is None else rb.detach())
    z.requires_grad_(True)
    fused_rl.reference.policy_loss(z, case.targets, case.advantages, case.mask, config=config,
                                   **loss_kwargs, **case.kwargs()).loss.backward()
    if dtype == torch.bfloat16:
        bound = z.grad.abs() * 2.0 ** -8
    else:
        normalizer = loss_kwargs.get("token_normalizer")
        unit = fused_rl.loss_math.aggregation_weights(case.mask, config, normalizer).max() \
            if tiled_linear.runs_tiled(config, off_policy=case.old is not None) \
            else token_gradient_unit(z, case, config, normalizer)
        rows = case.mask & (case.targets != fused_rl.IGNORE_INDEX)  # the kernel writes exact zero rows elsewhere
        bound = z.grad.abs() * 2.0 ** -11 + 2.0 ** -25 * unit * rows.unsqueeze(-1).to(z.dtype)
    return abs_gemm_bounds(bound, leaves, view)


def abs_gemm_bounds(bound, leaves, view):
    """Per-element bounds on the errors of ``grad_h = dz W``, ``grad_W = dz^T h``, ``grad_b = sum_t dz`` when
    each ``dz`` entry is off by at most ``bound`` (same shape as the logits): the same products of absolute
    values, i.e. the gradients of ``sum(bound * (|h| |W|^T + |b|))`` with respect to ``|h|, |W|, |b|``."""
    absolute = [None if x is None else x.detach().abs().requires_grad_(True) for x in leaves]
    ah, aw, ab = absolute
    (bound * torch.nn.functional.linear(view(ah), aw, ab)).sum().backward()
    return [None if x is None else x.grad for x in absolute]


@dataclass
class LinearCase:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
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


def make_linear_case(batch: int = 4, length: int = 6, vocab: int = 1000, hidden_size: int = HIDDEN, *,
                     kind: str = "randn", bias: bool = True, dtype=torch.float32, seed: int = 0,
                     per_token_adv: bool = False, spread: float = 0.3) -> LinearCase:
    """A ragged batch like ``helpers.make_case``: row 0 fully masked, row 1 a length-1 response, the
    rest random right padding, an ``IGNORE_INDEX`` target, NaN hidden states in the padding. ``kind``
    shapes the logits through the bias: ``peaked`` (one vocabulary entry +25), ``negative`` (-200: every ``exp`` of a
    logit underflows fp32 without the row max subtracted)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * (2.0 / hidden_size ** 0.5)
    b = torch.randn(vocab, generator=g) if bias else None
    if kind != "randn":
        assert bias, kind
        if kind == "peaked":
            b[int(torch.randint(0, vocab, (1,), generator=g))] += 25.0
        elif kind == "negative":
            b -= 200.0
        else:
            raise ValueError(kind)
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    if batch > 2:
        lengths[0] = 0
        lengths[1] = 1
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    targets[-1, -1] = fused_rl.IGNORE_INDEX
    advantages = torch.randn((batch, length) if per_token_adv else (batch,), generator=g)
    with torch.no_grad():
        lp = fused_rl.reference.linear_token_logprobs(hidden, weight, targets, bias=b, check_inputs=False)
    old = lp + spread * torch.randn(lp.shape, generator=g)
    ref = lp + spread * torch.randn(lp.shape, generator=g)
    if batch > 2:
        hidden[0, -1] = float("nan")  # padding content must never matter
    cast = (lambda x: x.to(dtype)) if dtype != torch.float32 else (lambda x: x)
    return LinearCase(cast(hidden), cast(weight), None if b is None else cast(b), targets, advantages, mask,
                      old, ref)


@pytest.fixture
def tiles(request, monkeypatch):
    """``auto``: the default tile rule; ``small``: 3-token tiles (gspo sequences spanning several tiles,
    token tiles cutting sequences); ``fixed``: small tiles that are fixed slices (the no-gather path
    used off CPU), masked rows computed and zeroed."""
    mode = getattr(request, "param", "auto")
    if mode in ("small", "fixed"):
        monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 3)
    if mode == "fixed":
        monkeypatch.setattr(torch_linear, "GATHER_VALID", False)
    return mode


def _leaves(case: LinearCase, dtype, frozen_weight: bool = False, clean: bool = False):
    """Fresh leaves in ``dtype``; ``clean`` replaces the NaN padding by 0 (for the reference, whose
    ``log_softmax`` backward turns a NaN row into NaN gradients everywhere in ``grad_weight``)."""
    def leaf(x, grad=True):
        if x is None:
            return None
        x = x.detach().to(dtype)
        return (torch.nan_to_num(x) if clean else x.clone()).requires_grad_(grad)

    return leaf(case.hidden), leaf(case.weight, not frozen_weight), leaf(case.bias)


def compare_linear(case: LinearCase, config, *, frozen_weight: bool = False, token_normalizer=None,
                   compute_entropy: bool = True, hidden_view=None, backend: str = "torch") -> None:
    """Loss, logprobs, entropy, metrics and all three gradients of ``backend`` against
    ``helpers.expected_results``: the fp64 oracle under its rule for fp32 inputs (the logits scale ``s`` from
    ``max(|h| |W|^T + |b|) / tau``, which bounds an fp32 logit's rounding; the gradients' bounds carry
    ``helpers.logits_gradient_bound`` through :func:`abs_gemm_bounds`), the fp32 reference on the same
    bf16 / fp16 inputs under :data:`LINEAR_GRAD_TOLERANCES` (plus the mixed GEMM mode's rounding bound,
    :func:`mixed_mode_slack`, where it runs)."""
    dtype = case.hidden.dtype
    view = hidden_view or (lambda x: x)
    grad_names = ["grad_hidden", None if frozen_weight else "grad_weight", None if case.bias is None else "grad_bias"]

    def reference(h, w, b):
        return fused_rl.reference.linear_policy_loss(
            view(h), w, case.targets, case.advantages, case.mask, bias=b, config=config,
            token_normalizer=token_normalizer, compute_entropy=compute_entropy, **case.kwargs())

    def zscale(xs):  # the finite logits' bound (a -inf bias entry is p = 0, not a scale)
        h, w, b = (None if x is None else x.detach().abs() for x in xs)
        b = None if b is None else torch.where(torch.isfinite(b), b, 0.0)
        return max(1.0, float(torch.nn.functional.linear(view(h), w, b).max()) / config.temperature)

    def grad_bounds(coef, ent_coef, xs):
        h, w, b = (None if x is None else x.detach() for x in xs)
        z = torch.nn.functional.linear(view(h), w, b)
        bound = logits_gradient_bound(z, case.targets, coef, ent_coef, config.temperature)
        return {name: x for name, x in zip(grad_names, abs_gemm_bounds(bound, xs, view)) if name is not None}

    h, w, b = _leaves(case, dtype, frozen_weight)
    slack = {}
    if backend != "torch" and tiled_linear._mode(h.device, dtype) == "mixed":
        leaves32 = _leaves(case, torch.float32, frozen_weight, clean=True)
        slack = dict(zip(("grad_hidden", "grad_weight", "grad_bias"),
                         mixed_mode_slack(case, leaves32, config, hidden_view, dtype,
                                          token_normalizer=token_normalizer, compute_entropy=compute_entropy)))

    def old_tols(name):
        if not name.startswith("grad"):
            return TOLERANCES[dtype]
        atol, rtol = LINEAR_GRAD_TOLERANCES[dtype]
        return (atol if slack.get(name) is None else atol + slack[name]), rtol

    clean = [None if x is None else torch.nan_to_num(x.detach()) for x in (case.hidden, case.weight, case.bias)]
    expected = expected_results(reference, clean, grad_names, dtype, config.temperature, old_tols, zscale,
                                grad_bounds)
    got = fused_rl.linear_policy_loss(
        view(h), w, case.targets, case.advantages, case.mask, bias=b,
        config=config, token_normalizer=token_normalizer, compute_entropy=compute_entropy, backend=backend,
        **case.kwargs())
    got.loss.backward()
    assert torch.isfinite(got.loss)
    expected.check("loss", got.loss)
    expected.check("logprobs", got.logprobs)
    if expected.values["entropy"] is None:
        assert got.entropy is None
    else:
        expected.check("entropy", got.entropy)
    assert set(got.metrics) == set(k[len("metric "):] for k in expected.values if k.startswith("metric "))
    for name, value in got.metrics.items():
        expected.check(f"metric {name}", value, equal_nan=True)
    if frozen_weight:
        assert w.grad is None
    for what, x in zip(grad_names, (h, w, b)):
        if what is None:
            continue
        assert x.grad is not None and x.grad.dtype == dtype, what
        assert torch.isfinite(x.grad).all(), what
        expected.check(what, x.grad)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}")
@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(config, vocab, bias, dtype):
    compare_linear(make_linear_case(vocab=vocab, bias=bias, dtype=dtype, seed=vocab + bias), config)


@pytest.mark.parametrize("tiles", ["small", "fixed"], indirect=True)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}")
def test_tile_boundaries(config, tiles):
    """Tiles of 3 tokens: boundaries inside sequences, gspo sequences over several tiles (two passes)."""
    compare_linear(make_linear_case(batch=5, length=7, vocab=1000, seed=11, per_token_adv=True), config)


@pytest.mark.parametrize("kind", ["peaked", "negative"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hard_logits(kind, dtype):
    compare_linear(make_linear_case(vocab=4099, kind=kind, dtype=dtype, seed=5), CONFIGS[1])


@pytest.mark.parametrize("tiles", ["auto", "fixed"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_weight_allocates_no_weight_gradient(dtype, tiles, monkeypatch):
    allocated = []
    original = torch_linear._Grads.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        allocated.append((self.h is not None, self.w is not None, self.b is not None))

    monkeypatch.setattr(torch_linear._Grads, "__init__", spy)
    compare_linear(make_linear_case(vocab=1000, dtype=dtype, seed=2), CONFIGS[1], frozen_weight=True)
    assert allocated == [(True, False, True)]


def test_only_hidden_requires_grad(monkeypatch):
    case = make_linear_case(vocab=1000, bias=False, seed=4)
    h = case.hidden.clone().requires_grad_(True)
    out = fused_rl.linear_policy_loss(h, case.weight, case.targets, case.advantages, case.mask, config=CONFIGS[0],
                                      backend="torch", **case.kwargs())
    out.loss.backward()
    rh = torch.nan_to_num(case.hidden).requires_grad_(True)
    fused_rl.reference.linear_policy_loss(rh, case.weight, case.targets, case.advantages, case.mask,
                                          config=CONFIGS[0], **case.kwargs()).loss.backward()
    assert_close(h.grad, rh.grad, torch.float32, "grad_hidden", grad=True)


def test_token_normalizer_no_entropy_and_sliced_hidden():
    """TRL's ``num_items_in_batch``, ``compute_entropy=False`` and a non-contiguous ``hidden[:, :-1]``."""
    case = make_linear_case(batch=3, length=6, vocab=1000, seed=8)
    full = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(3))
    full[:, :-1] = case.hidden
    case.hidden = full
    compare_linear(case, CONFIGS[0], token_normalizer=torch.tensor(17.0), compute_entropy=False,
                   hidden_view=lambda x: x[:, :-1])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_all_masked_and_no_grad(backend):
    reason = fused_rl.available_backends(torch.device("cpu"))[backend]
    if reason is not None:
        pytest.skip(reason)
    case = make_linear_case(vocab=1000, seed=6)
    h, w, b = _leaves(case, torch.float32)
    out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, torch.zeros_like(case.mask), bias=b,
                                      backend=backend, **case.kwargs())
    out.loss.backward()
    assert out.loss.item() == 0.0 and (out.logprobs == 0).all()
    for x in (h, w, b):
        assert (x.grad == 0).all()
    with torch.no_grad():
        got = fused_rl.linear_policy_loss(case.hidden, case.weight, case.targets, case.advantages, case.mask,
                                          bias=case.bias, config=CONFIGS[2], backend=backend, **case.kwargs())
    expected = fused_rl.reference.linear_policy_loss(torch.nan_to_num(case.hidden), case.weight, case.targets,
                                                     case.advantages, case.mask, bias=case.bias, config=CONFIGS[2],
                                                     **case.kwargs())
    assert_close(got.loss, expected.loss, torch.float32, "loss")
    assert_close(got.logprobs, expected.logprobs, torch.float32, "logprobs")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_no_valid_token_zeroes_the_unwritten_weight_gradient(backend):
    """With no valid token the CPU gathers no tile, so nothing writes the weight-gradient buffer (allocated without a
    zero fill: the first tile writes it) and the results zero it. Deterministic mode fills uninitialized memory with
    NaN, so a missing zero fill cannot pass on whatever the allocator's memory held (the loss and the two passes of
    ``linear_token_logprobs``, whose targets are all ``IGNORE_INDEX``)."""
    reason = fused_rl.available_backends(torch.device("cpu"))[backend]
    if reason is not None:
        pytest.skip(reason)
    case = make_linear_case(vocab=300, hidden_size=32, seed=6)
    ignored = torch.full_like(case.targets, fused_rl.IGNORE_INDEX)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for run in ("loss", "token_logprobs"):
            h, w, b = _leaves(case, torch.float32, clean=True)
            if run == "loss":
                out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, torch.zeros_like(case.mask),
                                                  bias=b, config=CONFIGS[1], backend=backend, **case.kwargs())
                out.loss.backward()
            else:
                logp, ent = fused_rl.linear_token_logprobs(h, w, ignored, bias=b, return_entropy=True, backend=backend)
                (logp.sum() + ent.sum()).backward()
            for name, x in zip(("hidden", "weight", "bias"), (h, w, b)):
                assert x.grad is not None and (x.grad == 0).all(), (run, name)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def test_chunk_rule(monkeypatch):
    assert torch_linear.chunk_tokens(4096, 32000, torch.float32) == (128 << 20) // (8 * 32000) == 524
    assert torch_linear.chunk_tokens(4096, 32000, torch.bfloat16, memory_budget_bytes=1 << 30) == 4096
    assert torch_linear.chunk_tokens(10, 10**9, torch.float32) == 1
    # on CUDA 1 GiB: 1046 tokens at V = 128256 (a sequence-level config's sequences of up to that in one pass)
    assert torch_linear.chunk_tokens(8192, 128256, torch.bfloat16, device=torch.device("cuda")) == 1046
    monkeypatch.setattr(torch_linear, "MEMORY_BUDGET_BYTES", 2 * 4 * 1000 * 7)
    assert torch_linear.chunk_tokens(4096, 1000, torch.float32) == 7
    assert torch_linear.chunk_tokens(4096, 1000, torch.float32, device=torch.device("cuda")) == 7
    monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 5)
    assert torch_linear.chunk_tokens(4096, 1000, torch.float32) == 5


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu", "triton")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
@pytest.mark.parametrize("config", [CONFIGS[1], fused_rl.PolicyLossConfig(policy_loss="gspo")], ids=["token", "sequence"])
def test_backward_allocates_no_zero_gradients_for_the_other_outputs(backend, config):
    """The fused-linear loss returns its stored gradients in the backward; autograd materialized zero gradients
    for its non-differentiable outputs first (``aten.zeros`` of ``(V, H)`` and ``(B, T, H)``: 2 GiB fp32 at
    V = 128256, H = 4096, beyond the documented buffers). Logged with a dispatch mode: no ``zeros`` of those
    shapes in the backward, on the tiled (token) and the two-pass (sequence) route."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.zeros = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "zeros" in str(func):
                self.zeros.append(tuple(out.shape))
            return out

    case = make_linear_case(vocab=300, hidden_size=16, seed=3)
    h = case.hidden.clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, case.mask, config=config, backend=backend,
                                      **case.kwargs())
    with Shapes() as log:
        out.loss.backward()
    assert not {tuple(h.shape), tuple(w.shape)} & set(log.zeros), log.zeros
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu", "triton")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
def test_memory_budget_argument_sets_the_tiles(backend, monkeypatch):
    """``memory_budget_bytes`` of the public functions reaches the tiles: 3 tokens a tile here (the tiled
    route's one fp32 ``(n, V)`` buffer; torch_linear's two, and the delegated / two-pass configs' too), and
    the results match the default tiles'; bad values are refused."""
    vocab, calls = 300, []
    if backend == "torch":
        real = torch_linear._tile_stats
        monkeypatch.setattr(torch_linear, "_tile_stats", lambda h, *a: calls.append(h.shape[0]) or real(h, *a))
        budget = 2 * 4 * vocab * 3
    else:
        real = tiled_linear.KERNELS
        monkeypatch.setattr(tiled_linear, "KERNELS",
                            {k: (lambda fn: lambda z, *a, **kw: calls.append(z.shape[0]) or fn(z, *a, **kw))(fn)
                             for k, fn in real.items()})
        budget = 4 * vocab * 3
    case = make_linear_case(vocab=vocab, hidden_size=32, seed=9)
    case.hidden = torch.nan_to_num(case.hidden)
    outs = []
    for b in (np.int64(budget), None):  # a numpy integer too (a size computed with numpy)
        calls.clear()
        h = case.hidden.clone().requires_grad_(True)
        out = fused_rl.linear_policy_loss(h, case.weight, case.targets, case.advantages, case.mask, config=CONFIGS[1],
                                          backend=backend, memory_budget_bytes=b, **case.kwargs())
        out.loss.backward()
        outs.append((out.loss, h.grad, max(calls)))
    (loss, grad, most), (loss_default, grad_default, most_default) = outs
    assert most == 3 < most_default
    torch.testing.assert_close(loss, loss_default, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, grad_default, rtol=1e-5, atol=1e-7)
    for bad in (0, -1, 1.5, True, "1GiB", np.float64(1e9), np.int32(-1)):
        with pytest.raises(ValueError, match="memory_budget_bytes"):
            fused_rl.linear_policy_loss(case.hidden, case.weight, case.targets, case.advantages, case.mask,
                                        backend=backend, memory_budget_bytes=bad)
        with pytest.raises(ValueError, match="memory_budget_bytes"):
            fused_rl.linear_token_logprobs(case.hidden, case.weight, case.targets.clamp(min=0), backend=backend,
                                           memory_budget_bytes=bad)


# ----------------------------------------------------------------------------- linear_token_logprobs
@pytest.mark.parametrize("tiles", ["auto", "small", "fixed"], indirect=True)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_token_logprobs_upstream_grads(temperature, dtype, tiles):
    case = make_linear_case(batch=3, length=5, vocab=4099, seed=9, dtype=dtype)
    case.hidden = torch.nan_to_num(case.hidden)
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    results = {}
    for name, fn, leaf_dtype in (("ref", fused_rl.reference.linear_token_logprobs, torch.float32),
                                 ("torch", fused_rl.linear_token_logprobs, dtype)):
        h, w, b = _leaves(case, leaf_dtype)
        kwargs = {} if name == "ref" else {"backend": "torch"}
        logp, ent = fn(h, w, case.targets, bias=b, temperature=temperature, return_entropy=True, **kwargs)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        results[name] = (logp, ent, h.grad, w.grad, b.grad)
    names = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    for got, exp, what in zip(results["torch"], results["ref"], names):
        assert_close(got, exp, dtype, what, grad=what.startswith("grad"))
    assert results["torch"][0][-1, -1] == 0 and (results["torch"][2][-1, -1] == 0).all()


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_linear_token_logprobs_single_output(which):
    case = make_linear_case(batch=2, length=4, vocab=1000, seed=12, bias=False)
    out = {}
    for name, fn in (("ref", fused_rl.reference.linear_token_logprobs),
                     ("torch", lambda *a, **k: fused_rl.linear_token_logprobs(*a, backend="torch", **k))):
        h, w, _ = _leaves(case, torch.float32)
        if which == "logp":
            fn(h, w, case.targets).pow(2).sum().backward()
        else:
            fn(h, w, case.targets, return_entropy=True)[1].sum().backward()
        out[name] = (h.grad, w.grad)
    for got, exp, what in zip(out["torch"], out["ref"], ("grad_hidden", "grad_weight")):
        assert_close(got, exp, torch.float32, what, grad=True)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (2, 3), generator=g)
    t[1, 2] = fused_rl.IGNORE_INDEX
    adv = torch.randn(2, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = -torch.rand(2, 3, generator=g, dtype=torch.float64) - 2
    cfg = CONFIGS[1]

    def tok(h, w, b):
        return fused_rl.linear_token_logprobs(h, w, t, bias=b, temperature=0.8, return_entropy=True,
                                              backend="torch")

    def loss(h, w, b):
        return fused_rl.linear_policy_loss(h, w, t, adv, mask, bias=b, old_logprobs=old, ref_logprobs=old, config=cfg,
                                           backend="torch").loss

    assert torch.autograd.gradcheck(tok, (h, w, b))
    assert torch.autograd.gradcheck(loss, (h, w, b))


def test_compile_fullgraph():
    case = make_linear_case(vocab=257, seed=4)
    case.hidden = torch.nan_to_num(case.hidden)
    cfg = CONFIGS[1]

    def loss_fn(h, w, b):
        out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, case.mask, bias=b, config=cfg,
                                          backend="torch", check_inputs=False, **case.kwargs())
        return out.loss, out.metrics["clip_frac"]

    def tok_fn(h, w, b):
        lp, ent = fused_rl.linear_token_logprobs(h, w, case.targets, bias=b, return_entropy=True, backend="torch",
                                                 check_inputs=False, temperature=0.9)
        return (lp * 1.5).sum() - ent.sum(), lp.detach().sum()

    for fn in (loss_fn, tok_fn):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        eager_leaves, comp_leaves = _leaves(case, torch.float32), _leaves(case, torch.float32)
        e_loss, e_aux = fn(*eager_leaves)
        c_loss, c_aux = compiled(*comp_leaves)
        e_loss.backward()
        c_loss.backward()
        torch.testing.assert_close(c_loss, e_loss)
        torch.testing.assert_close(c_aux, e_aux)
        for a, b in zip(comp_leaves, eager_leaves):
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("backend", [b for b in ("reference", "torch", "cpu", "triton")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
def test_compile_dynamic_shapes_and_configs(backend):
    """``torch.compile(fullgraph=True, dynamic=True)`` of the fused-linear and the logits loss: the
    config travels as a string formed at construction (``repr`` of the float fields, symbolic under
    ``dynamic=True``, could not be traced); a new length and a new config give the eager values."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 16, generator=g)

    def linear(h, t, a, m, ref, cfg):
        return fused_rl.linear_policy_loss(h, w, t, a, m, ref_logprobs=ref, config=cfg, backend=backend,
                                           check_inputs=False).loss

    def logits(x, t, a, m, ref, cfg):
        return fused_rl.policy_loss(x, t, a, m, ref_logprobs=ref, config=cfg, backend=backend,
                                    check_inputs=False).loss

    for fn, width in ((linear, 16), (logits, 50)):
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
        for length, beta in ((3, 0.1), (5, 0.1), (5, 0.3)):
            cfg = fused_rl.PolicyLossConfig(kl="k3", beta=beta, clip_low=0.1 + beta)
            x = torch.randn(2, length, width, generator=g)
            args = (torch.randint(0, 50, (2, length), generator=g), torch.randn(2, generator=g),
                    torch.ones(2, length, dtype=torch.bool), torch.randn(2, length, generator=g) - 4, cfg)
            xs = [x.clone().requires_grad_(True) for _ in range(2)]
            got, expected = compiled(xs[0], *args), fn(xs[1], *args)
            got.backward()
            expected.backward()
            torch.testing.assert_close(got, expected)
            torch.testing.assert_close(xs[0].grad, xs[1].grad)


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu", "cpu-mixed")
                                     if fused_rl.available_backends(torch.device("cpu"))[b.split("-")[0]] is None])
@pytest.mark.parametrize("normalizer, scale", [(None, 65536.0), (2.0 ** 20, 32768.0)])
def test_fp16_gradients_survive_a_loss_scale(backend, normalizer, scale, monkeypatch):
    """fp16 inputs under a loss scale (GradScaler starts at 65536): the forward's gradients are kept in
    fp32 until the backward multiplies them by ``grad_output``, so they neither overflow (an fp16
    ``grad_output`` of 65536 is inf) nor flush to 0 before scaling (``w_t p`` at a token normalizer of
    2^20 is below fp16's subnormals); all three gradients match the fp64 reference of the same fp16
    inputs to fp16 precision. ``cpu-mixed``: the tiled route's mixed GEMM mode (opt-in for fp16 on CUDA,
    emulated), whose kernel writes an fp16 ``dz`` in units of the largest aggregation weight (without
    them, ``w_t p`` at 2^20 flushes to 0 in that fp16 tile)."""
    if backend == "cpu-mixed":
        monkeypatch.setattr(fused_rl.backends.tiled_linear, "GEMM_MODE", "mixed")
        backend = "cpu"
    case = make_linear_case(vocab=300, hidden_size=32, seed=6)
    case.hidden = torch.nan_to_num(case.hidden)
    kw = dict(token_normalizer=normalizer, old_logprobs=case.old, ref_logprobs=case.ref, config=CONFIGS[1])
    grads = []
    for dtype, fn in ((torch.float16, lambda *a, **k: fused_rl.linear_policy_loss(*a, backend=backend, **k)),
                      (torch.float64, fused_rl.reference.linear_policy_loss)):
        h, w, b = (x.to(torch.float16).to(dtype).requires_grad_(True) for x in (case.hidden, case.weight, case.bias))
        out = fn(h, w, case.targets, case.advantages, case.mask, bias=b, **kw)
        (out.loss * scale).backward()
        grads.append([x.grad for x in (h, w, b)])
    for name, got, expected in zip(("hidden", "weight", "bias"), *grads):
        assert got.dtype == torch.float16 and torch.isfinite(got).all(), name
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < 2e-3, (name, float(err))


@pytest.mark.parametrize("backend", [b for b in ("reference", "torch", "cpu", "triton")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_does_not_change_the_gradients(backend, amp):
    """The fused-linear ops compute their gradients in the forward, inside the caller's autocast region
    (HF / accelerate wrap the loss in it; fp32 hidden states and LM head are the usual AMP setup): they run
    with autocast off, so the gradients are the fp32 ones. Before, the hidden gradient's GEMM ran in fp16
    on the unscaled ``w_t p`` (74% zeros at a token normalizer of 2^20, under a loss scale)."""
    case = make_linear_case(vocab=300, hidden_size=32, seed=3)
    config = CONFIGS[1].replace(entropy_coef=0.01)
    results = []
    for autocast in (False, True):
        h, w, b = (x.detach().clone().requires_grad_(True) for x in (case.hidden, case.weight, case.bias))
        with torch.autocast("cpu", dtype=amp, enabled=autocast):
            out = fused_rl.linear_policy_loss(h, w, case.targets, case.advantages, case.mask, bias=b, config=config,
                                              token_normalizer=2.0 ** 20, backend=backend, **case.kwargs())
            lp, ent = fused_rl.linear_token_logprobs(h, w, torch.where(case.mask, case.targets, -100), bias=b,
                                                     return_entropy=True, backend=backend)
            (out.loss * 32768.0 + (lp * case.advantages.unsqueeze(1)).sum() + ent.sum()).backward()
        results.append([out.loss, lp, ent, h.grad, w.grad, b.grad])
    names = ("loss", "logp", "entropy") + (("hidden", "weight", "bias") if backend != "reference" else ())
    for name, got, expected in zip(names, *results[::-1]):  # the reference's backward GEMMs are autocast's
        assert got.dtype == expected.dtype == torch.float32, name
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_operand_dtypes_are_refused_by_name(backend):
    """float8 operands, which no backend computes in, are refused under ``auto`` as when named (``auto`` fell back to
    the torch backend and returned float8 gradients, most entries rounded to 0); so is a bf16 / fp32 pair (autocast's
    bf16 head output against the fp32 head weight), with the way out."""
    case = make_linear_case(vocab=50, hidden_size=16, seed=0)
    args = (case.targets, case.advantages, case.mask)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="hidden must be a float32, bfloat16, float16 or float64 torch.Tensor"):
        fused_rl.linear_policy_loss(case.hidden.to(fp8), case.weight.to(fp8), *args, backend=backend)
    with pytest.raises(ValueError, match="weight must be a float32, bfloat16, float16 or float64 torch.Tensor"):
        fused_rl.linear_token_logprobs(case.hidden, case.weight.to(fp8), case.targets, backend=backend)
    with pytest.raises(ValueError, match=r"weight dtype torch.float32 differs from hidden dtype torch.bfloat16: cast"):
        fused_rl.linear_policy_loss(case.hidden.bfloat16(), case.weight, *args, backend=backend)
    with pytest.raises(ValueError, match="backend 'torch' does not support torch.float8_e4m3fn"):
        get_backend("auto", torch.device("cpu"), fp8, linear=True)


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu", "triton")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
def test_neg_inf_bias_entries_are_p_zero(backend):
    """A bias with ``-inf`` entries (vocabulary ids blocked) gives those logits ``p = 0``: entropies, the
    entropy bonus, the top-entropy mask (torch_linear for every backend) and all gradients as the
    reference's, finite (torch_linear's entropy was ``0 * -inf = NaN``)."""
    case = make_linear_case(vocab=300, hidden_size=32, seed=5)
    case.bias[-40:] = float("-inf")
    case.targets = case.targets % 260
    for config in (CONFIGS[1].replace(entropy_coef=0.05), CONFIGS[1].replace(top_entropy_quantile=0.5)):
        compare_linear(case, config, backend=backend)
    tgt = torch.where(case.mask, case.targets, -100)
    outs = []
    for be in (backend, "reference"):
        h, w, b = (x.detach().clone().requires_grad_(True) for x in (torch.nan_to_num(case.hidden), case.weight,
                                                                      case.bias))
        lp, ent = fused_rl.linear_token_logprobs(h, w, tgt, bias=b, return_entropy=True, backend=be)
        (lp.sum() + 0.5 * ent.sum()).backward()
        outs.append([lp, ent, h.grad, w.grad, b.grad])
    for name, got, expected in zip(("logp", "entropy", "hidden", "weight", "bias"), *outs):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu")
                                     if fused_rl.available_backends(torch.device("cpu"))[b] is None])
def test_bf16_parameter_gradients_rounded_once(backend):
    """The weight and bias gradients stay in their fp32 accumulators until the backward multiplies them
    by ``grad_output`` and rounds the product to bf16 (one pass over the ``(V, H)`` buffer, one rounding):
    every element within half a bf16 ulp of the fp64 reference of the same bf16 inputs, plus the fp32
    accumulation error (``1e-5`` of the sum of absolute terms). Rounding to bf16 in the forward and
    again after the multiply (the earlier form) misses that bound on a large fraction of the elements."""
    case = make_linear_case(vocab=300, hidden_size=32, seed=8)
    case.hidden = torch.nan_to_num(case.hidden)
    scale = 0.7371
    kw = dict(config=CONFIGS[1], **case.kwargs())
    grads = []
    for dtype, fn in ((torch.bfloat16, lambda *a, **k: fused_rl.linear_policy_loss(*a, backend=backend, **k)),
                      (torch.float64, fused_rl.reference.linear_policy_loss)):
        h, w, b = (x.to(torch.bfloat16).to(dtype).requires_grad_(True) for x in (case.hidden, case.weight, case.bias))
        (fn(h, w, case.targets, case.advantages, case.mask, bias=b, **kw).loss * scale).backward()
        grads.append((w.grad, b.grad))
    leaves = [x.to(torch.bfloat16).double().requires_grad_(True) for x in (case.hidden, case.weight, case.bias)]
    terms = mixed_mode_slack(case, leaves, CONFIGS[1], None)  # 2^-8 sum_t |dz| |h| (sum_t |dz| for b)
    for name, got, expected, absolute in zip(("weight", "bias"), *grads, terms[1:]):
        assert got.dtype == torch.bfloat16
        half_ulp = torch.ldexp(torch.ones_like(expected), torch.frexp(expected).exponent - 9)
        bound = half_ulp + 1e-5 * scale * absolute * 2.0 ** 8
        excess = (got.double() - expected).abs() - bound
        assert (excess <= 0).all(), (name, int((excess > 0).sum()), float(excess.max()))


def opcheck_args(dtype=torch.bfloat16, config=None):
    """``(hidden, weight, bias, targets, advantages (B, T), valid, weights, old, ref, config literal)`` of a
    small case, the leading arguments of the fused-linear loss ops (the config as `config_args`)."""
    config = config or CONFIGS[1]
    case = make_linear_case(vocab=300, hidden_size=32, seed=3)
    h, w, b = (x.to(dtype).requires_grad_(True) for x in (torch.nan_to_num(case.hidden), case.weight, case.bias))
    adv = case.advantages[:, None].expand_as(case.mask).contiguous()
    weights = fused_rl.loss_math.aggregation_weights(case.mask, config)
    targets = torch.where(case.mask, case.targets, torch.full_like(case.targets, fused_rl.IGNORE_INDEX))
    return h, w, b, targets, adv, case.mask, weights, case.old, case.ref, config_args(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, False, False)],
                         ids=["all", "hidden", "none"])
def test_loss_op_passes_opcheck(dtype, need):
    """``torch.library.opcheck`` of the chunked torch loss op: schema, fake outputs equal to the real ones
    in shape and dtype (the gradients stay fp32 until the backward, empty ones included), AOT dispatch."""
    h, w, b, targets, adv, valid, weights, old, ref, config = opcheck_args(dtype)
    args = (h, w, b, targets, adv, valid, weights, old, ref, None, None, *config, True, *need, 7)
    torch.library.opcheck(torch_linear.linear_policy_loss_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("op", ["torch", "tiled"])
def test_loss_ops_refuse_a_config_reading_the_entropy_without_with_entropy(op):
    """The fake implementations give the entropy output the shape ``with_entropy`` says (they cannot read the
    config's floats: ``entropy_coef`` is in a tensor); the ops computed it whenever the config read it, a shape
    the fake did not have. A config that reads the entropy without ``with_entropy`` is refused now."""
    config = fused_rl.PolicyLossConfig(entropy_coef=0.01)
    h, w, b, targets, adv, valid, weights, old, ref, _ = opcheck_args(torch.float32, config)
    lead = (h.detach(), w.detach(), b.detach(), targets, adv, valid, weights, old, ref, None)
    if op == "torch":
        run = lambda with_entropy: torch_linear.linear_policy_loss_op(  # noqa: E731
            *lead, None, *config_args(config), with_entropy, False, False, False, 7)
    else:
        run = lambda with_entropy: tiled_linear.tiled_linear_policy_loss_op(  # noqa: E731
            *lead, *config_args(config), with_entropy, False, False, False, 7, "native", False)
    with pytest.raises(ValueError, match="with_entropy must be set"):
        run(False)
    assert run(True)[2].shape == targets.shape
