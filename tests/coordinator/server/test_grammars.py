"""Constrained decoding: the grammars of response_format and forced tool calls, and the
logits processor that holds a row to one, over the tiny checkpoint's tokenizer."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from coordinator.server.grammars import Grammars, response_format_grammar, tool_call_grammar
from engine.errors import InvalidInput

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def grammars(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint("qwen3_moe"))
    return Grammars(tokenizer), tokenizer


def walk(grammars, grammar: str, seed: int, steps: int = 300) -> str:
    """Random allowed tokens through the processor, as decoding would pick them."""
    g, tokenizer = grammars
    processor = g.processor(grammar)
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(size=(1, 300)).astype(np.float32))
    out: list[int] = []
    context = [0]
    for _ in range(steps):
        masked = processor(mx.array(context), logits + mx.array(rng.normal(size=(1, 300)),
                                                                 dtype=mx.float32))
        token = int(mx.argmax(masked, axis=-1).item())
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(out)
        out.append(token)
        context.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_every_answer_under_a_schema_validates(grammars, seed):
    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": PERSON}})
    jsonschema.validate(json.loads(walk(grammars, grammar, seed)), PERSON)


def test_a_forced_call_is_one_call_of_the_named_tool(grammars):
    tools = [{"type": "function", "function": {"name": "f", "parameters": PERSON}},
             {"type": "function", "function": {"name": "g"}}]
    text = walk(grammars, tool_call_grammar(tools, "f", start="<tool_call>",
                                            end="</tool_call>", several=False), 1)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "f"
    jsonschema.validate(call["arguments"], PERSON)


def test_allowed_logits_keep_their_bits(grammars):
    g, _ = grammars
    processor = g.processor(response_format_grammar({"type": "json_object"}))
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 300)).astype(np.float32))
    masked = processor(mx.array([1]), logits)
    allowed = np.isfinite(np.array(masked))
    assert 0 < allowed.sum() < 300  # "{" (and nothing else) may start an object
    assert np.array_equal(np.array(masked)[allowed], np.array(logits)[allowed])


@pytest.mark.parametrize("fmt,message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "must be text, json_object or json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "nope"),
    ({"type": "json_schema", "json_schema": "x"}, "'schema' object"),
])
def test_bad_formats_are_refused(fmt, message):
    with pytest.raises(InvalidInput, match=message):
        response_format_grammar(fmt)
    assert response_format_grammar({"type": "text"}) is None


def digits_first(grammars, grammar: str, steps: int = 400) -> str:
    """A model that writes a digit whenever the grammar lets it (the worst case for an
    unbounded number), else the lowest allowed token."""
    g, tokenizer = grammars
    processor = g.processor(grammar)
    vocab = len(tokenizer.get_vocab())
    digits = [i for i in range(vocab) if tokenizer.decode([i]).isdigit()]
    assert digits
    logits = mx.array(np.where(np.isin(np.arange(vocab), digits), 1.0, 0.0)[None],
                      dtype=mx.float32)
    out: list[int] = []
    for _ in range(steps):
        token = int(mx.argmax(processor(mx.array([0, *out]), logits), axis=-1).item())
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tokenizer.decode(out)[:200]!r}")


def test_numbers_a_schema_leaves_unbounded_end_and_the_answer_is_valid_json(grammars):
    schema = {"type": "object", "additionalProperties": False, "required": ["x", "n", "at"],
              "properties": {"x": {"type": "number"}, "n": {"type": "integer"},
                             "at": {"type": "array", "minItems": 1, "maxItems": 2,
                                    "items": {"type": "number", "minimum": 0}}}}
    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": schema}})
    answer = json.loads(digits_first(grammars, grammar))
    jsonschema.validate(answer, schema)
    assert abs(answer["n"]) <= 2**53 - 1 and abs(answer["x"]) <= 2**53 - 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    call = digits_first(grammars, tool_call_grammar(tools, "f", start="<tool_call>",
                                                    end="</tool_call>", several=False))
    jsonschema.validate(json.loads(call.split("\n")[1])["arguments"], schema)


def test_a_schemas_own_bounds_and_literal_values_are_kept():
    from coordinator.server.grammars import bounded

    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 3, "exclusiveMaximum": 9},
        "b": {"const": {"type": "integer"}}, "c": {"enum": [{"type": "number"}]}}}
    out = bounded(schema)["properties"]
    assert out["a"] == {"type": "integer", "minimum": 3, "exclusiveMaximum": 9}
    assert out["b"] == {"const": {"type": "integer"}} and out["c"] == schema["properties"]["c"]
