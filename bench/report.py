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
import json
import sys
from pathlib import Path

import torch

from .cases import IMPLS, MODES, OPS, SHAPE_SETS, describe, floor_bytes, floor_flops, unavailable
from .measure import peak_extra_memory, time_case


def run(set_name: str, ops, impls, modes, repeats: int, memory: bool, device: str, sizes=None) -> list[dict]:
    rows = []
    for shape in SHAPE_SETS[set_name]:
        if sizes and shape.n not in sizes:
            continue
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
        lines.append(f"| {r['op']} | {r['mode']} | {shape} | {r['impl']} | {t * 1e3:.1f} | {speed} | {thr} | "
                     f"{mem_s} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["op"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 7), squeeze=False)
    for col, (op, mode) in enumerate(groups):
        for impl in sorted({r["impl"] for r in rows}):
            pts = sorted((r["n"], r["time_s"], r.get("peak_extra_bytes")) for r in rows
                         if r["op"] == op and r["mode"] == mode and r["impl"] == impl and "error" not in r)
            if not pts:
                continue
            axes[0][col].plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=impl)
            mem = [(p[0], p[2]) for p in pts if p[2] is not None]
            if mem:
                axes[1][col].plot([m[0] for m in mem], [m[1] / 2**20 for m in mem], marker="o", label=impl)
        axes[0][col].set_title(f"{op} {mode}")
        axes[0][col].set_ylabel("time (ms)")
        axes[1][col].set_ylabel("extra peak memory (MiB)")
        axes[1][col].set_xlabel("tokens N")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="cpu", choices=sorted(SHAPE_SETS))
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--n", default="", help="comma list of token counts N to keep from the set (default: all)")
    p.add_argument("--out", type=Path, default=None, help="folder for report.md, results.json, report.png")
    args = p.parse_args(argv)
    if args.set == "gpu" and not torch.cuda.is_available():
        p.error("--set gpu needs a CUDA device (its shapes are far too large for the CPU)")
    device = "cuda" if args.set == "gpu" else "cpu"
    rows = run(args.set, args.ops.split(","), args.impls.split(","), args.modes.split(","), args.repeats,
               not args.no_memory, device, sizes=[int(n) for n in args.n.split(",") if n])
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
        plot(rows, args.out / "report.png")


if __name__ == "__main__":
    main()
