#!/usr/bin/env bash
# One-shot GPU check (H200 image: python3 3.12, torch 2.11 / CUDA 13 / triton 3.6, no liger-kernel).
#
#   bash bench/gpu_wheels.sh             # here, once: liger-kernel, cut-cross-entropy, verl wheels into .whl/
#   device run: command "bash bench/gpu_check.sh $OUT", carry [".whl"], timeout_s 600, kind "nvidia-h200"
#   (without a kind the tool may start an H100, whose numbers do not compare with the issues' H200 goals)
#
# Steps (each under its own cap and one overall deadline, GPU_CHECK_BUDGET_S, default 560 s, so the
# whole command ends inside the device tool's 600 s per call; the call's timeout_s must leave the
# budget + 35 s: a step cut at the deadline gets SIGINT, then SIGKILL 15 s later; the running step
# logs to OUTDIR/running_step.txt, so a hard kill of the whole command still returns what it printed):
#   wheels  pip install --target of the carried .whl/*.whl (peers for the benchmarks), if present
#   build   FUSED_RL_CUDA=1 setup.py build_ext --inplace (CPU + CUDA kernels; a CUDA part that cannot be
#           built fails the build loudly), unless fused_rl._C imports and is newer than csrc/ and setup.py
#           (a warm machine keeps an older build; a carried one may be for another Python); then a preflight line in the
#           summary says whether the cuda and triton backends are usable (else their tests only skip)
#   logits  bench/gpu_logits_bench.py (issue 3): policy_loss fwd+bwd, N=16384, V=151936, bf16, triton / cuda /
#           torch / reference / liger; sweeps of the triton (block x warps, then loop order, cache hints,
#           grid) and cuda (threads x blocks per SM, then unroll, sweep order, cache policy) launch knobs
#   variants  bench/bench_variants.py on triton and cuda: single pass vs two-pass per variant
#   linear_budget  bench/gpu_linear_budget.py (issue 4): the tiled fused linear by tile budget, and its GEMMs alone
#   linear  bench.report --set gpu --ops linear_policy_loss --modes fwd+bwd: N=8192, H=4096, V=128256, bf16
#   linear_profile  bench/gpu_linear_profile.py: torch.profiler of the tiled fused linear, kernel time by kind
#   pytest  pytest -m cuda over the triton, native, tiled/linear, hardening, variant, opcheck, linear fuzz, Liger,
#           verl, vocabulary-parallel and recompile tests (xdist); last, in the time the benchmarks leave (the caps add up to more than
#           the budget, and the issues' rows must not be the ones cut)
# GPU_CHECK_STEPS (default all): the steps to run among pytest, logits, variants, linear, linear_budget,
# linear_profile
# (wheels and build always run; e.g. GPU_CHECK_STEPS="logits linear_budget" for a short confirmation).
# What comes back (the device tool returns at most 8 files): OUTDIR/summary.txt (environment, each
# step's exit code, wall time and output tail) and OUTDIR/results.tar.gz (every step's full output,
# junit XML, JSON and Markdown tables), both rewritten after every step.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUTDIR"
WORK="$(mktemp -d)"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
DEADLINE=$((SECONDS + BUDGET))
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$WORK/summary.txt"

publish() {
  cp "$SUMMARY" "$OUTDIR/summary.txt"
  tar czf "$OUTDIR/results.tar.gz.part" -C "$WORK" . && mv "$OUTDIR/results.tar.gz.part" "$OUTDIR/results.tar.gz"
}

# step NAME CAP CMD...: runs CMD under min(CAP, time left) seconds (SIGINT first, so pytest still
# prints its summary), output to WORK/NAME.txt; records the exit code and wall time.
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    echo "== $name: skipped (${left} s left of the ${BUDGET} s budget)" | tee -a "$SUMMARY"
    publish
    return
  fi
  local start=$SECONDS
  # the running step logs under OUTDIR: a hard kill of the whole command (the device tool's limit_s) still
  # returns what it printed; moved into WORK (the tarball) when it ends
  timeout -s INT -k 15 "$limit" "$@" > "$OUTDIR/running_step.txt" 2>&1
  local rc=$?
  mv "$OUTDIR/running_step.txt" "$WORK/$name.txt"
  {
    echo "== $name: exit $rc, $((SECONDS - start)) s (limit $limit s)"
    tail -n "${TAIL:-30}" "$WORK/$name.txt"
    echo
  } | tee -a "$SUMMARY"
  publish
}

