"""Model builders for the demo, the tests and the benchmarks (random checkpoints of every mlx-lm
MoE family, GGUF Llama to Hugging Face, dense to MoE, the demo's models); neither a coordinator
nor a worker needs them to serve."""
