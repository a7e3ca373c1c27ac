"""`shoal serve` whose workers are down when it starts: it starts anyway, answers 503 in each
API's own shape with the plain reason (the addresses given, "nothing listens"), serves once
the workers come up, without a restart; `--wait` gives up instead, in one plain line."""

import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx2 as httpx  # the HTTP client the openai package is built on
import ollama
import openai
import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.decoding.generate import encode_messages, generate
from coordinator.ops.local_processes import start_server
from engine.sharding import shard
from tests.ports import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Hello"}]
REFUSED = "connection refused at once: nothing listens on that port"
RAW = ("UNAVAILABLE", "failed to connect", "ipv4:")  # gRPC's own words, never shown
SETTLE = 30.0  # seconds a change of the workers may take to show, on a loaded machine


@pytest.fixture(scope="module")
def model(tiny_checkpoint, tmp_path_factory):
    """(source checkpoint, sharded folder) of a tiny model over two workers."""
    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path_factory.mktemp("serve-start") / "sharded"
    shard(source, sharded, workers=2, progress=False)
    return source, sharded


def until(check, what: str, timeout: float = SETTLE):
    """Poll `check` (bounded) until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:g} s")


def test_a_server_starts_without_its_workers_says_why_in_each_api_and_serves_once_they_come(
    model, start_worker, secret_file, tmp_path
):
    source, sharded = model
    ports = free_ports(2)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    server = start_server(sharded, addresses, secret_file, tmp_path / "serve.log",
                          ("--model-id", "tiny"))
    try:
        def health_says_both_are_dead() -> dict | None:
            reply = httpx.get(server.url + "/health", timeout=10)
            assert reply.status_code == 503, reply.text
            body = reply.json()
            return body if all(f"worker {a} is unreachable: {REFUSED}" in body["detail"]
                               for a in addresses) else None

        health = until(health_says_both_are_dead, "/health did not name both dead workers")
        assert health["status"] == "unavailable" and health["workers"] == 0
        assert not any(raw in health["detail"] for raw in RAW), health["detail"]
        assert httpx.get(server.url + "/", timeout=10).status_code == 200  # the dashboard

        with pytest.raises(openai.APIStatusError) as refused:
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                          timeout=30).chat.completions.create(model="tiny", messages=HI,
                                                              max_tokens=4)
        assert refused.value.status_code == 503
        message = refused.value.body["message"]
        assert f"worker {addresses[0]} is unreachable: {REFUSED}" in message, message
        assert not any(raw in message for raw in RAW), message
        with pytest.raises(anthropic.APIStatusError) as caught:
            anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                timeout=30).messages.create(model="tiny", messages=HI,
                                                            max_tokens=4)
        assert caught.value.status_code == 503 and caught.value.body["type"] == "error"
        assert f"worker {addresses[1]} is unreachable" in caught.value.body["error"]["message"]
        with pytest.raises(ollama.ResponseError) as said:
            ollama.Client(host=server.url, timeout=30).chat(model="tiny", messages=HI)
        assert said.value.status_code == 503 and REFUSED in said.value.error
        log = (tmp_path / "serve.log").read_text()
        assert f"shoal: worker {addresses[0]} is unreachable: {REFUSED}" in log, log
        assert "waiting for the workers at " + ", ".join(addresses) in log, log
        assert not any(raw in log for raw in RAW), log

        for port, store in zip(ports, ("worker-0", "worker-1"), strict=True):
            start_worker([sharded / store], "--port", str(port))
        until(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 200,
              "/health did not turn 200 once the workers came up")
        reply = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                              timeout=60).chat.completions.create(
            model="tiny", messages=HI, max_tokens=8, temperature=0)
        mlx_model, _ = load_model(source)
        tokenizer = load_tokenizer(source)
        expected = generate(mlx_model, tokenizer, encode_messages(tokenizer, HI), max_tokens=8)
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert "every expert has a live owner now: serving" in \
            (tmp_path / "serve.log").read_text()
    finally:
        server.stop()


def test_serve_with_wait_gives_up_in_one_plain_line_when_its_workers_are_down(
    model, secret_file
):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "coordinator.cli", "serve", "--model",
                          str(model[1]), "--workers", address, "--wait", "3", "--port", "0",
                          "--secret-file", str(secret_file)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stdout + run.stderr
    assert time.monotonic() - started < 60  # the dense load, then 3 s of waiting
    assert "Traceback" not in run.stderr and not any(raw in run.stderr for raw in RAW)
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith(f"shoal: error: waited 3 s for the workers at {address}: "), error
    assert f"worker {address} is unreachable: {REFUSED}" in error, error
    assert f"shoal doctor --workers {address}" in error, error


def test_shoal_workers_says_a_dead_address_in_plain_words(secret_file):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    run = subprocess.run([sys.executable, "-m", "coordinator.cli", "workers", "--workers",
                          address, "--secret-file", str(secret_file)],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"worker {address} is unreachable: {REFUSED}" in run.stdout, run.stdout
    assert not any(raw in run.stdout + run.stderr for raw in RAW), run.stdout + run.stderr
