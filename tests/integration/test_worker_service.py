"""A real worker process refuses bad input and unauthenticated calls, and stays up."""

import grpc
import numpy as np
import pytest

from engine.auth import load_secret, make_credential
from engine.sharding import shard
from proto import secure_channel, shoal_pb2, shoal_pb2_grpc
from tests.wire import tensor_fields

SERVICE = "/shoal.v1.ExpertService/"


@pytest.fixture
def worker(tiny_checkpoint, tmp_path, start_worker):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return start_worker([out / "worker-0"])


def credential(secret: bytes, method: str, node: str = "") -> list[tuple[str, str]]:
    """A call's credential; every one but GetInventory's names the worker (its node id)."""
    return [("shoal-auth", make_credential(secret, SERVICE + method, node=node))]


def request(layer=0, width=64, rows=(0,), experts=(0,), n=1, dtype="float32"):
    hidden = np.ones((n, width), np.float32)
    return shoal_pb2.ExpertRequest(
        seq=1, layer=layer, hidden=tensor_fields(hidden, dtype),
        rows=tensor_fields(np.array(rows, np.int32), "int32"),
        experts=tensor_fields(np.array(experts, np.int32), "int32"),
    )


def compute(stub, message, metadata):
    return list(stub.Compute(iter([message]), metadata=metadata, timeout=30))


def test_worker_refuses_bad_input_and_unauthenticated_calls_then_still_serves(
    worker, secret_file
):
    secret = load_secret(secret_file)
    channel = secure_channel(worker.address, load_secret(secret_file).identity, [])
    stub = shoal_pb2_grpc.ExpertServiceStub(channel)
    inventory = stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=30,
                                  metadata=credential(secret, "GetInventory"))

    def bound(method: str) -> list[tuple[str, str]]:
        return credential(secret, method, inventory.node_id)

    held = sorted((h.layer, h.expert) for h in inventory.experts)
    layer, expert = held[0]
    missing = next(e for e in range(8) if (layer, e) not in held)

    for metadata, hint in [
        ((), "missing"),
        (credential(b"w" * 64, "GetInventory"), "cluster secret"),
        (credential(secret, "Compute"), "cluster secret"),  # credential for another method
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=30, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert hint in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        compute(stub, request(layer, experts=(expert,)), ())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    bad = [
        (request(layer=77), "holds no experts of layer 77"),
        (request(layer, experts=(missing,)), f"does not hold expert(s) {missing}"),
        (request(layer, experts=(-3,)), "does not hold expert(s) -3"),
        (request(layer, width=63, experts=(expert,)), "width 63"),
        (request(layer, rows=(5,), experts=(expert,)), "outside the 1 hidden states"),
        (request(layer, rows=(0, 0), experts=(expert,)), "same length"),
        (request(layer, experts=(expert,), dtype="int32"), "not one of float32"),
    ]
    truncated = request(layer, experts=(expert,))
    truncated.hidden.data = truncated.hidden.data[:-1]
    bad.append((truncated, "needs 256 bytes, got 255"))
    for message, hint in bad:
        with pytest.raises(grpc.RpcError) as info:
            compute(stub, message, bound("Compute"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, hint
        assert hint in info.value.details()

    replies = compute(stub, request(layer, experts=(expert,)), bound("Compute"))
    assert replies[0].output.shape == [1, 64]
    assert worker.proc.poll() is None
    channel.close()


def test_numbers_that_are_not_numbers_and_huge_strings_get_short_clear_refusals(
    worker, secret_file
):
    """DropExpert's quiet_seconds of NaN, -1 or infinity is INVALID_ARGUMENT and deletes
    nothing; a 64 KiB string a client sent is not echoed back whole (it used to outgrow the
    client's metadata limit, which then saw a transport error, not the refusal)."""
    secret = load_secret(secret_file)
    channel = secure_channel(worker.address, load_secret(secret_file).identity, [])
    stub = shoal_pb2_grpc.ExpertServiceStub(channel)
    inventory = stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=30,
                                  metadata=credential(secret, "GetInventory"))

    def bound(method: str) -> list[tuple[str, str]]:
        return credential(secret, method, inventory.node_id)

    layer, expert = inventory.experts[0].layer, inventory.experts[0].expert
    drain = shoal_pb2.DropRequest(layer=layer, expert=expert, phase=shoal_pb2.DropRequest.DRAIN)
    stub.DropExpert(drain, timeout=30, metadata=bound("DropExpert"))
    for quiet in (float("nan"), -1.0, float("inf"), -float("inf")):
        delete = shoal_pb2.DropRequest(layer=layer, expert=expert, quiet_seconds=quiet,
                                       phase=shoal_pb2.DropRequest.DELETE)
        with pytest.raises(grpc.RpcError) as info:
            stub.DropExpert(delete, timeout=30, metadata=bound("DropExpert"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, quiet
        assert "quiet_seconds" in info.value.details()
    status = stub.ExpertFileStatus(shoal_pb2.ExpertFileRequest(layer=layer, expert=expert),
                                   timeout=30, metadata=bound("ExpertFileStatus"))
    assert status.state == shoal_pb2.ExpertFileState.DRAINING  # not deleted

    message = request(layer=layer, experts=(expert,))
    message.hidden.dtype = "x" * 65536
    with pytest.raises(grpc.RpcError) as info:
        compute(stub, message, bound("Compute"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(info.value.details()) < 2100
    assert "more characters" in info.value.details()
    assert compute(stub, request(layer=layer, experts=(expert,)), bound("Compute"))
    channel.close()
