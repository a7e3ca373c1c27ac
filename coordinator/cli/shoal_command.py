"""The `shoal` command: gathers the subcommands of coordinator/cli/ (one `*_command.py` each)
and runs the one asked for; expected failures (ShoalError) and I/O errors (OSError) print as
one line without a traceback, exit status 2."""

from __future__ import annotations

import argparse
import sys

from coordinator.cli import (
    api_key_command,
    bench_command,
    cache_prompt_command,
    chat_command,
    cluster_init_command,
    demo_command,
    deploy_rebalance_command,
    doctor_command,
    generate_command,
    heat_command,
    plan_command,
    pull_command,
    serve_command,
    shard_command,
    workers_command,
)
from coordinator.ops.hub import hub_may_be_reached
from engine.errors import ShoalError, worded
from engine.pipes import guard_standard_streams

# In the order `shoal --help` lists them: set up, run, inspect, then change the placement.
COMMANDS = (cluster_init_command, pull_command, shard_command, generate_command, chat_command,
            cache_prompt_command, workers_command, demo_command, bench_command, plan_command,
            serve_command, api_key_command, doctor_command, heat_command, deploy_rebalance_command)


def version_text() -> str:
    """shoal's version, its wire protocol and the MLX it runs on (what a bug report needs)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    # lazy: start-up
    from proto import PROTOCOL_VERSION

    return (f"shoal {of('shoal')} (protocol {PROTOCOL_VERSION}; mlx {of('mlx')}, "
            f"mlx-lm {of('mlx-lm')}, grpcio {of('grpcio')})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description=(
            "Run a Mixture-of-Experts model whose routed experts are spread over several "
            "machines. Typical use: `shoal cluster-init`, `shoal shard MODEL OUT --workers N`, "
            "start `shoal-worker --store OUT/worker-K --interface bridge0` on each machine, "
            "then `shoal generate`."
        ),
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.setup_arg_parser(sub.add_parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    guard_standard_streams()
    args = build_parser().parse_args(argv)
    hub_may_be_reached(args.command)
    try:
        args.main(args)
    except (ShoalError, OSError) as e:
        print(f"shoal: error: {worded(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nshoal: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
