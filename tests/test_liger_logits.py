"""``fused_rl.integrations.liger``: Liger-Kernel's logits-level ``triton_grpo_loss`` and
``fused_selective_log_softmax`` against Liger's own functions (their Triton kernels run in the CPU interpreter,
``TRITON_INTERPRET=1`` from conftest, or on a GPU), and, where the module documents a difference, against TRL's
formula from Liger's own per-token outputs.

Data: peaked logits (scale 3), a ragged mask with an all-masked row and a one-token row, old / reference
log-probs near the current ones (so that some ratios are clipped on each side), temperature 0.9 (Liger's
default), V = 300 (not a multiple of Liger's 2048 / 4096 blocks nor of fused_rl's)."""

from __future__ import annotations

import itertools

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.integrations.liger import fused_selective_log_softmax, triton_grpo_loss

from helpers import triton_interpreter_reason

try:
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax as liger_selective
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss as liger_grpo
except ImportError:
    liger_grpo = liger_selective = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Why Liger's kernels cannot run here (None: they can).
LIGER_REASON = ("liger-kernel is not installed" if liger_grpo is None
                else None if DEVICE == "cuda" else triton_interpreter_reason())
needs_liger = pytest.mark.skipif(LIGER_REASON is not None, reason=str(LIGER_REASON))
# on a GPU every test runs on CUDA tensors (Liger's kernels and fused_rl's triton backend): part of the -m cuda run
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")] + (
    [pytest.mark.cuda] if DEVICE == "cuda" else [])

B, L, V = 4, 6, 300


def make(seed: int = 0, dtype=torch.float32, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, L + 1, V, generator=g) * scale).to(dtype)
    ids = torch.randint(0, V, (B, L), generator=g)
    logp = torch.log_softmax(logits[:, :-1].float() / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, 3:] = 0  # ragged
    mask[1, 1:] = 0  # a one-token response
    mask[2] = 0  # all masked
    case = dict(logits=logits, old=logp + 0.3 * torch.randn(B, L, generator=g),
                ref=logp + 0.5 * torch.randn(B, L, generator=g), ids=ids,
                adv=torch.randn(B, generator=g), mask=mask,
                upstream=torch.randn(B, L, generator=g), vllm=torch.rand(B, L, generator=g) + 0.5)
    return {k: v.to(DEVICE) for k, v in case.items()}


def run(fn, case, reduce, **kwargs):
    """``fn``'s outputs (detached) and the gradient of the logits: of the loss (``reduce=True``) or of
    ``sum(upstream * per_token_loss)`` (``reduce=False``, an arbitrary upstream gradient)."""
    x = case["logits"].clone().requires_grad_(True)
    old = kwargs.pop("old", case["old"])
    vllm = kwargs.pop("vllm_is_ratio", None)
    out = fn(x, old, case["ref"], case["ids"], case["adv"], kwargs.pop("mask", case["mask"]), reduce=reduce,
             inplace=False, vllm_is_ratio=vllm, **kwargs)
    if reduce:
        loss, metrics = out
        loss.backward()
        return [loss.detach()] + [m.detach() for m in metrics], x.grad
    per_token, kl, clipped = out
    (per_token * case["upstream"]).sum().backward()
    return [per_token.detach(), None if kl is None else kl.detach(), clipped], x.grad


def assert_same(got, want, atol=2e-6, rtol=2e-5):
    (outs, grad), (want_outs, want_grad) = got, want
    assert len(outs) == len(want_outs)
    for a, b in zip(outs, want_outs):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(grad, want_grad, atol=atol, rtol=rtol)


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
TOKEN_ONLY = ("cispo", "sapo", "vespo")  # Liger raises at importance_sampling_level="sequence"
CASES = [(lt, lvl, beta, bc) for lt, lvl, beta, bc in itertools.product(
    LOSS_TYPES, ["token", "sequence"], [0.0, 0.04], [False, True])
    if not (lvl == "sequence" and lt in TOKEN_ONLY) and not (beta == 0.0 and bc)]


