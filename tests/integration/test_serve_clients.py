"""Every client against `shoal serve`: the official `openai` client with tools, streamed tool
calls, structured output and every sampling field; the official `anthropic` client on the
Messages API; the official `ollama` client on Ollama's API; and the schema sweeps: every field
of the OpenAI chat and completions schemas and mlx-lm's extensions, of Anthropic's Messages
request and of Ollama's chat, generate and options (each read from the installed client
package) is either honoured or refused with a 400 naming it. One cluster of two real workers
and one server, whose tiny checkpoint carries a chat template with tools
(tests/integration/tool_template.jinja)."""

import json
import shutil
import threading
import time
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anthropic
import httpx2 as httpx
import jsonschema
import ollama
import ollama._types as ollama_types
import openai
import pytest
from anthropic.types import message_create_params as message_params
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model, load_tokenizer
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params
from playwright.sync_api import sync_playwright

from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from coordinator.server.anthropic_api import FIELDS as ANTHROPIC_FIELDS
from coordinator.server.anthropic_api import NEUTRAL as ANTHROPIC_NEUTRAL
from coordinator.server.ollama_api import CHAT_FIELDS as OLLAMA_CHAT_FIELDS
from coordinator.server.ollama_api import GENERATE_FIELDS as OLLAMA_GENERATE_FIELDS
from coordinator.server.ollama_api import NEUTRAL as OLLAMA_NEUTRAL
from coordinator.server.ollama_api import OPTIONS as OLLAMA_OPTIONS
from coordinator.server.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, MLX_LM_FIELDS, NEUTRAL
from engine.manifest import read_manifest
from engine.sharding import shard

pytestmark = pytest.mark.slow

KEY = "sk-test-clients"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
TEMPLATE = Path(__file__).with_name("tool_template.jinja")
HI = [{"role": "user", "content": "What is the capital of France?"}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def with_tool_template(checkpoint: Path, out: Path) -> Path:
    shutil.copytree(checkpoint, out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE.read_text()
    config_file.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def source(tiny_checkpoint, tmp_path_factory) -> Path:
    return with_tool_template(tiny_checkpoint("qwen3_moe"),
                              tmp_path_factory.mktemp("clients") / "source")


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b"<!doctype html><html><body>a page</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pages():
    """Two web servers on loopback serving a page: a browser page's origins, the first let
    in by --cors-origin, the second not."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    for httpd in servers:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{httpd.server_address[1]}" for httpd in servers]
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def workers(source, secret_file):
    root = source.parent
    shard(source, root / "sharded", workers=2, progress=False)
    started = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs", forked=True)
    yield started
    stop_workers(started)


@pytest.fixture(scope="module")
def server(source, workers, secret_file, pages):
    root = source.parent
    (root / "key").write_text(KEY)
    local = start_server(root / "sharded", [w.address for w in workers], secret_file,
                         root / "serve.log", ("--api-key-file", str(root / "key"),
                                              "--model-id", "tiny", "--cors-origin", ORIGIN,
                                              "--cors-origin", pages[0],
                                              "--prompt-cache-dir", str(root / "cache")))
    yield local
    local.stop()


@pytest.fixture(scope="module")
def quiet_server(source, workers, secret_file):
    """A second server on the same workers, with the defaults the first one changes: no key,
    no CORS; and --log-level warning."""
    root = source.parent
    local = start_server(root / "sharded", [w.address for w in workers], secret_file,
                         root / "quiet.log", ("--model-id", "tiny", "--log-level", "warning",
                                              "--prompt-cache-dir", str(root / "cache")))
    yield local
    local.stop()


@pytest.fixture(scope="module")
def mlx_lm_model(source):
    """The same checkpoint in one process: mlx-lm's own generation is the reference."""
    model, _ = load_model(source)
    return model, load_tokenizer(source)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)


def mlx_lm_text(mlx_lm_model, prompt: list[int], max_tokens: int, **processors) -> str:
    """Greedy text of mlx-lm's stream_generate with mlx-lm's logits processors."""
    model, tokenizer = mlx_lm_model
    text = ""
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                             logits_processors=make_logits_processors(**processors)):
        if r.finish_reason == "stop":
            break
        text += r.text
    return text


