"""fused_rl.integrations.verl_lm_head against verl 0.9.1's own fused LM-head code (installed with ``--no-deps`` by
.ci/run): its torch ``FusedLinearForPPO``, and its model forwards (``dense_common.forward_with_torch_backend`` /
``forward_with_triton_backend``) on a tiny Llama with the patch applied."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from bench.cases import installed_path
from fused_rl.integrations.verl_lm_head import FusedLinearForPPO, linear_cross_entropy, patch_fused_kernels
from helpers import fused_backends, lm_head_inputs, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU every test runs on CUDA tensors (the triton / cuda backends, verl's torch path on CUDA): part of -m cuda
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []

FILES = {"verl.utils.kernel.linear_cross_entropy": "utils/kernel/linear_cross_entropy.py",
         "verl.utils.experimental.torch_functional": "utils/experimental/torch_functional.py",
         "verl.models.transformers.dense_common": "models/transformers/dense_common.py"}
PACKAGES = ("verl", "verl.utils", "verl.utils.kernel", "verl.utils.experimental", "verl.models",
            "verl.models.transformers")


@pytest.fixture
def verl_modules(monkeypatch):
    """verl's three files, loaded under their own names with empty stand-ins for their packages (``verl``'s
    ``__init__`` imports Ray and the rest of verl's stack): the model forwards' call-time imports find them."""
    root = installed_path("verl")  # not find_spec: a stand-in left in sys.modules has no spec
    if root is None:
        if os.environ.get("FUSED_RL_REQUIRE_OPENRLHF") == "1":  # .ci/run installs the peers: missing is a failure
            pytest.fail("verl is not installed (pip install --no-deps verl==0.9.1)")
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    for name in PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        monkeypatch.setitem(sys.modules, name, package)
    loaded = {}
    for name, path in FILES.items():
        file_spec = importlib.util.spec_from_file_location(name, root / path)
        loaded[name.rsplit(".", 1)[1]] = module = importlib.util.module_from_spec(file_spec)
        monkeypatch.setitem(sys.modules, name, module)
        file_spec.loader.exec_module(module)
    return types.SimpleNamespace(**loaded)


def _inputs(seed: int, shape=(2, 37), hidden=48, vocab=1000, dtype=torch.float32, kind="randn"):
    """:func:`helpers.lm_head_inputs` on ``DEVICE`` in ``dtype``, hidden states and head requiring grad."""
    h, w, ids = lm_head_inputs(seed, shape, hidden, vocab, kind)
    return h.to(DEVICE, dtype).requires_grad_(), w.to(DEVICE, dtype).requires_grad_(), ids.to(DEVICE)


def _grads(outputs, inputs, seed: int):
    """Gradients of ``<g1, log_probs> + <g2, entropy>`` for random ``g1, g2``: both outputs' backward formulas."""
    g = torch.Generator().manual_seed(seed + 1)
    logp, entropy = outputs
    g1, g2 = (torch.randn(x.shape, generator=g).to(DEVICE) for x in (logp, entropy))
    return torch.autograd.grad((logp.double() * g1).sum() + (entropy.double() * g2).sum(), inputs)