def _kwargs(loss_type, level, beta, bias_correction):
    kwargs = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                  use_bias_correction_kl=bias_correction)
    if loss_type == "cispo":
        kwargs["eps_high"] = 5.0  # the cap of the ratio itself (Liger's default 0.4 is refused, tested below)
    return kwargs


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("loss_type,level,beta,bias_correction", CASES)
def test_matches_liger(loss_type, level, beta, bias_correction, reduce):
    """Loss (or per-token loss), KL, clip ratio (or ``is_clipped``) and the logits' gradient equal Liger's own, for
    every loss type and level Liger computes (luspo reduced: next test)."""
    if loss_type == "luspo" and reduce:
        pytest.skip("luspo's reduction differs from Liger's by design (test_luspo_is_trls)")
    case = make()
    kwargs = _kwargs(loss_type, level, beta, bias_correction)
    assert_same(run(triton_grpo_loss, case, reduce, **kwargs), run(liger_grpo, case, reduce, **kwargs))


@needs_liger
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_luspo_is_trls(level, beta):
    """Reduced luspo is TRL's ``(l m).sum(-1).mean()`` of Liger's own per-token losses, gradient included (Liger's
    reduced luspo is ``mean(l n_b)`` over ``B L`` positions: a different number on a ragged batch)."""
    case = make(seed=3)
    kwargs = dict(loss_type="luspo", importance_sampling_level=level, beta=beta)
    x = case["logits"].clone().requires_grad_(True)
    per_token, _, _ = liger_grpo(x, case["old"], case["ref"], case["ids"], case["adv"], case["mask"], reduce=False,
                                 inplace=False, **kwargs)
    want = (per_token * case["mask"]).sum(-1).mean()
    want.backward()
    (loss, *_), grad = run(triton_grpo_loss, case, True, **kwargs)
    torch.testing.assert_close(loss, want.detach(), atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(grad, x.grad, atol=2e-6, rtol=2e-5)
    liger_loss, _ = liger_grpo(case["logits"], case["old"], case["ref"], case["ids"], case["adv"], case["mask"],
                               reduce=True, inplace=False, **kwargs)
    assert not torch.allclose(liger_loss, want)  # the difference the docstring states exists on this batch


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("options", [
    dict(vllm_is_ratio="token"), dict(vllm_is_ratio="sequence"), dict(vllm_is_ratio="flat"),
    dict(delta=1.5), dict(delta=1.5, importance_sampling_level="sequence", eps_low=0.01, eps_high=0.01),
    dict(vllm_is_ratio="token", importance_sampling_level="sequence"),
    dict(temperature=0.6), dict(temperature=1.0, eps_low=0.1, eps_high=0.28),
    dict(num_items_in_batch=40), dict(loss_type="cispo", eps_high=1.2, num_items_in_batch=torch.tensor(7.0)),
    dict(loss_type="dr_grpo", max_completion_length=9), dict(old=None), dict(mask=None),
    dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.0),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_liger_options(options, reduce):
    """The options beyond the loss type: ``vllm_is_ratio`` as ``(B, L)``, ``(B, 1)`` and ``(B,)``, ``delta`` (token
    and sequence level), the temperature, the clip range, ``num_items_in_batch`` (a number and a tensor),
    ``max_completion_length``, on-policy (``old_logp=None``), no mask, the sapo and vespo parameters."""
    case = make(seed=5)
    options = dict(options)
    shapes = {"token": case["vllm"], "sequence": case["vllm"][:, :1], "flat": case["vllm"][:, 0]}
    if "vllm_is_ratio" in options:
        options["vllm_is_ratio"] = shapes[options["vllm_is_ratio"]]
    assert_same(run(triton_grpo_loss, case, reduce, **dict(options)), run(liger_grpo, case, reduce, **options))


@needs_liger
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_match_liger(dtype):
    """bf16 / fp16 logits: both read them in fp32 (fp16 takes fused_rl's two passes)."""
    case = make(seed=7, dtype=dtype)
    kwargs = dict(loss_type="grpo", beta=0.04)
    got, want = run(triton_grpo_loss, case, True, **kwargs), run(liger_grpo, case, True, **kwargs)
    # Liger writes the gradient in the logits' dtype too: both round once
    assert_same(got, want, atol=1e-5, rtol=1e-2)


@needs_liger
@pytest.mark.parametrize("mask", [True, False])
def test_selective_log_softmax_matches_liger(mask):
    """The no-grad log-probs of whole sequences (``input_ids`` and ``mask`` with a 3-token prompt in front): 0 where
    masked, and the padding ids there are not read (fused_rl; Liger reads nothing there either)."""
    case = make(seed=2)
    input_ids = torch.cat([torch.zeros(B, 3, dtype=torch.long, device=DEVICE), case["ids"]], 1)
    full_mask = torch.cat([torch.ones(B, 3, dtype=torch.long, device=DEVICE), case["mask"]], 1) if mask else None
    want = liger_selective(case["logits"], input_ids, 0.8, full_mask)
    if mask:
        input_ids[:, 3:][case["mask"] == 0] = V + 7  # out of range where masked: never read
    got = fused_selective_log_softmax(case["logits"], input_ids, 0.8, full_mask)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert got.dtype == torch.float32 and not got.requires_grad


def test_per_token_outputs_against_the_reference():
    """``reduce=False`` without Liger: the per-token loss is the reference loss math's on the reference
    log-probs, summed with the aggregation weights it is the reduced loss, the KL is k3 where unmasked."""
    case = make(seed=4)
    kwargs = dict(loss_type="bnpo", beta=0.1, eps_low=0.1, eps_high=0.2, temperature=0.9)
    per_token, kl, clipped = triton_grpo_loss(case["logits"].clone().requires_grad_(True), case["old"], case["ref"],
                                              case["ids"], case["adv"], case["mask"], reduce=False, **kwargs)
    assert per_token.requires_grad and not kl.requires_grad and not clipped.requires_grad  # detached, as documented
    per_token = per_token.detach()
    logp = torch.log_softmax(case["logits"][:, :-1].double() / 0.9, -1).gather(-1, case["ids"][..., None])[..., 0]
    m = case["mask"].bool()
    r = torch.exp(logp - case["old"].double())
    adv = case["adv"].double()[:, None]
    pg = -torch.minimum(r * adv, r.clamp(0.9, 1.2) * adv)
    d = case["ref"].double() - logp
    k3 = torch.exp(d) - d - 1
    torch.testing.assert_close(per_token.double(), torch.where(m, pg + 0.1 * k3, 0.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl.double(), torch.where(m, k3, 0.0), atol=1e-5, rtol=1e-5)
    want_clipped = ((r < 0.9) & (adv < 0)) | ((r > 1.2) & (adv > 0))
    assert torch.equal(clipped.bool(), want_clipped & m)
    loss, (kl_mean, clip_ratio) = triton_grpo_loss(case["logits"], case["old"], case["ref"], case["ids"],
                                                   case["adv"], case["mask"], reduce=True, **kwargs)
    torch.testing.assert_close(loss.double(), per_token.double().sum() / m.sum(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kl_mean.double(), kl.double().sum() / m.sum(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(clip_ratio.double(), clipped.double().sum() / m.sum())


@pytest.mark.parametrize("backend", ["cpu", "cuda", "torch", "triton"])
def test_backends_agree(backend):
    """Every backend the reduced and per-token paths run on gives the reference backend's values."""
    reason = fused_rl.available_backends(torch.device(DEVICE)).get(backend)
    if reason is not None:
        pytest.skip(reason)
    case = make(seed=6)
    for reduce in (True, False):
        kwargs = dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=True)
        want = run(lambda *a, **k: triton_grpo_loss(*a, backend="reference", **k), case, reduce, **kwargs)
        got = run(lambda *a, **k: triton_grpo_loss(*a, backend=backend, **k), case, reduce, **kwargs)
        assert_same(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduce", [True, False])
def test_inplace_writes_the_gradient_over_non_leaf_logits(reduce):
    """``inplace=True`` (Liger's default): the gradient of a non-leaf ``logits`` is written over that buffer (the
    last, unread position's row is 0), by the single pass at the call (``reduce=True``) or by the backward
    (``reduce=False``, as Liger); a leaf is left intact; autograd still reaches the leaf it came from."""
    case = make(seed=8)

    def backward(x):
        out = triton_grpo_loss(x, case["old"], case["ref"], case["ids"], case["adv"], case["mask"], reduce=reduce,
                               inplace=True, loss_type="grpo")
        overwritten = not torch.equal(x.detach(), case["logits"])
        (out[0] if reduce else (out[0] * case["upstream"]).sum()).backward()
        return overwritten

    leaf = case["logits"].clone().requires_grad_(True)
    logits = leaf * 1.0  # a model output: non-leaf
    assert backward(logits) == reduce  # written at the call by the single pass only
    (_, want_grad) = run(triton_grpo_loss, case, reduce, loss_type="grpo")
    torch.testing.assert_close(leaf.grad, want_grad, atol=2e-6, rtol=2e-5)
    assert torch.equal(logits.detach(), leaf.grad) and torch.all(leaf.grad[:, -1] == 0)
    leaf2 = case["logits"].clone().requires_grad_(True)
    assert not backward(leaf2)
    assert torch.equal(leaf2.detach(), case["logits"])
    torch.testing.assert_close(leaf2.grad, want_grad, atol=2e-6, rtol=2e-5)


def test_ignore_index_ids_and_per_token_advantages():
    """``-100`` in ``completion_ids`` is no token (as a masked one); ``(B, L)`` advantages equal to the ``(B,)`` ones
    broadcast, and Liger's ``(B, 1)`` column, give the same loss."""
    case = make(seed=9)
    ids = case["ids"].clone()
    ids[3, 2] = -100
    mask = case["mask"].clone()
    mask[3, 2] = 0
    args = (case["old"], case["ref"])
    with_ignore = triton_grpo_loss(case["logits"], *args, ids, case["adv"], case["mask"], reduce=True)
    with_mask = triton_grpo_loss(case["logits"], *args, case["ids"], case["adv"], mask, reduce=True)
    per_token_adv = triton_grpo_loss(case["logits"], *args, ids, case["adv"][:, None].expand(B, L), case["mask"],
                                     reduce=True)
    column_adv = triton_grpo_loss(case["logits"], *args, ids, case["adv"][:, None], case["mask"], reduce=True)
    for got in (with_ignore, per_token_adv, column_adv):
        torch.testing.assert_close(got[0], with_mask[0])
        torch.testing.assert_close(torch.stack(got[1]), torch.stack(with_mask[1]))


@pytest.mark.parametrize("reduce", [True, False])
def test_empty_batch_and_no_completion(reduce):
    """``B == 0``: zero loss and metrics, zero gradient (``reduce=False``: empty outputs); ``L == 0`` (logits
    ``(B, 1, V)``): nothing is scored, the loss is 0 and the one position's gradient 0."""
    for shape in ((0, L + 1, V), (B, 1, V)):
        x = torch.randn(*shape, device=DEVICE, requires_grad=True)
        n = shape[1] - 1
        per_token = torch.zeros(shape[0], n, device=DEVICE)
        out = triton_grpo_loss(x, per_token, per_token, per_token.long(), torch.zeros(shape[0], device=DEVICE),
                               per_token.long() + 1, reduce=reduce, inplace=False)
        if reduce:
            loss, metrics = out
            assert loss.item() == 0.0 and [m.item() for m in metrics] == [0.0, 0.0]
            loss.backward()
        else:
            assert [tuple(t.shape) for t in out] == [(shape[0], n)] * 3
            out[0].sum().backward()
        assert x.grad is not None and torch.all(x.grad == 0)


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(loss_type="cispo"), ValueError, "epsilon_high"),
    (dict(loss_type="vespo", vllm_is_ratio=torch.ones(B, L)), NotImplementedError, "vllm_is_ratio"),
    (dict(delta=1.1), NotImplementedError, "delta"),
    (dict(loss_type="sapo", importance_sampling_level="sequence"), NotImplementedError, "sequence"),
    (dict(loss_type="nope"), ValueError, "unknown loss_type"),
    (dict(completion_mask=torch.full((B, L), 2)), ValueError, "completion_mask must contain only 0 and 1"),
    (dict(completion_mask=torch.ones(B, L + 1)), ValueError, r"completion_mask must have shape \(4, 6\)"),
    (dict(completion_ids=torch.zeros(B, L + 1, dtype=torch.long)), ValueError, r"completion_ids must have shape"),
    (dict(completion_ids=torch.full((B, L), V)), ValueError, r"completion_ids must be in \[0, 300\)"),
    (dict(completion_ids=None), ValueError, "completion_ids must be a torch.Tensor"),
    (dict(old_logp=torch.full((B, L), float("nan"))), ValueError, "old_logp"),
    (dict(ref_logp=torch.ones(B, L)), ValueError, "ref_logp"),
    (dict(ref_logp=None), ValueError, r"ref_logp is required with beta != 0"),
    (dict(vllm_is_ratio=-torch.ones(B, L)), ValueError, "vllm_is_ratio"),
    (dict(vllm_is_ratio=torch.ones(B, 2)), ValueError, r"vllm_is_ratio must have shape \(4, 6\), \(4, 1\)"),
    (dict(advantages=torch.ones(B + 1)), ValueError, "advantages must have shape"),
    (dict(logits=torch.randn(B, V)), ValueError, r"logits must be a tensor of shape \(B, L\+1, V\)"),
    (dict(logits=torch.randn(B, L + 1, V).to(torch.int64)), ValueError, "logits"),
    (dict(reduce=1), ValueError, "reduce and inplace must be bools"),
    # edges of the checks (a mutation round): a per-sequence ratio of the wrong batch, an empty logits length, integer
    # logits on an empty and a one-row batch (checked before the other arguments), max_completion_length=0 (not L),
    # delta == 1 + eps_high
    (dict(vllm_is_ratio=torch.ones(B + 1)), ValueError, r"vllm_is_ratio must have shape \(4, 6\), \(4, 1\) or \(4,\)"),
    (dict(vllm_is_ratio=torch.ones(B + 1, 1)), ValueError, r"vllm_is_ratio must have shape \(4, 6\), \(4, 1\)"),
    (dict(logits=torch.randn(B, 0, V)), ValueError, r"logits must be a tensor of shape \(B, L\+1, V\)"),
    (dict(logits=torch.zeros(0, L + 1, V, dtype=torch.long)), ValueError, "logits must be floating"),
    (dict(logits=torch.zeros(1, L + 1, V, dtype=torch.long)), ValueError, "logits must be float32, bfloat16, float16"),
    (dict(inplace="yes"), ValueError, "reduce and inplace must be bools"),
    (dict(loss_type="dr_grpo", max_completion_length=0), ValueError, "max_completion_length"),
    (dict(eps_high=0.5, delta=1.5), NotImplementedError, r"delta=1.5 <= 1 \+ epsilon_high"),
])
def test_bad_input_names_ligers_arguments(kwargs, exc, needle):
    """Bad input raises, naming Liger's argument; what Liger would compute wrongly (cispo's default 0.4 cap, vespo
    with vllm_is_ratio) or fused_rl cannot (delta inside the clip range) raises too."""
    case = make()
    args = dict(logits=case["logits"], old_logp=case["old"], ref_logp=case["ref"], completion_ids=case["ids"],
                advantages=case["adv"], completion_mask=case["mask"], reduce=True)
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    with pytest.raises(exc, match=needle):
        triton_grpo_loss(**args)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(input_ids=torch.full((B, L), V)), r"input_ids must be in \[0, 300\)"),
    (dict(input_ids=torch.zeros(B, L - 1, dtype=torch.long)), r"input_ids must have shape \(4, >= 6\)"),
    (dict(mask=torch.ones(B + 1, L)), r"mask must have shape \(4, >= 6\)"),
    (dict(temperature=0.0), "temperature"),
])
def test_selective_log_softmax_names_ligers_arguments(kwargs, needle):
    """Bad input to :func:`fused_selective_log_softmax` raises a ``ValueError`` naming Liger's argument."""
    case = make()
    args = dict(logits=case["logits"], input_ids=case["ids"])
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    with pytest.raises(ValueError, match=needle):
        fused_selective_log_softmax(**args)