# ---------------------------------------------------------------------------------------
# The schema sweep

SAMPLES = {  # a value for each field of the OpenAI schemas that is not its neutral one
    "audio": {"voice": "alloy", "format": "mp3"}, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"5": 1.5}, "logprobs": True, "max_completion_tokens": 3, "max_tokens": 3,
    "metadata": {"k": "v"}, "modalities": ["text"], "moderation": {"model": "m"}, "n": 1,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5, "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 1,
    "service_tier": "flex", "stop": ["\n"], "store": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "tool_choice": "auto",
    "tools": [WEATHER], "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low",
    "web_search_options": {}, "best_of": 1, "echo": True, "suffix": "end", "prompt": "hello",
    "messages": HI, "model": "tiny", "stream": False,  # streaming: the other tests
    # mlx-lm's extensions
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "repetition_context_size": 8,
    "presence_context_size": 8, "frequency_context_size": 8,
    "chat_template_kwargs": {"reasoning_effort": "low"},
    "speculative": False,  # Shoal's own
}
COMPANIONS = {"top_logprobs": {"logprobs": True}}  # fields that need another with them
TEXT_SAMPLES = {"logprobs": 2, "chat_template_kwargs": {"x": 1}}  # where completions differ


def test_the_sweep_knows_every_field_of_the_installed_openai_schemas():
    chat = typing.get_type_hints(chat_params.CompletionCreateParamsBase)
    text = typing.get_type_hints(text_params.CompletionCreateParamsBase)
    assert set(chat) - {"stream"} <= set(CHAT_FIELDS), set(chat) - set(CHAT_FIELDS)
    assert set(text) - {"stream"} <= set(COMPLETION_FIELDS), set(text) - set(COMPLETION_FIELDS)
    assert set(chat) | set(text) | set(MLX_LM_FIELDS) <= set(SAMPLES) | {"stream"}
    assert set(NEUTRAL) <= set(CHAT_FIELDS) | set(COMPLETION_FIELDS)


@pytest.mark.parametrize("route,fields", [("/v1/chat/completions", CHAT_FIELDS),
                                          ("/v1/completions", COMPLETION_FIELDS)])
def test_every_field_is_honoured_or_refused_with_a_400_naming_it(server, route, fields):
    """Each field of the API's table and mlx-lm's, at a value that asks for something: 200
    where honoured, the same answer where it only labels the request, else 400 naming it;
    a refused field at its neutral value (store: false...) is taken, same answer."""
    base = {"messages": HI} if route.endswith("chat/completions") else {"prompt": "hello"}
    base |= {"max_tokens": 3, "temperature": 0}
    samples = SAMPLES if route.endswith("chat/completions") else {**SAMPLES, **TEXT_SAMPLES}
    plain = post(server, route, base)
    assert plain.status_code == 200, plain.text
    for name, status in {**MLX_LM_FIELDS, **fields}.items():
        reply = post(server, route, {**base, **COMPANIONS.get(name, {}), name: samples[name]})
        if status in ("yes", "ignored"):
            assert reply.status_code == 200, (name, reply.text)
            if status == "ignored":  # accepted, and the answer is the same
                assert reply.json()["choices"] == plain.json()["choices"], name
        else:
            assert reply.status_code == 400, (name, reply.text)
            message = reply.json()["error"]["message"]
            assert f"'{name}'" in message, (name, message)
    for name, values in NEUTRAL.items():
        for value in values if name in fields else ():
            reply = post(server, route, {**base, name: value})
            assert reply.status_code == 200, (name, value, reply.text)
            assert reply.json()["choices"] == plain.json()["choices"], (name, value)