def _fp64(h, w, ids, temperature):
    """Log-probs and entropies of ``(h @ w.T) / temperature`` in float64 from the same (rounded) inputs,
    differentiable."""
    z = (h.double() @ w.double().T) / temperature
    logp = z.log_softmax(-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _no_worse_than_verl(ours, theirs, exact) -> None:
    """Each of ``ours`` within 1.5x verl's own distance to the float64 values (at most 5e-5 of their scale, at least
    1; plus 1e-6 of it), and verl's within 2e-3 of that scale (so that the float64 formula is verl's; its fp32
    hidden gradient's cancellation gave 1.06e-3 on an AMD EPYC machine on 2026-12-08, under 1e-3 on CI's before)."""
    for a, b, e in zip(ours, theirs, exact):
        scale = max(e.abs().max().item(), 1.0)
        theirs_off = (b.double() - e).abs().max().item()
        assert theirs_off <= 2e-3 * scale
        torch.testing.assert_close(a.double(), e, rtol=0, atol=min(1.5 * theirs_off, 5e-5 * scale) + 1e-6 * scale)


@pytest.mark.parametrize("kind", ["randn", "peaked", "negative"])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
@pytest.mark.parametrize("shape,vocab", [((2, 37), 1000), ((45,), 4099), ((1, 1), 1000)])
def test_fused_linear_for_ppo_matches_verl_fp32(verl_modules, backend, kind, shape, vocab):
    """verl's torch ``FusedLinearForPPO`` and ours: log-probs, entropies and the hidden / weight gradients of any
    upstream gradient on both, fp32, 2-D and 3-D hidden states, a ragged vocabulary, one token, temperature 0.7;
    each against float64 (verl's fp32 hidden gradient is up to ~1e-3 of its scale off where all logits are near -86:
    its column of the constant feature cancels), ours no further off than verl's."""
    h, w, ids = _inputs(3, shape, vocab=vocab, kind=kind)
    theirs = verl_modules.torch_functional.FusedLinearForPPO(chunk_size=16)(h, w, ids, temperature=0.7)
    ours = FusedLinearForPPO(backend=backend)(h, w, ids, temperature=0.7)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32] * 2
    assert [x.shape for x in ours] == [x.shape for x in theirs] == [ids.shape] * 2
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = _fp64(h64, w64, ids, 0.7)
    _no_worse_than_verl(ours, theirs, exact)
    _no_worse_than_verl(_grads(ours, (h, w), 3), _grads(theirs, (h, w), 3), _grads(exact, (h64, w64), 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
def test_fused_linear_for_ppo_half_precision(verl_modules, backend, dtype):
    """bf16 / fp16: our log-probs and entropies (fp32 accumulation) are within fp32 rounding of the float64 values of
    the same rounded inputs; verl's round the logits to the input dtype first and are further off; the gradients are
    within one unit roundoff of the float64 ones. Dtypes as verl's: fp32 log-probs, entropy in the input dtype."""
    if not supports(backend, dtype, DEVICE):
        pytest.skip(f"{backend} has no {dtype}")
    h, w, ids = _inputs(5, (3, 29), dtype=dtype)
    theirs = verl_modules.torch_functional.FusedLinearForPPO()(h, w, ids, temperature=0.9)
    ours = FusedLinearForPPO(backend=backend)(h, w, ids, temperature=0.9)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32, dtype]
    exact = _fp64(h, w, ids, 0.9)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(ours[0].double(), exact[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(ours[1].double(), exact[1], rtol=ulp, atol=ulp)  # rounded once, to the input dtype
    assert (ours[0].double() - exact[0]).abs().max() < (theirs[0].double() - exact[0]).abs().max()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    # the gradients round dlogits (and the GEMMs' outputs) to the input dtype: within one unit roundoff of the
    # float64 gradients' scale (measured: 0.35 / 0.55 of it for bf16 / fp16 hidden / weight)
    for a, e in zip(_grads(ours, (h, w), 5), _grads(_fp64(h64, w64, ids, 0.9), (h64, w64), 5)):
        torch.testing.assert_close(a.double(), e, rtol=0, atol=ulp * e.abs().max().item())


@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
def test_linear_cross_entropy_is_verls_kernel_contract(verl_modules, backend):
    """verl's Triton ``linear_cross_entropy`` (CUDA only; its contract from its source): flattened ``(N,)`` fp32
    log-probs and entropies of the same values as verl's torch path, ``reduction`` sum / mean of the log-probs,
    ``None`` temperature / reduction as 1 / "none", a group of one process accepted; gradients as the torch path's."""
    h, w, ids = _inputs(7, (2, 23))
    theirs = verl_modules.torch_functional.FusedLinearForPPO()(h, w, ids, temperature=0.5)
    logp, entropy = linear_cross_entropy(h, w, ids, 0.5, "none", backend=backend)
    assert logp.shape == entropy.shape == (46,) and logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, theirs[0].reshape(-1), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy, theirs[1].reshape(-1), rtol=1e-5, atol=2e-5)
    grads = _grads((logp.view(2, 23), entropy.view(2, 23)), (h, w), 7)
    for a, b in zip(grads, _grads(theirs, (h, w), 7)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5 * b.abs().max().item())
    for reduction, reduce in (("sum", torch.sum), ("MEAN", torch.mean)):
        total, entropy2 = linear_cross_entropy(h, w, ids, 0.5, reduction, backend=backend)
        assert total.shape == () and entropy2.shape == (46,)
        torch.testing.assert_close(total, reduce(logp), rtol=1e-6, atol=1e-5)
    for a, b in zip(linear_cross_entropy(h, w, ids, None, None, backend=backend),
                    linear_cross_entropy(h, w, ids, 1.0, "none", backend=backend)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flat = linear_cross_entropy(h.detach().reshape(46, 48), w, ids.reshape(46), 0.5, backend=backend)
    torch.testing.assert_close(flat[0], logp, rtol=0, atol=1e-6)


def test_autocast_casts_as_verls_matmul(verl_modules):
    """Under a bf16 autocast (verl's actor's forward) both operands are taken in bf16, as verl's ``hidden @ W.T``:
    fp32 hidden states with a bf16 head work (outside autocast: ValueError, as verl's matmul raises), the entropy has
    the hidden states' dtype as verl's, and the values are those of both operands in bf16."""
    h, w, ids = _inputs(13, (2, 9))
    wb = w.detach().bfloat16().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        theirs = verl_modules.torch_functional.FusedLinearForPPO()(h, wb, ids)
        ours = FusedLinearForPPO()(h, wb, ids)
        flat = linear_cross_entropy(h, wb, ids)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32, torch.float32]
    plain = FusedLinearForPPO()(h.detach().bfloat16(), wb.detach(), ids)
    torch.testing.assert_close(ours[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1].bfloat16(), plain[1], rtol=0, atol=0)  # plain's entropy: bf16 hidden's dtype
    torch.testing.assert_close(flat[0], plain[0].reshape(-1), rtol=0, atol=0)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0.1)  # verl's logits are rounded to bf16
    grad_h, grad_w = torch.autograd.grad(ours[0].sum() + ours[1].sum(), (h, wb))
    assert grad_h.dtype == torch.float32 and grad_w.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight dtype torch.bfloat16 differs from hidden dtype torch.float32"):
        FusedLinearForPPO()(h, wb, ids)


def test_ignore_index_and_bad_labels():
    """A label ``-100`` gives log-prob 0, entropy 0 and no gradient (fused_rl's ignore index: the row is not read);
    the other rows are unchanged; an out-of-range label raises (verl's kernels read whatever is there)."""
    h, w, ids = _inputs(9, (2, 5))
    full = FusedLinearForPPO()(h, w, ids)
    ids[0, 1] = -100
    logp, entropy = FusedLinearForPPO()(h, w, ids)
    assert logp[0, 1] == 0 and entropy[0, 1] == 0 and full[0][0, 1] < 0 and full[1][0, 1] > 0
    keep = ids != -100
    torch.testing.assert_close(logp[keep], full[0][keep], rtol=1e-6, atol=1e-6)  # the GEMM's tiles may differ
    torch.testing.assert_close(entropy[keep], full[1][keep], rtol=1e-6, atol=1e-6)
    (grad_h,) = torch.autograd.grad(logp.sum() + entropy.sum(), (h,))
    assert grad_h[0, 1].abs().max() == 0 and grad_h[0, 0].abs().max() > 0
    for bad in (1000, -1):
        ids[1, 2] = bad
        with pytest.raises(ValueError, match=r"targets must be in \[0, 1000\) or -100"):
            linear_cross_entropy(h, w, ids)


def test_errors(monkeypatch):
    h, w, ids = _inputs(11, (2, 5))
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: triton"):
        FusedLinearForPPO(impl_backend="triton")
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            FusedLinearForPPO(chunk_size=bad)
    with pytest.raises(ValueError, match=r"hidden_states must be 2D or 3D, got shape \(1, 2, 5, 48\)"):
        FusedLinearForPPO()(h.unsqueeze(0), w, ids.unsqueeze(0))
    with pytest.raises(ValueError, match=r"input_ids must have shape \(2, 5\) .* got \(10,\)"):
        FusedLinearForPPO()(h, w, ids.reshape(10))
    with pytest.raises(ValueError, match="input_ids must be an int32 or int64 tensor, got torch.float32"):
        FusedLinearForPPO()(h, w, ids.float())
    with pytest.raises(ValueError, match=r"reduction must be one of \('none', 'sum', 'mean'\), got 'max'"):
        linear_cross_entropy(h, w, ids, 1.0, "max")
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 5\)"):
        linear_cross_entropy(h, w, ids[:, :4])
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_cross_entropy(h, w[:, :40], ids)
    with pytest.raises(ValueError, match=r"the weight must be a \(V, H=48\) tensor"):  # zero tokens, a bad weight
        FusedLinearForPPO()(h[:, :0], w[:, :40], ids[:, :0])
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)  # a group of one process
    assert linear_cross_entropy(h, w, ids, 1.0, "none", object())[0].shape == (10,)


