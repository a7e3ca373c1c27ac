"""Model builders for the demo, the tests and the benchmarks: random checkpoints of every
mlx-lm MoE family, a GGUF Llama turned into a Hugging Face checkpoint, a dense Llama turned
into a Mixture-of-Experts, and the demo's models built from them into the cache. Neither a
coordinator nor a worker needs them to serve."""
