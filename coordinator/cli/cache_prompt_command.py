"""`shoal cache-prompt`: a long prompt's KV cache computed once on the cluster and written to a
file that `shoal generate --prompt-cache-file` (or mlx-lm's generate) continues from, as
mlx-lm's cache_prompt does (the file: coordinator/decoding/prompt_cache_file.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.cli.connect import members_secret, remote_model
from coordinator.cli.options import (
    AddParser,
    check_model_args,
    kv_cache_options,
    kv_cache_settings,
    model_options,
    secret_option,
)
from engine.errors import InvalidInput
from engine.manifest import read_manifest


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "cache-prompt", help="compute a prompt's KV cache once and save it to a file",
        description="Load the dense part of a sharded model, connect to the workers, run "
        "PROMPT through the model (as an open user message of the chat template when the "
        "model has one, as mlx-lm's cache_prompt does) and save its KV cache to FILE in "
        "mlx-lm's format. `shoal generate --prompt-cache-file FILE QUESTION` then computes "
        "only the question.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt to cache; - reads stdin")
    model_options(p, wait=30.0)
    p.add_argument("--prompt-cache-file", type=Path, required=True, metavar="FILE",
                   help="where to write the cache (a .safetensors file)")
    kv_cache_options(p)
    secret_option(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.cluster.membership import stderr_log
    from coordinator.decoding.prompt_cache_file import cached_prompt, save

    kv = kv_cache_settings(args)
    check_model_args(args)
    if str(args.prompt_cache_file).rpartition(".")[2] != "safetensors":
        raise InvalidInput("--prompt-cache-file must end in .safetensors (mlx-lm's format)")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    secret = members_secret(args, read_manifest(args.model))
    with remote_model(args, secret, stderr_log) as remote:
        prompt = cached_prompt(remote.tokenizer, text)
        n = save(args.prompt_cache_file, remote.model, prompt, str(args.model), **kv)
        print(f"shoal cache-prompt: {n} prompt tokens cached in {args.prompt_cache_file}",
              file=sys.stderr)
