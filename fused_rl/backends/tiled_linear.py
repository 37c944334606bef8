"""Tiled fused linear policy loss: chunked BLAS matmuls feeding a backend's single-pass logits kernel
(the quack / Liger route of issue 4's deliverable 3). Used by the ``cpu`` / ``cuda`` (C++ kernels of
``fused_rl._C``) and ``triton`` backends; no ``(N, V)`` tensor ever exists.

Per tile of ``n`` tokens, into one reused ``(n, V)`` fp32 workspace ``z``::

    z = h W^T (+ b)                          torch.mm / addmm (MKL / cuBLAS)
    kernel(z) in place                       one read + one write of the tile: logp, H, the token
                                             epilogue with the batch's aggregation weights w_t, and
                                             z <- dz = d(sum_t w_t l_t) / dz
    grad_h[tile] = dz W,  grad_W += dz^T h (fp32 accumulator),  grad_b += sum_rows dz

The kernels are the ones behind ``policy_loss`` (``kernels/logits.py::policy_fused``,
``csrc/policy_epilogue.h``), so the math has no new copy. The loss is token-local for the configs
they cover (:func:`runs_tiled`: ``config.has_token_epilogue``, token-level rollout correction included, the
kernels reading the rollout log-probs; and a sequence-level rollout correction off-policy, whose weights
depend on the old and rollout log-probs alone and fold into the advantages), so each
tile's gradient is exact as soon as its logits exist: one pass, three GEMMs in all, gradients
computed in the forward, and the backward only scales them by ``grad_output``. ``linear_token_logprobs`` and
the other configs take two passes (:func:`tiled_linear_token_stats_op`: the statistics kernel per tile, the
backward recomputing each tile for the gradient kernel; the loss math on ``(B, T)`` vectors between them): the
batch-level quantile everywhere, the sequence-level variants on CUDA; on the CPU those keep
:mod:`fused_rl.backends.torch_linear`'s one pass (:func:`_sequences_in_two_passes`).

Tiles, masked tokens, the gradient buffers (no weight-gradient buffer for a frozen weight; the
first tile writes it, no zero fill) and the fp32 upcast of 16-bit inputs are torch_linear's
(:func:`torch_linear._groups`, ``_tile_inputs``, ``_Grads``, ``_prepare``): on CPU only valid rows
are gathered; elsewhere tiles are fixed slices whose masked rows get target ``IGNORE_INDEX`` (zero
gradient rows) and zeroed hidden rows (NaN padding cannot reach ``grad_W``).

GEMM precision (``GEMM_MODE``): ``"fp32"`` (16-bit inputs upcast, one fp32 copy of ``W``; the
default on CPU, which has no fast 16-bit GEMM here, and for fp16) or ``"mixed"`` (the default for bf16
inputs on CUDA; opt-in for fp16, with the limits below): the GEMMs read the 16-bit ``h`` / ``W`` / ``dz`` with fp32
accumulation and write fp32
logits and fp32 gradients (``torch.mm(..., out_dtype=torch.float32)``, CUDA only; on CPU the mode is
emulated by upcasting, for the tests). The kernel reads fp32 logits either way (rounding the logits to
bf16 would cost up to ``|z| 2^-8`` of log-prob accuracy); in mixed mode it writes ``dz`` in the input dtype
into a second ``(n, V)`` buffer (both kernels round on store), the one rounding the GEMMs of the
backward would do anyway. ``dz ~ w_t p`` (``1/N`` times ``1/V``, ~1e-9 at N = 8192, V = 128256) is below
fp16's subnormals, so the kernel gets the weights in units of ``u = max_t w_t`` and writes ``dz / u``;
the backward multiplies the gradients by ``u grad_output``. Why fp16 is not mixed by default: (1) a token
whose ``|w_t / u * dl/dlogp|`` exceeds fp16's 65504 (``|A| r`` past it, a k3 KL term ``beta (1 - e^d)``
at a 14-nat gap to the reference with ``beta = 0.1``, or ``|A|`` times a rollout correction's weight, up to
``e^20`` without ``rollout_is_max``) gets inf / NaN gradients, before any loss scale, so
GradScaler skips every such batch and cannot recover by lowering its scale; (2) with per-sequence weights
(``seq-mean-token-mean``) a sequence k times longer than the shortest writes ``dz / u`` k times smaller, deeper
in fp16's subnormals (a 1 : 4096 length mix: 5.6e-3 relative error of the long row's hidden gradient,
against 2e-4 in fp32 mode). bf16 has fp32's range, so neither applies to it.

All gradients (fp32) stay in the op's outputs until the backward rounds ``grad * u * grad_output`` once
to the parameters' dtypes (``torch_linear.scale_grads``).

The operation is one ``torch.library`` custom op with a fake implementation and registered
autograd, so ``torch.compile(fullgraph=True)`` sees one opaque call.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import IGNORE_INDEX, PolicyLossConfig
from ..loss_math import aggregation_weights, metrics, per_token_loss, rollout_weights
from ..outputs import PolicyLossOutput
from ..validation import PolicyInputs
from . import torch_linear
from .custom_ops import autocast_free_op, config_args, config_from_args, host_floats, refuse_double_backward
from .torch_linear import _Grads, _needs_grad, _prepare, _tile_inputs, _token_groups

#: Force the tile size in tokens (``None``: derive it from the memory budget, see :func:`chunk_tokens`).
CHUNK_TOKENS: Optional[int] = None
#: ``"fp32"`` or ``"mixed"`` (see the module doc; mixed applies to bf16 and fp16 only); ``None``: mixed for
#: bf16 inputs on CUDA, else fp32.
GEMM_MODE: Optional[str] = None


_HALF = (torch.bfloat16, torch.float16)


def _mode(device: torch.device, dtype: torch.dtype) -> str:
    if GEMM_MODE is not None:
        if GEMM_MODE not in ("fp32", "mixed"):
            raise ValueError(f"tiled_linear.GEMM_MODE must be 'fp32', 'mixed' or None, got {GEMM_MODE!r}")
        return GEMM_MODE if dtype in _HALF else "fp32"
    return "mixed" if device.type == "cuda" and dtype == torch.bfloat16 else "fp32"


def chunk_tokens(num_tokens: int, vocab: int, dtype: torch.dtype, device: torch.device,
                 memory_budget_bytes: Optional[int] = None, mixed: bool = False) -> int:
    """Tokens per tile: ``CHUNK_TOKENS`` (this module's, then torch_linear's) if set, else
    ``budget // (V * bytes per token)``: one fp32 ``(n, V)`` workspace (4 bytes per element), plus a
    16-bit copy of the gradient in mixed mode (6). The budget is ``memory_budget_bytes`` (the public
    argument), else :func:`torch_linear.default_budget` (128 MiB on CPU: 1048 tokens at V = 32000; 1 GiB on
    CUDA, ``torch_linear.CUDA_DEFAULT_MEMORY_BUDGET_BYTES``). Clamped to ``[1, num_tokens]``."""
    forced = CHUNK_TOKENS if CHUNK_TOKENS is not None else torch_linear.CHUNK_TOKENS
    if forced is not None:
        n = int(forced)
    else:
        budget = memory_budget_bytes or torch_linear.default_budget(device)
        n = int(budget) // (vocab * (6 if mixed else 4))
    return max(1, min(n, max(num_tokens, 1)))


# ------------------------------------------------------------------------------------ the kernels
def runs_tiled(config: PolicyLossConfig, off_policy: bool = True) -> bool:
    """Whether ``config`` takes the tiled single-pass route: a token epilogue (token-level rollout correction
    included: the kernels read the rollout log-probs), or, ``off_policy`` (old log-probs given), a sequence-level
    rollout correction around one (its weights, from the old and rollout log-probs alone, fold into the
    advantages: :func:`_fold_sequence_rollout`). On-policy, a sequence's weight needs its current log-probs."""
    if config.has_token_epilogue:
        return True
    return off_policy and config.rollout_is is not None and config.has_token_local_policy


