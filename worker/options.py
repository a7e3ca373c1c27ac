"""shoal-worker's command line: its arguments, their defaults and their checks."""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from engine.advert import DEFAULT_CLUSTER, check_name
from engine.cache_policy import DEFAULT_MEMORY_SHARE, parse_budget
from engine.command_line import CommandParser
from engine.errors import ShoalError
from proto import PROTOCOL_VERSION
from worker.lane_server import IDLE_SECONDS as LANE_IDLE_SECONDS
from worker.lane_server import MESSAGE_SECONDS as LANE_MESSAGE_SECONDS
from worker.reader import READERS_PER_DRIVE
from worker.scrub import DEFAULT_RATE, parse_rate
from worker.store import check_store_folder

DEFAULT_PORT = 50551
DRAIN_SECONDS = 5.0  # on a stop, for the requests being computed (--drain-seconds)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandParser(
        prog="shoal-worker",
        description=(
            "Serve the MoE experts held in one or more store folders to a Shoal coordinator "
            "over gRPC. Every expert file is checked against the manifest's checksum before it "
            "is served; calls must carry the cluster secret (see `shoal cluster-init`)."
        ),
    )
    parser.add_argument(
        "--store", action="append", required=True, type=Path, metavar="DIR",
        help="a store folder written by `shoal shard` (repeat for one folder per drive)",
    )
    parser.add_argument(
        "--host", default=None,
        help="address to listen on (default: --interface's address if given, else 127.0.0.1, "
        "this machine only; 0.0.0.0 for every interface: see docs/security.md). `shoal "
        "doctor` says where a worker started here would listen and what it would announce",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one and prints it)",
    )
    parser.add_argument(
        "--lane-port", type=int, default=None, metavar="PORT",
        help="TCP port of the expert lane, where each MoE layer's requests arrive on a bare "
        "TLS socket (docs/protocol.md; default: --port + 1, or a free port where that one is taken "
        "or with --port 0; coordinators learn it from the worker's inventory)",
    )
    parser.add_argument(
        "--spin-us", type=float, default=0.0, metavar="US",
        help="microseconds a lane watches its socket busily for the next request before it "
        "sleeps (default 0: it sleeps at once; spinning burns a core to save a wake-up)",
    )
    parser.add_argument(
        "--lane-idle-seconds", type=float, default=LANE_IDLE_SECONDS, metavar="S",
        help="close an expert lane that sends no request for S seconds (default "
        f"{LANE_IDLE_SECONDS:g}; the coordinator opens it again when needed)",
    )
    parser.add_argument(
        "--lane-message-seconds", type=float, default=LANE_MESSAGE_SECONDS, metavar="S",
        help="close an expert lane whose request, once begun, has not arrived in full within "
        f"S seconds (default {LANE_MESSAGE_SECONDS:g})",
    )
    parser.add_argument(
        "--drain-seconds", type=float, default=DRAIN_SECONDS, metavar="S",
        help="on SIGTERM or SIGINT, give the requests being computed up to S seconds to be "
        f"answered before the lanes and calls are closed (default {DRAIN_SECONDS:g})",
    )
    parser.add_argument(
        "--no-lane", action="store_true",
        help="serve no expert lane: coordinators then send every request on the gRPC stream "
        "(slower; for networks where a second port cannot pass)",
    )
    parser.add_argument(
        "--secret-file", metavar="PATH",
        help="cluster secret (default: $SHOAL_SECRET_FILE, else ~/.config/shoal/secret)",
    )
    parser.add_argument(
        "--node-id",
        help="name reported to the coordinator (default: a stable id made once per machine and "
        "kept in ~/.config/shoal/node-id; give each worker its own when several share a machine)",
    )
    parser.add_argument(
        "--cluster", default=DEFAULT_CLUSTER, metavar="NAME",
        help=f"cluster name announced on the local network (default {DEFAULT_CLUSTER!r}); "
        "coordinators use only the workers of their own cluster",
    )
    parser.add_argument(
        "--interface", metavar="NAME",
        help="listen on and announce only this interface's address (e.g. bridge0 for "
        "Thunderbolt Bridge). Without it the worker listens on --host, else on loopback only, "
        "and announces that address; with --host 0.0.0.0 it announces every physical "
        "interface's",
    )
    parser.add_argument(
        "--no-advertise", action="store_true",
        help="do not announce this worker with Bonjour (coordinators then need its address)",
    )
    parser.add_argument(
        "--no-verify", action="store_true",
        help="skip checksum verification at start (sizes are still checked)",
    )
    parser.add_argument(
        "--memory-budget", metavar="SIZE",
        help="memory for expert tensors, e.g. 512M, 24G, or 50%% of this worker's expert bytes; "
        "experts beyond it stay on the drives and are read when routed (default: "
        f"{DEFAULT_MEMORY_SHARE:.0%}% of physical memory)",
    )
    parser.add_argument(
        "--cache-admission", choices=("heat", "every"), default="heat",
        help="under a memory budget, which experts read from a drive stay in memory: 'heat' "
        "(default) keeps one only if routed more (counted with a 64-token half-life) than "
        "the least routed expert kept, so a cold expert read once does not evict a hot one; "
        "'every' keeps each one read, evicting the coldest",
    )
    parser.add_argument(
        "--no-verify-reads", action="store_true",
        help="do not check the checksum of each expert read from a drive while serving "
        "(by default every read is checked: a file that rotted is caught, that expert alone "
        "stops being offered and is computed by another copy)",
    )
    parser.add_argument(
        "--scrub", nargs="?", const=format_rate(DEFAULT_RATE), metavar="RATE",
        help="re-check every expert file against the manifest's checksum in the background, "
        "reading at most RATE bytes/s (e.g. 16M, 200M; default "
        f"{format_rate(DEFAULT_RATE)}); a file that rotted is reported and no longer served",
    )
    parser.add_argument(
        "--read-limit", metavar="RATE",
        help="read expert files from each store folder at most this fast, bytes/s (e.g. 40M): "
        "leaves the drive to other work, or stands in for a slower drive (a cgroup's read "
        "throttle lets a read after an idle spell through at full speed)",
    )
    parser.add_argument(
        "--readers", type=int, default=READERS_PER_DRIVE, metavar="N",
        help=f"reader threads per store folder (default {READERS_PER_DRIVE})",
    )
    parser.add_argument("--version", action="version", version=version_text())
    return parser.parse_args(argv)


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("shoal")
    except PackageNotFoundError:
        mine = "(not installed)"
    return f"shoal-worker {mine} (protocol {PROTOCOL_VERSION}, mlx {mx.__version__})"


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything is loaded."""
    check_name(args.cluster, "cluster name")
    if args.node_id:
        check_name(args.node_id, "node id")
    if args.readers < 1:
        raise ShoalError(f"--readers must be at least 1, got {args.readers}")
    if not 0 <= args.port < 65536:
        raise ShoalError(f"--port must be 0-65535, got {args.port}")
    if args.lane_port is not None and not 0 <= args.lane_port < 65536:
        raise ShoalError(f"--lane-port must be 0-65535, got {args.lane_port}")
    if not 0 <= args.spin_us <= 100_000:
        raise ShoalError(f"--spin-us must be 0-100000, got {args.spin_us:g}")
    for name, least in (("lane_idle_seconds", 0.1), ("lane_message_seconds", 0.1),
                        ("drain_seconds", 0.0)):
        value = getattr(args, name)
        if not least <= value <= 86400:
            raise ShoalError(f"--{name.replace('_', '-')} must be {least:g}-86400, got "
                             f"{value:g}")
    if args.lane_port is not None and args.no_lane:
        raise ShoalError("--lane-port and --no-lane contradict each other: give one")
    if args.memory_budget:
        parse_budget(args.memory_budget)
    if args.scrub:
        parse_rate(args.scrub)
    if args.read_limit:
        parse_rate(args.read_limit, "--read-limit")
    for folder in args.store:
        check_store_folder(folder)


def format_rate(rate: int) -> str:
    return f"{rate >> 20}M" if rate % (1 << 20) == 0 else str(rate)


