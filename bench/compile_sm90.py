"""Compile the Triton kernels ahead of time for sm_90 (H100/H200) without a GPU: catches code-generation
errors (non-constexpr globals, type mismatches) that the CPU interpreter does not see, and reports
registers / spills of the hot configuration.

Usage: TRITON_INTERPRET=0 python bench/compile_sm90.py [--all]
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fused_rl.config import KL_ESTIMATORS, PolicyLossConfig  # noqa: E402
from fused_rl.kernels import epilogue as E  # noqa: E402
from fused_rl.kernels import logits as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
F32 = "fp32"


#: Integer arguments that the runtime specializes as divisible by 16 for V = 151936 and its strides.
DIV16_INTS = ("xs0", "xs1", "os0", "os1", "s0", "s1", "V")


def compile_kernel(fn, types, consts, num_warps):
    """Compile as the launcher would for V = 151936: pointers 16-byte aligned, V and strides % 16 == 0."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and (sig[n].startswith("*") or n in DIV16_INTS)}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options=dict(num_warps=num_warps))


def vector_loads(kernel) -> str:
    """``vec16`` when the logits are read with 16-byte vector loads (``ld.global.v4``)."""
    return "vec16" if re.search(r"ld\.global(\.[\w:]+)*\.v4", kernel.asm["ptx"]) else "SCALAR-LOADS"


def sass_lines(kernel) -> list[str]:
    """The SASS of ``kernel`` (``nvdisasm`` of its cubin), one line per instruction or label; empty without the
    tool."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(tool) or "cubin" not in kernel.asm:
        return []
    path = "/tmp/fused_rl_sm90_sass.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([tool, "-c", path], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/|^\s*\.L_x_\d+:", line)]


def is_instruction(line: str) -> bool:
    return re.search(r"/\*[0-9a-f]{4}\*/", line) is not None


def sass_instructions(kernel) -> tuple[int, int]:
    """``(in all, in line)``: the number of SASS instructions of ``kernel`` (0 without ``nvdisasm``), and of those up
    to its last ``EXIT``, i.e. without the out-of-line routines after it (the 64-bit integer division that
    ``row // T`` calls only when an operand needs 64 bits, and the padding): what a program runs once."""
    lines = [line for line in sass_lines(kernel) if is_instruction(line)]
    exits = [i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line)]
    return len(lines), (exits[-1] + 1 if exits else len(lines))


def sass_loops(kernel) -> list[int]:
    """The instructions of each loop body of ``kernel`` that holds no other loop (from a label to the branch back to
    it), in code order: for the row kernel, its statistics and gradient loops over one block."""
    lines, labels, bodies = sass_lines(kernel), {}, []
    for i, line in enumerate(lines):
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
        back = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)
        if back and labels.get(back.group(1), i) < i:
            body = lines[labels[back.group(1)]:i + 1]
            if not any(re.match(r"\s*\.L_x_", b) for b in body[1:]) and sum(map(is_instruction, body)) > 1:
                bodies.append(sum(map(is_instruction, body)))
    return bodies


def resource_usage(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool) or "cubin" not in kernel.asm:
        return vector_loads(kernel)
    path = "/tmp/fused_rl_sm90.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    return vector_loads(kernel) + " " + " ".join(line.strip() for line in out.splitlines() if "REG:" in line)


#: The config of ``bench/gpu_logits_bench.py`` (off-policy, with the entropy): the instruction counts are its.
BENCH_CONFIG = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl="k3", beta=0.04)

#: ``(config, on_policy)`` of the policy kernels compiled: the hot configuration, then every option at
#: once, then OpenRLHF's KL options, then DPPO twice (``--all``: each policy loss with each KL estimator, and both rollout
#: corrections, too).
POLICY_VARIANTS = [
    (PolicyLossConfig(dual_clip=3.0, kl="k3", beta=0.1), False),
    (PolicyLossConfig(delta=1.5, dual_clip=3.0, kl="k3+", beta=0.1, kl_bias_correction=True,
                      rollout_is="token_mask", rollout_is_min=0.5, rollout_is_max=2.0, entropy_coef=0.01), False),
    # OpenRLHF's KL: the value clamp and unbiased_gradient's weight (exclusive with kl_bias_correction)
    (PolicyLossConfig(policy_loss="sapo", kl="k1+", beta=0.1, kl_clamp=10.0, kl_is_clip=10.0, entropy_coef=0.01),
     False),
    # DPPO's binary-KL trust region (a log per token) with the weight's truncation
    (PolicyLossConfig(policy_loss="dppo_kl", clip_low=0.2, clip_high=0.2, delta=20.0, kl="k3", beta=0.1,
                      entropy_coef=0.01), False),
    # DPPO's total-variation trust region without delta, a token rollout mask dropping into its weight
    (PolicyLossConfig(policy_loss="dppo_tv", rollout_is="token_mask", rollout_is_min=0.5), False),
]
POLICY_VARIANTS_FULL = POLICY_VARIANTS + [
    (PolicyLossConfig(policy_loss=policy, kl=kl, beta=0.1 if kl else 0.0, entropy_coef=0.01 * (i % 2),
                      **(dict(dual_clip=3.0) if policy == "ppo_clip" else {})), i % 3 == 0)
    for i, (policy, kl) in enumerate((p, k) for p in E.POLICY_CODES for k in KL_ESTIMATORS)
] + [(PolicyLossConfig(policy_loss="sapo", rollout_is="token_truncate", rollout_is_min=0.5), True)]


