"""The CUDA kernels of ``csrc/logits_cuda.cu``, run on the CPU in an emulation of CUDA, against the
reference.

Where no GPU is present the ``cuda`` backend's tests skip; these run its kernel code anyway. The
module built here is fused_rl's own ``csrc/bindings.cpp`` with its CUDA part, the kernels compiled by
g++ over ``tests/cuda_sim/include`` (``cuda_sim.h``: every thread of a block a fiber, barriers and warp
shuffles scheduled so that a missing or divergent barrier fails the launch; see its header comment).
The ``cuda_kernels`` fixture swaps that module in for ``fused_rl._C`` with its ``cpu_*`` entry points
calling the emulated ``cuda_*`` ones, so the whole Python path of the native backends (custom ops,
autograd, in place, the two-pass composition, fused linear) runs the CUDA kernels on CPU tensors,
bindings included. The emulated device has 4 multiprocessors, so the 8-block grid strides over rows.
What the emulation cannot show (speed, coalescing, registers) needs ``bash bench/gpu_check.sh``.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

import fused_rl
from fused_rl.backends import native
import test_hardening as hardening
import test_native as native_tests
import test_variants as variants
from helpers import CONFIGS, LOGIT_KINDS, check_token_logprobs_inplace, compare_policy_loss, make_case, make_logits
from test_linear import compare_linear, make_linear_case

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
SIM = Path(__file__).resolve().parent / "cuda_sim"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
cfg_id = lambda c: f"{c.policy_loss}-{c.kl}-{c.agg}-t{c.temperature}"  # noqa: E731
#: CUDA sources as C++ over the emulation headers; a misaligned vector load traps, as it faults on a GPU
CU_FLAGS = ["-x", "c++", "-I", str(SIM / "include"), "-Wno-unknown-pragmas", "-fno-strict-aliasing",
            "-fsanitize=alignment", "-fsanitize-undefined-trap-on-error"]
#: ``FUSED_RL_SIM_ASAN=1``: the CUDA sources also under AddressSanitizer (reads and writes outside the
#: tensors' allocations); run with libasan and libstdc++ preloaded, as ``.ci/run`` does (docs/native.md)
ASAN = os.environ.get("FUSED_RL_SIM_ASAN") == "1"
if ASAN:
    CU_FLAGS += ["-fsanitize=address", "-fno-omit-frame-pointer"]
#: nvcc contracts ``a * b + c`` into an FMA by default (``-fmad=true``); so does g++ here where the CPU has FMA,
#: so that a formula whose result hangs on it (``x * scale - max y``: the max's own term off 2^0) shows as on a GPU
FMA = platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").exists() \
    and "fma" in Path("/proc/cpuinfo").read_text().split()
if FMA:
    CU_FLAGS += ["-mfma", "-ffp-contract=fast"]


def _build_plan(out: Path) -> dict[Path, list[tuple[list[str], Path]]]:
    """``{shared library: [(compile command, object)]}``: the ``_C_cudasim`` module (``csrc/`` with its CUDA
    part, in a namespace of its own so that its pybind11 classes do not clash with ``fused_rl._C``'s) and the
    emulation's self-test kernels."""
    import pybind11

    common = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-Wno-psabi", "-I", str(CSRC),
              "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"],
              "-Dfused_rl=fused_rl_sim", "-DFRL_WITH_CUDA=1", "-DFRL_MODULE=_C_cudasim"]
    sources = [(CSRC / "bindings.cpp", []), (CSRC / "logits_cpu.cpp", [])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        common += ["-march=x86-64-v2", "-DFRL_HAVE_AVX2_TU=1"]
        sources.append((CSRC / "logits_cpu_avx2.cpp", []))
    sources.append((CSRC / "logits_cuda.cu", CU_FLAGS))
    job = lambda src, flags: ([*flags, "-c", str(src), "-o", str(out / f"{src.name}.o")], out / f"{src.name}.o")
    module = out / ("_C_cudasim" + sysconfig.get_config_var("EXT_SUFFIX"))
    return {module: [job(src, ["g++", *common, *extra]) for src, extra in sources],
            out / "selftest.so": [job(SIM / "selftest.cu", ["g++", "-std=c++17", "-O2", "-fPIC", *CU_FLAGS])]}


def _source_key() -> str:
    h = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.h"), *CSRC.glob("*.cpp"), *CSRC.glob("*.cu"), *SIM.rglob("*.h"),
                        *SIM.glob("*.cu")]):
        h.update(path.name.encode() + path.read_bytes())
    h.update(Path(__file__).read_bytes() + bytes([ASAN, FMA]))
    return h.hexdigest()[:16]