def test_a_field_of_neither_the_api_nor_mlx_lm_is_refused_by_name(server):
    reply = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                                  "mirostat": 2})
    assert reply.status_code == 400 and "'mirostat'" in reply.json()["error"]["message"]


# ---------------------------------------------------------------------------------------
# Sampling: mlx-lm's processors and samplers, per request inside one batch

SETTINGS = [  # (request fields, mlx-lm's make_logits_processors arguments; None: seeded)
    ({}, {}),
    ({"logit_bias": {"70": 9.0}}, {"logit_bias": {70: 9.0}}),
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"repetition_penalty": 1.8, "repetition_context_size": 2},
     {"repetition_penalty": 1.8, "repetition_context_size": 2}),
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"presence_penalty": 1.5, "presence_context_size": 2},
     {"presence_penalty": 1.5, "presence_context_size": 2}),
    ({"frequency_penalty": 1.2, "frequency_context_size": 8},
     {"frequency_penalty": 1.2, "frequency_context_size": 8}),
    ({"temperature": 1.0, "seed": 5, "top_k": 3}, None),
    ({"temperature": 1.0, "seed": 5, "min_p": 0.3}, None),
]
# The openai client's own arguments for /v1/completions; mlx-lm's fields go in extra_body.
TEXT_ARGUMENTS = set(typing.get_type_hints(text_params.CompletionCreateParamsBase))


def complete(c: openai.OpenAI, prompt: list[int], max_tokens: int, fields: dict) -> str:
    given = {"temperature": 0, **fields}
    extra = {k: v for k, v in given.items() if k not in TEXT_ARGUMENTS}
    reply = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=extra or None,
        **{k: v for k, v in given.items() if k in TEXT_ARGUMENTS})
    return reply.choices[0].text


def test_each_sampling_setting_in_one_batch_equals_mlx_lm_alone(server, mlx_lm_model):
    """Nine requests with different processors and samplers, sent together through the
    openai client: each text equals the same request alone; the greedy ones equal mlx-lm's
    stream_generate with the same processors, and the seeded ones (top_k, min_p) draw from
    their own key. Each processor, and each context size, changes the answer."""
    _, tokenizer = mlx_lm_model
    prompt = tokenizer.encode("the quick brown fox")
    c = client(server)
    before = httpx.get(server.url + "/health", headers=HEADERS).json()["batching"]
    together: dict[int, str] = {}

    def run(i: int) -> None:
        together[i] = complete(c, prompt, 14, SETTINGS[i][0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(SETTINGS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = httpx.get(server.url + "/health", headers=HEADERS).json()["batching"]
    assert after["widest_step"] >= 2 and after["decode_rows"] - before["decode_rows"] > (
        after["decode_steps"] - before["decode_steps"])  # some shared a step
    texts = []
    for i, (fields, processors) in enumerate(SETTINGS):
        alone = complete(c, prompt, 14, fields)
        assert together[i] == alone, fields
        if processors is not None:
            reference = mlx_lm_text(mlx_lm_model, prompt, 14, **processors)
            assert alone.lstrip(" ") == reference.lstrip(" "), fields
        texts.append(alone)
    assert all(t != texts[0] for t in texts[1:]), texts
    assert texts[3] != texts[2] and texts[5] != texts[4], texts  # the context sizes count


def test_top_k_1_min_p_1_and_a_tiny_top_p_sample_the_greedy_answer(server):
    body = {"prompt": "hello there", "max_tokens": 12}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    sampled = {post(server, "/v1/completions", {**body, "temperature": 1.5, "seed": s})
               .json()["choices"][0]["text"] for s in range(3)}
    assert sampled != {greedy["choices"][0]["text"]}  # plain sampling wanders
    for knob in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.01}):
        for seed in (1, None):
            reply = post(server, "/v1/completions",
                         {**body, "temperature": 1.5, "seed": seed, **knob}).json()
            assert reply["choices"][0]["text"] == greedy["choices"][0]["text"], knob


def test_max_completion_tokens_bounds_a_chat_answer(server):
    c = client(server)
    free = c.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    assert free.usage.completion_tokens > 3
    cut = c.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0,
                                    max_completion_tokens=3)  # it wins over max_tokens
    assert cut.usage.completion_tokens == 3 and cut.choices[0].finish_reason == "length"
    assert free.choices[0].message.content.startswith(cut.choices[0].message.content)


