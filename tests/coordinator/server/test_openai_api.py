"""`shoal serve`'s pure parts: request validation, the context check, the answers' shapes,
stop strings."""

from dataclasses import replace

import pytest

from coordinator.server.answer_text import Event, TokenLogprob, Usage, split_at_stop
from coordinator.server.openai_answers import (
    Chunks,
    answer_meta,
    completion_json,
    usage_chunk_json,
)
from coordinator.server.openai_api import DEFAULT_MAX_TOKENS, NEUTRAL, fit_to_context, parse_request
from engine.errors import InvalidInput

HI = [{"role": "user", "content": "hi"}]


def test_a_chat_request_takes_the_apis_fields():
    r = parse_request({"model": "x", "messages": HI, "max_tokens": 5, "temperature": 0,
                       "top_p": 0.5, "seed": 3, "stop": "\n", "logprobs": True,
                       "top_logprobs": 2, "stream": True,
                       "stream_options": {"include_usage": True}, "user": "ignored"},
                      chat=True)
    assert r.chat and r.messages == ({"role": "user", "content": "hi"},)
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.top_logprobs) == (
        5, 0.0, 0.5, 3, ("\n",), 2)
    assert r.stream and r.include_usage and r.max_tokens_given


def test_defaults_are_the_apis():
    r = parse_request({"messages": HI}, chat=True)
    assert r.sampling.temperature == 1.0 and r.sampling.top_logprobs is None
    assert r.sampling.max_tokens == DEFAULT_MAX_TOKENS and not r.max_tokens_given
    assert parse_request({"messages": HI, "max_completion_tokens": 7},
                         chat=True).sampling.max_tokens == 7


def test_text_parts_and_prompts_of_token_ids():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = parse_request({"messages": [{"role": "user", "content": parts}]}, chat=True)
    assert r.messages[0]["content"] == "ab"
    assert parse_request({"prompt": [1, 2, 3]}, chat=False).prompt == (1, 2, 3)
    assert parse_request({"prompt": ["one"], "logprobs": 0}, chat=False).prompt == "one"


@pytest.mark.parametrize("body,chat,message", [
    ([], True, "JSON object"),
    ({"messages": []}, True, "non-empty list"),
    ({"messages": [{"content": "hi"}]}, True, "string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "text parts"),
    ({"messages": HI, "max_tokens": 0}, True, "at least 1"),
    ({"messages": HI, "max_tokens": True}, True, "an integer"),
    ({"messages": HI, "max_tokens": 2.5}, True, "an integer"),
    ({"messages": HI, "temperature": 3}, True, "between 0 and 2"),
    ({"messages": HI, "top_p": 0}, True, "above 0"),
    ({"messages": HI, "seed": "s"}, True, "an integer"),
    ({"messages": HI, "stop": ["a", ""]}, True, "non-empty"),
    ({"messages": HI, "stop": ["a"] * 5}, True, "at most 4"),
    ({"messages": HI, "top_logprobs": 2}, True, "needs 'logprobs'"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 50}, True, "between 0 and 20"),
    ({"messages": HI, "presence_penalty": 5}, True, "between -2 and 2"),
    ({"messages": HI, "logit_bias": {"x": 1}}, True, "'logit_bias'"),
    ({"messages": HI, "logit_bias": {"3": 101}}, True, "-100 to 100"),
    ({"messages": HI, "top_k": -1}, True, "'top_k' must be at least 0"),
    ({"messages": HI, "min_p": 1.5}, True, "'min_p' must be between 0 and 1"),
    ({"messages": HI, "functions": []}, True, "'functions'"),
    ({"messages": HI, "audio": {"voice": "x"}}, True, "audio"),
    ({"messages": HI, "store": True}, True, "'store'"),
    ({"messages": HI, "store": 0}, True, "'store'"),  # JSON's false only, not 0
    ({"messages": HI, "service_tier": "priority"}, True, "'service_tier'"),
    ({"messages": HI, "prompt_cache_retention": "24h"}, True, "'prompt_cache_retention'"),
    ({"messages": HI, "prompt_cache_options": {"mode": "explicit"}}, True,
     "'prompt_cache_options'"),
    ({"messages": HI, "prediction": {"type": "content", "content": "x"}}, True, "'prediction'"),
    ({"messages": HI, "modalities": ["text", "audio"]}, True, "'modalities'"),
    ({"messages": HI, "frobnicate": 1}, True, "unknown field 'frobnicate'"),
    ({"messages": HI, "reasoning_effort": "huge"}, True, "'reasoning_effort'"),
    ({"messages": HI, "response_format": {"type": "yaml"}}, True, "'response_format.type'"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, True, "json_schema"),
    ({"messages": HI, "tool_choice": "required"}, True, "needs 'tools'"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, True, "not in"),
    ({"messages": [{"role": "tool", "content": "4"}]}, True, "'tool_call_id'"),
    ({"prompt": "x", "suffix": "y"}, False, "'suffix'"),
    ({"prompt": "x", "tools": []}, False, "unknown field 'tools'"),
    ({"messages": HI, "stream_options": {"include_usage": "yes"}}, True, "true or false"),
    ({"messages": HI, "model": 3}, True, "a string"),
    ({"prompt": 3}, False, "'prompt'"),
    ({"prompt": [1, -2]}, False, "'prompt'"),
    ({"prompt": "x", "best_of": 2}, False, "'best_of' must be 1"),
    ({"prompt": "x", "logprobs": True}, False, "an integer"),
])
def test_bad_requests_say_which_field(body, chat, message):
    with pytest.raises(InvalidInput, match=message):
        parse_request(body, chat=chat)


