"""The fused linear policy loss on a GPU against its own GEMM floor, by tile budget.

Usage: python bench/gpu_linear_budget.py OUTDIR [--n 8192] [--hidden 4096] [--vocab 128256]

For backends triton and cuda (the tiled route of ``fused_rl/backends/tiled_linear.py``, bf16 inputs in
its mixed GEMM mode) and tile budgets of 1 GiB (``CUDA_DEFAULT_MEMORY_BUDGET_BYTES``) and 1.35 GiB:
median forward+backward ms, TFLOP/s on the ``6 N H V`` FLOPs and the peak memory beyond the inputs and
the fp32 weight-gradient buffer; triton at 1 GiB also with the other settings of the Triton single
pass's knobs (``GRAD_REVERSE`` + ``CACHE_HINTS``, ``PREFETCH``: tuned on bf16 logits, here the kernel
reads fp32 tiles the GEMM has just written). Then the same tiles' three GEMMs alone (``z = h W^T``, ``dh = dz W``,
``dW += dz^T h``, cuBLAS as the tiled route calls them): the time the route cannot go below without a
GEMM of its own. Writes OUTDIR/linear_budget.json and prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.backends import tiled_linear
from fused_rl.kernels import logits as K


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n, h, v, dev = args.n, args.hidden, args.vocab, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n // 512, 512, h, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(v, h, device=dev, generator=g) * h ** -0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (n // 512, 512), device=dev, generator=g)
    adv = torch.randn(n // 512, device=dev, generator=g)
    mask = torch.ones(n // 512, 512, dtype=torch.bool, device=dev)
    old = torch.randn(n // 512, 512, device=dev, generator=g) * 0.1 - 3.0
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    flops = 6 * n * h * v
    results = []

    def record(row):
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(os.path.join(args.out, "linear_budget.json"), "w") as f:
            json.dump(dict(n=n, hidden=h, vocab=v, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           results=results), f, indent=2)

    knob_defaults = (K.GRAD_REVERSE, K.CACHE_HINTS, K.PREFETCH)
    r, h_, p = knob_defaults

    def knob_names(knobs):
        return None if knobs is None else dict(zip(("reverse", "hints", "prefetch"), knobs))

    # (backend, budget, triton knobs): the Triton single pass's knobs were tuned on bf16 logits; here it
    # reads fp32 tiles the GEMM has just written, so the other settings are measured too
    runs = [("triton", 1.0, knob_defaults), ("triton", 1.35, knob_defaults), ("cuda", 1.0, None), ("cuda", 1.35, None)]
    runs += [("triton", 1.0, knobs) for knobs in ((not r, not h_, p), (r, h_, not p), (not r, not h_, not p))]
    for backend, budget_gib, knobs in runs:
        tiled_linear.CUDA_DEFAULT_MEMORY_BUDGET_BYTES = int(budget_gib * 2**30)
        if knobs is not None:
            K.GRAD_REVERSE, K.CACHE_HINTS, K.PREFETCH = knobs
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)

        def step():
            x.grad = w.grad = None
            fused_rl.linear_policy_loss(x, w, targets, adv, mask, old_logprobs=old, config=cfg, backend=backend,
                                        check_inputs=False).loss.backward()

        try:
            step()
            torch.cuda.synchronize()
            x.grad = w.grad = None
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base - v * h * 4  # beyond the fp32 dW buffer
            ms = float(do_bench(step, warmup=3, rep=300, return_mode="median"))
            record(dict(backend=backend, budget_gib=budget_gib, knobs=knob_names(knobs), ms=ms, tflops=flops / ms / 1e9,
                        peak_extra_beyond_fp32_dw_mib=peak / 2**20,
                        tile_tokens=tiled_linear.chunk_tokens(n, v, torch.bfloat16, x.device, mixed=True)))
        except Exception as exc:  # keep going
            record(dict(backend=backend, budget_gib=budget_gib, knobs=knob_names(knobs),
                        error=f"{type(exc).__name__}: {exc}"))
        del x, w
        torch.cuda.empty_cache()
    K.GRAD_REVERSE, K.CACHE_HINTS, K.PREFETCH = knob_defaults
    tiled_linear.CUDA_DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30

    # the GEMM floor of the same tiles
    for budget_gib in (1.0, 1.35):
        rows = tiled_linear.chunk_tokens(n, v, torch.bfloat16, hidden.device, int(budget_gib * 2**30), mixed=True)
        hf, z = hidden.reshape(n, h), torch.empty(rows, v, device=dev)
        dz, dh = torch.empty(rows, v, device=dev, dtype=torch.bfloat16), torch.empty(n, h, device=dev)
        dw = torch.zeros(v, h, device=dev)

        def gemms():
            for s in range(0, n, rows):
                t = hf[s:s + rows]
                k = t.shape[0]
                torch.mm(t, weight.t(), out_dtype=torch.float32, out=z[:k])
                torch.mm(dz[:k], weight, out_dtype=torch.float32, out=dh[s:s + k])
                torch.addmm(dw, dz[:k].t(), t, out_dtype=torch.float32, out=dw)

        try:
            ms = float(do_bench(gemms, warmup=3, rep=300, return_mode="median"))
            record(dict(backend="gemms only", budget_gib=budget_gib, ms=ms, tflops=flops / ms / 1e9, tile_tokens=rows))
        except Exception as exc:  # keep going
            record(dict(backend="gemms only", budget_gib=budget_gib, error=f"{type(exc).__name__}: {exc}"))
        del z, dz, dh, dw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
