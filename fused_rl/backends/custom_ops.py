"""The autograd and fake-tensor glue shared by every backend's token-stats / token-grad op pair.

Each backend defines two ``torch.library`` custom ops with the same schema:

* ``stats(logits, targets, temperature, with_entropy, grad_in_place=False) -> (logp, entropy, lse)``
  (``temperature`` a :func:`host_floats` of one value; outputs flat, length ``N``;
  ``lse`` in any layout the backend's ``grad`` reads, its last dimension ``N``;
  ``entropy`` empty unless ``with_entropy``; ``grad_in_place``: the backward writes ``dlogits`` over ``logits``);
* ``grad(logits, targets, lse, g_logp, entropy, g_entropy, temperature) -> dlogits`` with
  ``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau``, ``E[z] = lse - H``;
* optionally ``grad_inplace(logits, ...) -> None``, the same written over ``logits``.

:func:`register_token_ops` wires the backward of ``stats`` to ``grad`` (or ``grad_inplace``) and gives ``grad`` its fake
implementation and a backward that refuses, by name, a second-order gradient, so the three backends do
not each repeat it. :func:`consume_stored_grad` is the
one-backward rule of the single-pass ops (triton, cpu, cuda), whose forward already wrote ``dlogits``;
:func:`refuse_double_backward` the rule of every op whose gradient the forward computed;
:func:`register_stored_grad` the autograd formula of the single-pass ops' ``attach``.

Floats reach every op as a host tensor, :func:`host_floats` (a config as :func:`config_args`: its structure in a
string, its floats in the tensor), so that under ``torch.compile`` a value that changes between steps is an input
of the graph, not a constant of it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional, Sequence

import torch

from ..config import PolicyLossConfig
from ..validation import _is_compiling


def host_floats(values: Sequence[float]) -> torch.Tensor:
    """The CPU fp64 vector of ``values``: how the custom ops take floats (a config's, a temperature). Under
    ``torch.compile`` it is formed by tensor ops from the values, so a Python float that changes between calls (a
    ``beta`` schedule) is a symbolic input of the graph from its second value on (dynamo's unspecialized floats),
    not a constant of it: one recompile, then none. As a ``float`` argument of a custom op, or in a ``str``, each
    new value was a new graph, and past the recompile limit the step ran eagerly. The ops read it on the host
    (``tolist``: no device sync) and pass the values to their kernels as before."""
    cpu = torch.device("cpu")  # also under torch.set_default_device("cuda"): a device tensor would be a sync to read
    if torch.compiler.is_compiling():
        one = torch.ones((), dtype=torch.float64, device=cpu)
        return torch.stack([one * value for value in values])
    return torch.tensor(values, dtype=torch.float64, device=cpu)


def _host_read_tags() -> tuple:
    """``(torch.Tag.cudagraph_unsafe,)`` where this torch has the tag and ``custom_op`` takes tags, else ``()``."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    takes_tags = "tags" in inspect.signature(torch.library.custom_op).parameters
    return (tag,) if tag is not None and takes_tags else ()


#: The tags of an op that reads a :func:`host_floats` tensor when it runs: ``cudagraph_unsafe``. A CUDA graph
#: (``torch.compile(mode="reduce-overhead")``) records the kernels an op launched with the arguments of the
#: recording and a replay runs no Python: an op that read its floats on the host would repeat the recorded
#: ``beta`` / clip / temperature on every replay, whatever the step's config said. With the tag inductor runs
#: these ops outside its CUDA graphs (graph partitions), or records no CUDA graph for a graph that holds one.
HOST_READ_TAGS = _host_read_tags()


def host_reading_op(name: str, *, mutates_args=(), schema: Optional[str] = None):
    """``torch.library.custom_op(name, ...)`` for an op that reads a :func:`host_floats` tensor: tagged
    :data:`HOST_READ_TAGS`."""
    tags = {"tags": HOST_READ_TAGS} if HOST_READ_TAGS else {}
    return torch.library.custom_op(name, mutates_args=mutates_args, schema=schema, **tags)


def config_args(config: PolicyLossConfig, literal: Optional[str] = None) -> tuple[str, torch.Tensor]:
    """``(literal, floats)``: a config as the custom ops take it, its structure :attr:`PolicyLossConfig.literal`
    (or the given ``literal`` of it, e.g. ``literal_without_rollout``) and its :attr:`~PolicyLossConfig.float_values`
    as :func:`host_floats`; :func:`config_from_args` inverts it."""
    return (config.literal if literal is None else literal), host_floats(config.float_values)


def config_from_args(literal: str, floats: torch.Tensor) -> PolicyLossConfig:
    """The config of :func:`config_args`' pair, in a custom op's implementation (``floats`` on the CPU)."""
    return _config_of(literal, tuple(None if math.isnan(v) else v for v in floats.tolist()))


@functools.lru_cache(maxsize=64)
def _config_of(literal: str, floats: tuple[Optional[float], ...]) -> PolicyLossConfig:
    """:meth:`PolicyLossConfig.from_literal`, cached (the tiled ops call a kernel op per tile); ``None`` for the
    ``nan`` of an unset field, which a cache key cannot hold (``nan != nan``)."""
    return PolicyLossConfig.from_literal(literal, floats)


def autocast_free_op(name: str):
    """:func:`host_reading_op` ``(name)`` whose implementation (first argument a tensor) runs with autocast
    off on that tensor's device: the fused-linear ops pick their GEMM precision themselves (fp32
    accumulation, or the tiled mixed mode) and compute the gradients in their forward, which runs inside
    the caller's autocast region; there a ``torch.mm`` without ``out=`` would run in fp16 / bf16 and round
    gradients that carry no loss scale yet (fp16: mostly to 0). The schema is the undecorated function's."""

    def register(op_body):
        @functools.wraps(op_body)
        def run(first, *args, **kwargs):
            with torch.autocast(first.device.type, enabled=False):
                return op_body(first, *args, **kwargs)

        schema = torch.library.infer_schema(op_body, mutates_args=())
        return host_reading_op(name, schema=schema)(run)

    return register


def writable_in_place(logits: torch.Tensor) -> bool:
    """Whether ``inplace=True`` may write the gradient over ``logits``: a non-leaf buffer (model output) that is
    not a view of a leaf either (over a leaf it would alias the leaf's own ``.grad``; over a view of one, e.g.
    ``leaf[:, P-1:-1]``, it would overwrite the leaf's values)."""
    return not logits.is_leaf and (logits._base is None or not logits._base.is_leaf)


def grad_writable_in_place(logits: torch.Tensor) -> bool:
    """Whether a backward may write ``dlogits`` over ``logits``: :func:`writable_in_place`, outside a compiled
    graph (a traced mutation of a saved input would be copied back, not saved), and the kernels' ``(B, T, V)``
    rows a view of them (a ``(..., V)`` tensor whose leading dims cannot be viewed as two is read from a copy)."""
    if not writable_in_place(logits) or _is_compiling():
        return False
    if logits.dim() <= 3:
        return True
    try:
        logits.view(-1, logits.shape[-2], logits.shape[-1])
    except RuntimeError:
        return False
    return True


def fp16_needs_two_passes(logits: torch.Tensor) -> bool:
    """Whether a single-pass backend hands ``logits`` to the two-pass composition: fp16 logits with a gradient. The
    single pass stores ``dlogits`` in the logits dtype in the forward, before the backward's ``grad_output``
    (GradScaler's 65536) scales it: in fp16 every entry below ``6e-8`` (``w_t p_j`` of a softmax tail at
    ``w_t = 1 / 4096``: nearly all of a 150k-vocabulary row) was already 0. The two passes form ``dlogits`` in
    the backward from the scaled upstream gradient, in fp32, and round once, as the reference. bf16 has fp32's
    range: single pass."""
    return logits.dtype == torch.float16 and logits.requires_grad and torch.is_grad_enabled()


def register_token_ops(stats_op, grad_op, grad_inplace_op=None) -> None:
    """The autograd of ``stats_op`` (its backward runs ``grad_op``, or ``grad_inplace_op`` over the saved logits when
    the forward was asked ``grad_in_place`` and the backend has one: a permission, as ``policy_loss``'s ``inplace``)
    and the fake / refusing backward of the grad ops."""
    @grad_op.register_fake
    def _(logits, targets, lse, g_logp, entropy, g_entropy, temperature):
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    if grad_inplace_op is not None:
        grad_inplace_op.register_fake(lambda logits, targets, lse, g_logp, entropy, g_entropy, temperature: None)

    def setup_context(ctx, inputs, output):
        logits, targets, temperature, with_entropy, grad_in_place = inputs
        _, entropy, lse = output
        ctx.save_for_backward(logits, targets, entropy, lse, temperature)
        ctx.with_entropy = with_entropy
        ctx.in_place = grad_in_place and grad_inplace_op is not None
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # an unused entropy output: g_entropy None, its term not computed

    def backward(ctx, g_logp, g_entropy, g_lse):
        logits, targets, entropy, lse, temperature = ctx.saved_tensors
        if g_logp is None:
            g_logp = lse.new_zeros(lse.shape[-1])
        if not ctx.with_entropy or g_entropy is None:
            entropy = g_entropy = None
        batched = is_batched(g_logp) or (g_entropy is not None and is_batched(g_entropy))
        if ctx.in_place and not batched and not torch.is_grad_enabled():
            # over the logits' own memory (a new version of them: a node that saved them raises, as a second
            # backward through this one does), returned as their gradient; out of place under create_graph=True
            # (grad mode on: grad_op's backward refuses the second-order gradient by name, where the in-place
            # gradient would be a constant of the new graph) and for a batch of gradients (no batching rule)
            x = logits.detach()
            grad_inplace_op(x, targets, lse, g_logp, entropy, g_entropy, temperature)
            return x, None, None, None, None
        return grad_op(logits, targets, lse, g_logp, entropy, g_entropy, temperature), None, None, None, None

    stats_op.register_autograd(backward, setup_context=setup_context)

    def no_double_backward(ctx, g_dlogits):
        raise RuntimeError("fused_rl: the logits gradient of token_logprobs and of the two-pass policy losses has "
                           "no backward of its own (a second-order gradient through create_graph=True); use "
                           "backend='reference' for higher-order gradients")

    grad_op.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)


def refuse_double_backward(backend: str) -> None:
    """Raise in a backward that returns gradients computed in the forward (single-pass and fused-linear
    ops) when asked for a double backward (``create_graph=True``: grad mode on in the backward, outside
    ``torch.compile``'s tracing): those gradients are constants, so its second-order terms would be
    silently missing."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"the {backend} loss computes its gradient in the forward and has no double backward "
                           "(create_graph=True); use backend='reference' for higher-order gradients")


def register_stored_grad(attach_op, scale_, backend: str) -> None:
    """The autograd formula of a single-pass backend's ``attach(loss, logits, dlogits) -> loss`` op: the
    gradient w.r.t. ``logits`` is the ``dlogits`` its forward computed, scaled in place by the incoming
    gradient with ``scale_(dlogits, grad)`` (after :func:`consume_stored_grad`)."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    def backward(ctx, grad):
        consume_stored_grad(ctx, backend)
        (dlogits,) = ctx.saved_tensors
        if is_batched(grad):  # no batching rule for the in-place scale: one product per batch entry
            return None, dlogits * grad, None
        scale_(dlogits, grad)
        return None, dlogits, None

    attach_op.register_autograd(backward, setup_context=setup_context)


def is_batched(grad: torch.Tensor) -> bool:
    """Whether a backward's incoming gradient is a batch of them (``torch.autograd.grad(..., is_grads_batched=True)``,
    ``jacobian(vectorize=True)``): the ``out=`` and in-place products of the stored gradients have no batching rule,
    so their backwards multiply out of place there."""
    return torch._C._functorch.is_legacy_batchedtensor(grad) or torch._C._functorch.is_batchedtensor(grad)


def consume_stored_grad(ctx, backend: str) -> None:
    """:func:`refuse_double_backward`, then mark the single-pass gradient stored by the forward as used,
    or raise if it already was: its backward scales that buffer in place by ``grad_output``, so a second
    backward through the same graph (``retain_graph=True``) would return a gradient scaled twice. Call it
    first in the backward."""
    refuse_double_backward(f"single-pass {backend} policy")
    if getattr(ctx, "consumed", False):
        raise RuntimeError(f"the single-pass {backend} policy loss scales its stored gradient in place: it "
                           "supports one backward only (for a second backward through one graph use "
                           "backend='torch')")
    ctx.consumed = True
