"""Benchmark cases: shapes, inputs and one callable per (operation, implementation, mode).

Operations: ``token_logprobs``, ``token_entropy``, ``policy_loss`` (vocabulary logits in) and
``linear_policy_loss`` (hidden states + LM-head weight in). Modes: ``fwd`` (no autograd) and ``fwd+bwd``.

Implementations: the reference eager and under ``torch.compile``, each fused_rl backend, and peers when installed:
Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (linear) and ``triton_grpo_loss`` (logits, CUDA only), TRL's
``selective_log_softmax`` (+ its GRPO loss formula) and ``entropy_from_logits``, verl's ``logprobs_from_logits`` /
``entropy_from_logits`` (its engines without fused kernels), verl's ``FusedLinearForPPO`` + the same formula
(linear), Cut Cross-Entropy's ``linear_cross_entropy`` (the log-prob part of the linear loss only), Megatron-Core's
``vocab_parallel_cross_entropy`` (token log-probs; CPU, a one-process gloo group as the tensor-parallel one); and
fused_rl's drop-ins for Liger's, verl's and Megatron's (``liger-api``, ``verl-api``, ``verl-logits-api``,
``megatron-api``).

Byte / FLOP floors used for the throughput columns (``itemsize`` of the logits / hidden dtype):
logits ops read ``N V`` elements forward and additionally write ``N V`` in fwd+bwd; the linear op
does ``2 N H V`` FLOPs forward and ``6 N H V`` in fwd+bwd.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

import fused_rl
from fused_rl import PolicyLossConfig

OPS = ("token_logprobs", "token_entropy", "policy_loss", "linear_policy_loss")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: The workload every loss case computes: DAPO-style clipping with a k3 KL to a reference policy.
CONFIG = PolicyLossConfig.preset("dapo", beta=0.04)


@dataclass(frozen=True)
class Shape:
    """``n`` tokens as ``batch`` sequences of ``n // batch``; ``h`` only for the linear op."""

    n: int
    v: int
    h: int = 0
    dtype: str = "fp32"
    batch: int = 8
    #: sequence lengths uniform in ``[T/2, T]`` (about a quarter of the tokens masked); False: every token a
    #: loss token (issues 3 and 4, whose byte / FLOP floors count every row)
    ragged: bool = True

    @property
    def t(self) -> int:
        return self.n // self.batch

    def label(self) -> str:
        return f"N{self.n}-V{self.v}" + (f"-H{self.h}" if self.h else "") + f"-{self.dtype}"


SHAPE_SETS = {
    "smoke": [Shape(n=256, v=1000, h=64)],
    "cpu": [Shape(n=n, v=32000, h=512) for n in (2048, 4096, 8192)],
    "gpu": [Shape(n=16384, v=151936, h=0, dtype="bf16", batch=16, ragged=False),
            Shape(n=8192, v=128256, h=4096, dtype="bf16", batch=8, ragged=False)],
}


def floor_bytes(op: str, mode: str, shape: Shape, loss_tokens: Optional[int] = None) -> int:
    """Minimum bytes a logits op must move: read the rows it needs (policy_loss: the ``loss_tokens`` rows,
    masked rows need no read), write dlogits (every row) in fwd+bwd."""
    size = DTYPES[shape.dtype].itemsize
    read = loss_tokens if op == "policy_loss" and loss_tokens is not None else shape.n
    return (read + (shape.n if mode == "fwd+bwd" else 0)) * shape.v * size


def floor_flops(op: str, mode: str, shape: Shape) -> int:
    return (6 if mode == "fwd+bwd" else 2) * shape.n * shape.h * shape.v


