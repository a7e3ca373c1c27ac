"""`shoal serve` end to end: real workers, the real server process on loopback, the official
`openai` client. One server and two workers for the whole module; greedy answers are checked
against mlx-lm in one process, and concurrent (batched) answers against the same requests
sent one at a time, token for token and log-probability for log-probability."""

import json
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.decoding.generate import encode_messages, encode_text, generate
from coordinator.ops.local_processes import (
    LocalServer,
    LocalWorker,
    start_server,
    start_worker,
    start_workers,
    stop_workers,
)
from coordinator.server.answer_text import make_detokenizer
from engine.sharding import shard

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"

PROMPTS = [  # different lengths: a batch of them is left-padded
    "hello there",
    "the quick brown fox jumps over the lazy dog and then",
    "a",
    "what is the capital of France? It is",
    "one two three four five six",
]


class Server:
    def __init__(self, local: LocalServer) -> None:
        self.local, self.url = local, local.url

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0,
                             timeout=60)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10)


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    """(source checkpoint, sharded folder, workers, log folder) for the module."""
    root = tmp_path_factory.mktemp("serve")
    source = tiny_checkpoint("qwen3_moe")
    sharded = root / "sharded"
    shard(source, sharded, workers=2, progress=False)
    workers = start_workers([[sharded / "worker-0"], [sharded / "worker-1"]], secret_file,
                            root / "logs", forked=True)
    yield source, sharded, workers, root
    stop_workers(workers)


@pytest.fixture(scope="module")
def server(cluster, secret_file):
    _, sharded, workers, root = cluster
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    local = start_server(sharded, [w.address for w in workers], secret_file,
                         root / "serve.log",
                         ("--api-key-file", str(key_file), "--model-id", "tiny",
                          "--prompt-cache-dir", str(root / "prompt-cache")))
    yield Server(local)
    local.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    """Greedy text of mlx-lm in one process, by prompt ids (a model loaded once)."""
    source = cluster[0]
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    memo = {}

    def result(prompt_ids: list[int], max_tokens: int):
        key = (tuple(prompt_ids), max_tokens)
        if key not in memo:
            memo[key] = generate(model, tokenizer, prompt_ids, max_tokens=max_tokens)
        return memo[key]

    def text(prompt_ids: list[int], max_tokens: int) -> str:
        """A chat reply's text: mlx-lm's detokenizer drops the first leading space."""
        return result(prompt_ids, max_tokens).text

    def continuation(prompt_ids: list[int], max_tokens: int) -> str:
        """A text completion's: mlx-lm's detokenizer with the leading space kept."""
        detokenizer = make_detokenizer(tokenizer, keep_leading_space=True)
        for t in result(prompt_ids, max_tokens).token_ids:
            if t not in tokenizer.eos_token_ids:
                detokenizer.add_token(t)
        detokenizer.finalize()
        return detokenizer.text

    text.tokenizer = tokenizer
    text.continuation = continuation
    text.model = model
    return text


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = server.health()
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert health.json()["workers"] == 2


def test_chat_completion_equals_mlx_lm(server, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = server.client().chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=12, temperature=0)
    prompt = encode_messages(reference.tokenizer, messages)
    assert reply.choices[0].message.content == reference(prompt, 12)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens + (reply.choices[0].finish_reason == "stop") <= 12
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_unstreamed(server):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me about fish."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_stops_at_a_stop_string(server, reference):
    client = server.client()
    prompt = "the quick brown fox"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0]
    assert full.text == reference.continuation(encode_text(reference.tokenizer, prompt), 16)
    assert full.text.startswith(" ")  # the first token's space is the answer's
    stop = full.text[4:6]
    assert len(stop) == 2 and full.text.find(stop) >= 1, full.text
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                    temperature=0, stop=[stop, "\u2603never"]).choices[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_the_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key=None).models.list()
    with pytest.raises(openai.AuthenticationError):
        server.client(key="sk-wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    bare = httpx.get(server.url + "/health", timeout=10)
    assert bare.status_code == 401 and "Bearer" in bare.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    (b'{"messages": [', "not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "at least 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "an integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "a number"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": 1}, "true or false"),
    ({"messages": "hi"}, "'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "'n' must be 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "'stop'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_bad_chat_requests_get_400(server, body, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=10,
                       headers={"Authorization": f"Bearer {KEY}",
                                "Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_too_long_prompts_and_negative_max_tokens_get_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=[7] * 5000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[5, 10**7], max_tokens=2)
    assert server.health().status_code == 200  # and it goes on serving


def test_tools_for_a_template_without_tool_calling_get_a_400_naming_the_problem(server):
    """The tiny checkpoint's own chat template has no tool-call syntax: tools are refused on
    each API (the template would drop them and no call could be read back)."""
    tool = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
    messages = [{"role": "user", "content": "What time is it?"}]
    problem = "this model's chat template has no tool calling"
    with pytest.raises(openai.BadRequestError, match=problem) as refused:
        server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                                tools=[{"type": "function", "function": tool}])
    assert "leave 'tools' out" in refused.value.message
    headers = {"Authorization": f"Bearer {KEY}"}
    anthropic = httpx.post(server.url + "/v1/messages", headers=headers, timeout=30, json={
        "model": "tiny", "max_tokens": 2, "messages": messages,
        "tools": [{"name": tool["name"], "input_schema": tool["parameters"]}]})
    assert anthropic.status_code == 400 and problem in anthropic.json()["error"]["message"]
    ollama = httpx.post(server.url + "/api/chat", headers=headers, timeout=30, json={
        "model": "tiny", "messages": messages, "stream": False,
        "tools": [{"type": "function", "function": tool}]})
    assert ollama.status_code == 400 and problem in ollama.json()["error"]
    plain = server.client().chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=2, temperature=0)
    assert plain.choices[0].finish_reason in ("stop", "length")  # without tools: answered


