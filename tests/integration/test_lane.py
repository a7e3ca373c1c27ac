"""The expert lane against real workers: Compute's messages on it give the same bits as on
the gRPC stream (the fallback, kept), and its listener lets nobody in, or lock anyone out,
without the cluster's identity and a fresh credential."""

import os
import socket
import ssl
import subprocess
import sys
import time

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from coordinator.dataplane.link import Transport, WorkerLink
from coordinator.decoding.generate import open_remote_model
from coordinator.decoding.report import members_report
from engine.auth import create_secret, load_secret, make_credential
from engine.errors import Unauthenticated
from engine.manifest import read_manifest
from engine.sharding import shard
from proto import COMPUTE, EXPERT_REPLY, EXPERT_REQUEST, REQUEST_LIMIT, shoal_pb2
from proto import lane as wire
from tests.integration.test_equivalence import PROMPT, greedy_tokens
from tests.wire import tensor_fields

REPLIES = {wire.MESSAGE: 1 << 30, wire.ERROR: 1 << 16, wire.READY: 0}


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("lane") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False, workers=2)
    return out


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    reference, _ = load_model(tiny_checkpoint("qwen3_moe"))
    return greedy_tokens(reference, PROMPT, 8)


def lane_of(worker, secret_file) -> tuple[str, int, WorkerLink]:
    link = WorkerLink(worker.address, load_secret(secret_file))
    inventory = link.fetch_inventory(timeout=10)
    assert inventory.lane_port > 0
    host = worker.address.rpartition(":")[0]
    return host, inventory.lane_port, link


def open_lane(host: str, port: int, secret, credential: str | None = None,
              node: str = "") -> ssl.SSLSocket:
    """A lane with a HELLO: `credential`, else a fresh one made for the worker `node`."""
    sock = wire.connect(host, port, wire.client_context(secret.identity), 5,
                        secret.identity)
    sock.settimeout(10)
    hello = credential or make_credential(secret, wire.LANE_METHOD, node=node)
    wire.write_frame(sock, wire.HELLO, hello.encode())
    return sock


def ready_lane(host: str, port: int, secret, node: str) -> ssl.SSLSocket:
    """A lane with a fresh credential for the worker `node`, past its READY."""
    sock = open_lane(host, port, secret, node=node)
    assert wire.read_frame(sock, REPLIES)[0] == wire.READY
    return sock


def answer_of(sock: socket.socket) -> bytes:
    """What the worker sends next: b"" when it closed the connection (or reset it)."""
    try:
        return sock.recv(1024)
    except (ConnectionResetError, ssl.SSLEOFError):
        return b""


def request_bytes(manifest, inventory, seq: int = 1) -> bytes:
    """A right request for two experts the worker holds."""
    width = manifest.config["hidden_size"]
    held = sorted((e.layer, e.expert) for e in inventory.experts)
    layer = held[0][0]
    experts = [e for lay, e in held if lay == layer][:2]
    return EXPERT_REQUEST.write(
        shoal_pb2.ExpertRequest(seq=seq, layer=layer),
        hidden=(np.ones((1, width), np.float32), "float32"),
        rows=(np.zeros(2, np.int32), "int32"),
        experts=(np.array(experts, np.int32), "int32"))


@pytest.mark.slow
def test_the_lane_and_the_grpc_fallback_give_mlx_lms_tokens(
    sharded, expected, start_worker, secret_file
):
    workers = [start_worker([sharded / "worker-0"], "--no-advertise", "--spin-us", "300"),
               start_worker([sharded / "worker-1"], "--no-advertise", "--no-lane")]
    secret = load_secret(secret_file)
    for transport, lanes in ((Transport("lane"), [True, False]),
                             (Transport("lane", spin=50e-6), [True, False]),
                             (Transport("grpc"), [False, False])):
        remote = open_remote_model(sharded, [w.address for w in workers], secret,
                                   transport=transport)
        try:
            assert greedy_tokens(remote.model, PROMPT, 8) == expected, transport
            assert [link.uses_lane for link in remote.cluster.links] == lanes, transport
            served = remote.dispatcher.stats.worker_requests
            assert all(served[w.address] > 0 for w in workers), served
            # --stats names the path each member took
            paths = {a: m["path"] for a, m in members_report(remote.dispatcher.stats).items()}
            assert paths == {w.address: "lane" if lane else "grpc"
                             for w, lane in zip(workers, lanes, strict=True)}, transport
        finally:
            remote.close()


@pytest.mark.slow
def test_a_lane_that_cannot_be_opened_falls_back_to_grpc_and_says_so(
    sharded, expected, start_worker, secret_file, capfd
):
    workers = [start_worker([sharded / f"worker-{k}"], "--no-advertise") for k in range(2)]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on: the lane cannot be opened
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        remote.cluster.links[1].lane_address = f"127.0.0.1:{closed.getsockname()[1]}"
        assert greedy_tokens(remote.model, PROMPT, 8) == expected
        paths = {a: m["path"] for a, m in members_report(remote.dispatcher.stats).items()}
        assert paths[workers[0].address] == "lane"
        assert paths[workers[1].address].startswith("grpc (lane refused: worker ")
        assert "using gRPC for this worker" in capfd.readouterr().err
    finally:
        remote.close()
        closed.close()