def test_signatures_are_ligers():
    """Every Liger parameter, in Liger's order with Liger's defaults (then the two keyword-only extras)."""
    import inspect

    if liger_grpo is None:
        pytest.skip("liger-kernel is not installed")
    for ours, theirs in ((triton_grpo_loss, liger_grpo), (fused_selective_log_softmax, liger_selective)):
        mine = [(p.name, p.default) for p in inspect.signature(ours).parameters.values()
                if p.kind != p.KEYWORD_ONLY]
        assert mine == [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]


def test_config_is_the_grpo_mapping():
    """The config is :func:`fused_rl.nn.grpo_policy_loss_config`'s, with Liger's defaults (temperature 0.9,
    eps_high 0.4, dapo) and dr_grpo's length defaulting to ``L``."""
    from fused_rl.integrations.liger import _config
    from fused_rl.nn import grpo_policy_loss_config

    common = dict(beta=0.04, eps_low=0.2, eps_high=0.4, temperature=0.9, max_completion_length=None, delta=None,
                  use_bias_correction_kl=False, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0))
    assert _config("dapo", "token", 6, **common) == grpo_policy_loss_config(
        "dapo", epsilon_low=0.2, epsilon_high=0.4, beta=0.04, temperature=0.9)
    assert _config("dr_grpo", "token", 6, **common).max_len == 6
    assert isinstance(_config("grpo", "sequence", 6, **common), PolicyLossConfig)
    assert _config("grpo", "sequence", 6, **common).policy_loss == "gspo"


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("reduce", [True, False])
def test_padding_ids_are_not_read(backend, reduce):
    """Ids out of the vocabulary where the mask is 0 (a padding id) are never read: the same outputs and gradient
    as with in-range ids there."""
    case = make(seed=10)
    padded = dict(case, ids=torch.where(case["mask"] == 0, V + 7, case["ids"]))
    fn = lambda *a, **k: triton_grpo_loss(*a, backend=backend, **k)  # noqa: E731
    assert_same(run(fn, padded, reduce, loss_type="grpo", beta=0.04), run(fn, case, reduce, loss_type="grpo",
                                                                         beta=0.04))


