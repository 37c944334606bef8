"""Benchmarks of fused_rl against its reference and its peers (see bench/README in docs/bench.md)."""
