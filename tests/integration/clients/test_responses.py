"""The Responses API (`POST /v1/responses`) with the official `openai` client, streamed and not:
the chat API's greedy text, function tools, previous_response_id, and every field of the
installed schema honoured or refused with a 400 naming it (the cluster: conftest.py's)."""

import json
import typing

import jsonschema
import pytest
from openai.types.responses import response_create_params

from coordinator.server.responses_api import FIELDS, NEUTRAL
from tests.integration.clients.cluster import HI, WEATHER, client, post

pytestmark = pytest.mark.slow

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
SAMPLES = {  # a value for each field that is not its neutral one
    "model": "tiny", "input": "hello", "instructions": "Be brief.", "max_output_tokens": 3,
    "temperature": 0.5, "top_p": 0.9, "tools": [TOOL], "tool_choice": "auto",
    "parallel_tool_calls": False, "stream_options": {"include_obfuscation": False},
    "store": False, "metadata": {"k": "v"}, "text": {"format": {"type": "json_object"}},
    "reasoning": {"effort": "low"}, "user": "u", "safety_identifier": "s",
    "prompt_cache_key": "k", "top_logprobs": 2, "include": ["reasoning.encrypted_content"],
    "truncation": "auto", "background": True, "background_options": {},
    "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "max_tool_calls": 2,
    "service_tier": "flex", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"}, "context_management": [{"type": "x"}],
    "moderation": {"model": "m"}, "access_programs": ["x"], "image": {"size": "auto"},
    "speculative": False,  # Shoal's own
    "previous_response_id": None,  # test_previous_response_id_continues_the_conversation
}


def test_the_sweep_knows_every_field_of_the_installed_schema():
    fields = typing.get_type_hints(response_create_params.ResponseCreateParamsBase)
    assert set(fields) - {"stream"} <= set(FIELDS), set(fields) - set(FIELDS)
    assert set(FIELDS) - {"stream"} <= set(SAMPLES)


def test_every_responses_field_is_honoured_or_refused_with_a_400_naming_it(server):
    base = {"model": "tiny", "input": "hello", "max_output_tokens": 3, "temperature": 0}
    plain = post(server, "/v1/responses", base)
    assert plain.status_code == 200, plain.text
    for name, status in FIELDS.items():
        if SAMPLES.get(name) is None:
            continue
        reply = post(server, "/v1/responses", {**base, name: SAMPLES[name]})
        if status in ("yes", "ignored"):
            assert reply.status_code == 200, (name, reply.text)
            if status == "ignored":
                assert reply.json()["output"] == plain.json()["output"] or (
                    _text(reply.json()) == _text(plain.json())), name
        else:
            assert reply.status_code == 400, (name, reply.text)
            assert f"'{name}'" in reply.json()["error"]["message"], name
    for name, values in NEUTRAL.items():
        for value in values:
            reply = post(server, "/v1/responses", {**base, name: value})
            assert reply.status_code == 200, (name, value, reply.text)
            assert _text(reply.json()) == _text(plain.json()), (name, value)
    for bad, named in (({"input": [{"type": "input_image"}]}, "input[0].type"),
                       ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                       ({"previous_response_id": "resp_none"}, "previous_response_id")):
        reply = post(server, "/v1/responses", {**base, **bad})
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], bad


def _text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_response_is_the_chat_answer_and_its_stream_the_same_text(server):
    c = client(server)
    chat = c.chat.completions.create(model="tiny", messages=HI, max_tokens=10, temperature=0)
    whole = c.responses.create(model="tiny", input=HI[0]["content"], max_output_tokens=10,
                               temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status in ("completed", "incomplete") and whole.id.startswith("resp_")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    kinds, text, done = [], "", None
    for event in c.responses.create(model="tiny", input=HI[0]["content"],
                                    max_output_tokens=10, temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert text == whole.output_text == done.output_text


def test_a_forced_function_call_comes_back_as_a_function_call_item_streamed_or_not(server):
    c = client(server)
    kwargs = {"model": "tiny", "input": HI[0]["content"], "max_output_tokens": 120,
              "temperature": 0, "tools": [TOOL],
              "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = c.responses.create(**kwargs)
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    streamed = [e for e in c.responses.create(**kwargs, stream=True)]
    [done] = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == call.arguments

    # the call's result goes back as a function_call_output item
    again = c.responses.create(model="tiny", max_output_tokens=5, temperature=0, tools=[TOOL],
                               input=[{"role": "user", "content": HI[0]["content"]},
                                      {"type": "function_call", "call_id": call.call_id,
                                       "name": call.name, "arguments": call.arguments},
                                      {"type": "function_call_output", "call_id": call.call_id,
                                       "output": "sunny"}])
    assert again.status in ("completed", "incomplete")


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first = c.responses.create(model="tiny", input="Name a colour.", max_output_tokens=8,
                               temperature=0, instructions="Answer in one word.")
    second = c.responses.create(model="tiny", input="And another one?", max_output_tokens=8,
                                temperature=0, previous_response_id=first.id)
    chat = c.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
