"""Benchmarks that measure Shoal against baselines in the same run, each writing one result
record (records.py) that docs/benchmarks.md is rendered from (figures.py); probes/ answer one
question each. Outside the product: not in the installed package, run from a checkout."""
