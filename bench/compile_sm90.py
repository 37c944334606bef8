"""Compile the Triton kernels ahead of time for sm_90 (H100/H200) without a GPU: catches code-generation
errors (non-constexpr globals, type mismatches) that the CPU interpreter does not see, and reports
registers / spills of the hot configuration.

Usage: TRITON_INTERPRET=0 python bench/compile_sm90.py [--all]
"""

from __future__ import annotations

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
    return "vec16" if re.search(r"ld\.global(\.\w+)*\.v4", kernel.asm["ptx"]) else "SCALAR-LOADS"


def resource_usage(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool) or "cubin" not in kernel.asm:
        return vector_loads(kernel)
    path = "/tmp/fused_rl_sm90.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    return vector_loads(kernel) + " " + " ".join(line.strip() for line in out.splitlines() if "REG:" in line)


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
                 "out_ptr": "*" + xdt, "os0": "i64", "logp_ptr": "*fp32", "ent_ptr": "*fp32", "loss_ptr": "*fp32",
                 "ratio_ptr": "*fp32", "kl_ptr": "*fp32", "clip_low": F32, "clip_high": F32, "dual_clip": F32,
                 "beta": F32, "entropy_coef": F32}
        variants = [(p, kl) for p in (0, 1, 2) for kl in range(6)] if full else [(0, 3)]
        for policy, kl in variants:
            consts = dict(POLICY=policy, HAS_DUAL=policy == 0, KL=kl, ADD_KL=kl != 0, ADD_ENT=kl % 2 == 0,
                          ON_POLICY=kl == 2, WITH_ENT=True, WRITE_GRAD=True, BLOCK_N=1, BLOCK_V=block)
            k = compile_kernel(K._policy_kernel, types, consts, warps)
            print(xdt, f"policy POLICY={policy} KL={kl}", resource_usage(k))
        k = compile_kernel(K._policy_kernel, types, {**consts, "BLOCK_N": 4, "BLOCK_V": 1024}, 8)
        print(xdt, "policy BLOCK_N=4 BLOCK_V=1024", resource_usage(k))
        k = compile_kernel(K._scale_kernel, dict(x_ptr="*" + xdt, s0="i64", g_ptr="*fp32"),
                           dict(BLOCK_N=1, BLOCK_V=block), warps)
        print(xdt, "scale", resource_usage(k))
    ptrs = {n: "*fp32" for n in E._epilogue_vector_kernel.arg_names if n.endswith("_ptr")}
    k = compile_kernel(E._epilogue_vector_kernel,
                       {**ptrs, "valid_ptr": "*i8", "clip_low": F32, "clip_high": F32, "dual_clip": F32, "beta": F32,
                        "entropy_coef": F32},
                       dict(POLICY=0, HAS_DUAL=True, KL=5, ADD_KL=True, ADD_ENT=True, ON_POLICY=False, BLOCK=256), 4)
    print("epilogue vector", resource_usage(k))
    print("sm_90 compile OK")


if __name__ == "__main__":
    main("--all" in sys.argv)
