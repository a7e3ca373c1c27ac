"""`shoal pull`: download a checkpoint from the Hugging Face Hub into its local cache
(coordinator/hub.py), ready for `shoal plan` and `shoal shard`."""

from __future__ import annotations

import argparse

from coordinator.commands.options import AddParser


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "pull", help="download a checkpoint from the Hugging Face Hub into the local cache",
        description="Download a model repository's config, tokenizer and safetensors weights "
        "(not the other formats some repositories also carry) into the Hugging Face cache "
        "($HF_HUB_CACHE, default ~/.cache/huggingface/hub), with a progress bar. Run it again "
        "after an interruption: files already there are kept and a file cut short resumes "
        "where it stopped. Then `shoal shard ORG/NAME OUT --workers N` reads it from the "
        "cache. This is the only command that uses the network to reach a hub; gated or "
        "private repositories need `hf auth login` or HF_TOKEN, another hub or mirror "
        "HF_ENDPOINT.",
    )
    p.add_argument("repo_id", metavar="ORG/NAME",
                   help="the repository, e.g. mlx-community/Qwen3-30B-A3B-4bit")
    p.add_argument("--revision", metavar="REV",
                   help="a branch, tag or commit (default: main)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    from coordinator.hub import pull

    folder = pull(args.repo_id, revision=args.revision, progress=not args.quiet)
    print(f"{args.repo_id} -> {folder}\nnext: shoal plan --model {folder} --worker NAME=MEMORY "
          f"..., then shoal shard {args.repo_id} OUT --workers N")