def split_ordering(kernel) -> str:
    """`` ordered`` when the split pass's PTX synchronizes as its docstring says: a ``bar.sync`` right before the
    ``acq_rel`` arrival atomic (every thread's statistics stored first), an ``acquire`` load of the count in the
    wait, and the statistics read through L2 (``ld.global.cg``) after it; else what is missing."""
    ptx = kernel.asm["ptx"]
    arrival = re.search(r"bar\.sync[^\n]*\n(?:(?!bar\.sync)[^\n]*\n){0,12}?[^\n]*atom\.global\.gpu\.acq_rel\.add", ptx)
    wait = re.search(r"ld\.global\.gpu\.acquire", ptx)
    after = wait and re.search(r"ld\.global\.cg", ptx[wait.end():])
    missing = [name for name, found in (("barrier+arrival", arrival), ("acquire wait", wait), ("L2 reads", after))
               if not found]
    return " ordered" if not missing else " UNORDERED: " + ", ".join(missing)


def target_load_ordering(kernel) -> str:
    """`` ordered`` when the row kernel's PTX has a ``bar.sync`` between the gradient loop's load of the target
    logit (:func:`kernels.logits._row_grad`) and the first block store: in place, a block store of another warp
    may overwrite that logit; else `` UNORDERED: target load``."""
    lines, first = inspect.getsourcelines(K._row_grad.fn)
    tag = f"logits.py:{first + next(i for i, line in enumerate(lines) if 'xt = tl.load(' in line)}:"
    ptx = kernel.asm["ptx"].splitlines()
    at = next(i for i, line in enumerate(ptx) if tag in line)
    load = next(i for i in range(at, len(ptx)) if "ld.global" in ptx[i])
    store = next(i for i in range(load, len(ptx)) if re.search(r"st\.global.*\.v\d", ptx[i]))
    return " ordered" if any("bar.sync" in line for line in ptx[load:store]) else " UNORDERED: target load"


def epilogue_signature(config, on_policy: bool) -> tuple[dict, dict]:
    """``(runtime float types, constexprs)`` of the epilogue arguments of ``config``."""
    args = E.epilogue_args(config, on_policy)
    return ({n: F32 for n, v in args.items() if isinstance(v, float)},
            {n: v for n, v in args.items() if not isinstance(v, float)})


def variant_name(config, on_policy: bool) -> str:
    args = E.epilogue_args(config, on_policy)
    return " ".join(f"{n}={int(v)}" for n, v in args.items() if not isinstance(v, float))


