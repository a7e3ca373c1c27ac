"""Prompt caches in files, as mlx-lm keeps them (`mlx_lm.cache_prompt` writes one, `mlx_lm.generate
--prompt-cache-file` continues from it): the KV cache of a long prompt computed once, then each
question asked after it computes only itself. The files are mlx-lm's own (its
save_prompt_cache and load_prompt_cache), so a file made by mlx-lm on the checkpoint a Shoal
model was sharded from works here, and the other way round: the cache holds attention's keys
and values, which the dense part computes the same way in both."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.errors import InvalidInput, NotFound, ShoalError

QUERY = "<query>"  # mlx-lm's placeholder for where the question goes in the template


def cached_prompt(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    """The tokens mlx_lm.cache_prompt caches for `text`: a user message left open (the
    question will follow it) through the chat template, or the plain text without one."""
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=False,
            continue_final_message=True))
    return list(tokenizer.encode(text))


def question_tokens(tokenizer: TokenizerWrapper, text: str, *, chat: bool) -> list[int]:
    """The tokens of a question asked after a cached prompt, as mlx_lm.generate builds them:
    with the chat template, the part of the templated message from where the message's text
    begins (the cached prompt ends inside that message), special tokens not added again."""
    if not chat:
        return list(tokenizer.encode(text))
    messages = [{"role": "user", "content": text}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marked = tokenizer.apply_chat_template([{"role": "user", "content": QUERY}],
                                           tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(whole[marked.index(QUERY):], add_special_tokens=False))


def save(path: Path, model: nn.Module, prompt: list[int], model_name: str,
         **kv_cache: int) -> int:
    """Compute `prompt`'s KV cache with `model` and write it to `path` in mlx-lm's format
    (its metadata names the model); returns the tokens cached. `kv_cache` takes mlx-lm's
    KV-cache quantization, as cache_prompt does."""
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache,
                           **kv_cache):
        pass
    mx.eval([c.state for c in cache])
    try:
        save_prompt_cache(str(path), cache, {"model": model_name,
                                             "tokenizer_config": json.dumps({})})
    except OSError as e:
        raise ShoalError(f"cannot write the prompt cache {path}: {e.strerror}") from None
    return len(prompt)


def load(path: Path, model: nn.Module) -> list:
    """The prompt cache in `path`, checked to have one entry per layer of `model`."""
    if not Path(path).is_file():
        raise NotFound(f"no prompt cache file at {path} (make one with `shoal cache-prompt`)")
    try:
        cache = load_prompt_cache(str(path))
    except (ValueError, RuntimeError, KeyError) as e:
        raise InvalidInput(f"{path} is not a prompt cache mlx-lm can read: {e}") from None
    layers = len(make_prompt_cache(model))
    if len(cache) != layers:
        raise InvalidInput(f"{path} holds a cache of {len(cache)} layers; this model has "
                           f"{layers}: it was made for another model")
    return cache