@pytest.mark.parametrize("shape", [(2, 0), (0,)])
def test_zero_tokens_give_empty_outputs(shape):
    """No token (verl's kernels return empty outputs): empty log-probs / entropies of verl's dtypes, and a backward
    through them gives zero gradients to both operands."""
    h, w, ids = _inputs(11, (2, 5))
    hidden, labels = h[:, :0].reshape(*shape, 48), ids[:, :0].reshape(shape)
    logp, entropy = FusedLinearForPPO()(hidden, w, labels)
    assert logp.shape == entropy.shape == shape and logp.dtype == entropy.dtype == torch.float32
    flat = linear_cross_entropy(hidden, w, labels, 1.0, "sum")
    assert flat[0].shape == () and flat[0] == 0 and flat[1].shape == (0,)
    grad_h, grad_w = torch.autograd.grad(logp.sum() + flat[0] + flat[1].sum(), (h, w))
    assert not grad_h.any() and not grad_w.any()
    half = FusedLinearForPPO()(hidden.detach().bfloat16(), w.detach().bfloat16(), labels)
    assert half[0].dtype == torch.float32 and half[1].dtype == torch.bfloat16


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=611, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # verl's call, transformers 5.25
@pytest.mark.parametrize("forward", ["forward_with_torch_backend", "forward_with_triton_backend"])
def test_verl_model_forward_patched(verl_modules, forward, monkeypatch):
    """verl's own model forward (``dense_common``), patched: its triton route (CUDA only in verl) runs here, and both
    routes give verl's torch route's log-probs, entropies and model gradients; ``shift_labels`` as verl's engine passes
    them; restoring the returned pair undoes the patch."""
    model = _tiny_llama(0).to(DEVICE)
    ids = torch.randint(0, 611, (2, 19), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kwargs = dict(input_ids=ids, return_dict=True, temperature=0.8)
    run = getattr(verl_modules.dense_common, "forward_with_torch_backend")
    theirs = run(model, **kwargs)
    expected = _grads((theirs.log_probs, theirs.entropy), list(model.parameters()), 1)
    import fused_rl.integrations.verl_lm_head as module

    calls = []
    real = module._fused
    monkeypatch.setattr(module, "_fused", lambda *args: calls.append(args[4]) or real(*args))
    previous = patch_fused_kernels(verl_modules.linear_cross_entropy, verl_modules.torch_functional)
    try:
        ours = getattr(verl_modules.dense_common, forward)(model, **kwargs)
        rolled = getattr(verl_modules.dense_common, forward)(model, **kwargs, shift_labels=torch.roll(ids, -1, -1))
    finally:
        verl_modules.linear_cross_entropy.linear_cross_entropy, verl_modules.torch_functional.FusedLinearForPPO = \
            previous
    assert verl_modules.torch_functional.FusedLinearForPPO.__module__ == "verl.utils.experimental.torch_functional"
    assert calls == ["auto", "auto"]  # both calls of the patched forward went through fused_rl
    shape = (2, 19) if forward == "forward_with_torch_backend" else (38,)
    assert ours.log_probs.shape == ours.entropy.shape == shape
    torch.testing.assert_close(ours.log_probs.reshape(2, 19), theirs.log_probs, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours.entropy.reshape(2, 19), theirs.entropy, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(rolled.log_probs, ours.log_probs, rtol=0, atol=0)
    got = _grads((ours.log_probs.reshape(2, 19), ours.entropy.reshape(2, 19)), list(model.parameters()), 1)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item() + 1e-7)


def test_verl_patch_module_patches_on_import(verl_modules, monkeypatch):
    """``actor_rollout_ref.model.external_lib=fused_rl.integrations.verl_patch``: importing it patches verl's two
    names (verl imports the module in each worker) and keeps verl's own pair (the logits functions' patch, which it
    runs too, stood in: tests/test_verl_logits.py)."""
    import fused_rl.integrations.verl_lm_head as ours
    from fused_rl.integrations import verl_logits

    monkeypatch.setattr(verl_logits, "patch_torch_functional", dict)
    own = (verl_modules.linear_cross_entropy.linear_cross_entropy, verl_modules.torch_functional.FusedLinearForPPO)
    monkeypatch.delitem(sys.modules, "fused_rl.integrations.verl_patch", raising=False)
    monkeypatch.setattr(verl_modules.linear_cross_entropy, "linear_cross_entropy", own[0])
    monkeypatch.setattr(verl_modules.torch_functional, "FusedLinearForPPO", own[1])
    patch = importlib.import_module("fused_rl.integrations.verl_patch")
    assert patch.PREVIOUS == {"fused_kernels": own, "torch_functional": {}}
    assert verl_modules.linear_cross_entropy.linear_cross_entropy.func is ours.linear_cross_entropy
    assert issubclass(verl_modules.torch_functional.FusedLinearForPPO, ours.FusedLinearForPPO)
    monkeypatch.delitem(sys.modules, "fused_rl.integrations.verl_patch")


def test_autocast_fp32_head_and_fp64(verl_modules):
    """Under a bf16 autocast an fp32 head is taken in bf16 too (with fp32 or bf16 hidden states: verl's matmul works
    on both), fp64 operands are left as they are (autocast does not touch fp64 matmuls); fp64 hidden states give fp32
    log-probs and fp64 entropies, as verl's buffers."""
    h, w, ids = _inputs(17, (2, 9))
    plain = FusedLinearForPPO()(h.detach().bfloat16(), w.detach().bfloat16(), ids)
    for hidden in (h, h.detach().bfloat16().requires_grad_()):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            theirs = verl_modules.torch_functional.FusedLinearForPPO()(hidden, w, ids)
            ours = FusedLinearForPPO()(hidden, w, ids)
            flat = linear_cross_entropy(hidden, w, ids)
        assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32, hidden.dtype]
        torch.testing.assert_close(ours[0], plain[0], rtol=0, atol=0)
        torch.testing.assert_close(flat[0], plain[0].reshape(-1), rtol=0, atol=0)
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0.1)
        grad_w = torch.autograd.grad(ours[0].sum() + ours[1].float().sum(), (w,))[0]
        assert grad_w.dtype == torch.float32 and grad_w.abs().max() > 0
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ours = FusedLinearForPPO(backend="reference")(h64, w64, ids)
        theirs = verl_modules.torch_functional.FusedLinearForPPO()(h64, w64, ids)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32, torch.float64]
    exact = _fp64(h64, w64, ids, 1.0)
    torch.testing.assert_close(ours[1], exact[1], rtol=1e-12, atol=1e-12)  # no bf16 anywhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_impl_backend_matches_verls_liger_path(verl_modules, dtype):
    """verl's ``impl_backend="liger"`` (Liger's fused scaled cross-entropy; its torch fallback off sm90): the same
    values, dtypes and gradients as ours, the ``-100`` rows included (Liger has the same ignore index)."""
    if verl_modules.torch_functional._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY is None:
        pytest.skip("liger_kernel is not installed")
    h, w, ids = _inputs(19, (2, 11), dtype=dtype)
    ids[1, 4] = -100
    theirs = verl_modules.torch_functional.FusedLinearForPPO(impl_backend="liger")(h, w, ids, temperature=0.8)
    ours = FusedLinearForPPO(impl_backend="liger")(h, w, ids, temperature=0.8)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.float32, dtype]
    assert ours[0][1, 4] == theirs[0][1, 4] == 0 and ours[1][1, 4] == theirs[1][1, 4] == 0
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    for a, b in zip(_grads(ours, (h, w), 19), _grads(theirs, (h, w), 19)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.float().abs().max().item())


