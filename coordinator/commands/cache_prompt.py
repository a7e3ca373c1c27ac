"""`shoal cache-prompt`: a long prompt's KV cache computed once on the cluster and written to
a file that `shoal generate --prompt-cache-file` (or mlx-lm's generate) continues from, as
mlx-lm's cache_prompt command does (the file format and its handling: coordinator/
prompt_cache_file.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.commands.connect import open_membership, record_run_heat, worker_addresses
from coordinator.commands.generate import kv_cache_options, kv_cache_settings
from coordinator.commands.options import (
    AddParser,
    check_one_worker_source,
    cluster_secret,
    discovery_options,
    secret_option,
)
from engine.errors import InvalidInput


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
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--prompt-cache-file", type=Path, required=True, metavar="FILE",
                   help="where to write the cache (a .safetensors file)")
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the running shoal-worker daemons (default: find the "
                   "workers of --cluster on the local network with Bonjour)")
    discovery_options(p, wait=30.0, wait_help="how long to wait for workers to hold every "
                      "expert (default 30)")
    kv_cache_options(p)
    secret_option(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    from coordinator.generate import open_remote_model
    from coordinator.membership import stderr_log
    from coordinator.prompt_cache_file import cached_prompt, save
    from engine.manifest import read_manifest

    kv = kv_cache_settings(args)
    check_one_worker_source(args)
    if not (Path(args.model) / "manifest.json").exists():
        raise InvalidInput(f"--model {args.model} is not a folder written by `shoal shard` "
                           "(it has no manifest.json)")
    if str(args.prompt_cache_file).rpartition(".")[2] != "safetensors":
        raise InvalidInput("--prompt-cache-file must end in .safetensors (mlx-lm's format)")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    secret = cluster_secret(args)
    addresses = worker_addresses(args.workers) if args.workers else []
    membership = None if args.workers else open_membership(
        args, secret, read_manifest(args.model), log=stderr_log)
    remote = None
    try:
        remote = open_remote_model(args.model, addresses, secret, membership=membership,
                                   wait=args.wait, on_wait=stderr_log)
        prompt = cached_prompt(remote.tokenizer, text)
        n = save(args.prompt_cache_file, remote.model, prompt, str(args.model), **kv)
        print(f"shoal cache-prompt: {n} prompt tokens cached in {args.prompt_cache_file}",
              file=sys.stderr)
    finally:
        if remote is not None:
            record_run_heat(args.model, remote.manifest, remote.cluster.links)
            remote.close()
        if membership is not None:
            membership.close()