def make_inputs(op: str, shape: Shape, device: str, seed: int = 0) -> dict:
    """Random inputs (logits or hidden states and weight from randn) of the given shape, drawn on
    ``device`` (a GPU draws its GBs of logits or LM-head weight in milliseconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    on = dict(generator=g, device=device)
    dtype = DTYPES[shape.dtype]
    b, t = shape.batch, shape.t
    inputs: dict = {}
    if op == "linear_policy_loss":
        inputs["hidden"] = (torch.randn(b, t, shape.h, **on) / shape.h ** 0.25).to(dtype)
        inputs["weight"] = (torch.randn(shape.v, shape.h, **on) / shape.h ** 0.25).to(dtype)
    else:
        inputs["logits"] = (torch.randn(b, t, shape.v, **on) * 2).to(dtype)
    inputs["targets"] = torch.randint(0, shape.v, (b, t), **on)
    inputs["advantages"] = torch.randn(b, **on)
    lengths = torch.randint(t // 2, t + 1, (b,), **on)
    if not shape.ragged:
        lengths.fill_(t)  # after the draw: the later inputs stay those of the ragged case
    inputs["mask"] = torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    # old / ref near the policy's own log-probs, as in a training step (ratios ~1, some clipped, a small KL):
    # old = -5 rand (logp ~ -12) made every ratio ~e^-8 and the loss almost all KL
    with torch.no_grad():
        if op == "linear_policy_loss":
            logp = fused_rl.linear_token_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"],
                                                  check_inputs=False)
        else:
            logp = fused_rl.token_logprobs(inputs["logits"], inputs["targets"], check_inputs=False)
    inputs["old"] = (logp + 0.3 * torch.randn(b, t, **on)).clamp(max=0.0)
    inputs["ref"] = (logp + 0.3 * torch.randn(b, t, **on)).clamp(max=0.0)
    return inputs


# ----------------------------------------------------------------------------------------------
# implementations


def _fused(backend: str, compiled: bool = False):
    fns = {
        "token_logprobs": lambda x: fused_rl.token_logprobs(x["logits"], x["targets"], backend=backend,
                                                            check_inputs=False),
        "token_entropy": lambda x: fused_rl.token_entropy(x["logits"], backend=backend),
        "policy_loss": lambda x: fused_rl.policy_loss(
            x["logits"], x["targets"], x["advantages"], x["mask"], old_logprobs=x["old"], ref_logprobs=x["ref"],
            config=CONFIG, backend=backend, check_inputs=False).loss,
        "linear_policy_loss": lambda x: fused_rl.linear_policy_loss(
            x["hidden"], x["weight"], x["targets"], x["advantages"], x["mask"], old_logprobs=x["old"],
            ref_logprobs=x["ref"], config=CONFIG, backend=backend, check_inputs=False).loss,
    }
    if compiled:
        fns = {k: torch.compile(v) for k, v in fns.items()}
    return fns


def _eager_loss(logp: torch.Tensor, x: dict) -> torch.Tensor:
    """The cases' loss (:data:`CONFIG`: clip, k3 KL, token mean over the mask) on given log-probs, in eager torch
    (TRL's GRPO formula)."""
    coef_1 = torch.exp(logp - x["old"])
    coef_2 = torch.clamp(coef_1, 1 - CONFIG.clip_low, 1 + CONFIG.clip_high)
    a = x["advantages"].unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    d = x["ref"] - logp
    per_token = per_token + CONFIG.beta * (torch.exp(d) - d - 1)
    m = x["mask"].float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def _trl():
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    return {"token_logprobs": lambda x: selective_log_softmax(x["logits"], x["targets"]),
            "token_entropy": lambda x: entropy_from_logits(x["logits"]),
            "policy_loss": lambda x: _eager_loss(selective_log_softmax(x["logits"], x["targets"]), x)}


def verl_torch_functional():
    """verl 0.9.1's ``verl/utils/experimental/torch_functional.py`` loaded as a file (``import verl`` needs Ray)."""
    spec = importlib.util.spec_from_file_location("_verl_torch_functional",
                                                  installed_path("verl") / "utils/experimental/torch_functional.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _verl(fused: bool = False):
    """verl's fused-kernel forward (``use_fused_kernels``, torch backend): ``FusedLinearForPPO``'s log-probs (and
    entropies, unused) from the hidden states, then the cases' loss in eager torch; with ``fused`` fused_rl's drop-in
    (:mod:`fused_rl.integrations.verl_lm_head`) in its place."""
    if fused:
        from fused_rl.integrations.verl_lm_head import FusedLinearForPPO
    else:
        FusedLinearForPPO = verl_torch_functional().FusedLinearForPPO
    head = FusedLinearForPPO()

    def linear(x):
        logp, _ = head(x["hidden"], x["weight"], x["targets"])
        return _eager_loss(logp, x)

    return {"linear_policy_loss": linear}


def installed_path(package: str) -> Optional[Path]:
    """The installed ``package``'s directory (found on ``sys.path``: an empty stand-in in ``sys.modules`` is not
    asked), or None."""
    spec = importlib.machinery.PathFinder.find_spec(package)
    return None if spec is None else Path(list(spec.submodule_search_locations)[0])


def verl_functional() -> types.ModuleType:
    """verl 0.9.1's ``verl/utils/torch_functional.py`` (``logprobs_from_logits``, ``entropy_from_logits``: verl's
    engines without fused kernels) imported under its own name, with empty stand-ins for the packages ``verl`` and
    ``verl.utils`` (``import verl`` needs Ray) and, where it is not installed, ``tensordict`` (imported for other
    functions), unless already imported."""
    root = installed_path("verl")
    for name in ("verl", "verl.utils"):
        if name not in sys.modules:
            stand_in_package(name, root.joinpath(*name.split(".")[1:]))
    if "tensordict" not in sys.modules and importlib.machinery.PathFinder.find_spec("tensordict") is None:
        sys.modules["tensordict"] = types.SimpleNamespace(TensorDict=type("TensorDict", (), {}))
    return importlib.import_module("verl.utils.torch_functional")


def _verl_logits(fused: bool = False):
    """verl's log-probs and entropies from the logits (its engines without fused kernels; ``logprobs_from_logits``
    takes its ``logsumexp`` / ``log_softmax`` path where flash-attn is not installed); with ``fused`` fused_rl's
    drop-ins (:mod:`fused_rl.integrations.verl_logits`, ``inplace_backward`` left True as verl's engines call it
    without the entropy: the rows' logits are a leaf, left intact)."""
    if fused:
        from fused_rl.integrations import verl_logits as functional
    else:
        functional = verl_functional()
    return {"token_logprobs": lambda x: functional.logprobs_from_logits(x["logits"], x["targets"]),
            "token_entropy": lambda x: functional.entropy_from_logits(x["logits"])}


def load_module_file(name: str, path: Path) -> types.ModuleType:
    """The file at ``path`` imported as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in_package(name: str, path: Path) -> types.ModuleType:
    """An empty package ``name`` whose submodules are found in ``path`` (in place of a peer's ``__init__``, which
    imports the rest of its stack), registered in ``sys.modules``."""
    sys.modules[name] = package = types.ModuleType(name)
    package.__path__ = [str(path)]
    return package


@functools.cache
def megatron_cross_entropy() -> types.ModuleType:
    """Megatron-Core 0.16.1's ``megatron/core/tensor_parallel/cross_entropy.py`` (and the ``utils.py`` it imports)
    loaded by path, with stand-ins for what they import: ``megatron.core.parallel_state`` (the default process group
    as the tensor-parallel one) and the three names ``utils.py`` takes from ``megatron.core.utils``; the package
    ``megatron.core.tensor_parallel`` then has ``vocab_parallel_cross_entropy`` (verl's Megatron functions import it
    from there). Once a process (the stand-ins replace the installed package's modules)."""
    core = installed_path("megatron") / "core"
    stand_in_package("megatron", core.parent)
    megatron_core = stand_in_package("megatron.core", core)
    sys.modules["megatron"].core = megatron_core
    state = types.ModuleType("megatron.core.parallel_state")
    state.get_tensor_model_parallel_group = lambda: dist.group.WORLD
    state.get_tensor_model_parallel_rank = lambda: dist.get_rank()
    state.get_tensor_model_parallel_world_size = lambda: dist.get_world_size()
    sys.modules[state.__name__] = megatron_core.parallel_state = state
    utils = types.ModuleType("megatron.core.utils")
    utils.divide = lambda a, b: a // b
    utils.get_tensor_model_parallel_group_if_none = lambda group, **_: group
    utils.is_torch_min_version = lambda version, check_equality=True: True
    sys.modules[utils.__name__] = utils
    tensor_parallel = stand_in_package("megatron.core.tensor_parallel", core / "tensor_parallel")
    megatron_core.tensor_parallel = tensor_parallel
    load_module_file("megatron.core.tensor_parallel.utils", core / "tensor_parallel" / "utils.py")
    module = load_module_file("megatron.core.tensor_parallel.cross_entropy",
                              core / "tensor_parallel" / "cross_entropy.py")
    tensor_parallel.vocab_parallel_cross_entropy = module.vocab_parallel_cross_entropy
    return module


def _one_process_group() -> None:
    """A gloo process group of this process alone (the tensor-parallel group of the Megatron rows), once."""
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="fused_rl_bench_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _megatron(fused: bool = False):
    """Megatron-Core's ``vocab_parallel_cross_entropy`` on the logits (their one tensor-parallel slice, a
    one-process group: its fp32 copy, softmax and all-reduces all run), negated; with ``fused`` fused_rl's drop-in
    (:mod:`fused_rl.integrations.megatron`)."""
    _one_process_group()
    if fused:
        from fused_rl.integrations.megatron import vocab_parallel_cross_entropy

        return {"token_logprobs": lambda x: -vocab_parallel_cross_entropy(x["logits"], x["targets"],
                                                                          group=dist.group.WORLD)}
    vocab_parallel_cross_entropy = megatron_cross_entropy().vocab_parallel_cross_entropy
    return {"token_logprobs": lambda x: -vocab_parallel_cross_entropy(x["logits"], x["targets"])}


def _liger():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    modules = {}

    def linear(x):
        key = x["hidden"].device.type
        if key not in modules:
            modules[key] = LigerFusedLinearGRPOLoss(beta=CONFIG.beta, compiled=key == "cuda", use_ref_model=True,
                                                    epsilon_low=CONFIG.clip_low, epsilon_high=CONFIG.clip_high,
                                                    loss_type="bnpo")
        b, t, h = x["hidden"].shape
        loss, _ = modules[key](x["hidden"], x["weight"], x["targets"], x["mask"].int(), x["advantages"],
                               ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])
        return loss

    return {"linear_policy_loss": linear}


def _liger_triton_inputs(x: dict) -> dict:
    """``triton_grpo_loss`` reads ``(B, L+1, V)`` logits (a causal LM's, the last position unused): padded once,
    outside the timed step, and the padded tensor is the leaf (a ``cat`` in the step added a copy of the logits
    and, in the backward, a zero fill and an add of two full-size gradients)."""
    return {**x, "logits": torch.cat([x["logits"], x["logits"][:, -1:]], dim=1)}


def _liger_triton(fused: bool = False):
    """Liger's logits-level ``triton_grpo_loss`` (bnpo, the cases' clip range and k3 KL), or with ``fused`` the same
    call of fused_rl's drop-in (:mod:`fused_rl.integrations.liger`, backend auto: its cost over ``policy_loss``)."""
    if fused:
        from fused_rl.integrations.liger import triton_grpo_loss
    else:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def loss(x):
        out, _ = triton_grpo_loss(x["logits"], x["old"], x["ref"], x["targets"], x["advantages"], x["mask"].int(),
                                  temperature=1.0, beta=CONFIG.beta, eps_low=CONFIG.clip_low,
                                  eps_high=CONFIG.clip_high, inplace=False, loss_type="bnpo", reduce=True)
        return out

    return {"policy_loss": loss}


def _cce():
    from cut_cross_entropy import linear_cross_entropy

    def linear(x):
        nll = linear_cross_entropy(x["hidden"], x["weight"], x["targets"], reduction="none")
        return -(x["advantages"].unsqueeze(1) * -nll * x["mask"]).sum() / x["mask"].sum()

    return {"linear_policy_loss": linear}


@dataclass
class Impl:
    name: str
    build: Callable[[], dict]
    ops: tuple = OPS
    devices: tuple = ("cpu", "cuda")
    requires: Optional[str] = None  # importable module needed
    backend: Optional[str] = None  # fused_rl backend name, availability checked at run time
    note: str = ""  # shown after the name in the report's table: what the row leaves out
    prepare: Optional[Callable[[dict], dict]] = None  # the inputs in the peer's layout, made outside the timed step


IMPLS = {
    "reference": Impl("reference", lambda: _fused("reference")),
    "reference-compiled": Impl("reference-compiled", lambda: _fused("reference", compiled=True)),
    "torch": Impl("torch", lambda: _fused("torch"), backend="torch"),
    "cpu": Impl("cpu", lambda: _fused("cpu"), devices=("cpu",), backend="cpu"),
    "triton": Impl("triton", lambda: _fused("triton"), devices=("cuda",), backend="triton"),
    "cuda": Impl("cuda", lambda: _fused("cuda"), devices=("cuda",), backend="cuda"),
    "trl": Impl("trl", _trl, ops=("token_logprobs", "token_entropy", "policy_loss"), requires="trl"),
    "liger": Impl("liger", _liger, ops=("linear_policy_loss",), requires="liger_kernel"),
    "liger-triton": Impl("liger-triton", _liger_triton, ops=("policy_loss",), devices=("cuda",),
                         requires="liger_kernel", prepare=_liger_triton_inputs),
    "liger-api": Impl("liger-api", lambda: _liger_triton(fused=True), ops=("policy_loss",),
                      note="fused_rl.integrations.liger.triton_grpo_loss", prepare=_liger_triton_inputs),
    "verl": Impl("verl", _verl, ops=("linear_policy_loss",), requires="verl",
                 note="verl 0.9.1's FusedLinearForPPO (use_fused_kernels, torch) + the loss in eager torch"),
    "verl-api": Impl("verl-api", lambda: _verl(fused=True), ops=("linear_policy_loss",),
                     note="fused_rl.integrations.verl_lm_head.FusedLinearForPPO + the loss in eager torch"),
    "verl-logits": Impl("verl-logits", _verl_logits, ops=("token_logprobs", "token_entropy"), requires="verl",
                        note="verl 0.9.1's logprobs_from_logits / entropy_from_logits (no flash-attn)"),
    "verl-logits-api": Impl("verl-logits-api", lambda: _verl_logits(fused=True),
                            ops=("token_logprobs", "token_entropy"), note="fused_rl.integrations.verl_logits"),
    "megatron": Impl("megatron", _megatron, ops=("token_logprobs",), devices=("cpu",), requires="megatron",
                     note="Megatron-Core 0.16.1's vocab_parallel_cross_entropy, one process"),
    "megatron-api": Impl("megatron-api", lambda: _megatron(fused=True), ops=("token_logprobs",), devices=("cpu",),
                         note="fused_rl.integrations.megatron.vocab_parallel_cross_entropy, one process"),
    "cce": Impl("cce", _cce, ops=("linear_policy_loss",), devices=("cuda",), requires="cut_cross_entropy",
                note="advantage-weighted log-probs only: no clip, no KL"),
}


def unavailable(impl: Impl, op: str, device: str) -> Optional[str]:
    """Why ``impl`` cannot run ``op`` on ``device`` (``None`` if it can)."""
    if device not in impl.devices:
        return f"{impl.name} does not run on {device}"
    # on sys.path (find_spec would ask a stand-in package an earlier row left in sys.modules, which has no spec)
    if impl.requires and importlib.machinery.PathFinder.find_spec(impl.requires) is None:
        return f"{impl.requires} is not installed"
    if impl.backend is not None:
        reason = fused_rl.available_backends(torch.device(device)).get(impl.backend)
        if reason is not None:
            return reason
    if op not in impl.ops:
        return f"{impl.name} has no {op}"
    if impl.backend is not None and op == "linear_policy_loss":
        from fused_rl.backends import get_backend
        if not get_backend(impl.backend, torch.device(device)).has_linear:
            return f"backend {impl.backend!r} has no fused-linear implementation"
    return None


def make_callable(op: str, impl_name: str, mode: str, inputs: dict) -> Callable[[], None]:
    """A zero-argument function running one iteration (gradients reset each call); its ``inputs`` attribute
    holds what it runs on (``inputs``, or the implementation's ``prepare`` of them: their gradients' size)."""
    impl = IMPLS[impl_name]
    fn = impl.build()[op]
    if impl.prepare is not None:
        inputs = impl.prepare(inputs)
    run = _iteration(fn, mode, inputs)
    run.inputs = inputs
    return run


def _iteration(fn, mode: str, inputs: dict) -> Callable[[], None]:
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(inputs)
        return run
    leaves = [k for k in ("logits", "hidden", "weight") if k in inputs]

    def run():
        xs = dict(inputs)
        for k in leaves:
            xs[k] = inputs[k].detach().requires_grad_(True)
        out = fn(xs)
        (out if out.dim() == 0 else out.sum()).backward()

    return run


def describe(op: str, impl: str, mode: str, shape: Shape) -> dict:
    return dict(op=op, impl=impl, mode=mode, **asdict(shape))
