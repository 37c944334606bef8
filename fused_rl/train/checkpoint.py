"""Checkpoints: model (+ value head), optimizer, scheduler, step and every RNG state, for exact resume.

Layout in ``RUN_DIR/checkpoint/``: ``state.pt`` (model, optimizer, scheduler, step, config, the number of processes;
written by rank 0) and ``rng_rank{R}.pt`` (torch / CUDA / Python / NumPy RNGs and the prompt sampler of rank R). A
resume needs the same number of processes (each samples ``prompts_per_step`` prompts from its own sampler).
Writes go to a temporary file first, then are renamed, so a crash never leaves half a file; each RNG file
records its step, so a crash between the files' renames (the state of step 20, the RNGs of step 10) is
refused at load instead of resuming inexactly.

A run that starts over in a run dir holding a checkpoint sets the earlier run's ``metrics.jsonl`` aside in
``checkpoint/`` (:func:`set_metrics_aside`) until its own first save replaces the checkpoint: a resume from the earlier
checkpoint before then gets the earlier run's metrics back, not the later run's.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoint"


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state(prompt_rng: random.Random) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "prompt_rng": prompt_rng.getstate(),
    }


def set_rng_state(state: dict, prompt_rng: random.Random) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    prompt_rng.setstate(state["prompt_rng"])


def save(run_dir, *, model, optimizer, scheduler, step: int, config: dict, prompt_rng: random.Random,
         rank: int = 0, world_size: int = 1, barrier=None) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_save({**rng_state(prompt_rng), "step": step}, d / f"rng_rank{rank}.pt")
    if rank == 0:
        _atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "scheduler": scheduler.state_dict(), "step": step, "config": config,
                      "world_size": world_size}, d / "state.pt")
        drop_metrics_aside(run_dir)  # an earlier run's metrics, set aside: its checkpoint is gone
        for stale in d.glob("rng_rank*.pt"):  # of an earlier run with more processes
            if int(stale.stem[len("rng_rank"):]) >= world_size:
                stale.unlink(missing_ok=True)
    if barrier is not None:
        barrier()
    return d


def _state_stamp(run_dir) -> str:
    """Which ``state.pt`` is there: every save renames a new file over it (a new inode and time)."""
    st = (checkpoint_dir(run_dir) / "state.pt").stat()
    return f"{st.st_ino} {st.st_mtime_ns} {st.st_size}"


def set_metrics_aside(run_dir, metrics: Path) -> None:
    """A run starting over in ``run_dir``: the checkpoint's own ``metrics`` file moves into ``checkpoint/``, stamped
    with the checkpoint it belongs to (if one is there already, a third run started over before the second saved:
    that one stays, ``metrics`` is the second run's)."""
    if exists(run_dir) and metrics.is_file() and metrics_aside(run_dir) is None:
        d = checkpoint_dir(run_dir)
        (d / "metrics.owner").write_text(_state_stamp(run_dir))
        os.replace(metrics, d / "metrics.jsonl")


def metrics_aside(run_dir) -> Optional[Path]:
    """The checkpoint's metrics set aside by a later run that started over and has not saved, or None (also when
    the set-aside file belongs to a checkpoint since replaced: a crash in a save's clean-up)."""
    d = checkpoint_dir(run_dir)
    path, owner = d / "metrics.jsonl", d / "metrics.owner"
    if path.is_file() and owner.is_file() and exists(run_dir) and owner.read_text() == _state_stamp(run_dir):
        return path
    return None


def drop_metrics_aside(run_dir) -> None:
    for name in ("metrics.jsonl", "metrics.owner"):
        (checkpoint_dir(run_dir) / name).unlink(missing_ok=True)


def exists(run_dir) -> bool:
    return (checkpoint_dir(run_dir) / "state.pt").is_file()


def load_state(run_dir, map_location="cpu") -> dict:
    path = checkpoint_dir(run_dir) / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=False)


class CheckpointMismatch(ValueError):
    """The checkpoint's model does not fit the model built from the current config."""


class WorldSizeMismatch(ValueError):
    """The checkpoint was written by another number of processes than the resuming run has."""


def same(saved, current) -> bool:
    """Equal config values (a list and a tuple of equal items too: YAML gives lists), or two names of one existing
    file or directory (a model path saved relative by an older run, resumed from the same working directory)."""
    if saved == current:
        return True
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        return list(saved) == list(current)
    return (isinstance(saved, str) and isinstance(current, str) and Path(saved).exists() and Path(current).exists()
            and Path(saved).resolve() == Path(current).resolve())


def load(run_dir, *, model, optimizer, scheduler, prompt_rng: random.Random, rank: int = 0, world_size: int = 1,
         map_location="cpu", fixed: Optional[dict] = None) -> tuple[int, dict]:
    """Restore everything saved by :func:`save`; returns the step to continue from and the checkpoint's config.
    Raises
    :class:`WorldSizeMismatch` (on every rank, before anything is restored) when the checkpoint was written by
    another number of processes, :class:`CheckpointMismatch` (a message and the checkpoint's config) when its model
    does not load into ``model`` or its config differs from ``fixed`` (``{field: value}`` the run must keep)."""
    state = load_state(run_dir, map_location)
    saved_world = state.get("world_size")  # None: written before it was recorded (the RNG files then tell)
    if saved_world is not None and saved_world != world_size:
        raise WorldSizeMismatch(f"the checkpoint in {checkpoint_dir(run_dir)} was written by {saved_world} "
                                f"process(es) and this run has {world_size}: each process samples prompts_per_step "
                                f"prompts from its own sampler state, so the run would go on with another global "
                                f"batch; resume with {saved_world} process(es) (torchrun --nproc_per_node "
                                f"{saved_world})")
    saved = state.get("config", {})
    changed = sorted(name for name, value in (fixed or {}).items() if not same(saved.get(name), value))
    if changed:
        raise CheckpointMismatch(f"its fields {sorted(fixed)} must not change: they rebuild the reference model "
                                 f"(beta > 0), the run's start point, which is not saved; changed: {changed}", saved)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointMismatch(str(exc).split("\n\t")[0], state.get("config", {})) from exc
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_path = checkpoint_dir(run_dir) / f"rng_rank{rank}.pt"
    rng: Optional[dict] = torch.load(rng_path, weights_only=False) if rng_path.is_file() else None
    if rng is None:
        raise FileNotFoundError(f"checkpoint lacks {rng_path.name}: was it written with a different world size?")
    if rng.get("step", state["step"]) != state["step"]:
        raise FileNotFoundError(f"checkpoint in {checkpoint_dir(run_dir)} is incomplete: state.pt is step "
                                f"{state['step']}, {rng_path.name} step {rng['step']} (a crash between their writes?)")
    set_rng_state(rng, prompt_rng)
    return int(state["step"]), saved
