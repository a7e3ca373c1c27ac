"""`shoal serve --draft-model` and `--draft mtp` end to end: real workers, real server processes,
the official `openai` client. Greedy text with a draft equals the text without one, one stream
at a time and four at once (streams leave the batch for the draft and rejoin it); a request's
`"speculative": false` keeps it off the draft; a draft that does not fit is refused at start."""

import json
import shutil
import subprocess
import sys
import threading

import httpx2 as httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, load_tokenizer

from builders.synthetic import build_checkpoint
from coordinator.decoding.generate import encode_messages
from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.mtp import model_classes
from engine.sharding import shard

pytestmark = pytest.mark.slow

PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog and then", "a",
           "what is the capital of France? It is"]
MAX_TOKENS = 16


def chat(url: str, prompt: str, **extra) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body=extra or None)
    return reply.choices[0].message.content


def drafting(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()["drafting"]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    """(source checkpoint, sharded folder, worker addresses, root) with one worker running."""
    root = tmp_path_factory.mktemp("serve-drafts")
    source = tiny_checkpoint("qwen3_moe")
    shard(source, root / "sharded", workers=1, progress=False)
    workers = start_workers([[root / "sharded" / "worker-0"]], secret_file, root / "logs")
    yield source, root / "sharded", [w.address for w in workers], root
    stop_workers(workers)


def serve(cluster, secret_file, name: str, *extra: str):
    _, sharded, addresses, root = cluster
    return start_server(sharded, addresses, secret_file, root / f"{name}.log",
                        ("--model-id", "tiny", "--prompt-cache-disk", "0", *extra))


@pytest.fixture(scope="module")
def servers(cluster, secret_file):
    """(plain server, server drafting with the target's own checkpoint: every guess right)."""
    plain = serve(cluster, secret_file, "plain")
    try:
        drafted = serve(cluster, secret_file, "drafted", "--draft-model", str(cluster[0]))
    except BaseException:
        plain.stop()
        raise
    yield plain.url, drafted.url
    drafted.stop()
    plain.stop()


@pytest.fixture(scope="module")
def alone(servers):
    """Each prompt's greedy text from the server without a draft, sent alone."""
    return {p: chat(servers[0], p) for p in PROMPTS}


def test_one_stream_with_a_draft_equals_the_text_without(servers, alone):
    before = drafting(servers[1])
    for prompt in PROMPTS:
        assert chat(servers[1], prompt) == alone[prompt], prompt
    after = drafting(servers[1])
    # the draft's path was taken, and its guesses (the model's own) were accepted
    assert after["solo_runs"] >= before["solo_runs"] + len(PROMPTS)
    assert after["accepted"] > before["accepted"]
    assert after["tokens"] > before["tokens"]
    assert drafting(servers[0]) is None
    metrics = httpx.get(servers[1] + "/metrics", timeout=10).text
    assert "shoal_draft_acceptance" in metrics and "shoal_draft_tokens_per_step" in metrics


def test_four_streams_at_once_equal_each_alone(servers, alone):
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        results[prompt] = chat(servers[1], prompt)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone


def test_speculative_false_keeps_a_request_off_the_draft(servers, alone):
    before = drafting(servers[1])
    assert chat(servers[1], PROMPTS[1], speculative=False) == alone[PROMPTS[1]]
    assert drafting(servers[1])["tokens"] == before["tokens"]
    response = httpx.post(servers[1] + "/v1/chat/completions", timeout=10, json={
        "messages": [{"role": "user", "content": "hi"}], "speculative": "no"})
    assert response.status_code == 400 and "speculative" in response.text


def refusal(cluster, secret_file, *extra: str) -> subprocess.CompletedProcess:
    _, sharded, addresses, _ = cluster
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(sharded), "--workers",
         ",".join(addresses), "--port", "0", "--secret-file", str(secret_file), *extra],
        capture_output=True, text=True, timeout=120)


def test_a_draft_with_another_vocabulary_is_refused_at_start(cluster, secret_file, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(cluster[0], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    extra_id = len(tokenizer["model"]["vocab"])
    tokenizer["added_tokens"].append({"id": extra_id, "content": "<|extra|>", "special": True,
                                      "single_word": False, "lstrip": False, "rstrip": False,
                                      "normalized": False})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    done = refusal(cluster, secret_file, "--draft-model", str(other))
    assert done.returncode != 0
    assert "another tokenizer" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_draft_mtp_without_mtp_weights_is_refused_at_start(cluster, secret_file):
    done = refusal(cluster, secret_file, "--draft", "mtp")
    assert done.returncode != 0
    assert "multi-token-prediction" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr


def test_draft_mtp_in_serve_equals_mlx_lm(secret_file, tmp_path):
    source = build_checkpoint(tmp_path / "source", "deepseek_v3", mtp="bigram")
    shard(source, tmp_path / "sharded", workers=1, progress=False)
    workers = start_workers([[tmp_path / "sharded" / "worker-0"]], secret_file,
                            tmp_path / "logs")
    model, _ = load_model(source, get_model_classes=model_classes)
    tokenizer = load_tokenizer(source)
    try:
        server = start_server(tmp_path / "sharded", [w.address for w in workers], secret_file,
                              tmp_path / "serve.log", ("--model-id", "tiny",
                                                       "--prompt-cache-disk", "0",
                                                       "--draft", "mtp"))
        try:
            for prompt in PROMPTS[:2]:
                ids = encode_messages(tokenizer, [{"role": "user", "content": prompt}])
                expected = [int(t) for t, _ in generate_step(mx.array(ids), model,
                                                             max_tokens=MAX_TOKENS)]
                detokenizer = tokenizer.detokenizer
                for t in expected:
                    if t in tokenizer.eos_token_ids:
                        break
                    detokenizer.add_token(t)
                detokenizer.finalize()
                assert chat(server.url, prompt) == detokenizer.text, prompt
            stats = drafting(server.url)
            assert stats["draft"] == "mtp" and stats["accepted"] > 0, stats
        finally:
            server.stop()
    finally:
        stop_workers(workers)
