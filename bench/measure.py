"""Timing and peak-memory measurement of one benchmark case.

* time: median of ``repeats`` runs after one warm-up, CUDA-synchronized on GPU;
* memory on CUDA: ``torch.cuda.max_memory_allocated`` during one run minus what was allocated
  before it (the inputs) and minus the gradients it leaves behind (outputs);
* memory on CPU: in a fresh subprocess (``python -m bench.measure SPEC``), after a warm-up on a tiny
  shape, the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``), one run is
  made, and the peak (``VmHWM``) minus the resident size before the run (``VmRSS``) minus the
  gradient bytes is reported. glibc is told to serve every block of 1 MiB or more with mmap and to
  return it on free (:func:`fix_mmap_threshold`), so the resident peak tracks the peak of live tensors
  (without it the dynamic threshold keeps freed blocks below 32 MiB in the heap, and the same case measured
  63-127 MiB in fresh processes).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .cases import Shape, make_callable, make_inputs


def fix_mmap_threshold() -> None:
    """Make glibc serve every block >= 1 MiB with mmap (and unmap it on free), so RSS follows the
    live tensors (otherwise the dynamic threshold keeps freed blocks < 32 MiB in the heap)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(op: str, impl: str, mode: str, shape: Shape, device: str, repeats: int = 5, info=None) -> float:
    inputs = make_inputs(op, shape, device)
    if info is not None:
        info["loss_tokens"] = int(inputs["mask"].sum())
    run = make_callable(op, impl, mode, inputs)
    run()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _grad_bytes(op: str, mode: str, inputs: dict) -> int:
    if mode != "fwd+bwd":
        return 0
    keys = ("hidden", "weight") if op == "linear_policy_loss" else ("logits",)
    return sum(inputs[k].numel() * inputs[k].element_size() for k in keys)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the resident high-water mark to the current resident size; return that size in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def peak_extra_memory_local(op: str, impl: str, mode: str, shape: Shape, device: str) -> int:
    """Measured in this process; on CPU only meaningful in a fresh process (see module doc)."""
    inputs = make_inputs(op, shape, device)
    run = make_callable(op, impl, mode, inputs)
    if device == "cuda":
        run()  # warm-up (allocator, autotuning)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base - _grad_bytes(op, mode, run.inputs)
    tiny = Shape(n=16, v=shape.v if op == "linear_policy_loss" else 64, h=shape.h, dtype=shape.dtype, batch=2)
    # load code paths, not memory; a compiled implementation warms up on the real shape (a new shape would
    # recompile inside the measured run)
    warm = inputs if impl.endswith("-compiled") else make_inputs(op, tiny, device)
    make_callable(op, impl, mode, warm)()
    base = _reset_peak_rss()
    run()
    # Linux updates a thread's resident-page counters in batches (of up to 64 pages): a result within ~0.5 MiB of
    # 0, either sign, is no extra memory
    return _peak_rss_bytes() - base - _grad_bytes(op, mode, run.inputs)


def peak_extra_memory(op: str, impl: str, mode: str, shape: Shape, device: str) -> int:
    """CPU: in a fresh subprocess; CUDA: in this process."""
    if device == "cuda":
        return peak_extra_memory_local(op, impl, mode, shape, device)
    spec = json.dumps(dict(op=op, impl=impl, mode=mode, device=device, shape=asdict(shape)))
    out = subprocess.run([sys.executable, "-m", "bench.measure", spec], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess failed for {spec}:\n{out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"])


def main() -> None:
    spec = json.loads(sys.argv[1])
    fix_mmap_threshold()
    torch.manual_seed(0)
    value = peak_extra_memory_local(spec["op"], spec["impl"], spec["mode"], Shape(**spec["shape"]), spec["device"])
    print(json.dumps({"peak_extra_bytes": value}))


if __name__ == "__main__":
    main()