def test_completions_keep_the_first_tokens_leading_space_and_echo_reads_right(server,
                                                                           mlx_lm_model):
    _, tokenizer = mlx_lm_model
    bias = {str(t): 100 for t in tokenizer.encode(" ")[-1:]}  # the answer starts with a space
    reply = client(server).completions.create(model="tiny", prompt="the dog", max_tokens=2,
                                              temperature=0, logit_bias=bias, echo=True)
    assert reply.choices[0].text == "the dog  "  # two spaces generated, both kept
    chat = client(server).chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                                  temperature=0, logit_bias=bias)
    assert chat.choices[0].message.content == " "  # a chat reply's first one is trimmed


# ---------------------------------------------------------------------------------------
# Tools


def test_tools_reach_the_prompt_and_a_forced_call_comes_back_as_tool_calls(server):
    c = client(server)
    plain = c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0)
    reply = c.chat.completions.create(
        model="tiny", messages=HI, max_tokens=120, temperature=0, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools rendered
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    required = c.chat.completions.create(model="tiny", messages=HI, max_tokens=120,
                                         temperature=0, tools=[WEATHER, CLOCK],
                                         tool_choice="required", parallel_tool_calls=False)
    assert len(required.choices[0].message.tool_calls) == 1
    assert required.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_equal_the_whole_answer(server):
    c = client(server)
    kwargs = {"model": "tiny", "messages": HI, "max_tokens": 120, "temperature": 0,
              "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    whole = c.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments}
        for t in whole.message.tool_calls]


def test_tool_results_go_back_with_their_call_ids(server):
    c = client(server)
    turn = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]}]
    a = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, tools=[WEATHER],
                                  messages=turn + [{"role": "tool", "tool_call_id": "call_1",
                                                    "content": "sunny"}])
    b = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, tools=[WEATHER],
                                  messages=turn + [{"role": "tool",
                                                    "tool_call_id": "call_1_longer_id",
                                                    "content": "sunny"}])
    assert b.usage.prompt_tokens > a.usage.prompt_tokens  # the id is in the prompt


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(server):
    c = client(server)
    plain = c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0)
    effort = c.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                       temperature=0, reasoning_effort="high")
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens
    kwargs = c.chat.completions.create(
        model="tiny", messages=HI, max_tokens=2, temperature=0,
        extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert kwargs.usage.prompt_tokens == effort.usage.prompt_tokens  # the same prompt


# ---------------------------------------------------------------------------------------
# Structured output


def test_a_json_schema_answer_parses_and_validates(server):
    c = client(server)
    free = c.chat.completions.create(model="tiny", messages=HI, max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)  # without it: not JSON
    reply = c.chat.completions.create(
        model="tiny", messages=HI, max_tokens=150, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_json_object_holds_the_answer_and_composes_with_logit_bias(server, mlx_lm_model):
    _, tokenizer = mlx_lm_model
    [close] = tokenizer.encode("}")
    reply = client(server).completions.create(
        model="tiny", prompt="hello", max_tokens=20, temperature=0,
        logit_bias={str(close): 30}, extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].text == "{}" and reply.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------
# Anthropic's Messages API, with the official client


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


ANTHROPIC_TOOL = {"name": "get_weather", "description": "weather",
                  "input_schema": WEATHER["function"]["parameters"]}
ANTHROPIC_SAMPLES = {  # a value for each field of the Messages API that is not its neutral one
    "model": "tiny", "messages": HI, "max_tokens": 3, "system": "Be brief.",
    "stop_sequences": ["\n"], "stream": False, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"},
    "thinking": {"type": "disabled"}, "output_config": {"effort": "low"},
    "metadata": {"user_id": "u"}, "user_profile_id": "p", "workspace_id": "w",
    "service_tier": "priority", "cache_control": {"type": "ephemeral", "ttl": "1h"},
    "diagnostics": {"previous_message_id": None}, "inference_geo": "us", "speed": "fast",
    "container": "c", "mcp_servers": [{"type": "url", "url": "x"}], "context_management": {},
    "speculative": False,  # Shoal's own
}


def test_the_anthropic_sweep_knows_every_field_of_the_installed_schema():
    fields = typing.get_type_hints(message_params.MessageCreateParamsBase)
    assert set(fields) <= set(ANTHROPIC_FIELDS), set(fields) - set(ANTHROPIC_FIELDS)
    assert set(ANTHROPIC_FIELDS) <= set(ANTHROPIC_SAMPLES) and set(ANTHROPIC_NEUTRAL) <= set(
        ANTHROPIC_FIELDS)


def test_every_anthropic_field_is_honoured_or_refused_with_a_400_naming_it(server):
    """As the OpenAI sweep: 200 where honoured, the same answer for a label or a neutral
    value, else 400 naming the field."""
    base = {"model": "tiny", "messages": HI, "max_tokens": 3, "temperature": 0}
    plain = post(server, "/v1/messages", base)
    assert plain.status_code == 200, plain.text
    for name, status in ANTHROPIC_FIELDS.items():
        reply = post(server, "/v1/messages", {**base, name: ANTHROPIC_SAMPLES[name]})
        if status in ("yes", "ignored"):
            assert reply.status_code == 200, (name, reply.text)
            if status == "ignored":
                assert reply.json()["content"] == plain.json()["content"], name
        else:
            assert reply.status_code == 400, (name, reply.text)
            message = reply.json()["error"]["message"]
            assert f"'{name}'" in message, (name, message)
    for name, values in ANTHROPIC_NEUTRAL.items():
        for value in values:
            reply = post(server, "/v1/messages", {**base, name: value})
            assert reply.status_code == 200, (name, value, reply.text)
            assert reply.json()["content"] == plain.json()["content"], (name, value)


def test_anthropic_top_k_1_and_a_tiny_top_p_sample_the_greedy_answer(server):
    a = anthropic_client(server)
    greedy = a.messages.create(model="tiny", max_tokens=12, messages=HI,
                               extra_body={"temperature": 0}).content[0].text
    for knob in ({"top_k": 1}, {"top_p": 0.01}):
        reply = a.messages.create(model="tiny", max_tokens=12, messages=HI,
                                  extra_body={"temperature": 1, **knob})
        assert reply.content[0].text == greedy, knob


def test_anthropic_messages_equal_the_openai_chat(server):
    openai_text = client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=12, temperature=0).choices[0].message.content
    a = anthropic_client(server)
    reply = a.messages.create(model="tiny", max_tokens=12, messages=HI,
                              extra_body={"temperature": 0})
    assert reply.content[0].type == "text" and reply.content[0].text == openai_text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.input_tokens > 0
    with a.messages.stream(model="tiny", max_tokens=12, messages=HI,
                           extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == openai_text and final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens
    count = a.messages.count_tokens(model="tiny", messages=HI)
    assert count.input_tokens == reply.usage.input_tokens


def test_anthropic_tools_and_stop_sequences(server):
    a = anthropic_client(server)
    tool = ANTHROPIC_TOOL
    reply = a.messages.create(model="tiny", max_tokens=120, messages=HI, tools=[tool],
                              tool_choice={"type": "tool", "name": "get_weather"},
                              extra_body={"temperature": 0})
    assert reply.stop_reason == "tool_use"
    [use] = [b for b in reply.content if b.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])
    with a.messages.stream(model="tiny", max_tokens=120, messages=HI, tools=[tool],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    back = a.messages.create(model="tiny", max_tokens=4, tools=[tool], messages=[
        *HI, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                                "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny"}]}], extra_body={"temperature": 0})
    assert back.usage.input_tokens > reply.usage.input_tokens

    text = a.messages.create(model="tiny", max_tokens=16, messages=HI,
                             extra_body={"temperature": 0}).content[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text.find(text[i:i + 2]) == i)  # a stop string with text before it
    cut = a.messages.create(model="tiny", max_tokens=16, messages=HI, stop_sequences=[stop],
                            extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert [b.text for b in cut.content] == [text[: text.find(stop)]]
    with pytest.raises(anthropic.BadRequestError, match="'mcp_servers'"):
        a.messages.create(model="tiny", max_tokens=4, messages=HI,
                          extra_body={"mcp_servers": [{"type": "url", "url": "x"}]})


def test_anthropic_output_format_is_held_to_its_schema(server):
    reply = anthropic_client(server).messages.create(
        model="tiny", max_tokens=150, messages=HI, extra_body={"temperature": 0},
        output_config={"format": {"type": "json_schema", "schema": PERSON}})
    jsonschema.validate(json.loads(reply.content[0].text), PERSON)


# ---------------------------------------------------------------------------------------
# Ollama's API, with the official client


def test_ollama_chat_generate_and_models(server, source):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    openai_text = client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=12, temperature=0).choices[0].message.content
    reply = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 12})
    assert reply.message.content == openai_text and reply.done
    assert reply.eval_count >= 1 and reply.prompt_eval_count > 0
    streamed = list(o.chat(model="tiny", messages=HI, stream=True,
                           options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.message.content for p in streamed) == openai_text
    assert streamed[-1].done and not any(p.done for p in streamed[:-1])
    generated = o.generate(model="tiny", prompt=HI[0]["content"], stream=False,
                           options={"temperature": 0, "num_predict": 12})
    assert generated.response == openai_text
    raw = o.generate(model="tiny", prompt="the quick brown fox", raw=True, stream=False,
                     options={"temperature": 0, "num_predict": 8})
    text = client(server).completions.create(model="tiny", prompt="the quick brown fox",
                                             max_tokens=8, temperature=0).choices[0].text
    assert raw.response == text
    assert [m.model for m in o.list().models] == ["tiny"]
    manifest = read_manifest(source.parent / "sharded")
    assert o.list().models[0].size == sum(
        f.bytes for f in (*manifest.dense_files, *manifest.experts)) > 0  # Ollama's: bytes
    assert [m.model for m in o.ps().models] == ["tiny"]
    assert o.show("tiny").capabilities == ["completion", "tools"]
    assert httpx.get(server.url + "/api/version", headers=HEADERS).json()["version"]
    with pytest.raises(ollama.ResponseError, match="mirostat"):
        o.chat(model="tiny", messages=HI, options={"mirostat": 2})


OLLAMA_SAMPLES = {  # a value for each field of Ollama's chat and generate that asks something
    "model": "tiny", "messages": HI, "prompt": "hello", "stream": False, "format": "json",
    "options": {"temperature": 0, "num_predict": 3, "seed": 1}, "think": False,
    "keep_alive": "10m", "tools": [WEATHER], "logprobs": True, "top_logprobs": 2,
    "system": "Be brief.", "raw": True, "suffix": "end", "template": "{{ .Prompt }}",
    "context": [1, 2], "images": ["aGk="], "width": 64, "height": 64, "steps": 4,
}
OPTION_SAMPLES = {
    "num_predict": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 1,
    "stop": ["\n"], "repeat_penalty": 1.3, "repeat_last_n": 8, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "num_ctx": 4096, "numa": True, "num_batch": 8, "num_gpu": 1,
    "main_gpu": 1, "low_vram": True, "f16_kv": True, "logits_all": True, "vocab_only": True,
    "use_mmap": True, "use_mlock": True, "embedding_only": True, "num_thread": 2,
    "num_keep": 4, "tfs_z": 0.5, "typical_p": 0.5, "mirostat": 1, "mirostat_tau": 4.0,
    "mirostat_eta": 0.2, "penalize_newline": True, "speculative": False,
}
QUIET = {"temperature": 0, "num_predict": 3}


def test_the_ollama_sweep_knows_every_field_of_the_installed_ollama_package():
    assert set(ollama_types.ChatRequest.model_fields) <= set(OLLAMA_CHAT_FIELDS)
    assert set(ollama_types.GenerateRequest.model_fields) <= set(OLLAMA_GENERATE_FIELDS)
    assert set(ollama_types.Options.model_fields) <= set(OLLAMA_OPTIONS)
    assert set(OLLAMA_CHAT_FIELDS) | set(OLLAMA_GENERATE_FIELDS) <= set(OLLAMA_SAMPLES)
    assert set(OLLAMA_OPTIONS) <= set(OPTION_SAMPLES)


def _ollama_text(reply: httpx.Response) -> str:
    body = reply.json()
    return body["message"]["content"] if "message" in body else body["response"]


@pytest.mark.parametrize("route,fields", [("/api/chat", OLLAMA_CHAT_FIELDS),
                                          ("/api/generate", OLLAMA_GENERATE_FIELDS)])
def test_every_ollama_field_and_option_is_honoured_or_refused_with_a_400_naming_it(
    server, route, fields
):
    """As the OpenAI sweep, for the fields of each route and (on /api/chat) every option:
    200 where honoured, the same answer at a neutral value, else 400 naming it."""
    base = {"model": "tiny", "stream": False, "options": QUIET}
    base |= {"messages": HI} if route == "/api/chat" else {"prompt": "hello"}
    plain = post(server, route, base)
    assert plain.status_code == 200, plain.text
    sent = [(name, status, {**base, name: OLLAMA_SAMPLES[name]})
            for name, status in fields.items()]
    if route == "/api/chat":
        sent += [(name, status, {**base, "options": {**QUIET, name: OPTION_SAMPLES[name]}})
                 for name, status in OLLAMA_OPTIONS.items()]
    for name, status, body in sent:
        reply = post(server, route, body)
        if status == "yes":
            assert reply.status_code == 200, (name, reply.text)
        else:
            assert reply.status_code == 400, (name, reply.text)
            assert f"'{name}'" in reply.json()["error"], (name, reply.text)
    for name, values in OLLAMA_NEUTRAL.items():
        for value in values:
            body = ({**base, "options": {**QUIET, name: value}} if name in OLLAMA_OPTIONS
                    else {**base, name: value})
            reply = post(server, route, body)
            assert reply.status_code == 200, (name, value, reply.text)
            assert _ollama_text(reply) == _ollama_text(plain), (name, value)
    unload = post(server, route, {**base, "keep_alive": 0})  # the one keep_alive refused
    assert unload.status_code == 400 and "'keep_alive'" in unload.json()["error"]


def test_ollama_num_ctx_bounds_the_prompt_and_the_answer(server):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    plain = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 12})
    assert plain.eval_count > 3
    held = o.chat(model="tiny", messages=HI, stream=False,
                  options={"temperature": 0, "num_ctx": plain.prompt_eval_count + 3})
    assert held.eval_count == 3 and held.done_reason == "length"
    assert plain.message.content.startswith(held.message.content)
    with pytest.raises(ollama.ResponseError, match="'num_ctx'"):
        o.chat(model="tiny", messages=HI, stream=False,
               options={"num_ctx": plain.prompt_eval_count})


