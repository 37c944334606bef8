"""Triton backend (``backend="triton"``): the vocabulary work in Triton kernels (``fused_rl.kernels``).

* :meth:`TritonBackend.token_logprobs`: two passes. Forward (stats kernel, one read of the logits)
  saves per-row ``lse`` (and ``H``); backward (grad kernel, one read + one write) computes
  ``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau`` for arbitrary upstream gradients.
* :meth:`TritonBackend.policy_loss`, every token-local config (``config.has_token_epilogue``: ppo_clip
  with dual clip / ``delta``, sapo, cispo, reinforce, every KL estimator and ``kl_bias_correction``,
  token-level rollout correction): one kernel runs the stats loop, the loss epilogue
  (:mod:`fused_rl.kernels.epilogue`) and writes ``dlogits = d loss / d logits`` in the forward (over
  the logits with ``inplace=True``); the backward only scales it by ``grad_output`` in place, on the
  device (a no-op when it is 1, with no host sync). The other configs (gspo / gspo_token / gmpo / vespo,
  sequence rollout correction, the off-policy mask, the top-entropy quantile) use the base-class
  composition on top of :meth:`token_logprobs`.

The loss value is ``sum_t (w_t l_t)`` of the kernel's per-token values (``w`` from
:func:`fused_rl.loss_math.aggregation_weights`, computed in torch, O(N)); the metrics are
:func:`fused_rl.loss_math.metrics` applied to the kernel's per-token ratio / KL / entropy (O(N) torch),
with the rollout weights and dppo's trust-region mask for its metrics from :func:`fused_rl.loss_math.rollout_weights`
and :func:`fused_rl.loss_math.dppo_keep` on the kernel's log-probs (on-policy) or ``old``.

Every kernel call is a ``torch.library`` custom op with a fake implementation, so
``torch.compile(fullgraph=True)`` sees opaque calls. The kernels are imported on first use, so that
``TRITON_INTERPRET=1`` set before that (e.g. by a test module) takes effect.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from ..config import DPPO, IGNORE_INDEX, PolicyLossConfig, literal_fields
from ..loss_math import aggregation_weights, dppo_keep, metrics as loss_metrics, rollout_weights
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs
from . import register, register_missing
from .base import Backend
from .custom_ops import (config_args, config_from_args, fp16_needs_two_passes, host_floats, host_reading_op,
                         grad_writable_in_place, register_stored_grad, register_token_ops, writable_in_place)
from .tiled_linear import TiledLinearMethods

# triton itself is imported lazily too: importing it fixes TRITON_INTERPRET for its own @jit library
# functions, so an early import (e.g. at `import fused_rl` during test collection) would break the
# interpreter for a test module that sets the variable afterwards.
def _installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] is None
        return False


_INSTALLED = _installed()


#: The environment checks below, memoized in a plain dict: ``unavailable_reason`` runs inside code that
#: ``torch.compile`` traces, and dynamo warns on (and ignores) ``functools.lru_cache``.
_CHECKS: dict = {}


def _memoized(check):
    def cached() -> Optional[str]:
        if check.__name__ not in _CHECKS:
            _CHECKS[check.__name__] = check()
        return _CHECKS[check.__name__]
    return cached


#: The oldest Triton the kernels were run with: 3.4 (torch 2.8's; the test suite passes under its interpreter, and
#: ``bench/compile_sm90.py`` compiles every kernel for sm_90); 3.1 (torch 2.5's) refuses them ("arange's arguments
#: must be of type tl.constexpr")
MIN_TRITON = (3, 4)


def _major_minor(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".")[:2])


@_memoized
def _import_error() -> Optional[str]:
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    if _major_minor(triton.__version__) < MIN_TRITON:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}, which the kernels need"
    return None


@_memoized
def _interpreter_error() -> Optional[str]:
    """Triton < 3.7's interpreter calls ``int()`` on 1-element arrays (loop bounds such as
    ``tl.program_id(0)``), which numpy >= 2.4 refuses; Triton 3.7 fixed it."""
    import numpy
    import triton

    if _major_minor(triton.__version__) < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        return (f"the interpreter of triton {triton.__version__} fails with numpy {numpy.__version__} "
                "(int() of a 1-element array); use triton >= 3.7 or numpy < 2.4 for TRITON_INTERPRET=1")
    return None


def _kernels():
    from ..kernels import logits

    return logits


# --------------------------------------------------------------------------- token_logprobs ops
@host_reading_op("fused_rl::triton_token_stats", mutates_args=())
def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                with_entropy: bool, grad_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat fp32 ``(logp, entropy, lse)``; ``entropy`` empty unless ``with_entropy``; ``temperature`` a
    ``custom_ops.host_floats`` of one value; ``grad_in_place``: the backward runs :func:`token_grad_inplace`."""
    return _kernels().token_stats(logits, targets, float(temperature), with_entropy)


