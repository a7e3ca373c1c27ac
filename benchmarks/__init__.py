"""Benchmarks that print figures and ratios against baselines run in the same script: `shoal
bench`'s harness (bench.py), the measurements docs/ cites, and probes/, one question each.
Outside the product: not in the installed package, run from a checkout."""