def main(full: bool) -> None:
    dtypes = ("bf16", "fp32", "fp16") if full else ("bf16",)
    for xdt in dtypes:
        base = dict(x_ptr="*" + xdt, xs0="i64", xs1="i32", tgt_ptr="*i64", temperature=F32)
        _, block, warps = K.block_config(151936, {"bf16": K.torch.bfloat16, "fp16": K.torch.float16,
                                                  "fp32": K.torch.float32}[xdt])
        k = compile_kernel(K._stats_kernel, {**base, "logp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32"},
                           dict(BLOCK_N=1, BLOCK_V=block, WITH_ENT=True), warps)
        print(xdt, "stats", resource_usage(k))
        k = compile_kernel(K._grad_kernel, {**base, "out_ptr": "*" + xdt, "os0": "i64", "lse_ptr": "*fp32",
                                            "glogp_ptr": "*fp32", "ent_ptr": "*fp32", "gent_ptr": "*fp32"},
                           dict(BLOCK_N=1, BLOCK_V=block, GRAD_ENT=True), warps)
        print(xdt, "grad", resource_usage(k))
        types = {**base, "adv_ptr": "*fp32", "w_ptr": "*fp32", "old_ptr": "*fp32", "ref_ptr": "*fp32",
                 "rollout_ptr": "*fp32", "out_ptr": "*" + xdt, "os0": "i64", "logp_ptr": "*fp32", "ent_ptr": "*fp32",
                 "loss_ptr": "*fp32", "ratio_ptr": "*fp32", "kl_ptr": "*fp32"}
        for config, on_policy in (POLICY_VARIANTS_FULL if full else POLICY_VARIANTS):
            floats, consts = epilogue_signature(config, on_policy)
            consts.update(WITH_ENT=True, WRITE_GRAD=True, BLOCK_N=1, BLOCK_V=block, REVERSE=K.GRAD_REVERSE,
                          HINTS=K.CACHE_HINTS, PREFETCH=K.PREFETCH)
            k = compile_kernel(K._policy_kernel, {**types, **floats}, consts, warps)
            print(xdt, f"policy {variant_name(config, on_policy)}", resource_usage(k))
        for knobs in (dict(REVERSE=True, HINTS=True, PREFETCH=False), dict(REVERSE=False, HINTS=False, PREFETCH=False),
                      dict(REVERSE=True, HINTS=True, PREFETCH=True), dict(REVERSE=False, HINTS=False, PREFETCH=True)):
            k = compile_kernel(K._policy_kernel, {**types, **floats}, {**consts, **knobs}, warps)
            hints = "evict_last" in k.asm["ptx"] and "evict_first" in k.asm["ptx"]
            tag = " ".join(f"{n}={int(v)}" for n, v in knobs.items())
            print(xdt, f"policy {tag}{' cache-hints' if hints else ''}{target_load_ordering(k)}", resource_usage(k))
        k = compile_kernel(K._policy_kernel, {**types, **floats}, {**consts, "BLOCK_N": 4, "BLOCK_V": 1024}, 8)
        print(xdt, "policy BLOCK_N=4 BLOCK_V=1024", resource_usage(k))
        # the benchmark's config: the row kernel's instructions per block of its two loops, and the split's per column
        bench_floats, bench_consts = epilogue_signature(BENCH_CONFIG, False)
        bench_consts.update(WITH_ENT=True, WRITE_GRAD=True, HINTS=K.CACHE_HINTS)
        k = compile_kernel(K._policy_kernel, {**types, **bench_floats},
                           {**bench_consts, "BLOCK_N": 1, "BLOCK_V": block, "REVERSE": K.GRAD_REVERSE,
                            "PREFETCH": K.PREFETCH}, warps)
        loops = sass_loops(k)
        columns = block / (32 * warps)  # a thread's columns of one block
        print(xdt, f"policy bench-config SASS loops:{'+'.join(map(str, loops))} a block "
                   f"({sum(loops) / columns:.1f} a column)", resource_usage(k))
        split = bench_consts
        split_types = {**types, **bench_floats, "sync_ptr": "*i32", "part_ptr": "*fp32"}
        for chunk, warps in K.SPLIT_CANDIDATES:  # the rows split over programs; PHASE 0, the GPU's
            k = compile_kernel(K._policy_split_kernel, split_types,
                               {**split, "CHUNK": chunk, "K_POW2": K.triton.next_power_of_2(-(-151936 // chunk)),
                                "PHASE": 0}, warps)
            # instructions a column: a program runs each in-line one once (no loop but the wait, whose body is
            # counted once), over chunk / (32 warps) columns; in all, the out-of-line routines too
            total, in_line = sass_instructions(k)
            columns = chunk / (32 * warps)
            print(xdt, f"policy split CHUNK={chunk} warps={warps}{split_ordering(k)} SASS/column:"
                       f"{in_line / columns:.1f} ({total / columns:.1f} in all)", resource_usage(k))
        # one row: the runtime passes an int argument equal to 1 as a constexpr (N = 1 failed to compile once)
        k = compile_kernel(K._policy_split_kernel, split_types, {**split, "N": 1, "CHUNK": 4096, "K_POW2": 64,
                                                                 "PHASE": 0}, 8)
        print(xdt, "policy split N=1", resource_usage(k))
        k = compile_kernel(K._scale_kernel, dict(x_ptr="*" + xdt, s0="i64", g_ptr="*fp32"),
                           dict(BLOCK_N=1, BLOCK_V=block), warps)
        print(xdt, "scale", resource_usage(k))
    # the tiled fused linear's two passes in mixed mode: statistics of fp32 logits tiles, bf16 dlogits of the gradient
    base = dict(x_ptr="*fp32", xs0="i64", xs1="i32", tgt_ptr="*i64", temperature=F32)
    _, block, warps = K.block_config(128256, K.torch.float32)
    k = compile_kernel(K._stats_kernel, {**base, "logp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32"},
                       dict(BLOCK_N=1, BLOCK_V=block, WITH_ENT=True), warps)
    print("fp32 stats (tiled two passes)", resource_usage(k))
    k = compile_kernel(K._grad_kernel, {**base, "out_ptr": "*bf16", "os0": "i64", "lse_ptr": "*fp32",
                                        "glogp_ptr": "*fp32", "ent_ptr": "*fp32", "gent_ptr": "*fp32"},
                       dict(BLOCK_N=1, BLOCK_V=block, GRAD_ENT=True), warps)
    print("fp32 -> bf16 grad (tiled two passes, mixed mode)", resource_usage(k))
    ptrs = {n: "*fp32" for n in E._epilogue_vector_kernel.arg_names if n.endswith("_ptr")}
    floats, consts = epilogue_signature(POLICY_VARIANTS[-1][0], False)
    k = compile_kernel(E._epilogue_vector_kernel, {**ptrs, "valid_ptr": "*i8", **floats}, {**consts, "BLOCK": 256}, 4)
    print("epilogue vector", resource_usage(k))
    print("sm_90 compile OK")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="bf16, fp32 and fp16 logits (default: bf16 only)")
    main(parser.parse_args().all)
