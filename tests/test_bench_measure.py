"""``bench/measure.py`` on fake clocks and allocators: the time is the median of the timed runs after one untimed
warm-up, each run's GPU work waited for inside its timing; the peak memory beyond the inputs (and the gradients the
step leaves) is taken from a baseline after the warm-up; and the /proc readings it rests on."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from bench import measure
from bench.cases import Shape

MIB = 2**20


class _Device:
    """A fake clock and CUDA allocator: a run queues ``durations`` (the first: its warm-up) and, while it runs,
    ``extra`` bytes beyond the inputs (more on its first call) plus its gradients, freed when it returns."""

    def __init__(self, durations, grad_bytes=0, extra=700, first_extra=10_000):
        self.durations, self.grad_bytes, self.extra, self.first_extra = list(durations), grad_bytes, extra, first_extra
        self.now = self.queued = 0.0
        self.calls = 0
        self.allocated = self.peak = 1000  # the inputs

    def run(self):
        self.queued += self.durations[self.calls]
        extra = self.first_extra if self.calls == 0 else self.extra
        self.peak = max(self.peak, self.allocated + extra + self.grad_bytes)
        self.calls += 1

    def synchronize(self):
        self.now += self.queued
        self.queued = 0.0

    def reset_peak(self):
        self.peak = self.allocated

    def patch(self, monkeypatch, inputs):
        monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        monkeypatch.setattr(measure, "make_inputs", lambda op, shape, device: inputs)

        def make_callable(op, impl, mode, x):
            run = self.run
            fn = lambda: run()  # noqa: E731
            fn.inputs = x
            return fn
        monkeypatch.setattr(measure, "make_callable", make_callable)
        for name, fn in (("synchronize", self.synchronize), ("empty_cache", lambda: None),
                         ("reset_peak_memory_stats", self.reset_peak), ("memory_allocated", lambda: self.allocated),
                         ("max_memory_allocated", lambda: self.peak)):
            monkeypatch.setattr(torch.cuda, name, fn)


def test_time_is_the_median_after_an_untimed_warm_up(monkeypatch):
    """Warm-up 100 s, then 5, 1, 2 s: the median 2 s (not the mean, the minimum, or a median with the warm-up); the
    GPU's queued work counts in the run that queued it; the loss tokens are the mask's."""
    dev = _Device([100.0, 5.0, 1.0, 2.0])
    dev.patch(monkeypatch, {"mask": torch.tensor([[True, True, False], [True, False, False]])})
    info = {}
    assert measure.time_case("policy_loss", "x", "fwd", Shape(n=6, v=4, batch=2), "cuda", 3, info=info) == 2.0
    assert dev.calls == 4 and info == {"loss_tokens": 3}


@pytest.mark.parametrize("op, mode, leaves, grad", [
    ("policy_loss", "fwd+bwd", dict(logits=(2, 4, 8)), 2 * 4 * 8 * 2),
    ("linear_policy_loss", "fwd+bwd", dict(hidden=(2, 4, 8), weight=(16, 8)), (2 * 4 * 8 + 16 * 8) * 2),
    ("policy_loss", "fwd", dict(logits=(2, 4, 8)), 0)])
def test_cuda_peak_is_beyond_inputs_and_gradients_after_the_warm_up(monkeypatch, op, mode, leaves, grad):
    """CUDA: the peak of one run after a warm-up (its autotuning's 10000 bytes not counted), minus the 1000 bytes
    allocated before it and the bf16 gradients of the leaves (fwd+bwd): 700 bytes."""
    inputs = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in leaves.items()}
    dev = _Device([0.0, 0.0], grad_bytes=grad)
    dev.patch(monkeypatch, inputs)
    assert measure.peak_extra_memory_local(op, "x", mode, Shape(n=8, v=8), "cuda") == 700
    assert dev.calls == 2


def test_cpu_peak_is_beyond_the_rss_after_a_tiny_warm_up(monkeypatch):
    """CPU: a warm-up on a tiny shape (its first-call costs, 10000 bytes here, out of the measure), the resident
    high-water mark reset to the resident size, one run, minus its fp32 gradient."""
    state = dict(rss=1000, hwm=50_000, first=True)
    shapes = []

    def make_inputs(op, shape, device):
        shapes.append((shape.n, shape.v))
        return {"logits": torch.zeros(shape.n, shape.v)}

    def make_callable(op, impl, mode, x):
        def run():
            grad = x["logits"].numel() * 4
            state["hwm"] = max(state["hwm"], state["rss"] + (10_000 if state["first"] else 700) + grad)
            state["first"] = False
        run.inputs = x
        return run

    def reset():
        state["hwm"] = state["rss"]
        return state["rss"]

    monkeypatch.setattr(measure, "make_inputs", make_inputs)
    monkeypatch.setattr(measure, "make_callable", make_callable)
    monkeypatch.setattr(measure, "_reset_peak_rss", reset)
    monkeypatch.setattr(measure, "_peak_rss_bytes", lambda: state["hwm"])
    assert measure.peak_extra_memory_local("policy_loss", "x", "fwd+bwd", Shape(n=32, v=100), "cpu") == 700
    assert shapes == [(32, 100), (16, 64)]


def _status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_proc_readings_reset_and_read_the_high_water_mark():
    """``_peak_rss_bytes`` is the high-water mark (a freed 64 MiB still in it); ``_reset_peak_rss`` brings it down
    to the resident size and returns that size in bytes."""
    x = torch.ones(16 * MIB)  # 64 MiB touched, then unmapped on free
    del x
    rss = _status_bytes("VmRSS")
    assert measure._peak_rss_bytes() >= rss + 60 * MIB
    base = measure._reset_peak_rss()
    assert abs(base - rss) < MIB and rss > 100 * MIB  # (VmRSS kB * 1000 would be 2.3% off)
    assert measure._peak_rss_bytes() - base < 8 * MIB


def test_subprocess_entry_measures_the_spec(monkeypatch, capsys):
    """``python -m bench.measure SPEC``: glibc's mmap threshold fixed before the measure, the spec's case measured,
    its figure printed as JSON."""
    calls = []
    monkeypatch.setattr(measure, "fix_mmap_threshold", lambda: calls.append("fix"))
    monkeypatch.setattr(measure, "peak_extra_memory_local", lambda *a: (calls.append(a), 1234)[1])
    shape = Shape(n=32, v=100, h=8, dtype="bf16", batch=4, ragged=False)
    spec = dict(op="policy_loss", impl="cpu", mode="fwd", device="cpu", shape=shape.__dict__)
    monkeypatch.setattr(sys, "argv", ["bench.measure", json.dumps(spec)])
    measure.main()
    assert calls == ["fix", ("policy_loss", "cpu", "fwd", shape, "cpu")]
    assert json.loads(capsys.readouterr().out) == {"peak_extra_bytes": 1234}


_MMAPPED = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
fix_mmap_threshold()
big = libc.malloc(1 << 25)  # freed: the dynamic threshold would rise to 32 MiB
libc.free(ctypes.c_void_p(big))
def mmapped(size):
    before = libc.mallinfo2().hblks
    libc.malloc(size)
    return libc.mallinfo2().hblks - before
print(mmapped(3 << 19), mmapped(3 << 18))  # 1.5 MiB, 0.75 MiB
"""


def test_mmap_threshold_is_one_mib():
    """After ``fix_mmap_threshold`` a 1.5 MiB block is mmapped (returned to the system on free), even after a freed
    32 MiB block that would have raised glibc's dynamic threshold, and a 0.75 MiB one is not. The function's own
    source runs in a bare interpreter (no torch import: a fraction of a second)."""
    import ctypes
    import inspect
    import textwrap

    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    code = textwrap.dedent(inspect.getsource(measure.fix_mmap_threshold)) + _MMAPPED
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["1", "0"]