@pytest.mark.parametrize("reduce", [True, False])
def test_compiles_without_graph_breaks(reduce):
    """``torch.compile(fullgraph=True)`` traces both paths and :func:`fused_selective_log_softmax` (the custom ops
    opaque, no host read), with the eager values and gradient."""
    case = make(seed=11)

    def step(x):
        out = triton_grpo_loss(x, case["old"], case["ref"], case["ids"], case["adv"], case["mask"], reduce=reduce,
                               inplace=False, loss_type="dapo", num_items_in_batch=torch.tensor(9.0, device=DEVICE))
        return out[0] if reduce else (out[0] * case["upstream"]).sum()

    eager, compiled = (case["logits"].clone().requires_grad_(True) for _ in range(2))
    step(eager).backward()
    torch.compile(step, fullgraph=True, backend="aot_eager")(compiled).backward()
    torch.testing.assert_close(compiled.grad, eager.grad)
    logp = torch.compile(fused_selective_log_softmax, fullgraph=True, backend="aot_eager")(
        case["logits"], case["ids"], 0.9, case["mask"])
    torch.testing.assert_close(logp, fused_selective_log_softmax(case["logits"], case["ids"], 0.9, case["mask"]))


#: Wrong shapes, dtypes, layouts, values and types of each argument (some accepted: a bool or float 0/1 mask,
#: ``(B, 1)`` / ``(B,)`` ratios, old log-probs omitted, a smaller vocabulary).
_BAD = {
    "logits": lambda: [torch.randn(B, L, V), torch.randn(B, L + 1), torch.randn(B, L + 1, 0),
                       torch.randn(B, L + 1, V).long(), torch.randn(V, L + 1, B).permute(2, 1, 0),
                       torch.full((B, L + 1, V), float("nan")), torch.randn(B, L + 1, 3), "x"],
    "old_logp": lambda: [None, torch.randn(B, L + 1), torch.full((B, L), float("inf")), torch.randn(B).long()],
    "ref_logp": lambda: [None, torch.randn(B, 2), torch.full((B, L), float("nan")), torch.randn(B, L).double()],
    "completion_ids": lambda: [torch.zeros(B, L), torch.full((B, L), -5), torch.zeros(B, L, dtype=torch.int16),
                               torch.zeros(L, B, dtype=torch.long).t(), torch.zeros(B, dtype=torch.long)],
    "advantages": lambda: [torch.randn(B, L + 1), torch.randn(B, 1), torch.tensor(1.0), torch.randint(0, 2, (B,)),
                           torch.full((B,), float("nan"))],
    "completion_mask": lambda: [None, torch.ones(B, L, dtype=torch.bool), torch.full((B, L), 0.5), torch.ones(B),
                                torch.zeros(B, L)],
    "temperature": lambda: [0.0, -1.0, float("nan"), "1", torch.tensor(0.5)],
    "beta": lambda: [-0.1, float("inf"), None, torch.tensor(0.1)],
    "eps_low": lambda: [-0.2, float("nan"), 2.0],
    "eps_high": lambda: [-0.2, None, 10.0],
    "loss_type": lambda: ["cispo", "vespo", "GRPO", None, "luspo"],
    "max_completion_length": lambda: [0, -3, 4.5, "9"],
    "importance_sampling_level": lambda: ["sequence", "seq", None],
    "reduce": lambda: [False, None, 1],
    "inplace": lambda: [False, "yes"],
    "vllm_is_ratio": lambda: [torch.ones(B, L), torch.ones(B, 1), torch.ones(B), -torch.ones(B, L),
                              torch.ones(B, L + 1), torch.full((B, L), float("nan"))],
    "delta": lambda: [1.1, 3.0, -1.0, float("inf")],
    "num_items_in_batch": lambda: [0, -4, torch.tensor([1.0, 2.0]), "n", 12],
    "sapo_temperature_pos": lambda: [0.0, -1.0],
    "vespo_k_neg": lambda: [float("nan"), -1.0],
}


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_bad_input_fuzz_raises_value_errors_only(backend):
    """One or two arguments of a valid call replaced by a wrong shape, dtype, layout, value or type: the call
    succeeds (the change was acceptable) or raises ``ValueError`` / ``NotImplementedError`` (an option fused_rl
    does not compute) before any kernel runs; never an exception from deeper down."""
    from hypothesis import given
    from hypothesis import strategies as st

    from strategies import fuzz_settings

    case = make(seed=12)
    valid = dict(logits=case["logits"], old_logp=case["old"], ref_logp=case["ref"], completion_ids=case["ids"],
                 advantages=case["adv"], completion_mask=case["mask"], reduce=True)

    @fuzz_settings(150)
    @given(picks=st.lists(st.tuples(st.sampled_from(sorted(_BAD)), st.integers(0, 7)), min_size=1, max_size=2,
                          unique_by=lambda p: p[0]))
    def check(picks):
        kwargs = dict(valid)
        for key, i in picks:
            options = _BAD[key]()
            value = options[i % len(options)]
            kwargs[key] = value.to(DEVICE) if isinstance(value, torch.Tensor) else value
        if isinstance(kwargs["logits"], torch.Tensor) and kwargs["logits"].is_floating_point():
            kwargs["logits"] = kwargs["logits"].clone().requires_grad_(True)
        try:
            out = triton_grpo_loss(**kwargs, backend=backend)
            (out[0] if kwargs["reduce"] else out[0].sum()).backward()
        except (ValueError, NotImplementedError):
            pass

    check()


