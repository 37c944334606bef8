"""pytest-benchmark suites: ``pytest bench/ --benchmark-only`` (set FUSED_RL_BENCH_SET, see conftest).

Each case records its extra peak memory (measured in a fresh subprocess on CPU) and its byte / FLOP
floor in ``extra_info``, so ``--benchmark-json`` output holds the whole table.
"""

import os

import pytest
import torch

from bench.cases import MODES, OPS, describe, floor_bytes, floor_flops, make_callable, make_inputs, unavailable, IMPLS
from bench.conftest import measure_memory
from bench.measure import peak_extra_memory


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_bench(benchmark, op, impl, mode, shape, device):
    if os.environ.get("FUSED_RL_BENCH_SET") == "gpu" and device != "cuda":
        pytest.skip("FUSED_RL_BENCH_SET=gpu needs a CUDA device (its shapes are ~10 GB of logits)")
    reason = unavailable(IMPLS[impl], op, device)
    if reason:
        pytest.skip(reason)
    if impl == "reference-compiled" and os.environ.get("FUSED_RL_BENCH_SET") == "smoke":
        pytest.skip("torch.compile is too slow to build for the smoke run")
    if op == "linear_policy_loss" and not shape.h:
        pytest.skip("shape has no hidden size")
    if op != "linear_policy_loss" and shape.h and os.environ.get("FUSED_RL_BENCH_SET") == "gpu":
        pytest.skip("GPU linear shape is for the linear op only")
    inputs = make_inputs(op, shape, device)
    run = make_callable(op, impl, mode, inputs)
    if device == "cuda":  # time the GPU work, not its launch
        launch = run
        run = lambda: (launch(), torch.cuda.synchronize())  # noqa: E731
    benchmark.extra_info.update(describe(op, impl, mode, shape))
    if op == "linear_policy_loss":
        benchmark.extra_info["floor_flops"] = floor_flops(op, mode, shape)
    else:
        benchmark.extra_info["floor_bytes"] = floor_bytes(op, mode, shape, int(inputs["mask"].sum()))
    if measure_memory(op, mode) and not benchmark.disabled:
        benchmark.extra_info["peak_extra_bytes"] = peak_extra_memory(op, impl, mode, shape, device)
    benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