def test_options_reach_the_kernel(monkeypatch):
    """``backend``, ``check_inputs`` and ``memory_budget_bytes`` are passed to the fused pass (else the backend
    parametrization above would run "auto" every time)."""
    import fused_rl.integrations.verl_lm_head as module

    seen = []
    real = module.linear_token_logprobs

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("backend", "check_inputs", "memory_budget_bytes")})
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "linear_token_logprobs", spy)
    h, w, ids = _inputs(23, (2, 5))
    FusedLinearForPPO(backend="torch", check_inputs=False, memory_budget_bytes=1 << 20)(h, w, ids)
    linear_cross_entropy(h, w, ids, backend="reference", check_inputs=False, memory_budget_bytes=1 << 21)
    assert seen == [dict(backend="torch", check_inputs=False, memory_budget_bytes=1 << 20),
                    dict(backend="reference", check_inputs=False, memory_budget_bytes=1 << 21)]
    seen.clear()
    kernel, functional = (types.SimpleNamespace(linear_cross_entropy=None, FusedLinearForPPO=None) for _ in range(2))
    patch_fused_kernels(kernel, functional, backend="torch", check_inputs=False, memory_budget_bytes=1 << 22)
    functional.FusedLinearForPPO(impl_backend="liger")(h, w, ids, temperature=0.5)
    kernel.linear_cross_entropy(h, w, ids, 0.5, "none")
    assert seen == [dict(backend="torch", check_inputs=False, memory_budget_bytes=1 << 22)] * 2
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: triton"):
        functional.FusedLinearForPPO(impl_backend="triton")
    with pytest.raises(ValueError, match=r"targets must be in \[0, 1000\) or -100"):
        ids[0, 0] = 1000
        FusedLinearForPPO()(h, w, ids)


