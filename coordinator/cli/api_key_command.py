"""`shoal api-key`: create the key `shoal serve --api-key-file` asks every client for."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from coordinator.cli.options import AddParser
from engine.errors import ShoalError

DEFAULT_PATH = Path("~/.config/shoal/api-key")


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "api-key", help="create an API key file for `shoal serve --api-key-file`",
        description="Write a new random API key (one line, mode 0600) for `shoal serve "
        "--api-key-file FILE`, which then answers only requests that send it "
        "('Authorization: Bearer KEY', or Anthropic's 'x-api-key: KEY').",
    )
    p.add_argument("file", nargs="?", type=Path, default=DEFAULT_PATH, metavar="FILE",
                   help=f"where to write it (default {DEFAULT_PATH})")
    p.add_argument("--force", action="store_true", help="replace an existing key file")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    path = args.file.expanduser()
    if path.exists() and not args.force:
        raise ShoalError(f"an API key file already exists at {path}; use it, or pass --force "
                         "to replace it (every client then needs the new key)")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"sk-shoal-{secrets.token_urlsafe(32)}\n")
    print(f"wrote a new API key to {path} (mode 0600); serve with it:")
    print(f"  shoal serve --model OUT_DIR --api-key-file {path}")
    print("and give clients the key it holds, e.g. OpenAI(base_url=..., api_key=KEY)")
