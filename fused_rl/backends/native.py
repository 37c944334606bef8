"""The ``"cpu"`` and ``"cuda"`` backends: the compiled kernels of ``csrc/`` (module ``fused_rl._C``).

The extension takes raw data pointers, sizes, strides (in elements), dtype codes and, on CUDA, the
current stream; every output is allocated here with torch, so one build works with any torch
version. The kernels are wrapped as ``torch.library`` custom ops with fake implementations and
autograd formulas (the pattern of :mod:`fused_rl.backends.torch_chunked`), so ``torch.compile``
sees opaque calls.

Per row (``z = logits / tau``, ``m = max logits``, ``z - max z = (logits - m) / tau``: the raw max subtracted
before the scaling, so the max's own term is exactly 0, ``s = sum exp(z - max z)``): ``logp = (z_target - max z) -
log s``, ``H = log s - E[z - max z]``; ``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau`` with
``p = exp((z - max z) - log s)``. The saved ``lse`` is ``(2, N)``, ``m`` and ``log s`` apart (``log2 s`` on CUDA),
so ``1 - p`` of a near-certain token survives a large ``|m|``.

``policy_loss`` (token-level configs) is a single pass: the kernel evaluates the closed-form
epilogue of ``csrc/policy_epilogue.h`` per token (``g_logp = w dl/dlogp``, ``g_H = w dl/dH`` with the
aggregation weights ``w`` of :func:`fused_rl.loss_math.aggregation_weights`) and writes ``dlogits``
in the forward (over ``logits`` with ``inplace=True``); the loss value and metrics are then computed
by :func:`fused_rl.loss_math.compute_policy_loss` from the kernel's per-token log-probs. The backward
only scales the stored ``dlogits`` by the incoming gradient (in place: a second backward through the
same graph is not supported). The epilogue covers every token-local option
(``config.has_token_epilogue``: ppo_clip with dual clip / delta, sapo, cispo, reinforce, dppo, every KL
estimator with the straight-through and bias-corrected forms, token-level rollout correction, read
from the rollout log-probs in the same pass); sequence- and batch-level configs (gspo, gmpo, vespo, sequence
rollout correction, the off-policy mask, the top-entropy quantile) use the two-pass base composition.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import Optional

import torch

from ..config import IGNORE_INDEX, PolicyLossConfig
from ..loss_math import aggregation_weights, compute_policy_loss
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs, _is_compiling, check_rows_disjoint
from . import register, register_missing
from .base import Backend
from .custom_ops import (config_args, config_from_args, fp16_needs_two_passes, host_floats, host_reading_op,
                         grad_writable_in_place, register_stored_grad, register_token_ops, writable_in_place)
from .tiled_linear import TiledLinearMethods

try:
    from .. import _C  # type: ignore[attr-defined]
    LOAD_ERROR: Optional[str] = None
except ImportError as exc:  # not built, or built for another Python / platform
    import importlib.util

    _C = None
    _spec = importlib.util.find_spec("fused_rl._C")
    if _spec is None:
        LOAD_ERROR = ("the native extension fused_rl._C is not built in this installation (building it needs g++ "
                      "with OpenMP at install time: `pip install -v` shows why it failed; once g++ works, reinstall "
                      "with `--no-cache-dir --force-reinstall --no-binary fused_rl` (pip reuses a cached wheel "
                      "without it), or in a checkout run `python setup.py build_ext --inplace`)")
    else:
        LOAD_ERROR = f"the native extension {_spec.origin} failed to load: {exc}"

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INDEX_CODES = {torch.int32: 0, torch.int64: 1}
#: Codes of ``csrc/policy_epilogue.h`` (``PolicyKind``, ``KlKind``, ``RolloutKind``).
POLICY_CODES = {"ppo_clip": 0, "gspo": 1, "cispo": 2, "reinforce": 3, "sapo": 4, "dppo_tv": 5, "dppo_kl": 6}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "abs": 4, "low_var_kl": 5}
ROLLOUT_CODES = {None: 0, "token_truncate": 1, "token_mask": 2}

#: Threads of the CPU kernels; ``None`` follows ``torch.get_num_threads()``.
_NUM_THREADS: Optional[int] = None


#: The most threads :func:`set_num_threads` takes (OpenMP aborted the process allocating 2^31 - 1 of them).
MAX_THREADS = 1 << 16


def set_num_threads(n: Optional[int]) -> None:
    """Thread count of the CPU kernels, an integer in ``[1, MAX_THREADS]`` (``None``: ``torch.get_num_threads()``).
    Results do not depend on it."""
    global _NUM_THREADS
    if (isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point() and n.dtype != torch.bool
            and not n.is_meta):
        n = n.item()
    if n is not None and not (isinstance(n, numbers.Integral) and not isinstance(n, bool) and 1 <= n <= MAX_THREADS):
        raise ValueError(f"set_num_threads takes None or an integer in [1, {MAX_THREADS}], got {n!r}")
    _NUM_THREADS = None if n is None else int(n)


def _threads() -> int:
    return _NUM_THREADS if _NUM_THREADS is not None else torch.get_num_threads()


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int]:
    """``(x, B, T, V, stride_b, stride_t)`` describing the rows of ``(..., V)`` logits without a copy
    when possible."""
    vocab = logits.shape[-1]
    if logits.dim() == 2:
        return logits, 1, logits.shape[0], vocab, 0, logits.stride(0)
    if logits.dim() > 3:
        try:
            logits = logits.view(-1, logits.shape[-2], vocab)
        except RuntimeError:
            logits = logits.reshape(-1, logits.shape[-2], vocab)
    b, t = logits.shape[0], logits.shape[1]
    return logits, b, t, vocab, logits.stride(0), logits.stride(1)


def _ptr(x: Optional[torch.Tensor]) -> int:
    return 0 if x is None else x.data_ptr()


def _stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream


#: With ``FUSED_RL_HUGEPAGES=1``, CPU output buffers at least this large are advised to use
#: transparent huge pages before first touch. First-touch page faults of a fresh dlogits buffer can
#: cost as much as the kernel; huge pages remove most of that, but where the kernel compacts memory
#: on demand (THP defrag=madvise) some calls stall instead, so it is opt-in (see docs/native.md).
HUGEPAGE_MIN_BYTES = 1 << 25
USE_HUGEPAGES = os.environ.get("FUSED_RL_HUGEPAGES", "0") == "1"


def _new_output(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized output buffer (optionally with transparent huge pages, see USE_HUGEPAGES)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    nbytes = out.numel() * out.element_size()
    if USE_HUGEPAGES and out.device.type == "cpu" and nbytes >= HUGEPAGE_MIN_BYTES:
        _C.advise_hugepages(out.data_ptr(), nbytes)
    return out


def _f32(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x`` as contiguous fp32 (at any byte address: the kernels read the user's per-token inputs by memcpy)."""
    return None if x is None else x.detach().to(torch.float32).contiguous()