def test_a_lane_refuses_strangers_before_reading_their_requests(
    sharded, start_worker, secret_file, tmp_path
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    host, port, link = lane_of(worker, secret_file)
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    try:
        # plaintext: the TLS handshake fails, nothing is answered
        with socket.create_connection((host, port), timeout=5) as plain:
            plain.sendall(wire.HEADER.pack(16, wire.MESSAGE) + b"x" * 16)
            plain.settimeout(10)
            assert answer_of(plain)[:1] in (b"", b"\x15")  # closed, or a TLS alert
        # another cluster's identity: refused by the handshake, on either side
        other = load_secret(create_secret(tmp_path / "other"))
        with pytest.raises((ssl.SSLError, OSError)):
            sock = open_lane(host, port, other)
            wire.read_frame(sock, REPLIES)
        # this cluster's certificate, but a forged or a replayed credential
        credential = make_credential(secret, wire.LANE_METHOD, node=link.node_id)
        for forged in ("1.2.3.4", make_credential(secret, "/other/Method", node=link.node_id),
                       make_credential(secret, wire.LANE_METHOD),  # made for no worker
                       make_credential(secret, wire.LANE_METHOD, node="another-worker"),
                       credential):
            sock = open_lane(host, port, secret, forged)
            kind, payload = wire.read_frame(sock, REPLIES)
            if forged is credential and kind == wire.READY:  # its first use is fine
                sock.close()
                sock = open_lane(host, port, secret, forged)
                kind, payload = wire.read_frame(sock, REPLIES)
            assert kind == wire.ERROR, forged
            code, message = wire.read_error(payload)
            assert code == grpc.StatusCode.UNAUTHENTICATED, message
            sock.close()
        # a HELLO frame larger than any credential is refused before its body is read
        sock = wire.connect(host, port, wire.client_context(secret.identity), 5,
                            secret.identity)
        sock.sendall(wire.HEADER.pack(1 << 30, wire.HELLO))
        sock.settimeout(10)
        assert answer_of(sock) == b""
        # a request frame over the limit, once authenticated: refused, named, lane closed
        sock = ready_lane(host, port, secret, link.node_id)
        sock.sendall(wire.HEADER.pack(REQUEST_LIMIT + 1, wire.MESSAGE))
        kind, payload = wire.read_frame(sock, REPLIES)
        assert kind == wire.ERROR and "over the limit" in wire.read_error(payload)[1]
        # and the worker still serves a right request on a new lane
        sock = ready_lane(host, port, secret, link.node_id)
        wire.write_frame(sock, wire.MESSAGE, request_bytes(manifest, link.inventory, seq=9))
        kind, payload = wire.read_frame(sock, REPLIES)
        reply, tensors = EXPERT_REPLY.read(bytes(payload), "reply")
        width = manifest.config["hidden_size"]
        assert kind == wire.MESSAGE and reply.seq == 9
        assert tuple(tensors["output"].shape) == (2, width)
        sock.close()
    finally:
        link.close()


def test_malformed_requests_on_a_lane_are_refused_clearly_and_the_worker_serves_on(
    sharded, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    host, port, link = lane_of(worker, secret_file)
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    rng = np.random.default_rng(7)
    good = request_bytes(manifest, link.inventory)
    width = manifest.config["hidden_size"]
    cases = [rng.bytes(int(rng.integers(1, 200))) for _ in range(20)]
    cases += [good[:cut] for cut in (1, 5, len(good) // 2, len(good) - 1)]
    cases += [shoal_pb2.ExpertRequest(seq=3, layer=manifest.layers[0].layer,
                                      hidden=tensor_fields(np.ones((1, width), np.float32),
                                                           dtype),
                                      rows=tensor_fields(np.zeros(2, np.int32), "int32"),
                                      experts=tensor_fields(np.array([0, 99], np.int32),
                                                            "int32")).SerializeToString()
              for dtype in ("float32", "int64", "x" * 300)]
    try:
        for case in cases:
            sock = ready_lane(host, port, secret, link.node_id)
            wire.write_frame(sock, wire.MESSAGE, case)
            kind, payload = wire.read_frame(sock, REPLIES)
            assert kind == wire.ERROR, case[:40]
            code, message = wire.read_error(payload)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), message
            assert len(message) < 2000
            assert answer_of(sock) == b""  # the lane ends after a refusal
            sock.close()
        assert link.fetch_inventory(timeout=5).experts  # still serving
    finally:
        link.close()


def test_idle_connections_cannot_lock_a_coordinator_out_of_the_lane(
    sharded, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    host, port, link = lane_of(worker, secret_file)
    manifest = read_manifest(sharded)
    idle = []
    try:
        for _ in range(400):  # never a byte: as many as a flood from this host holds
            idle.append(socket.create_connection((host, port), timeout=5))
        started = time.monotonic()
        link.send(request_bytes(manifest, link.inventory, seq=5), timeout=5)
        reply, _ = EXPERT_REPLY.read(link.receive(timeout=5), "reply")
        assert reply.seq == 5 and link.uses_lane
        assert time.monotonic() - started < 2
        fds = f"/proc/{worker.proc.pid}/fd"
        if os.path.isdir(fds):  # the worker holds no descriptor per idle connection
            assert len(os.listdir(fds)) < 200, len(os.listdir(fds))
    finally:
        for sock in idle:
            sock.close()
        link.close()


def test_a_coordinator_of_another_cluster_is_told_so_at_the_lane(
    sharded, start_worker, secret_file, tmp_path
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    _, _, ours = lane_of(worker, secret_file)
    theirs = WorkerLink(worker.address, load_secret(create_secret(tmp_path / "other")))
    theirs.inventory = ours.inventory  # as if its handshake had got through
    try:
        with pytest.raises(Unauthenticated, match="TLS identity"):
            theirs.send(request_bytes(read_manifest(sharded), ours.inventory), timeout=5)
    finally:
        ours.close()
        theirs.close()


def test_a_prompt_pass_in_pieces_on_lanes_equals_the_whole_call(
    sharded, start_worker, secret_file
):
    workers = [start_worker([sharded / f"worker-{i}"], "--no-advertise") for i in range(2)]
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        prompt = mx.array([PROMPT * 8])
        whole = remote.model(prompt)
        remote.dispatcher.piece_pairs = 2  # many pieces a lane: replies owed while writing
        pieced = remote.model(prompt)
        assert mx.array_equal(whole, pieced)
        assert all(link.uses_lane for link in remote.cluster.links)
        assert remote.dispatcher.stats.prefill.requests > 8 * remote.dispatcher.stats.prefill.calls
    finally:
        remote.close()


def test_a_tensor_field_of_the_wrong_wire_type_is_refused_on_both_transports(
    sharded, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    host, port, link = lane_of(worker, secret_file)
    secret = load_secret(secret_file)
    # seq = 3, then `hidden` (field 3) as a varint: protobuf keeps such a field as an unknown
    # one, and a reader that took it as absent would answer nothing (a prefetch hint alone)
    data = b"\x08\x03\x18\x05"
    try:
        sock = ready_lane(host, port, secret, link.node_id)
        wire.write_frame(sock, wire.MESSAGE, data)
        kind, payload = wire.read_frame(sock, REPLIES)
        assert kind == wire.ERROR
        code, message = wire.read_error(payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "wire type 0" in message, message
        sock.close()
        compute = link._channel.stream_stream(COMPUTE, _registered_method=True)
        with pytest.raises(grpc.RpcError) as refused:
            next(compute(iter([data]), metadata=link.metadata("Compute"), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "wire type 0" in refused.value.details()
    finally:
        link.close()


def two_free_ports() -> tuple[int, socket.socket]:
    """A free port P and a listener holding P + 1 (bounded tries: ports come and go)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 1 >= 65536:
            continue
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port + 1))
        except OSError:
            taken.close()
            continue
        taken.listen()
        return port, taken
    raise AssertionError("no free pair of ports on loopback")


def test_a_taken_default_lane_port_moves_the_lane_and_the_inventory_says_where(
    sharded, start_worker, secret_file
):
    port, taken = two_free_ports()
    with taken:
        worker = start_worker([sharded / "worker-0"], "--no-advertise", "--port", str(port))
        host, lane_port, link = lane_of(worker, secret_file)
        try:
            assert lane_port != port + 1
            ready_lane(host, lane_port, load_secret(secret_file), link.node_id).close()
        finally:
            link.close()
        assert "is taken: the expert lane listens on port" in worker.log.read_text()
        # an explicit --lane-port that is taken is still an error, naming it
        refused = subprocess.run(
            [sys.executable, "-m", "worker.daemon", "--store", str(sharded / "worker-1"),
             "--no-advertise", "--secret-file", str(secret_file), "--port", "0",
             "--lane-port", str(port + 1)], capture_output=True, text=True, timeout=60,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert refused.returncode == 2
    assert f"cannot listen for the expert lane on 127.0.0.1:{port + 1}" in refused.stderr


def test_a_worker_of_another_cluster_is_refused_at_once_not_after_the_connect_timeout(
    sharded, start_worker, tmp_path
):
    from coordinator.dataplane.link import CONNECT_TIMEOUT

    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    stranger = WorkerLink(worker.address, load_secret(create_secret(tmp_path / "other")))
    started = time.monotonic()
    try:
        with pytest.raises(Unauthenticated, match="TLS identity"):
            stranger.fetch_inventory(timeout=CONNECT_TIMEOUT)
    finally:
        stranger.close()
    # the wait for a worker that is not up yet is CONNECT_TIMEOUT; this one answered
    assert time.monotonic() - started < CONNECT_TIMEOUT * 0.8
