"""`shoal generate`: one prompt through the sharded model, text streamed as it comes, with
--stats or --json a report (model and loop: coordinator/decoding/generate.py; the report's shape:
coordinator/decoding/report.py); this module picks the workers and records the run's heat."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.connect import members_secret, remote_model
from coordinator.cli.options import (
    AddParser,
    check_model_args,
    draft_options,
    draft_policy,
    drafting,
    kv_cache_options,
    kv_cache_settings,
    load_draft_of,
    model_options,
    secret_option,
)
from coordinator.decoding.draft_policy import DraftPolicy
from engine.errors import InvalidInput
from engine.manifest import read_manifest

if TYPE_CHECKING:
    from coordinator.decoding.generate import RemoteModel


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "generate", help="generate text with the experts served by running workers",
        description="Load the dense part of a sharded model, connect to the workers (and "
        "serve this machine's own --local-store experts in this process), and generate with "
        "mlx-lm's sampling and KV cache. Greedy by default; the prompt is used as given "
        "unless --chat applies the chat template. One Mac alone: `shoal generate --model OUT "
        "--local-store OUT/experts --memory-budget 25%% PROMPT`.",
    )
    p.add_argument("prompt", metavar="PROMPT")
    model_options(p, wait=30.0)
    p.add_argument("--max-tokens", type=int, default=100, metavar="N",
                   help="stop after N generated tokens, or earlier at the end of the answer "
                   "(default 100)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--stats", action="store_true",
                   help="also report per-token and per-layer timing, bytes sent, and the workers' "
                   "cache hit rate, prefetch recall and drive reads")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    draft_options(p)
    kv_cache_options(p)
    p.add_argument("--prompt-cache-file", type=Path, metavar="FILE",
                   help="continue from the prompt cache in FILE (made by `shoal cache-prompt`, "
                   "or by mlx-lm's cache_prompt on the checkpoint the model was sharded from): "
                   "PROMPT is then the question asked after the cached prompt")
    secret_option(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    policy = draft_policy(args)  # the draft options, then the rest, before anything loads
    check_generate_args(args)
    secret = members_secret(args, read_manifest(args.model))
    report = generate_with_workers(args, secret, policy, StreamedText())
    if args.json:
        print(json.dumps(report))
    else:
        # lazy: start-up
        from coordinator.decoding.report import summary_lines

        print("\n".join(summary_lines(report)), file=sys.stderr)


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse what cannot work before the model is loaded (which takes minutes when large)."""
    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise InvalidInput(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if kv_cache_settings(args) and drafting(args):
        raise InvalidInput("--kv-bits and a draft (--draft, --draft-model) cannot be used "
                           "together")
    if args.prompt_cache_file is not None and drafting(args):
        raise InvalidInput("--prompt-cache-file and a draft (--draft, --draft-model) cannot "
                           "be used together")
    check_model_args(args)


class StreamedText:
    """Generated text goes to stdout as it comes, without a newline at the end of a piece;
    anything said on stderr meanwhile first ends the line, so it never runs into the text."""

    def __init__(self) -> None:
        self.mid_line = False

    def write(self, text: str) -> None:
        if text:
            print(text, end="", flush=True)
            self.mid_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.mid_line:
            print(flush=True)
            self.mid_line = False


def generate_with_workers(
    args: argparse.Namespace,
    secret: bytes,
    policy: DraftPolicy | None,
    out: StreamedText,
) -> dict:
    """Load the model and reach its workers, generate, and let go of everything however the
    run ends, its heat recorded first (connect.remote_model)."""
    # lazy: start-up
    from coordinator.cluster.membership import stderr_log

    def say(message: str) -> None:
        out.end_line()
        stderr_log(message)

    with remote_model(args, secret, say) as remote:
        try:
            return decode(args, remote, policy, out)
        finally:
            out.end_line()  # an error or warning after partial output starts on its own line


def decode(
    args: argparse.Namespace, remote: RemoteModel, policy: DraftPolicy | None, out: StreamedText
) -> dict:
    """The prompt through the remote model (with a draft model proposing tokens when asked),
    and the report of the run; with --stats, the workers' counters are read around it."""
    # lazy: start-up
    from coordinator.decoding.generate import encode_prompt, generate
    from coordinator.decoding.report import generation_report, generation_stats
    from coordinator.ops.worker_stats import read_stats

    options = kv_cache_settings(args)
    if args.prompt_cache_file is not None:
        # lazy: start-up
        from coordinator.decoding.prompt_cache_file import load, question_tokens

        options["prompt_cache"] = load(args.prompt_cache_file, remote.model)
        prompt_ids = question_tokens(remote.tokenizer, args.prompt, chat=args.chat)
    else:
        prompt_ids = encode_prompt(remote.tokenizer, args.prompt, chat=args.chat)
    draft = None if policy is None else load_draft_of(args, remote, policy)
    before = read_stats(remote.cluster.links) if args.stats else {}
    result = generate(
        remote.model, remote.tokenizer, prompt_ids,
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        on_text=None if args.json else out.write, draft=draft, dispatcher=remote.dispatcher,
        **options,
    )
    if not args.stats:
        return generation_report(result)
    after = read_stats(remote.cluster.links)
    lookahead = remote.dispatcher.lookahead
    stats = generation_stats(result, remote.dispatcher.stats,
                             lookahead.stats if lookahead else None, before, after)
    return generation_report(result, stats)