# ----------------------------------------------------------------------------- edge cases (mutation-testing round)
@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_clip_boundaries_and_zero_advantages_match_liger(on_policy, level, reduce):
    """``is_clipped`` / ``clip_ratio`` at the edges of Liger's strict comparisons: on-policy with ``eps = 0`` every
    ratio is exactly ``1 = 1 - eps_low = 1 + eps_high`` (never clipped); off-policy with rows of ``A = 0`` whose
    ratios leave the clip range (never clipped either: Liger needs ``A < 0`` / ``A > 0``)."""
    case = make(seed=13)
    case["mask"][:] = 1
    case["adv"][:] = torch.tensor([0.0, -0.7, 0.9, 0.0])  # both signs on full rows, and two rows of A = 0
    if on_policy:
        kwargs = dict(old=None, eps_low=0.0, eps_high=0.0)
    else:
        kwargs = dict(eps_low=0.05, eps_high=0.05)
        logp = torch.log_softmax(case["logits"][:, :-1].float() / 0.9, -1).gather(-1, case["ids"][..., None])[..., 0]
        r = torch.exp(logp - case["old"])
        assert ((r[0] - 1).abs() > 0.05).any() and ((r[3] - 1).abs() > 0.05).any()  # A = 0 rows out of range
    kwargs.update(loss_type="grpo", importance_sampling_level=level)
    assert_same(run(triton_grpo_loss, case, reduce, **dict(kwargs)), run(liger_grpo, case, reduce, **kwargs))


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_all_masked_batch_matches_liger(loss_type, reduce):
    """``B > 0`` with every token masked: zero loss, KL, clip ratio (Liger's denominators clamped at 1, not 0 / 0)
    and gradient, as Liger's."""
    case = make(seed=14)
    kwargs = dict(_kwargs(loss_type, "token", 0.04, False), mask=torch.zeros_like(case["mask"]))
    got, want = run(triton_grpo_loss, case, reduce, **dict(kwargs)), run(liger_grpo, case, reduce, **kwargs)
    assert_same(got, want)
    assert all(torch.all(t == 0) for t in got[0] + [got[1]])


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("batch", [0, B])
def test_output_structure_and_dtypes_are_ligers(batch, reduce, beta, dtype):
    """The number of outputs / metrics, ``None`` for the KL at ``beta = 0``, shapes and dtypes (fp32 for fp32 and
    bf16 logits, ``is_clipped`` a float tensor) equal Liger's, on a batch and on an empty one (``B = 0``)."""
    case = {k: v[:batch] for k, v in make(seed=15, dtype=dtype).items()}
    outs = []
    for fn in (triton_grpo_loss, liger_grpo):
        out = fn(case["logits"], case["old"], case["ref"], case["ids"], case["adv"], case["mask"], beta=beta,
                 reduce=reduce, inplace=False)
        flat = [out[0], *out[1]] if reduce else list(out)
        outs.append([None if t is None else (tuple(t.shape), t.dtype) for t in flat])
    assert outs[0] == outs[1]
    if batch == 0:
        got = fused_selective_log_softmax(case["logits"], case["ids"], 0.9, case["mask"])
        want = liger_selective(case["logits"], case["ids"], 0.9, case["mask"])
        assert (got.shape, got.dtype) == (want.shape, want.dtype) == ((0, L), torch.float32)


