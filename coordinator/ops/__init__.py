"""Operating a cluster around the runtime: doctor, the heat record, offline planning, live
deploy and rebalance, the workers' counters, Hugging Face downloads, and starting local
worker and server processes."""