def build(cache: Path) -> dict[str, Path]:
    """Compile (once per state of the sources; xdist workers share the result under a lock) the shared
    libraries of :func:`_build_plan`; ``{"module": ..., "selftest": ...}``."""
    if shutil.which("g++") is None or importlib.util.find_spec("pybind11") is None:
        if os.environ.get("FUSED_RL_REQUIRE_NATIVE") == "1":
            raise RuntimeError("the CUDA emulation needs g++ and pybind11 (pip install -e '.[test]')")
        pytest.skip("the CUDA emulation needs g++ and pybind11")
    out = cache / _source_key()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        plan = _build_plan(out)
        if not all(lib.exists() for lib in plan):
            out.mkdir(parents=True, exist_ok=True)
            jobs = [job for lib_jobs in plan.values() for job in lib_jobs]
            procs = [(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), cmd)
                     for cmd, _ in jobs]
            for proc, cmd in procs:
                log = proc.communicate()[0]
                if proc.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{log}")
            for lib, lib_jobs in plan.items():
                tmp = lib.with_suffix(".tmp")
                subprocess.run(["g++", "-shared", "-fopenmp", *(["-fsanitize=address"] if ASAN else []),
                                *[str(o) for _, o in lib_jobs], "-o", str(tmp)],
                               check=True, capture_output=True, text=True)
                tmp.rename(lib)
    module, selftest = plan
    return {"module": module, "selftest": selftest}


class CudaKernelsAsCpu:
    """Stands in for ``fused_rl._C`` in :mod:`fused_rl.backends.native`: the ``cpu_*`` kernel entry points
    run the emulated CUDA kernels (same arguments, the thread count replaced by a null stream)."""

    def __init__(self, sim):
        self._sim = sim
        self.calls = collections.Counter()

    def __getattr__(self, name):
        return getattr(self._sim, name)

    def _run(self, kernel, args):
        self.calls[kernel] += 1
        getattr(self._sim, kernel)(*args[:-1], 0)

    def cpu_token_stats(self, *args):
        self._run("cuda_token_stats", args)

    def cpu_token_grad(self, *args):
        self._run("cuda_token_grad", args)

    def cpu_policy_fused(self, *args):
        self._run("cuda_policy_fused", args)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    # the parent of the per-worker base temp is shared by pytest-xdist's workers
    return build(tmp_path_factory.getbasetemp().parent / "cuda_sim_build")


