"""``torch.library.opcheck`` of every ``fused_rl::`` custom op: the schema (declared mutations match what
the op mutates), the fake implementation (the outputs ``torch.compile`` traces with have the real ones'
shapes, dtypes and strides, empty ones included) and AOT dispatch (autograd registration). A mismatch
there breaks compiled graphs that the eager tests never see. The fused-linear loss ops are checked in
``test_linear.py`` / ``test_tiled_linear.py``. The Triton ops run in the interpreter on CPU tensors; where a
GPU is present they run on CUDA tensors, and so do the native ops as the ``cuda`` backend (marked ``cuda``,
for ``bench/gpu_check.sh``)."""

from __future__ import annotations

import pytest
import torch

import fused_rl
from fused_rl import IGNORE_INDEX
from fused_rl.backends import torch_chunked, torch_linear
from fused_rl.backends.custom_ops import config_args, host_floats
from fused_rl.loss_math import aggregation_weights
from helpers import CONFIGS, make_case
from test_linear import opcheck_args

GPU = "cuda" if torch.cuda.is_available() else "cpu"
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
#: the ops' temperature 0.7: a one-value host tensor (custom_ops.host_floats), as the backends pass it
TAU = host_floats((0.7,))
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _backends(*names):
    """``names`` as parameters, plus ``cuda`` where a GPU is present; those that run on CUDA tensors marked
    ``cuda``."""
    names = names + (("cuda",) if GPU == "cuda" and "cpu" in names else ())
    on_gpu = lambda n: n == "cuda" or (n == "triton" and GPU == "cuda")
    return pytest.mark.parametrize("backend", [pytest.param(n, marks=[pytest.mark.cuda] if on_gpu(n) else [])
                                               for n in names])


def _module(name: str):
    """``(the ops' module, device)`` of a backend, skipping where it is unavailable there."""
    device = torch.device(GPU if name in ("triton", "cuda") else "cpu")
    reason = fused_rl.available_backends(device)[name]
    if reason is not None:
        pytest.skip(reason)
    if name == "torch":
        return torch_chunked, device
    from fused_rl.backends import native, triton

    return (triton if name == "triton" else native), device


def _policy_case(dtype, device, config):
    """``(logits (B, T, V), targets with IGNORE_INDEX at masked positions, A, w, old, ref)`` (fp32 vectors,
    contiguous)."""
    case = make_case(batch=3, length=4, vocab=300, dtype=dtype, seed=5)
    targets = torch.where(case.mask, case.targets, torch.full_like(case.targets, IGNORE_INDEX))
    f32 = lambda x: x.to(torch.float32).contiguous().to(device)
    adv = case.advantages[:, None].expand_as(case.mask)
    weights = aggregation_weights(case.mask, config)
    return (case.logits.to(device), targets.contiguous().to(device), f32(adv), f32(weights), f32(case.old),
            f32(case.ref))


@_backends("torch", "cpu", "triton")
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "entropy"])
@DTYPES
def test_token_ops(backend, with_entropy, dtype):
    module, device = _module(backend)
    logits, targets, *_ = _policy_case(dtype, device, CONFIGS[0])
    x = logits.detach().requires_grad_(True)
    torch.library.opcheck(module.token_stats, (x, targets, TAU, with_entropy), test_utils=CHECKS)
    _, entropy, lse = module.token_stats(logits, targets, TAU, with_entropy)
    g_logp = torch.randn(targets.numel(), device=device)
    g_ent = torch.randn(targets.numel(), device=device) if with_entropy else None
    grad_args = (targets, lse, g_logp, entropy if with_entropy else None, g_ent, TAU)
    torch.library.opcheck(module.token_grad, (logits, *grad_args), test_utils=CHECKS)
    # the in-place backward of token_logprobs(inplace=True): it mutates the logits
    torch.library.opcheck(module.token_stats, (x * 1, targets, TAU, with_entropy, True), test_utils=CHECKS)
    torch.library.opcheck(module.token_grad_inplace, (logits.clone(), *grad_args), test_utils=CHECKS)


