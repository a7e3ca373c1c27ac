"""A helper process for the fairness tests: opens COUNT new TLS connections to a worker's gRPC
port one after another, each making one liveness check with the cluster's credential within
TIMEOUT seconds, and prints one JSON line: how many succeeded, and the slowest.

    python -m tests.integration.handshake_probe 10.251.0.2:50551 SECRET_FILE --count 40
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.auth import HEALTH_CHECK, METADATA_KEY, load_secret, make_credential
from proto import SERVICE, secure_channel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("secret_file", type=Path)
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--gap", type=float, default=0.2)
    args = p.parse_args()
    secret = load_secret(args.secret_file)
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
                      "slowest": round(max(took), 3)}), flush=True)


if __name__ == "__main__":
    main()
