"""The shoal-worker command: parse arguments, load the stores, serve the expert service."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import uuid
from concurrent import futures
from pathlib import Path

import grpc

from engine.auth import CredentialChecker, load_secret, secret_path
from engine.errors import ShoalError
from proto import GRPC_OPTIONS, shoal_pb2_grpc
from worker.residency import Residency
from worker.service import AuthInterceptor, ExpertServicer
from worker.store import scan_stores

DEFAULT_PORT = 50551


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
        "--host", default="0.0.0.0",
        help="address to listen on (default 0.0.0.0: every interface; 127.0.0.1 for this Mac only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one and prints it)",
    )
    parser.add_argument(
        "--secret-file", metavar="PATH",
        help="cluster secret (default: $SHOAL_SECRET_FILE, else ~/.config/shoal/secret)",
    )
    parser.add_argument("--node-id", help="name reported to the coordinator (default: host name)")
    parser.add_argument(
        "--no-verify", action="store_true",
        help="skip checksum verification at start (sizes are still checked)",
    )
    return parser.parse_args(argv)


def serve(args: argparse.Namespace) -> None:
    secret = load_secret(secret_path(args.secret_file))
    scan = scan_stores(args.store, verify=not args.no_verify)
    for problem in scan.problems:
        print(f"shoal-worker: warning: {problem}", file=sys.stderr, flush=True)
    if not scan.held:
        raise ShoalError(f"no intact expert files in {', '.join(map(str, args.store))}")
    residency = Residency(scan)
    node_id = args.node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        interceptors=[AuthInterceptor(CredentialChecker(secret))],
        options=GRPC_OPTIONS,
    )
    shoal_pb2_grpc.add_ExpertServiceServicer_to_server(ExpertServicer(residency, node_id), server)
    try:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    except RuntimeError:
        port = 0
    if port == 0:
        where = f"{args.host}:{args.port}"
        raise ShoalError(f"cannot listen on {where} (port in use, or not an address of this host)")
    server.start()
    layers = len(residency.layers)
    print(
        f"shoal-worker {node_id}: serving {len(scan.held)} experts of {layers} layers "
        f"({scan.manifest.model_type}, model {scan.manifest.fingerprint[:12]}) "
        f"on {args.host}:{port}",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait(5)
    print(f"shoal-worker {node_id}: stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        serve(args)
    except ShoalError as e:
        print(f"shoal-worker: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
