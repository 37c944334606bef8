"""fused_rl.vocab_parallel: log-probs and entropy of a vocabulary-parallel LM head (each process a slice of the
weight's rows) against float64 over the whole vocabulary: values, and the gradients the tensor-parallel convention
gives (each process's weight slice its own, the hidden states' partial sums adding up to the whole gradient).
In one process, the ranks simulated (each rank's statistics with their graph, the others' detached: what the
gather's backward gives) on every backend; then real gloo process groups, through the public function and verl's
``linear_cross_entropy`` with its ``dist_process_group``."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_rl import vocab_parallel
from fused_rl.integrations.verl_lm_head import linear_cross_entropy
from helpers import fused_backends, lm_head_inputs, supports

TEMPERATURE = 0.7
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(test):
    """The simulated-rank tests run on DEVICE's backends (on a GPU: marked cuda, in bench/gpu_check.sh's list); the
    gloo tests on the CPU."""
    return pytest.mark.cuda(test) if DEVICE == "cuda" else test


def _inputs(seed: int, tokens: tuple, hidden: int, vocab: int, dtype=torch.float32, kind: str = "randn",
            shard: int = 0):
    """:func:`helpers.lm_head_inputs` (a whole ``(V, H)`` head) in ``dtype``, two token ids ``-100`` and two more the
    last row of the first ``shard`` rows and the next one."""
    h, w, ids = lm_head_inputs(seed, tokens, hidden, vocab, kind)
    if ids.numel() > 4:
        ids.view(-1)[1] = ids.view(-1)[-1] = -100
        ids.view(-1)[2:4] = torch.tensor([shard - 1, shard]) if shard else ids.view(-1)[2:4]
    return h.to(dtype), w.to(dtype), ids


def _upstream(shape, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _exact(h, w, ids, g1, g2, temperature: float = TEMPERATURE):
    """float64 log-probs, entropies and the gradients of ``<g1, logp> + <g2, H>`` over the whole vocabulary, from the
    same (rounded) inputs."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    logp_all = ((h64 @ w64.T) / temperature).log_softmax(-1)
    ignored = ids == -100
    logp = logp_all.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    entropy = (-(logp_all.exp() * logp_all).sum(-1)).masked_fill(ignored, 0.0)
    grad_h, grad_w = torch.autograd.grad((logp * g1).sum() + (entropy * g2).sum(), (h64, w64))
    return logp.detach(), entropy.detach(), grad_h, grad_w


def _simulate(world: int, shard_stats, ignored, g1, g2):
    """Rank by rank in one process: ``((logp, H), [each rank's leaves' gradients])`` of ``<g1, logp> + <g2, H>``, with
    ``shard_stats(rank, grad) -> (statistics, leaves)``; each rank's own statistics keep their graph, the other
    ranks' are detached (the gather's backward), and every rank gives the same values."""
    grads, values = [], []
    for rank in range(world):
        stats, leaves = [], []
        for other in range(world):
            if other == rank:
                own, leaves = shard_stats(rank, True)
                stats.append(own)
            else:
                with torch.no_grad():
                    stats.append(shard_stats(other, False)[0])
        logp, entropy = vocab_parallel.combine(torch.stack(stats), ignored, True)
        ((logp.double() * g1.to(logp.device)).sum() + (entropy.double() * g2.to(logp.device)).sum()).backward()
        values.append((logp.detach().cpu(), entropy.detach().cpu()))
        grads.append([leaf.grad.double().cpu() for leaf in leaves])
    for logp, entropy in values[1:]:
        assert torch.equal(logp, values[0][0]) and torch.equal(entropy, values[0][1])
    return values[0], grads