def _stream_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, list]:
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True, logprobs=3)
    text, scores = "", []
    for c in chunks:
        text += c.choices[0].text
        if c.choices[0].logprobs:
            lp = c.choices[0].logprobs
            scores += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    return text, scores


def test_concurrent_streams_equal_the_same_requests_one_at_a_time(server, reference):
    """Five streams of different prompt lengths and answer lengths, started a little apart
    so that some join a batch already decoding and some leave it early: each text and each
    log-probability equals that request's alone, and mlx-lm's in one process."""
    client = server.client()
    lengths = [24, 9, 30, 16, 5]
    before = server.health().json()["batching"]
    results: dict[int, tuple[str, list]] = {}
    errors = []

    def run(i: int) -> None:
        try:
            results[i] = _stream_text(client, PROMPTS[i], lengths[i])
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert not errors and len(results) == len(PROMPTS), errors
    after = server.health().json()["batching"]
    assert after["widest_step"] >= 3, after  # they really were decoded together
    assert after["decode_rows"] - before["decode_rows"] > after["decode_steps"] - before[
        "decode_steps"]

    for i, prompt in enumerate(PROMPTS):
        alone = _stream_text(client, prompt, lengths[i])
        assert results[i][0] == alone[0], (i, prompt)
        assert results[i][1] == alone[1], (i, prompt)  # float for float
        assert alone[0] == reference.continuation(encode_text(reference.tokenizer, prompt),
                                                  lengths[i])


def test_a_second_chat_turn_reuses_the_first_turns_cache(server, reference):
    client = server.client()
    turn = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8,
                                           temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    prompt = encode_messages(reference.tokenizer, turn)
    assert second.choices[0].message.content == reference(prompt, 8)


def _wait_idle(server: Server, timeout: float = 15.0) -> float:
    started = time.monotonic()
    while server.health().json()["requests_in_flight"]:
        assert time.monotonic() - started < timeout, "a request kept its slot"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_client_that_disconnects_frees_its_slot(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "hello there", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.health().json()["requests_in_flight"] == 1
    assert _wait_idle(server) < 10
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=1.0)
    assert _wait_idle(server) < 10


def test_a_seeded_sample_does_not_depend_on_its_batch(server):
    """With a seed, a request draws from its own random key: the same text alone and while
    other requests share its batch; without one, samples differ."""
    client = server.client()

    def sample(seed: int | None) -> str:
        return client.completions.create(model="tiny", prompt="hello there", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    alone = sample(7)
    together: list[str] = []
    threads = [threading.Thread(target=lambda: together.append(sample(7))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == [alone] * 3
    assert len({sample(None) for _ in range(3)} | {alone}) > 1


def test_a_lost_worker_ends_requests_with_its_experts_named_and_serving_resumes(
    server, cluster, secret_file
):
    """Last in the module: it stops a worker (no other copy of its experts) mid-answer,
    then starts it again on the same port."""
    _, sharded, workers, root = cluster
    client = server.client()
    stream = client.completions.create(model="tiny", prompt="hello there", max_tokens=4000,
                                       temperature=0, stream=True)
    next(iter(stream))
    lost = workers[1]
    lost.stop()
    with pytest.raises(openai.APIError, match="no live worker holds these experts: layer"):
        for _ in stream:
            pass
    health = server.health()
    assert health.status_code == 503 and "experts" in health.json()["detail"]
    with pytest.raises(openai.InternalServerError, match="no live worker holds"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)

    port = lost.address.rpartition(":")[2]
    back: LocalWorker = start_worker([sharded / "worker-1"], secret_file,
                                     root / "logs" / "worker-1-again.log",
                                     ("--no-advertise", "--port", port), forked=True)
    workers[1] = back  # stopped with the others at the end of the module
    deadline = time.monotonic() + 30
    while server.health().status_code != 200:
        assert time.monotonic() < deadline, server.health().text
        time.sleep(0.2)
    again = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