def test_ollama_tools_and_format(server):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    reply = o.chat(model="tiny", messages=HI, stream=False, format=PERSON,
                   options={"temperature": 0, "num_predict": 150})
    jsonschema.validate(json.loads(reply.message.content), PERSON)
    plain = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 2})
    with_tools = o.chat(model="tiny", messages=HI, stream=False, tools=[WEATHER],
                        options={"temperature": 0, "num_predict": 2})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count  # the tools rendered


# ---------------------------------------------------------------------------------------
# HTTP: JSON errors, the model, CORS, the access log and the start-up line


def test_models_retrieve_and_json_404s(server):
    c = client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="no model 'other'"):
        c.models.retrieve("other")
    missing = httpx.get(server.url + "/v1/nothing", headers=HEADERS)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route GET /v1/nothing"
    wrong = httpx.get(server.url + "/v1/chat/completions", headers=HEADERS)
    assert wrong.status_code == 405 and "does not take GET" in wrong.json()["error"]["message"]


def test_cors_lets_the_named_origin_in_and_without_cors_options_is_a_json_405(
    server, quiet_server
):
    preflight_headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.request("OPTIONS", server.url + "/v1/chat/completions",
                              headers=preflight_headers)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    reply = httpx.get(server.url + "/v1/models", headers={**HEADERS, "Origin": ORIGIN})
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={**HEADERS,
                                                          "Origin": "http://elsewhere"})
    assert "access-control-allow-origin" not in other.headers
    off = httpx.request("OPTIONS", quiet_server.url + "/v1/chat/completions",
                        headers=preflight_headers)  # no --cors-origin: no preflight answer
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    assert off.json()["error"] == {"message": "/v1/chat/completions does not take OPTIONS",
                                   "type": "invalid_request_error", "param": None,
                                   "code": 405}