def _sequences_in_two_passes(device: torch.device) -> bool:
    """Whether a sequence-level config (one the single pass cannot run) takes the two tiled passes (statistics,
    then the loss math on ``(B, T)`` vectors and a gradient pass recomputing the tiles: four GEMMs) rather than
    torch_linear's one pass over whole-sequence tiles (three GEMMs and about six torch passes over each tile). On
    CUDA the torch passes cost far more than a GEMM (torch_linear took 991-1015 ms against the single pass's
    41-44 ms on the H200 shape); on the CPU the GEMMs dominate and the extra one costs more (gspo, B=8 T=512
    H=512 V=32000 fp32: 3024 ms in two passes against 2511 ms, ``bench/bench_linear.py --preset gspo``). A
    batch-level config (the entropy quantile) and ``linear_token_logprobs`` take two passes anyway, the tiled ones
    on every device (CPU: 3107 ms against torch_linear's 4721 ms, ``bench_linear.py --op token_logprobs``)."""
    return device.type == "cuda"


def _fold_sequence_rollout(config: PolicyLossConfig, inputs: PolicyInputs) -> tuple[tuple[str, torch.Tensor],
                                                                                    torch.Tensor]:
    """The kernel config and advantages of a sequence-level rollout correction off-policy: ``w`` of
    :func:`loss_math.rollout_weights` (``rho = exp(clamp(sum_t m (old - rollout), -20, 20))`` truncated or masked,
    detached, a function of the old and rollout log-probs only) multiplies the policy term alone, which is positively
    homogeneous in ``A`` (``PolicyInputs.kernel_advantages``): the kernel runs the config without the correction
    on ``A w``."""
    w = rollout_weights(inputs.old, inputs.rollout, inputs.mask, config)[1]
    return config_args(config, config.literal_without_rollout), inputs.kernel_advantages * w


