"""A worker's expert lane that breaks on the way (its TLS handshake cut or reset, not refused):
the coordinator goes on over gRPC for that worker and says why, once, never naming a cluster
mismatch that is not there."""

import contextlib
import socket
import struct
import threading

import pytest

from coordinator.dataplane.link import Transport
from coordinator.decoding.generate import open_remote_model
from engine.auth import load_secret
from engine.sharding import shard
from tests.integration.test_equivalence import PROMPT, greedy_tokens


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("lane-fallback") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)  # one store: out/experts
    return out


class _Cutter:
    """A port that takes a lane's first bytes (its ClientHello) and then closes the
    connection (`cut`) or resets it (`reset`): a handshake broken on the way, not refused."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            connection.settimeout(5)
            with contextlib.suppress(OSError):
                connection.recv(4096)
                if self.how == "reset":
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                          struct.pack("ii", 1, 0))
            connection.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("how", ["cut", "reset"])
def test_a_lane_handshake_cut_on_the_way_falls_back_to_grpc_and_says_so_once(
    how, sharded, start_worker, secret_file, capfd
):
    """Not taken for another cluster's identity: the run goes on over gRPC, and one line
    names the lane's failure."""
    worker = start_worker([sharded / "experts"], "--no-advertise")
    cutter = _Cutter(how)
    remote = open_remote_model(sharded, [worker.address], load_secret(secret_file))
    try:
        remote.cluster.links[0].lane_address = cutter.address
        tokens = greedy_tokens(remote.model, PROMPT, 6)
        assert not remote.cluster.links[0].uses_lane
    finally:
        remote.close()
        cutter.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if "lane" in line]
    assert len(lines) == 1, lines
    assert "using gRPC for this worker" in lines[0]
    assert "TLS identity" not in lines[0] and "secret" not in lines[0]
    if how == "cut":
        assert "cut during the TLS handshake" in lines[0], lines[0]
    alone = open_remote_model(sharded, [worker.address], load_secret(secret_file),
                              transport=Transport("grpc"))
    try:
        assert tokens == greedy_tokens(alone.model, PROMPT, 6)
    finally:
        alone.close()
