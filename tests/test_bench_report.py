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


def _row(**kw):
    row = dict(op="policy_loss", mode="fwd+bwd", impl="reference", n=256, v=100000, h=64, dtype="fp32", batch=8,
               ragged=True, loss_tokens=200, time_s=4e-3, peak_extra_bytes=12 * 2**20)
    return {**row, **kw}


def test_table_figures_by_hand():
    """Each figure of the table worked out by hand: time in ms; speed-up = the reference's time / the row's (same
    op, mode, shape and dtype); GB/s over the loss rows read + every row's dlogits written (``(200 + 256) V``
    fp32 elements in 1 ms: 182.4 GB/s, decimal); TFLOP/s over ``6 N H V``; extra peak memory in MiB and its
    ratio to the reference's."""
    from bench.report import table

    rows = [_row(),
            _row(dtype="bf16", time_s=2e-3, peak_extra_bytes=6 * 2**20),  # its own reference: same figures
            _row(impl="torch", time_s=1e-3, peak_extra_bytes=3 * 2**20),
            _row(op="linear_policy_loss", impl="cpu", n=8192, v=128256, h=4096, dtype="bf16", ragged=False,
                 loss_tokens=8192, time_s=0.04, peak_extra_bytes=None)]
    shape = "N=256 V=100000 {} (200 loss tokens)"
    assert table(rows, "cpu").splitlines()[2:] == [
        f"| policy_loss | fwd+bwd | {shape.format('fp32')} | reference | 4.0 | 1.00x | 45.6 GB/s | 12.0 | 1.000 |",
        f"| policy_loss | fwd+bwd | {shape.format('bf16')} | reference | 2.0 | 1.00x | 45.6 GB/s | 6.0 | 1.000 |",
        f"| policy_loss | fwd+bwd | {shape.format('fp32')} | torch | 1.0 | 4.00x | 182.4 GB/s | 3.0 | 0.250 |",
        # 6 * 8192 * 4096 * 128256 FLOPs in 40 ms; no reference row: no ratios
        "| linear_policy_loss | fwd+bwd | N=8192 V=128256 H=4096 bf16 (8192 loss tokens) | cpu | 40.0 | - | "
        "645.53 TFLOP/s | - | - |"]


def test_run_keeps_the_asked_sizes_repeats_and_memory(monkeypatch):
    """``run``: only the token counts asked for (``--n``), the set's shapes for the ops they are for on the GPU set
    (its logits shape has no H, its linear shape is for the linear op only), ``--repeats`` passed through, memory
    measured unless ``--no-memory``, ``--dtype`` in place of the set's."""
    from bench import report

    calls = []
    monkeypatch.setattr(report, "unavailable", lambda *a: None)
    monkeypatch.setattr(report, "time_case", lambda op, impl, mode, shape, device, repeats, info: (
        calls.append(("time", op, shape.n, repeats)), 0.5)[1])
    monkeypatch.setattr(report, "peak_extra_memory", lambda op, impl, mode, shape, device: (
        calls.append(("memory", op, shape.n)), 7)[1])
    ops = ["policy_loss", "linear_policy_loss"]
    rows = report.run("cpu", ops, ["reference"], ["fwd"], 7, True, "cpu", sizes=[4096])
    assert calls == [("time", "policy_loss", 4096, 7), ("memory", "policy_loss", 4096),
                     ("time", "linear_policy_loss", 4096, 7), ("memory", "linear_policy_loss", 4096)]
    assert [(r["op"], r["n"], r["time_s"], r["peak_extra_bytes"]) for r in rows] == [
        ("policy_loss", 4096, 0.5, 7), ("linear_policy_loss", 4096, 0.5, 7)]
    calls.clear()
    rows = report.run("gpu", ops, ["reference"], ["fwd"], 3, False, "cuda")
    assert calls == [("time", "policy_loss", 16384, 3), ("time", "linear_policy_loss", 8192, 3)]
    assert all("peak_extra_bytes" not in r for r in rows)
    calls.clear()
    monkeypatch.setattr(report, "time_case", lambda op, impl, mode, shape, device, repeats, info: (
        calls.append((shape.n, shape.dtype)), 0.5)[1])
    rows = report.run("cpu", ["policy_loss"], ["reference"], ["fwd"], 1, False, "cpu", sizes=[2048], dtype="bf16")
    assert calls == [(2048, "bf16")] and rows[0]["dtype"] == "bf16"  # --dtype: the set's shapes in that dtype


def test_figure_lines_run_in_token_order():
    """A line joins its points in order of N, whatever their times (here falling with N); time in ms, extra peak
    memory in MiB."""
    import matplotlib.pyplot as plt

    rows = [dict(op="policy_loss", mode="fwd", impl="cpu", n=n, time_s=t, peak_extra_bytes=m * 2**20)
            for n, t, m in ((4096, 0.001, 3), (1024, 0.003, 1), (2048, 0.002, 2))]
    fig = figure(rows)
    try:
        (line,) = fig.axes[0].get_lines()
        assert list(line.get_xdata()) == [1024, 2048, 4096]
        assert list(line.get_ydata()) == pytest.approx([3.0, 2.0, 1.0])
        (memory,) = fig.axes[1].get_lines()
        assert list(memory.get_xdata()) == [1024, 2048, 4096]
        assert list(memory.get_ydata()) == pytest.approx([1.0, 2.0, 3.0])
    finally:
        plt.close(fig)


def test_figure_bars_in_ms_and_mib():
    """One N: a bar per implementation, its time in ms (top) and extra peak memory in MiB (bottom)."""
    import matplotlib.pyplot as plt

    rows = [dict(op="policy_loss", mode="fwd", impl=impl, n=4096, time_s=t, peak_extra_bytes=m * 2**20)
            for impl, t, m in (("cpu", 0.002, 3), ("reference", 0.005, 12))]
    fig = figure(rows)
    try:
        top, bottom = fig.axes
        assert [p.get_width() for p in top.patches] == pytest.approx([2.0, 5.0])
        assert [p.get_width() for p in bottom.patches] == pytest.approx([3.0, 12.0])
    finally:
        plt.close(fig)