def _native_kernel(z, targets, adv, w, old, ref, rollout, config: PolicyLossConfig, want_ent: bool,
                   write_grad: bool, out: Optional[torch.Tensor] = None):
    """C++ (CPU / CUDA) single pass over the ``(n, V)`` tile; dlogits written over it, or straight into
    ``out`` if given (e.g. a 16-bit buffer: the kernel rounds on store); ``(logp, H)``. Without ``write_grad``
    the statistics pass alone (one read of the tile, no write)."""
    from . import native

    if not write_grad:
        logp, ent, _ = native.token_stats(z.unsqueeze(0), targets, host_floats((config.temperature,)), want_ent)
        return logp, ent
    # (1, n, V) views: the ops take their output row strides from dims 0 and 1
    args = (targets, adv, old, ref, rollout, w, *config_args(config))
    if out is not None:
        return native.policy_fwd_into(z.unsqueeze(0), out.unsqueeze(0), *args)
    return native.policy_fwd_inplace(z.unsqueeze(0), *args)


def _triton_kernel(z, targets, adv, w, old, ref, rollout, config: PolicyLossConfig, want_ent: bool,
                   write_grad: bool, out: Optional[torch.Tensor] = None):
    """Triton single pass over the ``(n, V)`` tile; with ``write_grad`` dlogits go over it, or straight
    into ``out`` (e.g. a 16-bit buffer: the kernel rounds on store); ``(logp, H)``."""
    from ..kernels.epilogue import epilogue_args
    from . import triton as tb

    x = z.unsqueeze(0)
    o = x if out is None else out.unsqueeze(0)
    logp, ent, _, _, _ = tb._kernels().policy_fused(x, targets, adv, w, old, ref, o, float(config.temperature),
                                                     epilogue_args(config, on_policy=old is None), want_ent,
                                                     write_grad, rollout=rollout)
    return logp, ent


KERNELS = {"native": _native_kernel, "triton": _triton_kernel}


# ------------------------------------------------------------------------------------ GEMMs
def _mm_out_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b``: 16-bit operands read as they are, fp32 accumulation and output (cuBLAS)."""
    if accumulate:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def _native_mixed_gemms(device: torch.device) -> bool:
    """Whether ``device`` runs :func:`_mm_out_f32` natively (cuBLAS); the tiled route's device decisions are
    each a function of the device (``bench/linear_memory_model.py`` models CUDA through them)."""
    return device.type == "cuda"


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` into the fp32 ``out`` with 16-bit ``a``, ``b`` (mixed mode): :func:`_mm_out_f32`
    on CUDA; upcast emulation elsewhere (tests only)."""
    if _native_mixed_gemms(a.device):
        _mm_out_f32(a, b, out, accumulate)
        return
    a, b = a.float(), b.float()
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _operands(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mixed: bool):
    """``(hidden (N, H), weight, bias, dtype of the GEMM operands)``: 16-bit as given in mixed mode (fp32 bias),
    else the fp32 upcast of :func:`torch_linear._prepare`."""
    if mixed:
        return (hidden.reshape(-1, hidden.shape[-1]), weight.contiguous(),
                None if bias is None else bias.to(torch.float32), hidden.dtype)
    _, hidden_flat, weight_c, bias_c = _prepare(hidden, weight, bias)
    return hidden_flat, weight_c, bias_c, torch.float32


