"""The single-pass epilogue against the two-pass composition, per loss variant (issue 10).

    python bench/bench_variants.py                              # cpu backend, N=4096 (8 x 512), V=32000, fp32
    python bench/bench_variants.py --backend triton --dtype bf16 --batch 16 --length 1024 --vocab 151936  # GPU

For each token-local variant (``PolicyLossConfig.has_token_epilogue``) prints the median wall time of
forward+backward of ``fused_rl.policy_loss`` on one backend three ways: the two-pass composition (stats
pass, the O(N) loss math of :mod:`fused_rl.loss_math`, gradient pass: what these variants ran before the
kernels' epilogue covered them; forced here by masking ``has_token_epilogue``), the single-pass kernel, and
the single-pass kernel with ``inplace=True`` (the gradient written over the logits); with
``--with-reference`` also the eager reference. Ratios are against the composition, measured in the same
run on the same inputs (peaked logits, ragged rows, off-policy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fused_rl  # noqa: E402
from bench.bench_native import DTYPES, make_inputs, prepare  # noqa: E402
from bench.measure import fix_mmap_threshold  # noqa: E402
from fused_rl import PolicyLossConfig  # noqa: E402

#: The variants the epilogue covers beyond the peers' ppo_clip / cispo (one workload each).
VARIANTS = {
    "dapo+k3 (baseline)": PolicyLossConfig.preset("dapo", beta=0.04),
    "sapo": PolicyLossConfig.preset("sapo"),
    "delta=1.5": PolicyLossConfig.preset("dapo", delta=1.5),
    "k3+ beta=0.04": PolicyLossConfig.preset("dapo", beta=0.04, kl="k3+"),
    "kl_bias_correction": PolicyLossConfig.preset("dapo", beta=0.04, kl_bias_correction=True),
    "openrlhf k2 unbiased": PolicyLossConfig.preset("dapo", beta=0.04, kl="k2+", kl_clamp=10.0, kl_is_clip=10.0),
    "dppo_kl (verl)": PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.2, clip_high=0.2, delta=20.0, kl="k3",
                                       beta=0.04),
    "rollout_is=token_truncate": PolicyLossConfig.preset("dapo", rollout_is="token_truncate", rollout_is_max=2.0),
    "rollout_is=token_mask": PolicyLossConfig.preset("dapo", rollout_is="token_mask", rollout_is_min=0.5,
                                                     rollout_is_max=2.0),
}


@contextlib.contextmanager
def two_pass():
    """Route every config to the backends' two-pass composition (``Backend.policy_loss``)."""
    saved = PolicyLossConfig.has_token_epilogue
    PolicyLossConfig.has_token_epilogue = property(lambda self: False)
    try:
        yield
    finally:
        PolicyLossConfig.has_token_epilogue = saved


def step(backend, prepared, data, config, inplace):
    logits, targets, mask, adv, old, ref, rollout = data
    x, y = prepared
    out = fused_rl.policy_loss(y, targets, adv, mask, old_logprobs=old, ref_logprobs=ref if config.kl else None,
                               rollout_logprobs=rollout if config.uses_rollout_logprobs else None, config=config,
                               backend=backend, inplace=inplace, check_inputs=False, compute_entropy=False)
    out.loss.backward()
    return x.grad


def timed(backend, data, config, repeat, inplace=False):
    """Median wall time of forward+backward (the input copy for ``inplace`` is not timed)."""
    sync = torch.cuda.synchronize if data[0].is_cuda else (lambda: None)
    step(backend, prepare(data[0], inplace), data, config, inplace)  # warm-up (compilation, first calls)
    times = []
    for _ in range(repeat):
        prepared = prepare(data[0], inplace)
        sync()
        t0 = time.perf_counter()
        step(backend, prepared, data, config, inplace)
        sync()
        times.append(time.perf_counter() - t0)
        del prepared
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--with-reference", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    args = ap.parse_args()
    fix_mmap_threshold()
    # triton runs on the CPU only in its interpreter (a dry run of this script; no meaningful times)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cuda" if args.backend == "cuda" or (args.backend == "triton" and not interpreted) else "cpu"
    logits, targets, mask, adv, old, ref = make_inputs(args.batch, args.length, args.vocab, DTYPES[args.dtype],
                                                       device=device)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator(device=device).manual_seed(1),
                                      device=device)
    data = (logits, targets, mask, adv, old, ref, rollout)
    print(f"backend {args.backend}, N={args.batch * args.length} ({args.batch}x{args.length}) V={args.vocab} "
          f"{args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, repeat {args.repeat} "
          "(median fwd+bwd)\n")
    cols = ["two-pass (s)", "single-pass (s)", "inplace (s)", "single / two-pass", "inplace / two-pass"]
    if args.with_reference:
        cols.insert(0, "reference (s)")
    print("| variant | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name in args.variants.split(","):
        config = VARIANTS[name]
        assert config.has_token_epilogue, name
        with two_pass():
            t_two = timed(args.backend, data, config, args.repeat)
        t_one = timed(args.backend, data, config, args.repeat)
        t_inp = timed(args.backend, data, config, args.repeat, inplace=True)
        row = [f"{t_two:.3f}", f"{t_one:.3f}", f"{t_inp:.3f}", f"{t_one / t_two:.2f}", f"{t_inp / t_two:.2f}"]
        if args.with_reference:
            row.insert(0, f"{timed('reference', data, config, max(1, args.repeat // 2)):.3f}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
