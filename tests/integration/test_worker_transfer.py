"""Expert files moving in and out of a real worker process: a push in chunks is resumed from
its partial file, verified before it is renamed and served (no restart), a corrupt push is
discarded, a drained copy is still computed but no longer offered, it is deleted only once
quiet, and a request for it afterwards says it moved. GetHeat counts exactly."""

import time

import grpc
import numpy as np
import pytest

from coordinator.dataplane.link import WorkerLink
from engine.auth import METADATA_KEY, load_secret, make_credential
from engine.errors import CorruptData, InvalidInput, Moved, NotFound, ShoalError
from engine.manifest import read_manifest
from engine.sharding import shard
from proto import EXPERT_REPLY, shoal_pb2
from proto.wire import decode
from tests.wire import tensor_fields
from worker.transfer import partial_path

State = shoal_pb2.ExpertFileState


def chunks(key, data: bytes, offset: int, entry, size: int = 4096):
    yield shoal_pb2.ExpertChunk(layer=key[0], expert=key[1], offset=offset,
                                total_bytes=entry.bytes, sha256=entry.sha256)
    for start in range(offset, len(data), size):
        yield shoal_pb2.ExpertChunk(layer=key[0], expert=key[1], offset=start,
                                    data=data[start:start + size])


def compute(link: WorkerLink, key, hidden: np.ndarray) -> tuple[np.ndarray, int]:
    request = shoal_pb2.ExpertRequest(
        seq=1, layer=key[0], hidden=tensor_fields(hidden, "float32"),
        rows=tensor_fields(np.arange(len(hidden), dtype=np.int32), "int32"),
        experts=tensor_fields(np.full(len(hidden), key[1], dtype=np.int32), "int32"),
    )
    link.send(request.SerializeToString())  # protobuf's own bytes: the worker reads them too
    try:
        reply, tensors = EXPERT_REPLY.read(link.receive(timeout=60), "reply")
    finally:
        link.reset()
    return decode(tensors["output"], what="output", ndim=2), reply.inventory_version


def status(link: WorkerLink, key) -> shoal_pb2.ExpertFileState:
    return link.call("ExpertFileStatus", shoal_pb2.ExpertFileRequest(layer=key[0], expert=key[1]))


def drop(link: WorkerLink, key, phase, quiet: float = 0.3):
    return link.call("DropExpert", shoal_pb2.DropRequest(layer=key[0], expert=key[1],
                                                         phase=phase, quiet_seconds=quiet))


@pytest.fixture
def two_workers(tiny_checkpoint, tmp_path, start_worker, secret_file):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    secret = load_secret(secret_file)
    workers = [start_worker([out / f"worker-{k}"], "--no-advertise", "--node-id", f"t{k}")
               for k in range(2)]
    links = [WorkerLink(w.address, secret) for w in workers]
    yield out, links
    for link in links:
        link.close()