# wanted STEP: whether GPU_CHECK_STEPS names it
wanted() {
  case " ${GPU_CHECK_STEPS:-pytest logits variants linear linear_budget linear_profile} " in
    *" $1 "*) return 0 ;;
    *) return 1 ;;
  esac
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 \
    || echo "WARNING: not an H200: the issues' goals and runs 1-4 are on an H200 (device call: kind nvidia-h200)"
  nvcc --version 2>&1 | tail -1
} > "$SUMMARY"

if ls .whl/*.whl > /dev/null 2>&1; then
  step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
SO="$("$PY" -c "import fused_rl._C as C; print(C.__file__)" 2>/dev/null)"
if [ -z "$SO" ] || [ -n "$(find csrc setup.py -newer "$SO" 2>/dev/null)" ]; then
  FUSED_RL_CUDA=1 TAIL=5 step build 150 "$PY" setup.py build_ext --inplace
fi
"$PY" -c "import torch, fused_rl
r = fused_rl.available_backends(torch.device('cuda'))
bad = {k: v for k, v in r.items() if k in ('cuda', 'triton', 'torch') and v is not None}
print('PREFLIGHT FAILED: ' + repr(bad) if bad else 'preflight: cuda, triton and torch backends usable on the GPU')" \
  >> "$SUMMARY" 2>&1
"$PY" -c "import torch, triton, fused_rl; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(fused_rl.available_backends(torch.device('cuda')))" \
  >> "$SUMMARY" 2>&1
"$PY" -c "import importlib.metadata as m
for name in ('numpy', 'transformers', 'liger_kernel', 'cut_cross_entropy'):
    try: print(name, m.version(name))
    except m.PackageNotFoundError: print(name, 'not installed')" >> "$SUMMARY" 2>&1
cat "$SUMMARY"
publish

# the issue rows first (issues 3 and 4), the test suite after them
wanted logits && TAIL=60 step logits 150 "$PY" bench/gpu_logits_bench.py "$WORK/logits"

wanted variants && for backend in triton cuda; do
  TAIL=15 step "variants_$backend" 40 "$PY" bench/bench_variants.py --backend "$backend" --dtype bf16 \
    --batch 16 --length 512 --vocab 151936 --repeat 3
done

wanted linear_budget && TAIL=12 step linear_budget 70 "$PY" bench/gpu_linear_budget.py "$WORK/linear_budget"

wanted linear && TAIL=20 step linear 90 "$PY" -m bench.report --set gpu --ops linear_policy_loss --modes fwd+bwd \
  --impls triton,cuda,reference,cce,liger,torch,reference-compiled --repeats 3 --out "$WORK/linear"

wanted linear_profile && TAIL=45 step linear_profile 45 "$PY" bench/gpu_linear_profile.py "$WORK/linear_profile"

# the issues' verdicts from the benchmarks' JSON, before the tests (which the budget may cut)
"$PY" bench/gpu_verdicts.py "$WORK" 2>&1 | tee -a "$SUMMARY"
publish

wanted pytest && FUSED_RL_REQUIRE_NATIVE=1 TAIL=40 step pytest 270 "$PY" -m pytest -m cuda -n 8 -q -p no:cacheprovider -rfEs --durations=15 \
  -W ignore::RuntimeWarning --junitxml="$WORK/pytest_junit.xml" \
  tests/test_triton.py tests/test_native.py tests/test_linear.py tests/test_tiled_linear.py \
  tests/test_hardening.py tests/test_variants.py tests/test_opcheck.py tests/test_linear_fuzz.py \
  tests/test_recompiles.py tests/test_liger_logits.py tests/test_verl_lm_head.py tests/test_verl_logits.py \
  tests/test_vocab_parallel.py

echo "== done in $SECONDS s" | tee -a "$SUMMARY"
publish