def test_refused_fields_are_taken_at_their_neutral_values():
    for name, values in NEUTRAL.items():
        for value in values:
            assert parse_request({"messages": HI, name: value}, chat=True).messages == (
                {"role": "user", "content": "hi"},)


def test_the_context_holds_prompt_and_answer():
    given = parse_request({"prompt": "x", "max_tokens": 10}, chat=False)
    assert fit_to_context(given, 90, 100).sampling.max_tokens == 10
    with pytest.raises(InvalidInput, match="does not fit"):
        fit_to_context(given, 91, 100)
    with pytest.raises(InvalidInput, match="the prompt has 100 tokens"):
        fit_to_context(given, 100, 100)
    free = parse_request({"prompt": "x"}, chat=False)  # no max_tokens: what is left
    assert fit_to_context(free, 95, 100).sampling.max_tokens == 5
    smaller = replace(free, context=50)  # a request's own context (Ollama's num_ctx)
    assert fit_to_context(smaller, 45, 100).sampling.max_tokens == 5
    assert fit_to_context(replace(free, context=500), 95, 100).sampling.max_tokens == 5
    with pytest.raises(InvalidInput, match="asks for \\('num_ctx'\\) holds 50"):
        fit_to_context(smaller, 50, 100)


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(97 + t) for t in tokens)


DONE = Event(text="c", logprobs=(TokenLogprob(2, -0.5, ((2, -0.5), (3, -1.5))),),
             finish_reason="stop", usage=Usage(2, 1, 0))


def test_a_whole_chat_answer_has_the_message_logprobs_and_usage():
    request = parse_request({"messages": HI, "logprobs": True, "top_logprobs": 2}, chat=True)
    meta = answer_meta(chat=True, model="m")
    assert meta["id"].startswith("chatcmpl-") and meta["model"] == "m"
    body = completion_json(Letters(), request, [0, 1], [Event(text="ab"), DONE], meta)
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "abc"}
    assert choice["finish_reason"] == "stop"
    [score] = choice["logprobs"]["content"]
    assert score["token"] == "c" and [t["token"] for t in score["top_logprobs"]] == ["c", "d"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 0,
                                                   "cache_tier": None}}


def test_a_whole_text_answer_echoes_the_prompt_when_asked():
    request = parse_request({"prompt": [0, 1], "echo": True, "logprobs": 1}, chat=False)
    body = completion_json(Letters(), request, [0, 1], [DONE], answer_meta(chat=False,
                                                                           model="m"))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {"tokens": ["c"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"c": -0.5, "d": -1.5}]}


def test_streamed_chat_chunks_name_the_role_first_and_usage_last():
    request = parse_request({"messages": HI, "stream": True,
                             "stream_options": {"include_usage": True}}, chat=True)
    meta = answer_meta(chat=True, model="m")
    chunks = Chunks(Letters(), request, meta)
    first = chunks.chunk(Event(text="a"))
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert first["choices"][0]["logprobs"] is None
    last = chunks.chunk(Event(finish_reason="length"))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    usage = usage_chunk_json(request, DONE, meta)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    assert usage["id"] == first["id"] == last["id"]


@pytest.mark.parametrize("pending,stops,expected", [
    ("hello world", ("wor",), ("hello ", "", True)),
    ("hello wo", ("world",), ("hello ", "wo", False)),  # may begin a stop string: held
    ("hello w", ("xyz",), ("hello w", "", False)),
    ("ab\n\nc", ("\n\n", "b"), ("a", "", True)),  # the earliest stop string wins
    ("aaa", ("aab",), ("a", "aa", False)),
    ("", ("x",), ("", "", False)),
    ("text", (), ("text", "", False)),
])
def test_stop_strings_are_never_emitted(pending, stops, expected):
    assert split_at_stop(pending, stops) == expected
