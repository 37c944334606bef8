"""fused_rl.integrations.megatron against the peers' own code in real gloo process groups: Megatron-Core 0.16.1's
``vocab_parallel_cross_entropy`` (``megatron/core/tensor_parallel/cross_entropy.py``) and verl 0.9.1's Megatron
log-prob / entropy functions (``verl/utils/megatron/tensor_parallel.py``), each file loaded by path (their wheels
installed with ``--no-deps`` by .ci/run), with stand-ins for what they import (``bench.cases.megatron_cross_entropy``:
Megatron's ``parallel_state``, the default group as the tensor-parallel one) and for the packages' ``__init__``
(which import the rest of their stacks)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.cases import installed_path, load_module_file, megatron_cross_entropy, stand_in_package
from fused_rl.integrations import megatron as ours

TOKENS, SHARD = (13, 2), 500


def _peers_installed() -> None:
    missing = [name for name in ("megatron", "verl") if installed_path(name) is None]
    if missing:
        if os.environ.get("FUSED_RL_REQUIRE_OPENRLHF") == "1":  # .ci/run installs the peers: missing is a failure
            pytest.fail(f"{missing} not installed (pip install --no-deps megatron-core==0.16.1 verl==0.9.1)")
        pytest.skip(f"{missing} not installed (pip install --no-deps megatron-core==0.16.1 verl==0.9.1)")


def _load_peers():
    """Megatron's cross entropy and verl's Megatron functions in this (worker) process, on the default group."""
    cross_entropy = megatron_cross_entropy()
    verl = installed_path("verl")
    for name in ("verl", "verl.utils", "verl.utils.megatron"):
        stand_in_package(name, verl.joinpath(*name.split(".")[1:]))
    verl_tp = load_module_file("verl.utils.megatron.tensor_parallel",
                               verl / "utils" / "megatron" / "tensor_parallel.py")
    return cross_entropy, verl_tp


def _inputs(world: int):
    g = torch.Generator().manual_seed(world)
    z = torch.randn(*TOKENS, world * SHARD, generator=g) * 3
    z[..., torch.randint(0, world * SHARD, (4,), generator=g)] += 12.0  # a few likely tokens
    ids = torch.randint(0, world * SHARD, TOKENS, generator=g)
    ids[0, 0], ids[1, 0] = SHARD - 1, SHARD  # the first slice's last column and the second's first
    g1, g2 = torch.randn(TOKENS, generator=g, dtype=torch.float64), torch.randn(TOKENS, generator=g,
                                                                                dtype=torch.float64)
    return z, ids, g1, g2


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # verl's entropy compiles a two-line helper at each call: eager here (inductor would build C++ per process)
        torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        cross_entropy, verl_tp = _load_peers()
        z, ids, g1, g2 = _inputs(world)
        mine = z[..., rank * SHARD:(rank + 1) * SHARD]
        out = {}
        calls = {
            "megatron": lambda x: -cross_entropy.vocab_parallel_cross_entropy(x, ids),
            "megatron-ours": lambda x: -ours.vocab_parallel_cross_entropy(x, ids),
            "verl-logp": lambda x: verl_tp.vocab_parallel_log_probs_from_logits(x, ids),
            "verl-logp-ours": lambda x: ours.vocab_parallel_log_probs_from_logits(x, ids),
            "verl-entropy": lambda x: verl_tp.vocab_parallel_entropy(x),
            "verl-entropy-ours": lambda x: ours.vocab_parallel_entropy(x),
            "verl-chunked": lambda x: verl_tp.vocab_parallel_entropy_with_chunking(x, chunk_size=5),
            "verl-chunked-ours": lambda x: ours.vocab_parallel_entropy_with_chunking(x, chunk_size=5),
        }
        for name, call in calls.items():
            x = mine.clone().requires_grad_()
            value = call(x)
            ((value.double() * (g2 if "entropy" in name or "chunked" in name else g1)).sum()).backward()
            out[name] = (value.detach(), x.grad, torch.equal(x.detach(), mine))
        # (batch, seq, 1, V / tp) logits in two chunks of the second dimension: verl's backward writes into each
        # chunk's saved view of the logits and fails on the next chunk's
        x = mine.clone().requires_grad_()
        value = ours.vocab_parallel_entropy_with_chunking(x.unsqueeze(2), chunk_size=1).squeeze(2)
        ((value.double() * g2).sum()).backward()
        out["chunked4d"] = (value.detach(), x.grad)
        try:
            verl_tp.vocab_parallel_entropy_with_chunking(mine.clone().requires_grad_().unsqueeze(2), 1).sum().backward()
        except RuntimeError as exc:
            out["verl two chunks"] = "modified by an inplace operation" in str(exc)
        previous = ours.patch_verl_megatron(modules=("verl.utils.megatron.tensor_parallel",), backend="torch")
        out["patched"] = (set(previous["verl.utils.megatron.tensor_parallel"]),
                          verl_tp.vocab_parallel_entropy.func is ours.vocab_parallel_entropy,
                          verl_tp.vocab_parallel_entropy.keywords,
                          verl_tp.vocab_parallel_log_probs_from_logits.keywords,
                          verl_tp.vocab_parallel_log_probs_from_logits(mine, ids).detach())
        try:
            ours.vocab_parallel_cross_entropy(mine, ids, label_smoothing=0.1)
        except NotImplementedError as exc:
            out["smoothing"] = str(exc)
        try:  # process 1's alone: raised there, and on the others (not left waiting in the check's all_gather)
            ours.vocab_parallel_cross_entropy(mine, ids, label_smoothing=0.1 if rank == 1 else 0.0)
        except (NotImplementedError, ValueError) as exc:
            out["one smoothing"] = f"{type(exc).__name__}: {exc}"
        out["no smoothing"] = torch.equal(ours.vocab_parallel_cross_entropy(mine, ids, label_smoothing=-0.1),
                                          ours.vocab_parallel_cross_entropy(mine, ids))  # <= 0: none, as Megatron's
        # the default modules: verl's engine module (a stand-in binding the three names, as its import does) too;
        # the options reach each name, the previous functions are returned
        for attr, function in previous["verl.utils.megatron.tensor_parallel"].items():
            setattr(verl_tp, attr, function)
        engine = types.ModuleType("verl.workers.engine.megatron.transformer_impl")
        for attr in previous["verl.utils.megatron.tensor_parallel"]:
            setattr(engine, attr, getattr(verl_tp, attr))
        sys.modules[engine.__name__] = engine
        originals = dict(previous["verl.utils.megatron.tensor_parallel"])
        previous = ours.patch_verl_megatron(backend="torch", check_inputs=False)
        beyond = torch.full_like(ids, world * SHARD + 3)  # in no slice: raises with check_inputs only
        out["default"] = (
            {name: previous[name] == originals for name in previous},
            [getattr(engine, attr).keywords for attr in sorted(originals)],
            torch.isfinite(engine.vocab_parallel_log_probs_from_logits(mine, beyond)).all().item())
        raised = []
        for call in (ours.vocab_parallel_cross_entropy, ours.vocab_parallel_log_probs_from_logits):
            try:
                call(mine, beyond)
            except ValueError:
                raised.append(True)
            raised.append(call(mine, beyond, check_inputs=False).shape == ids.shape)
        out["check_inputs"] = raised
        if world == 3:  # Megatron's tensor-parallel group a sub-group (global ranks 1, 2), resolved at each call
            sub = dist.new_group([1, 2])
            state = sys.modules["megatron.core.parallel_state"]
            state.get_tensor_model_parallel_group = lambda: sub
            if rank > 0:
                sub_z = z[..., (rank - 1) * SHARD:rank * SHARD]
                out["sub"] = (ours.vocab_parallel_log_probs_from_logits(sub_z, ids % (2 * SHARD)),
                              ours.vocab_parallel_entropy(sub_z))
            state.get_tensor_model_parallel_group = lambda: dist.group.WORLD
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_against_megatron_and_verl(tmp_path, world):
    """Per rank, from its slice of the logits: Megatron's cross entropy and verl's log-probs / entropies (plain and
    chunked) against fused_rl's drop-ins: values and each rank's logits gradient (of random upstream gradients) the
    peers' within fp32 rounding, both against float64 over the whole vocabulary; fused_rl leaves the logits as they
    were;
    the chunked entropy of 4-D logits in two chunks against float64 (verl's backward raises there); the verl patch
    rebinds the three names with its options; label smoothing raises."""
    _peers_installed()
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    z, ids, g1, g2 = _inputs(world)
    z64 = z.double().requires_grad_()
    logp_all = z64.log_softmax(-1)
    exact_logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    exact_entropy = -(logp_all.exp() * logp_all).sum(-1)
    exact = {"logp": (exact_logp.detach(), torch.autograd.grad((exact_logp * g1).sum(), z64, retain_graph=True)[0]),
             "entropy": (exact_entropy.detach(), torch.autograd.grad((exact_entropy * g2).sum(), z64)[0])}
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for peer, kind in (("megatron", "logp"), ("verl-logp", "logp"), ("verl-entropy", "entropy"),
                       ("verl-chunked", "entropy")):
        value, grad = exact[kind]
        # fused_rl leaves the logits as they were (Megatron's fp32 logits are shifted in place by their max)
        assert all(r[peer + "-ours"][2] for r in ranks)
        for name in (peer, peer + "-ours"):
            assert all(torch.equal(r[name][0], ranks[0][name][0]) for r in ranks)
            got = torch.cat([r[name][1].double() for r in ranks], dim=-1)
            torch.testing.assert_close(ranks[0][name][0].double(), value, rtol=0, atol=2e-5)
            torch.testing.assert_close(got, grad, rtol=0, atol=1e-5 * grad.abs().max().item())
        theirs = torch.cat([r[peer][1] for r in ranks], dim=-1)
        mine = torch.cat([r[peer + "-ours"][1] for r in ranks], dim=-1)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
        torch.testing.assert_close(ranks[0][peer + "-ours"][0], ranks[0][peer][0], rtol=0, atol=2e-5)
    value, grad = exact["entropy"]
    torch.testing.assert_close(ranks[0]["chunked4d"][0].double(), value, rtol=0, atol=2e-5)
    got = torch.cat([r["chunked4d"][1].double() for r in ranks], dim=-1)
    torch.testing.assert_close(got, grad, rtol=0, atol=1e-5 * grad.abs().max().item())
    assert all(r["verl two chunks"] for r in ranks)
    for r in ranks:
        names, is_ours, keywords, logp_keywords, patched = r["patched"]
        assert logp_keywords == dict(check_inputs=True, group=None, backend="torch")  # the default check_inputs
        assert names == {"vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
                         "vocab_parallel_entropy_with_chunking"}
        assert is_ours and keywords == dict(group=None, backend="torch")
        torch.testing.assert_close(patched.double(), exact["logp"][0], rtol=0, atol=2e-5)
        assert "label_smoothing=0.1" in r["smoothing"] and r["no smoothing"]
    for number, r in enumerate(ranks):
        assert r["one smoothing"].startswith("NotImplementedError: vocab_parallel_cross_entropy: label_smoothing=0.1"
                                             if number == 1 else
                                             "ValueError: fused_rl.vocab_parallel: the arguments of process(es) [1]")
    for r in ranks:
        same, keywords, finite = r["default"]
        assert same == {"verl.utils.megatron.tensor_parallel": True,
                        "verl.workers.engine.megatron.transformer_impl": True}
        assert keywords == [dict(group=None, backend="torch")] * 2 + [dict(check_inputs=False, group=None,
                                                                          backend="torch")]
        assert finite and r["check_inputs"] == [True, True, True, True]
    if world == 3:
        sub = z[..., :2 * SHARD].double().log_softmax(-1)
        for r in ranks[1:]:
            logp, entropy = r["sub"]
            expected = sub.gather(-1, (ids % (2 * SHARD)).unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(logp.double(), expected, rtol=0, atol=2e-5)
            torch.testing.assert_close(entropy.double(), -(sub.exp() * sub).sum(-1), rtol=0, atol=2e-5)


def test_chunked_entropy_arguments():
    z = torch.zeros(2, 3, 10)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            ours.vocab_parallel_entropy_with_chunking(z, chunk_size=bad)
    with pytest.raises(ValueError, match=r"\(batch, seq, \.\.\., V / tp\) logits, got shape \(6, 10\)"):
        ours.vocab_parallel_entropy_with_chunking(z.view(6, 10))


def test_options_reach_the_fused_pass(monkeypatch):
    """Each drop-in passes its group, ``backend`` and (log-probs) ``check_inputs`` on; the entropies read no target
    check (their stand-in targets are always in range)."""
    seen = []

    def spy(logits, targets, **kwargs):
        seen.append(kwargs)
        logp = torch.zeros(targets.shape)
        return (logp, logp) if kwargs.get("return_entropy") else logp

    monkeypatch.setattr(ours.vocab_parallel, "token_logprobs", spy)
    z, ids, group = torch.zeros(2, 3, 10), torch.zeros(2, 3, dtype=torch.long), object()
    ours.vocab_parallel_cross_entropy(z, ids, group=group, backend="torch", check_inputs=False)
    ours.vocab_parallel_log_probs_from_logits(z, ids, group=group, backend="cpu")
    ours.vocab_parallel_entropy(z, group=group, backend="triton")
    ours.vocab_parallel_entropy_with_chunking(z.unsqueeze(2), chunk_size=2, group=group, backend="reference")
    assert seen == [dict(group=group, backend="torch", check_inputs=False),
                    dict(group=group, backend="cpu", check_inputs=True),
                    dict(group=group, return_entropy=True, backend="triton", check_inputs=False),
                    dict(group=group, return_entropy=True, backend="reference", check_inputs=False)]
