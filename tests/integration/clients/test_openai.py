"""The official `openai` client against `shoal serve`: every field of the installed chat and
completions schemas and mlx-lm's extensions honoured or refused with a 400 naming it, each
sampling setting equal to mlx-lm's, tools, streamed tool calls and structured output."""

import json
import threading
import typing

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params

from coordinator.server.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, MLX_LM_FIELDS, NEUTRAL
from tests.integration.clients.cluster import (
    CLOCK,
    HEADERS,
    HI,
    PERSON,
    WEATHER,
    client,
    mlx_lm_text,
    post,
)

pytestmark = pytest.mark.slow


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


