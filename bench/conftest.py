"""Benchmark selection: ``FUSED_RL_BENCH_SET`` = smoke | cpu (default) | gpu; ``FUSED_RL_BENCH_IMPLS``
a comma list to restrict implementations."""

import os

import pytest
import torch

from bench.cases import IMPLS, SHAPE_SETS


def bench_set() -> str:
    return os.environ.get("FUSED_RL_BENCH_SET", "cpu")


def bench_device() -> str:
    return "cuda" if bench_set() == "gpu" and torch.cuda.is_available() else "cpu"


#: The smoke set (CI) runs fused_rl's own CPU paths only: peers' imports alone take longer than it.
SMOKE_IMPLS = ["reference", "torch", "cpu"]


def bench_impls() -> list[str]:
    chosen = os.environ.get("FUSED_RL_BENCH_IMPLS")
    if chosen:
        return chosen.split(",")
    return SMOKE_IMPLS if bench_set() == "smoke" else list(IMPLS)


def measure_memory(op: str, mode: str) -> bool:
    """FUSED_RL_BENCH_MEMORY=0/1 forces it; by default every case, but only policy_loss fwd+bwd in smoke."""
    forced = os.environ.get("FUSED_RL_BENCH_MEMORY")
    if forced is not None:
        return forced == "1"
    return bench_set() != "smoke" or (op, mode) == ("policy_loss", "fwd+bwd")


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        metafunc.parametrize("shape", SHAPE_SETS[bench_set()], ids=lambda s: s.label())
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", bench_impls())


@pytest.fixture
def device():
    return bench_device()
