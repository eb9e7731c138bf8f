"""Benchmark scripts: each prints ratios measured within one run (machines here are noisy)."""
