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
