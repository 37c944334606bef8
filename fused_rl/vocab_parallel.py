"""Log-probs and entropy of a vocabulary-parallel (tensor-parallel) LM head: from each process's slice of the logits
(:func:`token_logprobs`) or without the logits (:func:`linear_token_logprobs`).

Each process ``r`` of ``group`` (``R`` of them) holds columns ``[r V_r, (r + 1) V_r)`` of the logits ``z`` (Megatron's
``ColumnParallelLinear`` output without ``gather_output``), or the matching rows of the LM-head weight (verl's
``linear_cross_entropy`` with a tensor-parallel ``dist_process_group``), and the same token ids (global) and hidden
states. With ``z`` divided by the temperature:

* each process runs one fused pass (:func:`fused_rl.token_logprobs` / :func:`fused_rl.linear_token_logprobs`) over
  its slice, reading a column ``c`` whose log-prob gives the slice's ``lse_r = logsumexp_{j in r} z_j = z_c - log
  p_r(c)`` (``z_c`` read or one dot product per row, in fp32) and, with ``return_entropy``, its entropy ``H_r``; its
  logit ``z_t`` where the slice holds the target;
* one ``all_gather`` of ``(lse_r, [z_t if t in r else 0], H_r)`` per token, and then, on every process alike:
  ``LSE = logsumexp_r lse_r``, ``w_r = exp(lse_r - LSE)``,
  ``log p(t) = z_t - LSE`` and ``H = sum_r w_r H_r + sum_r w_r (LSE - lse_r)`` (the entropy of a mixture: the
  slices' entropies plus that of the slice weights ``w``).

Gradients follow Megatron's and verl's tensor-parallel convention: every process computes the same loss from the
outputs, and each one's gradient is that loss's gradient through its own slice's statistics (the gather's backward
hands each process its own row, no collective): the logits or weight gradient is the slice's own, the hidden-state
gradient this process's partial sum, whose sum over the group is the whole gradient (verl's Megatron forwards gather
the hidden states with ``gather_from_sequence_parallel_region``, whose backward reduce-scatters it; verl turns sequence
parallelism on whenever the tensor-parallel group has more than one process; a caller without it must all-reduce the
hidden states' gradient). One ``all_gather`` (of ``2`` or ``3`` values per token, fp32, fp64 for fp64 input) runs in
the forward, and with ``check_inputs`` one more of the slice sizes and each process's check results (and a host
sync); none in the backward. With ``check_inputs`` the processes agree on the checks: a process whose own
arguments are wrong (the checks, its backend included) raises its error and the others raise too (the check's
``all_gather`` carries a flag of each process's checks, and the number of tokens, ``return_entropy``, whether the input
is fp64 and the temperature, which must be the same on every process), none is left waiting in a collective; without,
it raises alone before the first collective while the others wait in it (as with any collective call), and so it does
while ``torch.compile`` traces :func:`linear_token_logprobs`.

The column ``c``. On logits: each row's largest (one more read of the slice, no write): ``log p_r(c)`` is then in
``[-log V_r, 0]`` (no cancellation in ``lse_r``), and a row whose slice is all ``-inf`` is not read (``lse_r = -inf``,
``w_r = 0``). Without logits (finite there; no bias argument: Megatron's and verl's LM heads have none): the target
where the slice holds it, else a stand-in spread over the columns (the row index modulo ``V_r``); its one-hot gradient
cancels (the dot product adds what ``log p_r(c)`` takes away), one row's contribution per column, within the rounding
of a 16-bit gradient. Memory beyond the fused pass's: on logits, none (the gathers' gradients are added in place to the
fused pass's logits gradient); without, the dot products' backward forms its own ``(V_r, H)`` weight gradient (in the
weight's dtype, added to the fused pass's by autograd) and ``(N, H)`` hidden gradient; the statistics are ``O(R N)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .backends import get_backend
from .config import IGNORE_INDEX
from .ops import _check_flags, _check_linear, _memory_budget, linear_token_logprobs as _linear_token_logprobs
from .ops import token_logprobs as _token_logprobs
from .validation import (INDEX_DTYPES, _fail, _is_compiling, check_temperature, target_range_ok,
                         token_logprobs_checks)

#: Rows per chunk of :class:`_RowDot` (a ``(rows, H)`` fp32 product at a time).
ROW_DOT_CHUNK = 4096


class _RowDot(torch.autograd.Function):
    """``z_n = hidden_n . weight[sel_n]`` for ``hidden (N, H)``, ``sel (N,)`` in ``[0, V)``, in ``dtype`` (fp32 or
    fp64: the products of 16-bit inputs are exact there), in chunks of rows: no ``(N, H)`` fp32 copy is kept."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, sel: torch.Tensor, dtype: torch.dtype):
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], ROW_DOT_CHUNK):
            rows = slice(start, start + ROW_DOT_CHUNK)
            out[rows] = torch.linalg.vecdot(hidden[rows].to(dtype), weight[sel[rows]].to(dtype))
        ctx.save_for_backward(hidden, weight, sel)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, sel = ctx.saved_tensors
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ROW_DOT_CHUNK):
            rows = slice(start, start + ROW_DOT_CHUNK)
            g = grad[rows].unsqueeze(-1)
            if grad_h is not None:
                grad_h[rows] = g * weight[sel[rows]].to(grad.dtype)
            if grad_w is not None:
                grad_w.index_add_(0, sel[rows], (g * hidden[rows].to(grad.dtype)).to(weight.dtype))
        return grad_h, grad_w, None, None


