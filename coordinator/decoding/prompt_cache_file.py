"""Prompt caches in files, in mlx-lm's own format (its save_prompt_cache and load_prompt_cache),
so `shoal cache-prompt` files and mlx-lm's serve each other; and the checksummed files that
`shoal serve` keeps of finished requests' prompts."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
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


# Files `shoal serve` keeps (coordinator/server/prompt_cache_tiers.py): each cache file in
# mlx-lm's format has a sidecar, NAME.json, naming its model and tokens and holding the
# file's SHA-256. A crash mid-write, a full disk or a flipped bit then reads as a mismatch.


def file_digest(path: Path) -> tuple[str, int]:
    """(SHA-256 hex, size in bytes) of the file at `path`, read in pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 22):
            digest.update(piece)
            size += len(piece)
    return digest.hexdigest(), size


def write_checked(path: Path, cache: list, meta: dict) -> tuple[int, str]:
    """Write `cache` to `path` (mlx-lm's format) and its sidecar with `meta` and the
    checksum, each under a temporary name renamed into place; returns (size, checksum)."""
    tmp = path.with_name(f".{path.stem}.tmp.safetensors")
    save_prompt_cache(str(tmp), cache, {"model": str(meta.get("model", ""))})
    digest, size = file_digest(tmp)
    os.replace(tmp, path)
    side = path.with_suffix(".json")
    tmp_side = side.with_name(f".{side.name}.tmp")
    tmp_side.write_text(json.dumps({**meta, "sha256": digest, "bytes": size}))
    os.replace(tmp_side, side)
    return size, digest


def read_sidecar(path: Path) -> dict:
    """The sidecar of the cache file at `path`, checked for the fields read_checked needs."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        tokens, digest, size = meta["tokens"], meta["sha256"], meta["bytes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"{path}: its sidecar is missing or unreadable ({e})") from None
    if not (isinstance(tokens, list) and isinstance(digest, str) and isinstance(size, int)):
        raise InvalidInput(f"{path}: its sidecar is not a prompt cache's")
    return meta


def read_checked(path: Path, meta: dict, layers: int) -> list:
    """The cache in `path` if it matches the checksum in `meta` and holds `layers` layers
    of plain KV caches of len(meta["tokens"]) tokens; InvalidInput otherwise."""
    try:
        digest, size = file_digest(path)
    except OSError as e:
        raise InvalidInput(f"{path} cannot be read: {e.strerror}") from None
    if (digest, size) != (meta["sha256"], meta["bytes"]):
        raise InvalidInput(f"{path} does not match its checksum (a torn or corrupt file)")
    try:
        cache = load_prompt_cache(str(path))
    except (ValueError, RuntimeError, KeyError, OSError) as e:
        raise InvalidInput(f"{path} is not a prompt cache mlx-lm can read: {e}") from None
    if len(cache) != layers or any(
        type(c) is not KVCache or c.offset != len(meta["tokens"]) for c in cache
    ):
        raise InvalidInput(f"{path} does not hold this model's cache of its tokens")
    return cache
