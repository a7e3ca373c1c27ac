"""`shoal pull`: download a checkpoint from the Hugging Face Hub into its local cache
(coordinator/ops/hub.py), ready for `shoal plan` and `shoal shard`."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from coordinator.cli.options import AddParser
from coordinator.ops.hub import cache_entry, pull


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "pull", help="download a checkpoint from the Hugging Face Hub into the local cache",
        description="Download a model repository's config, tokenizer and safetensors weights "
        "(not the other formats some repositories also carry) into the Hugging Face cache "
        "($HF_HUB_CACHE, default ~/.cache/huggingface/hub), with a progress bar. A dropped "
        "connection resumes mid-file; after Ctrl-C (or any stop) run it again: the files "
        "already downloaded are kept, the one that was cut short starts over. Then `shoal "
        "shard ORG/NAME OUT --workers N` reads it from the cache. This is the only command "
        "that uses the network to reach a hub; gated or private repositories need `hf auth "
        "login` or HF_TOKEN, another hub or mirror HF_ENDPOINT.",
    )
    p.add_argument("repo_id", metavar="ORG/NAME",
                   help="the repository, e.g. mlx-community/Qwen3-30B-A3B-4bit")
    p.add_argument("--revision", metavar="REV",
                   help="a branch, tag or commit (default: main)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    done: dict[str, object] = {}

    def download() -> None:
        try:
            done["folder"] = pull(args.repo_id, revision=args.revision, progress=not args.quiet)
        except BaseException as e:  # handed to the main thread as it is
            done["error"] = e

    # huggingface_hub downloads in a pool of threads that finish their files before the
    # process may end: run it aside, so that Ctrl-C stops the command at once.
    blobs = cache_entry(args.repo_id) / "blobs"
    partial_before = set(blobs.glob("*.incomplete"))
    thread = threading.Thread(target=download, daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except KeyboardInterrupt:
        for path in set(blobs.glob("*.incomplete")) - partial_before:
            path.unlink(missing_ok=True)  # this run's file cut short: nothing to resume from
        print("\nshoal: interrupted: the files already downloaded are kept; run the same "
              "command again to fetch the rest", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    if "error" in done:
        raise done["error"]
    folder = done["folder"]
    print(f"{args.repo_id} -> {folder}\nnext: shoal plan --model {args.repo_id} --worker "
          f"NAME=MEMORY:DISK ..., then shoal shard {args.repo_id} OUT --workers N")