# ---------------------------------------------------------------- token_logprobs: stats + grad ops
@host_reading_op("fused_rl::native_token_stats", mutates_args=())
def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                with_entropy: bool, grad_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat fp32 ``(logp, entropy, lse)`` of length ``N``; ``entropy`` empty unless ``with_entropy``;
    ``temperature`` a ``custom_ops.host_floats`` of one value; ``grad_in_place``: the backward runs
    :func:`token_grad_inplace`."""
    x, b, t, v, sb, st = _rows(logits)
    n = targets.numel()
    tg = targets.reshape(-1).contiguous()
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
    args = (x.data_ptr(), _DTYPE_CODES[x.dtype], b, t, v, sb, st, tg.data_ptr(), _INDEX_CODES[tg.dtype],
            1.0 / float(temperature), logp.data_ptr(), entropy.data_ptr() if with_entropy else 0, lse.data_ptr())
    if logits.is_cuda:
        with torch.cuda.device(logits.device):
            _C.cuda_token_stats(*args, _stream(logits))
    else:
        _C.cpu_token_stats(*args, _threads())
    return logp, entropy, lse


@token_stats.register_fake
def _(logits, targets, temperature, with_entropy, grad_in_place=False):
    n = targets.numel()
    f = torch.float32
    return (logits.new_empty(n, dtype=f), logits.new_empty(n if with_entropy else 0, dtype=f),
            logits.new_empty((2, n), dtype=f))


@host_reading_op("fused_rl::native_token_grad", mutates_args=())
def token_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
               entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
               temperature: torch.Tensor) -> torch.Tensor:
    """``dlogits = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau``, contiguous, in the logits dtype."""
    out = _new_output(logits.shape, logits)
    _, _, t, v, _, _ = _rows(logits)
    token_grad_into(logits, out, targets, lse, g_logp, entropy, g_entropy, float(temperature), t * v, v)
    return out


@host_reading_op("fused_rl::native_token_grad_inplace", mutates_args=("logits",))
def token_grad_inplace(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g_logp: torch.Tensor,
                       entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
                       temperature: torch.Tensor) -> None:
    """:func:`token_grad` written over ``logits`` (rows viewed as ``_rows`` views them: no copy, see
    ``custom_ops.grad_writable_in_place``)."""
    x, _, _, _, sb, st = _rows(logits)
    token_grad_into(logits, x, targets, lse, g_logp, entropy, g_entropy, float(temperature), sb, st)


def token_grad_into(logits: torch.Tensor, out: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    g_logp: torch.Tensor, entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
                    temperature: float, out_sb: int, out_st: int) -> None:
    """:func:`token_grad` written into ``out`` (the logits dtype, row strides ``out_sb`` / ``out_st``; may be
    ``logits`` itself: each row is read before its gradient is written over it, as the in-place policy op)."""
    x, b, t, v, sb, st = _rows(logits)
    tg = targets.reshape(-1).contiguous()
    gl = _f32(g_logp)
    with_ent = entropy is not None and g_entropy is not None
    ent = _f32(entropy) if with_ent else None
    ge = _f32(g_entropy) if with_ent else None
    args = (x.data_ptr(), _DTYPE_CODES[x.dtype], b, t, v, sb, st, tg.data_ptr(), _INDEX_CODES[tg.dtype],
            1.0 / temperature, lse.data_ptr(), gl.data_ptr(), _ptr(ent), _ptr(ge), out.data_ptr(), out_sb, out_st)
    if logits.is_cuda:
        with torch.cuda.device(logits.device):
            _C.cuda_token_grad(*args, _stream(logits))
    else:
        _C.cpu_token_grad(*args, _threads())


register_token_ops(token_stats, token_grad, token_grad_inplace)


# ---------------------------------------------------------------- single-pass policy loss
@functools.lru_cache(maxsize=64)
def epilogue_params(config: PolicyLossConfig):
    """The ``_C.EpilogueParams`` of a config with a token epilogue (``config.has_token_epilogue``);
    ``has_old`` is set by the kernel call from the ``old`` pointer."""
    if not config.has_token_epilogue:
        raise ValueError(f"no token epilogue for this config (sequence- or batch-level options): {config}")
    p = _C.EpilogueParams()
    p.policy = POLICY_CODES[config.policy_loss]
    kl = config.kl or ""
    p.kl, p.kl_straight = KL_CODES[kl.rstrip("+") or None], int(kl.endswith("+"))
    p.kl_bias = int(config.kl_bias_correction)
    p.has_kl_clamp, p.kl_clamp = int(config.kl_clamp is not None), config.kl_clamp or 0.0
    p.has_kl_is, p.kl_is_clip = int(config.kl_is_clip is not None), config.kl_is_clip or 0.0
    p.has_dual, p.has_delta = int(config.dual_clip is not None), int(config.delta is not None)
    p.rollout = ROLLOUT_CODES[config.rollout_is]
    p.clip_low, p.clip_high = config.clip_low, config.clip_high
    p.dual_clip, p.delta = config.dual_clip or 0.0, config.delta or 0.0
    p.sapo_pos, p.sapo_neg = config.sapo_temperature_pos, config.sapo_temperature_neg
    p.beta, p.entropy_coef = config.beta, config.entropy_coef
    p.rollout_min = -math.inf if config.rollout_is_min is None else config.rollout_is_min
    p.rollout_max = math.inf if config.rollout_is_max is None else config.rollout_is_max
    return p


def _policy_args(xr, targets, adv, old, ref, rollout, w, config, logp, ent, out, osb, ost):
    """The kernel's arguments; ``xr`` is ``_rows(logits)[0]`` held by the caller until the kernel returns (above
    3-D it may be a reshape copy: only its pointer goes into the tuple)."""
    _, b, t, v, sb, st = _rows(xr)
    return (xr.data_ptr(), _DTYPE_CODES[xr.dtype], b, t, v, sb, st, targets.data_ptr(), _INDEX_CODES[targets.dtype],
            1.0 / config.temperature, adv.data_ptr(), _ptr(old), _ptr(ref), _ptr(rollout), w.data_ptr(),
            epilogue_params(config), logp.data_ptr(), ent.data_ptr(), out.data_ptr(), osb, ost,
            _DTYPE_CODES[out.dtype])


def _run_policy(logits, out, osb, ost, targets, adv, old, ref, rollout, w, config_literal, config_floats):
    """The single pass over ``logits``, dlogits written to ``out`` (row strides ``osb``, ``ost``); the fp32
    per-token ``(logp, entropy)``."""
    config = config_from_args(config_literal, config_floats)
    n = targets.numel()
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    ent = torch.empty(n, dtype=torch.float32, device=logits.device)
    x = _rows(logits)[0]  # kept alive through the call (a copy when a > 3-D input cannot be viewed as rows)
    args = _policy_args(x, targets, adv, old, ref, rollout, w, config, logp, ent, out, osb, ost)
    if logits.is_cuda:
        with torch.cuda.device(logits.device):
            _C.cuda_policy_fused(*args, _stream(logits))
    else:
        _C.cpu_policy_fused(*args, _threads())
    return logp, ent


def _check_3d(logits: torch.Tensor) -> None:
    """The in-place / into ops take the output's row strides from its dims 0 and 1: ``(B, T, V)`` only (a 2-D
    input, which :func:`_rows` reads as ``(1, N, V)``, had its rows written one element apart)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")


