"""Benchmarks that print figures and ratios against baselines run in the same script."""
