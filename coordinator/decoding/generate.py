"""The coordinator's model: mlx-lm's dense part with every switch module replaced by a
RemoteSwitch, and generation through mlx-lm's own loop, sampler and KV cache (with a draft
model, through mlx-lm's speculative step: coordinator/decoding/speculative.py)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.cluster.membership import Membership
from coordinator.cluster.snapshot import Cluster, FixedMembers, layer_sizes, with_local
from coordinator.dataplane.cache_guess import CacheGuess
from coordinator.dataplane.dispatch import Dispatcher, install
from coordinator.dataplane.link import LANE, Transport
from coordinator.dataplane.local_experts import LocalExperts, open_local_experts
from coordinator.dataplane.lookahead import Lookahead
from coordinator.decoding.draft_policy import SpeculativeStats
from coordinator.decoding.mtp_draft import MtpDraft
from coordinator.decoding.pipelined_prefill import pipelined_prefill, worth_pipelining
from coordinator.decoding.speculative import Draft, stream_speculative
from engine.errors import CorruptData, InvalidInput, NotFound
from engine.manifest import Manifest, read_manifest
from engine.moe_layers import check_safetensors, expert_keys
from engine.mtp import attach_from_files as attach_mtp
from engine.mtp import without_mtp
from engine.process import launch_directly

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken", "tiktoken.model"
)


@dataclass
class RemoteModel:
    """The dense model on this machine, its experts on the cluster."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    manifest: Manifest
    cluster: Cluster
    dispatcher: Dispatcher
    owned: FixedMembers | None = None  # the workers opened for it from addresses
    local: LocalExperts | None = None  # the coordinator's own experts, from --local-store

    def close(self) -> None:
        if self.owned is not None:  # a Membership is its opener's to close
            self.owned.close()
        if self.local is not None:
            self.local.close()