def _tile_logits(h: torch.Tensor, weight_c: torch.Tensor, bias_c: Optional[torch.Tensor], z: torch.Tensor,
                 mixed: bool) -> None:
    """``z = h W^T (+ b)`` into the fp32 tile ``z``."""
    if mixed:
        _mm_f32(h, weight_c.t(), z, accumulate=False)
        if bias_c is not None:
            z.add_(bias_c)
    elif bias_c is None:
        torch.mm(h, weight_c.t(), out=z)
    else:
        torch.addmm(bias_c, h, weight_c.t(), out=z)


def _tile_take(tile, ok):
    """The per-token vectors' rows of ``tile``: gathered (CPU) or the contiguous slice (fixed tiles)."""
    if ok is None:
        return lambda x: None if x is None else x.index_select(0, tile.idx)
    s, e = tile.contiguous
    return lambda x: None if x is None else x[s:e]


class _MixedGrads(_Grads):
    """:class:`torch_linear._Grads` with 16-bit GEMM operands: the 16-bit ``dz``, fp32 accumulation in
    the GEMMs (fp32 output) and in the bias sum."""

    def add_mixed(self, tile, dz16, h, weight, ok):
        if self.h is not None:
            gh = torch.empty(dz16.shape[0], weight.shape[1], dtype=torch.float32, device=dz16.device)
            _mm_f32(dz16, weight, gh, accumulate=False)
            self.put_h(tile, gh, ok)
        if self.w is not None:
            _mm_f32(dz16.t(), h, self.w, self.w_written)
            self.w_written = True
        if self.b is not None:
            self.b.add_(dz16.sum(dim=0, dtype=torch.float32))