def _fake_stats(logits, targets):
    n = targets.numel()
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@host_reading_op("fused_rl::native_policy_fwd", mutates_args=())
def policy_fwd(logits: torch.Tensor, targets: torch.Tensor, adv: torch.Tensor, old: Optional[torch.Tensor],
               ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor], w: torch.Tensor,
               config_literal: str, config_floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token fp32 ``(logp, entropy)`` (flat) and ``dlogits`` of ``sum_t w_t l_t`` (contiguous,
    logits dtype) for the config of ``(config_literal, config_floats) = custom_ops.config_args(config)``. ``targets``
    must be ``IGNORE_INDEX`` wherever the mask is off; per-token tensors are contiguous fp32 of ``B*T`` elements."""
    out = _new_output(logits.shape, logits)
    _, _, t, v, _, _ = _rows(logits)  # the row layout the kernel reads: (1, N, V) for 2-D, (-1, T, V) above 3-D
    logp, ent = _run_policy(logits, out, t * v, v, targets, adv, old, ref, rollout, w, config_literal, config_floats)
    return logp, ent, out


@policy_fwd.register_fake
def _(logits, targets, adv, old, ref, rollout, w, config_literal, config_floats):
    return (*_fake_stats(logits, targets), torch.empty(logits.shape, dtype=logits.dtype, device=logits.device))


@host_reading_op("fused_rl::native_policy_fwd_inplace", mutates_args=("logits",))
def policy_fwd_inplace(logits: torch.Tensor, targets: torch.Tensor, adv: torch.Tensor, old: Optional[torch.Tensor],
                       ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor], w: torch.Tensor,
                       config_literal: str, config_floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`policy_fwd`, writing ``dlogits`` over ``logits`` (same strides)."""
    _check_3d(logits)
    return _run_policy(logits, logits, logits.stride(0), logits.stride(1), targets, adv, old, ref, rollout, w,
                       config_literal, config_floats)


