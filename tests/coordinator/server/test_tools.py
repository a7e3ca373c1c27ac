"""Tool calling's pure parts: the request fields validated, the answer's text split into text
and calls with mlx-lm's parser, and the refusals for models whose template cannot take tools."""

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from coordinator.server.openai_api import parse_request
from coordinator.server.prompts import longest_token, prepare
from coordinator.server.tools import CallReader, ToolUse, template_messages, tool_use
from engine.errors import InvalidInput

TEMPLATE = Path(__file__).parents[2] / "integration" / "tool_template.jinja"
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


def bind(tokenizer, request):
    return prepare(tokenizer, request, 300, context=4096, longest=longest_token(tokenizer))


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("qwen3_moe"))


@pytest.fixture(scope="module")
def tooled(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tooled") / "model"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


def test_calls_are_read_across_chunk_boundaries_and_text_around_them_kept(tooled):
    reader = CallReader(tooled, tool_use([F], None, None))
    answer = ('hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
              '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>bye')
    pieces = [reader.feed(answer[i:i + 3], last=i + 3 >= len(answer))
              for i in range(0, len(answer), 3)]
    assert "".join(p.text for p in pieces) == "hi \nbye"
    calls = [c for p in pieces for c in p.calls]
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": 1}), ("f", {})]
    assert len({c.id for c in calls}) == 2 and reader.made_calls == 2


def test_a_call_cut_short_comes_back_as_text_not_lost(tooled):
    reader = CallReader(tooled, tool_use([F], None, None))
    piece = reader.feed('<tool_call>\n{"name": "f", "argu', last=True)
    assert piece.calls == () and piece.text == '<tool_call>\n{"name": "f", "argu'


def test_a_call_whose_arguments_are_not_an_object_comes_back_as_text(tooled):
    reader = CallReader(tooled, tool_use([F], None, None))
    text = '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'
    piece = reader.feed(text, last=True)
    assert piece.calls == () and piece.text == text and reader.made_calls == 0


def test_without_tools_the_text_is_left_alone(tooled):
    text = '<tool_call>{"name": "f"}</tool_call>'
    assert CallReader(tooled, ToolUse()).feed(text, last=True).text == text
    none = tool_use([F], "none", None)
    assert none.rendered is None and CallReader(tooled, none).feed(text, last=True).text == text


def test_a_template_without_tool_calling_refuses_tools(plain, tooled):
    request = parse_request({"messages": HI, "tools": [F]}, chat=True)
    with pytest.raises(InvalidInput, match="no tool calling"):
        bind(plain, request)
    bound, prompt = bind(tooled, request)
    assert len(prompt) > len(bind(tooled, parse_request({"messages": HI}, chat=True))[1])
    assert bound.sampling.grammar is None  # "auto": nothing forced


def test_a_forced_call_gets_a_grammar_and_a_single_call_a_stop(tooled):
    forced = parse_request({"messages": HI, "tools": [F], "tool_choice": "required",
                            "parallel_tool_calls": False}, chat=True)
    bound, _ = bind(tooled, forced)
    assert bound.sampling.grammar is not None and bound.sampling.stop == ("</tool_call>",)


def test_reasoning_effort_needs_a_template_that_takes_it(plain, tooled):
    request = parse_request({"messages": HI, "reasoning_effort": "low"}, chat=True)
    with pytest.raises(InvalidInput, match="does not reason"):
        bind(plain, request)
    thinking = parse_request({"messages": HI, "chat_template_kwargs": {
        "enable_thinking": True}}, chat=True)
    with pytest.raises(InvalidInput, match="does not reason"):
        bind(plain, thinking)
    no_thinking = parse_request({"messages": HI, "chat_template_kwargs": {
        "enable_thinking": False}}, chat=True)
    assert bind(plain, no_thinking)[1]  # nothing to turn off: fine
    assert bind(tooled, request)[1] != bind(
        tooled, parse_request({"messages": HI}, chat=True))[1]


@pytest.mark.parametrize("tools,choice,message", [
    ("f", None, "'tools' must be a list"),
    ([{"type": "web_search"}], None, "only {\"type\": \"function\"}"),
    ([{"type": "function", "function": {}}], None, "non-empty string 'name'"),
    ([F], "sometimes", "'tool_choice' must be"),
    ([F], {"type": "function", "function": {"name": "g"}}, "not in 'tools'"),
])
def test_bad_tools_say_what_is_wrong(tools, choice, message):
    with pytest.raises(InvalidInput, match=message):
        tool_use(tools, choice, None)


def test_an_assistants_call_arguments_reach_the_template_as_objects():
    calls = [{"id": "1", "type": "function", "function": {"name": "f",
                                                         "arguments": '{"a": 1}'}}]
    [message] = template_messages([{"role": "assistant", "content": "", "tool_calls": calls}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(InvalidInput, match="not valid JSON"):
        template_messages([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])
