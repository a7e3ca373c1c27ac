"""The official `anthropic` client on the Messages API of `shoal serve`: every field honoured
or refused with a 400 naming it, the same answer as the OpenAI chat, tools, stop sequences."""

import json
import typing

import anthropic
import jsonschema
import pytest
from anthropic.types import message_create_params as message_params

from coordinator.server.anthropic_api import FIELDS as ANTHROPIC_FIELDS
from coordinator.server.anthropic_api import NEUTRAL as ANTHROPIC_NEUTRAL
from tests.integration.clients.cluster import HI, KEY, PERSON, WEATHER, client, post

pytestmark = pytest.mark.slow


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


