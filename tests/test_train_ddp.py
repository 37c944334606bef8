"""A 2-process gloo ``torchrun`` DDP update equals the single-process update on the same global batch.

The test process generates one global rollout batch and saves it; each of the two torchrun workers
(this file run as a script) takes its half (whole prompt groups), runs ``Trainer.update`` under DDP
and rank 0 saves the parameters, which must equal those of a single-process update on the full
batch. Covers the per-sequence aggregation (grpo, with gradient accumulation) and ``token-mean``
(dapo: the token normalizer is all-reduced) and PPO (value head, whitened GAE advantages).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "dapo", "ppo")


def _config(algorithm: str, run_dir: str, backend: str):
    from fused_rl.train.config import load_config

    return load_config(None, [], run_dir=run_dir, algorithm=algorithm, steps=3, warmup_steps=0, prompts_per_step=4,
                       group_size=4, max_new_tokens=4, micro_batch_size=4, threads=1, progress=False, plot=False,
                       eval_every=0, backend=backend, lr=1e-2,
                       model_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                     "num_attention_heads": 2})


def _params(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def _worker(out_dir: str, backend: str) -> None:
    from fused_rl.train.trainer import Trainer, close_distributed

    results = {}
    for algorithm in ALGORITHMS:
        trainer = Trainer(_config(algorithm, os.path.join(out_dir, f"ddp_{algorithm}"), backend), quiet=True)
        rank, world = trainer.rank, trainer.world
        assert world == 2
        batch = torch.load(os.path.join(out_dir, f"batch_{algorithm}.pt"), weights_only=False)
        n = batch.targets.shape[0]
        share = torch.arange(rank * n // world, (rank + 1) * n // world)
        metrics = trainer.update(batch.select(share))
        results[algorithm] = {"params": _params(trainer), "metrics": metrics}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "ddp_result.pt"))
    # the DDP wrapper's reducer holds the process group: freed at interpreter exit it ran the gloo group's destructor
    # with the GIL held while a gloo thread waited for the GIL to free the barrier's work (torch's known shutdown
    # deadlock: a hang after the results were written); free it first, then end the group
    del trainer
    close_distributed()


def test_ddp_step_equals_single_process(tmp_path):
    BACKEND = "auto"

    from fused_rl.train.trainer import Trainer

    single = {}
    for algorithm in ALGORITHMS:
        trainer = Trainer(_config(algorithm, str(tmp_path / f"single_{algorithm}"), BACKEND), quiet=True)
        torch.manual_seed(123)
        batch = trainer.collect()
        assert batch.rewards.std() > 0, "degenerate batch: all rewards equal"
        torch.save(batch, tmp_path / f"batch_{algorithm}.pt")
        before = _params(trainer)
        metrics = trainer.update(batch)
        single[algorithm] = {"params": _params(trainer), "metrics": metrics, "before": before}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}" + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), str(tmp_path), BACKEND]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ddp = torch.load(tmp_path / "ddp_result.pt", weights_only=False)
    for algorithm in ALGORITHMS:
        ref, got = single[algorithm], ddp[algorithm]
        moved = max((ref["params"][k] - ref["before"][k]).abs().max().item() for k in ref["params"])
        assert moved > 1e-4, f"{algorithm}: the update did not change the parameters"
        for key, value in ref["params"].items():
            torch.testing.assert_close(got["params"][key], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{algorithm} parameter {key}: {m}")
        # Adam's first step is nearly invariant to the gradient's scale: the (pre-clipping) gradient norm
        # is what catches a wrong loss normalisation across processes.
        for key in ("grad_norm", "loss", "reward", "accuracy", "length", "entropy", "clip_frac"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), (algorithm, key)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2])
