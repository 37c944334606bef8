"""``bench/bench_linear.py``'s pure-Python parts: its padding, its step's gradients, its printed median and ratios
(on a fake clock)."""

import types

import torch

import fused_rl
from bench import bench_linear


def test_padding_draws_lengths_up_to_the_full_sequence():
    """``--pad p``: lengths uniform in ``[T (1 - 2p), T]`` (both ends drawn among 64 sequences of T = 4); no pad:
    every token."""
    x = bench_linear.make_inputs(64, 4, 2, 3, 0.25)
    lengths = x["mask"].sum(1)
    assert torch.equal(x["mask"], torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1))
    assert set(lengths.tolist()) == {2, 3, 4}
    assert bench_linear.make_inputs(4, 4, 2, 3, 0.0)["mask"].all()


def test_a_step_leaves_one_steps_gradients(monkeypatch):
    """Each timed step starts from no gradient: after two steps the hidden-state gradient is one step's (not twice
    it, an accumulation the timing would include)."""
    leaves = []
    real = fused_rl.reference.linear_policy_loss

    def spy(hidden, weight, *args, **kwargs):
        leaves.append(hidden)
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(fused_rl.reference, "linear_policy_loss", spy)
    inp = bench_linear.make_inputs(2, 4, 8, 16, 0.25)
    step = bench_linear.make_step("reference", inp, False)
    step()
    once = leaves[-1].grad.clone()
    step()
    assert leaves[-1].grad.abs().sum() > 0
    torch.testing.assert_close(leaves[-1].grad, once)


def test_printed_median_and_ratio_on_a_fake_clock(monkeypatch, capsys):
    """``--time-only``: after an untimed warm-up each, the median of the repeats (reference 4, 1, 3 ms: 3 ms;
    fused 2, 9, 1 ms: 2 ms) and the time against the reference's (0.667x)."""
    clock = types.SimpleNamespace(now=0.0)
    durations = {"reference": [100, 4, 1, 3], "fused": [100, 2, 9, 1]}

    def make_step(impl, inp, compute_entropy, op="policy_loss"):
        def step():
            clock.now += durations[impl].pop(0) * 1e-3
        return step

    monkeypatch.setattr(bench_linear, "make_step", make_step)
    monkeypatch.setattr(bench_linear, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(bench_linear.sys, "argv", ["bench_linear.py", "--time-only", "--B", "1", "--T", "2", "--H",
                                                   "2", "--V", "3", "--repeats", "3", "--impls", "reference,fused"])
    bench_linear.main()
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines == ["fwd+bwd median reference       3.0 ms  runs=[4, 1, 3]  (1.000x the reference's time)",
                     "fwd+bwd median fused           2.0 ms  runs=[2, 9, 1]  (0.667x the reference's time)"]


def test_printed_memory_in_mib_and_against_the_reference(monkeypatch, capsys):
    """Memory: each implementation's child reports its extra bytes; printed in MiB (2^20 bytes) with the ratio to
    the reference's (12 MiB and 3 MiB: 0.250x)."""
    extra = {"reference": 12 * 2**20, "fused": 3 * 2**20}

    def run(cmd, **kwargs):
        impl = cmd[cmd.index("--child") + 1]
        return types.SimpleNamespace(returncode=0, stdout=f'{{"impl": "{impl}", "extra": {extra[impl]}}}\n')

    monkeypatch.setattr(bench_linear.subprocess, "run", run)
    monkeypatch.setattr(bench_linear.sys, "argv", ["bench_linear.py", "--memory-only", "--impls", "reference,fused"])
    bench_linear.main()
    assert capsys.readouterr().out.splitlines()[1:] == [
        "peak extra memory reference      12.0 MiB  (1.000x the reference's memory)",
        "peak extra memory fused           3.0 MiB  (0.250x the reference's memory)"]
