"""Workers that keep only part of their experts in memory give exactly mlx-lm's output, and
the stats say that they read from their drives (with prefetch hints) to do it."""

import shutil

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from coordinator.decoding.generate import open_remote_model
from coordinator.decoding.report import streaming_report
from coordinator.ops.worker_stats import read_stats
from engine.auth import load_secret
from engine.errors import Unavailable
from engine.sharding import shard
from tests.integration.test_equivalence import PROMPT, greedy_tokens, make_stores

NEW_TOKENS = 8


@pytest.mark.slow
def test_tokens_identical_at_budgets_of_100_50_and_10_percent(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint("qwen3_moe", quantize_bits=4)
    reference, _ = load_model(source)
    expected = greedy_tokens(reference, PROMPT, NEW_TOKENS)
    sharded = tmp_path / "sharded"
    manifest = shard(source, sharded, progress=False)
    keys = sorted((e.layer, e.expert) for e in manifest.experts)
    # Halves, so that 10% of a worker's experts is still more than one expert.
    first, second = make_stores(sharded, tmp_path / "stores", [keys[::2], keys[1::2]])
    # The second worker has two drives: its experts split between them, some on both.
    other_drive = tmp_path / "stores" / "store-1-drive-b"
    shutil.copytree(second, other_drive)
    for index, path in enumerate(sorted(second.glob("L*/E*.safetensors"))):
        if index % 3 == 0:
            path.unlink()  # only on drive b
        elif index % 3 == 1:
            (other_drive / path.relative_to(second)).unlink()  # only on drive a
    secret = load_secret(secret_file)
    for share in ("100%", "50%", "10%"):
        workers = [start_worker([first], "--memory-budget", share),
                   start_worker([second, other_drive], "--memory-budget", share)]
        remote = open_remote_model(sharded, [w.address for w in workers], secret)
        try:
            # The worker says whether it streams; the coordinator's hints follow what it says.
            assert [link.inventory.streaming for link in remote.cluster.links] == [
                share != "100%"] * 2, share
            before = read_stats(remote.cluster.links)
            tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
            after = read_stats(remote.cluster.links)
        finally:
            remote.close()
            for worker in workers:
                worker.stop()
        assert tokens == expected, share
        report = streaming_report(before, after, NEW_TOKENS, remote.dispatcher.lookahead.stats)
        summaries = [report["workers"][w.address] for w in workers]
        if share == "100%":
            assert all(s["hit_rate"] == 1.0 and s["bytes_read"] == 0 for s in summaries)
            assert report["hints"]["predictions"] == 0  # no worker streams: no guessing
        else:
            assert all(s["bytes_read"] > 0 and s["hit_rate"] < 1.0 for s in summaries), share
            assert report["hints"]["predictions"] > 0
            assert sum(s["prefetch_issued"] for s in summaries) > 0
        assert all(not s["problems"] for s in summaries)
        drives = summaries[1]["drives"]
        assert len(drives) == 2
        if share == "10%":
            assert all(d["bytes_read"] > 0 for d in drives)


@pytest.mark.slow
def test_a_file_corrupted_or_removed_while_serving_is_reported_with_its_path(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint("qwen3_moe", quantize_bits=4)
    sharded = tmp_path / "sharded"
    shard(source, sharded, progress=False)
    store = sharded / "experts"
    spare = tmp_path / "spare-drive"
    shutil.copytree(store, spare)
    worker = start_worker([store, spare], "--memory-budget", "10%")
    files = sorted(store.glob("L*/E*.safetensors"))
    # After start: one copy corrupted (its twin on the spare drive is intact), one expert
    # removed from both drives, so it has no copy left. The corrupt one is of the middle
    # layer: not loaded at start (the budget fills with layer 0's first experts) and not
    # asked for until the end, so its first read, by a prefetch hint or by demand, meets
    # the bad bytes. (An expert in memory is not read again until evicted, and which one is
    # evicted depends on when prefetches land.)
    corrupt = next(f for f in files if f.parent.name == "L001")
    gone = files[-1]
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    gone.unlink()
    (spare / gone.relative_to(store)).unlink()
    secret = load_secret(secret_file)
    remote = open_remote_model(sharded, [worker.address], secret)
    link = remote.cluster.links[0]
    try:
        layer, expert = (int(gone.parent.name[1:]), int(gone.stem[1:]))
        dispatcher = remote.dispatcher
        hidden = mx.ones((1, 1, 64))
        # Every expert of the first and last layer, one by one, then the corrupt one, which
        # is served from its intact twin.
        order = [(lay, e) for lay in (0, layer) for e in range(8) if (lay, e) != (layer, expert)]
        for lay, e in [*order, (1, int(corrupt.stem[1:]))]:
            out = dispatcher(lay, hidden, mx.array([[[e]]]))
            assert out.shape == (1, 1, 1, 64)
        # The expert with no copy left is named alone; the worker serves every other one.
        with pytest.raises(Unavailable, match=f"layer {layer}: experts? {expert}$"):
            dispatcher(layer, hidden, mx.array([[[expert]]]))
        stats = link.fetch_stats()
        inventory = link.fetch_inventory()
    finally:
        remote.close()
    assert any(str(corrupt) in p and "checksum" in p for p in stats.problems), stats.problems
    assert any(str(gone) in p for p in stats.problems), stats.problems
    held = {(h.layer, h.expert) for h in inventory.experts}
    assert (layer, expert) not in held and len(held) == len(files) - 1
    assert worker.proc.poll() is None


@pytest.mark.slow
def test_rot_while_streaming_is_caught_and_served_from_another_copy(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """Default settings, a worker streaming under a budget smaller than its experts: every
    file of its store rots after it started. Its reads fail their checksum, each such expert
    alone stops being offered there and is computed by the other worker's copy: the tokens
    stay mlx-lm's, the rot is reported with its paths, and the worker keeps serving the
    experts it still holds intact in memory."""
    source = tiny_checkpoint("qwen3_moe", quantize_bits=4)
    reference, _ = load_model(source)
    expected = greedy_tokens(reference, PROMPT, NEW_TOKENS)
    sharded = tmp_path / "sharded"
    shard(source, sharded, progress=False)
    rotting, intact = tmp_path / "rotting", tmp_path / "intact"
    shutil.copytree(sharded / "experts", rotting)
    shutil.copytree(sharded / "experts", intact)
    # Both stream: a copy that holds every expert in memory would be given them all
    # (coordinator/dataplane/call_plan.py: spread_reads), and the rotting one would read none.
    workers = [start_worker([rotting], "--memory-budget", "25%"),
               start_worker([intact], "--memory-budget", "25%")]
    files = sorted(rotting.glob("L*/E*.safetensors"))
    for path in files:  # the tensors' bytes rot, the header stays readable
        data = bytearray(path.read_bytes())
        half = len(data) // 2
        data[half:] = bytes(b ^ 0x5A for b in data[half:])
        path.write_bytes(bytes(data))
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
        stats = remote.cluster.links[0].fetch_stats()
        inventory = remote.cluster.links[0].fetch_inventory()
        still_routed = remote.cluster.holdings[0]
    finally:
        remote.close()
    assert tokens == expected
    assert any("checksum" in p and str(rotting) in p for p in stats.problems), stats.problems
    held = {(h.layer, h.expert) for h in inventory.experts}
    assert 0 < len(held) < len(files)  # only the experts that rotted were given up
    assert still_routed == frozenset(held)
    assert workers[0].proc.poll() is None
