"""The shoal-worker command: parse arguments, load the stores, serve the expert service."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import TextIO

import grpc
import mlx.core as mx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.advert import DEFAULT_CLUSTER, Advert, check_name, inventory_digest
from engine.auth import CredentialChecker, load_secret, secret_path
from engine.cache_policy import (
    DEFAULT_MEMORY_SHARE,
    BudgetSpec,
    format_bytes,
    parse_budget,
    resolve_budget,
)
from engine.errors import ShoalError, worded
from engine.interfaces import announced_addresses, busy_port, listen_host, port_taken
from engine.pipes import guard_standard_streams
from engine.process import launch_directly, raise_file_limit
from engine.store_lock import hold_for_serving
from engine.tls import Identity
from proto import (
    PROTOCOL_VERSION,
    SERVER_OPTIONS,
    SERVICE,
    add_expert_service,
    server_credentials,
)
from proto.lane import server_context
from worker.advertise import Advertiser, load_node_id, node_id_path
from worker.interceptors import AuthInterceptor, BoundedErrors, PeerLimit
from worker.lane_server import LaneServer
from worker.reader import READERS_PER_DRIVE
from worker.residency import Residency
from worker.scrub import DEFAULT_RATE, Scrubber, parse_rate
from worker.service import ExpertServicer
from worker.store import check_store_folder, free_disk, scan_stores

DEFAULT_PORT = 50551
MAX_CALLS = 64  # calls at once, all peers together; gRPC refuses more (RESOURCE_EXHAUSTED)
# Files kept free of the gRPC port's connections: the expert lane's, expert files, logs.
FILES_SPARE = 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
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
        "TLS socket (docs/protocol.md; default: --port + 1, or a free port with --port 0)",
    )
    parser.add_argument(
        "--spin-us", type=float, default=0.0, metavar="US",
        help="microseconds a lane watches its socket busily for the next request before it "
        "sleeps (default 0: it sleeps at once; spinning burns a core to save a wake-up)",
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


def physical_memory() -> int:
    """Bytes of physical memory (macOS and Linux); 16 GiB where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def choose_budget(memory_budget: str | None, expert_bytes: int) -> tuple[int, str]:
    """The budget in bytes (--memory-budget's text, or None) and how it was chosen, for the
    start-up line."""
    spec = parse_budget(memory_budget) if memory_budget else BudgetSpec()
    physical = physical_memory()
    budget = resolve_budget(spec, expert_bytes, physical)
    how = (f"--memory-budget {memory_budget}" if memory_budget else
           f"default {DEFAULT_MEMORY_SHARE:.0%} of {format_bytes(physical)} physical memory")
    return budget, how


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
    if args.lane_port is not None and args.no_lane:
        raise ShoalError("--lane-port and --no-lane contradict each other: give one")
    if args.memory_budget:
        parse_budget(args.memory_budget)
    if args.scrub:
        parse_rate(args.scrub)
    for folder in args.store:
        check_store_folder(folder)


def connection_cap(file_limit: int) -> int:
    """Connections the gRPC port holds at once, all peers together, in a process that may
    open `file_limit` files: FILES_SPARE fewer, or half of a limit under twice that; 0 (no
    cap) where the limit is not known."""
    return max(file_limit - FILES_SPARE, file_limit // 2)


def bind(
    host: str, port: int, executor: futures.Executor, checker: CredentialChecker,
    identity: Identity, max_connections: int = 0,
) -> tuple[grpc.Server, int]:
    """A gRPC server that owns host:port alone, bound before any expert is loaded, serving
    TLS only (docs/security.md), holding at most `max_connections` connections (0: no cap).

    gRPC sets SO_REUSEPORT by default, so a second worker on a taken port would start
    silently and the kernel would deal connections out to both: turned off here. Beyond the
    cap gRPC closes a new connection at once: a flood of connections that never finish their
    handshake keeps the process off its file limit, where it could open no expert file and
    gRPC's accept loop would log every second (grpcio has no cap per peer address).
    """
    if port and port_taken(host, port):  # before gRPC, which logs its own raw line first
        raise ShoalError(busy_port(host, port))
    options = [*SERVER_OPTIONS, ("grpc.so_reuseport", 0)]
    if max_connections:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    server = grpc.server(
        executor,
        interceptors=[BoundedErrors(), AuthInterceptor(checker), PeerLimit(checker)],
        options=options,
        maximum_concurrent_rpcs=MAX_CALLS,
    )
    try:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(identity))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ShoalError(busy_port(host, port))
    return server, bound


