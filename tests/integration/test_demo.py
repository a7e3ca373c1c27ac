"""`shoal demo` as a newcomer runs it: real SmolLM2 weights, converted, sharded over two local
workers, a chat answer that names Paris, and no worker left running afterwards."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load
from openai import OpenAI

from builders.demo_models import moe_folder, prepare
from coordinator.decoding.generate import encode_prompt, open_remote_model
from engine.auth import load_secret
from tests.demo_runs import DemoRun, demo_workers_running
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_second_run(demo_cache: Path) -> DemoRun:
    """`shoal demo` run again on the cache the first run filled (its printed next steps are
    what test_the_commands_the_demo_prints_work_as_printed types)."""
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "SHOAL_CACHE": str(demo_cache)})
    return DemoRun(demo_cache, run, demo_workers_running(demo_cache))


@pytest.mark.slow
def test_demo_answers_paris_and_stops_its_workers(demo_first_run, demo_second_run):
    """The first run (conftest's demo_first_run, on an empty cache) builds the model, the
    second reuses it; each answers and leaves no worker running."""
    cache = demo_first_run.cache
    first = demo_first_run.run
    assert first.returncode == 0, f"first run: {first.stderr[-3000:]}"
    assert "building" in first.stderr, "the first run built nothing"
    assert not demo_first_run.left_running, "first run"
    second = demo_second_run.run
    assert second.returncode == 0, f"second run: {second.stderr[-3000:]}"
    assert not demo_second_run.left_running, "second run"
    for attempt, run in (("first run builds the model", first),
                         ("second run reuses the cache", second)):
        assert "Paris" in run.stdout, f"{attempt}: {run.stdout}"
        assert "tok/s" in run.stderr
        assert "16 experts per layer, top-4" in run.stderr  # sparse: each token runs a quarter
    assert "building" not in second.stderr  # the second run built nothing
    assert (cache / "demo" / "sharded-e16-k4-copies-w2" / "manifest.json").exists()


@pytest.mark.slow
def test_demo_model_on_workers_matches_mlx_lm_on_its_checkpoint(demo_cache, start_worker,
                                                                secret_file, monkeypatch):

    monkeypatch.setenv("SHOAL_CACHE", str(demo_cache))
    sharded = prepare(16, 4, 2, progress=False)  # built already
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


def chat_as_printed(command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command + " --max-tokens 16", shell=True, cwd=REPO, env=env, text=True,
                          input="What is the capital of France?\n", capture_output=True,
                          timeout=300)


def wait_for_port(port: int, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"nothing listened on {port} within {seconds} s")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.mark.slow
def test_the_commands_the_demo_prints_work_as_printed(demo_second_run):
    """A chat, the OpenAI API through the official client, and a worker of its own, each on
    the demo's model, typed as the demo printed them (ports made free where the printed one
    is taken on this shared machine, the only change)."""
    env = {**os.environ, "SHOAL_CACHE": str(demo_second_run.cache)}  # the models built already
    demo = demo_second_run.run
    assert demo.returncode == 0, demo.stderr[-3000:]
    after = demo.stdout.split("Next, on the model the demo built")[1]
    commands = [line.strip() for line in after.splitlines() if line.startswith("    ")]
    alone, serve, worker, with_worker = commands
    assert alone.startswith(".venv/bin/shoal chat ")  # how this install's shoal is typed

    answered = chat_as_printed(alone, env)
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert "Paris" in answered.stdout

    http_port = free_ports(1)[0]
    server = subprocess.Popen(serve.replace("--port 8080", f"--port {http_port}"), shell=True,
                              cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_port(http_port, server, 300)
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        # the demo model's template renders tools: a forced call comes back parsed
        weather = {"type": "function", "function": {
            "name": "get_weather", "parameters": {
                "type": "object", "additionalProperties": False, "required": ["city"],
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
        called = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=40,
            temperature=0, tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        call = called.choices[0].message.tool_calls[0].function
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in (
            "Paris", "Rome")
    finally:
        stop(server)

    worker_port = free_ports(1)[0]
    worker_process = subprocess.Popen(worker.replace("--port 50561", f"--port {worker_port}"),
                                      shell=True, cwd=REPO, env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True)
    try:
        wait_for_port(worker_port, worker_process, 300)
        answered = chat_as_printed(with_worker.replace(":50561", f":{worker_port}"), env)
        assert answered.returncode == 0, answered.stderr[-3000:]
        assert "Paris" in answered.stdout
    finally:
        stop(worker_process)
