"""Triton kernels over vocabulary logits ``(B, T, V)`` (any ``stride(0)``, ``stride(1)``; unit stride along V).

One program per tile of ``BLOCK_N`` rows ``n = b * T + t`` (one row at large vocabularies) on grid axis 0
(up to 2^31 - 1 programs, no 65,535 limit); all pointer offsets are int64. Per row, with ``z = x / tau``
accumulated in fp32 whatever the input dtype:

* **stats** (one read of the row): online raw max ``m = max x``, ``s = sum exp((x - m) / tau)`` and
  ``q = sum exp((x - m) / tau) (x - m) / tau`` over blocks of ``BLOCK_V`` (``m`` starts at ``-inf``, masked
  lanes load ``-inf``; ``m`` is subtracted before the scaling by ``1 / tau``, so large ``|x|`` costs no
  accuracy), giving ``logp = (x_target - m) / tau - log s`` and ``H = -sum p log p = log s - q / s``;
  ``m`` and ``log s`` (as ``log2 s``) are saved apart (``lse = m / tau + log s`` rounded to one fp32 loses
  ``log s`` when ``|m|`` is large, and with it ``1 - p`` of a near-certain token);
* **grad** (one read + one write): ``dlogits_j = (g_logp (onehot_j - p_j) + g_H p_j (E[z] - z_j)) / tau``
  with ``p_j = exp((x_j - m) / tau - log s)`` and ``E[z] - z_j = -H - log p_j``, from the saved ``m``,
  ``log s`` (and ``H``);
* **fused policy loss** (stats loop, then the epilogue of :mod:`fused_rl.kernels.epilogue` on the
  row's scalars, then the grad loop with ``g_logp = w dl/dlogp``, ``g_H = w dl/dH``): reads the
  per-token ``A, w`` and, where the epilogue's constexprs use them, ``old``, ``ref`` and the rollout
  log-probs; writes the per-token ``logp, H, w l, r, kl`` and ``dlogits`` (optionally over the logits
  themselves);
* **split single pass** (``SPLIT_CHUNK`` set, a tuning knob off until measured on a GPU): the fused policy loss
  with each row's ``SPLIT_CHUNK``-column chunks on programs of their own, which wait for each other between the
  statistics and the gradient (:func:`_policy_split_kernel`): the logits read from memory once, not twice.

Rows whose target is ``IGNORE_INDEX`` (the callers also set it at masked positions) read nothing and
get ``logp = H = 0`` and zero ``dlogits``. A valid row whose softmax is undefined (a NaN or ``+inf``
``z``, or every ``z = -inf``) gets ``log s = logp = H = NaN`` and a NaN ``dlogits`` row, as
``log_softmax`` of the reference gives (a ``-inf`` in a finite row is ``p = 0``, nothing more).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .epilogue import expm1, token_epilogue

IGNORE_INDEX = tl.constexpr(-100)  # compiled Triton reads only constexpr globals

#: Upper bound of BLOCK_V (None: the heuristic of :func:`block_config`). Tests set a small value.
MAX_BLOCK_V: Optional[int] = None
#: Cap on the number of programs (grid axis 0); each program loops over row tiles ``pid, pid + grid, ...``.
#: None: one program per tile. A cap of a few programs per SM bounds the rows in flight, so the second
#: read of a row (the gradient loop) can hit L2; ``bench/gpu_logits_bench.py`` measures both.
MAX_PROGRAMS: Optional[int] = None
#: Override of num_warps (None: the heuristic of :func:`block_config`).
NUM_WARPS: Optional[int] = None
#: Elements of one ``BLOCK_N x BLOCK_V`` tile: small vocabularies get several rows per program.
TILE_ELEMENTS = 4096
#: The single pass's gradient loop over a row's blocks from its end: the blocks the statistics loop read
#: last, the likeliest still in L2 (a tuning knob; the results do not change). On by measurement: on an
#: H200 (N = 16384, V = 151936 bf16) with CACHE_HINTS 3.10 ms against 3.27 ms with neither (docs/triton.md).
GRAD_REVERSE = True
#: Cache policy of the single pass: the statistics loop loads ``evict_last`` (the row is read again), the
#: gradient loop loads and stores ``evict_first`` (a tuning knob; the results do not change). On by
#: measurement, with GRAD_REVERSE (alone it was slower: 3.47 ms).
CACHE_HINTS = True
#: The single pass's loops load the next block of the row before they reduce the current one (one block
#: of registers more, twice the loads in flight per thread; the same values in the same order, so the
#: results do not change). A tuning knob for ``bench/gpu_logits_bench.py``'s sweep, not yet measured
#: on a GPU: off until it is.
PREFETCH = False
#: The single pass with each row split over programs of this many columns (:func:`_policy_split_kernel`: the
#: logits read once, each program's chunk kept in registers while the row's programs wait for each other), where
#: it gives a row two or more programs. A tuning knob for ``bench/gpu_logits_bench.py``'s sweep (the results
#: equal the row kernel's to rounding), not yet measured on a GPU: None (off) until it is.
SPLIT_CHUNK: Optional[int] = None
#: num_warps of the split pass (None: ``SPLIT_CHUNK / 4096``, 128 columns a thread, 1 to 16 warps: a program's
#: fixed sm_90 instructions (combining, epilogue, wait; ~740 a warp) count for less the more columns it has: ~18 a
#: column, fewer than the row kernel's ~21, in 168 registers with a 16-bit gradient (bf16 or fp32 logits; 174 for
#: fp32 logits and gradient); ~22 at 64, ~34 at 32).
SPLIT_WARPS: Optional[int] = None
#: Polls of a row's arrival count before a program of the split pass gives up waiting (~1 us each: ~1 s; a
#: row's programs wait for each other microseconds); then every other wait gives up at once, and the loss is NaN.
SPLIT_MAX_POLLS = 1 << 20
#: ``(SPLIT_CHUNK, num_warps)`` pairs that ``bench/gpu_logits_bench.py`` measures and ``bench/compile_sm90.py``
#: compiles, the first also checked at full size there. By sm_90 instruction count (``compile_sm90.py``, bf16,
#: ppo_clip + k3 with entropy, triton 3.9 / 3.6; the row kernel: ~21 a column, ~1.55 ms of issue at N = 16384,
#: V = 151936): 128 columns a thread 18.1 / 19.1 a column (1.35-1.4 ms of issue, 160-168 registers: 3 programs of
#: 4 warps an SM; fp32 logits and gradient 174: 2), 64 ~22 / 24 (1.65-1.8 ms, 128 registers), 32 ~34 / 38
#: (2.5-2.8 ms), so 128 first, with 4 and 2 warps (10 and 19 programs a row); 256 spill. Each program takes one
#: ticket (an atomic on one address): 2048 columns would be 1.2M of them.
SPLIT_CANDIDATES = ((16384, 4), (8192, 2), (8192, 4), (16384, 8), (32768, 8), (4096, 4))


def block_config(vocab: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_V, num_warps)``: blocks of up to 8192 vocabulary entries for 2-byte logits and
    4096 for fp32 (16 KiB per row block load, 16-32 elements per thread), i.e. 19 / 38 blocks per row at
    V = 151936 with one row per program; ``BLOCK_N = TILE_ELEMENTS // BLOCK_V`` rows (at least 1) per
    program for small vocabularies; 4 warps up to 1024 elements per tile (only with a ``TILE_ELEMENTS`` below its
    4096, as tests set), 8 above. On an H200 at
    N = 16384, V = 151936 bf16 with GRAD_REVERSE and CACHE_HINTS: 8192 x 8 warps 2.99 ms, 4096 x 4 or 8
    3.09-3.10, 16384 x 16 3.07, 8192 x 16 3.16, 2048 x 4 3.34 (docs/triton.md)."""
    cap = MAX_BLOCK_V if MAX_BLOCK_V is not None else (8192 if dtype.itemsize <= 2 else 4096)
    block = max(min(triton.next_power_of_2(vocab), triton.next_power_of_2(cap)), 16)
    rows = max(1, TILE_ELEMENTS // block)
    tile = rows * block
    warps = 4 if tile <= 1024 else 8
    return rows, block, NUM_WARPS or warps


@triton.jit
def _row_offset(rows, T, s0, s1):
    b = rows // T
    t = rows - b * T
    return b * s0 + t * s1


@triton.jit
def _rows(tile, N, BLOCK_N: tl.constexpr):
    rows = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # < N + BLOCK_N: fits int32 before the cast
    return rows, rows < N


@triton.jit
def _load_targets(tgt_ptr, rows, in_rows, V):
    """The rows' targets (int32 or int64 in memory) as int32: ``IGNORE_INDEX`` (also past ``N``) stays, any
    other value outside ``[0, V)`` becomes -1 before the cast (an int64 ``2^32 + 3`` must not wrap to token 3,
    nor ``2^32 - 100`` to ``IGNORE_INDEX``), so the callers' range test gives it a NaN row."""
    raw = tl.load(tgt_ptr + rows, mask=in_rows, other=IGNORE_INDEX)
    return tl.where((raw >= 0) & (raw < V), raw, tl.where(raw == IGNORE_INDEX, IGNORE_INDEX, -1)).to(tl.int32)


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_block(x_ptr, x_off, valid, start, V, BLOCK_V: tl.constexpr, EVICT: tl.constexpr):
    """The ``BLOCK_V`` entries of each row from column ``start`` (``-inf`` outside ``[0, V)`` and on rows
    not ``valid``, which load nothing), in the logits' dtype. The mask keeps the column bounds apart from
    the per-row ``valid`` so that the compiler still proves 16-byte vector loads (V divisible by 16)."""
    cols = start + tl.arange(0, BLOCK_V)
    return tl.load(x_ptr + x_off[:, None] + cols[None, :],
                   mask=valid[:, None] & ((cols[None, :] >= 0) & (cols[None, :] < V)), other=float("-inf"),
                   eviction_policy=EVICT)


@triton.jit
def _row_stats(x_ptr, x_off, in_rows, tgt, valid, V, temperature, BLOCK_N: tl.constexpr,
               BLOCK_V: tl.constexpr, WITH_ENT: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr):
    """``(m, log2 s, logp, H)`` of ``BLOCK_N`` rows starting at ``x_ptr + x_off`` (garbage where not
    ``valid``; the caller masks); ``logp`` and ``H`` in natural log. Ignored rows load nothing.

    The loop works in base 2 on ``u = (x - m) log2(e) / tau`` with ``m = max x``, the raw (unscaled) row max
    (one subtraction, one multiply and one ``exp2`` per element): ``s = sum 2^u``, ``q = sum 2^u u``; then
    ``logp = ln2 (u_t - log2 s)``, ``H = ln2 (log2 s - q / s)``. ``m`` is subtracted before the scaling, so
    ``x - m`` is exact near the max and ``u`` is rounded relative to ``x - m``, not to ``x``: scaling first
    rounds ``x log2(e) / tau`` to ``|x| 2^-24`` (4e-5 nats of log-prob at logits near -1000). The log-sum-exp
    ``m + tau ln2 log2 s`` is never rounded into one number: ``m`` and ``log2 s`` stay apart for the gradient.

    A valid row whose softmax is undefined gets ``log2 s = NaN`` (so ``logp = H = NaN``, and the gradient
    loop writes NaN), found after the loop at no cost in it: ``s`` is NaN when any ``u`` is NaN or
    ``+inf`` (that element's ``2^(u - m)`` is NaN whether or not the block max kept it, and ``s`` keeps
    it: ``alpha`` times NaN is NaN) and 0 when no ``u`` is finite, so ``s > 0`` fails exactly there."""
    scale = LOG2E / temperature
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    q = tl.zeros([BLOCK_N], tl.float32)
    # a tile without a valid row skips the loop
    n_cols = tl.where(tl.max(valid.to(tl.int32), axis=0) > 0, V, 0)
    if PREFETCH:  # block 0 before the loop; each iteration loads the next (past V: masked, reads nothing)
        x_next = _load_block(x_ptr, x_off, valid, 0, V, BLOCK_V, EVICT)
    for start in range(0, n_cols, BLOCK_V):
        if PREFETCH:
            x_raw = x_next
            x_next = _load_block(x_ptr, x_off, valid, start + BLOCK_V, V, BLOCK_V, EVICT)
        else:
            x_raw = _load_block(x_ptr, x_off, valid, start, V, BLOCK_V, EVICT)
        m, s, q, _, _ = _block_update(x_raw, m, s, q, scale, WITH_ENT)
    # in-row address even for ignored rows; rows past N (valid is False there too) load nothing, and so
    # does a target outside [0, V) (only with check_inputs=False): NaN logp, as the C++ kernels give
    in_vocab = (tgt >= 0) & (tgt < V)
    xt = tl.load(x_ptr + x_off + tl.where(valid & in_vocab, tgt, 0), mask=in_rows & in_vocab,
                 other=float("nan")).to(tl.float32)
    return _finish_stats(m, s, q, valid, xt, scale, WITH_ENT)


@triton.jit
def _block_update(x_raw, m, s, q, scale, WITH_ENT: tl.constexpr):
    """``(m, s, q, 2^u, u)`` of each row of ``x_raw`` (``BLOCK_N x BLOCK_V``, in the logits' dtype) after one more
    block of it: ``m`` the raw max so far (``-inf`` before any finite entry), ``s = sum 2^u``, ``q = sum 2^u u`` with
    ``u = (x - m) scale`` relative to the new max (``m`` taken as 0 while ``-inf``); the old sums are rescaled by
    ``alpha = 2^((m_old - m) scale)`` (``q`` also gains ``(m_old - m) scale s``). The block's ``2^u`` and ``u``
    are for the split pass's gradient (:func:`_chunk_grad`); the row kernel's loop drops them."""
    xf = x_raw.to(tl.float32)
    m_new = tl.maximum(m, tl.max(xf, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * scale)
    uc = (xf - m_safe[:, None]) * scale
    e = tl.exp2(uc)
    if WITH_ENT:
        # clamped where alpha = 2^shift is 0 anyway: shift * s overflowed to -inf (a max gap over ~1e33 tau)
        # and alpha * -inf made H NaN
        shift = tl.where(s > 0.0, tl.maximum((m - m_safe) * scale, -256.0), 0.0)
        # no 0 * -inf: where e > 0, uc > -150 (one max, not a compare and a select, per element)
        q = alpha * (q + shift * s) + tl.sum(e * tl.maximum(uc, -1e30), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, q, e, uc


@triton.jit
def _finish_stats(m, s, q, valid, xt, scale, WITH_ENT: tl.constexpr):
    """``(m, log2 s, logp, H)`` of rows from their statistics ``(m, s, q)`` (:func:`_block_update`) and target
    logits ``xt`` (NaN where none was read): ``m`` 0 where ``-inf``; ``s`` NaN on a valid row unless
    ``s > 0``, 1 on an ignored one."""
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    # ignored rows (nothing loaded): lse = 0 there, masked by the caller; valid rows: NaN unless s > 0
    s = tl.where(s > 0.0, s, tl.where(valid, float("nan"), 1.0))
    log2_s = tl.log2(s)
    logp = LN2 * ((xt - m_fin) * scale - log2_s)
    # log p <= 0 (FMA contraction of ut can round it to +1e-8 for a near-certain token); NaN passes
    logp = tl.where(logp > 0.0, 0.0, logp)
    ent = tl.zeros_like(logp)
    if WITH_ENT:
        ent = LN2 * (log2_s - q / s)
        ent = tl.where(ent < 0.0, 0.0, ent)  # H >= 0 (its cancellation near a one-hot row gives -1e-8); NaN passes
    return m_fin, log2_s, logp, ent


@triton.jit
def _block_start(k, n_blocks, BLOCK_V: tl.constexpr, REVERSE: tl.constexpr):
    """First column of the gradient loop's ``k``-th block: from the row's start, or its end (``REVERSE``);
    ``k = n_blocks`` gives a block outside the row (``V`` or beyond; ``-BLOCK_V`` reversed)."""
    return (n_blocks - 1 - k) * BLOCK_V if REVERSE else k * BLOCK_V


@triton.jit
def _row_grad(x_ptr, x_off, out_ptr, o_off, in_rows, tgt, valid, V, temperature, m_row, log2_s, ent, g_logp, g_h,
              BLOCK_V: tl.constexpr, GRAD_ENT: tl.constexpr, REVERSE: tl.constexpr, EVICT: tl.constexpr,
              PREFETCH: tl.constexpr):
    """Writes ``(g_logp (onehot - p) + g_h p (E[z] - z)) / tau`` over the rows (zeros where not ``valid``).

    Per element, in base 2 (``d = (x - m) log2(e) / tau - log2 s``, ``p = 2^d``):
    ``a onehot - a p + b p (E[u] - u)`` with ``E[u] - u = -H log2(e) - d`` (``m`` the raw row max of
    :func:`_row_stats`, subtracted before the scaling) and the per-row
    ``a = g_logp / tau``, ``b = g_h ln2 / tau``: no division in the loop, and no rounding of
    ``m + log2 s`` (``1 - p`` of a near-certain token stays exact at any ``|u|``)."""
    scale = LOG2E / temperature
    in_vocab = (tgt >= 0) & (tgt < V)
    xt = tl.load(x_ptr + x_off + tl.where(valid & in_vocab, tgt, 0), mask=valid & in_vocab,
                 other=0.0).to(tl.float32)
    # in place (out = x) a block store of another warp may overwrite the target's logit: every thread has read
    # it before any stores
    tl.debug_barrier()
    a, b, h2, one_minus_pt = _grad_coefs(tgt, valid, V, temperature, xt, m_row, log2_s, ent, g_logp, g_h)
    n_blocks = tl.cdiv(V, BLOCK_V)
    if PREFETCH:  # the first block before the loop; each iteration loads the next (none past the row)
        x_next = _load_block(x_ptr, x_off, valid, _block_start(0, n_blocks, BLOCK_V, REVERSE), V, BLOCK_V, EVICT)
    for k in range(0, n_blocks):  # ignored rows load nothing and store zeros
        start = _block_start(k, n_blocks, BLOCK_V, REVERSE)
        cols = start + tl.arange(0, BLOCK_V)
        if PREFETCH:
            x_raw = x_next
            x_next = _load_block(x_ptr, x_off, valid, _block_start(k + 1, n_blocks, BLOCK_V, REVERSE), V, BLOCK_V,
                                 EVICT)
        else:
            x_raw = _load_block(x_ptr, x_off, valid, start, V, BLOCK_V, EVICT)
        g = _grad_block(x_raw, m_row, log2_s, a, b, h2, scale, GRAD_ENT)
        tl.store(out_ptr + o_off[:, None] + cols[None, :], g.to(out_ptr.dtype.element_ty),
                 mask=in_rows[:, None] & (cols[None, :] < V), eviction_policy=EVICT)
    _store_target_grad(out_ptr, o_off, tgt, valid & in_vocab & in_rows, xt, m_row, log2_s, a, b, h2, one_minus_pt,
                       scale, GRAD_ENT)


@triton.jit
def _grad_coefs(tgt, valid, V, temperature, xt, m_row, log2_s, ent, g_logp, g_h):
    """The per-row ``(a, b, H log2(e), 1 - p_target)`` of :func:`_grad_block`: ``a = g_logp / tau``,
    ``b = g_h ln2 / tau`` (0 on rows not ``valid``; ``a`` NaN for a target outside ``[0, V)``, only with
    ``check_inputs=False``: a NaN row), the target's ``1 - p`` by expm1 (a near-certain token's ``1 - p`` is
    below the error of exp2) from its logit ``xt`` (ignored where the row is not valid or the target outside)."""
    in_vocab = (tgt >= 0) & (tgt < V)
    a = tl.where(valid, tl.where(in_vocab, g_logp / temperature, float("nan")), 0.0)
    b = tl.where(valid, g_h * (LN2 / temperature), 0.0)
    xt = tl.where(valid & in_vocab, xt, 0.0)
    one_minus_pt = -expm1(_log2_p(xt, m_row, log2_s, LOG2E / temperature) * LN2)
    return a, b, ent * LOG2E, one_minus_pt


@triton.jit
def _log2_p(x, m_row, log2_s, scale):
    """``log2 p = (x - m) scale - log2 s`` of logits ``x`` (fp32) of a row with statistics ``m``, ``log2 s``."""
    return (x - m_row) * scale - log2_s


@triton.jit
def _entropy_grad(p, d, b, h2):
    """The entropy's part of an entry's gradient, ``b p (E[u] - u)`` with ``E[u] - u = -H log2(e) - d``, ``d = log2 p``
    (0 where ``p = 0``: no ``0 * inf``)."""
    return b * p * tl.where(p > 0.0, -h2 - d, 0.0)


@triton.jit
def _grad_block(x_raw, m_row, log2_s, a, b, h2, scale, GRAD_ENT: tl.constexpr):
    """``dlogits`` (fp32) of a ``BLOCK_N x BLOCK_V`` block but at the target (``x_raw`` ``-inf`` outside the row and
    on ignored rows: 0 there): ``-a p + b p (E[u] - u)`` (:func:`_row_grad`); the target's entry, ``a`` more, is
    :func:`_store_target_grad`'s (no compare and select per element)."""
    d = _log2_p(x_raw.to(tl.float32), m_row[:, None], log2_s[:, None], scale)
    p = tl.exp2(d)  # 0 on masked lanes and ignored rows (x = -inf there)
    g = -a[:, None] * p
    if GRAD_ENT:
        g += _entropy_grad(p, d, b[:, None], h2[:, None])
    return g


@triton.jit
def _chunk_grad(e, u, m_k, m_row, log2_s, a, b, h2, scale, GRAD_ENT: tl.constexpr):
    """:func:`_grad_block` of a split-pass chunk from its statistics' terms (:func:`_block_update` with ``m = m_k``,
    the chunk's max): ``log2 p = u + c`` with ``c = (m_k - m) scale - log2 s`` per row, so ``p = 2^u 2^c``, one
    multiply an entry (no second ``exp2``) where the entropy has no gradient (``-a p = 2^u (-a 2^c)``); with it,
    ``-a p + b p (E[u] - u)`` at ``log2 p = u + c``. ``c <= 0`` (``m_k <= m``, ``s >= 1``), ``-inf`` for a chunk of
    ``-inf`` (``m`` is taken as 0 only where the whole row is): ``2^c`` is never inf, so no ``0 * inf``. One
    difference from :func:`_grad_block`, where the loss is infinite anyway: at an infinite ``a`` (k3 of ``d > 88``)
    an entry whose ``p`` underflows to 0 but ``2^u`` does not is ``inf`` here, NaN there (``inf * 0``)."""
    c = (m_k - m_row) * scale - log2_s
    if GRAD_ENT:
        d = u + c[:, None]
        p = tl.exp2(d)
        g = -a[:, None] * p + _entropy_grad(p, d, b[:, None], h2[:, None])
    else:
        g = e * (-a * tl.exp2(c))[:, None]
    return g


@triton.jit
def _store_target_grad(out_ptr, o_off, tgt, store, xt, m_row, log2_s, a, b, h2, one_minus_pt, scale,
                       GRAD_ENT: tl.constexpr):
    """Overwrites the target entry of each row where ``store`` (valid, in-vocabulary target; in the program that
    wrote that entry's block) with ``a (1 - p_t) + b p_t (E[u] - u_t)``, ``1 - p_t`` by expm1 (:func:`_grad_coefs`),
    after a barrier: the block store that wrote ``-a p_t`` there may be another thread's."""
    g = a * one_minus_pt
    if GRAD_ENT:
        d = _log2_p(xt, m_row, log2_s, scale)
        g += _entropy_grad(tl.exp2(d), d, b, h2)
    tl.debug_barrier()
    tl.store(out_ptr + o_off + tl.where(store, tgt, 0), g.to(out_ptr.dtype.element_ty), mask=store)


@triton.jit
def _stats_kernel(x_ptr, xs0, xs1, N, T, V, tgt_ptr, logp_ptr, ent_ptr, lse_ptr, temperature,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENT: tl.constexpr):
    for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rows, in_rows = _rows(tile, N, BLOCK_N)
        tgt = _load_targets(tgt_ptr, rows, in_rows, V)
        valid = tgt != IGNORE_INDEX
        m_row, log2_s, logp, ent = _row_stats(x_ptr, _row_offset(rows, T, xs0, xs1), in_rows, tgt, valid, V,
                                           temperature, BLOCK_N, BLOCK_V, WITH_ENT, "", False)
        tl.store(logp_ptr + rows, tl.where(valid, logp, 0.0), mask=in_rows)
        tl.store(lse_ptr + rows, tl.where(valid, m_row, 0.0), mask=in_rows)
        tl.store(lse_ptr + N + rows, tl.where(valid, log2_s, 0.0), mask=in_rows)
        if WITH_ENT:
            tl.store(ent_ptr + rows, tl.where(valid, ent, 0.0), mask=in_rows)


@triton.jit
def _grad_kernel(x_ptr, xs0, xs1, N, T, V, tgt_ptr, out_ptr, os0, os1, lse_ptr, glogp_ptr, ent_ptr, gent_ptr,
                 temperature, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GRAD_ENT: tl.constexpr):
    for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rows, in_rows = _rows(tile, N, BLOCK_N)
        tgt = _load_targets(tgt_ptr, rows, in_rows, V)
        valid = tgt != IGNORE_INDEX
        m_row = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
        log2_s = tl.load(lse_ptr + N + rows, mask=in_rows, other=0.0)
        g_logp = tl.load(glogp_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
        ent = tl.zeros([BLOCK_N], tl.float32)
        g_h = tl.zeros([BLOCK_N], tl.float32)
        if GRAD_ENT:
            ent = tl.load(ent_ptr + rows, mask=in_rows, other=0.0)
            g_h = tl.load(gent_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
        _row_grad(x_ptr, _row_offset(rows, T, xs0, xs1), out_ptr, _row_offset(rows, T, os0, os1), in_rows, tgt,
                  valid, V, temperature, m_row, log2_s, ent, g_logp, g_h, BLOCK_V, GRAD_ENT, False, "", False)


@triton.jit
def _policy_kernel(x_ptr, xs0, xs1, N, T, V, tgt_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rollout_ptr, out_ptr, os0,
                   os1, logp_ptr, ent_ptr, loss_ptr, ratio_ptr, kl_ptr, temperature,
                   clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta, entropy_coef, ris_min, ris_max,
                   kl_clamp, kl_is_clip,
                   POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_DELTA: tl.constexpr, KL: tl.constexpr,
                   KL_ST: tl.constexpr, ADD_KL: tl.constexpr, KL_BIAS: tl.constexpr, KL_CLAMP: tl.constexpr,
                   KL_IS: tl.constexpr, ROLLOUT: tl.constexpr,
                   HAS_RIS_MIN: tl.constexpr, HAS_RIS_MAX: tl.constexpr, ADD_ENT: tl.constexpr,
                   ON_POLICY: tl.constexpr, WITH_ENT: tl.constexpr, WRITE_GRAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, REVERSE: tl.constexpr, HINTS: tl.constexpr,
                   PREFETCH: tl.constexpr):
    for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rows, in_rows = _rows(tile, N, BLOCK_N)
        tgt = _load_targets(tgt_ptr, rows, in_rows, V)
        valid = tgt != IGNORE_INDEX
        x_off = _row_offset(rows, T, xs0, xs1)
        m_row, log2_s, logp, ent = _row_stats(x_ptr, x_off, in_rows, tgt, valid, V, temperature, BLOCK_N, BLOCK_V,
                                           WITH_ENT, "evict_last" if HINTS else "", PREFETCH)
        g_logp, g_h = _token_outputs(
            rows, in_rows, in_rows, valid, logp, ent, adv_ptr, w_ptr, old_ptr, ref_ptr, rollout_ptr, logp_ptr, ent_ptr,
            loss_ptr, ratio_ptr, kl_ptr, clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta, entropy_coef,
            ris_min, ris_max, kl_clamp, kl_is_clip, POLICY, HAS_DUAL, HAS_DELTA, KL, KL_ST, ADD_KL, KL_BIAS,
            KL_CLAMP, KL_IS, ROLLOUT, HAS_RIS_MIN, HAS_RIS_MAX, ADD_ENT, ON_POLICY, WITH_ENT, False)
        if WRITE_GRAD:
            _row_grad(x_ptr, x_off, out_ptr, _row_offset(rows, T, os0, os1), in_rows, tgt, valid, V, temperature,
                      m_row, log2_s, ent, g_logp, g_h, BLOCK_V, ADD_ENT, REVERSE, "evict_first" if HINTS else "",
                      PREFETCH)


@triton.jit
def _token_outputs(rows, in_rows, store, valid, logp, ent, adv_ptr, w_ptr, old_ptr, ref_ptr, rollout_ptr, logp_ptr,
                   ent_ptr, loss_ptr, ratio_ptr, kl_ptr, clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta,
                   entropy_coef, ris_min, ris_max, kl_clamp, kl_is_clip, POLICY: tl.constexpr, HAS_DUAL: tl.constexpr,
                   HAS_DELTA: tl.constexpr, KL: tl.constexpr, KL_ST: tl.constexpr, ADD_KL: tl.constexpr,
                   KL_BIAS: tl.constexpr, KL_CLAMP: tl.constexpr, KL_IS: tl.constexpr, ROLLOUT: tl.constexpr,
                   HAS_RIS_MIN: tl.constexpr, HAS_RIS_MAX: tl.constexpr, ADD_ENT: tl.constexpr, ON_POLICY: tl.constexpr,
                   WITH_ENT: tl.constexpr, ADD_LOSS: tl.constexpr):
    """The policy kernels' per-token part: reads ``A, w`` (and ``old``, ``ref``, the rollout log-probs where the
    constexprs use them) of ``rows``, runs :func:`~fused_rl.kernels.epilogue.token_epilogue` on the rows'
    ``logp``, ``H`` (0 where not ``valid``), stores ``logp, H, w l, r, kl`` where ``store`` (and ``in_rows``; ``w l``
    added atomically with ``ADD_LOSS``, into zeros), and returns the gradient coefficients
    ``(w dl/dlogp, w dl/dH)``."""
    logp = tl.where(valid, logp, 0.0)
    ent = tl.where(valid, ent, 0.0)
    adv = tl.load(adv_ptr + rows, mask=in_rows, other=0.0)
    w = tl.load(w_ptr + rows, mask=in_rows, other=0.0)
    old = logp
    ref = logp
    rollout = logp
    if not ON_POLICY:
        old = tl.load(old_ptr + rows, mask=in_rows, other=0.0)
    if KL != 0:
        ref = tl.load(ref_ptr + rows, mask=in_rows, other=0.0)
    if ROLLOUT != 0:
        rollout = tl.load(rollout_ptr + rows, mask=in_rows, other=0.0)
    loss, dlogp, dh, ratio, kl = token_epilogue(
        logp, ent, old, ref, rollout, adv, valid, clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta,
        entropy_coef, ris_min, ris_max, kl_clamp, kl_is_clip, POLICY, HAS_DUAL, HAS_DELTA, KL, KL_ST, ADD_KL,
        KL_BIAS, KL_CLAMP, KL_IS, ROLLOUT, HAS_RIS_MIN, HAS_RIS_MAX, ADD_ENT, ON_POLICY)
    out = in_rows & store
    tl.store(logp_ptr + rows, logp, mask=out)
    if WITH_ENT:
        tl.store(ent_ptr + rows, ent, mask=out)
    if ADD_LOSS:
        tl.atomic_add(loss_ptr + rows, w * loss, mask=out, sem="relaxed")
    else:
        tl.store(loss_ptr + rows, w * loss, mask=out)
    tl.store(ratio_ptr + rows, ratio, mask=out)
    if KL != 0:
        tl.store(kl_ptr + rows, kl, mask=out)
    return w * dlogp, w * dh


@triton.jit
def _policy_split_kernel(x_ptr, xs0, xs1, N, T, V, tgt_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rollout_ptr, out_ptr,
                         os0, os1, logp_ptr, ent_ptr, loss_ptr, ratio_ptr, kl_ptr, temperature,
                         clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta, entropy_coef, ris_min,
                         ris_max, kl_clamp, kl_is_clip, sync_ptr, part_ptr, K, max_polls,
                         POLICY: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_DELTA: tl.constexpr, KL: tl.constexpr,
                         KL_ST: tl.constexpr, ADD_KL: tl.constexpr, KL_BIAS: tl.constexpr, KL_CLAMP: tl.constexpr,
                         KL_IS: tl.constexpr, ROLLOUT: tl.constexpr,
                         HAS_RIS_MIN: tl.constexpr, HAS_RIS_MAX: tl.constexpr, ADD_ENT: tl.constexpr,
                         ON_POLICY: tl.constexpr, WITH_ENT: tl.constexpr, WRITE_GRAD: tl.constexpr,
                         CHUNK: tl.constexpr, K_POW2: tl.constexpr, PHASE: tl.constexpr, HINTS: tl.constexpr):
    """The single pass with each row split over ``K`` programs of ``CHUNK`` columns: a program loads its chunk
    once and keeps it in registers, publishes the chunk's ``(m_k, s_k, q_k)`` (:func:`_block_update`) in
    ``part`` and counts itself in the row's arrival counter ``sync[row]``; once all ``K`` have arrived each
    combines the row's statistics (:func:`_combine_chunks`, the same for all), runs the epilogue (the chunk-0
    program stores the per-token outputs) and writes its chunk's ``dlogits`` from its registers. So the logits
    are read from memory once (the row-per-program kernel reads a row twice, the second time from L2 only while
    few enough rows are in flight). The target logit goes through ``part`` too, stored by the chunk-0 program
    before it arrives: read after the wait from there, it cannot be one that an in-place gradient has
    overwritten.

    ``PHASE`` 0 (GPU): both halves, with the wait between them. Programs take their item (row, chunk) from a
    ticket counter (``sync[N]``) in the order they start, so the programs of a row that is waited on have
    either started or are the next to start: with at least ``K`` programs resident at once (the launcher
    checks ``K`` <= the SM count) every row completes. A wait gives up after ``max_polls`` polls of the count,
    or at once once another program has given up (the flag ``sync[N + 1]``, so that a launch where fewer than
    ``K`` programs fit, e.g. beside other kernels, ends after one such wait, not one per row); a program that
    gave up makes its chunk's ``dlogits`` NaN and adds NaN to its row's loss term (the chunk-0 program adds the
    term itself into zeros, ``ADD_LOSS``), so the loss is NaN whichever program gave up. The interpreter runs
    programs one after the other, so it launches ``PHASE`` 1 (load, publish, arrive) and then ``PHASE`` 2 (load
    again, read the count, combine, epilogue, gradient): the same code, without the wait.

    Offsets are int64 (``rows`` int64; ``N K < 2^31`` items, checked by the launcher)."""
    scale = LOG2E / temperature
    if PHASE == 0:
        item = tl.atomic_add(sync_ptr + N, 1, sem="relaxed")
    else:
        item = tl.program_id(0)
    row = item // K
    k = item - row * K
    rows = row.to(tl.int64) + tl.zeros([1], tl.int64)
    in_rows = rows < N
    tgt = _load_targets(tgt_ptr, rows, in_rows, V)
    valid = tgt != IGNORE_INDEX
    valid_row = tl.sum(valid.to(tl.int32), axis=0) > 0
    first = (k + tl.zeros([1], tl.int32)) == 0  # the chunk-0 program (as a row vector)
    x_off = _row_offset(rows, T, xs0, xs1)
    # ignored rows: all -inf, nothing read
    x_raw = _load_block(x_ptr, x_off, valid, k * CHUNK, V, CHUNK, "evict_first" if HINTS else "")
    nk = tl.cast(N, tl.int64) * K  # N == 1 is a constexpr int on a GPU (no .to)
    part_row = part_ptr + rows * K  # per chunk: m_k at [0, nk), s_k at [nk, 2 nk), q_k at [2 nk, 3 nk)
    xt_ptr = part_ptr + 3 * nk + rows  # the target logit
    arrived = K
    m_k, s_k, q_k, e, u = _block_update(x_raw, tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32),
                                        tl.zeros([1], tl.float32), scale, WITH_ENT)
    if PHASE != 2:
        tl.store(part_row + k, m_k)
        tl.store(part_row + nk + k, s_k)
        if WITH_ENT:
            tl.store(part_row + 2 * nk + k, q_k)
        in_vocab = (tgt >= 0) & (tgt < V)
        xt = tl.load(x_ptr + x_off + tl.where(valid & in_vocab, tgt, 0), mask=valid & in_vocab & first,
                     other=float("nan"))
        tl.store(xt_ptr, xt.to(tl.float32), mask=first)
        tl.debug_barrier()  # every thread's stores before the arrival (a release: they are visible after it)
        arrived = tl.atomic_add(sync_ptr + row, 1, mask=valid_row, sem="acq_rel") + 1
    if PHASE != 1:
        done = tl.where(valid_row, arrived, K)  # ignored rows: nothing to wait for, their statistics unread
        if PHASE == 2:  # every program has run PHASE 1: the count is K (unless one failed to arrive)
            done = tl.where(valid_row, tl.atomic_add(sync_ptr + row, 0, mask=valid_row, sem="acquire"), K)
        if PHASE == 0:
            polls = 0
            stop = tl.atomic_add(sync_ptr + N + 1, 0, sem="relaxed")
            while (done < K) & (polls < max_polls) & (stop == 0):
                done = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
                stop = tl.atomic_add(sync_ptr + N + 1, 0, sem="relaxed")
                polls += 1
            tl.atomic_xchg(sync_ptr + N + 1, 1, mask=done < K, sem="relaxed")  # gave up: the others need not wait
        ks = tl.arange(0, K_POW2)
        read = (ks < K) & ((tl.zeros([K_POW2], tl.int32) + valid_row.to(tl.int32)) > 0)
        m_all = tl.load(part_row + ks, mask=read, other=float("-inf"), cache_modifier=".cg")
        s_all = tl.load(part_row + nk + ks, mask=read, other=0.0, cache_modifier=".cg")
        q_all = s_all
        if WITH_ENT:
            q_all = tl.load(part_row + 2 * nk + ks, mask=read, other=0.0, cache_modifier=".cg")
        m, s, q = _combine_chunks(m_all, s_all, q_all, scale, WITH_ENT)
        gave_up = (done + tl.zeros([1], tl.int32)) < K  # (as a row vector)
        s = tl.where(done < K, float("nan"), s)  # gave up waiting: NaN, not a result from part of the row
        tl.atomic_add(loss_ptr + rows, tl.full([1], float("nan"), tl.float32), mask=in_rows & gave_up,
                      sem="relaxed")  # and a NaN loss, also where the chunk-0 program saw the whole row
        xt = tl.load(xt_ptr, mask=valid, other=float("nan"), cache_modifier=".cg")
        m_row, log2_s, logp, ent = _finish_stats(m + tl.zeros([1], tl.float32), s + tl.zeros([1], tl.float32),
                                                 q + tl.zeros([1], tl.float32), valid, xt, scale, WITH_ENT)
        g_logp, g_h = _token_outputs(
            rows, in_rows, first, valid, logp, ent, adv_ptr, w_ptr, old_ptr, ref_ptr, rollout_ptr, logp_ptr,
            ent_ptr, loss_ptr, ratio_ptr, kl_ptr, clip_low, clip_high, dual_clip, delta, tau_pos, tau_neg, beta,
            entropy_coef, ris_min, ris_max, kl_clamp, kl_is_clip, POLICY, HAS_DUAL, HAS_DELTA, KL, KL_ST, ADD_KL,
            KL_BIAS, KL_CLAMP, KL_IS, ROLLOUT, HAS_RIS_MIN, HAS_RIS_MAX, ADD_ENT, ON_POLICY, WITH_ENT, True)
        if WRITE_GRAD:
            a, b, h2, one_minus_pt = _grad_coefs(tgt, valid, V, temperature, xt, m_row, log2_s, ent, g_logp, g_h)
            cols = k * CHUNK + tl.arange(0, CHUNK)
            g = _chunk_grad(e, u, m_k, m_row, log2_s, a, b, h2, scale, ADD_ENT)
            o_off = _row_offset(rows, T, os0, os1)
            tl.store(out_ptr + o_off[:, None] + cols[None, :], g.to(out_ptr.dtype.element_ty),
                     mask=in_rows[:, None] & (cols[None, :] < V), eviction_policy="evict_first" if HINTS else "")
            owner = (tgt >= k * CHUNK) & (tgt < k * CHUNK + CHUNK) & (tgt < V)  # its chunk holds the target
            _store_target_grad(out_ptr, o_off, tgt, valid & owner & in_rows, xt, m_row, log2_s, a, b, h2,
                               one_minus_pt, scale, ADD_ENT)


@triton.jit
def _combine_chunks(m_k, s_k, q_k, scale, WITH_ENT: tl.constexpr):
    """A row's ``(m, s, q)`` (:func:`_block_update`) from its chunks' (vectors; absent chunks ``m_k = -inf``,
    ``s_k = q_k = 0``): ``m = max m_k``, ``s = sum a_k s_k``, ``q = sum a_k (q_k + d_k s_k)`` with
    ``d_k = (m_k - m) scale``, ``a_k = 2^d_k``. A NaN or ``+inf`` in a chunk makes ``s`` NaN: its ``s_k`` is NaN
    (``_block_update``'s ``2^u`` of that entry; on a GPU ``max`` drops NaN, so ``m_k`` may be finite) or, at
    ``+inf``, ``a_k`` (``inf - inf``)."""
    m = tl.max(m_k, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d_k = (m_k - m_safe) * scale
    a_k = tl.exp2(d_k)
    s = tl.sum(a_k * s_k, axis=0)
    q = s
    if WITH_ENT:
        q = tl.sum(a_k * (q_k + tl.where(s_k > 0.0, tl.maximum(d_k, -256.0), 0.0) * s_k), axis=0)  # no 0 * -inf
    return m, s, q


@triton.jit
def _scale_kernel(x_ptr, s0, s1, N, T, V, g_ptr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Rows of ``x`` (``(B, T, V)``, any row strides) ``*= g`` in place, ``g`` a 0-dim tensor read on the
    device: no host sync, and no memory traffic at all when ``g == 1``."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
            rows, in_rows = _rows(tile, N, BLOCK_N)
            off = _row_offset(rows, T, s0, s1)
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                m = in_rows[:, None] & (cols[None, :] < V)
                ptrs = x_ptr + off[:, None] + cols[None, :]
                x = tl.load(ptrs, mask=m).to(tl.float32)
                tl.store(ptrs, (x * g).to(x_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- launchers
def _grid(rows: int, block_n: int) -> tuple[int]:
    tiles = triton.cdiv(rows, block_n)
    return (tiles if MAX_PROGRAMS is None else max(1, min(tiles, MAX_PROGRAMS)),)


def _on(x: torch.Tensor):
    """``x``'s GPU as the current device during a launch: Triton launches on the current device and its
    current stream, not the tensors' (logits on ``cuda:1`` while ``cuda:0`` is current would run on GPU 0
    with GPU 1 pointers). Nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """A ``(B, T, V)`` view of ``(..., V)`` logits (a copy only if the leading dims cannot be viewed so)."""
    if logits.dim() == 3:
        return logits
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    try:
        return logits.view(-1, logits.shape[-2], logits.shape[-1])
    except RuntimeError:
        return logits.reshape(-1, logits.shape[-2], logits.shape[-1])


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """Flat fp32 ``(logp, entropy, lse)`` (``entropy`` empty unless ``with_entropy``); ``lse`` is
    ``(2, N)``: the raw row max ``m = max x`` and ``log2 s``, which :func:`token_grad` reads."""
    x = as_rows(logits)
    B, T, V = x.shape
    n = B * T
    tgt = targets.reshape(-1).contiguous()
    logp = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(2, n, dtype=torch.float32, device=x.device)
    ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=x.device)
    bn, block, warps = block_config(V, x.dtype)
    with _on(x):
        _stats_kernel[_grid(n, bn)](
            x, x.stride(0), x.stride(1), n, T, V, tgt, logp, ent if with_entropy else logp, lse,
            float(temperature), BLOCK_N=bn, BLOCK_V=block, WITH_ENT=bool(with_entropy), num_warps=warps)
    return logp, ent, lse


def token_grad(logits, targets, lse, g_logp, entropy, g_entropy, temperature, out=None):
    """dlogits ``(B, T, V)`` in the logits dtype (contiguous unless ``out`` is given)."""
    x = as_rows(logits)
    B, T, V = x.shape
    o = torch.empty((B, T, V), dtype=x.dtype, device=x.device) if out is None else as_rows(out)
    grad_ent = entropy is not None and g_entropy is not None
    bn, block, warps = block_config(V, x.dtype)
    g_logp = g_logp.reshape(-1).contiguous()
    ent = entropy.reshape(-1).contiguous() if grad_ent else g_logp
    g_ent = g_entropy.reshape(-1).contiguous() if grad_ent else g_logp
    with _on(x):
        _grad_kernel[_grid(B * T, bn)](
            x, x.stride(0), x.stride(1), B * T, T, V, targets.reshape(-1).contiguous(), o, o.stride(0),
            o.stride(1), lse, g_logp, ent, g_ent, float(temperature), BLOCK_N=bn, BLOCK_V=block, GRAD_ENT=grad_ent,
            num_warps=warps)
    return o.view(logits.shape) if out is None else out


def policy_fused(logits, targets, advantages, weights, old, ref, out, temperature, epilogue: dict,
                 with_entropy: bool, write_grad: bool, rollout=None):
    """Single pass of the token-level policy loss. ``targets`` flat with masked positions already
    ``IGNORE_INDEX``; ``advantages``, ``weights``, ``old``, ``ref``, ``rollout`` flat fp32 (``old=None``:
    on-policy; ``rollout``, the sampler's log-probs, read only with token rollout correction);
    ``epilogue`` from :func:`fused_rl.kernels.epilogue.epilogue_args`. Writes dlogits into ``out``
    (``(B, T, V)``, any row strides; may be ``logits`` itself) when ``write_grad``. Returns flat fp32
    ``(logp, entropy, w * l, ratio, kl)``."""
    x = as_rows(logits)
    B, T, V = x.shape
    n = B * T
    dev = x.device
    new = lambda k: torch.empty(k, dtype=torch.float32, device=dev)
    logp, loss, ratio = new(n), new(n), new(n)
    ent = new(n if with_entropy else 0)
    kl = new(n if epilogue["KL"] != 0 else 0)
    o = as_rows(out) if write_grad else x
    bn, block, warps = block_config(V, x.dtype)
    if epilogue["ROLLOUT"] != 0 and rollout is None:
        raise ValueError("token rollout correction needs the rollout log-probs")
    unused = advantages  # any pointer for the arguments the constexprs leave unread
    args = (x, x.stride(0), x.stride(1), n, T, V, targets, advantages, weights,
            unused if old is None else old, unused if ref is None else ref, unused if rollout is None else rollout,
            o, o.stride(0), o.stride(1), logp, ent if with_entropy else logp, loss, ratio,
            kl if epilogue["KL"] != 0 else logp, float(temperature))
    flags = dict(WITH_ENT=bool(with_entropy), WRITE_GRAD=bool(write_grad), **epilogue)
    chunks = _split_chunks(n, V, x) if write_grad else 0  # without a gradient the row kernel reads a row once too
    with _on(x):
        if chunks:
            loss.zero_()  # the split pass adds the loss terms
            _launch_split(args, flags, n, chunks, x)
        else:
            _policy_kernel[_grid(n, bn)](*args, BLOCK_N=bn, BLOCK_V=block, num_warps=warps, REVERSE=bool(GRAD_REVERSE),
                                         HINTS=bool(CACHE_HINTS), PREFETCH=bool(PREFETCH), **flags)
    return logp, ent, loss, ratio, kl


def _split_chunks(rows: int, vocab: int, x: torch.Tensor) -> int:
    """The programs per row of :func:`_policy_split_kernel` with ``SPLIT_CHUNK`` (0: the row kernel): where it
    gives a row at least two, the ``rows x chunks`` items fit int32, and on a GPU at most one program per SM
    is needed per row (all of a row's programs resident at once)."""
    if SPLIT_CHUNK is None:
        return 0
    chunks = triton.cdiv(vocab, SPLIT_CHUNK)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else chunks
    return chunks if 2 <= chunks <= sms and rows * chunks < 2**31 else 0


def _split_phases() -> tuple[int, ...]:
    """The ``PHASE`` launches of :func:`_policy_split_kernel`: ``(0,)`` compiled, ``(1, 2)`` in the interpreter,
    which runs programs one after the other (the row kernel's type tells; it is never wrapped)."""
    return (0,) if isinstance(_policy_kernel, triton.runtime.JITFunction) else (1, 2)


def _launch_split(args, flags, rows: int, chunks: int, x: torch.Tensor) -> None:
    """:func:`_policy_split_kernel` over ``rows x chunks`` items (``SPLIT_WARPS`` warps, by default 128 columns a
    thread); the loss terms' buffer must hold zeros (the kernel adds into it)."""
    sync = torch.zeros(rows + 2, dtype=torch.int32, device=x.device)  # arrival counters, the ticket, the flag
    part = torch.empty(3 * rows * chunks + rows, dtype=torch.float32, device=x.device)
    warps = SPLIT_WARPS or min(16, max(1, SPLIT_CHUNK // 4096))
    for phase in _split_phases():
        _policy_split_kernel[(rows * chunks,)](*args, sync_ptr=sync, part_ptr=part, K=chunks,
                                               max_polls=SPLIT_MAX_POLLS, CHUNK=SPLIT_CHUNK,
                                               K_POW2=triton.next_power_of_2(chunks), PHASE=phase,
                                               HINTS=bool(CACHE_HINTS), num_warps=warps, **flags)


def scale_(x: torch.Tensor, g: torch.Tensor) -> None:
    """In-place ``x *= g`` for ``(..., V)`` ``x`` with any row strides; ``g`` a one-element tensor."""
    r = as_rows(x)
    B, T, V = r.shape
    bn, block, warps = block_config(V, r.dtype)
    with _on(r):
        _scale_kernel[_grid(B * T, bn)](r, r.stride(0), r.stride(1), B * T, T, V, g.reshape(()).to(torch.float32),
                                        BLOCK_N=bn, BLOCK_V=block, num_warps=warps)
