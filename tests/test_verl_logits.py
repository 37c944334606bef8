"""fused_rl.integrations.verl_logits against verl 0.9.1's own ``verl/utils/torch_functional.py``
(``logprobs_from_logits`` and the entropy functions of its engines without fused kernels; the wheel installed
``--no-deps`` by .ci/run, the ``verl`` package's ``__init__`` replaced by empty stand-ins since it imports Ray,
``tensordict`` by a stand-in where it is not installed: ``torch_functional`` imports it for other functions) and
verl's prefix-grouper forward (``verl/trainer/ppo/prefix_grouper_utils.py``, the ``prefix_grouper`` package stood
in), patched."""

from __future__ import annotations

import importlib
import os
import re
import sys
import types

import pytest
import torch

import fused_rl
from bench.cases import installed_path, stand_in_package, verl_functional
from fused_rl.integrations import verl_logits as ours
from helpers import LOGIT_KINDS, assert_close, fused_backends, make_logits, peer_modules, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU every test runs on CUDA tensors (the triton / cuda backends, verl's functions on CUDA): part of -m cuda
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
BACKENDS = ["reference"] + fused_backends(DEVICE)


@pytest.fixture
def verl():
    """verl's ``torch_functional`` (``bench.cases.verl_functional``: stand-ins for its packages and ``tensordict``)
    and ``prefix_grouper_utils`` (``prefix_grouper`` stood in) imported under their own names from the installed
    wheel; every module this imports is dropped afterwards."""
    root = installed_path("verl")
    if root is None:
        if os.environ.get("FUSED_RL_REQUIRE_OPENRLHF") == "1":  # .ci/run installs the peers: missing is a failure
            pytest.fail("verl is not installed (pip install --no-deps verl==0.9.1)")
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    with peer_modules("verl", "tensordict", "prefix_grouper"):
        functional = verl_functional()
        for name in ("verl.trainer", "verl.trainer.ppo"):
            stand_in_package(name, root.joinpath(*name.split(".")[1:]))
        sys.modules["prefix_grouper"] = types.SimpleNamespace(PrefixGrouper=type("PrefixGrouper", (), {}))
        yield types.SimpleNamespace(F=functional,
                                    grouper=importlib.import_module("verl.trainer.ppo.prefix_grouper_utils"))


def _inputs(seed: int, shape=(2, 37, 1000), kind: str = "randn", dtype=torch.float32):
    """Logits of ``shape`` (randn, peaked or all far below 0), labels, and upstream gradients of the outputs."""
    g = torch.Generator().manual_seed(seed)
    z = make_logits(shape, kind=kind, generator=g).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    upstream = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    return z.to(DEVICE), labels.to(DEVICE), upstream.to(DEVICE)


def _value_and_grad(fn, z, upstream, dtype=None):
    """``fn`` of a leaf copy of ``z`` (in ``dtype``), and the leaf's gradient of ``<upstream, fn(z)>``."""
    x = z.to(dtype or z.dtype).clone().requires_grad_()
    value = fn(x)
    (value.double() * upstream).sum().backward()
    return value.detach(), x.grad


def _fp64_entropy(x):
    logp = x.double().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def _fp64_logprobs(x, labels):
    return x.double().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("shape", [(2, 37, 1000), (5, 4099), (1, 1000)])
def test_logprobs_match_verl(verl, backend, kind, shape):
    """fp32 logits (3-D, 2-D, one token; ``V`` 1000 / 4099): log-probs and the logits gradient (random upstream
    gradient) of verl's ``logprobs_from_logits`` (its ``logsumexp`` path: flash-attn is not installed) within fp32
    rounding, both within that of float64; the logits are left intact (a leaf)."""
    z, labels, upstream = _inputs(1, shape, kind)
    got, grad = _value_and_grad(lambda x: ours.logprobs_from_logits(x, labels, backend=backend), z, upstream)
    theirs, their_grad = _value_and_grad(lambda x: verl.F.logprobs_from_logits(x, labels), z, upstream)
    exact, exact_grad = _value_and_grad(lambda x: _fp64_logprobs(x, labels), z, upstream, torch.float64)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    scale = max(1.0, z.abs().max().item() / 100)  # fp32 holds logits near -200 to 2^-24 of 200
    torch.testing.assert_close(got.double(), exact, atol=2e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(theirs.double(), exact, atol=2e-5 * scale, rtol=1e-5)  # the formula is verl's
    torch.testing.assert_close(grad.double(), exact_grad, atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(their_grad.double(), exact_grad, atol=1e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("chunked", [False, True])
def test_entropy_matches_verl(verl, backend, kind, chunked):
    """fp32 ``(N, V)`` logits, ``V = 4099``: the entropy and its logits gradient of verl's ``entropy_from_logits`` /
    ``entropy_from_logits_with_chunking`` (chunks of 16 of the 74 rows) within fp32 rounding of float64, and the
    gradient within that of float64's (verl's within 10x that)."""
    z, _, upstream = _inputs(2, (74, 4099), kind)
    if chunked:
        fn, theirs_fn = (lambda x: ours.entropy_from_logits_with_chunking(x, 16, backend=backend),
                         lambda x: verl.F.entropy_from_logits_with_chunking(x, 16))
    else:
        fn, theirs_fn = (lambda x: ours.entropy_from_logits(x, backend=backend), verl.F.entropy_from_logits)
    got, grad = _value_and_grad(fn, z, upstream)
    theirs, their_grad = _value_and_grad(theirs_fn, z, upstream)
    exact, exact_grad = _value_and_grad(_fp64_entropy, z, upstream, torch.float64)
    assert got.dtype == torch.float32 and got.shape == z.shape[:-1]
    scale = max(1.0, z.abs().max().item() / 100)
    torch.testing.assert_close(got.double(), exact, atol=2e-5 * scale, rtol=2e-5)
    torch.testing.assert_close(theirs.double(), exact, atol=2e-4 * scale, rtol=2e-4)  # the formula is verl's
    # the gradient -p_j (log p_j + H): log p_j is held to |z| 2^-24
    torch.testing.assert_close(grad.double(), exact_grad, atol=1e-6 * max(1.0, z.abs().max().item() / 10),
                               rtol=1e-5)
    # verl's autograd of softmax * logits: the same gradient, further off
    torch.testing.assert_close(their_grad.double(), exact_grad, atol=1e-5 * max(1.0, z.abs().max().item() / 10),
                               rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["randn", "peaked"])  # peaked rows' entropies (~1e-5) are below the tolerance
def test_16_bit_logits_give_fp32_values_closer_than_verls(verl, backend, dtype, kind):
    """bf16 / fp16 logits: fp32 log-probs and entropies within fp32 rounding of the float64 values of the same
    rounded logits (verl's log-probs and ``entropy_from_logits`` are in the logits' dtype, from a 16-bit softmax),
    closer than verl's; the gradients are the logits' dtype, within its rounding of float64's."""
    if not supports(backend, dtype, DEVICE):
        pytest.skip(f"{backend} does not take {dtype}")
    z, labels, upstream = _inputs(3, (3, 11, 1000), kind, dtype)
    for fn, theirs_fn, exact_fn in (
            (lambda x: ours.logprobs_from_logits(x, labels, backend=backend),
             lambda x: verl.F.logprobs_from_logits(x, labels), lambda x: _fp64_logprobs(x, labels)),
            (lambda x: ours.entropy_from_logits(x, backend=backend), verl.F.entropy_from_logits, _fp64_entropy)):
        got, grad = _value_and_grad(fn, z, upstream)
        theirs = theirs_fn(z)
        exact, exact_grad = _value_and_grad(exact_fn, z, upstream, torch.float64)
        assert got.dtype == torch.float32 and theirs.dtype == dtype and grad.dtype == dtype
        torch.testing.assert_close(got.double(), exact, atol=2e-5, rtol=1e-5)
        assert (got.double() - exact).abs().max() < (theirs.double() - exact).abs().max()
        assert_close(grad.double(), exact_grad, dtype, "gradient", grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_writes_the_gradient_over_the_logits(backend):
    """``inplace_backward=True`` (verl's default): a non-leaf logits buffer holds, after the backward, the gradient
    its leaf receives, bit for bit the out-of-place one (the reference writes nothing); a leaf is left intact;
    ``inplace_backward=False`` leaves the buffer intact."""
    z, labels, upstream = _inputs(4, (3, 5, 1000), "peaked")
    _, expected = _value_and_grad(lambda x: ours.logprobs_from_logits(x, labels, False, backend=backend), z, upstream)
    for inplace in (True, False):
        leaf = z.clone().requires_grad_()
        buffer = leaf * 1  # a model output
        (ours.logprobs_from_logits(buffer, labels, inplace, backend=backend).double() * upstream).sum().backward()
        assert torch.equal(leaf.grad, expected)
        written = inplace and backend != "reference"
        assert torch.equal(buffer.detach(), expected if written else z)
    _, leaf_grad = _value_and_grad(lambda x: ours.logprobs_from_logits(x, labels, True, backend=backend), z,
                                   upstream)
    assert torch.equal(leaf_grad, expected)  # the helper's leaf copy: intact, its gradient the same


@pytest.mark.parametrize("backend", fused_backends(DEVICE))
def test_inplace_logprobs_beside_the_entropy_of_the_same_logits(backend):
    """verl's prefix-grouper forward takes the log-probs (``inplace_backward`` left True) and then the entropy of the
    same logits: the entropy's backward runs first, so both gradients are right. Taken the other way round the
    entropy's backward would read the overwritten logits: it raises (flash-attn's kernel would give it the gradient
    silently)."""
    z, labels, upstream = _inputs(5, (2, 9, 1000), "randn")

    def both(x, entropy_first):
        buffer = x * 1
        if entropy_first:
            entropy = ours.entropy_from_logits(buffer, backend=backend)
            logp = ours.logprobs_from_logits(buffer, labels, backend=backend)
        else:
            logp = ours.logprobs_from_logits(buffer, labels, backend=backend)
            entropy = ours.entropy_from_logits(buffer, backend=backend)
        return logp + 0.5 * entropy

    _, grad = _value_and_grad(lambda x: both(x, False), z, upstream)
    _, exact = _value_and_grad(lambda x: _fp64_logprobs(x, labels) + 0.5 * _fp64_entropy(x), z, upstream,
                               torch.float64)
    torch.testing.assert_close(grad.double(), exact, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _value_and_grad(lambda x: both(x, True), z, upstream)


def test_ignore_index_out_of_range_and_inf_rows(verl):
    """A label ``-100`` gives log-prob 0 and no gradient (flash-attn's ignore index); any other label outside
    ``[0, V)`` raises, unless ``check_inputs=False``; a row with ``-inf`` logits has the entropy of its finite ones
    (verl's: NaN); a row of only ``-inf``, NaN as verl's."""
    z, labels, upstream = _inputs(6, (2, 6, 300))
    labels[0, 2] = fused_rl.IGNORE_INDEX
    got, grad = _value_and_grad(lambda x: ours.logprobs_from_logits(x, labels, False), z, upstream)
    assert got[0, 2] == 0 and torch.all(grad[0, 2] == 0) and torch.all(grad[0, 3] != 0)
    for bad in (300, -1):
        labels[1, 1] = bad
        with pytest.raises(ValueError, match=r"targets must be in \[0, 300\)"):
            ours.logprobs_from_logits(z, labels)
        assert ours.logprobs_from_logits(z, labels, check_inputs=False).shape == labels.shape
    masked = z.clone()
    masked[0, 0, 100:] = float("-inf")
    entropy = ours.entropy_from_logits(masked)
    torch.testing.assert_close(entropy[0, 0].double(), _fp64_entropy(z[0, 0, :100]), atol=1e-5, rtol=1e-5)
    assert torch.isnan(verl.F.entropy_from_logits(masked)[0, 0])
    masked[1, 1] = float("-inf")  # no finite logit: no distribution, NaN on both
    assert torch.isnan(ours.entropy_from_logits(masked)[1, 1]) and torch.isnan(verl.F.entropy_from_logits(masked)[1, 1])


def test_chunked_entropy_takes_any_leading_shape_and_checks_chunk_size(verl):
    """``entropy_from_logits_with_chunking`` of ``(B, T, V)`` logits gives the entropy of each position (verl's takes
    only ``(N, V)``); ``chunk_size`` must be a positive int; ``inplace_backward`` a bool; zero tokens raise."""
    z, labels, _ = _inputs(7, (2, 5, 300))
    torch.testing.assert_close(ours.entropy_from_logits_with_chunking(z, chunk_size=3).double(), _fp64_entropy(z),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):
        verl.F.entropy_from_logits_with_chunking(z, chunk_size=3)
    for bad in (0, -2, 2.0, True, "8"):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            ours.entropy_from_logits_with_chunking(z, chunk_size=bad)
    for fn in (ours.entropy_from_logits, ours.entropy_from_logits_with_chunking):  # verl's entropy: empty
        with pytest.raises(ValueError, match="logits is empty"):
            fn(z[:0])
    with pytest.raises(ValueError, match="inplace_backward must be a bool"):
        ours.logprobs_from_logits(z, labels, 1)


def test_compile_and_checkpoint_as_verls_engines_call_them():
    """verl's engines wrap the entropy function in ``torch.compile(..., dynamic=True)`` (``use_torch_compile``) and
    ``torch.utils.checkpoint`` (``entropy_checkpointing``): both give the float64 values and gradients within fp32
    rounding."""
    z, _, upstream = _inputs(8, (19, 1000))
    value, grad = _value_and_grad(_fp64_entropy, z, upstream, torch.float64)
    compiled = torch.compile(ours.entropy_from_logits, dynamic=True)
    for fn in (compiled, lambda x: torch.utils.checkpoint.checkpoint(ours.entropy_from_logits, x, use_reentrant=False)):
        got, got_grad = _value_and_grad(fn, z, upstream)
        torch.testing.assert_close(got.double(), value, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got_grad.double(), grad, atol=1e-6, rtol=1e-5)


def test_patch_rebinds_every_module_that_holds_the_names(verl, monkeypatch):
    """``patch_torch_functional()`` rebinds the three names in ``torch_functional`` and ``logprobs_from_logits`` in
    the modules that imported it (the prefix-grouper forward; an engine module stood in, as its import binds it),
    with the options; it returns verl's functions."""
    engine = types.ModuleType("verl.workers.engine.fsdp.transformer_impl")
    engine.logprobs_from_logits = verl.F.logprobs_from_logits
    monkeypatch.setitem(sys.modules, engine.__name__, engine)
    names = ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")
    own = {name: getattr(verl.F, name) for name in names}
    previous = ours.patch_torch_functional(backend="torch", check_inputs=False)
    assert previous == {"verl.utils.torch_functional": own, engine.__name__: {names[0]: own[names[0]]},
                        "verl.trainer.ppo.prefix_grouper_utils": {names[0]: own[names[0]]}}
    for module in (verl.F, engine, verl.grouper):
        assert module.logprobs_from_logits.func is ours.logprobs_from_logits
        assert module.logprobs_from_logits.keywords == {"backend": "torch", "check_inputs": False}
    assert verl.F.entropy_from_logits.func is ours.entropy_from_logits
    assert verl.F.entropy_from_logits_with_chunking.func is ours.entropy_from_logits_with_chunking
    assert verl.F.entropy_from_logits.keywords == verl.F.entropy_from_logits_with_chunking.keywords == {
        "backend": "torch"}
    z, labels, _ = _inputs(9, (2, 3, 50))
    labels[0, 0] = 50
    ours.patch_torch_functional(modules=(engine.__name__,))  # the default options: the labels checked
    with pytest.raises(ValueError, match=r"targets must be in \[0, 50\)"):
        engine.logprobs_from_logits(z, labels)


class _Grouper:
    """A stand-in for ``prefix_grouper.PrefixGrouper``: the suffix is the positions from ``prompt - 1`` on."""

    def __init__(self, prompt: int):
        self.prompt = prompt

    def split_output(self, logits, include_prefix_last):
        suffix = logits[:, self.prompt - include_prefix_last:]
        return logits[:, :self.prompt], None, suffix, torch.ones(suffix.shape[:2], dtype=torch.bool)

    def convert_padding(self, ids, mask, padding_mode):
        return ids


@pytest.mark.parametrize("entropy_name", ["entropy_from_logits", "entropy_from_logits_with_chunking"])
def test_prefix_grouper_forward_patched(verl, entropy_name):
    """verl's own ``pg_forward`` (log-probs with ``inplace_backward`` left True, then the entropy of the same
    logits, at temperature 0.7) on a tiny model, patched, gives the unpatched forward's log-probs and entropies and
    every parameter's gradient (random upstream gradients of both). Unpatched, verl's own chunked entropy cannot
    take the forward's ``(B, T, V)`` logits: the expected values are its ``entropy_from_logits``'."""
    g = torch.Generator().manual_seed(10)
    model = torch.nn.Sequential(torch.nn.Embedding(500, 16), torch.nn.Linear(16, 500)).to(DEVICE)
    ids = torch.randint(0, 500, (3, 12), generator=g).to(DEVICE)
    g1, g2 = (torch.randn(3, 7, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))

    def run(entropy_name):
        model.zero_grad()
        forward = lambda **kw: types.SimpleNamespace(logits=model(kw["input_ids"]))  # noqa: E731
        logp, entropy, _ = verl.grouper.pg_forward(
            forward, _Grouper(5), ids, None, None, ids[:, 5:], None, temperature=0.7, calculate_entropy=True,
            entropy_fn=getattr(verl.F, entropy_name))  # read at each call, as verl's forward does
        ((logp.double() * g1).sum() + (entropy.double() * g2).sum()).backward()
        return logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    expected = run("entropy_from_logits")
    previous = ours.patch_torch_functional(modules=("verl.utils.torch_functional",
                                                    "verl.trainer.ppo.prefix_grouper_utils"))
    assert verl.grouper.logprobs_from_logits.func is ours.logprobs_from_logits
    got = run(entropy_name)
    for name, functions in previous.items():
        for attr, function in functions.items():
            setattr(sys.modules[name], attr, function)
    assert got[0].shape == (3, 7) and got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), expected[1].double(), atol=1e-5, rtol=1e-5)
    for a, b in zip(got[2], expected[2]):
        torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item() + 1e-7, rtol=1e-4)


def test_verl_patch_module_patches_both_paths(verl, monkeypatch):
    """``actor_rollout_ref.model.external_lib=fused_rl.integrations.verl_patch``: importing it runs both patches (the
    fused LM-head kernels', stood in here: tests/test_verl_lm_head.py, and the logits functions') and keeps verl's
    own functions."""
    from fused_rl.integrations import verl_lm_head

    fused_kernels = (object(), object())
    monkeypatch.setattr(verl_lm_head, "patch_fused_kernels", lambda: fused_kernels)
    own = verl.F.entropy_from_logits
    monkeypatch.delitem(sys.modules, "fused_rl.integrations.verl_patch", raising=False)
    patch = importlib.import_module("fused_rl.integrations.verl_patch")
    assert patch.PREVIOUS["fused_kernels"] is fused_kernels
    assert patch.PREVIOUS["torch_functional"]["verl.utils.torch_functional"]["entropy_from_logits"] is own
    assert verl.F.entropy_from_logits.func is ours.entropy_from_logits
    monkeypatch.delitem(sys.modules, "fused_rl.integrations.verl_patch")


def test_patch_imports_torch_functional(verl):
    """With ``torch_functional`` not yet imported the patch imports it (the module the others import the names
    from) and patches it."""
    del sys.modules["verl.utils.torch_functional"]
    ours.patch_torch_functional()
    fresh = sys.modules["verl.utils.torch_functional"]
    assert fresh is not verl.F and fresh.entropy_from_logits.func is ours.entropy_from_logits


def test_verl_modules_lists_every_module_that_imports_the_names():
    """Every module of the installed verl that imports one of the three names from ``torch_functional`` (binding it at
    its import) is in ``VERL_MODULES``: read from the wheel's source, so a verl release that adds one fails here."""
    root = installed_path("verl")
    if root is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    root = str(root)
    pattern = re.compile(r"from\s+verl\.utils\.torch_functional\s+import\s+(\([^)]*\)|[^\n]*)")
    names = {"logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking"}
    importing = set()
    for directory, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                with open(path, encoding="utf-8") as f:
                    imported = {word for match in pattern.findall(f.read()) for word in re.findall(r"\w+", match)}
                if imported & names:
                    module = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                    importing.add(module.removesuffix(".__init__"))
    assert importing and importing <= set(ours.VERL_MODULES[1:]), sorted(importing - set(ours.VERL_MODULES))


def test_patched_names_take_verls_call_forms(verl):
    """After the patch, verl's own calls: ``logprobs_from_logits(logits=, labels=, inplace_backward=)`` (its engines'
    keywords) and the entropy functions as the engines build them (``torch.compile(..., dynamic=True)`` of the name
    read from ``torch_functional``, the chunked one called with ``chunk_size=``) give the float64 values."""
    z, labels, upstream = _inputs(11, (13, 1000))
    previous = ours.patch_torch_functional(modules=("verl.utils.torch_functional",))
    try:
        for inplace in (True, False):
            got, grad = _value_and_grad(lambda x: verl.F.logprobs_from_logits(
                logits=x * 1, labels=labels, inplace_backward=inplace), z, upstream)
            exact, exact_grad = _value_and_grad(lambda x: _fp64_logprobs(x, labels), z, upstream, torch.float64)
            torch.testing.assert_close(got.double(), exact, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(grad.double(), exact_grad, atol=1e-6, rtol=1e-5)
        exact = _fp64_entropy(z)
        compiled = torch.compile(verl.F.entropy_from_logits_with_chunking, dynamic=True)
        torch.testing.assert_close(compiled(z, chunk_size=2048).double(), exact, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(verl.F.entropy_from_logits(z).double(), exact, atol=2e-5, rtol=2e-5)
    finally:
        for name, functions in previous.items():
            for attr, function in functions.items():
                setattr(sys.modules[name], attr, function)


def test_backend_reaches_the_fused_pass(monkeypatch):
    """Each drop-in hands its ``backend`` (and ``logprobs_from_logits`` its ``check_inputs`` and ``inplace_backward``)
    on to the fused pass."""
    seen = []
    real = {"token_logprobs": ours.token_logprobs, "token_entropy": ours.token_entropy}
    for name in real:
        monkeypatch.setattr(ours, name, lambda *a, _name=name, **kw: seen.append((_name, kw)) or real[_name](*a, **kw))
    z, labels, _ = _inputs(12, (3, 50))
    ours.logprobs_from_logits(z, labels, False, backend="torch", check_inputs=False)
    ours.entropy_from_logits(z, backend="torch")
    ours.entropy_from_logits_with_chunking(z, 7, backend="torch")
    assert seen == [("token_logprobs", dict(backend="torch", check_inputs=False, inplace=False)),
                    ("token_entropy", dict(backend="torch")), ("token_entropy", dict(backend="torch"))]
