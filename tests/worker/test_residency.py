"""The cache in one process: any budget computes the same as every expert in memory; hints
fill the cache without pushing out hot experts; a bad copy is found by its checksum."""

import dataclasses
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import engine.experts as experts_module
from engine.errors import ShoalError
from engine.sharding import shard
from worker.residency import Request, Residency, Timing
from worker.store import scan_stores


@pytest.fixture(scope="module")
def store(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("residency") / "out"
    shard(tiny_checkpoint("qwen3_moe", quantize_bits=4), out, progress=False)
    return out / "experts"


def random_request(rng, layer=None):
    n = int(rng.integers(1, 12))
    m = int(rng.integers(1, 3 * n))
    return Request(
        int(rng.integers(0, 3)) if layer is None else layer,
        rng.standard_normal((n, 64)).astype(np.float32), "float32",
        rng.integers(0, n, m).astype(np.int32), rng.integers(0, 8, m).astype(np.int32),
    )


def test_small_budgets_compute_exactly_what_a_full_one_does(store):
    scan = scan_stores([store])
    full = Residency(scan)
    rng = np.random.default_rng(0)
    for share in (0.5, 0.1):
        small = Residency(scan, budget=int(share * full.expert_bytes))
        try:
            for _ in range(25):
                request = random_request(rng)
                small.prefetch((request.layer + 1) % 3, rng.integers(0, 8, 3).tolist())
                assert np.array_equal(np.array(full.compute(request)),
                                      np.array(small.compute(request)))
            snap = small.snapshot()
            assert snap.resident_bytes <= small.budget
            assert snap.counters.misses > 0 and snap.counters.loads > 0
        finally:
            small.close()
    assert full.snapshot().counters.misses == 0
    full.close()


def test_under_a_budget_a_request_of_resident_experts_is_one_gathered_call_over_the_slots(
    store, monkeypatch
):
    scan = scan_stores([store])
    full = Residency(scan)
    small = Residency(scan, budget=full.expert_bytes // 2)
    calls = []
    gathered = experts_module.ExpertRunner.gathered

    def counted(runner, *args, **kwargs):
        calls.append(args[0] is small.pool.params)
        return gathered(runner, *args, **kwargs)

    def one_expert_at_a_time(runner, *args):
        raise AssertionError("experts of one shape never run one by one")

    monkeypatch.setattr(experts_module.ExpertRunner, "gathered", counted)
    monkeypatch.setattr(experts_module.ExpertRunner, "__call__", one_expert_at_a_time)
    try:
        assert small.pool.slots == small.budget // small.slot_bytes
        hidden = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
        request = Request(2, hidden, "float32", np.zeros(4, np.int32),
                          np.array([7, 5, 6, 4], np.int32), 4)  # layer 2: not warmed
        first = np.array(small.compute(request))  # read now, each a copy into its slot
        assert small.snapshot().counters.misses == 4
        calls.clear()
        again = np.array(small.compute(request))  # all resident: one call, no read
        assert calls == [True] and small.snapshot().counters.hits == 4
        expected = np.array(full.compute(request))
        assert np.array_equal(first, expected) and np.array_equal(again, expected)
    finally:
        small.close()
        full.close()


def test_a_full_budget_stacks_each_layer_once_and_restacks_after_a_move(store):
    scan = scan_stores([store])
    before = mx.get_active_memory()
    full = Residency(scan)
    grown = mx.get_active_memory() - before
    streaming = Residency(scan, budget=int(0.5 * full.expert_bytes))
    rng = np.random.default_rng(2)
    try:
        assert full.stacked_layers() == [0, 1, 2] and streaming.stacked_layers() == []
        # The stack is the experts' only copy: their tensors became views into it.
        assert grown < 1.25 * full.expert_bytes
        for _ in range(10):
            request = random_request(rng)
            assert np.array_equal(np.array(full.compute(request)),
                                  np.array(streaming.compute(request)))

        copies = scan.copies[(1, 3)]
        full.remove_expert((1, 3))
        assert 1 not in full.stacked_layers()
        with pytest.raises(ShoalError, match="moved"):
            full.compute(Request(1, np.ones((1, 64), np.float32), "float32",
                                 np.zeros(1, np.int32), np.full(1, 3, np.int32)))
        full.add_expert((1, 3), *copies[0])
        uses_it = Request(1, rng.standard_normal((2, 64)).astype(np.float32), "float32",
                          np.array([0, 1, 1], np.int32), np.array([3, 3, 5], np.int32))
        for request in (uses_it, random_request(rng, layer=1)):  # the 1st loads expert 1/3
            assert np.array_equal(np.array(full.compute(request)),
                                  np.array(streaming.compute(request)))
        assert 1 in full.stacked_layers()
    finally:
        full.close()
        streaming.close()


def test_hints_fill_the_cache_but_never_push_out_a_hot_expert(store):
    scan = scan_stores([store])
    size = max(e.bytes for e in scan.manifest.experts)
    residency = Residency(scan, budget=4 * size, warm=False)
    rng = np.random.default_rng(1)
    try:
        hot = Request(0, rng.standard_normal((8, 64)).astype(np.float32), "float32",
                      np.arange(8, dtype=np.int32), np.zeros(8, dtype=np.int32))
        for _ in range(3):
            residency.compute(hot)  # expert 0/0: 8 tokens a pass, pinned
        residency.prefetch(1, range(8))
        residency.prefetch(2, range(8))
        residency.compute(hot)
        counters = residency.snapshot().counters
        assert counters.hits == 3 and counters.misses == 1
        assert counters.prefetch_issued >= 1
        first = Request(1, hot.hidden, "float32", hot.rows, np.zeros(8, dtype=np.int32))
        residency.compute(first)  # expert 1/0 was hinted: read ahead of its demand
        counters = residency.snapshot().counters
        assert counters.prefetch_hits + counters.prefetch_late == 1
    finally:
        residency.close()


def test_a_corrupt_copy_is_reported_with_its_path_and_the_good_copy_served(store, tmp_path):
    import shutil

    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(store, first)
    shutil.copytree(store, second)
    scan = scan_stores([first, second])
    problems = []
    size = max(e.bytes for e in scan.manifest.experts)
    residency = Residency(scan, budget=2 * size, verify_reads=True, warm=False,
                          report=problems.append)
    reference = Residency(scan_stores([store]))
    victim = first / scan.manifest.expert(0, 3).file
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    request = Request(0, np.ones((1, 64), np.float32), "float32", np.zeros(1, np.int32),
                      np.array([3], np.int32))
    try:
        assert np.array_equal(np.array(residency.compute(request)),
                              np.array(reference.compute(request)))
        assert any(str(victim) in p and "checksum" in p for p in problems)
        (second / scan.manifest.expert(0, 3).file).write_bytes(bytes(data))
        other = Request(0, request.hidden, "float32", request.rows, np.array([4], np.int32))
        residency.compute(other)
        residency.compute(Request(0, request.hidden, "float32", request.rows,
                                  np.array([5], np.int32)))  # 0/3 is evicted by now
        with pytest.raises(ShoalError, match="no intact copy"):
            residency.compute(request)
        assert np.array_equal(np.array(residency.compute(other)),
                              np.array(reference.compute(other)))  # the rest still works
    finally:
        residency.close()
        reference.close()


@pytest.mark.parametrize("checksum", ["crc32", "sha256 (a manifest without crc32)"])
def test_by_default_a_read_that_rotted_gives_up_that_expert_alone(store, tmp_path, checksum):
    """Default settings, a budget under the experts: a file corrupted after start is caught
    when read, the expert alone stops being offered (the inventory changes), a request for it
    is told it moved, and every other expert is still computed exactly."""
    import json
    import shutil

    from engine.errors import Moved
    from engine.manifest import MANIFEST_NAME

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    if checksum != "crc32":
        body = json.loads((copy / MANIFEST_NAME).read_text())
        for e in body["experts"]:
            del e["crc32"]
        (copy / MANIFEST_NAME).write_text(json.dumps(body))
    scan = scan_stores([copy])
    size = max(e.bytes for e in scan.manifest.experts)
    problems = []
    residency = Residency(scan, budget=2 * size, warm=False, report=problems.append)
    reference = Residency(scan_stores([store]))
    victim = copy / scan.manifest.expert(1, 2).file
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside a tensor
    victim.write_bytes(bytes(data))
    hidden = np.ones((1, 64), np.float32)

    def ask(layer, expert):
        return Request(layer, hidden, "float32", np.zeros(1, np.int32),
                       np.array([expert], np.int32))

    version = residency.holdings.version
    try:
        with pytest.raises(Moved, match="expert 2 is no longer served"):
            residency.compute(ask(1, 2))
        assert (1, 2) not in residency.held()
        assert residency.holdings.version > version
        assert any(str(victim) in p and "checksum" in p for p in problems)
        assert len(residency.held()) == len(reference.held()) - 1
        for layer, expert in [(1, 3), (0, 2), (2, 2)]:
            assert np.array_equal(np.array(residency.compute(ask(layer, expert))),
                                  np.array(reference.compute(ask(layer, expert))))
        with pytest.raises(Moved):
            residency.compute(ask(1, 2))
    finally:
        residency.close()
        reference.close()


def test_a_call_padded_to_the_callers_pair_count_gives_the_same_outputs(store, monkeypatch):
    """On a GPU a worker pads a call with fewer pairs than the caller's (ExpertRunner.pads);
    the padding is an unused expert's and its outputs are dropped, so the real pairs' outputs
    are those of the unpadded call (here on the CPU, where both must be bit-identical)."""
    residency = Residency(scan_stores([store]))
    rng = np.random.default_rng(3)
    try:
        for runner in residency.runners.values():
            runner.pads = False
        # decode-shaped (one row, each row's pairs together) and prompt-shaped requests
        requests = [Request(layer, rng.standard_normal((1, 64)).astype(np.float32), "float32",
                            np.zeros(3, np.int32), rng.choice(8, 3, replace=False).astype(np.int32),
                            call_pairs=8) for layer in range(3)]
        requests += [random_request(rng) for _ in range(10)]
        plain = [np.array(residency.compute(r)) for r in requests]
        for runner in residency.runners.values():
            runner.pads = True
        sizes = []  # the pair count of every call the module is given
        real_to_mlx = experts_module.to_mlx
        monkeypatch.setattr(experts_module, "to_mlx", lambda *parts: (
            sizes.append(parts[-1][0][0].size), real_to_mlx(*parts))[1])
        for request, expected in zip(requests, plain, strict=True):
            if not request.call_pairs:
                request = dataclasses.replace(request, call_pairs=request.experts.size + 40)
            padded = np.array(residency.compute(request))
            assert padded.shape == expected.shape
            assert np.array_equal(padded, expected)
        assert sizes[:3] == [8, 8, 8]  # the decode-shaped ones were padded to the caller's 8
    finally:
        residency.close()


def test_a_request_waiting_for_anothers_mlx_work_reports_the_wait_apart(store):
    """Requests from several streams (a prompt pass's pieces) compute one at a time; the time
    one waits for another's turn is `Timing.waited`, not its matrix work."""
    residency = Residency(scan_stores([store]))
    request = random_request(np.random.default_rng(4), layer=0)
    try:
        alone = Timing()
        expected = np.array(residency.compute(request, alone))
        assert alone.waited < 0.05
        timing, outputs = Timing(), []
        with residency._lock:  # another request's turn, 0.2 s long
            thread = threading.Thread(
                target=lambda: outputs.append(np.array(residency.compute(request, timing))))
            thread.start()
            time.sleep(0.2)
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert np.array_equal(outputs[0], expected)
        assert timing.waited >= 0.15 and timing.matrix < timing.waited
    finally:
        residency.close()
