"""The fused linear policy loss on a GPU against its own GEMM floor, by tile budget.

Usage: python bench/gpu_linear_budget.py OUTDIR [--n 8192] [--hidden 4096] [--vocab 128256]
       python bench/gpu_linear_budget.py OUTDIR --cpu-dry-run   (the script's logic on the CPU: triton in the
       interpreter and the cpu backend in place of cuda, N = 16, H = 32, V = 300, one timed call each)

For backends triton and cuda (the tiled route of ``fused_rl/backends/tiled_linear.py``, bf16 inputs in
its mixed GEMM mode) and tile budgets (``memory_budget_bytes``) of 1 GiB (the CUDA default), 1.2 GiB (the
largest whose peak ``linear_memory_model.py`` puts under issue 4's bound: 1422 MiB) and 1.35 GiB:
median forward+backward ms, TFLOP/s on the ``6 N H V`` FLOPs and the peak memory beyond the inputs and
the fp32 weight-gradient buffer; triton at 1 GiB also with other settings of the Triton single
pass's knobs (``SPLIT_CHUNK``: the split single pass, each fp32 row read once; ``GRAD_REVERSE`` +
``CACHE_HINTS``, ``PREFETCH``, ``MAX_PROGRAMS``, ``MAX_BLOCK_V``, ``NUM_WARPS``: tuned on bf16 logits, here the
kernel reads fp32 tiles the GEMM has just written; a row
"knobs" names the ones that differ from the defaults); both backends at 1 GiB also with TRL's vLLM correction at
its defaults (rows ``variant: vllm_is``: ``sequence_mask``, bound 3, folded into the advantages) and with gspo
(``variant: gspo``: on CUDA the two tiled passes, four GEMMs; the FLOP column stays on ``6 N H V``). Then the
same tiles' three GEMMs alone (``z = h W^T``, ``dh = dz W``, ``dW += dz^T h``, cuBLAS as the tiled route calls
them): the time the route cannot go below without a GEMM of its own. Writes OUTDIR/linear_budget.json and prints
one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--cpu-dry-run" in sys.argv:  # triton runs on the CPU only in its interpreter, chosen before triton's import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from anywhere

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fused_rl  # noqa: E402
from fused_rl import PolicyLossConfig  # noqa: E402
from fused_rl.backends import tiled_linear  # noqa: E402
from fused_rl.kernels import logits as K  # noqa: E402

#: Issue 4's speed goal: 85% of the ``6 N H V`` floor at the H200's measured 790 TFLOP/s (a row's
#: ``issue4_flop_goal_met``; 38.5 ms at the default shape); its memory goal: under 1.5 GB beyond the fp32
#: weight-gradient buffer (``issue4_memory_goal_met``).
ISSUE4_FLOP_GOAL_TFLOPS = 0.85 * 790


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dry = args.cpu_dry_run
    n, h, v = (16, 32, 300) if dry else (args.n, args.hidden, args.vocab)
    dev, native_backend = ("cpu", "cpu") if dry else ("cuda", "cuda")
    seq = min(n, 512)
    n = (n // seq) * seq  # whole sequences: the tokens the inputs hold (the FLOP count and the GEMM floor use n)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n // seq, seq, h, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(v, h, device=dev, generator=g) * h ** -0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (n // seq, seq), device=dev, generator=g)
    adv = torch.randn(n // seq, device=dev, generator=g)
    mask = torch.ones(n // seq, seq, dtype=torch.bool, device=dev)
    # old / ref near the policy's own log-probs (ratios ~1, ~20% clipped) and a k3 KL, as gpu_logits_bench.py:
    # with old = -3 (logp ~ -11.9 here) every A < 0 token was clipped and its dz row all zeros
    with torch.no_grad():
        lp = fused_rl.linear_token_logprobs(hidden, weight, targets, check_inputs=False)
    old = lp + 0.3 * torch.randn(lp.shape, device=dev, generator=g)
    ref = lp + 0.3 * torch.randn(lp.shape, device=dev, generator=g)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl="k3", beta=0.04)
    # TRL's vLLM correction at its defaults (sequence_mask, bound 3; TRL computes old log-probs with vLLM), tiled
    # since 2026-12-05 (before: torch_linear's chunked path); rollout log-probs 0.01 randn off the old ones (a
    # sequence's log-ratio 0.23 randn at 512 tokens: most sequences kept)
    rollout = old + 0.01 * torch.randn(lp.shape, device=dev, generator=g)
    # variant -> (config, rollout log-probs); gspo: a sequence-level config, two tiled passes on CUDA
    variants = {None: (cfg, None), "gspo": (PolicyLossConfig.preset("gspo", kl="k3", beta=0.04), None),
                "vllm_is": (PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl="k3", beta=0.04,
                                             rollout_is="sequence_mask", rollout_is_max=3.0), rollout)}
    flops = 6 * n * h * v
    results = []

    def record(row):
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(os.path.join(args.out, "linear_budget.json"), "w") as f:
            json.dump(dict(n=n, hidden=h, vocab=v, device="cpu (dry run)" if dry else torch.cuda.get_device_name(),
                           torch=torch.__version__, results=results), f, indent=2)

    def time_ms(fn) -> float:
        if not dry:
            return float(do_bench(fn, warmup=3, rep=300, return_mode="median"))
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    sync = (lambda: None) if dry else torch.cuda.synchronize
    empty_cache = (lambda: None) if dry else torch.cuda.empty_cache

    # the Triton single pass's knobs (module globals of fused_rl.kernels.logits), by name
    knob_attrs = dict(reverse="GRAD_REVERSE", hints="CACHE_HINTS", prefetch="PREFETCH", programs="MAX_PROGRAMS",
                      block="MAX_BLOCK_V", warps="NUM_WARPS", split="SPLIT_CHUNK", split_warps="SPLIT_WARPS")
    knob_defaults = {k: getattr(K, a) for k, a in knob_attrs.items()}
    r, h_, p = knob_defaults["reverse"], knob_defaults["hints"], knob_defaults["prefetch"]
    sms = 2 if dry else torch.cuda.get_device_properties(dev).multi_processor_count

    # (backend, budget, triton knobs that differ from the defaults, TRL's vLLM correction): the budgets, the vLLM
    # correction, then the knob sweep (the step's time limit may cut its end). The Triton single pass's knobs were
    # tuned on bf16 logits; here it reads fp32 rows (513 KB at V = 128256) that the GEMM has just written, 2-3
    # rows per SM in flight by default (135-200 MB, beyond the 50 MB L2: the second read of a row misses), so
    # also the other loop settings, grids capped at 1-2 programs per SM (with prefetch: the loads in flight of the
    # missing programs) and 32 KiB blocks
    runs = [(backend, gib, {} if backend == "triton" else None, None)
            for backend in ("triton", native_backend) for gib in (1.0, 1.2, 1.35)]
    runs += [(backend, 1.0, {} if backend == "triton" else None, variant)
             for variant in ("vllm_is", "gspo") for backend in ("triton", native_backend)]
    # the split single pass on the fp32 tiles: 128 columns a thread (SPLIT_WARPS' default; 168 registers) and 64
    split_runs = ((128, None),) if dry else ((16384, 4), (8192, 4))
    runs += [("triton", 1.0, knobs, None) for knobs in (
        *(dict(split=chunk, split_warps=warps) for chunk, warps in split_runs),
        dict(reverse=not r, hints=not h_), dict(prefetch=not p), dict(reverse=not r, hints=not h_, prefetch=not p),
        dict(programs=sms, prefetch=True), dict(programs=2 * sms, prefetch=True), dict(programs=2 * sms),
        dict(block=8192), dict(block=8192, warps=16, programs=sms))]
    for backend, budget_gib, knobs, variant in runs:
        config, rollout_logprobs = variants[variant]
        budget = int(budget_gib * 2**30)
        for k, value in {**knob_defaults, **(knobs or {})}.items():
            setattr(K, knob_attrs[k], value)
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)

        def step():
            x.grad = w.grad = None
            fused_rl.linear_policy_loss(x, w, targets, adv, mask, old_logprobs=old, ref_logprobs=ref,
                                        config=config, rollout_logprobs=rollout_logprobs, backend=backend,
                                        check_inputs=False, memory_budget_bytes=budget).loss.backward()

        try:
            step()
            sync()
            x.grad = w.grad = None
            empty_cache()
            peak = 0.0
            if not dry:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                sync()
                peak = torch.cuda.max_memory_allocated() - base - v * h * 4  # beyond the fp32 dW buffer
            ms = time_ms(step)
            record(dict(backend=backend, budget_gib=budget_gib, knobs=knobs, variant=variant, ms=ms,
                        tflops=flops / ms / 1e9,
                        # issue 4's bound: under 1.5 GB beyond the fp32 weight-gradient buffer
                        peak_extra_beyond_fp32_dw_mib=peak / 2**20,
                        issue4_memory_goal_met=bool(peak < 1.5e9) if not dry else None,
                        # for the config the issue names (no variant)
                        issue4_flop_goal_met=bool(flops / ms / 1e9 >= ISSUE4_FLOP_GOAL_TFLOPS)
                        if not dry and variant is None else None,
                        # for information: net of the returned bf16 x.grad and w.grad too
                        peak_extra_net_of_returned_grads_mib=(peak - (v + n) * h * 2) / 2**20 if not dry else 0.0,
                        tile_tokens=tiled_linear.chunk_tokens(n, v, torch.bfloat16, x.device, budget, mixed=True)))
        except Exception as exc:  # keep going
            record(dict(backend=backend, budget_gib=budget_gib, knobs=knobs, variant=variant,
                        error=f"{type(exc).__name__}: {exc}"))
        del x, w
        empty_cache()
    for k, value in knob_defaults.items():
        setattr(K, knob_attrs[k], value)

    # the GEMM floor of the same tiles
    for budget_gib in (1.0, 1.2, 1.35):
        rows = tiled_linear.chunk_tokens(n, v, torch.bfloat16, hidden.device, int(budget_gib * 2**30), mixed=True)
        hf, z = hidden.reshape(n, h), torch.empty(rows, v, device=dev)
        # dz with random mantissas and no zero rows, as the kernel writes it (uninitialized memory, often zeros,
        # runs the two backward GEMMs at a lower power draw: faster than the route can)
        dz = (torch.randn(rows, v, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        dh = torch.empty(n, h, device=dev)
        dw = torch.zeros(v, h, device=dev)

        def gemms():
            for s in range(0, n, rows):
                t = hf[s:s + rows]
                k = t.shape[0]
                # cuBLAS with fp32 output as the route calls it (upcast emulation on the CPU)
                tiled_linear._mm_f32(t, weight.t(), z[:k], accumulate=False)
                tiled_linear._mm_f32(dz[:k], weight, dh[s:s + k], accumulate=False)
                tiled_linear._mm_f32(dz[:k].t(), t, dw, accumulate=True)

        try:
            ms = time_ms(gemms)
            record(dict(backend="gemms only", budget_gib=budget_gib, ms=ms, tflops=flops / ms / 1e9, tile_tokens=rows))
        except Exception as exc:  # keep going
            record(dict(backend="gemms only", budget_gib=budget_gib, error=f"{type(exc).__name__}: {exc}"))
        del z, dz, dh, dw
        empty_cache()


if __name__ == "__main__":
    main()