@token_stats.register_fake
def _(logits, targets, temperature, with_entropy, grad_in_place=False):
    n = targets.numel()
    return (logits.new_empty(n, dtype=torch.float32), logits.new_empty(n if with_entropy else 0, dtype=torch.float32),
            logits.new_empty((2, n), dtype=torch.float32))


@host_reading_op("fused_rl::triton_token_grad", mutates_args=())
def token_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
               entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
               temperature: torch.Tensor) -> torch.Tensor:
    """Contiguous dlogits in the logits dtype and shape."""
    return _kernels().token_grad(logits, targets, lse, g_logp, entropy, g_entropy, float(temperature))


@host_reading_op("fused_rl::triton_token_grad_inplace", mutates_args=("logits",))
def token_grad_inplace(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
                       entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
                       temperature: torch.Tensor) -> None:
    """:func:`token_grad` written over ``logits`` (each row read before its blocks are stored)."""
    _kernels().token_grad(logits, targets, lse, g_logp, entropy, g_entropy, float(temperature), out=logits)


register_token_ops(token_stats, token_grad, token_grad_inplace)


# --------------------------------------------------------------------------- single-pass policy loss ops
# The config travels as ``custom_ops.config_args`` (its literal, a str, and its floats, a host tensor): the kernel
# arguments come from the one map of the epilogue, ``kernels.epilogue.epilogue_args``.
def _run_policy(logits, targets, advantages, weights, old, ref, rollout, config_literal, config_floats, with_entropy,
                out, write_grad):
    from ..kernels.epilogue import epilogue_args

    config = config_from_args(config_literal, config_floats)
    return _kernels().policy_fused(logits, targets, advantages, weights, old, ref, out, config.temperature,
                                   epilogue_args(config, on_policy=old is None), with_entropy, write_grad,
                                   rollout=rollout)


def _fake_token_outputs(logits, targets, config_literal, with_entropy):
    n = targets.numel()
    new = lambda k: logits.new_empty(k, dtype=torch.float32)
    has_kl = literal_fields(config_literal)["kl"] is not None
    return new(n), new(n if with_entropy else 0), new(n), new(n), new(n if has_kl else 0)


@host_reading_op("fused_rl::triton_policy_fwd", mutates_args=())
def policy_fwd(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
               old: Optional[torch.Tensor], ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor],
               config_literal: str, config_floats: torch.Tensor, with_entropy: bool, write_grad: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat fp32 ``(logp, entropy, w * l, ratio, kl)`` and the contiguous ``dlogits`` (empty unless
    ``write_grad``) of the single-pass kernel; ``targets`` flat, IGNORE_INDEX at masked positions;
    ``(config_literal, config_floats)`` the ``custom_ops.config_args`` of a config with a token epilogue."""
    out = torch.empty(logits.shape if write_grad else (0,), dtype=logits.dtype, device=logits.device)
    outs = _run_policy(logits, targets, advantages, weights, old, ref, rollout, config_literal, config_floats,
                       with_entropy, out, write_grad)
    return (*outs, out)


@policy_fwd.register_fake
def _(logits, targets, advantages, weights, old, ref, rollout, config_literal, config_floats, with_entropy,
      write_grad):
    out = torch.empty(logits.shape if write_grad else (0,), dtype=logits.dtype, device=logits.device)
    return (*_fake_token_outputs(logits, targets, config_literal, with_entropy), out)


@host_reading_op("fused_rl::triton_policy_fwd_inplace", mutates_args=("logits",))
def policy_fwd_inplace(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                       weights: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
                       rollout: Optional[torch.Tensor], config_literal: str, config_floats: torch.Tensor,
                       with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``triton_policy_fwd`` but writes ``dlogits`` over ``logits`` (each block is read before it is
    overwritten by the same program)."""
    return _run_policy(logits, targets, advantages, weights, old, ref, rollout, config_literal, config_floats,
                       with_entropy, logits, True)


@policy_fwd_inplace.register_fake
def _(logits, targets, advantages, weights, old, ref, rollout, config_literal, config_floats, with_entropy):
    return _fake_token_outputs(logits, targets, config_literal, with_entropy)