def load_dense(model_dir: Path, manifest: Manifest) -> tuple[nn.Module, TokenizerWrapper]:
    """Load OUT/dense with mlx-lm, leaving the routed experts out, and check nothing else is."""
    dense_dir = Path(model_dir) / "dense"
    for entry in manifest.dense_files:
        path = dense_dir / entry.file
        if not path.exists():
            raise NotFound(f"dense weight file {path} is missing")
        check_safetensors(path)
    with contextlib.redirect_stdout(io.StringIO()):
        model, config = load_model(dense_dir, lazy=True, strict=False)
    index = json.loads((dense_dir / "model.safetensors.index.json").read_text())
    routed = expert_keys(manifest.layers)
    # the MTP module, where the split kept one (`--draft mtp`): mlx-lm's load leaves it out
    attach_mtp(model, config, [dense_dir / e.file for e in manifest.dense_files],
               routed=frozenset(routed))
    wanted = {k for k, _ in tree_flatten(model.parameters()) if k not in routed}
    absent = sorted(wanted - set(index["weight_map"]))
    if absent:
        raise CorruptData(
            f"{dense_dir} lacks {len(absent)} dense weights the model needs, e.g. {absent[0]}"
        )
    if not any(any(dense_dir.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise NotFound(
            f"{dense_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer files into the source checkpoint and shard it again"
        )
    tokenizer = load_tokenizer(dense_dir)
    return model, tokenizer


def open_remote_model(
    model_dir: Path,
    addresses: list[str],
    secret: bytes,
    *,
    membership: Membership | None = None,
    wait: float | None = 30.0,
    on_wait: Callable[[str], None] | None = None,
    transport: Transport = LANE,
    local_stores: Sequence[Path] = (),
    memory_budget: str | None = None,
    admission: bool = True,
    read_limit: int | None = None,
) -> RemoteModel:
    """The dense model here, the experts on the workers at `addresses`, or, with a
    `membership`, on whichever of its workers are healthy (waiting up to `wait` seconds
    until every expert has an owner, or with `wait` None not at once: a call made before then
    raises Unavailable; workers may leave and come back afterwards); and on
    this Mac's own store folders, `local_stores`, served in this process under
    `memory_budget` (the worker's forms; `admission`: its --cache-admission heat, `read_limit`:
    its --read-limit). With local stores and no workers, this Mac alone."""
    if addresses or membership is not None:  # every MoE layer evaluates: engine/process.py
        launch_directly()
    manifest = read_manifest(Path(model_dir))
    model, tokenizer = load_dense(model_dir, manifest)
    local = owned = None
    if local_stores:
        local = open_local_experts(list(local_stores), manifest, memory_budget=memory_budget,
                                   admission=admission, read_limit=read_limit)
    try:
        if membership is None and not addresses and local is not None:
            cluster = Cluster.of(with_local(None, local), layer_sizes(manifest))
        elif membership is None:
            owned = FixedMembers(addresses, secret, transport)
            cluster = owned.join(manifest, log=on_wait, local=local)
        elif wait is None:
            cluster = Cluster.following(with_local(membership, local), layer_sizes(manifest))
        else:
            cluster = membership.join(manifest, wait=wait, on_wait=on_wait, local=local)
    except BaseException:
        if local is not None:
            local.close()
        raise
    dispatcher = Dispatcher(cluster)
    install(model, manifest, dispatcher)
    # the main model's layers only: the MTP module's run when it drafts, not after the last
    dispatcher.lookahead = Lookahead(model, without_mtp(manifest))
    experts = manifest.experts
    dispatcher.guess = CacheGuess(sum(e.bytes for e in experts) // max(len(experts), 1))
    if local is not None:  # for its layers run whole, which the dispatcher does not see
        local.lookahead = dispatcher.lookahead
    mx.eval(model.parameters())
    return RemoteModel(model, tokenizer, manifest, cluster, dispatcher, owned, local)


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str, *, chat: bool) -> list[int]:
    """Token ids exactly as mlx-lm's generate would build them (chat template only if asked)."""
    if chat:
        if tokenizer.chat_template is None:
            raise InvalidInput("this model's tokenizer has no chat template; drop --chat")
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return encode_text(tokenizer, prompt)


def encode_messages(tokenizer: TokenizerWrapper, messages: list[dict]) -> list[int]:
    """A conversation through the checkpoint's chat template, ready for the reply."""
    return encode_text(tokenizer, render_messages(tokenizer, messages))


def render_messages(tokenizer: TokenizerWrapper, messages: list[dict]) -> str:
    """A conversation as the text the checkpoint's chat template makes of it."""
    if tokenizer.chat_template is None:
        raise InvalidInput("this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_text(tokenizer: TokenizerWrapper, prompt: str) -> list[int]:
    """Text as mlx-lm encodes a prompt: a BOS token added unless the text starts with it."""
    add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
    ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    if not ids:
        raise InvalidInput("the prompt is empty")
    return list(ids)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    token_seconds: list[float] = field(default_factory=list)  # wall time of each new token
    finish_reason: str | None = None
    speculative: SpeculativeStats | None = None  # with a draft model


def generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt_ids: list[int],
    *,
    max_tokens: int = 100,
    temperature: float = 0.0,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
    draft: Draft | MtpDraft | None = None,
    dispatcher: Dispatcher | None = None,
    **mlx_options,
) -> GenerationResult:
    """Generate with mlx-lm's stream_generate; `model` may be local or a RemoteModel's.
    With a `draft` (a draft model, or the model's own MTP module), the draft proposes tokens
    that `model` verifies several at a time.
    `mlx_options` go to mlx-lm's generate_step: its KV-cache quantization (kv_bits,
    kv_group_size, quantized_kv_start) and a prompt_cache to continue from. With the
    RemoteModel's `dispatcher`, a long prompt's pass is pipelined over the cluster
    (pipelined_prefill.py) and mlx-lm's loop continues from its cache."""
    if max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {max_tokens}")
    if temperature < 0:
        raise InvalidInput(f"--temperature must not be negative, got {temperature}")
    if seed is not None:
        mx.random.seed(seed)
    result = GenerationResult(prompt_token_ids=list(prompt_ids))
    sampler = make_sampler(temp=temperature)
    rest, piped = list(prompt_ids), 0.0
    if draft is None and dispatcher is not None and "kv_bits" not in mlx_options \
            and "prompt_cache" not in mlx_options \
            and worth_pipelining(dispatcher, len(prompt_ids) - 1):
        cache = make_prompt_cache(model)
        started = time.perf_counter()
        pipelined_prefill(model, dispatcher, rest[:-1], cache)
        piped = time.perf_counter() - started
        rest, mlx_options = rest[-1:], {**mlx_options, "prompt_cache": cache}
    if draft is None:
        responses = stream_generate(
            model, tokenizer, mx.array(rest), max_tokens=max_tokens, sampler=sampler,
            **mlx_options,
        )
    else:
        result.speculative = SpeculativeStats()
        responses = stream_speculative(
            model, tokenizer, mx.array(prompt_ids), draft, max_tokens=max_tokens,
            sampler=sampler, stats=result.speculative,
        )
    last = time.perf_counter()
    for response in responses:
        now = time.perf_counter()
        result.token_seconds.append(now - last)
        last = now
        if response.finish_reason != "stop" or response.token not in tokenizer.eos_token_ids:
            result.token_ids.append(int(response.token))
        result.text += response.text
        if on_text and response.text:
            on_text(response.text)
        # mlx-lm times the tokens it was given; a pipelined pass's come before them
        result.prefill_tps = (len(prompt_ids) / (piped + len(rest) / response.prompt_tps)
                              if piped and response.prompt_tps else response.prompt_tps)
        result.decode_tps = response.generation_tps
        result.finish_reason = response.finish_reason
    return result