def test_patch_rebinds_megatron_forwards_and_passes_the_group(monkeypatch):
    """verl's Megatron forwards bind ``linear_cross_entropy`` at import: the patch rebinds it in those already
    imported that hold verl's function (not in one holding anything else), and a tensor-parallel group reaches
    :func:`fused_rl.vocab_parallel.linear_token_logprobs` with the patch's options (the group's values:
    tests/test_vocab_parallel.py)."""
    import fused_rl.integrations.verl_lm_head as module

    def verls(*args):
        raise AssertionError("verl's kernel called")

    kernel = types.SimpleNamespace(linear_cross_entropy=verls)
    functional = types.SimpleNamespace(FusedLinearForPPO=None)
    fused, overlap = (types.ModuleType(name) for name in module.MCORE_MODULES)
    fused.linear_cross_entropy, overlap.linear_cross_entropy = verls, len
    for name, mod in zip(module.MCORE_MODULES, (fused, overlap)):
        monkeypatch.setitem(sys.modules, name, mod)
    previous = patch_fused_kernels(kernel, functional, backend="torch", check_inputs=False)
    assert previous[0] is verls and overlap.linear_cross_entropy is len
    assert fused.linear_cross_entropy is kernel.linear_cross_entropy and fused.linear_cross_entropy.func is \
        module.linear_cross_entropy
    seen = []

    def spy(hidden, weight, labels, **kwargs):
        seen.append((tuple(hidden.shape), tuple(labels.shape), kwargs))
        return torch.full(labels.shape, -1.0), torch.full(labels.shape, 2.0)

    monkeypatch.setattr(module.vocab_parallel, "linear_token_logprobs", spy)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    h, w, ids = _inputs(29, (2, 5))
    group = object()
    logp, entropy = fused.linear_cross_entropy(h, w, ids, 0.5, "none", group)
    assert torch.equal(logp, torch.full((10,), -1.0)) and torch.equal(entropy, torch.full((10,), 2.0))
    assert seen == [((1, 10, 48), (1, 10), dict(group=group, temperature=0.5, return_entropy=True, backend="torch",
                                                check_inputs=False, memory_budget_bytes=None))]


def test_narrow_integer_input_ids_are_taken_as_int64():
    """verl's ``FusedLinearForPPO`` takes ``input_ids.to(torch.int64)``: uint8 / int8 / int16 ids give the int64
    ids' values; ``linear_cross_entropy`` (verl's kernel reads them as they are) takes int32 / int64."""
    h, w, ids = _inputs(31, (2, 6), vocab=100)
    expected = FusedLinearForPPO()(h, w, ids)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        for a, b in zip(FusedLinearForPPO()(h, w, ids.to(dtype)), expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="labels must be an int32 or int64 tensor, got torch.int16"):
        linear_cross_entropy(h, w, ids.to(torch.int16))


def test_linear_cross_entropy_flattens_as_verls_kernel():
    """verl's kernel views hidden as ``(-1, H)`` and labels as ``(-1,)`` separately: Megatron's fused forward passes
    ``(s, 1, h)`` hidden states with ``(1, s)`` labels."""
    h, w, ids = _inputs(29, (7, 1))
    flat = linear_cross_entropy(h.detach().reshape(7, 48), w, ids.reshape(7))
    for a, b in zip(linear_cross_entropy(h, w, ids.reshape(1, 7)), flat):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
