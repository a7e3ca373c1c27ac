"""`shoal cluster-init`: create the secret that the coordinator and the workers share."""

from __future__ import annotations

import argparse

from coordinator.cli.options import AddParser, secret_option
from engine.auth import create_secret, secret_mode, secret_path


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "cluster-init", help="create the cluster secret shared by the coordinator and workers",
        description="Create a random cluster secret (mode 0600). Copy the file to the same path "
        "on every machine; workers refuse calls that do not prove they hold it.",
    )
    secret_option(p)
    p.add_argument("--force", action="store_true", help="replace an existing secret")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    path = create_secret(secret_path(args.secret_file), force=args.force)
    print(f"wrote a new cluster secret to {path} (mode {secret_mode(path):04o})")
    print("copy it to the same path on every machine of the cluster, for example:")
    print(f"  scp -p {path} other-mac.local:{path}")
