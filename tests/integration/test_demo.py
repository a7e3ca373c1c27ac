"""`shoal demo` as a newcomer runs it: real SmolLM2 weights, converted, sharded over two local
workers, a chat answer that names Paris, and no worker left running afterwards."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def worker_processes(cache: Path) -> list[str]:
    run = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, timeout=30)
    return [line for line in run.stdout.splitlines()
            if "worker.daemon" in line and str(cache) in line]


@pytest.mark.slow
def test_demo_answers_paris_and_stops_its_workers(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "SHOAL_CACHE": str(cache)}
    for attempt in ("first run builds the model", "second run reuses the cache"):
        run = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "demo", "--max-tokens", "24"],
            capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
        )
        assert run.returncode == 0, f"{attempt}: {run.stderr[-3000:]}"
        assert "Paris" in run.stdout, f"{attempt}: {run.stdout}"
        assert "tok/s" in run.stderr
        assert "16 experts per layer, top-4" in run.stderr  # sparse: each token runs a quarter
        assert not worker_processes(cache), attempt
    assert "building" not in run.stderr  # the second run built nothing
    assert (cache / "demo" / "sharded-e16-k4-copies-w2" / "manifest.json").exists()


@pytest.mark.slow
def test_demo_model_on_workers_matches_mlx_lm_on_its_checkpoint(tmp_path, start_worker,
                                                                secret_file, monkeypatch):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from builders.demo_models import moe_folder, prepare
    from coordinator.generate import encode_prompt, open_remote_model
    from engine.auth import load_secret

    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    sharded = prepare(16, 4, 2, progress=False)
    reference, tokenizer = load(str(moe_folder(16, 4)))
    prompt = encode_prompt(tokenizer, "What is the capital of France?", chat=True)
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), reference, max_tokens=12)]
    workers = [start_worker([sharded / f"worker-{k}"]) for k in range(2)]
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        tokens = [int(t) for t, _ in generate_step(mx.array(prompt), remote.model,
                                                    max_tokens=12)]
    finally:
        remote.close()
    assert tokens == expected
    assert "Paris" in tokenizer.decode(tokens)