def _simulated(h, w, ids, world: int, backend: str, g1, g2, temperature: float = TEMPERATURE):
    """The linear route simulated: ``(logp, H, hidden gradient summed over ranks, weight gradient (all slices),
    the ranks' hidden gradients)``."""
    shard = w.shape[0] // world
    h, w, ids = h.to(DEVICE), w.to(DEVICE), ids.to(DEVICE)

    def stats(rank, grad):
        hr, wr = h.clone().requires_grad_(grad), w[rank * shard:(rank + 1) * shard].clone().requires_grad_(grad)
        return vocab_parallel.linear_shard_statistics(hr, wr, ids, rank * shard, temperature, True, backend,
                                                      None), (hr, wr)

    (logp, entropy), grads = _simulate(world, stats, ids == -100, g1, g2)
    partials = [g[0] for g in grads]
    return logp, entropy, sum(partials), torch.cat([g[1] for g in grads]), partials


def _close(got, exact, dtype, h, w, temperature: float = TEMPERATURE) -> None:
    """Log-probs within a few roundings of the largest logit (the shard's ``lse`` comes from ``z_c - log p_c``),
    entropies as tight; gradients (the ranks' hidden partial sums summed) within as many roundings of the largest
    logit, at least 1e-5 (fp32), or one 16-bit unit roundoff (two roundings: each rank's own and the stand-in
    column's, which cancels) of their own scale (with all logits near -86 a rank's partial sum over the constant
    feature is ~100 where their sum is ~3: the slice weights ``w_r`` must sum to 1 within a rounding, as the whole
    head's softmax and verl's global max / sum do)."""
    logp, entropy, grad_h, grad_w, _ = got
    z_max = ((h.double() @ w.double().T) / temperature).abs().max().item()
    atol = 8 * torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps * max(z_max, 1.0)
    torch.testing.assert_close(logp.double(), exact[0], rtol=0, atol=atol)
    torch.testing.assert_close(entropy.double(), exact[1], rtol=0, atol=atol)
    unit = max(1e-5, atol) if dtype == torch.float32 else atol if dtype == torch.float64 else torch.finfo(dtype).eps
    torch.testing.assert_close(grad_h, exact[2], rtol=0, atol=unit * exact[2].abs().max().item())
    torch.testing.assert_close(grad_w, exact[3], rtol=0, atol=unit * exact[3].abs().max().item())