@policy_fwd_inplace.register_fake
def _(logits, targets, adv, old, ref, rollout, w, config_literal, config_floats):
    return _fake_stats(logits, targets)


@host_reading_op("fused_rl::native_policy_fwd_into", mutates_args=("out",))
def policy_fwd_into(logits: torch.Tensor, out: torch.Tensor, targets: torch.Tensor, adv: torch.Tensor,
                    old: Optional[torch.Tensor], ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor],
                    w: torch.Tensor, config_literal: str, config_floats: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`policy_fwd`, writing ``dlogits`` into ``out`` (the logits' shape, unit vocabulary stride,
    not overlapping them): in the logits dtype, or bf16 / fp16 for fp32 logits, rounded once on store (the
    tiled fused linear's mixed mode: no fp32 gradient tile and no copy of it)."""
    _check_3d(logits)
    if out.device != logits.device:
        raise ValueError(f"out must be on the logits' device {logits.device}, got {out.device}")
    if out.shape != logits.shape or out.stride(-1) != 1:
        raise ValueError(f"out must have the logits' shape {tuple(logits.shape)} and unit last stride, got "
                         f"{tuple(out.shape)} / {out.stride()}")
    check_rows_disjoint(out, "out")  # rows written by concurrent blocks must not share memory (an expand())
    allowed = (logits.dtype,) + ((torch.bfloat16, torch.float16) if logits.dtype == torch.float32 else ())
    if out.dtype not in allowed:
        raise ValueError(f"out must be {logits.dtype} (or bf16 / fp16 for fp32 logits), got {out.dtype}")
    if out.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
        raise ValueError("out shares the logits' storage: use policy_fwd_inplace")
    return _run_policy(logits, out, out.stride(0), out.stride(1), targets, adv, old, ref, rollout, w, config_literal,
                       config_floats)


@policy_fwd_into.register_fake
def _(logits, out, targets, adv, old, ref, rollout, w, config_literal, config_floats):
    return _fake_stats(logits, targets)


@torch.library.custom_op("fused_rl::native_scale_grad_", mutates_args=("grad",))
def scale_grad_(grad: torch.Tensor, g: torch.Tensor) -> None:
    """``grad *= g`` in place, skipped when ``g == 1`` (the usual ``loss.backward()``): on CUDA the kernel
    reads ``g`` on the device (no host sync) and returns at once when it is 1; on CPU ``float(g)``."""
    if grad.is_cuda:
        # the (B, T, V) buffer the forward wrote (unit vocabulary stride, validated): _rows takes no copy
        x, b, t, v, sb, st = _rows(grad)
        g32 = g.detach().reshape(()).to(torch.float32)
        with torch.cuda.device(grad.device):
            _C.cuda_scale_(x.data_ptr(), _DTYPE_CODES[x.dtype], b, t, v, sb, st, g32.data_ptr(), _stream(grad))
    elif float(g) != 1.0:
        grad.mul_(g.detach().reshape(()).to(torch.float32))  # in fp32, one rounding (as the GPU kernels)


@scale_grad_.register_fake
def _(grad, g):
    return None


@torch.library.custom_op("fused_rl::native_attach_grad", mutates_args=())
def attach_grad(loss: torch.Tensor, logits: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    """Returns ``loss``; its gradient w.r.t. ``logits`` is the precomputed ``dlogits`` (times the
    incoming gradient)."""
    return loss.clone()


@attach_grad.register_fake
def _(loss, logits, dlogits):
    return torch.empty_like(loss)


register_stored_grad(attach_grad, scale_grad_, "cpu/cuda")


class NativeBackend(TiledLinearMethods, Backend):
    """Shared body of the ``cpu`` and ``cuda`` backends (the device decides which kernels run)."""

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    linear_kernel = "native"

    def token_logprobs(self, logits, targets, temperature, return_entropy, inplace=False):
        logp, entropy, _ = token_stats(logits, targets, host_floats((temperature,)), bool(return_entropy),
                                       inplace and grad_writable_in_place(logits))
        lead = targets.shape
        return logp.reshape(lead), (entropy.reshape(lead) if return_entropy else None)

    def policy_loss(self, logits: torch.Tensor, inputs: PolicyInputs, config: PolicyLossConfig,
                    compute_entropy: bool, inplace: bool = False) -> PolicyLossOutput:
        if not config.has_token_epilogue or not (torch.is_grad_enabled() and logits.requires_grad) \
                or fp16_needs_two_passes(logits):
            return super().policy_loss(logits, inputs, config, compute_entropy, inplace)
        batch, length, _ = logits.shape
        mask = inputs.mask
        targets = torch.where(mask, inputs.targets, torch.full_like(inputs.targets, IGNORE_INDEX)).contiguous()
        w = aggregation_weights(mask, config, inputs.token_normalizer).to(torch.float32).contiguous()
        adv = _f32(inputs.kernel_advantages)
        old = _f32(inputs.old)
        ref = _f32(inputs.ref) if config.kl is not None else None
        rollout = _f32(inputs.rollout) if config.rollout_is is not None else None
        args = (targets, adv, old, ref, rollout, w, *config_args(config))
        x = logits.detach()
        if inplace and writable_in_place(logits) and not _is_compiling():
            logp, ent = policy_fwd_inplace(x, *args)
            dlogits = x
        else:
            logp, ent, dlogits = policy_fwd(x, *args)
        logp = logp.view(batch, length)
        want_entropy = compute_entropy or config.needs_entropy
        entropy = ent.view(batch, length) if want_entropy else None
        value, metrics = compute_policy_loss(logp, inputs.advantages, mask, config, old_logprobs=inputs.old,
                                             ref_logprobs=inputs.ref, entropy=entropy, rollout_logprobs=inputs.rollout,
                                             rollout_is_weights=inputs.is_weights,
                                             token_normalizer=inputs.token_normalizer)
        loss = attach_grad(value, logits, dlogits)
        return PolicyLossOutput(loss=loss, logprobs=logp, entropy=entropy, metrics=metrics)


class CpuBackend(NativeBackend):
    """C++ kernels on CPU tensors (OpenMP over rows, AVX2 when the CPU has it)."""

    name = "cpu"

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cpu":
            return f"the 'cpu' backend runs on CPU tensors only, not {device.type}"
        return None


@torch.compiler.assume_constant_result
def _cuda_device_count() -> int:
    """The CUDA devices the kernels of ``_C`` see: a pybind call that ``torch.compile`` cannot trace, so it is
    run at trace time and its result taken as a constant (``get_backend`` runs inside compiled steps)."""
    return _C.cuda_device_count()


class CudaBackend(NativeBackend):
    """Hand-written CUDA kernels (one block per row) on CUDA tensors."""

    name = "cuda"

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return f"the 'cuda' backend runs on CUDA tensors only, not {device.type}"
        if _cuda_device_count() <= 0:
            return "the CUDA kernels of fused_rl._C see no CUDA device (driver missing or too old?)"
        return None


if _C is None:
    register_missing("cpu", LOAD_ERROR)
    register_missing("cuda", LOAD_ERROR)
else:
    register(CpuBackend())
    if getattr(_C, "has_cuda", False):
        register(CudaBackend())
    else:
        register_missing("cuda", "fused_rl._C was built without its CUDA kernels (nvcc was not found at build "
                                 "time, or FUSED_RL_CUDA=0); reinstall with nvcc on PATH or FUSED_RL_CUDA=1")
