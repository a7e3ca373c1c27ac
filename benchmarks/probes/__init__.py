"""One-question probes: each measures one thing a choice in the code or a doc rests on
(benchmarks/probes/README.md lists them with their reports)."""