def format_rate(rate: int) -> str:
    return f"{rate >> 20}M" if rate % (1 << 20) == 0 else str(rate)


def serve(args: argparse.Namespace) -> None:
    file_limit = raise_file_limit()  # each connection is a file: mlx-lm's import set it low
    args.host = listen_host(args.host, args.interface)
    check_args(args)
    secret = load_secret(secret_path(args.secret_file))
    identity = secret.require_identity()  # before loading any expert: refuse early
    addresses = [] if args.no_advertise else announced_addresses(args.host, args.interface)
    # Every call holds a thread (Compute streams for as long as a coordinator is connected):
    # the pool has room beyond the server's cap, so liveness checks always find a thread, and
    # PeerLimit keeps one host from taking the whole cap.
    executor = futures.ThreadPoolExecutor(max_workers=MAX_CALLS + 8, thread_name_prefix="rpc")
    checker = CredentialChecker(secret)  # one memory of used nonces for both listeners
    server, port = bind(args.host, args.port, executor, checker, identity,
                        connection_cap(file_limit))
    lane = None
    residency = None
    try:
        if not args.no_lane:
            lane_port = args.lane_port if args.lane_port is not None else \
                port + 1 if args.port else 0
            lane = LaneServer(args.host, lane_port, server_context(identity), checker,
                              log=lambda m: print(f"shoal-worker: {m}", file=sys.stderr,
                                                  flush=True), spin=args.spin_us / 1e6)
        residency = load(args)
        run(args, server, port, residency, addresses, checker, lane)
    finally:
        if lane is not None:
            lane.close()
        server.stop(grace=None).wait(5)
        # The calls still running were cancelled by stop(); give their threads a bounded while.
        joiner = threading.Thread(target=executor.shutdown, kwargs={"cancel_futures": True},
                                  daemon=True)
        joiner.start()
        joiner.join(5)
        if residency is not None:
            residency.close()


def load(args: argparse.Namespace) -> Residency:
    """Scan (and verify) the stores and set up the memory budget."""
    hold_for_serving(args.store)  # `shoal shard` will not write them while this runs
    return open_residency(args.store, args.memory_budget, verify=not args.no_verify,
                          readers=args.readers, verify_reads=not args.no_verify_reads)


def open_residency(
    stores: list[Path], memory_budget: str | None, *, verify: bool = True,
    readers: int = READERS_PER_DRIVE, verify_reads: bool = True, name: str = "shoal-worker",
    out: TextIO | None = None, warm: bool = True,
) -> Residency:
    """Scan (and verify) store folders and hold their experts under a memory budget
    (--memory-budget's text, or None for the default), saying so as `name` (a worker, or the
    coordinator for its own experts: coordinator/local_experts.py), the budget on `out`
    (default stdout), warnings on stderr. `warm`: read the experts that fit into memory now."""
    scan = scan_stores(stores, verify=verify)
    for problem in scan.problems:
        print(f"{name}: warning: {problem}", file=sys.stderr, flush=True)
    if not scan.held:
        # A store folder with only the manifest: `shoal deploy` sends the experts.
        print(f"{name}: no intact expert files in {', '.join(map(str, stores))} yet; "
              "waiting for `shoal deploy` to send some", file=sys.stderr, flush=True)
    expert_bytes = scan.expert_bytes()
    budget, how = choose_budget(memory_budget, expert_bytes)
    resident = min(budget, expert_bytes)
    print(
        f"{name}: memory budget {format_bytes(budget)} ({how}); experts "
        f"{format_bytes(expert_bytes)}, {resident / max(expert_bytes, 1):.0%} of them fit in memory"
        + ("" if budget >= expert_bytes else "; the rest are read from the drives when routed"),
        file=out or sys.stdout, flush=True,
    )
    residency = Residency(
        scan, budget=budget, readers_per_drive=readers, verify_reads=verify_reads, warm=warm,
        report=lambda m: print(f"{name}: warning: {m}", file=sys.stderr, flush=True),
    )
    if residency.streaming:
        # Evicted experts' memory goes back to the system instead of MLX's buffer cache.
        mx.set_cache_limit(4 * residency.reader.buffer_bytes)
    return residency