# ------------------------------------------------------------------------------------ the op
@autocast_free_op("fused_rl::tiled_linear_policy_loss")
def tiled_linear_policy_loss_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    advantages: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, old: Optional[torch.Tensor],
    ref: Optional[torch.Tensor], rollout: Optional[torch.Tensor], config_literal: str, config_floats: torch.Tensor,
    with_entropy: bool, need_h: bool, need_w: bool, need_b: bool, n_tile: int, kernel: str, mixed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, logp (B,T), entropy (B,T) or empty, grad_hidden, grad_weight, grad_bias, unit)`` (fp32;
    gradients empty unless their ``need_*`` flag is set, in units of the 0-dim ``unit``: the backward
    multiplies them by ``unit * grad_output``) of a token-level config; ``weights`` are the aggregation
    weights, ``kernel`` a key of :data:`KERNELS`, ``with_entropy`` set when ``config.needs_entropy``. In mixed
    mode ``unit = max_t w_t`` and the kernel gets ``w_t / unit``, so the 16-bit ``dz`` it writes is
    ``O(dl/dlogp p)`` whatever the token count: inside fp16's normal range where ``dz`` itself (``w_t p``, ~1e-9
    at N = 8192, V = 128256) would flush to 0."""
    config = config_from_args(config_literal, config_floats)
    batch, length, _ = hidden.shape
    vocab = weight.shape[0]
    f32 = torch.float32
    hidden_flat, weight_c, bias_c, hdtype = _operands(hidden, weight, bias, mixed)
    run_kernel = KERNELS[kernel]
    if config.needs_entropy and not with_entropy:  # the fake implementation's entropy shape is with_entropy's
        raise ValueError("with_entropy must be set for a config that reads the entropy")
    need_grad = need_h or need_w or need_b
    dev = hidden.device
    targets_flat, valid_flat = targets.reshape(-1), valid.reshape(-1)
    vec = lambda x: None if x is None else x.reshape(-1).to(f32)
    adv_flat, w_flat, old_flat = vec(advantages), vec(weights), vec(old)
    unit = torch.ones((), dtype=f32, device=hidden.device)
    if mixed:
        w_max = w_flat.abs().amax() if w_flat.numel() else unit
        unit = torch.where(w_max > 0, w_max, unit)
        w_flat = w_flat / unit
    ref_flat = vec(ref) if config.kl is not None else None
    rollout_flat = vec(rollout) if config.rollout_is is not None else None
    logp = torch.zeros(batch * length, dtype=f32, device=dev)
    entropy = torch.zeros(batch * length if with_entropy else 0, dtype=f32, device=dev)
    grads = (_MixedGrads if mixed else _Grads)(hidden, weight, need_h, need_w, need_b, f32)
    rows = min(n_tile, batch * length)
    ws = torch.empty(rows * vocab, dtype=f32, device=dev)
    ws16 = torch.empty(rows * vocab if mixed and need_grad else 0, dtype=hidden.dtype, device=dev)
    for tile in _token_groups(valid, n_tile):
        h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, hdtype)
        n = h.shape[0]
        take = _tile_take(tile, ok)
        if ok is not None:
            t = torch.where(ok, t, torch.full_like(t, IGNORE_INDEX))
        z = ws[:n * vocab].view(n, vocab)
        _tile_logits(h, weight_c, bias_c, z, mixed)
        dz16 = ws16[:n * vocab].view(n, vocab) if ws16.numel() else None
        lp, ent = run_kernel(z, t.contiguous(), take(adv_flat).contiguous(), take(w_flat).contiguous(),
                             None if old_flat is None else take(old_flat).contiguous(),
                             None if ref_flat is None else take(ref_flat).contiguous(),
                             None if rollout_flat is None else take(rollout_flat).contiguous(), config, with_entropy,
                             need_grad, out=dz16)
        logp[tile.idx] = lp
        if with_entropy:
            entropy[tile.idx] = ent
        if not need_grad:
            continue
        if mixed:
            grads.add_mixed(tile, dz16, h, weight_c, ok)
        else:
            grads.add(tile, z.t(), h, weight_c, ok)  # _Grads takes the transposed (V, n) gradient
    del ws, ws16
    shape = (batch, length)
    ent_bt = entropy.view(shape) if with_entropy else None
    loss_t = per_token_loss(logp.view(shape), advantages, valid, config, old_logprobs=old, ref_logprobs=ref,
                            entropy=ent_bt, rollout_logprobs=rollout).loss
    loss = (loss_t * weights).sum().to(f32)
    gh, gw, gb = grads.results(hidden, weight, cast=False)
    return loss, logp.view(shape), entropy.view(shape) if with_entropy else entropy, gh, gw, gb, unit


@tiled_linear_policy_loss_op.register_fake
def _(hidden, weight, bias, targets, advantages, valid, weights, old, ref, rollout, config_literal, config_floats,
      with_entropy, need_h, need_w, need_b, n_tile, kernel, mixed):
    return (*torch_linear.fake_loss_outputs(hidden, weight, with_entropy, need_h, need_w, need_b, torch.float32),
            hidden.new_empty((), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    _, _, _, gh, gw, gb, unit = output
    ctx.flags = (inputs[13], inputs[14], inputs[15])  # need_h, need_w, need_b
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype, inputs[1].dtype)
    ctx.save_for_backward(gh, gw, gb, unit)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, *_):
    refuse_double_backward("tiled fused-linear policy")
    if g_loss is None:
        return (None,) * 19
    gh, gw, gb, unit = ctx.saved_tensors
    return torch_linear.scale_grads(ctx, g_loss * unit, (gh, gw, gb)) + (None,) * 16


tiled_linear_policy_loss_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------ two passes
# the temperature: the ops' one-value host tensor (``custom_ops.host_floats``)
def _native_stats(z, targets, temperature: torch.Tensor, with_entropy: bool):
    from . import native

    return native.token_stats(z.unsqueeze(0), targets, temperature, with_entropy)


def _triton_stats(z, targets, temperature: torch.Tensor, with_entropy: bool):
    from . import triton as tb

    return tb._kernels().token_stats(z.unsqueeze(0), targets, float(temperature), with_entropy)


def _native_grad(z, targets, lse, g_logp, entropy, g_entropy, temperature: torch.Tensor, out=None):
    """dlogits written over the fp32 tile ``z`` (the C++ gradient writes its input's dtype), then rounded into
    ``out`` (16-bit, mixed mode) if given."""
    from . import native

    native.token_grad_into(z.unsqueeze(0), z, targets, lse, g_logp, entropy, g_entropy, float(temperature),
                           z.numel(), z.stride(0))
    if out is not None:
        out.copy_(z)


def _triton_grad(z, targets, lse, g_logp, entropy, g_entropy, temperature: torch.Tensor, out=None):
    """dlogits written over the tile ``z``, or straight into ``out`` (the kernel rounds on store)."""
    from . import triton as tb

    x = z.unsqueeze(0)
    tb._kernels().token_grad(x, targets, lse, g_logp, entropy, g_entropy, float(temperature),
                             out=x if out is None else out.unsqueeze(0))


#: kernel -> (statistics of a tile: ``(logp, entropy, lse (2, n))``, its gradient given ``lse``), the kernels
#: behind ``token_logprobs`` (``kernels/logits.py::token_stats`` / ``token_grad``, the C++ ones)
TWO_PASS_KERNELS = {"native": (_native_stats, _native_grad), "triton": (_triton_stats, _triton_grad)}


@autocast_free_op("fused_rl::tiled_linear_token_stats")
def tiled_linear_token_stats_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                targets: torch.Tensor, temperature: torch.Tensor, with_entropy: bool, n_tile: int,
                                kernel: str, mixed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp (B, T), entropy (B, T) or empty, lse (2, N))`` of ``softmax((h W^T + b) / tau)``, fp32:
    per tile ``z = h W^T + b`` and the statistics kernel (one read of ``z``); ``IGNORE_INDEX`` targets give 0;
    ``lse`` is the kernel's per-row statistics (raw max, ``log2`` of the sum), which its gradient reads."""
    batch, length, _ = hidden.shape
    vocab, count, f32 = weight.shape[0], batch * length, torch.float32
    hidden_flat, weight_c, bias_c, hdtype = _operands(hidden, weight, bias, mixed)
    stats = TWO_PASS_KERNELS[kernel][0]
    valid = targets != IGNORE_INDEX
    targets_flat, valid_flat = targets.reshape(-1), valid.reshape(-1)
    logp = torch.zeros(count, dtype=f32, device=hidden.device)
    entropy = torch.zeros(count if with_entropy else 0, dtype=f32, device=hidden.device)
    lse = torch.zeros(2, count, dtype=f32, device=hidden.device)
    ws = torch.empty(min(n_tile, count) * vocab, dtype=f32, device=hidden.device)
    for tile in _token_groups(valid, n_tile):
        h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, hdtype)
        if ok is not None:  # fixed tiles: masked rows (zeroed hidden rows) read nothing and give 0
            t = torch.where(ok, t, torch.full_like(t, IGNORE_INDEX))
        z = ws[:h.shape[0] * vocab].view(h.shape[0], vocab)
        _tile_logits(h, weight_c, bias_c, z, mixed)
        lp, ent, row_stats = stats(z, t.contiguous(), temperature, with_entropy)
        logp[tile.idx] = lp
        if with_entropy:
            entropy[tile.idx] = ent if ok is None else torch.where(ok, ent, torch.zeros_like(ent))
        lse[:, tile.idx] = row_stats
    return logp.view(batch, length), entropy.view(batch, length) if with_entropy else entropy, lse


