"""The GPU benchmark scripts of ``bench/gpu_check.sh`` on this CPU machine, in their dry-run modes: a
device session has one or two runs, so a script that breaks must break here first.

``bench/gpu_logits_bench.py --cpu-dry-run`` runs every variant and both sweeps on the Triton interpreter
(N = 64, V = 1000), with its full-size agreement check against the reference; ``bench/gpu_linear_profile.py
--device cpu`` profiles the ``cpu`` backend's fused linear loss on a small shape; ``bench/gpu_linear_budget.py
--cpu-dry-run`` runs its tile budgets and Triton knob settings on a small shape (triton in the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _needs_interpreter() -> None:
    """Skip, saying why, where the Triton interpreter cannot run the kernels (the dry runs' triton rows)."""
    from helpers import triton_interpreter_reason

    reason = triton_interpreter_reason()
    if reason is not None:
        pytest.skip(reason)


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")  # the dry run is on the CPU interpreter
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def _verdicts(work) -> list[str]:
    """``bench/gpu_verdicts.py`` on ``work`` (``gpu_check.sh``'s WORK: the benchmarks' outputs under ``logits/``
    and ``linear_budget/``), its lines after the heading."""
    res = subprocess.run([sys.executable, "bench/gpu_verdicts.py", str(work)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    heading, *lines = res.stdout.splitlines()
    assert heading == "== verdicts"
    return lines


def test_logits_bench_dry_run(tmp_path):
    _needs_interpreter()
    _run(["bench/gpu_logits_bench.py", str(tmp_path / "logits"), "--cpu-dry-run"], tmp_path)
    report = json.loads((tmp_path / "logits" / "logits_bench.json").read_text())
    rows = report["results"]
    assert not [r for r in rows if "error" in r], rows
    names = [r["name"] for r in rows]
    assert "triton single-pass" in names and "reference (eager fp32 log_softmax)" in names
    assert any(n.startswith("sweep triton") and "prefetch=True" in n for n in names)
    # the script's own agreement check: the same loss as the reference
    check = report["info"]["check_loss"]
    assert check["triton"] == pytest.approx(check["reference"], rel=1e-5, abs=1e-6)
    assert (tmp_path / "logits" / "logits_bench.md").read_text().startswith("# logits-pass benchmark")
    # issue 3's verdict: the goal's ms from the run's own copy bandwidth, over the single-pass rows (not the
    # no-entropy or grad_output = 2 ones)
    info, goal = report["info"], report["issue3_goal"]
    assert goal["goal_ms"] == pytest.approx(2 * info["pass_bytes"] / (0.8 * info["copy_GBps"] * 1e9) * 1e3)
    single = [r for r in rows if r["name"] in ("triton single-pass", "triton single-pass in place")
              or r["name"].startswith(("sweep triton single-pass", "sweep triton split"))]
    assert any(n.startswith("sweep triton split") for n in names) and len(single) > 4
    assert goal["best_ms"] == min(r["ms"] for r in single) and goal["met"] == (goal["best_ms"] <= goal["goal_ms"])
    assert "Issue 3's goal (80% of the copy bandwidth" in (tmp_path / "logits" / "logits_bench.md").read_text()
    assert _verdicts(tmp_path)[0] == (f"issue 3: goal <= {goal['goal_ms']:.3f} ms; fastest {goal['best']} "
                                      f"{goal['best_ms']:.3f} ms ({goal['best_percent_of_copy_bw']:.1f}% of copy "
                                      f"BW): {'MET' if goal['met'] else 'not met'}")


def test_linear_profile_dry_run(tmp_path):
    _run(["bench/gpu_linear_profile.py", str(tmp_path), "--device", "cpu", "--steps", "1"], tmp_path)
    report = json.loads((tmp_path / "linear_profile.json").read_text())["results"]
    assert "error" not in report["cpu"], report
    kinds = report["cpu"]["kinds_ms"]
    assert kinds.get("gemm", 0) > 0 and kinds.get("logits kernel", 0) > 0, kinds


def test_linear_budget_dry_run(tmp_path):
    _needs_interpreter()
    _run(["bench/gpu_linear_budget.py", str(tmp_path / "linear_budget"), "--cpu-dry-run"], tmp_path)
    rows = json.loads((tmp_path / "linear_budget" / "linear_budget.json").read_text())["results"]
    assert not [r for r in rows if "error" in r], rows
    backends = [r["backend"] for r in rows]
    assert backends.count("gemms only") == 3 and backends.count("cpu") == 5
    assert [(r["backend"], r["variant"]) for r in rows if r.get("variant")] == [
        ("triton", "vllm_is"), ("cpu", "vllm_is"), ("triton", "gspo"), ("cpu", "gspo")]
    # issue 4's verdicts are GPU-only: present in every timed row, None in the dry run
    assert all(r["issue4_flop_goal_met"] is None and r["issue4_memory_goal_met"] is None
               for r in rows if r["backend"] != "gemms only")
    knobs = [r["knobs"] for r in rows if r["backend"] == "triton"]
    assert {} in knobs and dict(programs=2, prefetch=True) in knobs and dict(block=8192) in knobs
    verdicts = _verdicts(tmp_path)[1:]  # after issue 3's "no logits result"
    assert [line.split(":")[0] for line in verdicts] == ["issue 4 (triton)", "issue 4 (cpu)"]
    assert all("FLOP goal not measured; memory goal not measured" in line for line in verdicts)  # a dry run


def test_verdicts_from_the_benchmarks_json(tmp_path):
    """``bench/gpu_verdicts.py`` (the summary lines of ``gpu_check.sh``) on the JSON the two benchmarks write: issue
    3's goal as ``gpu_logits_bench.py`` states it, issue 4's fastest row of the issue's config per backend (not the
    variants, not the GEMMs alone) with its goals, and a line that says so where a result is missing."""
    (tmp_path / "logits").mkdir()
    (tmp_path / "logits" / "logits_bench.json").write_text(json.dumps(dict(info={}, results=[], issue3_goal=dict(
        goal_ms=2.897, best="sweep triton split CHUNK=8192 warps=4 hints=True", best_ms=2.85,
        best_percent_of_copy_bw=81.3, met=True))))
    row = dict(backend="triton", budget_gib=1.0, knobs={}, variant=None, ms=40.0, tflops=645.0,
               peak_extra_beyond_fp32_dw_mib=1206.0, issue4_memory_goal_met=True, issue4_flop_goal_met=False)
    rows = [row, {**row, "budget_gib": 1.35, "ms": 38.0, "tflops": 679.0, "peak_extra_beyond_fp32_dw_mib": 1584.0,
                  "issue4_memory_goal_met": False, "issue4_flop_goal_met": True},
            {**row, "knobs": {"split": 8192}, "ms": 39.0, "tflops": 662.0},
            {**row, "variant": "gspo", "ms": 1.0, "tflops": 1e5, "issue4_flop_goal_met": None},
            dict(backend="gemms only", budget_gib=1.0, ms=34.0, tflops=760.0),
            {**row, "backend": "cuda", "ms": 43.0, "tflops": 600.0, "issue4_memory_goal_met": False},
            dict(backend="cuda", budget_gib=1.2, knobs=None, variant=None, error="RuntimeError: x")]
    (tmp_path / "linear_budget").mkdir()
    (tmp_path / "linear_budget" / "linear_budget.json").write_text(json.dumps(dict(results=rows)))
    lines = _verdicts(tmp_path)
    assert lines[0] == ("issue 3: goal <= 2.897 ms; fastest sweep triton split CHUNK=8192 warps=4 hints=True "
                        "2.850 ms (81.3% of copy BW): MET")
    assert lines[1] == ("issue 4 (triton): fastest 38.00 ms (679 TFLOP/s, 1.35 GiB tiles, knobs default): FLOP goal "
                        "MET; memory goal MET at 1.0 GiB (peak beyond the fp32 dW: 1.0 GiB 1206 MiB, "
                        "1.35 GiB 1584 MiB)")
    assert lines[2].startswith("issue 4 (cuda): fastest 43.00 ms")
    assert "FLOP goal not met; memory goal not met" in lines[2]
    assert len(lines) == 3
    (tmp_path / "linear_budget" / "linear_budget.json").unlink()
    (tmp_path / "logits" / "logits_bench.json").write_text(json.dumps(dict(info={}, results=[], issue3_goal=None)))
    assert _verdicts(tmp_path) == [
        "issue 3: no verdict in the logits result (no single-pass row yet, a --ragged run, or older JSON)",
        "issue 4: no linear_budget result (FileNotFoundError)"]
    # JSON the scripts do not write: one issue's line survives the other's
    (tmp_path / "logits" / "logits_bench.json").write_text("[]")
    (tmp_path / "linear_budget" / "linear_budget.json").write_text(json.dumps(dict(results=[
        {**row, "peak_extra_beyond_fp32_dw_mib": None, "issue4_memory_goal_met": None, "issue4_flop_goal_met": None},
        {**row, "budget_gib": 1.2, "issue4_memory_goal_met": False}])))
    assert _verdicts(tmp_path) == [
        "issue 3: no logits result (ValueError)",
        "issue 4 (triton): fastest 40.00 ms (645 TFLOP/s, 1.0 GiB tiles, knobs default): FLOP goal not measured; "
        "memory goal not met (peak beyond the fp32 dW: 1.0 GiB ? MiB, 1.2 GiB 1206 MiB)"]
    (tmp_path / "linear_budget" / "linear_budget.json").write_text(json.dumps(dict(results=[{"ms": 1.0}])))
    assert _verdicts(tmp_path)[1] == "issue 4: no verdict (KeyError: 'backend')"


def test_issue4_verdict_is_the_fastest_rows(tmp_path):
    """Issue 4's FLOP verdict is the fastest row's (a slower row that met it does not count); its memory verdict is
    "not measured" where no row measured it, and lists every budget that met it."""
    from bench.gpu_verdicts import issue4_lines

    def lines(*rows):
        (tmp_path / "linear_budget").mkdir(exist_ok=True)
        (tmp_path / "linear_budget" / "linear_budget.json").write_text(json.dumps(dict(results=list(rows))))
        return issue4_lines(tmp_path)

    row = dict(backend="triton", budget_gib=1.0, knobs={}, variant=None, ms=40.0, tflops=645.0,
               peak_extra_beyond_fp32_dw_mib=None, issue4_memory_goal_met=None, issue4_flop_goal_met=False)
    assert lines(row, {**row, "budget_gib": 1.35, "ms": 45.0, "issue4_flop_goal_met": True}) == [
        "issue 4 (triton): fastest 40.00 ms (645 TFLOP/s, 1.0 GiB tiles, knobs default): FLOP goal not met; "
        "memory goal not measured (peak beyond the fp32 dW: 1.0 GiB ? MiB, 1.35 GiB ? MiB)"]
    met = dict(issue4_memory_goal_met=True, peak_extra_beyond_fp32_dw_mib=1000.0)
    assert "memory goal MET at 1.0 GiB, 1.2 GiB (peak" in lines({**row, **met, "budget_gib": 1.2}, {**row, **met})[0]