@pytest.mark.parametrize("kind", ["randn", "peaked", "negative"])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
@pytest.mark.parametrize("tokens,world,shard", [((2, 19), 2, 500), ((1, 23), 3, 1367), ((1, 1), 2, 500)])
@on_device
def test_simulated_ranks_match_the_whole_vocabulary_fp32(backend, kind, tokens, world, shard):
    """fp32, 2 or 3 ranks of 500 / 1367 rows (a whole vocabulary of 1000 / 4101: not a multiple of any block), one
    token, two ignored tokens, temperature 0.7: values and both gradients against float64."""
    h, w, ids = _inputs(3, tokens, 40, world * shard, kind=kind, shard=shard)
    g1, g2 = _upstream(ids.shape, 3)
    _close(_simulated(h, w, ids, world, backend, g1, g2), _exact(h, w, ids, g1, g2), torch.float32, h, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
@on_device
def test_simulated_ranks_half_precision(backend, dtype):
    """bf16 / fp16 hidden states and head: values with fp32 accuracy, gradients within 16-bit rounding; 1024 tokens,
    so that stand-in columns all in one place would not be (their cancelling one-hot gradients summed in one weight
    row: measured 3.3 unit roundoffs of the scale off there where the spread columns are 0.3 off, and 1.1 at most)."""
    if not supports(backend, dtype, DEVICE):
        pytest.skip(f"{backend} has no {dtype}")
    h, w, ids = _inputs(5, (8, 128), 40, 3 * 347, dtype=dtype, shard=347)
    g1, g2 = _upstream(ids.shape, 5)
    _close(_simulated(h, w, ids, 3, backend, g1, g2), _exact(h, w, ids, g1, g2), dtype, h, w)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@on_device
def test_simulated_ranks_fp64(backend, monkeypatch):
    """fp64 head, temperature 1.3: values and gradients within fp64 roundings (the row dot products in fp64, not
    fp32), the row dot products in chunks of 7 rows (38 tokens: five chunks and a partial one)."""
    monkeypatch.setattr(vocab_parallel, "ROW_DOT_CHUNK", 7)
    h, w, ids = _inputs(9, (2, 19), 40, 3 * 347, dtype=torch.float64, shard=347)
    g1, g2 = _upstream(ids.shape, 9)
    got = _simulated(h, w, ids, 3, backend, g1, g2, temperature=1.3)
    assert got[0].dtype == got[1].dtype == torch.float64
    _close(got, _exact(h, w, ids, g1, g2, temperature=1.3), torch.float64, h, w, temperature=1.3)


def test_targets_in_one_shard_and_a_single_rank():
    """Every target in the last rank's slice (the others contribute only their normalizers), and one rank holding the
    whole head: the log-probs / entropies of :func:`fused_rl.linear_token_logprobs` on the whole head."""
    h, w, ids = _inputs(7, (2, 9), 24, 600)
    ids = torch.where(ids == -100, ids, ids % 200 + 400)
    g1, g2 = _upstream(ids.shape, 7)
    _close(_simulated(h, w, ids, 3, "cpu", g1, g2), _exact(h, w, ids, g1, g2), torch.float32, h, w)
    import fused_rl

    whole = fused_rl.linear_token_logprobs(h, w, ids, temperature=TEMPERATURE, return_entropy=True)
    one = _simulated(h, w, ids, 1, "cpu", g1, g2)
    torch.testing.assert_close(one[0], whole[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(one[1], whole[1], rtol=0, atol=2e-6)


def _logits(seed: int, tokens: tuple, world: int, shard: int, dtype=torch.float32, kind: str = "randn"):
    """Whole logits ``(*tokens, world * shard)`` and token ids (two ``-100``, two at the first shard boundary) of
    order 3 (``"randn"``), peaked, all near -80 (``"negative"``) or with ``-inf`` columns (``"masked"``: a vocabulary
    mask, the last shard's half, one row's whole first shard, and a target on a masked column)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*tokens, world * shard, generator=g) * 3
    if kind == "peaked":
        z[..., torch.randint(0, world * shard, (5,), generator=g)] += 30.0
    elif kind == "negative":
        z = z - 80.0
    ids = torch.randint(0, world * shard, tokens, generator=g)
    flat = ids.view(-1)
    if flat.numel() > 4:
        flat[1] = flat[-1] = -100
        flat[2:4] = torch.tensor([shard - 1, shard])
    if kind == "masked":
        z[..., (world - 1) * shard + shard // 2:] = float("-inf")
        z.view(-1, world * shard)[0, :shard] = float("-inf")
        if flat.numel() > 4:
            z.view(-1, world * shard)[-2, 7] = float("-inf")
            flat[-2] = 7
    return z.to(dtype), ids


def _logits_exact(z, ids, g1, g2):
    """float64 log-probs, entropies and the logits gradient of ``<g1, logp> + <g2, H>`` (``p log p = 0`` where ``p =
    0``: 0 at ``-inf`` logits but a target's, ``g1 (1 - p) = g1``, as :func:`fused_rl.token_logprobs` gives)."""
    z64 = z.double().requires_grad_()
    logp_all = (z64 / TEMPERATURE).log_softmax(-1)
    ignored = ids == -100
    logp = logp_all.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    p = logp_all.exp()
    entropy = (-(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)).masked_fill(ignored, 0.0)
    (grad,) = torch.autograd.grad((logp * g1).sum() + (entropy * g2).sum(), (z64,))
    return logp.detach(), entropy.detach(), grad


def _logits_simulated(z, ids, world: int, backend: str, g1, g2):
    shard = z.shape[-1] // world
    z, ids = z.to(DEVICE), ids.to(DEVICE)

    def stats(rank, grad):
        zr = z[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(grad)
        return vocab_parallel.logits_shard_statistics(zr, ids, rank * shard, TEMPERATURE, True, backend), (zr,)

    (logp, entropy), grads = _simulate(world, stats, ids == -100, g1, g2)
    return logp, entropy, torch.cat([g[0] for g in grads], dim=-1)


def _logits_close(got, exact, dtype, z, exact_targets) -> None:
    """Log-probs and entropies within a few fp32 roundings of the largest finite logit; the logits gradient within
    1e-5 (fp32) / one 16-bit unit roundoff of its scale, and exactly 0 at ``-inf`` logits but the targets'."""
    finite = z[z.isfinite()].double()
    atol = 8 * torch.finfo(torch.float32).eps * max(finite.abs().max().item() / TEMPERATURE, 1.0)
    torch.testing.assert_close(got[0].double(), exact[0], rtol=0, atol=atol)
    torch.testing.assert_close(got[1].double(), exact[1], rtol=0, atol=atol)
    unit = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    torch.testing.assert_close(got[2], exact[2], rtol=0, atol=unit * exact[2].abs().max().item())
    targets = torch.zeros(z.shape, dtype=torch.bool).scatter_(-1, exact_targets.clamp(min=0).unsqueeze(-1), True)
    assert not got[2][z.isinf() & ~targets].any()


@pytest.mark.parametrize("kind", ["randn", "peaked", "negative", "masked"])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
@pytest.mark.parametrize("tokens,world,shard", [((2, 19), 2, 500), ((23,), 3, 1367), ((1, 1), 2, 500)])
@on_device
def test_logits_simulated_ranks_match_the_whole_vocabulary_fp32(backend, kind, tokens, world, shard):
    """Vocabulary-parallel logits, fp32: 2 or 3 ranks' columns (whole vocabularies of 1000 / 4101), 2-D and 1-D
    token shapes, one token, ignored tokens, targets at a shard boundary, temperature 0.7, ``-inf`` columns (a whole
    shard of them on one row, a target on one): values and the logits gradient against float64."""
    z, ids = _logits(3, tokens, world, shard, kind=kind)
    g1, g2 = _upstream(ids.shape, 3)
    got = _logits_simulated(z, ids, world, backend, g1, g2)
    _logits_close(got, _logits_exact(z, ids, g1, g2), torch.float32, z, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference"] + fused_backends(DEVICE))
@on_device
def test_logits_simulated_ranks_half_precision(backend, dtype):
    if not supports(backend, dtype, DEVICE):
        pytest.skip(f"{backend} has no {dtype}")
    z, ids = _logits(5, (4, 33), 3, 347, dtype=dtype, kind="masked")
    g1, g2 = _upstream(ids.shape, 5)
    _logits_close(_logits_simulated(z, ids, 3, backend, g1, g2), _logits_exact(z, ids, g1, g2), dtype, z, ids)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, shard: int) -> None:
    # a collective left waiting (a process raising alone) fails after 2 minutes instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        h, w, ids = _inputs(11, (2, 13), 32, world * shard, shard=shard)
        g1, g2 = _upstream(ids.shape, 11)
        out = {}
        for name, run in (
                ("public", lambda hr, wr: vocab_parallel.linear_token_logprobs(
                    hr, wr, ids, temperature=TEMPERATURE, return_entropy=True)),
                ("verl", lambda hr, wr: [x.view(ids.shape) for x in linear_cross_entropy(
                    hr, wr, ids, TEMPERATURE, "none", dist.group.WORLD)])):
            hr = h.clone().requires_grad_()
            wr = w[rank * shard:(rank + 1) * shard].clone().requires_grad_()
            logp, entropy = run(hr, wr)
            ((logp.double() * g1).sum() + (entropy.double() * g2).sum()).backward()
            out[name] = (logp.detach(), entropy.detach(), hr.grad, wr.grad)
        total, _ = linear_cross_entropy(h, w[rank * shard:(rank + 1) * shard], ids, TEMPERATURE, "sum",
                                        dist.group.WORLD)
        out["sum"] = total
        z, z_ids = _logits(11, (2, 13), world, shard, kind="masked")
        zr = z[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        logp, entropy = vocab_parallel.token_logprobs(zr, z_ids, temperature=TEMPERATURE, return_entropy=True)
        ((logp.double() * g1).sum() + (entropy.double() * g2).sum()).backward()
        out["logits"] = (logp.detach(), entropy.detach(), zr.grad)
        errors = []
        # a target past the last shard, a target -1, unequal shards
        for bad_ids, bad_w in ((torch.where(ids == -100, ids, world * shard), w[:shard]),
                               (torch.where(ids == -100, ids, -1), w[:shard]), (ids, w[:shard + rank])):
            for call in (lambda: vocab_parallel.linear_token_logprobs(h, bad_w, bad_ids),
                         lambda: vocab_parallel.token_logprobs(z[..., :bad_w.shape[0]], bad_ids)):
                try:
                    call()
                except ValueError as exc:
                    errors.append(str(exc))
        # one process's own arguments wrong (its targets' shape, its temperature, its targets alone out of range):
        # it raises its own error, the others raise too, none is left waiting in a collective
        beyond = ids.clone()
        beyond[0, 1] = world * shard
        for call in (lambda: vocab_parallel.linear_token_logprobs(h, w[:shard], ids[:, :3] if rank == 1 else ids),
                     lambda: vocab_parallel.token_logprobs(z[..., :shard], z_ids, temperature=0.0 if rank else 1.0),
                     lambda: vocab_parallel.token_logprobs(z[..., :shard], beyond if rank == 1 else z_ids)):
            try:
                call()
            except ValueError as exc:
                errors.append(str(exc))
        # process 1's own backend, flag, meta logits or memory budget, then what must be the same on every process:
        # the number of tokens, return_entropy, the temperature (each raised on every process: before, the others
        # were left in a collective or a gloo process aborted on the gathers' differing sizes)
        zs, bad = z[..., :shard], rank == 1
        flag = 1 if bad else False  # not a bool on process 1
        for call in (lambda: vocab_parallel.token_logprobs(zs, z_ids, backend="bogus" if bad else "auto"),
                     lambda: vocab_parallel.linear_token_logprobs(h, w[:shard], ids, return_entropy=flag),
                     lambda: vocab_parallel.token_logprobs(zs.to("meta") if bad else zs, z_ids),
                     lambda: vocab_parallel.linear_token_logprobs(h, w[:shard], ids,
                                                                  memory_budget_bytes=-1 if bad else None),
                     lambda: vocab_parallel.token_logprobs(zs[:1] if bad else zs, z_ids[:1] if bad else z_ids),
                     lambda: vocab_parallel.linear_token_logprobs(h, w[:shard], ids, return_entropy=bad),
                     lambda: vocab_parallel.token_logprobs(zs, z_ids, temperature=2.0 if bad else 1.0),
                     # verl's drop-in's own checks before it: process 1's reduction, labels' dtype, labels' shape
                     lambda: linear_cross_entropy(h, w[:shard], ids, 1.0, "max" if bad else "none", dist.group.WORLD),
                     lambda: linear_cross_entropy(h, w[:shard], ids.float() if bad else ids, 1.0, "none",
                                                  dist.group.WORLD),
                     lambda: linear_cross_entropy(h, w[:shard], ids[:, :3] if bad else ids, 1.0, "none",
                                                  dist.group.WORLD)):
            try:
                call()
            except ValueError as exc:
                errors.append(str(exc))
        out["errors"] = errors
        if world == 3:  # a sub-group (Megatron's tensor-parallel group): group ranks 0, 1 are global ranks 1, 2
            sub = dist.new_group([1, 2])
            if rank > 0:
                hr = h.clone().requires_grad_()
                wr = w[(rank - 1) * shard:rank * shard].clone().requires_grad_()
                sub_ids = torch.where(ids == -100, ids, ids % (2 * shard))
                logp, entropy = vocab_parallel.linear_token_logprobs(hr, wr, sub_ids, group=sub,
                                                                     temperature=TEMPERATURE, return_entropy=True)
                ((logp.double() * g1).sum() + (entropy.double() * g2).sum()).backward()
                out["sub"] = (logp.detach(), entropy.detach(), hr.grad, wr.grad)
                zr = z[..., (rank - 1) * shard:rank * shard].clone().requires_grad_()
                sub_z_ids = torch.where(z_ids == -100, z_ids, z_ids % (2 * shard))
                logp, entropy = vocab_parallel.token_logprobs(zr, sub_z_ids, group=sub, temperature=TEMPERATURE,
                                                              return_entropy=True)
                ((logp.double() * g1).sum() + (entropy.double() * g2).sum()).backward()
                out["sub-logits"] = (logp.detach(), entropy.detach(), zr.grad)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,shard", [(2, 500), (3, 347)])
def test_gloo_process_group(tmp_path, world, shard):
    """Real processes: :func:`fused_rl.vocab_parallel.linear_token_logprobs` and verl's ``linear_cross_entropy``
    with the group give every rank the whole vocabulary's values; the ranks' hidden gradients sum to the whole
    gradient, their weight gradients are the slices of it; ``reduction="sum"`` is the log-probs' sum;
    :func:`fused_rl.vocab_parallel.token_logprobs` of logits with ``-inf`` columns, each rank's logits gradient the
    slice of the whole one; a target past the last slice, a target -1 and unequal slices raise on every rank, in both,
    and so does one process's own bad argument (verl's drop-in's reduction and labels too; the others told which
    process); with 3 processes, both again on a
    sub-group of global ranks 1 and 2 (Megatron's tensor-parallel group: group ranks are not global ranks)."""
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), str(tmp_path), shard), nprocs=world, join=True)
    h, w, ids = _inputs(11, (2, 13), 32, world * shard, shard=shard)
    g1, g2 = _upstream(ids.shape, 11)
    exact = _exact(h, w, ids, g1, g2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for name in ("public", "verl"):
        for rank in ranks[1:]:
            assert torch.equal(rank[name][0], ranks[0][name][0]) and torch.equal(rank[name][1], ranks[0][name][1])
        partials = [r[name][2].double() for r in ranks]
        got = (ranks[0][name][0], ranks[0][name][1], sum(partials), torch.cat([r[name][3].double() for r in ranks]),
               partials)
        _close(got, exact, torch.float32, h, w)
    torch.testing.assert_close(ranks[0]["sum"].double(), exact[0].sum(), rtol=0, atol=1e-4)
    z, z_ids = _logits(11, (2, 13), world, shard, kind="masked")
    for rank in ranks[1:]:
        assert torch.equal(rank["logits"][0], ranks[0]["logits"][0])
        assert torch.equal(rank["logits"][1], ranks[0]["logits"][1])
    got = (*ranks[0]["logits"][:2], torch.cat([r["logits"][2].double() for r in ranks], dim=-1))
    _logits_close(got, _logits_exact(z, z_ids, g1, g2), torch.float32, z, z_ids)
    for number, rank in enumerate(ranks):
        assert len(rank["errors"]) == 19
        own = ("reduction must be one of", "labels must be an int32 or int64 tensor", "labels must have shape")
        for error, message in zip(rank["errors"][16:], own):
            assert message in error if number == 1 else "arguments of process(es) [1] of the group" in error
        own = ("backend must be one of", "return_entropy must be a bool", "on the meta device",
               "memory_budget_bytes must be a positive int")
        for error, message in zip(rank["errors"][9:13], own):
            assert message in error if number == 1 else "arguments of process(es) [1] of the group" in error
        for error, name in zip(rank["errors"][13:], ("number of tokens", "return_entropy", "temperature")):
            assert f"every process must pass the same {name}" in error
        assert all(f"targets must be in [0, {world * shard})" in e for e in rank["errors"][:4])
        assert all("equal shards" in e for e in rank["errors"][4:6])
        own = ("targets must have shape", "temperature must be")
        for error, message, bad in zip(rank["errors"][6:8], own, ([1], list(range(1, world)))):
            assert message in error if number in bad else f"arguments of process(es) {bad} of the group" in error
        assert rank["errors"][8].endswith("(not on process(es) [1])")
    if world == 3:  # the sub-group of global ranks 1, 2: the first two slices' vocabulary
        sub_ids = torch.where(ids == -100, ids, ids % (2 * shard))
        partials = [r["sub"][2].double() for r in ranks[1:]]
        got = (ranks[1]["sub"][0], ranks[1]["sub"][1], sum(partials),
               torch.cat([r["sub"][3].double() for r in ranks[1:]]), partials)
        _close(got, _exact(h, w[:2 * shard], sub_ids, g1, g2), torch.float32, h, w[:2 * shard])
        sub_z_ids = torch.where(z_ids == -100, z_ids, z_ids % (2 * shard))
        got = (*ranks[1]["sub-logits"][:2], torch.cat([r["sub-logits"][2].double() for r in ranks[1:]], dim=-1))
        _logits_close(got, _logits_exact(z[..., :2 * shard], sub_z_ids, g1, g2), torch.float32, z[..., :2 * shard],
                      sub_z_ids)


def test_bad_arguments():
    h, w, ids = _inputs(13, (2, 5), 16, 100)
    z, _ = _logits(13, (2, 5), 1, 100)
    with pytest.raises(ValueError, match="targets must have shape"):
        vocab_parallel.token_logprobs(z, ids[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel.token_logprobs(z, ids, temperature=float("nan"))
    with pytest.raises(ValueError, match="check_inputs"):
        vocab_parallel.token_logprobs(z, ids, check_inputs=None)
    with pytest.raises(ValueError, match="targets must be an int32 or int64 tensor"):
        vocab_parallel.linear_token_logprobs(h, w, ids.float())
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 5\)"):
        vocab_parallel.linear_token_logprobs(h, w, ids[:, :3])
    with pytest.raises(ValueError, match="weight must have shape"):
        vocab_parallel.linear_token_logprobs(h, w[:, :8], ids)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel.linear_token_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match="return_entropy"):
        vocab_parallel.linear_token_logprobs(h, w, ids, return_entropy=1)


def test_ignored_tokens_are_not_read(monkeypatch):
    """A ``-100`` token reaches the shard's fused pass as ``-100`` (its row read nowhere), the others as local
    columns: the target where the shard holds it, else the stand-in (the row index modulo ``V_r``)."""
    seen = []
    real = vocab_parallel._linear_token_logprobs

    def spy(hidden, weight, targets, **kwargs):
        seen.append(targets.clone())
        return real(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(vocab_parallel, "_linear_token_logprobs", spy)
    h, w, ids = _inputs(17, (2, 6), 16, 60, shard=30)
    vocab_parallel.linear_shard_statistics(h, w[30:], ids, 30, 1.0, False, "reference", None)
    stand_in = torch.arange(12).view(2, 6) % 30
    expected = torch.where(ids == -100, -100, torch.where((ids >= 30) & (ids < 60), ids - 30, stand_in))
    assert torch.equal(seen[0], expected) and (seen[0] == -100).sum() == 2 and (ids >= 30).sum() > 2


def test_logits_backward_twice_double_backward_memory_and_edge_rows():
    """The logits path (ranks simulated, one shard's graph): a retained graph's second backward gives the same
    gradient; without retain_graph it raises, and nothing keeps the logits alive after the backward (the inner
    graph goes with the saved tensors); create_graph raises; an ignored row all ``-inf`` in every shard has gradient
    0 (not nan); a 16-bit gradient at each shard's largest column is within 16-bit rounding of its own value (the
    fused pass's ``-g (1 - p_m)`` and the one-hot ``g`` cancel there); fp64 logits keep fp64 accuracy."""
    import gc
    import weakref

    def run(z, ids, world=3, **kw):
        return _logits_simulated(z, ids, world, "auto", *_upstream(ids.shape, 1), **kw)

    z, ids = _logits(21, (3, 7), 3, 200)
    zr = z[..., :200].clone().requires_grad_()
    stats = vocab_parallel.logits_shard_statistics(zr, ids, 0, TEMPERATURE, True, "auto")
    loss = stats.double().square().sum()
    first = torch.autograd.grad(loss, zr, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, zr)[0], first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, zr)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(vocab_parallel.logits_shard_statistics(zr, ids, 0, 1.0, True, "auto").sum(), zr,
                            create_graph=True)
    buf = z[..., :200].clone().requires_grad_()
    alias = buf * 1.0
    kept = weakref.ref(alias)
    stats = vocab_parallel.logits_shard_statistics(alias, ids, 0, 1.0, False, "auto")
    stats.sum().backward()
    del alias
    gc.collect()
    assert kept() is None  # the outputs (stats) still alive, the logits not
    masked = z.clone()
    masked[1, 2] = float("-inf")
    ids_masked = ids.clone()
    ids_masked[1, 2] = -100
    g1, g2 = _upstream(ids.shape, 1)
    got = _logits_simulated(masked, ids_masked, 3, "auto", g1, g2)
    assert not got[2].isnan().any() and not got[2][1, 2].any()
    flat = (torch.randn(64, 3 * 2000) * 0.3).bfloat16()
    flat_ids = torch.randint(0, flat.shape[-1], (64,))
    g1, g2 = _upstream(flat_ids.shape, 2)
    got = _logits_simulated(flat, flat_ids, 3, "auto", g1, g2)
    exact = _logits_exact(flat, flat_ids, g1, g2)[2]
    at = torch.stack([flat[:, r * 2000:(r + 1) * 2000].float().argmax(-1) + r * 2000 for r in range(3)], -1)
    err = (got[2].double() - exact).gather(-1, at).abs() / exact.gather(-1, at).abs()
    assert err.max() < 2 * 2.0 ** -8
    z64, ids64 = _logits(23, (2, 11), 3, 300, dtype=torch.float64, kind="masked")
    g1, g2 = _upstream(ids64.shape, 23)
    got = _logits_simulated(z64, ids64, 3, "auto", g1, g2)
    exact = _logits_exact(z64, ids64, g1, g2)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, exact):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-12 * max(b[b.isfinite()].abs().max().item(), 1.0))


def _compile_main(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        z, ids = _logits(25, (2, 9), 1, 300)
        ids = torch.where(ids == 300, 299, ids)
        eager = lambda x: vocab_parallel.token_logprobs(x, ids, temperature=TEMPERATURE, return_entropy=True)
        grads = []
        for call in (torch.compile(eager, backend="aot_eager"), eager):
            x = z.clone().requires_grad_()
            logp, entropy = call(x)
            (logp.sum() + entropy.sum()).backward()
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1])
    finally:
        dist.destroy_process_group()


def test_logits_under_torch_compile(tmp_path):
    """Inside a compiled function the logits path runs eagerly (a graph break): the same gradient as eager."""
    mp.spawn(_compile_main, args=(str(tmp_path / "init"),), nprocs=1, join=True)