@tiled_linear_token_stats_op.register_fake
def _(hidden, weight, bias, targets, temperature, with_entropy, n_tile, kernel, mixed):
    f32 = torch.float32
    return (hidden.new_empty(targets.shape, dtype=f32),
            hidden.new_empty(targets.shape if with_entropy else (0,), dtype=f32),
            hidden.new_empty((2, targets.numel()), dtype=f32))


@autocast_free_op("fused_rl::tiled_linear_token_grad")
def tiled_linear_token_grad_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    lse: torch.Tensor, g_logp: torch.Tensor, entropy: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
    temperature: torch.Tensor, need_h: bool, need_w: bool, need_b: bool, n_tile: int, kernel: str, mixed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight, grad_bias, unit)`` (fp32, empty where not needed, in units of the 0-dim
    ``unit``) of ``sum_t g_logp_t logp_t + g_H_t H_t``: each tile recomputed, the gradient kernel's
    ``dz = (g_logp (onehot - p) + g_H p (E[z] - z)) / tau`` (from :func:`tiled_linear_token_stats_op`'s ``lse``),
    then ``grad_h[tile] = dz W``, ``grad_W += dz^T h``. In mixed mode the kernel gets ``g / unit``,
    ``unit = max |g|``, as the single pass's weights (16-bit ``dz`` in fp16's normal range)."""
    f32 = torch.float32
    vocab = weight.shape[0]
    hidden_flat, weight_c, bias_c, hdtype = _operands(hidden, weight, bias, mixed)
    grad_kernel = TWO_PASS_KERNELS[kernel][1]
    valid = targets != IGNORE_INDEX
    targets_flat, valid_flat = targets.reshape(-1), valid.reshape(-1)
    gl = g_logp.reshape(-1).to(f32)
    ge = None if g_entropy is None or entropy is None else g_entropy.reshape(-1).to(f32)
    ent_flat = None if ge is None else entropy.reshape(-1).to(f32)
    unit = torch.ones((), dtype=f32, device=hidden.device)
    if mixed and gl.numel():  # over the read rows only (an inf upstream gradient at a -100 target reads nothing)
        largest = lambda g: torch.where(valid_flat, g.abs(), torch.zeros_like(g)).amax()
        g_max = largest(gl) if ge is None else torch.maximum(largest(gl), largest(ge))
        unit = torch.where(g_max > 0, g_max, unit)
        gl, ge = gl / unit, None if ge is None else ge / unit
    grads = (_MixedGrads if mixed else _Grads)(hidden, weight, need_h, need_w, need_b, f32)
    rows = min(n_tile, targets.numel())
    ws = torch.empty(rows * vocab, dtype=f32, device=hidden.device)
    ws16 = torch.empty(rows * vocab if mixed else 0, dtype=hidden.dtype, device=hidden.device)
    lse_rows = lse.t()  # (N, 2): the tiles' rows, taken as the other per-token vectors
    for tile in _token_groups(valid, n_tile):
        h, t, ok = _tile_inputs(tile, hidden_flat, targets_flat, valid_flat, hdtype)
        n = h.shape[0]
        take = _tile_take(tile, ok)
        g1, g2 = take(gl), take(ge)
        if ok is not None:
            t = torch.where(ok, t, torch.full_like(t, IGNORE_INDEX))
            g1 = torch.where(ok, g1, torch.zeros_like(g1))
            g2 = None if g2 is None else torch.where(ok, g2, torch.zeros_like(g2))
        z = ws[:n * vocab].view(n, vocab)
        _tile_logits(h, weight_c, bias_c, z, mixed)
        dz16 = ws16[:n * vocab].view(n, vocab) if mixed else None
        grad_kernel(z, t.contiguous(), take(lse_rows).t().contiguous(), g1.contiguous(),
                    None if g2 is None else take(ent_flat).contiguous(), None if g2 is None else g2.contiguous(),
                    temperature, out=dz16)
        if mixed:
            grads.add_mixed(tile, dz16, h, weight_c, ok)
        else:
            grads.add(tile, z.t(), h, weight_c, ok)
    return (*grads.results(hidden, weight, cast=False), unit)


@tiled_linear_token_grad_op.register_fake
def _(hidden, weight, bias, targets, lse, g_logp, entropy, g_entropy, temperature, need_h, need_w, need_b, n_tile,
      kernel, mixed):
    return (*torch_linear.fake_grads(hidden, weight, need_h, need_w, need_b, torch.float32),
            hidden.new_empty((), dtype=torch.float32))


tiled_linear_token_grad_op.register_autograd(torch_linear.no_double_backward,
                                             setup_context=lambda ctx, inputs, output: None)


def _stats_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, with_entropy, n_tile, kernel, mixed = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, temperature)
    ctx.args = (with_entropy, n_tile, kernel, mixed)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # an unused entropy output: g_entropy None, no entropy term recomputed


def _stats_backward(ctx, g_logp, g_entropy, _):
    hidden, weight, bias, targets, lse, entropy, temperature = ctx.saved_tensors
    with_entropy, n_tile, kernel, mixed = ctx.args
    if g_logp is None and g_entropy is None:
        return (None,) * 9
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    if g_logp is None:
        g_logp = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    g_entropy = g_entropy if with_entropy else None
    *grads, unit = tiled_linear_token_grad_op(hidden, weight, bias, targets, lse, g_logp,
                                              entropy if g_entropy is not None else None, g_entropy, temperature,
                                              *need, n_tile, kernel, mixed)
    dtypes = (hidden.dtype, weight.dtype, weight.dtype)
    if torch.is_grad_enabled():  # create_graph=True: out= is not differentiable; the grad op's backward raises
        return tuple((g * unit).to(dtype) if wanted else None for g, wanted, dtype in zip(grads, need, dtypes)) \
            + (None,) * 6
    return tuple(torch.mul(g, unit, out=torch.empty(g.shape, dtype=dtype, device=g.device)) if wanted else None
                 for g, wanted, dtype in zip(grads, need, dtypes)) + (None,) * 6


tiled_linear_token_stats_op.register_autograd(_stats_backward, setup_context=_stats_setup_context)


# ------------------------------------------------------------------------------------ backend methods
def linear_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       inputs: PolicyInputs, config: PolicyLossConfig, compute_entropy: bool, kernel: str,
                       memory_budget_bytes: Optional[int] = None) -> PolicyLossOutput:
    """The backend method: the configs of :func:`runs_tiled` through the single-pass op with ``kernel``; the
    others in the two passes (:func:`torch_linear.two_pass_policy_loss` over :func:`linear_token_logprobs`) where
    :func:`_sequences_in_two_passes` or the config is batch-level, else :func:`torch_linear.linear_policy_loss`."""
    if not runs_tiled(config, off_policy=inputs.old is not None):
        if not (config.is_batch_level or _sequences_in_two_passes(hidden.device)):
            return torch_linear.linear_policy_loss(hidden, weight, bias, inputs, config, compute_entropy,
                                                   memory_budget_bytes)
        return torch_linear.two_pass_policy_loss(  # the loss math on (B, T) vectors between the two passes
            lambda *args: linear_token_logprobs(*args, kernel=kernel, memory_budget_bytes=memory_budget_bytes),
            hidden, weight, bias, inputs, config, compute_entropy or config.needs_entropy)
    kernel_config, kernel_adv = config_args(config), inputs.kernel_advantages
    rollout = inputs.rollout if config.rollout_is is not None else None
    if not config.has_token_epilogue:  # a sequence-level correction off-policy, folded into the advantages
        kernel_config, kernel_adv = _fold_sequence_rollout(config, inputs)
        rollout = None
    batch, length, _ = hidden.shape
    mixed = _mode(hidden.device, hidden.dtype) == "mixed"
    weights = aggregation_weights(inputs.mask, config, inputs.token_normalizer)
    want_ent = compute_entropy or config.needs_entropy
    n_tile = chunk_tokens(batch * length, weight.shape[0], hidden.dtype, hidden.device, memory_budget_bytes, mixed)
    loss, logp, entropy, _, _, _, _ = tiled_linear_policy_loss_op(
        hidden, weight, bias, inputs.targets, kernel_adv, inputs.mask, weights, inputs.old, inputs.ref,
        rollout, *kernel_config, bool(want_ent), _needs_grad(hidden), _needs_grad(weight), _needs_grad(bias), n_tile,
        kernel, mixed)
    entropy = entropy if want_ent else None
    terms = per_token_loss(logp, inputs.advantages, inputs.mask, config, old_logprobs=inputs.old,
                           ref_logprobs=inputs.ref, entropy=entropy, rollout_logprobs=inputs.rollout,
                           rollout_is_weights=inputs.is_weights)
    return PolicyLossOutput(loss=loss, logprobs=logp, entropy=entropy,
                            metrics=metrics(terms.ratio, inputs.advantages, inputs.mask, config, terms.kl, entropy,
                                            terms.extras))


def linear_token_logprobs(hidden, weight, bias, targets, temperature: float, return_entropy: bool, kernel: str,
                          memory_budget_bytes: Optional[int] = None):
    """The backend method: :func:`tiled_linear_token_stats_op` (its backward recomputes the tiles for any upstream
    gradient of the log-probs and entropies)."""
    mixed = _mode(hidden.device, hidden.dtype) == "mixed"
    n_tile = chunk_tokens(targets.numel(), weight.shape[0], hidden.dtype, hidden.device, memory_budget_bytes, mixed)
    logp, entropy, _ = tiled_linear_token_stats_op(hidden, weight, bias, targets, host_floats((temperature,)),
                                                   bool(return_entropy), n_tile, kernel, mixed)
    return logp, (entropy if return_entropy else None)


class TiledLinearMethods:
    """The fused-linear methods of a :class:`~fused_rl.backends.base.Backend` whose single-pass kernel is
    ``KERNELS[linear_kernel]``: tiles of ``h W^T`` (MKL / cuBLAS) fed to it (this module)."""

    linear_kernel: str

    def linear_policy_loss(self, hidden, weight, bias, inputs, config, compute_entropy, memory_budget_bytes=None):
        return linear_policy_loss(hidden, weight, bias, inputs, config, compute_entropy, self.linear_kernel,
                                  memory_budget_bytes)

    def linear_token_logprobs(self, hidden, weight, bias, targets, temperature, return_entropy,
                              memory_budget_bytes=None):
        return linear_token_logprobs(hidden, weight, bias, targets, temperature, return_entropy, self.linear_kernel,
                                     memory_budget_bytes)
