"""The demo's models, built once into the cache ($SHOAL_CACHE, else ~/.cache/shoal) and reused:
SmolLM2-135M-Instruct turned into a Mixtral-layout MoE (moefy.py) and sharded for local
workers, and its 4-bit draft; the benchmarks keep their checkpoints in the same cache."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from builders.gguf_llama import find_smollm2_gguf, gguf_to_llama
from builders.moefy import moefy
from engine.sharding import shard


def cache_root() -> Path:
    """$SHOAL_CACHE, else $XDG_CACHE_HOME/shoal, else ~/.cache/shoal."""
    if os.environ.get("SHOAL_CACHE"):
        return Path(os.environ["SHOAL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shoal"


def build_once(target: Path, build: Callable[[Path], object], what: str) -> Path:
    """Build into TARGET.partial and rename when complete, so an interrupted build is redone."""
    if target.exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"demo: building {what} (first run only) ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm's chatter: never mix it into output
        build(partial)
    os.replace(partial, target)
    print(f"demo: built {what} in {time.perf_counter() - started:.0f} s -> {target}",
          file=sys.stderr, flush=True)
    return target


# With tools, the conversation in the Hermes / Qwen form (ChatML, as SmolLM2 speaks it) that
# mlx-lm's json_tools parser reads back; without, SmolLM2's own template, word for word.
TOOLS_MARK = "{#- shoal: tools in the Hermes form, else SmolLM2's own template -#}"
TOOLS_BRANCH = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content }}{%- else %}{{- 'You are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face' }}{%- endif %}{{- '\\n\\n# Tools\\n\\nYou may call one "
    "or more functions. Their signatures:\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each call, "
    "return a JSON object with the function name and arguments within <tool_call></tool_call> "
    "tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' "
    "+ message.content + '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{%- else %}"
)


def with_tools_template(model: Path) -> Path:
    """Give the demo checkpoint at `model` a chat template that renders tools (once; the
    answer to a conversation without tools is unchanged, its prompt being the same)."""
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config.get("chat_template") or ""
    if not template.startswith(TOOLS_MARK):
        config["chat_template"] = TOOLS_MARK + TOOLS_BRANCH + template + "{%- endif %}"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return model


def prepare_dense(*, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a float32 mlx-lm checkpoint in the cache, built on first use."""
    gguf = find_smollm2_gguf()
    return with_tools_template(build_once(
        cache_root() / "demo" / "smollm2-135m-instruct",
        lambda out: gguf_to_llama(gguf, out, progress=progress),
        "the dense model from its GGUF",
    ))


DRAFT_BITS = 4


def prepare_draft(*, progress: bool = True) -> Path:
    """The demo's draft: the dense model quantized to 4 bits by mlx-lm, built on first use."""
    from mlx_lm.convert import convert

    dense = prepare_dense(progress=progress)

    def build(out: Path) -> None:
        convert(str(dense), str(out), quantize=True, q_bits=DRAFT_BITS, q_group_size=64)

    return build_once(cache_root() / "demo" / f"smollm2-135m-instruct-q{DRAFT_BITS}", build,
                      f"the {DRAFT_BITS}-bit draft model")


def moe_folder(experts: int, top_k: int) -> Path:
    """Where the demo's MoE checkpoint is cached; "copies" names the construction (builders/
    moefy.py), so a cache built by an older Shoal, which fitted its experts, is not reused."""
    return cache_root() / "demo" / f"smollm2-moe-e{experts}-k{top_k}-copies"


def prepare(experts: int, top_k: int, workers: int, *, progress: bool = True) -> Path:
    """The sharded demo model in the cache, built on first use; returns the shard folder."""
    root = cache_root() / "demo"
    dense = prepare_dense(progress=progress)
    moe = build_once(
        moe_folder(experts, top_k),
        lambda out: moefy(dense, out, num_experts=experts, top_k=top_k),
        f"a {experts}-expert MoE (top-{top_k})",
    )
    with_tools_template(moe)  # a cache built before the template had tools gets it too
    sharded = build_once(
        root / f"sharded-e{experts}-k{top_k}-copies-w{workers}",
        lambda out: shard(moe, out, workers=workers, progress=progress),
        f"{workers} worker stores",
    )
    with_tools_template(sharded / "dense")
    return sharded
