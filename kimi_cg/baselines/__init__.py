"""Baselines the benchmarks compare kimi_cg with (not part of the compiler)."""
