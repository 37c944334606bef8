"""``bench/report.py``'s figure: one colour per implementation in every panel (matplotlib's colour cycle restarts
in each panel, so an implementation missing from one panel shifted the others' colours: "reference" was green in
the fused-linear panel and orange in the others of the README's plot), lines against N or bars for one N."""

import matplotlib.colors as mcolors
import pytest

from bench.report import figure


def _rows(ns):
    rows = []
    for n in ns:
        for op, impls in (("linear_policy_loss", ("cpu", "liger", "reference")), ("policy_loss", ("cpu", "reference"))):
            for k, impl in enumerate(impls):
                rows.append(dict(op=op, mode="fwd+bwd", impl=impl, n=n, time_s=0.1 * (k + 1) * n / 1024,
                                 peak_extra_bytes=(k + 1) * n * 2**10))
    rows.append(dict(op="policy_loss", mode="fwd+bwd", impl="trl", n=ns[0], error="ImportError"))
    return rows


def _colors(ax, bars: bool) -> dict:
    """implementation -> colour of its line or bar in ``ax``."""
    if bars:
        names = [t.get_text() for t in ax.get_yticklabels()]
        return {name: mcolors.to_hex(p.get_facecolor()) for name, p in zip(names, ax.patches)}
    return {line.get_label(): mcolors.to_hex(line.get_color()) for line in ax.get_lines()}


@pytest.mark.parametrize("ns", [[4096], [2048, 4096]], ids=["bars", "lines"])
def test_each_implementation_keeps_its_colour(ns):
    import matplotlib.pyplot as plt

    fig = figure(_rows(ns))
    try:
        seen = {}
        for ax in fig.axes:
            colors = _colors(ax, bars=len(ns) == 1)
            assert set(colors) in ({"cpu", "liger", "reference"}, {"cpu", "reference"})  # errors left out
            for impl, color in colors.items():
                assert seen.setdefault(impl, color) == color, (impl, ax.get_title())
        assert len(set(seen.values())) == 3
        if len(ns) > 1:  # the lines' points: time in ms against N
            line = next(x for x in fig.axes[0].get_lines() if x.get_label() == "reference")
            assert list(line.get_xdata()) == ns and line.get_ydata()[-1] == pytest.approx(0.3 * 4 * 1e3)
    finally:
        plt.close(fig)


def test_a_peer_that_computes_less_says_so_in_the_table():
    """Cut Cross-Entropy's row is the advantage-weighted log-probs without clip or KL: the table says so next to
    its name (``Impl.note`` was never printed, and the row read as the whole loss)."""
    from bench.report import table

    row = dict(op="linear_policy_loss", mode="fwd+bwd", n=256, v=1000, h=64, dtype="fp32", batch=8, time_s=0.01)
    lines = table([dict(row, impl="reference"), dict(row, impl="cce")], "cuda").splitlines()
    assert "| cce (advantage-weighted log-probs only: no clip, no KL) |" in lines[-1]
    assert "| reference |" in lines[-2]


def test_a_peer_layout_is_made_outside_the_timed_step():
    """Liger's ``triton_grpo_loss`` reads ``(B, L+1, V)`` logits: the callable's inputs are padded once, before
    timing, and the padded tensor is the gradient leaf (a ``cat`` in the step added a copy and a full-size zero
    fill and add to the backward)."""
    import torch

    from bench.cases import IMPLS, Shape, make_inputs

    shape = Shape(n=32, v=50)
    inputs = make_inputs("policy_loss", shape, "cpu")
    padded = IMPLS["liger-triton"].prepare(inputs)["logits"]
    assert padded.shape == (shape.batch, shape.t + 1, shape.v)
    torch.testing.assert_close(padded[:, :-1], inputs["logits"], rtol=0, atol=0)
    assert inputs["logits"].shape == (shape.batch, shape.t, shape.v)  # the caller's inputs are left as they were


def test_benchmark_inputs_are_near_the_policy():
    """Old and reference log-probs 0.3 randn off the policy's own (ratios near 1): ``-5 rand`` made every ratio
    ~e^-8 and the loss almost all KL."""
    import torch

    import fused_rl
    from bench.cases import Shape, make_inputs

    for op in ("policy_loss", "linear_policy_loss"):
        x = make_inputs(op, Shape(n=256, v=1000, h=64), "cpu")
        logp = (fused_rl.token_logprobs(x["logits"], x["targets"]) if op == "policy_loss"
                else fused_rl.linear_token_logprobs(x["hidden"], x["weight"], x["targets"]))
        ratio = torch.exp(logp - x["old"])
        assert 0.8 < ratio.median() < 1.25 and (x["old"] <= 0).all() and (x["ref"] <= 0).all(), op
