"""Performance goal of the C++ CPU backend: policy_loss forward+backward vs the eager reference.

    python bench/bench_native.py                      # N=4096 (8 x 512), V=32000, fp32
    python bench/bench_native.py --dtype bf16 --repeat 7

Prints the median wall time of forward+backward per backend and the extra peak resident memory of
one ``backend="cpu"`` call beyond the logits and dlogits buffers (peak RSS, reset through
/proc/self/clear_refs, minus the RSS before the call and the size of the gradient).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fused_rl  # noqa: E402
from fused_rl import PolicyLossConfig  # noqa: E402
from bench.measure import fix_mmap_threshold  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_inputs(batch, length, vocab, dtype, seed=0, device="cpu"):
    """Random benchmark inputs, drawn on ``device`` (a GPU draws its GBs of logits in milliseconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    on = dict(generator=g, device=device)
    logits = (torch.randn(batch, length, vocab, **on) * 2).to(dtype)
    targets = torch.randint(0, vocab, (batch, length), **on)
    lengths = torch.randint(length // 2, length + 1, (batch,), **on)
    mask = torch.arange(length, device=device)[None] < lengths[:, None]
    adv = torch.randn(batch, **on)
    old = -torch.rand(batch, length, **on) * 10
    ref = old + 0.1 * torch.randn(batch, length, **on)
    return logits, targets, mask, adv, old, ref


def prepare(logits, inplace):
    """A leaf ``x`` whose gradient we read, and the tensor handed to the loss: ``x`` itself, or for
    ``inplace`` (which needs a buffer the caller gives up, as with real model logits) ``x.clone()``,
    whose backward passes the gradient buffer through without a copy."""
    x = logits.detach().requires_grad_(True)
    return x, (x.clone() if inplace else x)


def step(backend, prepared, targets, mask, adv, old, ref, config, inplace=False):
    x, y = prepared
    out = fused_rl.policy_loss(y, targets, adv, mask, old_logprobs=old, ref_logprobs=ref, config=config,
                               backend=backend, inplace=inplace, check_inputs=False)
    out.loss.backward()
    return x.grad


def timed(backend, data, config, repeat, inplace=False):
    """Median wall time of forward+backward (the input preparation is not timed)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        prepared = prepare(data[0], inplace)
        t0 = time.perf_counter()
        g = step(backend, prepared, *data[1:], config, inplace=inplace)
        times.append(time.perf_counter() - t0)
        del g, prepared
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ref-repeat", type=int, default=3)
    ap.add_argument("--with-torch", action="store_true", help="also time the chunked torch backend")
    ap.add_argument("--threads", type=int, default=0, help="torch / kernel threads (0: leave)")
    args = ap.parse_args()
    fix_mmap_threshold()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    config = PolicyLossConfig(kl="k3", beta=0.04, entropy_coef=0.01)
    data = make_inputs(args.batch, args.length, args.vocab, dtype)
    logits = data[0]
    size = logits.numel() * logits.element_size()
    from fused_rl import _C
    print(f"N={args.batch * args.length} ({args.batch}x{args.length}) V={args.vocab} {args.dtype}; "
          f"logits {size / 2**20:.0f} MiB; torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"isa {_C.cpu_isa()}, cpus {os.cpu_count()}")

    step("cpu", prepare(logits, False), *data[1:], config)  # warm up (first-call overheads)
    # --- extra peak memory of one call (logits already resident; the dlogits buffer = x.grad is allowed)
    def extra_peak(backend, inplace=False):
        prepared = prepare(logits, inplace)
        gc.collect()
        before = rss_kib("VmRSS")
        reset_peak()
        grad = step(backend, prepared, *data[1:], config, inplace=inplace)
        peak = rss_kib("VmHWM")
        # in place, the gradient is the caller's logits buffer (already counted in `before`)
        grad_bytes = 0 if inplace else grad.numel() * grad.element_size()
        extra = (peak - before) * 1024 - grad_bytes
        print(f"{backend}{' inplace' if inplace else ''}: peak RSS - RSS before = {(peak - before) / 1024:.1f} MiB, "
              f"dlogits {grad_bytes / 2**20:.0f} MiB -> extra {extra / 2**20:.2f} MiB = {100 * extra / size:.2f}% "
              "of logits")

    if reset_peak():
        extra_peak("cpu")
        extra_peak("cpu", inplace=True)
        extra_peak("reference")
    results = {}
    results["cpu"] = timed("cpu", data, config, args.repeat)
    results["cpu inplace"] = timed("cpu", data, config, args.repeat, inplace=True)
    if args.with_torch:
        results["torch"] = timed("torch", data, config, args.ref_repeat)
    results["reference"] = timed("reference", data, config, args.ref_repeat)
    for name, (med, times) in results.items():
        print(f"{name:12s} median {med * 1e3:8.1f} ms  runs {[round(t * 1e3) for t in times]}")
    print(f"speedup cpu vs reference: {results['reference'][0] / results['cpu'][0]:.2f}x")


if __name__ == "__main__":
    main()
