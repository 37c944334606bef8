"""``bench/cases.py``: the byte / FLOP floors behind the report's throughput column, the GPU set's shapes (issues 3
and 4), the inputs' masks and seeding, what one timed iteration runs, and that the peers compute the same loss."""

import pytest
import torch

import fused_rl
from bench import cases
from bench.cases import IMPLS, SHAPE_SETS, Impl, Shape, floor_bytes, floor_flops, make_callable, make_inputs
from helpers import peer_modules


def test_floor_bytes_by_hand():
    """Logits ops read their rows (policy_loss: the loss rows only) and, in fwd+bwd, write every row's dlogits;
    ``itemsize`` bytes of the logits' dtype."""
    bf16, fp32 = Shape(n=256, v=1000, dtype="bf16"), Shape(n=256, v=1000, dtype="fp32")
    assert floor_bytes("policy_loss", "fwd", bf16, 200) == 200 * 1000 * 2
    assert floor_bytes("policy_loss", "fwd+bwd", bf16, 200) == (200 + 256) * 1000 * 2
    assert floor_bytes("policy_loss", "fwd+bwd", Shape(n=256, v=1000, dtype="fp16"), 200) == 456 * 1000 * 2
    assert floor_bytes("policy_loss", "fwd", fp32) == 256 * 1000 * 4  # no count given: every row
    # token_logprobs has no mask: it reads every row
    assert floor_bytes("token_logprobs", "fwd", bf16, 200) == 256 * 1000 * 2
    assert floor_bytes("token_logprobs", "fwd+bwd", fp32, 200) == 512 * 1000 * 4


def test_floor_flops_by_hand():
    """``2 N H V`` forward (the logits GEMM), ``6 N H V`` forward + backward (and the two gradient GEMMs)."""
    assert floor_flops("linear_policy_loss", "fwd", Shape(n=8, v=10, h=4)) == 640
    assert floor_flops("linear_policy_loss", "fwd+bwd", Shape(n=8, v=10, h=4)) == 1920


def test_gpu_set_is_the_issues_shapes():
    """docs/bench.md's ``gpu`` set: issue 3's N = 16384, V = 151936 bf16 logits, every token a loss token, and issue
    4's N = 8192, H = 4096, V = 128256 bf16 (the shapes of gpu_logits_bench.py and gpu_linear_budget.py)."""
    assert SHAPE_SETS["gpu"] == [Shape(n=16384, v=151936, h=0, dtype="bf16", batch=16, ragged=False),
                                 Shape(n=8192, v=128256, h=4096, dtype="bf16", batch=8, ragged=False)]


def _lengths(mask):
    """Row lengths of a right-padded mask, checking each row is a prefix of ones."""
    lengths = mask.sum(1)
    assert torch.equal(mask, torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(1))
    return lengths


def test_ragged_masks_are_prefixes_of_half_to_all_tokens():
    """A ragged case's sequences are ``T/2 .. T`` tokens (both ends drawn among 64 sequences of T = 4); a non-ragged
    case's are all ``T``, and its other inputs are the ragged case's."""
    ragged = make_inputs("policy_loss", Shape(n=256, v=16, batch=64), "cpu")
    assert set(_lengths(ragged["mask"]).tolist()) == {2, 3, 4}
    full = make_inputs("policy_loss", Shape(n=256, v=16, batch=64, ragged=False), "cpu")
    assert full["mask"].shape == (64, 4) and full["mask"].all()
    for key in ("logits", "targets", "advantages", "old", "ref"):
        torch.testing.assert_close(full[key], ragged[key], rtol=0, atol=0, msg=key)


def test_inputs_come_from_their_seed_only():
    """The inputs are a function of ``seed``: the global RNG's state does not change them."""
    shape = Shape(n=32, v=20, h=8, batch=4)
    for op in ("policy_loss", "linear_policy_loss"):
        torch.manual_seed(1)
        a = make_inputs(op, shape, "cpu")
        torch.manual_seed(2)
        b = make_inputs(op, shape, "cpu")
        c = make_inputs(op, shape, "cpu", seed=1)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=(op, key))
        assert not torch.equal(a["advantages"], c["advantages"])