FETCH = """async ({url, key}) => {
  try {
    const reply = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "What is the capital of France?"}],
                            max_tokens: 6, temperature: 0})});
    const body = await reply.json();
    return {status: reply.status, content: body.choices[0].message.content};
  } catch (e) {
    return {error: e.name};
  }
}"""


def test_a_browser_page_of_the_named_origin_can_call_the_api_and_others_cannot(server, pages,
                                                                              chromium):
    """Debian's chromium, driven by playwright: fetch() from a page of the --cors-origin
    origin (a preflight, then the call with its key) gets the answer; from another origin
    the browser refuses it."""
    expected = client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0).choices[0].message.content
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            results = []
            for origin in pages:
                page.goto(origin + "/", timeout=30_000)
                results.append(page.evaluate(FETCH, {"url": server.url, "key": KEY}))
        finally:
            browser.close()
    assert results[0] == {"status": 200, "content": expected}
    assert results[1] == {"error": "TypeError"}  # "Failed to fetch": CORS refused it


def _log_when(local, text: str, timeout: float = 10.0) -> str:
    """The server's log once it holds `text` (the access line follows the answer)."""
    deadline = time.monotonic() + timeout
    while text not in (log := local.log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return log


def test_the_log_says_a_key_is_needed_and_has_a_line_per_request(server):
    httpx.get(server.url + "/v1/models/tiny", headers=HEADERS)
    log = _log_when(server, '"GET /v1/models/tiny" 200')
    assert "an API key is required" in log and ORIGIN in log
    assert '"GET /v1/models/tiny" 200' in log


def test_at_log_level_warning_no_key_is_asked_and_no_request_is_logged(quiet_server):
    """Last to use the quiet server: it stops it, so that everything it wrote is in the log
    before the log is read."""
    [line] = [line for line in quiet_server.log.read_text().splitlines()
              if " requests decoded together)" in line]
    assert line.startswith(f"shoal serve: tiny on {quiet_server.url}/v1 (")
    assert line.endswith("; no API key is required"), line
    bare = openai.OpenAI(base_url=quiet_server.url + "/v1", api_key="any", max_retries=0,
                         timeout=60)  # a key it does not check
    assert bare.models.retrieve("tiny").id == "tiny"
    assert bare.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                        temperature=0).choices[0].message.content
    quiet_server.stop()
    assert quiet_server.proc.returncode == 0
    log = quiet_server.log.read_text()
    assert "shoal.access" not in log and "/v1/models/tiny" not in log, log
    assert " INFO " not in log, log  # neither Shoal's info lines nor uvicorn's
