"""``top_entropy_quantile``'s threshold over several processes' entropies
(:func:`fused_rl.loss_math.entropy_quantile_across`, :func:`fused_rl.distributed.all_gather_1d`), as TRL
takes it: the mask against ``torch.quantile`` of the gathered entropies, every backend against the
reference under the same gather, and a real 2-process gloo run against its one-process simulation.
(The TRL trainer's parity: ``tests/test_trl_integration.py``.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.distributed import all_gather_1d
from fused_rl.loss_math import entropy_quantile_across, top_entropy_keep
from helpers import compare_policy_loss, fused_backends, make_case
from test_linear import compare_linear, make_linear_case

CONFIG = PolicyLossConfig(top_entropy_quantile=0.3, entropy_coef=0.01, kl="k3", beta=0.1)
#: A second process's unmasked entropies: above most of the local ones, so the threshold moves up.
OTHER = torch.linspace(6.0, 7.5, 23)


def appending(other: torch.Tensor):
    """A one-process stand-in for the gather: this process's entropies, then ``other``'s."""
    return lambda local: torch.cat([local, other.to(local)])


def test_threshold_is_the_quantile_of_every_process_entropies():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(4, 7, generator=g) * 8
    mask = torch.rand(4, 7, generator=g) < 0.7
    for q in (0.2, 0.5, 0.9):
        with entropy_quantile_across(appending(OTHER)):
            keep = top_entropy_keep(h, mask, q)
        threshold = torch.quantile(torch.cat([h[mask], OTHER]), 1.0 - q)
        assert torch.equal(keep, mask & (h >= threshold))
        alone = top_entropy_keep(h, mask, q)
        assert not torch.equal(keep, alone)
        with entropy_quantile_across(lambda local: local):  # one process: the local threshold, exactly
            assert torch.equal(top_entropy_keep(h, mask, q), alone)
    with entropy_quantile_across(lambda local: local[:0]):  # no unmasked token on any process
        assert not top_entropy_keep(h, mask, 0.5).any()
    assert top_entropy_keep(h, mask, 0.5).any()  # the context ended with the block


@pytest.mark.parametrize("backend", fused_backends())
def test_backends_take_the_gathered_threshold(backend):
    """Every backend (logits and fused linear) under the gather equals the reference under it, and differs
    from the one-process loss (so the gathered entropies reach each backend's loss math). The gather runs
    exactly once per loss, forward and backward together: with a real collective every process must call
    it equally often."""
    case = make_case(batch=5, length=6, vocab=257, seed=4)
    calls = []
    gather = appending(OTHER)
    with entropy_quantile_across(lambda local: calls.append(1) or gather(local)):
        compare_policy_loss(backend, case, CONFIG)
        assert len(calls) == 2  # the reference's and the backend's
        x = case.logits.clone().requires_grad_(True)
        across = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIG,
                                      backend=backend, **case.kwargs()).loss
        across.backward()
        assert len(calls) == 3
        across = across.detach()
    alone = fused_rl.policy_loss(case.logits, case.targets, case.advantages, case.mask, config=CONFIG,
                                 backend=backend, **case.kwargs()).loss
    assert not torch.isclose(across, alone)
    if fused_rl.backends.get_backend(backend, torch.device("cpu")).has_linear:
        with entropy_quantile_across(appending(OTHER)):
            compare_linear(make_linear_case(batch=5, length=6, vocab=257, seed=4), CONFIG, backend=backend)


def _rank_loss(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        case = make_case(batch=4, length=6, vocab=300, seed=10 + rank)
        x = case.logits.clone().requires_grad_(True)
        with entropy_quantile_across(all_gather_1d):
            out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIG,
                                       **case.kwargs())
        out.loss.backward()
        local = torch.arange(5 - 2 * rank, dtype=torch.float32) + 10.0 * (rank + 1)  # rank 0: 5 values, rank 1: 3
        torch.save({"loss": out.loss.detach(), "grad": x.grad, "gathered": all_gather_1d(local)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_their_one_process_simulation(tmp_path):
    """Two processes with different batches (different token counts) under ``all_gather_1d``: each one's
    loss and gradient equal the one-process computation whose gather appends the other's entropies; and
    ``all_gather_1d`` of 5 and 3 values (the longer one first) gives every process both tensors, in rank order,
    the shorter one cut back (no padding zeros)."""
    world = 2
    init_file = str(tmp_path / "init")
    mp.spawn(_rank_loss, args=(world, init_file, str(tmp_path)), nprocs=world, join=True)
    cases = [make_case(batch=4, length=6, vocab=300, seed=10 + rank) for rank in range(world)]
    with torch.no_grad():
        entropies = [fused_rl.token_logprobs(c.logits, c.targets, return_entropy=True)[1][c.mask] for c in cases]
    for rank, case in enumerate(cases):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        x = case.logits.clone().requires_grad_(True)
        with entropy_quantile_across(appending(entropies[1 - rank])):
            expected = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIG,
                                            **case.kwargs())
        expected.loss.backward()
        torch.testing.assert_close(got["loss"], expected.loss.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["grad"], x.grad, atol=1e-7, rtol=1e-5)
        assert torch.equal(got["gathered"], torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 20.0, 21.0, 22.0]))


def test_all_gather_1d_rejects_other_shapes():
    with pytest.raises(ValueError, match="1-D"):
        all_gather_1d(torch.zeros(2, 3))

