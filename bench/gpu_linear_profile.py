"""Where the fused linear loss's time goes: ``torch.profiler`` over forward + backward steps of
``linear_policy_loss`` per backend (the inputs and DAPO + k3 config of ``bench/cases.py``, as
``bench.report --set gpu`` times them), the device time of every kernel grouped by kind.

Usage: python bench/gpu_linear_profile.py OUTDIR [--n 8192] [--hidden 4096] [--vocab 128256]
       python bench/gpu_linear_profile.py OUTDIR --device cpu   (the script's logic, small shapes, CPU ops)

On an H200 the tiled route (triton: 41-44 ms at the default shape) sits 6-7 ms above its three GEMMs
alone (``bench/gpu_linear_budget.py``); this says which kernels take that time. Kinds, from the
kernel's name: ``gemm`` (cuBLAS / CUTLASS), ``logits kernel`` (the fused single pass: Triton's
``_policy_kernel``, the CUDA ``policy`` kernel), ``copy / cast`` and ``elementwise / index`` (torch's
own kernels) and ``other``. ``idle`` is the step's wall time minus the kernels' busy time (launch gaps,
host work). Writes OUTDIR/linear_profile.md and OUTDIR/linear_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fused_rl  # noqa: E402
from bench import cases  # noqa: E402

#: ``(kind, pattern of the kernel / op name)``, first match wins.
KINDS = (
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|sm90_|aten::(mm|addmm|bmm|matmul)\b", re.I)),
    ("logits kernel", re.compile(r"_policy_kernel|policy_fused|policy_kernel|fused_rl::", re.I)),
    ("copy / cast", re.compile(r"copy|cast|aten::(to|_to_copy|copy_)\b", re.I)),
    ("elementwise / index", re.compile(r"elementwise|vectorized|index|scatter|gather|reduce|where|fill|aten::", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def device_events(prof, device: str):
    """``(name, µs)`` of every kernel (CUDA) or every top-level op's self time (CPU dry run)."""
    events = prof.events()
    if device == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in events if e.device_type == torch.autograd.DeviceType.CPU]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backends", default=None, help="comma-separated (default: triton,cuda on CUDA, cpu on CPU)")
    args = ap.parse_args()
    dev = args.device
    small = dev == "cpu"
    shape = cases.Shape(n=args.n or (256 if small else 8192), v=args.vocab or (1000 if small else 128256),
                        h=args.hidden or (64 if small else 4096), dtype="fp32" if small else "bf16",
                        ragged=small)  # every token a loss token on the GPU, as gpu_linear_budget.py
    n, h, v, dtype = shape.n, shape.h, shape.v, cases.DTYPES[shape.dtype]
    backends = (args.backends or ("cpu" if small else "triton,cuda")).split(",")
    os.makedirs(args.out, exist_ok=True)
    inputs = cases.make_inputs("linear_policy_loss", shape, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    report, lines = {}, [f"# fused linear profile: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, "
                         f"torch {torch.__version__}", f"N={n} H={h} V={v} {dtype}, {args.steps} steps of "
                         f"forward + backward per backend, device time per step", ""]

    def write():  # after every backend: a step cut off by its cap keeps the backends it finished
        with open(os.path.join(args.out, "linear_profile.json"), "w") as f:
            json.dump(dict(n=n, hidden=h, vocab=v, dtype=str(dtype), torch=torch.__version__, results=report), f,
                      indent=2)
        with open(os.path.join(args.out, "linear_profile.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    for backend in backends:
        x = inputs["hidden"].clone().requires_grad_(True)
        w = inputs["weight"].clone().requires_grad_(True)

        def step():
            x.grad = w.grad = None
            fused_rl.linear_policy_loss(x, w, inputs["targets"], inputs["advantages"], inputs["mask"],
                                        old_logprobs=inputs["old"], ref_logprobs=inputs["ref"], config=cases.CONFIG,
                                        backend=backend, check_inputs=False).loss.backward()

        try:
            step()  # warm-up / compile
            sync()
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                wall_us = (time.perf_counter() - t0) * 1e6 / args.steps
        except Exception as exc:  # keep going: one failing backend must not lose the other
            report[backend] = dict(error=f"{type(exc).__name__}: {exc}")
            lines += [f"## {backend}: FAILED {type(exc).__name__}: {exc}", ""]
            write()
            continue
        by_kind, by_name = collections.Counter(), collections.Counter()
        for name, us in device_events(prof, dev):
            by_kind[kind_of(name)] += us / args.steps
            by_name[name] += us / args.steps
        busy = sum(by_kind.values())
        if dev == "cuda":
            by_kind["idle"] = max(0.0, wall_us - busy)
        report[backend] = dict(wall_ms=wall_us / 1e3, kinds_ms={k: us / 1e3 for k, us in by_kind.items()},
                               top_ms={k: us / 1e3 for k, us in by_name.most_common(12)})
        lines += [f"## {backend}: {wall_us / 1e3:.2f} ms per step (wall)", "", "| kind | ms per step |", "|---|---:|"]
        lines += [f"| {k} | {us / 1e3:.3f} |" for k, us in by_kind.most_common()]
        lines += ["", "| kernel | ms per step |", "|---|---:|"]
        lines += [f"| `{name[:110]}` | {us / 1e3:.3f} |" for name, us in by_name.most_common(12)]
        lines.append("")
        print(f"{backend}: {json.dumps(report[backend]['kinds_ms'])}", flush=True)
        write()
        del x, w
        if dev == "cuda":
            torch.cuda.empty_cache()
    write()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