def test_an_iteration_differentiates_every_leaf():
    """fwd+bwd: the logits, hidden states and weight are fresh leaves that get their gradient each call (the
    caller's tensors untouched); fwd: no autograd."""
    seen = []

    def fn(x):
        seen.append((dict(x), torch.is_grad_enabled()))
        return (x["hidden"] * 2).sum() + (x["weight"] * 3).sum()

    inputs = dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 3), targets=torch.zeros(2, dtype=torch.long))
    cases._iteration(fn, "fwd+bwd", inputs)()
    xs, grad_mode = seen[-1]
    assert grad_mode and xs["hidden"] is not inputs["hidden"] and inputs["hidden"].grad is None
    torch.testing.assert_close(xs["hidden"].grad, torch.full((2, 3), 2.0))
    torch.testing.assert_close(xs["weight"].grad, torch.full((4, 3), 3.0))
    cases._iteration(fn, "fwd", inputs)()
    assert seen[-1][1] is False


def test_a_callable_runs_on_the_prepared_inputs(monkeypatch):
    """``prepare`` (a peer's layout) is what the iteration runs on and what ``run.inputs`` holds."""
    got = []
    fake = Impl("fake", lambda: {"policy_loss": lambda x: got.append(x["logits"].shape)},
                prepare=lambda x: {**x, "logits": torch.zeros(2, 5, 7)})
    monkeypatch.setitem(IMPLS, "fake", fake)
    run = make_callable("policy_loss", "fake", "fwd", {"logits": torch.zeros(2, 4, 7)})
    run()
    assert got == [(2, 5, 7)] and run.inputs["logits"].shape == (2, 5, 7)


def test_unavailable_says_why():
    impl = Impl("x", dict, ops=("policy_loss",), devices=("cpu",))
    assert cases.unavailable(impl, "policy_loss", "cpu") is None
    assert cases.unavailable(impl, "token_logprobs", "cpu") == "x has no token_logprobs"
    assert cases.unavailable(impl, "policy_loss", "cuda") == "x does not run on cuda"


def test_each_fused_impl_runs_its_own_backend(monkeypatch):
    """The ``reference`` / ``torch`` / ``cpu`` / ``triton`` / ``cuda`` rows call fused_rl with that backend."""
    called = []

    class Out:
        loss = torch.zeros(())

    def fake(name):
        def f(*args, backend, **kwargs):
            called.append((name, backend))
            return torch.zeros(()) if name.startswith("token_") else Out()
        return f

    for name in cases.OPS:
        monkeypatch.setattr(fused_rl, name, fake(name))
    x = dict(logits=None, hidden=None, weight=None, targets=None, advantages=None, mask=None, old=None, ref=None)
    for impl in ("reference", "torch", "cpu", "triton", "cuda"):
        fns = IMPLS[impl].build()
        for op in cases.OPS:
            fns[op](x)
            assert called[-1] == (op, impl), (impl, op)


def test_the_workload_has_its_kl_term():
    """The cases' loss is DAPO clipping (0.2 / 0.28, token mean) with a k3 KL of weight 0.04 to the reference
    policy, and the built loss reads the reference log-probs: moving them moves the loss."""
    c = cases.CONFIG
    assert (c.policy_loss, c.clip_low, c.clip_high, c.agg) == ("ppo_clip", 0.2, 0.28, "token-mean")
    assert (c.kl, c.beta) == ("k3", 0.04)
    fn = IMPLS["reference"].build()["policy_loss"]
    x = make_inputs("policy_loss", Shape(n=64, v=50, batch=4), "cpu")
    assert float(fn(x)) != pytest.approx(float(fn({**x, "ref": x["ref"] - 1.0})), rel=1e-3)


def test_trl_row_computes_the_reference_loss():
    """TRL's ``selective_log_softmax`` + its GRPO formula (clip, k3 KL, token mean over the mask) is the cases'
    loss: the same value as fused_rl's reference on a ragged batch."""
    pytest.importorskip("trl")
    x = make_inputs("policy_loss", Shape(n=64, v=50, batch=4), "cpu")
    assert not x["mask"].all()
    expected = IMPLS["reference"].build()["policy_loss"](x)
    torch.testing.assert_close(IMPLS["trl"].build()["policy_loss"](x), expected, rtol=1e-5, atol=1e-6)


