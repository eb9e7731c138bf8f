"""Bitwise-numerics regression suite: stored loss curves, run-to-run determinism, and a
representative sample of the cpu integration suite's bitwise comparisons (see docs/testing.md,
"Integration suites")."""