class _GatherRows(torch.autograd.Function):
    """``(R, *local.shape)``: every process's ``local``, in rank order. Every process computes the same loss of the
    result, so the gradient of its own ``local`` is its own row of the result's gradient (no collective)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank = dist.get_rank(group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def linear_shard_statistics(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                            temperature: float, return_entropy: bool, backend: str,
                            memory_budget_bytes: Optional[int]) -> torch.Tensor:
    """This shard's ``(lse_r, z_t or 0, [H_r])`` per token, ``(2 or 3, B, T)`` fp32 (fp64 for fp64 input),
    differentiable: one fused pass over the shard plus one dot product per row (module docstring). ``targets`` are
    global ids (``IGNORE_INDEX`` rows: 0 statistics' gradient, any value)."""
    vocab = weight.shape[0]
    local = targets.long() - vocab_start
    in_shard = (local >= 0) & (local < vocab)
    stand_in = torch.arange(targets.numel(), device=targets.device).view(targets.shape) % vocab
    sel = torch.where(in_shard, local, stand_in)
    ignored = targets == IGNORE_INDEX
    out = _linear_token_logprobs(hidden, weight, torch.where(ignored, IGNORE_INDEX, sel), temperature=temperature,
                                 return_entropy=return_entropy, backend=backend, check_inputs=False,
                                 memory_budget_bytes=memory_budget_bytes)
    logp = out[0] if return_entropy else out
    flat = hidden.reshape(-1, hidden.shape[-1])
    z_sel = (_RowDot.apply(flat, weight, sel.reshape(-1), logp.dtype) / temperature).view(targets.shape)
    rows = [z_sel - logp, torch.where(in_shard, z_sel, torch.zeros_like(z_sel))]
    return torch.stack(rows + [out[1]] if return_entropy else rows)


class _LogitsShard(torch.autograd.Function):
    """``(z_m, log p_r(m), H_r, z_t)`` of a logits shard ``(N, V_r)`` (``/ tau``, fp32 or fp64): ``m`` the row's
    largest column (``kernel_targets``: ``m``, or ``IGNORE_INDEX`` on ignored rows and rows all ``-inf``, which the
    fused pass does not read), ``t`` the local target where ``owner`` (else 0). One fused pass
    (:func:`fused_rl.token_logprobs`) and two gathers; the backward is the fused pass's, with the gathers' one-hot
    gradients added in place (no second ``(N, V_r)`` buffer)."""

    @staticmethod
    def forward(ctx, logits, kernel_targets, largest, target, owner, temperature, return_entropy, backend):
        x = logits.detach().requires_grad_(logits.requires_grad)
        with torch.enable_grad():
            out = _token_logprobs(x, kernel_targets, temperature=temperature, return_entropy=return_entropy,
                                  backend=backend, check_inputs=False)
        logp, entropy = out if return_entropy else (out, out.new_zeros(0))
        take = lambda index: logits.detach().gather(-1, index.unsqueeze(-1)).squeeze(-1).to(logp.dtype) / temperature
        z_t = take(target)
        z_t = torch.where(owner, z_t, torch.zeros_like(z_t))
        # the inner graph through save_for_backward, not a ctx attribute: released with the outer graph's saved
        # tensors (a ctx attribute kept x, an alias of the logits, alive as long as the outputs)
        ctx.save_for_backward(x, logp, entropy, kernel_targets, largest, target, owner)
        ctx.temperature, ctx.return_entropy = temperature, return_entropy
        return take(largest), logp.detach(), entropy.detach(), z_t

    @staticmethod
    def backward(ctx, g_largest, g_logp, g_entropy, g_target):
        if torch.is_grad_enabled():
            raise NotImplementedError("fused_rl.vocab_parallel.token_logprobs: no double backward (create_graph=True)")
        x, logp, entropy, kernel_targets, largest, target, owner = ctx.saved_tensors
        if logp.grad_fn is None:
            raise RuntimeError("fused_rl.vocab_parallel: the logits path's backward needs its forward run eagerly "
                               "(not traced by torch.compile)")
        outputs, grads = [logp], [g_logp]
        if ctx.return_entropy:
            outputs.append(entropy)
            grads.append(g_entropy)
        # retain_graph: a retained outer graph may run this again; the inner graph goes with the saved tensors
        (grad,) = torch.autograd.grad(outputs, x, grads, retain_graph=True)
        rows = grad.view(-1, grad.shape[-1])
        at = torch.arange(rows.shape[0], device=rows.device)
        tau = ctx.temperature
        # at m the fused pass's g_logp (1 - p_m) and the one-hot g_largest cancel to about g p_m: written from the
        # row statistics (fp32 / fp64), not summed in the gradient's dtype (16-bit: off by 2^-8 g, not 2^-8 g p_m)
        m, gl, gp = largest.reshape(-1), g_largest.reshape(-1), g_logp.reshape(-1)
        lp = logp.detach().reshape(-1)
        p = lp.exp()
        value = (gl + gp) - gp * p
        if ctx.return_entropy:
            value = value - g_entropy.reshape(-1) * p * (lp + entropy.detach().reshape(-1))
        skip = kernel_targets.reshape(-1) == IGNORE_INDEX  # rows the fused pass did not read (its gradient 0)
        value = torch.where(skip, rows[at, m].to(value.dtype) * tau + gl, value)
        rows[at, m] = (value / tau).to(rows.dtype)
        # one entry a row: an indexed add (scatter_add_ of 16-bit values on the CPU takes an fp32 copy of rows)
        g_t = torch.where(owner, g_target, torch.zeros_like(g_target))
        rows[at, target.reshape(-1)] += (g_t / tau).reshape(-1).to(rows.dtype)
        return grad, None, None, None, None, None, None, None


def logits_shard_statistics(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
                            return_entropy: bool, backend: str) -> torch.Tensor:
    """This logits shard's ``(lse_r, z_t or 0, [H_r])`` per token, ``(2 or 3, *targets.shape)``, differentiable: the
    shard's ``logsumexp`` read at its largest column ``m`` (``lse_r = z_m - log p_r(m)``: no cancellation, and
    ``-inf`` for a row whose shard is all ``-inf``), one read of the shard for ``m`` and one fused pass."""
    vocab = logits.shape[-1]
    local = targets.long() - vocab_start
    owner = (local >= 0) & (local < vocab)
    values, largest = logits.detach().max(dim=-1)
    skip = (targets == IGNORE_INDEX) | (values == float("-inf"))
    kernel_targets = torch.where(skip, IGNORE_INDEX, largest)
    z_m, logp_m, entropy, z_t = _LogitsShard.apply(logits, kernel_targets, largest,
                                                   torch.where(owner, local, torch.zeros_like(local)), owner,
                                                   temperature, return_entropy, backend)
    rows = [z_m - logp_m, z_t]
    return torch.stack(rows + [entropy] if return_entropy else rows)


def combine(gathered: torch.Tensor, ignored: torch.Tensor, return_entropy: bool):
    """``(log p(t), H or None)`` of every shard's statistics (:func:`linear_shard_statistics`,
    :func:`logits_shard_statistics`), ``gathered (R, 2 or 3, *shape)`` (module docstring's formulas); 0 at ``ignored``
    tokens. A shard whose logits are all ``-inf`` on a row (``lse_r = -inf``, ``w_r = 0``) adds nothing there."""
    # ignored rows: lse 0 (an ignored row all -inf in every shard would give -inf - -inf = nan, and a nan gradient)
    lse = torch.where(ignored, torch.zeros_like(gathered[:, 0]), gathered[:, 0])
    # shifted by the largest slice's (a constant): the gradient's weights exp(lse_r - LSE) then sum to 1 within a
    # rounding, not within eps |LSE|, which the ranks' partial hidden gradients (large, cancelling) would carry
    top = lse.detach().amax(0)
    shifted = lse - top
    log_mass = torch.logsumexp(shifted, dim=0)
    total = log_mass + top
    zero = torch.zeros_like(total)
    # <= 0 as computed: the owner's lse_r = z_t - log p_r(t) >= z_t (the fused pass's log-probs are <= 0), LSE >= lse_r
    logp = torch.where(ignored, zero, gathered[:, 1].sum(0) - total)
    if not return_entropy:
        return logp, None
    w = torch.softmax(shifted, dim=0)
    term = gathered[:, 2] + (log_mass - shifted)
    # where w = 0 the term may be inf (lse_r = -inf): 0, and so its gradient (not 0 * inf)
    entropy = (w * torch.where(w > 0, term, torch.zeros_like(term))).sum(0)
    return logp, torch.where(ignored, zero, entropy)


#: What every process must pass alike besides the shard size (a mismatch makes the gathers' sizes or dtypes differ,
#: or the combination wrong), agreed with ``check_inputs``: one column each of the check's ``all_gather``.
AGREED = ("number of tokens", "return_entropy", "fp64-ness of the input", "temperature")


def _table_device(operand: Any, group: Any) -> torch.device:
    """Where the check's ``all_gather`` runs: NCCL takes CUDA tensors (the current device, whatever this process's
    possibly wrong operand is on: a meta or CPU operand must not make its gather fail), gloo / MPI CPU ones."""
    name = str(dist.get_backend(group)).lower()
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in name or "mpi" in name:
        return torch.device("cpu")
    device = getattr(operand, "device", None)
    return device if isinstance(device, torch.device) and device.type != "meta" else torch.device("cpu")


def _agree_on_inputs(error: Optional[BaseException], operand: Any, targets: Optional[torch.Tensor], vocab: int,
                     agreed: tuple, group: Any, shard: str) -> None:
    """The argument checks, agreed by every process of ``group``: one ``all_gather`` of ``(V_r, whether this process's
    own checks failed, whether its targets are in [0, R V_r) or -100, *agreed)`` (fp64) and one host sync, then every
    process raises if any process's checks failed (that process its own ``error``), the shards differ in size, any
    targets are out of range or the :data:`AGREED` values differ: a process with wrong arguments does not leave the
    others waiting in the next collective."""
    world = dist.get_world_size(group)
    device = _table_device(operand, group)
    if error is None:
        in_range = target_range_ok(targets, world * vocab).to(device=device, dtype=torch.float64).view(1)
        mine = torch.cat([torch.tensor([vocab, 0.0], dtype=torch.float64, device=device), in_range,
                          torch.tensor([float(v) for v in agreed], dtype=torch.float64, device=device)])
    else:
        mine = torch.tensor([0.0, 1.0, 1.0] + [0.0] * len(AGREED), dtype=torch.float64, device=device)
    rows = [torch.empty(3 + len(AGREED), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).tolist()
    if error is not None:
        raise error
    failed = [rank for rank, row in enumerate(table) if row[1]]
    if failed:
        _fail(f"fused_rl.vocab_parallel: the arguments of process(es) {failed} of the group (group ranks) are invalid "
              "(each raised its own error)")
    problems = []
    if any(row[0] != vocab for row in table):
        problems.append(f"every process's {shard} must be V_r = {vocab} (equal shards), got "
                        f"{[int(row[0]) for row in table]}")
    out_of_range = [rank for rank, row in enumerate(table) if not row[2]]
    if out_of_range:
        problems.append(f"targets must be in [0, {world * vocab}) (the {world} shards' vocabulary) or {IGNORE_INDEX} "
                        f"(not on process(es) {out_of_range})")
    for column, name in enumerate(AGREED, start=3):
        values = [row[column] if name == "temperature" else int(row[column]) for row in table]
        if any(value != values[0] for value in values):
            problems.append(f"every process must pass the same {name}, got {values}")
    if problems:
        _fail("; ".join(problems))


def _agreeing(check_inputs: Any) -> bool:
    """Whether the checks are agreed: with ``check_inputs`` (an invalid one taken as true, so that its own check's
    error is agreed on), not while ``torch.compile`` traces, and only with a process group (else nobody to agree
    with)."""
    try:
        wanted = bool(check_inputs)
    except Exception:  # noqa: BLE001 - an invalid flag: its check raises, agreed
        wanted = True
    return wanted and not _is_compiling() and dist.is_initialized()


def agreed_checks(checks: Callable[[], Any], operand: Any, group: Any, check_inputs: Any) -> Any:
    """``checks()``: a caller's own argument checks before it calls :func:`linear_token_logprobs` or
    :func:`token_logprobs` with the same ``group`` and ``check_inputs`` (a drop-in's checks of its own options).
    Where that call's checks are agreed, so is an exception of these: this process raises it after the agreement's
    ``all_gather``, the others in their call's (told which process failed), instead of this process raising alone and
    leaving the others waiting in a collective. Returns what ``checks()`` returns."""
    try:
        return checks()
    except Exception as exc:  # noqa: BLE001 - re-raised on this process, agreed on the others
        if not _agreeing(check_inputs):
            raise
        _agree_on_inputs(exc, operand, None, 0, (), group, "")


def _checked(checks: Callable[[], tuple], operand: Any, targets: Any, group: Any, shard: str,
             check_inputs: Any) -> int:
    """``checks()`` (this process's argument checks, returning its ``V_r`` and :data:`AGREED` values), then with
    ``check_inputs`` (:func:`_agreeing`) :func:`_agree_on_inputs`; without, a failed check raises here alone. Any
    exception of the checks is agreed on (a backend's RuntimeError too)."""
    agree = _agreeing(check_inputs)
    try:
        vocab, agreed = checks()
    except Exception as exc:  # noqa: BLE001 - re-raised on this process, agreed on the others
        if not agree:
            raise
        _agree_on_inputs(exc, operand, None, 0, (), group, shard)
    if agree:
        _agree_on_inputs(None, operand, targets, vocab, agreed, group, shard)
    return vocab


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, group: Any = None,
                          temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                          check_inputs: bool = True, memory_budget_bytes: Optional[int] = None):
    """:func:`fused_rl.linear_token_logprobs` of a vocabulary-parallel LM head: ``hidden (B, T, H)`` and ``targets
    (B, T)`` (global token ids, ``-100`` ignored) the same on every process of ``group`` (``None``: the default
    group), ``weight (V_r, H)`` this process's rows ``[rank V_r, (rank + 1) V_r)`` of the whole ``(R V_r, H)``
    weight. Returns ``log p(t)`` ``(B, T)`` (and ``H``) of the whole vocabulary, fp32 (fp64 for fp64 input), the
    same on every process; gradients per the module docstring (the hidden states' is this process's partial sum).
    Every process of ``group`` must call it (one ``all_gather``; with ``check_inputs`` one more of the shard
    sizes, which must be equal, and one host sync for the target range)."""
    def checks() -> tuple:
        _check_flags(return_entropy=return_entropy, check_inputs=check_inputs)
        _check_linear(hidden, weight, None)
        _memory_budget(memory_budget_bytes)
        if not isinstance(targets, torch.Tensor) or targets.dtype not in INDEX_DTYPES:
            raise ValueError("targets must be an int32 or int64 tensor, got "
                             f"{getattr(targets, 'dtype', type(targets))}")
        if tuple(targets.shape) != tuple(hidden.shape[:2]) or targets.device != hidden.device:
            raise ValueError(f"targets must have shape {tuple(hidden.shape[:2])} on {hidden.device}, "
                             f"got {tuple(targets.shape)} on {targets.device}")
        check_temperature(temperature)
        get_backend(backend, hidden.device, hidden.dtype, linear=True)
        return weight.shape[0], (targets.numel(), return_entropy, hidden.dtype == torch.float64, temperature)

    vocab = _checked(checks, hidden, targets, group, "weight shard's row count", check_inputs)
    memory_budget_bytes = _memory_budget(memory_budget_bytes)
    rank = dist.get_rank(group)
    stats = linear_shard_statistics(hidden, weight, targets, rank * vocab, float(temperature), bool(return_entropy),
                                    backend, memory_budget_bytes)
    logp, entropy = combine(_GatherRows.apply(stats, group), targets == IGNORE_INDEX, return_entropy)
    return (logp, entropy) if return_entropy else logp


@torch.compiler.disable  # the logits path runs an inner autograd graph: eager under torch.compile (a graph break)
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, group: Any = None, temperature: float = 1.0,
                   return_entropy: bool = False, backend: str = "auto", check_inputs: bool = True):
    """:func:`fused_rl.token_logprobs` of vocabulary-parallel logits: ``logits (..., V_r)`` this process's columns
    ``[rank V_r, (rank + 1) V_r)`` of the whole vocabulary (Megatron's ``ColumnParallelLinear`` output without
    ``gather_output``), ``targets (...)`` global token ids (``-100`` ignored), the same on every process of ``group``.
    Returns ``log p(t)`` (and ``H``) over the whole vocabulary, fp32 (fp64 for fp64 logits), the same on every
    process; each process's logits gradient is its own columns' (Megatron's ``vocab_parallel_cross_entropy``:
    ``-token_logprobs(logits, targets, group=tp_group)``). One read of the shard for each row's largest logit, one
    fused pass, one ``all_gather``; with ``check_inputs``, one more of the shard sizes, which must be equal, and of the
    checks' results (a process's bad argument raises on every process), and one host sync. ``-inf`` logits (a vocabulary
    mask) are ``p = 0`` with gradient 0, a whole shard of them included; a target at ``-inf`` has log-prob ``-inf``, its
    column's gradient ``g (1 - p) = g``, as on one process. A retained graph may be run backward again; no double
    backward (``create_graph=True`` raises NotImplementedError); under ``torch.compile`` it runs eagerly
    (``torch.compiler.disable``: a graph break, an error with ``fullgraph=True``)."""
    def checks() -> tuple:
        _check_flags(return_entropy=return_entropy, check_inputs=check_inputs)
        token_logprobs_checks(logits, targets, temperature, False)
        get_backend(backend, logits.device, logits.dtype)
        return logits.shape[-1], (targets.numel(), return_entropy, logits.dtype == torch.float64, temperature)

    vocab = _checked(checks, logits, targets, group, "logits shard's vocabulary size", check_inputs)
    rank = dist.get_rank(group)
    stats = logits_shard_statistics(logits, targets, rank * vocab, float(temperature), bool(return_entropy), backend)
    logp, entropy = combine(_GatherRows.apply(stats, group), targets == IGNORE_INDEX, return_entropy)
    return (logp, entropy) if return_entropy else logp


__all__ = ["token_logprobs", "linear_token_logprobs", "logits_shard_statistics", "linear_shard_statistics", "combine",
           "agreed_checks"]
