#!/usr/bin/env bash
# Peers for the GPU benchmarks that the device image lacks, as wheels in .whl/ (git-ignored), for
# bench/gpu_check.sh to install there (carry [".whl"] in the device call). Pure-Python wheels: the
# image's torch and triton serve them. Run here, where pip reaches PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1 verl==0.9.1
ls -la .whl