def run(
    args: argparse.Namespace, server: grpc.Server, port: int, residency: Residency,
    addresses: list[str], checker: CredentialChecker, lane: LaneServer | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, advertised on `addresses` (none: not advertised)."""
    scan = residency.scan

    def note(message: str) -> None:
        print(f"shoal-worker: {message}", file=sys.stderr, flush=True)

    node_id = args.node_id or load_node_id(node_id_path(), log=note)
    checker.node = node_id  # credentials for every call but the inventory must name it
    memory_budget = residency.budget
    servicer = ExpertServicer(residency, node_id, memory_budget, lane.port if lane else 0)
    add_expert_service(servicer, server)
    liveness = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(liveness, server)
    for service in ("", SERVICE.full_name):
        liveness.set(service, health_pb2.HealthCheckResponse.SERVING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    if lane is not None:
        lane.start(servicer.answers)
    layers = len(residency.layers)
    print(
        f"shoal-worker {node_id}: serving {len(scan.held)} experts of {layers} layers "
        f"({scan.manifest.model_type}, model {scan.manifest.fingerprint[:12]}) "
        f"on {args.host}:{port}",
        flush=True,
    )
    note(f"expert lane on port {lane.port}" if lane else
         "no expert lane (--no-lane): coordinators send every request on the gRPC stream")
    if args.host.startswith("127."):
        note("listening on loopback only (this machine); to serve other machines give --interface "
             "bridge0 (Thunderbolt Bridge) or --host ADDRESS")
    advertiser = None
    if addresses:
        advert = Advert(
            node_id=node_id, cluster=args.cluster, protocol=PROTOCOL_VERSION,
            model=scan.manifest.fingerprint, inventory=inventory_digest(residency.held()),
            experts=len(scan.held), memory_budget=memory_budget,
            free_disk=free_disk(scan.folders),
        )
        advertiser = Advertiser(
            advert, addresses, port,
            log=lambda m: print(f"shoal-worker {node_id}: {m}", flush=True),
        )
        advertiser.start()
    scrubber = None
    if args.scrub:
        scrub_rate = parse_rate(args.scrub)
        scrubber = Scrubber(residency, scrub_rate, log=note)
        scrubber.start()
        note(f"scrubbing expert files at up to {format_bytes(scrub_rate)}/s")
    # Python runs a signal's handler in the main thread, but the kernel may deliver SIGTERM to
    # any of gRPC's or MLX's threads, and then nothing interrupts a wait without a timeout:
    # wake every second to let the handler run.
    while not stop.wait(1.0):
        pass
    liveness.enter_graceful_shutdown()  # coordinators see NOT_SERVING while we drain
    if advertiser is not None:
        advertiser.close()
    if scrubber is not None:
        scrubber.close()
    if lane is not None:
        lane.close()
    server.stop(grace=2).wait(5)
    print(f"shoal-worker {node_id}: stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    launch_directly()  # before any kernel: MLX reads it once (engine/process.py)
    guard_standard_streams()  # `shoal-worker | head` must not end the worker
    args = parse_args(argv)
    try:
        serve(args)
    except (ShoalError, OSError) as e:
        print(f"shoal-worker: error: {worded(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    # Stopped cleanly (a signal): end here, without the interpreter's teardown. A thread that
    # ran MLX's compiled functions frees its compile cache as the thread ends, which takes the
    # GIL; when that lands while the interpreter finalizes, the process aborts (SIGABRT,
    # "terminate called without an active exception", 2 stops in 6 with a coordinator
    # connected). Everything that needed stopping has stopped; only output is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