@pytest.fixture(scope="session")
def sim(built):
    spec = importlib.util.spec_from_file_location("_C_cudasim", built["module"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The CUDA kernels' launch knobs (``cuda_set_<knob>`` / ``cuda_<knob>``), restored after each test.
KNOBS = ("threads", "rows_per_sm", "unroll", "reverse", "streaming")


@pytest.fixture
def cuda_kernels(sim, monkeypatch):
    """Route the ``cpu`` backend's kernel calls to the emulated CUDA kernels for one test (its launch knobs
    set back to the defaults afterwards)."""
    native.epilogue_params.cache_clear()  # its params objects are the module's own class
    kernels = CudaKernelsAsCpu(sim)
    defaults = {k: getattr(sim, f"cuda_{k}")() for k in KNOBS}
    monkeypatch.setattr(native, "_C", kernels)
    yield kernels
    for k, v in defaults.items():
        getattr(sim, f"cuda_set_{k}")(v)
    native.epilogue_params.cache_clear()


# ------------------------------------------------------------------------------ the emulation itself
SELFTEST = {"block_sum": 0, "block_sum_missing_barrier": 1, "warp_sum": 2, "divergent_barrier": 3,
            "divergent_shuffle": 4, "block_sum_half_written": 5, "block_sum_two_arrays": 6}


@pytest.fixture(scope="session")
def selftest(built):
    lib = ctypes.CDLL(str(built["selftest"]))
    lib.cuda_sim_selftest.restype = ctypes.c_char_p
    lib.cuda_sim_selftest.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

    def run(kernel: str, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        blocks = x.numel() // 64
        out = torch.full((x.numel(),), -1.0)
        err = lib.cuda_sim_selftest(SELFTEST[kernel], blocks, x.data_ptr(), out.data_ptr()).decode()
        return out, err

    return run


def test_the_emulation_runs_barriers_and_shuffles(selftest):
    x = torch.randn(3 * 64, generator=torch.Generator().manual_seed(0))
    out, err = selftest("block_sum", x)
    assert err == ""
    torch.testing.assert_close(out[:3], x.view(3, 64).sum(1))
    out, err = selftest("warp_sum", x)
    assert err == ""
    torch.testing.assert_close(out, x.view(-1, 32).sum(1).repeat_interleave(32))


def test_the_emulation_catches_a_missing_barrier(selftest):
    """Thread 0 sums shared memory that other threads have not all written yet: the threads run in a new
    order at each launch, so some launch reads a stale entry."""
    wrong = 0
    for seed in range(5):
        x = torch.randn(64, generator=torch.Generator().manual_seed(seed))
        out, err = selftest("block_sum_missing_barrier", x)
        assert err == ""
        wrong += not torch.allclose(out[0], x.sum())
    assert wrong > 0


def test_the_emulation_poisons_shared_memory_per_block(selftest):
    """Block 0 writes all its 64 shared entries, blocks 1 and 2 only their first warp's: the 32 entries those never
    write hold NaN bytes at each block's start, as garbage on a GPU, not block 0's values (a buffer poisoned only
    when first used would give a finite sum there, a zeroed static array the first warp's sum)."""
    x = torch.randn(3 * 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second launch finds the buffer the first one left
        out, err = selftest("block_sum_half_written", x)
        assert err == ""
        torch.testing.assert_close(out[0], x[:64].sum(), rtol=1e-5, atol=1e-5)
        assert out[1:3].isnan().all()


def test_the_emulation_keeps_two_shared_arrays_of_one_line_apart(selftest):
    """Two shared arrays of one size declared on one line are two buffers: zeroing the second leaves the first's
    sum."""
    x = torch.randn(3 * 64, generator=torch.Generator().manual_seed(0))
    out, err = selftest("block_sum_two_arrays", x)
    assert err == ""
    torch.testing.assert_close(out[:3], x.view(3, 64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, message", [("divergent_barrier", "exited"), ("divergent_shuffle", "deadlock")])
def test_the_emulation_fails_a_launch_that_would_hang(selftest, kernel, message):
    _, err = selftest(kernel, torch.zeros(64))
    assert message in err and err.startswith("cuda_sim: ")
    assert selftest("block_sum", torch.zeros(64))[1] == ""  # reported once, then cleared


# ------------------------------------------------------------------------------ policy_loss: single pass
@pytest.mark.parametrize("config", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_policy_loss_matches_reference(cuda_kernels, config, kind, dtype, vocab):
    """policy_kernel (gspo: stats_kernel + grad_kernel) on ragged batches; with V = 4099 the rows start at
    every 16-byte alignment, so both the 128-bit and the scalar loads run; 24 rows on an 8-block grid."""
    compare_policy_loss("cpu", make_case(vocab=vocab, kind=kind, dtype=dtype, seed=3), config)
    single = config.has_token_epilogue and dtype != torch.float16  # fp16 with a gradient: two passes
    assert cuda_kernels.calls["cuda_policy_fused" if single else "cuda_token_grad"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_sliced_view_and_int32_targets(cuda_kernels, dtype):
    native_tests._check_inplace("cpu", make_case(batch=3, length=6, vocab=1000, dtype=dtype, seed=2), CONFIGS[1])
    case = make_case(batch=3, length=7, vocab=4099, dtype=dtype, seed=5)
    case.logits = make_logits((3, 8, 4099), generator=torch.Generator().manual_seed(1), dtype=dtype)[:, :-1]
    case.targets = case.targets.to(torch.int32)
    for inplace in (False, True):
        compare_policy_loss("cpu", case, CONFIGS[1], inplace=inplace)


@pytest.mark.parametrize("name", list({**variants.VARIANTS, **variants.SINGLE_PASS}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_variants_match_reference(cuda_kernels, name, dtype):
    """Every #10 variant: the token-local ones through policy_kernel's epilogue, the others through the
    stats and gradient kernels of the two-pass composition."""
    config = {**variants.VARIANTS, **variants.SINGLE_PASS}[name]
    weights = "" if config.policy_loss == "vespo" else "token"  # vespo refuses caller weights (inside its phi)
    variants._compare_backend("cpu", "cpu", dtype, name, config, (("randn", True, ""), ("peaked", False, ""),
                                                                  ("negative", True, weights)))
    if config.has_token_epilogue:
        native_tests._check_inplace("cpu", variants.with_extras(make_case(batch=5, length=6, seed=1), config),
                                    config)
    kernel = "cuda_policy_fused" if config.has_token_epilogue else "cuda_token_grad"
    assert cuda_kernels.calls[kernel] >= 3


# ------------------------------------------------------------------------------ token_logprobs: two kernels
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 5, 333), (10, 4099), (2, 2, 3, 257)], ids=str)
def test_token_logprobs_grad_of_both_outputs(cuda_kernels, temperature, dtype, shape):
    native_tests.test_token_logprobs_grad_of_both_outputs(temperature, dtype, shape)
    assert cuda_kernels.calls["cuda_token_stats"] == 1 and cuda_kernels.calls["cuda_token_grad"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 1000), (7, 4099)], ids=str)
def test_token_logprobs_inplace(cuda_kernels, dtype, shape):
    """The gradient kernel written over the logits it reads (rows at every 16-byte alignment with V = 4099)."""
    check_token_logprobs_inplace("cpu", shape, dtype)
    assert cuda_kernels.calls["cuda_token_grad"] == 2


# ------------------------------------------------------------------------------ exact zeros of one-hot rows
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.7])
@pytest.mark.parametrize("kind", ["gap", "gap-blocks", "single", "vocab1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_hot_rows_give_exact_zeros(cuda_kernels, kind, temperature, dtype):
    """logp = H = dlogits = 0 exactly where p(target) = 1 in fp32 (y - max y = (x - max x) scale2)."""
    native_tests.check_one_hot_rows("cpu", kind, temperature, dtype)
    fp16 = dtype == torch.float16  # the policy loss of fp16 logits with a gradient: two passes
    assert cuda_kernels.calls["cuda_token_stats"] == 1 + fp16 and cuda_kernels.calls["cuda_policy_fused"] == 1 - fp16


def test_top_entropy_quantile_ties_of_one_hot_rows(cuda_kernels):
    native_tests.check_top_entropy_ties("cpu")
    assert cuda_kernels.calls["cuda_token_stats"] == 1


# ------------------------------------------------------------------------------ fused linear: tiles in place
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[7]], ids=cfg_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_matches_reference(cuda_kernels, config, dtype):
    compare_linear(make_linear_case(vocab=4099, dtype=dtype, seed=7), config, backend="cpu")
    assert cuda_kernels.calls["cuda_policy_fused"] >= 1


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[3]], ids=cfg_id)
def test_fused_linear_gpu_tiling(cuda_kernels, config, monkeypatch):
    """The tiling the fused linear loss uses on a GPU: fixed 3-token slices (masked rows computed with an
    IGNORE_INDEX target) and, for bf16, the mixed GEMM mode (fp32 logits tile, the gradient rounded to
    bf16 once), each tile through the emulated policy kernel in place."""
    from fused_rl.backends import tiled_linear, torch_linear

    monkeypatch.setattr(tiled_linear, "CHUNK_TOKENS", 3)
    monkeypatch.setattr(torch_linear, "CHUNK_TOKENS", 3)
    monkeypatch.setattr(torch_linear, "GATHER_VALID", False)
    monkeypatch.setattr(tiled_linear, "GEMM_MODE", "mixed")
    for dtype in (torch.float32, torch.bfloat16):
        compare_linear(make_linear_case(batch=5, length=7, vocab=1000, dtype=dtype, seed=11, per_token_adv=True),
                       config, backend="cpu")
        compare_linear(make_linear_case(vocab=4099, dtype=dtype, seed=14), config, frozen_weight=True, backend="cpu")
    assert cuda_kernels.calls["cuda_policy_fused"] == 2 * (12 + 8)  # 3-token tiles of 35 and of 24 tokens


# ------------------------------------------------------------------------------ undefined rows, bad values
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("config", hardening.UNDEFINED_CONFIGS, ids=hardening._undefined_ids)
@pytest.mark.parametrize("kind", hardening.UNDEFINED_KINDS)
def test_undefined_row(cuda_kernels, kind, config):
    """NaN, +inf and all -inf rows: NaN log-prob, entropy and gradient rows as the reference's; masked NaN
    rows change nothing; the same through the fused linear loss."""
    hardening.test_undefined_row_policy_loss("cpu", "cpu", kind, config, None)
    hardening.test_nan_in_masked_rows_changes_nothing("cpu", "cpu", config, None)
    if config.policy_loss != "gspo":
        hardening.test_undefined_row_linear_policy_loss("cpu", "cpu", kind, config)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_undefined_rows_token_logprobs(cuda_kernels, dtype):
    hardening.test_undefined_rows_token_logprobs("cpu", "cpu", dtype, None)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_out_of_range_targets_nan_upstream_and_overflowing_ratios(cuda_kernels):
    hardening.test_out_of_range_target_with_checks_off_is_nan_not_a_stray_read("cpu", "cpu", None)
    hardening.test_nan_upstream_gradient_gives_a_nan_row_also_where_p_is_0("cpu", "cpu")
    hardening.test_neg_inf_logits_have_p_zero_even_at_the_target("cpu", "cpu")
    for drop in ("is_weights", "token_mask"):
        for policy in ("ppo_clip", "gmpo"):
            hardening.test_a_dropped_token_with_an_overflowed_ratio_adds_zero("cpu", "cpu", drop, policy)
    for case in ("reinforce-dropped", "cispo-dropped", "reinforce-A0", "nan-row-dropped"):
        hardening.test_weight_zero_rules_agree_on_every_backend("cpu", "cpu", case)
    for config, adv in hardening.OVERFLOW_CONFIGS:
        hardening.test_overflowing_ratio_of_a_clipped_token_has_zero_gradient("cpu", "cpu", config, adv)


def test_fp16_gradient_is_formed_after_the_loss_scale(cuda_kernels):
    """fp16 logits with a gradient take the stats and gradient kernels: the scaled gradient rounded once."""
    hardening.test_fp16_gradient_is_formed_after_the_loss_scale("cpu", "cpu")
    assert cuda_kernels.calls["cuda_token_grad"] == 1 and cuda_kernels.calls["cuda_policy_fused"] == 0


def test_nan_inputs_and_logits_near_the_float32_maximum(cuda_kernels):
    """The epilogue's min / max / clamp keep a NaN old / ref / rollout log-prob as torch's; a finite row max above
    ``float32 max / log2(e)`` is a defined softmax."""
    for nan_in in ("old", "ref", "rollout"):
        hardening.test_a_nan_log_prob_input_gives_what_the_reference_gives("cpu", nan_in)
    hardening.test_finite_logits_near_the_float32_maximum_have_a_softmax("cpu")
    assert cuda_kernels.calls["cuda_policy_fused"] > 0 and cuda_kernels.calls["cuda_token_stats"] > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_huge_jump_of_the_row_max(cuda_kernels, temperature):
    """Partial sums of threads whose maxima are 2e37 apart merge to the reference's finite entropy (the
    rescale's ``s d`` overflowed to ``-inf`` and ``0 * -inf`` made it NaN)."""
    hardening.test_a_huge_jump_of_the_row_max_keeps_the_entropy_finite("cpu", "cpu", temperature, None)
    assert cuda_kernels.calls["cuda_policy_fused"] > 0 and cuda_kernels.calls["cuda_token_stats"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_differential_fuzz(cuda_kernels, dtype):
    """hypothesis cases of test_hardening (40 a dtype): 1-4 x 1-6 rows, V from 2 to 1000, |z| up to 1e4,
    identical rows, -inf entries, left / right padding, every config family, against the reference."""
    hardening.test_differential_fuzz("cpu", "cpu", dtype)
    assert cuda_kernels.calls["cuda_policy_fused"] > 0 and cuda_kernels.calls["cuda_token_grad"] > 0


def test_offsets_beyond_int32(cuda_kernels):
    """Two rows 2^31 + 3 elements apart in one storage: the kernels' row offsets are 64-bit."""
    hardening.test_offsets_beyond_int32("cpu", "cpu")
    assert cuda_kernels.calls["cuda_token_stats"] == 1


@pytest.mark.parametrize("vocab", [1024, 1028, 1003])
@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_dlogits_of_fp32_logits(cuda_kernels, odtype, vocab):
    """The policy kernel reading fp32 logits and writing 16-bit dlogits (64-bit vector stores on rows whose
    16-bit output is 8-byte aligned: every row at V = 1024 and 1028, whose odd output rows are not 16-byte
    aligned; the emulation traps a misaligned one): bitwise the fp32 kernel's dlogits rounded once
    (tests/test_native.py's test)."""
    native_tests.test_policy_fwd_into_rounds_the_fp32_gradient_once(odtype, vocab, None)
    assert cuda_kernels.calls["cuda_policy_fused"] == 2


def test_policy_ops_row_layouts(cuda_kernels):
    """2-D and 4-D inputs to the policy op get the 3-D results; the in-place / into ops refuse other ranks and an
    ``out`` whose rows share memory (tests/test_native.py's test)."""
    native_tests.test_policy_ops_row_layouts(None)
    assert cuda_kernels.calls["cuda_policy_fused"] == 3


# ------------------------------------------------------------------------------ grid, schedule, compile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitwise_identical_across_grids_and_schedules(cuda_kernels, dtype):
    """One block per row at a time: the grid size (rows per SM 1, 2, 64: from 4 to 24 blocks for 24 rows)
    and the order the emulation runs threads in between barriers (drawn anew per launch) change nothing
    (the fixture sets the knobs back)."""
    case = make_case(batch=4, length=6, vocab=4099, dtype=dtype, seed=12)
    outs = []
    for rows_per_sm in (2, 1, 64, 2):
        cuda_kernels.cuda_set_rows_per_sm(rows_per_sm)
        x = case.logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIGS[1],
                                   backend="cpu", **case.kwargs())
        out.loss.backward()
        lp, ent = fused_rl.token_logprobs(case.logits, case.targets, return_entropy=True, backend="cpu")
        outs.append((out.loss, out.logprobs, out.entropy, x.grad, lp, ent))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unrolled_row_sweeps(cuda_kernels, dtype):
    """Rows of 49,229 entries, so that each thread has 24 (fp32) / 12 (16-bit) vectors: the 2- and 4-deep
    unrolled loops of both sweeps run, with a remainder, on aligned and unaligned rows (the row stride is
    not a multiple of 16 bytes). The reference's values, and bitwise the same for unroll 4, 2 and 1 and
    with the gradient sweep reversed and streaming (whose thread owning the target entry differs)."""
    case = make_case(batch=3, length=2, vocab=49229, dtype=dtype, seed=21)
    compare_policy_loss("cpu", case, CONFIGS[1])
    outs = []
    for unroll, reverse, streaming in ((4, False, False), (2, False, False), (1, False, False),
                                       (4, True, False), (2, True, True), (1, False, True)):
        cuda_kernels.cuda_set_unroll(unroll)
        cuda_kernels.cuda_set_reverse(reverse)
        cuda_kernels.cuda_set_streaming(streaming)
        x = case.logits.clone().requires_grad_(True)
        out = fused_rl.policy_loss(x, case.targets, case.advantages, case.mask, config=CONFIGS[1],
                                   backend="cpu", **case.kwargs())
        out.loss.backward()
        xt = case.logits.clone().requires_grad_(True)
        lp, ent = fused_rl.token_logprobs(xt, case.targets, return_entropy=True, temperature=0.7, backend="cpu")
        (lp.sum() - 0.5 * ent.sum()).backward()
        outs.append((out.loss, out.logprobs, out.entropy, x.grad, lp, ent, xt.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [64, 512])
def test_threads_per_block(cuda_kernels, threads):
    """The threads-per-block knob (the reductions' warp count changes with it: the reference's values, not
    bitwise the same as the default 1024) on rows with a scalar tail, unaligned rows and rows of a single
    vector."""
    cuda_kernels.cuda_set_threads(threads)
    for vocab in (4099, 8):
        compare_policy_loss("cpu", make_case(batch=3, length=4, vocab=vocab, seed=vocab), CONFIGS[1])
    compare_policy_loss("cpu", make_case(batch=2, length=3, vocab=1000, dtype=torch.bfloat16, seed=4), CONFIGS[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [1.0, -2.5, 0.0])
def test_scale_rows_in_place(sim, dtype, g):
    """``cuda_scale_`` (the single-pass backward's ``dlogits *= grad_output``) on aligned contiguous rows,
    on a sliced view whose rows are unaligned, with more rows than the grid: ``x * g`` rounded once, and
    with ``g == 1`` nothing written (the buffer keeps its bits, a -0.0 and a NaN included)."""
    full = make_logits((5, 7, 4099), "randn", generator=torch.Generator().manual_seed(3), dtype=dtype)
    full[0, 0, :3] = torch.tensor([-0.0, float("nan"), 1e30 if dtype == torch.float32 else 3e4])
    for x in (full[:, :-1], full.reshape(-1)[: 35 * 4096].view(5, 7, 4096)):
        before = x.clone()
        gt = torch.tensor(g, dtype=torch.float32)
        sim.cuda_scale_(x.data_ptr(), native._DTYPE_CODES[dtype], x.shape[0], x.shape[1], x.shape[2], x.stride(0),
                        x.stride(1), gt.data_ptr(), 0)
        if g == 1.0:
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert torch.equal(x.view(bits), before.view(bits))
        else:
            torch.testing.assert_close(x, (before.float() * g).to(dtype), rtol=0, atol=0, equal_nan=True)
        x.copy_(before)


def test_compile_fullgraph(cuda_kernels):
    native_tests.test_compile_fullgraph()
    assert cuda_kernels.calls["cuda_policy_fused"] >= 2


def test_policy_and_grad_offsets_beyond_int32(cuda_kernels):
    """The policy and gradient kernels on two rows 2^31 + 8 elements apart: bitwise the dense rows' results
    (tests/test_native.py's test)."""
    native_tests.test_policy_and_grad_kernels_offsets_beyond_int32(None)
    assert cuda_kernels.calls["cuda_policy_fused"] == 2 and cuda_kernels.calls["cuda_token_grad"] == 2


def test_policy_target_equal_to_the_vocabulary_size_is_nan(cuda_kernels):
    """A target == V in the policy kernel: a NaN row, not the next row's first logit (tests/test_native.py's)."""
    native_tests.test_policy_target_equal_to_the_vocabulary_size_is_nan(None)
    assert cuda_kernels.calls["cuda_policy_fused"] == 1


def test_bf16_dlogits_round_half_to_even(cuda_kernels):
    """bf16 dlogits of fp32 logits round half to even (tests/test_native.py's test, ~1M values)."""
    native_tests.test_bf16_dlogits_round_half_to_even(None)
    assert cuda_kernels.calls["cuda_policy_fused"] == 2
