"""A validated request bound to the model: its prompt's token ids, built with the chat
template as mlx-lm builds it (tools, reasoning effort), refused when it cannot fit."""

from __future__ import annotations

from dataclasses import replace

from mlx_lm.tokenizer_utils import TokenizerWrapper

from coordinator.decoding.generate import encode_text
from coordinator.server.openai_api import CompletionRequest
from coordinator.server.tools import (
    check_model_tools,
    extra_stops,
    forced_call_grammar,
    template_messages,
)
from engine.errors import InvalidInput


def longest_token(tokenizer: TokenizerWrapper) -> int:
    """The most UTF-8 bytes one token's text in the vocabulary takes. A byte-level or
    SentencePiece vocabulary spells a token with at least as many bytes as it stands for, so
    no token covers more of a prompt than this."""
    return max((len(text.encode("utf-8", "replace")) for text in tokenizer.get_vocab()),
               default=1)


def template_kwargs(tokenizer: TokenizerWrapper, request: CompletionRequest) -> dict:
    """The chat template's keyword arguments: `chat_template_kwargs` as given, and the
    reasoning effort as the template can take it (a thinking model's enable_thinking, or a
    template that reads `reasoning_effort` itself); refused where it can take neither."""
    kwargs = dict(request.template_kwargs)
    template = tokenizer.chat_template or ""
    if kwargs.get("enable_thinking") and not tokenizer.has_thinking and (
        "enable_thinking" not in template
    ):
        raise InvalidInput("thinking was asked for, and this model does not reason (its chat "
                           "template has no thinking switch)")
    effort = request.reasoning_effort
    if effort is not None:
        reads_effort = "reasoning_effort" in template
        if not tokenizer.has_thinking and not reads_effort:
            raise InvalidInput("'reasoning_effort': this model does not reason (its chat "
                               "template has no thinking switch): leave it out")
        if tokenizer.has_thinking:
            kwargs.setdefault("enable_thinking", effort != "none")
        if reads_effort:
            kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def check_prompt_size(text: str, *, context: int, longest: int) -> None:
    """Refuse a text that cannot fit the `context` whatever its tokens (at most `longest`
    bytes each), before it is tokenized, which for a text of megabytes takes seconds."""
    size = len(text.encode("utf-8"))
    fewest = -(-size // max(longest, 1))
    if fewest >= context:
        raise InvalidInput(f"the prompt has at least {fewest} tokens ({size} bytes); this "
                           f"model's context holds {context}, the prompt and the answer "
                           "together")


def prepare(tokenizer: TokenizerWrapper, request: CompletionRequest, vocab: int, *,
            context: int, longest: int) -> tuple[CompletionRequest, list[int]]:
    """The request bound to this model: its prompt as token ids (the chat template applied
    as mlx-lm applies it, with the tools), a forced tool call's grammar and a single call's
    stop; token ids given (prompt, logit_bias) must be below the model's `vocab` size, and a
    prompt's text is refused before it is tokenized when it cannot fit the `context`
    (check_prompt_size)."""
    for token, _ in request.sampling.logit_bias:
        if token >= vocab:
            raise InvalidInput(f"'logit_bias': token id {token} is outside the vocabulary "
                               f"({vocab} tokens)")
    if not request.chat:
        if isinstance(request.prompt, tuple):
            if max(request.prompt) >= vocab:
                raise InvalidInput(f"token id {max(request.prompt)} is outside the "
                                   f"vocabulary ({vocab} tokens)")
            return request, list(request.prompt)
        check_prompt_size(request.prompt, context=context, longest=longest)
        return request, encode_text(tokenizer, request.prompt)
    check_model_tools(tokenizer, request.tools)
    if tokenizer.chat_template is None:
        raise InvalidInput("this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            template_messages(list(request.messages)), tools=request.tools.rendered,
            tokenize=False, add_generation_prompt=True, **template_kwargs(tokenizer, request))
    except InvalidInput:
        raise
    except Exception as e:  # the template itself refused (e.g. roles out of order)
        raise InvalidInput(f"the chat template refused these messages: {e}") from None
    sampling = request.sampling
    grammar = forced_call_grammar(tokenizer, request.tools)
    if grammar is not None:
        sampling = replace(sampling, grammar=grammar)
    sampling = replace(sampling, stop=sampling.stop + extra_stops(tokenizer, request.tools))
    check_prompt_size(text, context=context, longest=longest)
    return replace(request, sampling=sampling), encode_text(tokenizer, text)