@needs_liger
@pytest.mark.parametrize("num_items", [None, 40, torch.tensor(40.0), 1.5, torch.tensor(1.5)],
                         ids=["none", "int", "tensor", "small-float", "small-tensor"])
def test_world_size_normalizer_matches_liger(monkeypatch, num_items):
    """dapo's normalizer on a (faked) 2-rank job, read from ``torch.distributed`` by both: ``num_items_in_batch /
    world_size`` clamped at 1 (1.5 / 2 -> 1), or the tokens of all ranks (``all_reduce``: here twice the local
    count) over the world size; Liger's own ``_compute_dapo_normalizer`` runs under the same fake."""
    calls = []

    def all_reduce(t, op=None):
        calls.append(t)
        t.mul_(2)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    case = make(seed=16)
    kwargs = dict(loss_type="dapo", num_items_in_batch=num_items)
    got = run(triton_grpo_loss, case, True, **dict(kwargs))
    assert len(calls) == (num_items is None)  # one all_reduce (for the loss and its gradient), only without the count
    assert_same(got, run(liger_grpo, case, True, **kwargs))


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
def test_ref_logp_is_not_read_at_beta_zero(reduce):
    """``beta = 0``: ``ref_logp`` is not read (Liger's kernel does not load it): a wrong-shaped or NaN one gives
    Liger's outputs without it."""
    case = make(seed=17)
    want = run(liger_grpo, dict(case, ref=None), reduce, beta=0.0)
    for ref in (torch.full((B, L), float("nan"), device=DEVICE), torch.zeros(B, 2, device=DEVICE)):
        assert_same(run(triton_grpo_loss, dict(case, ref=ref), reduce, beta=0.0), want)


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
def test_cispo_cap_of_one_matches_liger(reduce):
    """cispo's smallest accepted cap, ``eps_high = 1`` (the ratio truncated at 1; ``clip_high = 0``), is Liger's."""
    case = make(seed=18)
    kwargs = dict(loss_type="cispo", eps_high=1.0)
    assert_same(run(triton_grpo_loss, case, reduce, **dict(kwargs)), run(liger_grpo, case, reduce, **kwargs))


@needs_liger
@pytest.mark.parametrize("reduce", [True, False])
def test_ignore_index_ids_match_liger_with_those_tokens_masked(reduce):
    """``-100`` in ``completion_ids`` (on rows of both advantage signs) is a masked token: loss, KL, clip ratio
    (numerator and denominator) and gradient equal Liger's with the mask 0 there (and any valid id)."""
    case = make(seed=19)
    case["adv"][:] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    case["mask"][:] = 1
    drop = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    drop[:, 1::2] = True
    want = run(liger_grpo, dict(case, mask=case["mask"].masked_fill(drop, 0)), reduce, loss_type="bnpo")
    got = run(triton_grpo_loss, dict(case, ids=case["ids"].masked_fill(drop, -100)), reduce, loss_type="bnpo")
    assert_same(got, want)
