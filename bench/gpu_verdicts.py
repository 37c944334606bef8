"""Issues 3 and 4's verdicts from the JSON that ``gpu_logits_bench.py`` and ``gpu_linear_budget.py`` wrote under
``WORK`` (``WORK/logits/logits_bench.json``, ``WORK/linear_budget/linear_budget.json``), a few lines for
``gpu_check.sh``'s summary, so that a device session reads them without unpacking the results.

Usage: python bench/gpu_verdicts.py WORK

* issue 3: ``issue3_goal`` of the logits benchmark (the goal's ms at 80% of the run's copy bandwidth, the fastest
  single-pass row, met or not);
* issue 4: per backend, the fastest row of the issue's config (no variant, any tile budget or Triton knobs) with
  its ``issue4_flop_goal_met``, and whether any row of that config met the memory goal, at which budget.
"""

from __future__ import annotations

import json
import pathlib
import sys


def _load(path: pathlib.Path):
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return exc
    return report if isinstance(report, dict) else ValueError("not a JSON object")


def _verdict(flag) -> str:
    """A goal's flag as the rows store it: True, False, or None where not measured (a dry run, a variant row)."""
    return {True: "MET", False: "not met"}.get(flag, "not measured")


def _mib(value) -> str:
    return "? MiB" if value is None else f"{value:.0f} MiB"


def issue3_lines(work: pathlib.Path) -> list[str]:
    report = _load(work / "logits" / "logits_bench.json")
    if isinstance(report, Exception):
        return [f"issue 3: no logits result ({type(report).__name__})"]
    goal = report.get("issue3_goal")
    if not goal:
        return ["issue 3: no verdict in the logits result (no single-pass row yet, a --ragged run, or older JSON)"]
    return [f"issue 3: goal <= {goal['goal_ms']:.3f} ms; fastest {goal['best']} {goal['best_ms']:.3f} ms "
            f"({goal['best_percent_of_copy_bw']:.1f}% of copy BW): {_verdict(goal['met'])}"]


def issue4_lines(work: pathlib.Path) -> list[str]:
    report = _load(work / "linear_budget" / "linear_budget.json")
    if isinstance(report, Exception):
        return [f"issue 4: no linear_budget result ({type(report).__name__})"]
    rows = [r for r in report.get("results", []) if "ms" in r and r.get("variant") is None
            and r["backend"] != "gemms only"]
    if not rows:
        return ["issue 4: no row of the issue's config measured"]
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        best = min(mine, key=lambda r: r["ms"])
        memory = sorted({r["budget_gib"] for r in mine if r.get("issue4_memory_goal_met")})
        memory_verdict = ("MET at " + ", ".join(f"{b} GiB" for b in memory) if memory else
                          _verdict(False if any(r.get("issue4_memory_goal_met") is not None for r in mine) else None))
        peaks = ", ".join(f"{r['budget_gib']} GiB {_mib(r.get('peak_extra_beyond_fp32_dw_mib'))}"
                          for r in mine if not r.get("knobs"))
        lines.append(f"issue 4 ({backend}): fastest {best['ms']:.2f} ms ({best.get('tflops') or 0:.0f} TFLOP/s, "
                     f"{best['budget_gib']} GiB tiles, knobs {best.get('knobs') or 'default'}): FLOP goal "
                     f"{_verdict(best.get('issue4_flop_goal_met'))}; memory goal {memory_verdict} "
                     f"(peak beyond the fp32 dW: {peaks})")
    return lines


def main(argv: list[str]) -> None:
    work = pathlib.Path(argv[1])
    lines = ["== verdicts"]
    for issue, verdicts in ((3, issue3_lines), (4, issue4_lines)):
        try:  # one issue's unexpected JSON must not lose the other's line
            lines += verdicts(work)
        except Exception as exc:  # noqa: BLE001
            lines.append(f"issue {issue}: no verdict ({type(exc).__name__}: {exc})")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
