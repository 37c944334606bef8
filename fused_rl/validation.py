"""Input checks shared by every backend and the reference.

Two kinds of checks:

* **structural** (shapes, dtypes, devices, strides): free, always on;
* **value** checks (target range, 0/1 mask, finite advantages / log-probs, positive normalizer):
  they need the data, so they are batched into one boolean vector and read back with a single
  host synchronization. ``check_inputs=False`` skips them, and they are skipped automatically
  while ``torch.compile`` traces (a data-dependent branch would break the graph).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .config import IGNORE_INDEX, MIN_TEMPERATURE, PolicyLossConfig
from .loss_math import Normalizer

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
#: ``old`` / ``ref`` / ``rollout`` log-probs above this raise: no rounding of a ``log_softmax`` (even one
#: taken in bf16 at logits ~30, ulp 0.125) gets there, a negative log-likelihood passed for a log-prob does.
LOGPROB_SLACK = 0.5
#: A Python-number ``token_normalizer`` must lie strictly between these: the numbers that round to a positive,
#: finite fp32 (as a tensor normalizer is checked after its cast): ``2^-150`` rounds to 0, ``FLT_MAX + ulp / 2`` to
#: inf (``1e-300`` made the loss inf and its gradient NaN; ``1e300`` made it 0).
FP32_POSITIVE_FINITE = (2.0 ** -150, float.fromhex("0x1.ffffffp+127"))


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _real(x) -> float:
    """``float(x)`` of a real number, ``inf`` where it is an int too large for a float (``10**400``: it passes
    ``-inf < x < inf``, and ``float()`` would raise OverflowError later)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def check_flag(value, name: str) -> None:
    """A bool (Python's or numpy's): a string such as ``"no"`` is truthy, and ``inplace="no"`` wrote the gradient
    over the caller's logits."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and _is_compiling():
        # torch.compile traces a numpy bool as an array, whose value it does not know (a repr of it broke the graph)
        _fail(f"{name}: torch.compile traces a numpy bool as an array, of unknown value: pass a Python bool")
    if not isinstance(value, bool) and not (np is not None and isinstance(value, np.bool_)):
        _fail(f"{name} must be a bool, got {value!r}")


def check_not_meta(x: torch.Tensor, name: str, verb: str = "is") -> None:
    """Meta tensors hold no data: the value checks and the kernels cannot read them."""
    if x.device.type == "meta":
        _fail(f"{name} {verb} on the meta device: no data to compute on (fused_rl needs real cpu / cuda tensors)")


def _is_compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # torch < 2.3
        return False


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """Floating ``(..., V)`` tensor, non-empty, unit stride along the vocabulary."""
    if not isinstance(logits, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        _fail(f"{name} must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.dim() < 2:
        _fail(f"{name} must have shape (..., V), got {tuple(logits.shape)}")
    check_not_meta(logits, name, "are" if name == "logits" else "is")
    if logits.numel() == 0:
        _fail(f"{name} is empty: shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        _fail(f"{name} must be contiguous along the vocabulary (stride(-1) == 1), got strides {logits.stride()}; "
              "call .contiguous() (rows may have any stride)")
    if logits.shape[-1] >= 2**31:
        _fail(f"{name}: vocabulary size {logits.shape[-1]} does not fit int32")


def check_rows_disjoint(logits: torch.Tensor, name: str = "logits") -> None:
    """For ``inplace=True`` (and any tensor a kernel writes rows of, ``name``): the ``(..., V)`` rows of ``logits``
    must not share memory (an ``expand`` of one prompt's logits over a group would get every row's gradient
    written into the same place). Rows are disjoint when, in increasing stride order, each dimension's stride
    clears the extent of the ones below (the usual layouts and their slices); other layouts are refused."""
    extent = logits.shape[-1]
    dims: list[tuple] = []  # (size, |stride|) of the leading dims of size > 1, by increasing stride
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]):
        if size > 1:  # an insertion sort: torch.compile refuses sorted(key=...) on symbolic strides
            i = len(dims)
            while i > 0 and abs(stride) < dims[i - 1][1]:
                i -= 1
            dims.insert(i, (size, abs(stride)))
    for size, stride in dims:
        if stride < extent:
            layout = f"got shape {tuple(logits.shape)} and strides {logits.stride()} (an expand()?)"
            if name != "logits":
                _fail(f"{name} must have rows that do not share memory, {layout}")
            _fail(f"inplace=True needs logits whose rows do not share memory, {layout}: pass inplace=False")
        extent += stride * (size - 1)


def check_targets(targets: torch.Tensor, logits: torch.Tensor, name: str = "targets") -> None:
    if not isinstance(targets, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in INDEX_DTYPES:
        _fail(f"{name} must be int32 or int64 token ids, got {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        _fail(f"{name} must have shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
              f"got {tuple(targets.shape)}")
    if targets.device != logits.device:
        _fail(f"{name} is on {targets.device} but logits are on {logits.device}")


def target_range_ok(targets: torch.Tensor, vocab: int, where: Optional[torch.Tensor] = None) -> torch.Tensor:
    """0-dim bool: every target is in ``[0, vocab)`` or equals ``IGNORE_INDEX`` (only where ``where``)."""
    ok = ((targets >= 0) & (targets < vocab)) | (targets == IGNORE_INDEX)
    if where is not None:
        ok = ok | ~where
    return ok.all()


def _check_values(checks: list[tuple[str, torch.Tensor]]) -> list[bool]:
    """The checks' values on the host: one stacked read; inside a ``torch.func`` transform one read per check, of the
    tensor under its wrappers (grad and jvp levels, vmap's batch dimension), which hold no storage to read
    ("Cannot access data pointer of Tensor that doesn't have storage": under every ``vmap``, and under ``grad`` on
    torch <= 2.8, where even a stack of the unwrapped values is wrapped again); under ``vmap`` a check then covers
    every sample."""
    functorch = torch._C._functorch
    if functorch.peek_interpreter_stack() is None:
        return torch.stack([c.reshape(()) for _, c in checks]).cpu().tolist()
    values = []
    for _, check in checks:
        while functorch.is_functorch_wrapped_tensor(check):
            check = functorch.get_unwrapped(check)
        values.append(bool(check.all()))
    return values


def run_value_checks(checks: list[tuple[str, torch.Tensor]]) -> None:
    """Evaluate all 0-dim bool checks with one host sync (one per check inside ``torch.func`` transforms); raise
    naming every failed one."""
    if not checks:
        return
    flags = _check_values(checks)
    failed = [msg for (msg, _), ok in zip(checks, flags) if not ok]
    if failed:
        _fail("; ".join(failed))


def binary_mask(mask: torch.Tensor, name: str, check: bool = True) -> torch.Tensor:
    """``mask`` as bool for the adapters whose peers take a 0/1 float or int mask: values other than 0 and 1
    (a weighted mask, which Liger and verl would use as weights) raise instead of being rounded to 1
    (one host sync when ``check`` and not compiling; bool masks pass as they are)."""
    if mask.dtype == torch.bool:
        return mask
    if check and not _is_compiling():
        run_value_checks([binary_mask_check(mask, name)])
    return mask != 0


def binary_mask_check(mask: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
    """:func:`binary_mask`'s value check, for a caller that batches it into its own :func:`run_value_checks`."""
    return (f"{name} must contain only 0 and 1 (fused_rl does not weight tokens)",
            ((mask == 0) | (mask == 1)).all())


# The value checks of the per-token arguments, as ``(message, 0-dim bool)`` for :func:`run_value_checks`, read only
# where ``valid`` (a (B, T) bool) is set: padding may hold anything. ``mask_name`` names the mask in the messages.
def advantages_check(advantages: torch.Tensor, valid: torch.Tensor, name: str = "advantages",
                     mask_name: str = "mask") -> tuple[str, torch.Tensor]:
    """Finite ``(B, T)`` or per-sequence ``(B,)`` advantages (the latter where the row has a valid token)."""
    where = valid if advantages.dim() == 2 else valid.any(dim=1)
    return (f"{name} contain NaN or inf where {mask_name} is set", (torch.isfinite(advantages) | ~where).all())


def logprob_checks(x: torch.Tensor, valid: torch.Tensor, name: str, mask_name: str = "mask",
                   unscored_nan: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Finite log-probs ``<= LOGPROB_SLACK``; with ``unscored_nan`` (rollout log-probs) NaN passes: a token the
    inference engine did not score."""
    finite = ~torch.isinf(x) if unscored_nan else torch.isfinite(x)
    return [(f"{name} contain {'inf' if unscored_nan else 'NaN or inf'} where {mask_name} is set",
             (finite | ~valid).all()),
            (f"{name} must be log-probabilities (<= 0) where {mask_name} is set, got values above {LOGPROB_SLACK} "
             "(a negative log-likelihood, -log p?)", ~((x > LOGPROB_SLACK) & valid).any())]


def weights_check(weights: torch.Tensor, valid: torch.Tensor, name: str = "rollout_is_weights",
                  mask_name: str = "mask") -> tuple[str, torch.Tensor]:
    """Finite importance weights ``>= 0``, ``(B, T)`` or per-sequence ``(B,)``."""
    where = valid if weights.dim() == 2 else valid.any(dim=1)
    return (f"{name} must be finite and >= 0 where {mask_name} is set",
            ((torch.isfinite(weights) & (weights >= 0)) | ~where).all())


def check_chunk_size(chunk_size) -> None:
    """A peer's ``chunk_size`` that fused_rl's fused pass does not use (verl's chunked entropies, its
    ``FusedLinearForPPO``): a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        _fail(f"chunk_size must be a positive int, got {chunk_size!r}")


def positive_integer(value, name: str):
    """A peer's process count or length option (``dp_size``, ``loss_scale_factor``): a positive integer (``3.0`` is
    3); a tensor passes unread (no host sync)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value >= 1 and float(value).is_integer()):
        _fail(f"{name} must be a positive integer, got {value!r}")
    return int(value)


Named = tuple[str, Optional[torch.Tensor]]


def adapter_inputs(shape: tuple, device: torch.device, device_owner: str, check_inputs: bool, *,
                   logprobs: tuple[Named, ...], advantages: Named, mask: Named,
                   weights: Optional[Named] = None) -> torch.Tensor:
    """Checks of a peer adapter's per-token arguments ``(name, tensor)``, named as the peer names them; returns the
    boolean mask. ``logprobs`` (required), ``mask`` ``(B, T) = shape``, ``advantages`` and ``weights`` (optional)
    ``(B, T)`` or per sequence ``(B,)``, all on ``device``; with ``check_inputs`` (one host sync) a 0/1 mask and,
    where it is set, finite advantages, finite log-probs ``<= LOGPROB_SLACK`` and finite weights ``>= 0`` (padding
    is not read)."""
    (mask_name, mask_tensor), (adv_name, adv) = mask, advantages
    per_seq = (adv_name,) + ((weights[0],) if weights is not None else ())
    for name, x in (*logprobs, advantages, mask) + ((weights,) if weights is not None else ()):
        if x is None and (weights is None or name != weights[0]):
            _fail(f"{name} is required")
        _check_per_token(x, name, shape, device, allow_seq=name in per_seq, device_owner=device_owner)
        if x is not None and name != mask_name and not x.is_floating_point():
            _fail(f"{name} must be a floating tensor, got {x.dtype}")
    if mask_tensor.is_complex():
        _fail(f"{mask_name} must be boolean or 0/1 numbers, got {mask_tensor.dtype}")
    valid = binary_mask(mask_tensor, mask_name, check=False)
    if check_inputs and not _is_compiling():
        checks = [] if mask_tensor.dtype == torch.bool else [binary_mask_check(mask_tensor, mask_name)]
        checks.append(advantages_check(adv, valid, name=adv_name, mask_name=mask_name))
        for name, x in logprobs:
            checks += logprob_checks(x, valid, name, mask_name=mask_name)
        if weights is not None and weights[1] is not None:
            checks.append(weights_check(weights[1], valid, name=weights[0], mask_name=mask_name))
        run_value_checks(checks)
    return valid


def target_logit_check(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                       temperature: float = 1.0) -> tuple[str, torch.Tensor]:
    """On-policy, no valid target whose logit over ``temperature`` is ``-inf`` (in fp32 at least, as the kernels
    scale it: a finite ``finfo.min`` bias at ``temperature < 1`` is one): the sampled token would have probability 0
    under ``logits``, its log-prob ``-inf`` and the ratio ``exp(logp - sg(logp)) = exp(-inf + inf)`` undefined (the
    backends disagreed there: NaN or 1), also in a row of only ``-inf``. Off-policy such a token is ``r = 0``, a
    defined loss. Reads the ``B T`` target logits only (a NaN or ``+inf`` logit is an undefined row, NaN on every
    backend, and an all ``-inf`` row off-policy too)."""
    safe = torch.where(valid, targets, torch.zeros_like(targets)).clamp(0, logits.shape[-1] - 1)
    picked = logits.gather(-1, safe.unsqueeze(-1).long()).squeeze(-1)
    scaled = picked.to(torch.promote_types(picked.dtype, torch.float32)) / temperature
    return ("targets have logit -inf (over the temperature) where mask is set (on-policy: old_logprobs=None): the "
            "sampled token has probability 0 under these logits (a token banned here that the sampler did not ban?), "
            "its log-prob is -inf and the on-policy ratio exp(logp - sg(logp)) undefined",
            ~(torch.isneginf(scaled) & valid).any())


def check_temperature(temperature) -> None:
    """A finite real ``>= MIN_TEMPERATURE`` (Python or numpy scalar; not a bool or a tensor)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(temperature, np.ndarray) and _is_compiling():
        # torch.compile traces a numpy scalar as an array, whose value it does not know (a repr of it broke the graph)
        _fail("temperature: torch.compile traces a numpy scalar as an array, of unknown value: pass a Python float")
    # comparisons, not math.isfinite: torch.compile traces them on a symbolic float (NaN fails both)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            -math.inf < _real(temperature) < math.inf):
        _fail(f"temperature must be a finite number >= {MIN_TEMPERATURE}, got {temperature!r}")
    if temperature < MIN_TEMPERATURE:
        _fail(f"temperature must be a finite number >= {MIN_TEMPERATURE} (below it samplers decode greedily: no "
              f"distribution to take log-probs of), got {temperature!r}")


def token_logprobs_checks(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          check_inputs: bool) -> None:
    check_logits(logits)
    check_targets(targets, logits)
    check_temperature(temperature)
    if check_inputs and not _is_compiling():
        run_value_checks([(f"targets must be in [0, {logits.shape[-1]}) or {IGNORE_INDEX}",
                           target_range_ok(targets, logits.shape[-1]))])


@dataclass
class PolicyInputs:
    """Normalized per-token inputs of the loss, all ``(B, T)`` on the logits' device.

    ``mask`` is boolean and already excludes ``IGNORE_INDEX`` targets (and truncated completions with
    ``config.mask_truncated_completions``); ``advantages``, ``old``, ``ref`` and ``rollout`` are fp32
    (fp64 if the logits are fp64) and detached (constants of the loss: no gradient reaches a value head
    through the advantages on any backend), as is a tensor ``token_normalizer``; ``targets`` keep their
    dtype.
    """

    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    token_normalizer: Normalizer
    rollout: Optional[torch.Tensor] = None
    #: caller-computed importance weights of the policy term (``rollout_is_weights``), ``(B, T)``
    is_weights: Optional[torch.Tensor] = None

    @property
    def kernel_advantages(self) -> torch.Tensor:
        """``A * rollout_is_weights`` (or ``A``): the advantages the single-pass kernels read. Their
        token-local policy terms (ppo_clip with dual clip / delta, sapo, cispo, dppo, reinforce) are positively
        homogeneous in ``A`` (``pg(c A) = c pg(A)`` for ``c >= 0``, gradient included), so the weights fold
        into the advantages; the KL and entropy terms do not read ``A``. Metrics keep ``advantages``."""
        return self.advantages if self.is_weights is None else self.advantages * self.is_weights


def _noting_cast(make_checks, x: torch.Tensor, converted: torch.Tensor,
                 compute_dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The checks ``make_checks(converted)`` of ``x`` converted to ``compute_dtype`` (what the loss reads). Where
    the conversion can overflow (fp64 values beyond fp32's range become inf), each message says so when only the
    conversion fails it (the raw ``x`` passes); a value bad already in ``x`` (a NaN) gets the plain message."""
    checks = make_checks(converted)
    if not (x.is_floating_point() and torch.finfo(x.dtype).max > torch.finfo(compute_dtype).max):
        return checks
    note = f" (as {compute_dtype}, the dtype of the loss: {x.dtype} values beyond its range become inf)"
    return [entry for (msg, ok), (_, ok_raw) in zip(checks, make_checks(x.detach()))
            for entry in ((msg, ok_raw), (msg + note, ok | ~ok_raw))]


def _check_per_token(x: Optional[torch.Tensor], name: str, shape: tuple, device: torch.device,
                     allow_seq: bool = False, device_owner: str = "logits are") -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        _fail(f"{name} is on {x.device} but {device_owner} on {device}")
    ok_shapes = [shape, shape[:1]] if allow_seq else [shape]
    if tuple(x.shape) not in ok_shapes:
        want = " or ".join(str(s) for s in ok_shapes)
        _fail(f"{name} must have shape {want}, got {tuple(x.shape)}")


def prepare_policy_inputs(
    logits_shape: tuple,
    device: torch.device,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    config: PolicyLossConfig,
    token_normalizer: Normalizer,
    compute_dtype: torch.dtype,
    check_inputs: bool,
    rollout_logprobs: Optional[torch.Tensor] = None,
    truncated: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    logits: Optional[torch.Tensor] = None,
) -> PolicyInputs:
    """Validate the per-token arguments of ``policy_loss`` and bring them to one form.

    ``logits_shape`` is ``(B, T, V)`` (for the linear loss: ``(B, T, vocab)`` of the virtual logits); ``logits``,
    when given, are read at the targets for the value checks (on-policy, a sampled token whose logit is ``-inf``).
    """
    if len(logits_shape) != 3:
        _fail(f"logits must have shape (B, T, V), got {tuple(logits_shape)}")
    batch, length, vocab = logits_shape
    shape = (batch, length)
    if not isinstance(config, PolicyLossConfig):
        _fail(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in INDEX_DTYPES:
        _fail(f"targets must be an int32 or int64 tensor, got {getattr(targets, 'dtype', type(targets).__name__)}")
    _check_per_token(targets, "targets", shape, device)
    if advantages is None:
        _fail("advantages are required")
    _check_per_token(advantages, "advantages", shape, device, allow_seq=True)
    if not advantages.is_floating_point():
        _fail(f"advantages must be a floating tensor, got {advantages.dtype}")
    if mask is None:
        _fail("mask is required (use torch.ones_like(targets, dtype=torch.bool) for no padding)")
    _check_per_token(mask, "mask", shape, device)
    if mask.is_complex():
        _fail(f"mask must be boolean or 0/1 numbers, got {mask.dtype}")
    per_token = ((old_logprobs, "old_logprobs"), (ref_logprobs, "ref_logprobs"), (rollout_logprobs, "rollout_logprobs"))
    for x, name in per_token:
        _check_per_token(x, name, shape, device)
        if x is not None and not x.is_floating_point():
            _fail(f"{name} must be a floating tensor, got {x.dtype}")
    _check_per_token(rollout_is_weights, "rollout_is_weights", shape, device, allow_seq=True)
    if rollout_is_weights is not None and config.policy_loss == "vespo":
        _fail("policy_loss='vespo' folds importance weights into its sequence weight (log-space, as TRL): pass the "
              "sampler's log-probs as rollout_logprobs with config.rollout_is instead of rollout_is_weights")
    if rollout_is_weights is not None and not rollout_is_weights.is_floating_point():
        _fail(f"rollout_is_weights must be a floating tensor, got {rollout_is_weights.dtype}")
    if config.kl is not None and ref_logprobs is None:
        _fail(f"config.kl={config.kl!r} needs ref_logprobs")
    if config.rollout_is is not None and rollout_logprobs is None:
        _fail(f"config.rollout_is={config.rollout_is!r} needs rollout_logprobs (the sampler's log-probs)")
    if rollout_logprobs is not None and not config.uses_rollout_logprobs:
        _fail("rollout_logprobs are only used with config.rollout_is or config.off_policy_mask; set one of them")
    if config.mask_truncated_completions:
        if truncated is None:
            _fail("config.mask_truncated_completions needs truncated, a (B,) bool tensor of truncated completions")
        _check_per_token(truncated, "truncated", shape[:1], device)
        if truncated.dtype != torch.bool:
            _fail(f"truncated must be a bool tensor, got {truncated.dtype}")
    elif truncated is not None:
        _fail("truncated is only used with config.mask_truncated_completions=True")
    if token_normalizer is not None:
        if config.agg != "token-mean":
            _fail(f"token_normalizer only applies to agg='token-mean', not {config.agg!r}")
        np = sys.modules.get("numpy")
        if np is not None and isinstance(token_normalizer, np.ndarray):
            # an array, or a numpy scalar as torch.compile traces it (an ndarray, not a numbers.Real)
            if not _is_compiling() and token_normalizer.dtype.kind not in "iufb":  # bool: refused as a tensor
                _fail(f"token_normalizer must be a real number or tensor, got a numpy {token_normalizer.dtype}")
            token_normalizer = torch.as_tensor(token_normalizer)
        if isinstance(token_normalizer, torch.Tensor):
            if token_normalizer.numel() != 1:
                _fail(f"token_normalizer must be a scalar, got shape {tuple(token_normalizer.shape)}")
            if token_normalizer.dtype == torch.bool:  # as a Python True is refused: not a count
                _fail("token_normalizer must be a number, got a bool tensor")
            if token_normalizer.is_complex():  # .to(float32) would drop the imaginary part
                _fail(f"token_normalizer must be a real number or tensor, got {token_normalizer.dtype}")
            check_not_meta(token_normalizer, "token_normalizer")
            token_normalizer = token_normalizer.detach().reshape(()).to(device=device, dtype=torch.float32)
        elif isinstance(token_normalizer, bool) or not isinstance(token_normalizer, numbers.Real) \
                or not FP32_POSITIVE_FINITE[0] < _real(token_normalizer) < FP32_POSITIVE_FINITE[1]:
            _fail("token_normalizer must be a positive finite number or tensor, positive and finite in fp32 (the loss "
                  f"divides by it there), got {token_normalizer!r}")
        else:
            token_normalizer = float(token_normalizer)

    # the loss reads these in compute_dtype: checked as converted (fp64 1e300 is finite, as fp32 it is inf)
    adv = advantages.detach().to(compute_dtype)
    old, ref, rollout = (None if x is None else x.detach().to(compute_dtype) for x, _ in per_token)
    weights = None if rollout_is_weights is None else rollout_is_weights.detach().to(compute_dtype)

    bool_mask = mask if mask.dtype == torch.bool else mask != 0
    valid = bool_mask & (targets != IGNORE_INDEX)
    if truncated is not None:
        valid = valid & ~truncated.unsqueeze(1)
    if check_inputs and not _is_compiling():
        checks = [(f"targets must be in [0, {vocab}) (or {IGNORE_INDEX}) where mask is set",
                   target_range_ok(targets, vocab, bool_mask))]
        if mask.dtype != torch.bool:
            checks.append(("mask must contain only 0 and 1", ((mask == 0) | (mask == 1)).all()))
        checks += _noting_cast(lambda a: [advantages_check(a, valid)], advantages, adv, compute_dtype)
        for (x, name), converted in zip(per_token, (old, ref, rollout)):
            if x is not None:
                checks += _noting_cast(
                    lambda y, name=name: logprob_checks(y, valid, name, unscored_nan=name == "rollout_logprobs"),
                    x, converted, compute_dtype)
        if rollout_is_weights is not None:
            checks += _noting_cast(lambda w: [weights_check(w, valid)], rollout_is_weights, weights, compute_dtype)
        if logits is not None and old_logprobs is None:
            checks.append(target_logit_check(logits, targets, valid, config.temperature))
        if isinstance(token_normalizer, torch.Tensor):
            checks.append(("token_normalizer must be positive and finite in fp32 (a tensor normalizer is cast to it)",
                           torch.isfinite(token_normalizer) & (token_normalizer > 0)))
        run_value_checks(checks)

    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand(batch, length)
    is_weights = weights
    if is_weights is not None:
        if is_weights.dim() == 1:
            is_weights = is_weights.unsqueeze(1).expand(batch, length)
        # masked positions never reach the loss; neutral there so A * w stays finite
        is_weights = torch.where(valid, is_weights, torch.ones_like(is_weights))
    return PolicyInputs(
        targets=targets,
        advantages=adv,
        mask=valid,
        old=old,
        ref=ref,
        token_normalizer=token_normalizer,
        rollout=rollout,
        is_weights=is_weights,
    )
