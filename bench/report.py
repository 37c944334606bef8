"""Run a benchmark set and print a Markdown table; write the table, a JSON dump and a PNG plot.

    python -m bench.report --set cpu --out bench/results/cpu
    python -m bench.report --set gpu --out $OUT            # on a CUDA machine

Columns: median time per iteration, speed-up against the eager reference (same op, mode, shape),
achieved throughput against the explicit floor (GB/s for logits ops: ``N V`` bytes read forward, plus
``N V`` written in fwd+bwd; TFLOP/s for the linear op: ``2 / 6 N H V``), extra peak memory beyond
inputs and outputs (see bench/measure.py) and its ratio to the reference's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from .cases import DTYPES, IMPLS, MODES, OPS, SHAPE_SETS, describe, floor_bytes, floor_flops, unavailable
from .measure import peak_extra_memory, time_case


def run(set_name: str, ops, impls, modes, repeats: int, memory: bool, device: str, sizes=None,
        dtype: Optional[str] = None) -> list[dict]:
    """The rows of the set's shapes (those of ``sizes`` tokens; in ``dtype`` where given)."""
    rows = []
    for shape in SHAPE_SETS[set_name]:
        if sizes and shape.n not in sizes:
            continue
        shape = dataclasses.replace(shape, dtype=dtype) if dtype else shape
        for op in ops:
            if (op == "linear_policy_loss") != bool(shape.h) and set_name == "gpu":
                continue
            for mode in modes:
                for impl in impls:
                    reason = unavailable(IMPLS[impl], op, device)
                    if reason:
                        if reason.endswith("is not installed"):  # a peer asked for: say why its row is missing
                            print(f"skipped {impl} ({op}): {reason}", flush=True)
                        continue
                    row = describe(op, impl, mode, shape)
                    try:
                        row["time_s"] = time_case(op, impl, mode, shape, device, repeats, info=row)
                        if memory:
                            row["peak_extra_bytes"] = peak_extra_memory(op, impl, mode, shape, device)
                    except Exception as exc:  # one failing peer must not hide the rest; the table says why
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def _key(row):
    return (row["op"], row["mode"], row["n"], row["v"], row["h"], row["dtype"])


def table(rows: list[dict], device: str) -> str:
    ref = {_key(r): r for r in rows if r["impl"] == "reference" and "error" not in r}
    lines = ["| op | mode | shape | impl | time (ms) | vs reference | throughput | extra peak MiB | mem vs reference |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shape = f"N={r['n']} V={r['v']}" + (f" H={r['h']}" if r["op"] == "linear_policy_loss" else "")
        shape += f" {r['dtype']}" + (f" ({r['loss_tokens']} loss tokens)" if "loss_tokens" in r else "")
        if "error" in r:
            lines.append(f"| {r['op']} | {r['mode']} | {shape} | {r['impl']} | failed: {r['error']} | | | | |")
            continue
        base = ref.get(_key(r))
        t = r["time_s"]
        speed = f"{base['time_s'] / t:.2f}x" if base else "-"
        from .cases import Shape
        s = Shape(n=r["n"], v=r["v"], h=r["h"], dtype=r["dtype"], batch=r["batch"], ragged=r.get("ragged", True))
        if r["op"] == "linear_policy_loss":
            thr = f"{floor_flops(r['op'], r['mode'], s) / t / 1e12:.2f} TFLOP/s"
        else:
            thr = f"{floor_bytes(r['op'], r['mode'], s, r.get('loss_tokens')) / t / 1e9:.1f} GB/s"
        mem = r.get("peak_extra_bytes")
        mem_s = f"{mem / 2**20:.1f}" if mem is not None else "-"
        ratio = "-"
        if mem is not None and base and base.get("peak_extra_bytes"):
            ratio = f"{mem / base['peak_extra_bytes']:.3f}"
        note = IMPLS[r["impl"]].note if r["impl"] in IMPLS else ""
        impl = f"{r['impl']} ({note})" if note else r["impl"]
        lines.append(f"| {r['op']} | {r['mode']} | {shape} | {impl} | {t * 1e3:.1f} | {speed} | {thr} | "
                     f"{mem_s} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Writes :func:`figure` of ``rows`` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(rows: list[dict]):
    """Time (top) and extra peak memory (bottom) of each implementation, a column per (op, mode): against N where
    the rows have several token counts, else one bar per implementation; an implementation keeps its colour in
    every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["op"], r["mode"]) for r in rows})
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(sorted({r["impl"] for r in rows}))}
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 7), squeeze=False)
    for col, (op, mode) in enumerate(groups):
        ok = [r for r in rows if r["op"] == op and r["mode"] == mode and "error" not in r]
        points = {impl: [(r["n"], r["time_s"] * 1e3, r.get("peak_extra_bytes")) for r in ok if r["impl"] == impl]
                  for impl in colors}
        series = {impl: sorted(pts, key=lambda p: p[0]) for impl, pts in points.items() if pts}
        top, bottom = axes[0][col], axes[1][col]
        ns = sorted({r["n"] for r in ok})
        if len(ns) == 1:  # one shape: bars
            names = list(series)
            top.barh(names, [series[i][0][1] for i in names], color=[colors[i] for i in names])
            mem = [i for i in names if series[i][0][2] is not None]
            bottom.barh(mem, [series[i][0][2] / 2**20 for i in mem], color=[colors[i] for i in mem])
            top.set_xlabel(f"time (ms), N = {ns[0]}")
            bottom.set_xlabel(f"extra peak memory (MiB), N = {ns[0]}")
            top.invert_yaxis()
            bottom.invert_yaxis()
        else:
            for impl, pts in series.items():
                top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=colors[impl])
                mem = [(p[0], p[2] / 2**20) for p in pts if p[2] is not None]
                if mem:
                    bottom.plot(*zip(*mem), marker="o", label=impl, color=colors[impl])
            top.set_ylabel("time (ms)")
            bottom.set_ylabel("extra peak memory (MiB)")
            bottom.set_xlabel("tokens N")
            top.legend(fontsize=7)
        top.set_title(f"{op} {mode}")
    fig.tight_layout()
    return fig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="cpu", choices=sorted(SHAPE_SETS))
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--n", default="", help="comma list of token counts N to keep from the set (default: all)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="the shapes' dtype (default: the set's)")
    p.add_argument("--out", type=Path, default=None, help="folder for report.md, results.json, report.png")
    args = p.parse_args(argv)
    if args.set == "gpu" and not torch.cuda.is_available():
        p.error("--set gpu needs a CUDA device (its shapes are far too large for the CPU)")
    device = "cuda" if args.set == "gpu" else "cpu"
    rows = run(args.set, args.ops.split(","), args.impls.split(","), args.modes.split(","), args.repeats,
               not args.no_memory, device, sizes=[int(n) for n in args.n.split(",") if n], dtype=args.dtype)
    command = "python -m bench.report " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"`{command}` on {device} "
              f"({torch.cuda.get_device_name() if device == 'cuda' else f'{torch.get_num_threads()} threads'}), "
              f"torch {torch.__version__}\n\n")
    md = header + table(rows, device)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(md + "\n")
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        if rows:
            plot(rows, args.out / "report.png")


if __name__ == "__main__":
    main()