@pytest.mark.slow
def test_push_resume_verify_serve_drain_delete_and_heat(two_workers):
    out, (a, b) = two_workers
    manifest = read_manifest(out)
    held_a = {(h.layer, h.expert) for h in a.fetch_inventory().experts}
    version = a.inventory.inventory_version
    key, other = sorted({(e.layer, e.expert) for e in manifest.experts} - held_a)[:2]
    entry = manifest.expert(*key)
    data = (out / "worker-1" / entry.file).read_bytes()
    assert status(a, key).state == State.ABSENT

    # half a file, then a resume from where it stopped
    half = len(data) // 2
    reply = a.call("PushExpert", chunks(key, data[:half], 0, entry))
    assert (reply.state, reply.partial_bytes) == (State.PARTIAL, half)
    assert status(a, key).partial_bytes == half
    with pytest.raises(InvalidInput, match="only .* bytes have arrived"):
        a.call("PushExpert", chunks(key, data, half + 10, entry))
    assert not (out / "worker-0" / entry.file).exists()
    reply = a.call("PushExpert", chunks(key, data, half, entry))
    assert reply.state == State.SERVING
    final = out / "worker-0" / entry.file
    assert final.read_bytes() == data and not partial_path(final).exists()
    inventory = a.fetch_inventory()
    assert key in {(h.layer, h.expert) for h in inventory.experts}
    assert inventory.inventory_version > version

    # served without a restart, and bit for bit what the original holder computes
    hidden = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out_a, seen_version = compute(a, key, hidden)
    out_b, _ = compute(b, key, hidden)
    assert np.array_equal(out_a, out_b)
    assert seen_version == inventory.inventory_version

    # a corrupt push is thrown away; a push of another model's file is refused
    other_entry = manifest.expert(*other)
    bad = bytearray((out / "worker-1" / other_entry.file).read_bytes())
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptData, match="checksum"):
        a.call("PushExpert", chunks(other, bytes(bad), 0, other_entry))
    assert status(a, other).state == State.ABSENT
    assert not (out / "worker-0" / other_entry.file).exists()
    wrong = shoal_pb2.ExpertChunk(layer=other[0], expert=other[1], total_bytes=1, sha256="00")
    with pytest.raises(InvalidInput, match="not this model's"):
        a.call("PushExpert", iter([wrong]))

    # ReadExpert sends the verified file; a worker without it says so
    read = b"".join(c.data for c in a.call("ReadExpert", shoal_pb2.ExpertFileRequest(
        layer=key[0], expert=key[1], offset=100)))
    assert read == data[100:]
    with pytest.raises(grpc.RpcError) as info:
        list(b.call("ReadExpert", shoal_pb2.ExpertFileRequest(layer=sorted(held_a)[0][0],
                                                              expert=sorted(held_a)[0][1])))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    # drain: no longer offered, still computed; delete waits until it is quiet
    assert drop(a, key, shoal_pb2.DropRequest.DRAIN).state == State.DRAINING
    inventory = a.fetch_inventory()
    assert key not in {(h.layer, h.expert) for h in inventory.experts}
    assert key in {(h.layer, h.expert) for h in inventory.draining}
    assert np.array_equal(compute(a, key, hidden)[0], out_b)
    with pytest.raises(ShoalError, match="not deleted yet"):
        drop(a, key, shoal_pb2.DropRequest.DELETE)
    time.sleep(0.4)
    assert drop(a, key, shoal_pb2.DropRequest.DELETE).state == State.ABSENT
    assert not final.exists()
    with pytest.raises(Moved, match="moved to another worker"):
        compute(a, key, hidden)
    with pytest.raises(NotFound):
        drop(a, key, shoal_pb2.DropRequest.DRAIN)

    # exact heat: 3 tokens in each of the two computes of `key` that a served
    heat = a.call("GetHeat", shoal_pb2.HeatRequest())
    counts = {(h.layer, h.expert): h.tokens for h in heat.experts}
    assert counts == {key: 6} and heat.boot_id and heat.node_id == "t0"


def test_a_credential_made_for_one_worker_or_for_none_is_refused_by_another(
    two_workers, secret_file
):
    """Issue 28, item 8: every call but the inventory takes a credential bound to its worker's
    node id. A credential made for worker A, or for no worker, is UNAUTHENTICATED at worker B
    (whose expert stays put), while A takes the one made for it (A then refuses the request
    on its merits: it holds no such expert, the chunk is not this model's)."""
    _, (a, b) = two_workers
    secret = load_secret(secret_file)
    a.fetch_inventory()
    held_b = b.fetch_inventory().experts[0]
    file_request = shoal_pb2.ExpertFileRequest(layer=held_b.layer, expert=held_b.expert)
    drain = shoal_pb2.DropRequest(layer=held_b.layer, expert=held_b.expert,
                                  phase=shoal_pb2.DropRequest.DRAIN)
    wrong = shoal_pb2.ExpertChunk(layer=held_b.layer, expert=held_b.expert, total_bytes=1,
                                  sha256="00")
    calls = {
        "DropExpert": lambda stub, metadata: stub.DropExpert(drain, metadata=metadata,
                                                             timeout=30),
        "PushExpert": lambda stub, metadata: stub.PushExpert(iter([wrong]), metadata=metadata,
                                                             timeout=30),
        "ReadExpert": lambda stub, metadata: list(stub.ReadExpert(
            file_request, metadata=metadata, timeout=30)),
        "ExpertFileStatus": lambda stub, metadata: stub.ExpertFileStatus(
            file_request, metadata=metadata, timeout=30),
        "GetStats": lambda stub, metadata: stub.GetStats(shoal_pb2.StatsRequest(),
                                                         metadata=metadata, timeout=30),
        "GetHeat": lambda stub, metadata: stub.GetHeat(shoal_pb2.HeatRequest(),
                                                       metadata=metadata, timeout=30),
    }
    for name, call in calls.items():
        method = f"/shoal.v1.ExpertService/{name}"
        for_a = make_credential(secret, method, node=a.node_id)
        for credential in (for_a, make_credential(secret, method)):
            with pytest.raises(grpc.RpcError) as refused:
                call(b._stub, [(METADATA_KEY, credential)])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        try:  # the worker it was made for takes it
            call(a._stub, [(METADATA_KEY, for_a)])
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), \
                (name, e.code(), e.details())
    assert status(b, (held_b.layer, held_b.expert)).state == State.SERVING