@_backends("cpu")
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["on-policy-no-kl", "k3"])
@DTYPES
def test_native_policy_ops(backend, config, dtype):
    module, device = _module(backend)
    logits, targets, adv, weights, old, ref = _policy_case(dtype, device, config)
    old = old if config.kl is not None else None
    ref = ref if config.kl is not None else None
    args = (targets, adv, old, ref, None, weights, *config_args(config))
    torch.library.opcheck(module.policy_fwd, (logits, *args), test_utils=CHECKS)
    torch.library.opcheck(module.policy_fwd_inplace, (logits.clone(), *args), test_utils=CHECKS)
    if dtype == torch.float32:
        out = torch.empty(logits.shape, dtype=torch.bfloat16, device=device)
        torch.library.opcheck(module.policy_fwd_into, (logits, out, *args), test_utils=CHECKS)
    _, _, dlogits = module.policy_fwd(logits, *args)
    torch.library.opcheck(module.scale_grad_, (dlogits, torch.tensor(0.5, device=device)),
                          test_utils=CHECKS)
    loss = torch.tensor(1.5, device=device)
    torch.library.opcheck(module.attach_grad, (loss, logits.detach().requires_grad_(True), dlogits),
                          test_utils=CHECKS)


@_backends("triton")
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["on-policy-no-kl", "k3"])
@pytest.mark.parametrize("write", [False, True], ids=["no-grad", "grad"])
@DTYPES
def test_triton_policy_ops(backend, config, write, dtype):
    module, device = _module(backend)
    logits, targets, adv, weights, old, ref = _policy_case(dtype, device, config)
    flat = lambda x: None if x is None else x.reshape(-1)
    old = flat(old) if config.kl is not None else None
    ref = flat(ref) if config.kl is not None else None
    args = (targets.reshape(-1), flat(adv), flat(weights), old, ref, None, *config_args(config), True)
    torch.library.opcheck(module.policy_fwd, (logits, *args, write), test_utils=CHECKS)
    if not write:
        return
    torch.library.opcheck(module.policy_fwd_inplace, (logits.clone(), *args), test_utils=CHECKS)
    dlogits = module.policy_fwd(logits, *args, True)[-1]
    torch.library.opcheck(module.scale_, (dlogits, torch.tensor(0.5, device=device)), test_utils=CHECKS)
    terms = torch.randn(targets.numel(), device=device)
    torch.library.opcheck(module.attach_grad, (terms, logits.detach().requires_grad_(True), dlogits),
                          test_utils=CHECKS)


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "entropy"])
@DTYPES
def test_linear_token_ops(with_entropy, dtype):
    h, w, b, targets, *_ = opcheck_args(dtype)
    torch.library.opcheck(torch_linear.linear_token_stats, (h, w, b, targets, TAU, with_entropy, 5),
                          test_utils=CHECKS)
    g_logp = torch.randn(targets.shape)
    g_ent = torch.randn(targets.shape) if with_entropy else None
    h, w, b = h.detach(), w.detach(), b.detach()  # the grad op runs in a backward: it refuses one of its own
    for need in ((True, True, True), (True, False, False)):
        torch.library.opcheck(torch_linear.linear_token_grad, (h, w, b, targets, g_logp, g_ent, TAU, *need, 5),
                              test_utils=CHECKS)


def _fused_rl_ops() -> dict[str, torch._ops.OpOverload]:
    """Every registered ``fused_rl::`` op (the lazily imported backends imported first)."""
    from fused_rl.backends import native, tiled_linear, triton  # noqa: F401  (their ops register on import)

    ops = {}
    for name in dir(torch.ops.fused_rl):
        packet = getattr(torch.ops.fused_rl, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            ops[name] = packet.default
    return ops


def test_ops_that_read_host_floats_are_cudagraph_unsafe():
    """An op with a host-floats argument (``config_floats``, ``temperature``: ``custom_ops.host_floats``) reads it
    on the host when it runs, so a CUDA graph (``torch.compile(mode="reduce-overhead")``) that recorded it would
    replay the recorded values whatever the step's config: each such op carries ``cudagraph_unsafe`` (inductor runs
    it outside its CUDA graphs); the ops without one (the gradient scaling reads ``g`` on the device, ``attach``
    reads nothing) do not, and stay in the graph."""
    from fused_rl.backends.custom_ops import HOST_READ_TAGS

    if not HOST_READ_TAGS:
        pytest.skip("this torch has no cudagraph_unsafe tag (or custom_op takes no tags)")
    ops = _fused_rl_ops()
    reads = {name for name, op in ops.items()
             if {a.name for a in op._schema.arguments} & {"config_floats", "temperature"}}
    assert len(reads) == 20 and len(ops) == 24, sorted(ops)
    for name, op in ops.items():
        assert (torch.Tag.cudagraph_unsafe in op.tags) == (name in reads), name
