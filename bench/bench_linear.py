"""Fused linear policy loss vs the eager reference (and Liger-Kernel's chunked GRPO loss) on CPU.

    python bench/bench_linear.py                      # B=8 T=512 H=512 V=32000 fp32, the issue's goal
    python bench/bench_linear.py --B 2 --T 64 --repeats 3   # quick

* **memory**: each implementation runs once (forward + backward) in a fresh subprocess; the peak
  extra memory is ``ru_maxrss`` after the step minus the resident set size just before it (inputs
  allocated, torch warmed up on a tiny shape). Gradients of hidden / weight count for every
  implementation alike.
* **time**: median of ``--repeats`` forward + backward steps per implementation in one process,
  interleaved (A B C A B C ...) so that load from other processes hits every implementation alike,
  after one warm-up step each.

Implementations: ``reference`` (``fused_rl.reference.linear_policy_loss``: fp32 logits, log_softmax,
loss math, autograd), ``fused`` (``fused_rl.linear_policy_loss(backend="torch")``, the chunked torch
backend), ``tiled`` (``backend="cpu"``: MKL matmul tiles fed to the C++ single-pass kernel,
:mod:`fused_rl.backends.tiled_linear`; ``--chunk`` forces its tile size, and ``tiled:N`` runs it with
``N``-token tiles, so ``--impls tiled:512,tiled:1024,...`` is an interleaved sweep), ``liger``
(``LigerFusedLinearGRPOLoss(compiled=False, loss_type="bnpo", beta=0)``, the same token-mean ppo_clip
loss). Loss: default :class:`fused_rl.PolicyLossConfig` (ppo_clip 0.2, token-mean), off-policy;
``--rollout-is MODE`` adds a rollout correction (``rollout_is_max=3``, TRL's vLLM correction default bound;
``sequence_mask`` is TRL's default mode) against rollout log-probs 0.01 randn off the old ones (a sequence's
log-ratio then 0.23 randn at T = 512: most sequences kept; not with liger); ``--preset NAME`` uses
``PolicyLossConfig.preset(NAME)`` instead (e.g. ``gspo``: the two-pass route; not with liger). ``--op
token_logprobs`` times ``linear_token_logprobs`` instead (log-probs and entropies, upstream gradients of both
``randn``; not with liger).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fused_rl  # noqa: E402

IMPLS = ("reference", "fused", "tiled", "liger")
BACKENDS = {"fused": "torch", "tiled": "cpu"}


def make_inputs(B, T, H, V, pad, seed=0, rollout_is=None, preset=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * H ** -0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.full((B,), T)
    if pad:
        lengths = torch.randint(max(1, int(T * (1 - 2 * pad))), T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    advantages = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 5 - 8  # around log(1/V)
    inputs = dict(hidden=hidden, weight=weight, targets=targets, mask=mask, advantages=advantages, old=old,
                  config=fused_rl.PolicyLossConfig(), rollout=None)
    if preset:
        inputs.update(config=fused_rl.PolicyLossConfig.preset(preset))
    if rollout_is:
        inputs.update(config=fused_rl.PolicyLossConfig(rollout_is=rollout_is, rollout_is_max=3.0),
                      rollout=old + 0.01 * torch.randn(B, T, generator=g))
    inputs.update(g_logp=torch.randn(B, T, generator=g), g_ent=torch.randn(B, T, generator=g))  # --op token_logprobs
    return inputs


def make_step(impl, inp, compute_entropy, op="policy_loss"):
    hidden = inp["hidden"].clone().requires_grad_(True)
    weight = inp["weight"].clone().requires_grad_(True)
    if op == "token_logprobs":
        if impl == "liger":
            raise ValueError("--op token_logprobs is not run with liger")
        name, _, _ = impl.partition(":")
        fn = fused_rl.reference.linear_token_logprobs if name == "reference" else \
            (lambda *a, **k: fused_rl.linear_token_logprobs(*a, backend=BACKENDS[name], **k))

        def token_step():
            hidden.grad = weight.grad = None
            logp, ent = fn(hidden, weight, inp["targets"], return_entropy=True, check_inputs=False)
            loss = (logp * inp["g_logp"]).sum() + (ent * inp["g_ent"]).sum()
            loss.backward()
            return loss
        return token_step
    if impl == "liger":
        if inp["rollout"] is not None or inp["config"] != fused_rl.PolicyLossConfig():
            raise ValueError("--rollout-is / --preset are not run with liger")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        mod = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="bnpo",
                                       epsilon_low=0.2, epsilon_high=0.2)

        def step():
            hidden.grad = weight.grad = None
            out = mod(hidden, weight, inp["targets"], inp["mask"].long(), inp["advantages"],
                      old_per_token_logps=inp["old"])
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss
        return step

    name, _, chunk = impl.partition(":")
    fn = fused_rl.reference.linear_policy_loss if name == "reference" else \
        (lambda *a, **k: fused_rl.linear_policy_loss(*a, backend=BACKENDS[name], **k))
    from fused_rl.backends import tiled_linear

    def step():
        hidden.grad = weight.grad = None
        saved = tiled_linear.CHUNK_TOKENS
        if chunk:
            tiled_linear.CHUNK_TOKENS = int(chunk)
        try:
            out = fn(hidden, weight, inp["targets"], inp["advantages"], inp["mask"], old_logprobs=inp["old"],
                     rollout_logprobs=inp["rollout"], config=inp["config"], compute_entropy=compute_entropy,
                     check_inputs=False)
            out.loss.backward()
        finally:
            tiled_linear.CHUNK_TOKENS = saved
        return out.loss
    return step


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(args):
    """Child process: peak extra resident memory of one step of ``args.impl``."""
    torch.manual_seed(0)
    warm = make_inputs(2, 8, 16, 64, 0.0, rollout_is=args.rollout_is, preset=args.preset)
    make_step(args.impl, warm, args.entropy, args.op)()  # import / first-call costs out of the measurement
    inp = make_inputs(args.B, args.T, args.H, args.V, args.pad, rollout_is=args.rollout_is,
                          preset=args.preset)
    step = make_step(args.impl, inp, args.entropy, args.op)
    before = rss_bytes()
    # ru_maxrss is a high-water mark over the whole process: it must be below `before` here, or the
    # step's peak could hide under earlier history (reported as a failure below).
    history = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if peak <= history:
        raise RuntimeError(f"step peak not above the earlier high-water mark ({history} bytes)")
    print(json.dumps({"impl": args.impl, "before": before, "peak": peak, "extra": peak - before}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--V", type=int, default=32000)
    p.add_argument("--pad", type=float, default=0.0, help="mean fraction of right padding (0: none)")
    p.add_argument("--entropy", action="store_true", help="compute_entropy=True (liger: not comparable)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="fused: torch_linear.MEMORY_BUDGET_BYTES (default: the module default, 128 MiB)")
    p.add_argument("--chunk", type=int, default=None,
                   help="tiled: tiled_linear.CHUNK_TOKENS (default: from the budget)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--rollout-is", default=None, help="a rollout correction mode, e.g. sequence_mask")
    p.add_argument("--preset", default=None, help="a PolicyLossConfig preset, e.g. gspo")
    p.add_argument("--op", default="policy_loss", choices=("policy_loss", "token_logprobs"))
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--time-only", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.budget_mib:
        from fused_rl.backends import torch_linear

        torch_linear.MEMORY_BUDGET_BYTES = int(args.budget_mib * 2**20)
    if args.chunk:
        from fused_rl.backends import tiled_linear

        tiled_linear.CHUNK_TOKENS = args.chunk
    if args.child:
        args.impl = args.child
        return measure_memory(args)
    impls = [i for i in args.impls.split(",") if i]
    print(f"shape B={args.B} T={args.T} H={args.H} V={args.V} fp32 pad={args.pad} entropy={args.entropy} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} budget_mib={args.budget_mib} "
          f"chunk={args.chunk} rollout_is={args.rollout_is} preset={args.preset} op={args.op}")
    if not args.time_only:
        mem = {}
        for impl in impls:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--B", str(args.B), "--T", str(args.T),
                   "--H", str(args.H), "--V", str(args.V), "--pad", str(args.pad)]
            cmd += ["--entropy"] if args.entropy else []
            cmd += ["--budget-mib", str(args.budget_mib)] if args.budget_mib else []
            cmd += ["--chunk", str(args.chunk)] if args.chunk else []
            cmd += ["--rollout-is", args.rollout_is] if args.rollout_is else []
            cmd += ["--preset", args.preset] if args.preset else []
            cmd += ["--op", args.op]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if res.returncode != 0:
                print(f"memory {impl}: failed\n{res.stderr[-2000:]}")
                continue
            mem[impl] = json.loads(res.stdout.strip().splitlines()[-1])["extra"]
        for impl, extra in mem.items():
            ratio = f"  ({extra / mem['reference']:.3f}x the reference's memory)" if "reference" in mem else ""
            print(f"peak extra memory {impl:9s} {extra / 2**20:9.1f} MiB{ratio}")
    if not args.memory_only:
        inp = make_inputs(args.B, args.T, args.H, args.V, args.pad, rollout_is=args.rollout_is,
                          preset=args.preset)
        steps, times = {}, {}
        for impl in impls:
            try:
                steps[impl] = make_step(impl, inp, args.entropy, args.op)
                steps[impl]()  # warm-up
                times[impl] = []
            except Exception as exc:  # liger missing or failing on CPU
                print(f"time {impl}: failed: {type(exc).__name__}: {exc}")
        for _ in range(args.repeats):
            for impl in steps:
                if impl not in times:
                    continue
                t0 = time.perf_counter()
                steps[impl]()
                times[impl].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for impl, t in med.items():
            ratio = f"  ({t / med['reference']:.3f}x the reference's time)" if "reference" in med else ""
            print(f"fwd+bwd median {impl:9s} {t * 1e3:9.1f} ms  runs={[round(x * 1e3) for x in times[impl]]}{ratio}")


if __name__ == "__main__":
    main()
