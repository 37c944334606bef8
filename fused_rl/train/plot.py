"""``fused-rl plot RUN_DIR``: reward, KL, entropy and length curves from ``RUN_DIR/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class MetricsError(ValueError):
    """``RUN_DIR/metrics.jsonl`` has a malformed line, or nothing to plot."""


class PlotError(MetricsError):
    """The plot's output file has an extension matplotlib cannot write."""


def read_metrics(run_dir) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``; a last line cut short (a run killed while writing it) is
    dropped, a malformed line elsewhere raises :class:`MetricsError` naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise MetricsError(f"{path}: line {i + 1} is not JSON ({exc})") from exc
    return records


def plot_run(run_dir, out: Optional[str] = None) -> Path:
    """Write ``RUN_DIR/reward_curve.png`` (or ``out``) and return its path (``out`` without an extension gets
    matplotlib's default format's, ``.png``, as ``savefig`` writes it; an extension matplotlib cannot write raises
    :class:`PlotError`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = read_metrics(run_dir)
    rows = [r for r in all_rows if "reward" in r]  # training steps (step-0 line: evaluation only)
    if not rows:
        raise MetricsError(f"{Path(run_dir) / 'metrics.jsonl'} has no training steps")
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(8, 5.5), dpi=80)
    panels = (("reward", "reward (train, sampled)"), ("kl", "KL to reference"), ("entropy", "entropy / token"),
              ("length", "completion length"))
    for ax, (key, title) in zip(axes.flat, panels):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            ax.plot(steps, [float("nan") if y is None else y for y in ys], lw=1.2, label="train")
        if key == "reward":
            ev = [(r["step"], r["eval_reward"]) for r in all_rows if "eval_reward" in r]
            if ev:
                ax.plot(*zip(*ev), "o-", ms=3, lw=1, label="eval (greedy)")
            ax.legend(loc="lower right", fontsize=8)
        if key == "kl" and all(y is None for y in ys):
            ax.text(0.5, 0.5, "no reference model (beta = 0)", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    last = rows[-1]
    fig.suptitle(f"{Path(run_dir).name}: {last['step']} steps, {last.get('elapsed_s', 0):.0f} s", fontsize=10)
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "reward_curve.png"
    fmt = path.suffix[1:].lower()
    if not fmt:  # savefig appends the default format's extension: return the file it writes
        fmt = str(matplotlib.rcParams["savefig.format"])
        path = path.with_name(f"{path.name}.{fmt}")
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        plt.close(fig)
        raise PlotError(f"cannot write {str(path)!r}: matplotlib writes {', '.join(sorted(supported))} files")
    fig.savefig(path)
    plt.close(fig)
    return path
