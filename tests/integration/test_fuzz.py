"""A seeded fuzz of every RPC of a real worker: a few hundred malformed or hostile requests,
each answered with a clear status (never UNKNOWN, which means an unhandled exception), then a
correct request still gets the right answer and the worker's memory is back near its start."""

import subprocess

import grpc
import numpy as np
import pytest

from coordinator.dataplane.link import WorkerLink
from engine.auth import load_secret
from engine.manifest import read_manifest
from engine.sharding import shard
from proto import COMPUTE, shoal_pb2
from proto.wire import decode
from tests.wire import tensor_fields

SEED = 1234
ROUNDS = 40  # per RPC: 8 RPCs, 320 requests
# What a refusal may answer. INTERNAL only for bytes that are not the message at all (gRPC's
# own "Exception deserializing request"); UNKNOWN never.
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS}
UNPARSABLE = CLEAR | {grpc.StatusCode.INTERNAL}
DTYPES = ["float32", "bfloat16", "float16", "int32", "int64", "", "x" * 300, "float32\0"]


def rss_kib(pid: int) -> int:
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                              text=True, check=True).stdout.split()[0])


def code_of(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            for _ in result:
                pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def tensor(rng: np.random.Generator, width: int) -> dict:
    shape = [int(rng.choice([0, 1, 2, width, -1, 2**31, 2**62]))
             for _ in range(int(rng.integers(0, 4)))]
    size = int(rng.choice([0, 4, 8 * width, 1000]))
    return {"dtype": str(rng.choice(DTYPES)), "shape": shape, "data": rng.bytes(size)}


@pytest.mark.slow
def test_a_worker_answers_every_malformed_request_clearly_and_still_serves(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    sharded = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    manifest = read_manifest(sharded)
    width = manifest.config["hidden_size"]
    worker = start_worker([sharded / "experts"], "--no-advertise")
    link = WorkerLink(worker.address, load_secret(secret_file))
    stub, meta = link._stub, link.metadata
    rng = np.random.default_rng(SEED)
    layers = [layer.layer for layer in manifest.layers]

    def good_request() -> shoal_pb2.ExpertRequest:
        return shoal_pb2.ExpertRequest(
            seq=7, layer=layers[0],
            hidden=tensor_fields(np.ones((1, width), np.float32), "float32"),
            rows=tensor_fields(np.zeros(2, np.int32), "int32"),
            experts=tensor_fields(np.array([0, 1], np.int32), "int32"))

    def compute_once(request) -> np.ndarray:
        reply = next(stub.Compute(iter([request]), metadata=meta("Compute"), timeout=60))
        return decode(reply.output, what="output", ndim=2)

    expected = compute_once(good_request())
    before = rss_kib(worker.proc.pid)

    def some_id() -> int:
        return int(rng.choice([*layers, 0, 1, 7, 2**31 - 1, 2**32 - 1]))

    def compute():
        request = shoal_pb2.ExpertRequest(
            seq=int(rng.integers(0, 2**63)), layer=some_id(), hidden=tensor(rng, width),
            rows=tensor(rng, width), experts=tensor(rng, width))
        return stub.Compute(iter([request]), metadata=meta("Compute"), timeout=30)

    def file_request():
        return shoal_pb2.ExpertFileRequest(layer=some_id(), expert=some_id(),
                                           offset=int(rng.integers(0, 2**63)))

    def push():
        chunks = [shoal_pb2.ExpertChunk(layer=some_id(), expert=some_id(),
                                        offset=int(rng.integers(0, 2**20)),
                                        data=rng.bytes(int(rng.integers(0, 4096))),
                                        total_bytes=int(rng.integers(0, 2**40)),
                                        sha256=rng.bytes(8).hex())
                  for _ in range(int(rng.integers(0, 3)))]
        return stub.PushExpert(iter(chunks), metadata=meta("PushExpert"), timeout=30)

    def drop():
        # Deleting a real expert is a legitimate call for a credential holder: only held ids
        # are drained and kept, and any phase goes to ids the worker does not hold.
        layer, expert = some_id(), some_id()
        held = (layer, expert) in {(e.layer, e.expert) for e in manifest.experts}
        phase = int(rng.choice([1, 3] if held else [0, 1, 2, 3, 9]))
        quiet = float(rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e308]))
        return stub.DropExpert(shoal_pb2.DropRequest(layer=layer, expert=expert, phase=phase,
                                                     quiet_seconds=quiet),
                               metadata=meta("DropExpert"), timeout=30)

    calls = {
        "Compute": compute,
        "GetInventory": lambda: stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=30,
                                                  metadata=meta("GetInventory")),
        "GetStats": lambda: stub.GetStats(shoal_pb2.StatsRequest(), timeout=30,
                                          metadata=meta("GetStats")),
        "GetHeat": lambda: stub.GetHeat(shoal_pb2.HeatRequest(), timeout=30,
                                        metadata=meta("GetHeat")),
        "ExpertFileStatus": lambda: stub.ExpertFileStatus(
            file_request(), metadata=meta("ExpertFileStatus"), timeout=30),
        "ReadExpert": lambda: stub.ReadExpert(file_request(), metadata=meta("ReadExpert"),
                                              timeout=30),
        "PushExpert": push,
        "DropExpert": drop,
    }
    seen: dict[str, set] = {}
    try:
        for name, call in calls.items():
            raw = link._channel.unary_unary(f"/shoal.v1.ExpertService/{name}")
            for _ in range(ROUNDS):
                code = code_of(call)
                assert code in CLEAR, f"{name} answered {code}"
                seen.setdefault(name, set()).add(code)
            for _ in range(3):  # bytes that are not the message at all
                code = code_of(lambda raw=raw, name=name: raw(rng.bytes(64), timeout=30,
                                                               metadata=meta(name)))
                assert code in UNPARSABLE, f"{name} answered {code} to garbage"
        assert grpc.StatusCode.INVALID_ARGUMENT in seen["Compute"]
        # Compute's bytes are read by Shoal's own reader (proto/wire.py: split_message): a
        # message cut short is refused as such, whatever field the cut falls in.
        whole = good_request().SerializeToString()
        compute_bytes = link._channel.stream_stream(COMPUTE)
        for cut in (1, 5, len(whole) // 2, len(whole) - 1):
            with pytest.raises(grpc.RpcError) as refused:
                next(compute_bytes(iter([whole[:cut]]), metadata=meta("Compute"), timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cut short" in refused.value.details()
        assert np.array_equal(compute_once(good_request()), expected)  # still right
        after = rss_kib(worker.proc.pid)
        assert after < before * 1.5 + 64 * 1024, (before, after)  # KiB
    finally:
        link.close()