@torch.library.custom_op("fused_rl::triton_scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, g: torch.Tensor) -> None:
    """``x *= g`` in place on the device (``g`` one element); reads nothing of ``x`` when ``g == 1``."""
    _kernels().scale_(x, g)


@scale_.register_fake
def _(x, g):
    return None


@torch.library.custom_op("fused_rl::triton_attach_grad", mutates_args=())
def attach_grad(loss_terms: torch.Tensor, logits: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    """``sum(loss_terms)``, whose gradient w.r.t. ``logits`` is ``grad_output * dlogits`` (precomputed)."""
    return loss_terms.sum()


@attach_grad.register_fake
def _(loss_terms, logits, dlogits):
    return loss_terms.new_empty(())


register_stored_grad(attach_grad, scale_, "triton")


class TritonBackend(TiledLinearMethods, Backend):
    """Triton kernels on CUDA (or on the CPU interpreter with ``TRITON_INTERPRET=1``)."""

    name = "triton"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    linear_kernel = "triton"

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        kind = torch.device(device).type
        if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"Triton kernels need a CUDA device, not {kind!r} "
                    "(set TRITON_INTERPRET=1 before the first use to run them in the slow CPU interpreter)")
        if kind == "cuda" and not torch.cuda.is_available():
            return "torch sees no CUDA device"
        error = _import_error()
        if error is None and os.environ.get("TRITON_INTERPRET") == "1":
            error = _interpreter_error()
        return error

    def token_logprobs(self, logits, targets, temperature, return_entropy, inplace=False):
        logp, entropy, _ = token_stats(logits, targets, host_floats((temperature,)), bool(return_entropy),
                                       inplace and grad_writable_in_place(logits))
        lead = targets.shape
        return logp.reshape(lead), (entropy.reshape(lead) if return_entropy else None)

    def policy_loss(self, logits: torch.Tensor, inputs: PolicyInputs, config: PolicyLossConfig,
                    compute_entropy: bool, inplace: bool = False) -> PolicyLossOutput:
        """Single pass for token-local configs (``config.has_token_epilogue``); the others (sequence
        ratios and masks, the top-entropy quantile) and fp16 logits with a gradient
        (:func:`fp16_needs_two_passes`) fall back to the composition."""
        if not config.has_token_epilogue or fp16_needs_two_passes(logits):
            return super().policy_loss(logits, inputs, config, compute_entropy, inplace)
        batch, length, _ = logits.shape
        mask = inputs.mask
        targets = torch.where(mask, inputs.targets, torch.full_like(inputs.targets, IGNORE_INDEX)).reshape(-1)
        weights = aggregation_weights(mask, config, inputs.token_normalizer).reshape(-1).contiguous()
        flat = lambda x: None if x is None else x.to(torch.float32).reshape(-1).contiguous()
        adv, old = flat(inputs.kernel_advantages), flat(inputs.old)
        ref = flat(inputs.ref) if config.kl is not None else None
        rollout = flat(inputs.rollout) if config.rollout_is is not None else None
        want_entropy = bool(compute_entropy or config.needs_entropy)
        write_grad = logits.requires_grad and torch.is_grad_enabled()
        args = (targets.contiguous(), adv, weights, old, ref, rollout, *config_args(config), want_entropy)
        x = logits.detach()
        if inplace and write_grad and writable_in_place(logits):
            logp, entropy, loss_terms, ratio, kl = policy_fwd_inplace(x, *args)
            dlogits = x
        else:
            logp, entropy, loss_terms, ratio, kl, dlogits = policy_fwd(x, *args, write_grad)
        loss = attach_grad(loss_terms, logits, dlogits) if write_grad else loss_terms.sum()
        shape = (batch, length)
        logp = logp.view(shape)
        entropy = entropy.view(shape) if want_entropy else None
        kl = kl.view(shape) if config.kl is not None else None
        extras = {}
        behaviour = logp if inputs.old is None else inputs.old
        if config.rollout_is is not None:  # the kernel's weights, recomputed O(N) for the metrics only
            extras["rollout_rho"], extras["rollout_is"] = rollout_weights(behaviour, inputs.rollout, mask, config)
        if config.policy_loss in DPPO:  # the kernel's trust-region mask, likewise
            extras["dppo_keep"] = dppo_keep(logp, behaviour, inputs.advantages, config)
        mets = loss_metrics(ratio.view(shape), inputs.advantages, mask, config, kl, entropy, extras)
        return PolicyLossOutput(loss=loss, logprobs=logp, entropy=entropy, metrics=mets)


if _INSTALLED:
    register(TritonBackend())
else:
    register_missing("triton", "the triton package is not installed (pip install 'fused_rl[gpu]')")
