"""Constrained decoding with llguidance: the grammars `response_format` and a forced tool call
ask for, and the logits processor that holds a request to its grammar; a request without one
gets no processor, and an allowed logit is kept bit for bit."""

from __future__ import annotations

import json
import threading

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.errors import InvalidInput, ShoalError

# Compact JSON: the answer cannot pad itself with whitespace forever.
JSON_OPTIONS: dict = {"whitespace_flexible": False, "item_separator": ", ",
                      "key_separator": ": "}


def checked(grammar: str, what: str) -> str:
    """`grammar` if llguidance can compile it, else InvalidInput naming `what`."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidInput(f"{what}: {error}")
    return grammar


# Bounds for numbers a schema leaves open, so a model that keeps emitting digits is stopped
# by the grammar (the number must end) instead of running to max_tokens with broken JSON:
# integers within I-JSON's exact range (RFC 7493), other numbers within it and to 9 decimals.
LARGEST = 2**53 - 1
NUMBER_STEP = 1e-9
_LITERALS = ("const", "enum", "default", "examples")  # values, not schemas: left alone


def bounded(schema: object) -> object:
    """`schema` with every integer and number given the bounds above where it has none of
    its own; everything else as it was."""
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _LITERALS else bounded(value) for key, value in schema.items()}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -LARGEST
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = LARGEST
        if kind == "number" and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


def json_schema_grammar(schema: dict, what: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(bounded(schema),
                                                                overrides=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidInput(f"{what}: {e}") from None
    return checked(grammar, what)


def response_format_grammar(response_format: object) -> str | None:
    """The grammar for an OpenAI `response_format` (None for plain text); InvalidInput for a
    malformed one or a schema the engine cannot compile."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidInput("'response_format' must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidInput("'response_format.json_schema' must be an object with a "
                               "'schema' object")
        return json_schema_grammar(spec.get("schema", {}), "response_format.json_schema")
    raise InvalidInput(f"'response_format.type' must be text, json_object or json_schema, "
                       f"got {json.dumps(kind)}")


def tool_call_grammar(tools: list[dict], name: str | None, *, start: str, end: str,
                      several: bool) -> str:
    """A grammar for tool calls in the JSON syntax that mlx-lm's json_tools parser reads
    (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Hermes and Qwen):
    one call of the tool `name`, or (name None) one call, or several if `several`, of any
    tool in `tools` (OpenAI's {"type": "function", "function": {...}} entries), each call's
    arguments held to its tool's parameter schema."""
    calls = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        calls.append({"type": "object", "additionalProperties": False,
                      "required": ["name", "arguments"],
                      "properties": {"name": {"const": function["name"]},
                                     "arguments": bounded(function.get("parameters")
                                                          or {"type": "object"})}})
    call = json.dumps({"anyOf": calls} if len(calls) > 1 else calls[0])
    options = json.dumps(JSON_OPTIONS)
    repeat = ' ("\\n" block)*' if several else ""
    lark = (f"%llguidance {{}}\nstart: block{repeat}\n"
            f"block: {json.dumps(start + chr(10))} call {json.dumps(chr(10) + end)}\n"
            f'call: %json {{"x-guidance": {options}, {call[1:]}\n')
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


class Grammars:
    """The tokenizer as llguidance sees it and a processor per constrained request. The
    tokenizer's view takes a while for a large vocabulary (docs/serving.md), so it is built
    on a thread of its own from the start, not by the first constrained request (which
    would hold up the whole batch meanwhile)."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._error: Exception | None = None
        self._built = threading.Event()
        threading.Thread(target=self._build, name="shoal grammars", daemon=True).start()

    def _build(self) -> None:
        try:
            self._ll = llguidance.hf.from_tokenizer(
                self._tokenizer._tokenizer, eos_token=sorted(self._tokenizer.eos_token_ids))
        except Exception as e:  # noqa: BLE001 (said to the first request that needs it)
            self._error = e
        self._built.set()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        self._built.wait()
        if self._ll is None:
            raise ShoalError(f"constrained decoding is not available for this tokenizer: "
                             f"{self._error}")
        return self._ll

    def processor(self, grammar: str) -> GrammarProcessor:
        return GrammarProcessor(llguidance.LLMatcher(self._ll_tokenizer(), grammar),
                                sorted(self._tokenizer.eos_token_ids))


class GrammarProcessor:
    """An mlx-lm logits processor: each call first feeds the matcher the token sampled at
    the step before (none at the first step, whose input is the prompt's last token), then
    masks every token the grammar does not allow next."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: list[int]) -> None:
        self.matcher = matcher
        self.eos = eos
        self._started = False

    def allowed(self, width: int) -> np.ndarray:
        """The tokens allowed next, as a bool per logit (ids past the tokenizer's: never). A
        matcher in error (it cannot be, for tokens it allowed) allows only the end."""
        allowed = np.zeros(width, dtype=bool)
        if self.matcher.is_error():
            allowed[self.eos] = True
            return allowed
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)
        n = min(width, bits.size)
        allowed[:n] = bits[:n]
        return allowed

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            self.matcher.consume_token(int(tokens[-1].item()))
        self._started = True
        mask = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
