"""Tool calling as mlx-lm does it, for every API `shoal serve` speaks: tools rendered by the
model's own chat template, its tool-call syntax read back by mlx-lm's parser for that template;
pure data and functions (the APIs' shapes are in their own modules)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper

from coordinator.server.grammars import tool_call_grammar
from engine.errors import InvalidInput

JSON_TOOLS_PARSER = "mlx_lm.tool_parsers.json_tools"  # the syntax a forced call is held to


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict  # as the parser read them

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Piece:
    """A piece of an answer as the APIs show it: text, and the tool calls completed in it."""

    text: str = ""
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolUse:
    """What a request asks of tools, validated: the tools in OpenAI's shape ({"type":
    "function", "function": {"name", "description", "parameters"}}), and the choice."""

    tools: tuple[dict, ...] = ()
    choice: str = "auto"  # "auto", "none", "required", or "function"
    name: str | None = None  # the function a "function" choice names
    parallel: bool = True

    @property
    def rendered(self) -> list[dict] | None:
        """The tools for the chat template (none when the choice is "none")."""
        return list(self.tools) if self.tools and self.choice != "none" else None


def check_function(function: object, where: str) -> dict:
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not (
        function["name"]
    ):
        raise InvalidInput(f"{where} must be an object with a non-empty string 'name'")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidInput(f"{where}.parameters must be a JSON Schema object")
    return function


def tool_use(tools: object, choice: object, parallel: object) -> ToolUse:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, validated."""
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise InvalidInput("'tool_choice' needs 'tools'")
        return ToolUse()
    if not isinstance(tools, list):
        raise InvalidInput("'tools' must be a list of {type: function, function: {...}}")
    checked = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidInput(f"tools[{i}]: only {{\"type\": \"function\"}} tools are "
                               "supported")
        check_function(tool.get("function"), f"tools[{i}].function")
        checked.append({"type": "function", "function": tool["function"]})
    names = [t["function"]["name"] for t in checked]
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInput("'parallel_tool_calls' must be true or false")
    parallel = True if parallel is None else parallel
    if choice is None or choice in ("auto", "none", "required"):
        return ToolUse(tuple(checked), choice or "auto", None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("function"), dict
    ):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidInput(f"'tool_choice' names {json.dumps(name)}, which is not in "
                               f"'tools' ({', '.join(names)})")
        return ToolUse(tuple(checked), "function", name, parallel)
    raise InvalidInput("'tool_choice' must be none, auto, required, or "
                       '{"type": "function", "function": {"name": ...}}')


def check_model_tools(tokenizer: TokenizerWrapper, use: ToolUse) -> None:
    """Refuse tools a model cannot take: its chat template has no tool-call syntax mlx-lm
    knows, or a forced call where the syntax is not the JSON one it can be held to."""
    if use.rendered is None:
        return
    if not tokenizer.has_tool_calling:
        raise InvalidInput("this model's chat template has no tool calling (mlx-lm finds "
                           "no tool-call syntax in it): leave 'tools' out")
    if use.choice in ("required", "function") and (
        tokenizer.tool_parser.__module__ != JSON_TOOLS_PARSER
    ):
        raise InvalidInput(f"'tool_choice' {use.choice}: a call can be forced only for "
                           "models whose tool calls are JSON (<tool_call>{...}</tool_call>); "
                           "use 'auto'")


def forced_call_grammar(tokenizer: TokenizerWrapper, use: ToolUse) -> str | None:
    """The grammar that holds the answer to tool calls, for "required" and a named function
    (None otherwise)."""
    if use.rendered is None or use.choice not in ("required", "function"):
        return None
    return tool_call_grammar(list(use.tools), use.name, start=tokenizer.tool_call_start,
                             end=tokenizer.tool_call_end,
                             several=use.choice == "required" and use.parallel)


def extra_stops(tokenizer: TokenizerWrapper, use: ToolUse) -> tuple[str, ...]:
    """With `parallel_tool_calls: false`, the answer ends where its first call does."""
    if use.rendered is not None and not use.parallel and tokenizer.tool_call_end:
        return (tokenizer.tool_call_end,)
    return ()


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: an assistant's tool-call arguments as objects
    (the API sends them as JSON text), as mlx-lm's server passes them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                for c in calls]}
        out.append(message)
    return out


def _arguments(function: dict) -> object:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidInput(f"the arguments of the call to {function.get('name')!r} are "
                               "not valid JSON") from None
    return arguments if arguments is not None else {}


class CallReader:
    """Splits an answer's text, as it streams, into text and tool calls, with mlx-lm's
    TextStateMachine on the template's call markers; each call is read by mlx-lm's parser
    when its end marker (or the answer's end) arrives. A call the parser cannot read comes
    back as text, markers included, rather than being lost."""

    def __init__(self, tokenizer: TokenizerWrapper, use: ToolUse) -> None:
        self.active = use.rendered is not None and tokenizer.has_tool_calling
        self._call_text = ""
        self.made_calls = 0
        if not self.active:
            return
        self._parser = tokenizer.tool_parser
        self._start, self._end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self._tools = list(use.tools)
        transitions = {"normal": [(self._start, "tool")],
                       "tool": [(self._end, "normal")] if self._end else []}
        self._state = TextStateMachine(transitions).make_state("normal")

    def feed(self, text: str, *, last: bool) -> Piece:
        """The piece for `text`, the next text of the answer; `last` when the answer ended."""
        if not self.active:
            return Piece(text)
        self._state, segments = TextStateMachine.split(self._state, text)
        out: list[str] = []
        calls: list[ToolCall] = []
        previous = None
        for state, part in segments:
            if previous == "tool" and state != "tool":  # the call's end marker was read
                self._close(calls, out, ended=True)
            if state == "tool":
                self._call_text += part
            else:
                out.append(part)
            previous = state
        if last:
            self._state, rest, state = TextStateMachine.flush(self._state)
            if state == "tool":
                self._call_text += rest
                self._close(calls, out, ended=False)
            else:
                out.append(rest)
        return Piece("".join(out), tuple(calls))

    def _close(self, calls: list[ToolCall], out: list[str], *, ended: bool) -> None:
        """The call whose text was gathered, read; as text (what was generated) if the
        parser cannot read it or its arguments are not a JSON object."""
        text, self._call_text = self._call_text, ""
        try:
            parsed = self._parser(text, self._tools)
            read = [_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, KeyError, TypeError, AttributeError):  # JSONDecodeError too
            out.append(self._start + text + (self._end if ended else ""))
            return
        calls.extend(read)
        self.made_calls += len(read)


def _call(parsed: dict) -> ToolCall:
    """One call as mlx-lm's parser gives it ({"name", "arguments"[, "id"]})."""
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a call's arguments must be an object")
    return ToolCall(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}", str(parsed["name"]),
                    arguments)
