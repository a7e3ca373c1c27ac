"""The shoal-worker command: parse arguments, load the stores, serve the expert service."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.advert import Advert, inventory_digest
from engine.auth import CredentialChecker, load_secret, secret_path
from engine.cache_policy import format_bytes
from engine.errors import ShoalError, worded
from engine.interfaces import announced_addresses, listen_host
from engine.pipes import guard_standard_streams
from engine.process import launch_directly, raise_file_limit
from engine.store_lock import hold_for_serving
from engine.tls import Identity
from proto import (
    HANDSHAKE_SECONDS,
    PROTOCOL_VERSION,
    SERVER_OPTIONS,
    SERVICE,
    add_expert_service,
    server_credentials,
)
from proto.lane import server_context
from worker.advertise import Advertiser, load_node_id, node_id_path
from worker.grpc_gate import Gate
from worker.interceptors import AuthInterceptor, BoundedErrors, PeerLimit
from worker.lane_server import LaneServer
from worker.open_stores import open_residency
from worker.options import check_args, parse_args
from worker.residency import Residency
from worker.scrub import Scrubber, parse_rate
from worker.service import ExpertServicer
from worker.store import free_disk
from worker.threads import started

MAX_CALLS = 64  # calls at once, all peers together; gRPC refuses more (RESOURCE_EXHAUSTED)
# Files kept free of the gRPC port's connections: the expert lane's, expert files, logs.
FILES_SPARE = 1024


def connection_cap(file_limit: int) -> int:
    """Connections the gRPC port holds at once, all peers together, in a process that may
    open `file_limit` files: each takes three (the client's, the relay's and gRPC's end of
    it), out of FILES_SPARE fewer, or half of a limit under twice that; 0 (no cap) where the
    limit is not known."""
    return max(file_limit - FILES_SPARE, file_limit // 2) // 3


class GatedServer:
    """The gRPC server behind its front door (worker/grpc_gate.py): what grpc.Server does,
    with the door opened at start and closed to new connections at stop."""

    def __init__(self, server: grpc.Server, gate: Gate, upstream: int) -> None:
        self.server, self.gate, self._upstream = server, gate, upstream

    def __getattr__(self, name: str):
        return getattr(self.server, name)

    def start(self) -> None:
        self.server.start()
        self.gate.start(("127.0.0.1", self._upstream))

    def stop(self, grace: float | None) -> threading.Event:
        self.gate.stop_accepting()
        return self.server.stop(grace)


def bind(
    host: str, port: int, executor: futures.Executor, checker: CredentialChecker,
    identity: Identity, max_connections: int = 0,
) -> tuple[GatedServer, int]:
    """A gRPC server that owns host:port alone, bound before any expert is loaded, serving
    TLS only (docs/security.md), holding at most `max_connections` connections (0: no cap).

    The port is its front door's (worker/grpc_gate.py), which caps the connections still in
    their handshake per source address; gRPC itself listens on a loopback port, with
    SO_REUSEPORT off (gRPC's default would let a second server share it) and the same cap
    in all: beyond it a new connection is closed at once, so that a flood keeps the process
    off its file limit, where it could open no expert file.
    """
    log = lambda m: print(f"shoal-worker: {m}", file=sys.stderr, flush=True)  # noqa: E731
    gate = Gate(host, port, proving=HANDSHAKE_SECONDS + 1, identity=identity,
                max_connections=max_connections, log=log)
    options = [*SERVER_OPTIONS, ("grpc.so_reuseport", 0)]
    if max_connections:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    server = grpc.server(
        executor,
        interceptors=[BoundedErrors(), AuthInterceptor(checker),
                      PeerLimit(checker, gate=gate)],
        options=options,
        maximum_concurrent_rpcs=MAX_CALLS,
    )
    try:
        upstream = server.add_secure_port("127.0.0.1:0", server_credentials(identity))
    except RuntimeError:
        upstream = 0
    if upstream == 0:
        raise ShoalError("cannot listen on a loopback port for the gRPC server behind "
                         f"{host}:{port}")
    return GatedServer(server, gate, upstream), gate.port


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
    # All started now: gRPC's serving thread dies where it cannot start one for a call.
    executor = started(futures.ThreadPoolExecutor(max_workers=MAX_CALLS + 8,
                                                  thread_name_prefix="rpc"), MAX_CALLS + 8)
    checker = CredentialChecker(secret)  # one memory of used nonces for both listeners
    server, port = bind(args.host, args.port, executor, checker, identity,
                        connection_cap(file_limit))
    lane = None
    residency = None
    try:
        if not args.no_lane:
            lane = open_lane(args, port, lambda lane_port: LaneServer(
                args.host, lane_port, server_context(identity), checker, identity,
                log=lambda m: print(f"shoal-worker: {m}", file=sys.stderr, flush=True),
                spin=args.spin_us / 1e6, idle_seconds=args.lane_idle_seconds,
                message_seconds=args.lane_message_seconds))
        residency = load(args)
        run(args, server, port, residency, addresses, checker, lane)
    finally:
        # Each step on its own: one that fails (no thread can be started) skips no other.
        if lane is not None:
            _quietly(lane.close)
        _quietly(lambda: server.stop(grace=None).wait(5))
        # The calls still running were cancelled by stop(); give their threads a bounded while.
        _quietly(lambda: _bounded(lambda: executor.shutdown(cancel_futures=True), 5))
        if residency is not None:
            _quietly(residency.close)


def open_lane(args: argparse.Namespace, port: int,
              listen: Callable[[int], LaneServer]) -> LaneServer:
    """The expert lane on --lane-port, which must be free; without it on the gRPC port + 1,
    or, where another process has that one, on any free port: coordinators learn the lane's
    port from the inventory, so only a port the user asked for is worth refusing to start."""
    if args.lane_port is not None or not args.port:
        return listen(args.lane_port or 0)
    if port + 1 < 65536:
        try:
            return listen(port + 1)
        except ShoalError:
            pass
    lane = listen(0)
    print(f"shoal-worker: port {port + 1} (the gRPC port + 1) is taken: the expert lane "
          f"listens on port {lane.port}, announced to coordinators in the inventory",
          file=sys.stderr, flush=True)
    return lane


def _quietly(step) -> None:
    try:
        step()
    except Exception as e:
        print(f"shoal-worker: warning: while stopping: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def _bounded(step, seconds: float) -> None:
    """`step` in a thread of its own, waited for at most `seconds`."""
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(seconds)


def load(args: argparse.Namespace) -> Residency:
    """Scan (and verify) the stores and set up the memory budget."""
    hold_for_serving(args.store)  # `shoal shard` will not write them while this runs
    return open_residency(args.store, args.memory_budget, verify=not args.no_verify,
                          readers=args.readers, verify_reads=not args.no_verify_reads,
                          admission=args.cache_admission == "heat",
                          read_limit=parse_rate(args.read_limit, "--read-limit")
                          if args.read_limit else None)


def run(
    args: argparse.Namespace, server: GatedServer, port: int, residency: Residency,
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
    print(f"shoal-worker {node_id}: stopping: the calls in flight get up to "
          f"{args.drain_seconds:g} s to finish", file=sys.stderr, flush=True)
    liveness.enter_graceful_shutdown()  # coordinators see NOT_SERVING while we drain
    if advertiser is not None:
        _quietly(advertiser.close)
    if scrubber is not None:
        _quietly(scrubber.close)
    if lane is not None:  # a layer call being computed is answered first
        _quietly(lambda: lane.close(drain=args.drain_seconds))
    _quietly(lambda: server.stop(grace=args.drain_seconds).wait(args.drain_seconds + 3))
    servicer.files.burst.flush()  # the drains and drops not said yet
    print(f"shoal-worker {node_id}: stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    launch_directly()  # before any kernel: MLX reads it once (engine/process.py)
    guard_standard_streams()  # `shoal-worker | head` must not end the worker
    args = parse_args(argv)
    code = 0
    try:
        serve(args)
    except (ShoalError, OSError) as e:
        print(f"shoal-worker: error: {worded(e)}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before it served (while loading the experts)
        print("\nshoal-worker: interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # said in a line, and the process still ends
        print(f"shoal-worker: error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    # End here, without the interpreter's teardown. A thread that ran MLX's compiled functions
    # frees its compile cache as the thread ends, which takes the GIL; when that lands while
    # the interpreter finalizes, the process aborts (SIGABRT, "terminate called without an
    # active exception"); and the teardown joins every pool thread, which a call still
    # blocked in would hold forever. Everything that needed stopping has stopped.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
