#!/usr/bin/env bash
# One-shot GPU check (H200: torch 2.11 / CUDA 13 / triton 3.6 expected).
#   bash bench/gpu_check.sh OUTDIR        (default: $OUT, else ./gpu_check_out)
# 0. build the native extension in place if it is missing (CUDA kernels need nvcc there)
# 1. pytest -m cuda tests/test_triton.py   (TRITON_INTERPRET=0: real kernels on the GPU)
# 2. pytest -m cuda on the native (CUDA C++), linear, tiled linear and hardening tests
# 3. bench/gpu_logits_bench.py: N=16384, V=151936, bf16, forward+backward of policy_loss
# 4. bench/bench_variants.py on triton and cuda: N=8192, V=151936, bf16, single pass vs two-pass
# Results: OUTDIR/{env.txt,build.txt,pytest_cuda.txt,pytest_native.txt,pytest_junit.xml,bench.txt,
#          logits_bench.json,logits_bench.md,variants.txt}.
# Budget: <= 240 s build + 170 s + 120 s tests + 120 s + 2 x 45 s benchmarks (each step has its own timeout).
set -u
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python}"
export TRITON_INTERPRET=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch, triton, fused_rl; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print('fused_rl from', fused_rl.__file__); print(fused_rl.available_backends(torch.device('cuda')))"
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

if ! ls fused_rl/_C*.so > /dev/null 2>&1; then
  echo "== build_ext --inplace"
  timeout 240 "$PY" setup.py build_ext --inplace > "$OUTDIR/build.txt" 2>&1
  echo "build exit code: $?" >> "$OUTDIR/build.txt"
  tail -5 "$OUTDIR/build.txt"
fi

echo "== pytest -m cuda tests/test_triton.py"
timeout 170 "$PY" -m pytest -m cuda tests/test_triton.py -q -p no:cacheprovider --durations=10 \
  --junitxml="$OUTDIR/pytest_junit.xml" -W ignore::RuntimeWarning > "$OUTDIR/pytest_cuda.txt" 2>&1
echo "pytest exit code: $?" >> "$OUTDIR/pytest_cuda.txt"
tail -25 "$OUTDIR/pytest_cuda.txt"

echo "== pytest -m cuda tests/test_native.py tests/test_linear.py tests/test_tiled_linear.py tests/test_hardening.py"
timeout 120 "$PY" -m pytest -m cuda tests/test_native.py tests/test_linear.py tests/test_tiled_linear.py tests/test_hardening.py -q \
  -p no:cacheprovider -W ignore::RuntimeWarning > "$OUTDIR/pytest_native.txt" 2>&1
echo "pytest exit code: $?" >> "$OUTDIR/pytest_native.txt"
tail -15 "$OUTDIR/pytest_native.txt"

echo "== logits-pass benchmark"
timeout 120 "$PY" bench/gpu_logits_bench.py "$OUTDIR" > "$OUTDIR/bench.txt" 2>&1
echo "bench exit code: $?" >> "$OUTDIR/bench.txt"
tail -40 "$OUTDIR/bench.txt"

echo "== single pass vs two-pass per token-local variant"
for backend in triton cuda; do
  timeout 45 "$PY" bench/bench_variants.py --backend "$backend" --dtype bf16 --batch 16 --length 512 \
    --vocab 151936 --repeat 3 >> "$OUTDIR/variants.txt" 2>&1
  echo "$backend exit code: $?" >> "$OUTDIR/variants.txt"
done
tail -25 "$OUTDIR/variants.txt"
