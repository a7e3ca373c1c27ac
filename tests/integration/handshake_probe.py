"""A helper process for the fairness tests: opens COUNT new TLS connections to a worker's gRPC
port one after another, each making one liveness check with the cluster's credential within
TIMEOUT seconds, and prints one JSON line: how many succeeded, and the slowest. With --stream,
it instead sends layer calls back to back on one expert lane for that many seconds and prints
how many were answered and the longest wait for a reply.

    python -m tests.integration.handshake_probe 10.251.0.2:50551 SECRET_FILE --count 40
    python -m tests.integration.handshake_probe 10.251.0.2:50551 SECRET --stream 10 --model M
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.dataplane.link import WorkerLink
from engine.auth import HEALTH_CHECK, METADATA_KEY, Secret, load_secret, make_credential
from engine.manifest import read_manifest
from proto import EXPERT_REQUEST, SERVICE, secure_channel, shoal_pb2


def stream(address: str, secret: Secret, model: Path, seconds: float) -> dict:
    """Layer calls back to back on one expert lane for `seconds`: how many were answered,
    and the longest from one reply (or the first request) to the next."""
    link = WorkerLink(address, secret)
    try:
        held = sorted((e.layer, e.expert) for e in link.fetch_inventory().experts)
        width = read_manifest(model).config["hidden_size"]
        layer = held[0][0]
        experts = np.array([e for lay, e in held if lay == layer][:2], np.int32)
        started = last = time.monotonic()
        answered, longest, seq = 0, 0.0, 0
        while last - started < seconds:
            seq += 1
            link.send(EXPERT_REQUEST.write(
                shoal_pb2.ExpertRequest(seq=seq, layer=layer),
                hidden=(np.ones((1, width), np.float32), "float32"),
                rows=(np.zeros(experts.size, np.int32), "int32"), experts=(experts, "int32")),
                timeout=10)
            link.receive(timeout=10)
            now = time.monotonic()
            answered, longest, last = answered + 1, max(longest, now - last), now
        return {"answered": answered, "longest_gap": round(longest, 3), "lane": link.uses_lane,
                "seconds": round(last - started, 3)}
    finally:
        link.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("secret_file", type=Path)
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--gap", type=float, default=0.2)
    p.add_argument("--stream", type=float, default=0.0, help="seconds of layer calls")
    p.add_argument("--model", type=Path, help="the sharded model (for --stream)")
    args = p.parse_args()
    secret = load_secret(args.secret_file)
    if args.stream:
        print(json.dumps(stream(args.address, secret, args.model, args.stream)), flush=True)
        return
    succeeded, failures, took = 0, [], []
    for _ in range(args.count):
        # a subchannel of its own: gRPC would otherwise share one connection among channels
        channel = secure_channel(args.address, secret.identity,
                                 [("grpc.use_local_subchannel_pool", 1)])
        started = time.monotonic()
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=args.timeout,
                metadata=[(METADATA_KEY, make_credential(secret, HEALTH_CHECK))])
            succeeded += 1
        except grpc.RpcError as e:
            failures.append(e.code().name)
        took.append(time.monotonic() - started)
        channel.close()
        time.sleep(args.gap)
    print(json.dumps({"count": args.count, "succeeded": succeeded, "failures": failures,
                      "median": round(sorted(took)[len(took) // 2], 3),
                      "slowest": round(max(took), 3)}), flush=True)


if __name__ == "__main__":
    main()