def test_liger_api_row_computes_the_reference_loss():
    """fused_rl's ``triton_grpo_loss`` drop-in, called as the ``liger-triton`` row calls Liger's on the padded
    ``(B, L+1, V)`` logits: the same value as the reference's loss on a ragged batch."""
    x = make_inputs("policy_loss", Shape(n=64, v=50, batch=4), "cpu")
    expected = IMPLS["reference"].build()["policy_loss"](x)
    got = IMPLS["liger-api"].build()["policy_loss"](IMPLS["liger-api"].prepare(x))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_liger_row_computes_the_reference_loss():
    """Liger's ``LigerFusedLinearGRPOLoss`` as the cases build it (bnpo, clip 0.2 / 0.28, k3 KL): the same value as
    fused_rl's reference linear loss on a ragged batch."""
    pytest.importorskip("liger_kernel")
    x = make_inputs("linear_policy_loss", Shape(n=64, v=50, h=16, batch=4), "cpu")
    expected = IMPLS["reference"].build()["linear_policy_loss"](x)
    torch.testing.assert_close(IMPLS["liger"].build()["linear_policy_loss"](x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["verl", "verl-api"])
def test_verl_rows_compute_the_reference_loss(impl):
    """verl's ``FusedLinearForPPO`` (loaded from its installed file) and fused_rl's drop-in, each + the cases' eager
    loss: the same value as fused_rl's reference linear loss on a ragged batch."""
    if impl == "verl" and cases.unavailable(IMPLS[impl], "linear_policy_loss", "cpu"):
        pytest.skip("verl is not installed")
    x = make_inputs("linear_policy_loss", Shape(n=64, v=50, h=16, batch=4), "cpu")
    expected = IMPLS["reference"].build()["linear_policy_loss"](x)
    torch.testing.assert_close(IMPLS[impl].build()["linear_policy_loss"](x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["trl", "verl-logits", "verl-logits-api"])
def test_log_prob_and_entropy_rows_compute_the_references(impl):
    """TRL's and verl's log-probs and entropies from the logits (verl's installed ``torch_functional.py``) and
    fused_rl's verl drop-ins: the reference's values and logits gradients."""
    requires = IMPLS[impl].requires  # not unavailable(): a row without one of the ops would be skipped
    if requires and cases.installed_path(requires) is None:
        pytest.skip(f"{requires} is not installed")
    x = make_inputs("token_logprobs", Shape(n=64, v=50, batch=4), "cpu")
    with peer_modules("verl", "tensordict"):
        fns = IMPLS[impl].build()
        for op in ("token_logprobs", "token_entropy"):
            assert cases.unavailable(IMPLS[impl], op, "cpu") is None  # the bench runs the row
            leaf = x["logits"].clone().requires_grad_()
            expected = IMPLS["reference"].build()[op]({**x, "logits": leaf})
            (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
            leaf = x["logits"].clone().requires_grad_()
            got = fns[op]({**x, "logits": leaf})
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)
            (grad,) = torch.autograd.grad(got.sum(), leaf)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_verl_logits_api_row_runs_the_drop_ins(monkeypatch):
    """The ``verl-logits-api`` row calls fused_rl's drop-ins (verl's own functions would give the same values)."""
    from fused_rl.integrations import verl_logits

    seen = []
    for name in ("logprobs_from_logits", "entropy_from_logits"):
        real = getattr(verl_logits, name)
        monkeypatch.setattr(verl_logits, name,
                            lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k))
    x = make_inputs("token_logprobs", Shape(n=16, v=50, batch=4), "cpu")
    fns = IMPLS["verl-logits-api"].build()
    fns["token_logprobs"](x), fns["token_entropy"](x)
    assert seen == ["logprobs_from_logits", "entropy_from_logits"]


def test_every_op_is_benchmarked():
    """``OPS`` (what the suite and the report run) holds every operation the reference row builds."""
    assert set(IMPLS["reference"].build()) == set(cases.OPS)


@pytest.fixture
def own_process_group():
    """The Megatron rows start a one-process gloo group in this process: ended after the test."""
    before = torch.distributed.is_initialized()
    yield
    if torch.distributed.is_initialized() and not before:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("impl", ["megatron", "megatron-api"])
def test_megatron_rows_compute_the_reference_log_probs(impl, own_process_group):
    """Megatron-Core's ``vocab_parallel_cross_entropy`` (its installed file, a one-process group) and fused_rl's
    drop-in, negated: the reference's token log-probs, and their logits gradient (Megatron's shifts its fp32 logits
    in place by their max, which leaves the log-probs as they are)."""
    if cases.unavailable(IMPLS[impl], "token_logprobs", "cpu"):
        pytest.skip("megatron-core is not installed")
    x = make_inputs("token_logprobs", Shape(n=64, v=50, batch=4), "cpu")
    leaf = x["logits"].clone().requires_grad_()
    expected = fused_rl.reference.token_logprobs(leaf, x["targets"])
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    leaf = x["logits"].clone().requires_grad_()
    got = IMPLS[impl].build()["token_logprobs"]({**x, "logits": leaf})
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
