"""Operating a cluster around the runtime: checking machines and workers (doctor.py), the
heat record, planning placements offline, deploying and rebalancing live (rebalancer.py,
migration_executor.py), the workers' counters, Hugging Face downloads, and starting local
worker and server processes."""
