"""worker/cache.py over real files and a real reader pool: what is evicted under the budget,
what a cancelled prefetch leaves behind, and how a read that fails its checksum is handled."""

import hashlib
import os
import threading
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import Moved
from engine.manifest import ExpertFile
from worker.cache import ExpertCache
from worker.reader import ReaderPool
from worker.uncached import ALIGN

SIZE = 3 * ALIGN + 100  # several read chunks, not a multiple of the block size


def decode(key, view, origin):
    return {"w": mx.array(np.frombuffer(bytes(view), dtype=np.uint8))}


def write_experts(folder: Path, n: int) -> dict:
    """n expert files of layer 0 in one store folder: key -> bytes."""
    (folder / "L000").mkdir(parents=True)
    data = {}
    for e in range(n):
        data[(0, e)] = os.urandom(SIZE)
        (folder / "L000" / f"E{e:04d}.safetensors").write_bytes(data[(0, e)])
    return data


def checks_for(data: dict) -> dict:
    return {key: ExpertFile(key[0], key[1], f"L000/E{key[1]:04d}.safetensors", len(b),
                            hashlib.sha256(b).hexdigest(), f"{zlib.crc32(b):08x}")
            for key, b in data.items()}


def make_cache(folders, copies, capacity, *, buffers=4, readers=2, checks=None, lost=None,
               admission=True):
    pool = ReaderPool(folders, SIZE, buffers, readers_per_drive=readers, chunk_bytes=ALIGN)
    keys = sorted(copies)
    problems: list[str] = []
    cache = ExpertCache(
        keys, np.full(len(keys), SIZE, dtype=np.int64), copies, capacity, pool, decode,
        checks=checks, report=problems.append,
        on_lost=(lambda key, why: lost.append(key)) if lost is not None else (lambda k, w: None),
        admission=admission,
    )
    return cache, pool, problems


def use(cache, expert, tokens=1):
    """One request for one expert of layer 0: wait for it, compute nothing, give it back."""
    lease = cache.demand(0, np.array([expert]), np.array([tokens]))
    try:
        [pos] = lease.take()
        tensors = lease.tensors(pos)
        lease.done([pos])
        return bytes(np.array(tensors["w"]))
    finally:
        lease.close()


def resident(cache, expert) -> bool:
    return cache.ready_tensors([(0, expert)]) is not None


def one_drive(tmp_path, n):
    folder = tmp_path / "drive-a"
    data = write_experts(folder, n)
    copies = {key: [(0, folder / f"L000/E{key[1]:04d}.safetensors")] for key in data}
    return folder, data, copies


def test_under_the_budget_the_coldest_expert_goes_first_then_the_least_recently_used(tmp_path):
    folder, data, copies = one_drive(tmp_path, 4)
    cache, pool, _ = make_cache([folder], copies, capacity=2 * SIZE)
    try:
        assert use(cache, 0, tokens=1) == data[(0, 0)]
        assert use(cache, 1, tokens=9) == data[(0, 1)]  # hotter, and more recent
        assert use(cache, 2, tokens=1) == data[(0, 2)]  # no room: evicts 0, the colder
        assert cache.counters.evictions == 1
        assert not resident(cache, 0) and resident(cache, 1) and resident(cache, 2)
        assert cache.resident_bytes() == (2 * SIZE, 2)

        # Equal heat: the one used longer ago goes.
        cache2, pool2, _ = make_cache([folder], dict(copies), capacity=2 * SIZE)
        try:
            use(cache2, 0, tokens=0)
            use(cache2, 1, tokens=0)
            use(cache2, 2, tokens=0)
            assert not resident(cache2, 0) and resident(cache2, 1) and resident(cache2, 2)
        finally:
            pool2.close()
    finally:
        pool.close()


@pytest.mark.parametrize("admission", [True, False])
def test_cold_experts_read_once_do_not_evict_a_hot_one_under_admission(tmp_path, admission):
    folder, data, copies = one_drive(tmp_path, 14)
    cache, pool, _ = make_cache([folder], copies, capacity=3 * SIZE, admission=admission)
    try:
        use(cache, 0, tokens=4)  # the hot expert: 4 tokens of one pass
        for e in range(1, 14):  # then 13 passes of a cold expert each, read once
            assert use(cache, e) == data[(0, e)]
        # Without admission the recent heat of 0 (half-life 4 passes) falls below a newcomer's.
        assert resident(cache, 0) == admission
        assert resident(cache, 13)  # the last one read is in memory either way
    finally:
        pool.close()


def test_an_expert_on_probation_routed_more_than_a_kept_one_is_kept(tmp_path):
    folder, data, copies = one_drive(tmp_path, 5)
    cache, pool, _ = make_cache([folder], copies, capacity=2 * SIZE)
    try:
        use(cache, 0, tokens=6)
        use(cache, 1, tokens=4)
        use(cache, 2)  # routed less than 0 and 1: on probation (it still needs 1's room)
        assert resident(cache, 0) and resident(cache, 2) and not resident(cache, 1)
        use(cache, 2, tokens=8)  # now routed more than 0, the least routed kept one: kept
        use(cache, 3)  # on probation, and with none other on probation, 0 makes room
        assert resident(cache, 2) and resident(cache, 3) and not resident(cache, 0)
        use(cache, 4)  # 3, on probation, goes first
        assert resident(cache, 2) and resident(cache, 4) and not resident(cache, 3)
    finally:
        pool.close()


def test_an_expert_in_use_is_not_evicted(tmp_path):
    folder, data, copies = one_drive(tmp_path, 2)
    cache, pool, _ = make_cache([folder], copies, capacity=SIZE)
    try:
        held = cache.demand(0, np.array([0]), np.array([1]))
        [pos] = held.take()
        other = cache.demand(0, np.array([1]), np.array([1]))  # no room while 0 is held
        assert other.pending == [0] and resident(cache, 0)
        held.done([pos])
        held.close()
        [pos] = other.take()  # now 0 may go, and 1 is read
        assert bytes(np.array(other.tensors(pos)["w"])) == data[(0, 1)]
        other.close()
        assert not resident(cache, 0) and cache.counters.evictions == 1
    finally:
        pool.close()


def test_a_cancelled_prefetch_leaves_no_entry_and_no_reserved_bytes(tmp_path):
    folder, data, copies = one_drive(tmp_path, 3)
    # One buffer and one reader thread: a read held open keeps the prefetch queued.
    cache, pool, _ = make_cache([folder], copies, capacity=2 * SIZE, buffers=1, readers=1)
    release = threading.Event()

    def hold(job):
        release.wait(30)
        pool.release(job)

    try:
        pool.submit((9, 9), SIZE, copies[(0, 0)], demand=True, on_done=hold)
        cache.prefetch(0, [1])
        assert cache.counters.prefetch_issued == 1
        lease = cache.demand(0, np.array([0]), np.array([1]))  # 1 was not asked for: stale
        assert cache.counters.prefetch_cancelled == 1
        release.set()
        [pos] = lease.take()
        assert bytes(np.array(lease.tensors(pos)["w"])) == data[(0, 0)]
        lease.done([pos])
        lease.close()
        # Had the cancelled read kept its bytes reserved, this would evict expert 0.
        assert use(cache, 2) == data[(0, 2)]
        assert cache.counters.evictions == 0 and not resident(cache, 1)
        assert cache.resident_bytes() == (2 * SIZE, 2)
        assert cache.counters.loads == 2
        # The expert is not left half-loaded: asked for now, it is read whole.
        assert use(cache, 1) == data[(0, 1)]
    finally:
        release.set()
        pool.close()


def two_drives(tmp_path, corrupt: tuple[int, ...]):
    """Expert 0 and 1 of layer 0 on two drives; expert 0's file corrupted on the drives named."""
    folders = [tmp_path / "drive-a", tmp_path / "drive-b"]
    data = write_experts(folders[0], 2)
    (folders[1] / "L000").mkdir(parents=True)
    for key, b in data.items():
        (folders[1] / f"L000/E{key[1]:04d}.safetensors").write_bytes(b)
    for d in corrupt:
        path = folders[d] / "L000/E0000.safetensors"
        bad = bytearray(path.read_bytes())
        bad[ALIGN + 7] ^= 0xFF  # in the second chunk, which drive 1 reads
        bad[7] ^= 0xFF  # and in the first, which drive 0 reads
        path.write_bytes(bytes(bad))
    copies = {key: [(d, folders[d] / f"L000/E{key[1]:04d}.safetensors") for d in (0, 1)]
              for key in data}
    return folders, data, copies


def test_a_read_that_fails_its_crc_is_served_from_the_intact_copy_and_the_bad_one_dropped(
        tmp_path):
    folders, data, copies = two_drives(tmp_path, corrupt=(0,))
    bad, good = copies[(0, 0)]
    lost: list = []
    cache, pool, problems = make_cache(folders, copies, capacity=2 * SIZE,
                                       checks=checks_for(data), lost=lost)
    try:
        assert use(cache, 0) == data[(0, 0)]
        assert cache.copies((0, 0)) == [good]
        assert problems == [f"{bad[1]}: checksum does not match the manifest; "
                            "not served"]
        assert lost == []
    finally:
        pool.close()


def test_with_no_intact_copy_left_the_expert_alone_is_given_up(tmp_path):
    folders, data, copies = two_drives(tmp_path, corrupt=(0, 1))
    lost: list = []
    cache, pool, problems = make_cache(folders, copies, capacity=2 * SIZE,
                                       checks=checks_for(data), lost=lost)
    try:
        with pytest.raises(Moved, match="no intact copy"):
            use(cache, 0)
        assert lost == [(0, 0)] and cache.copies((0, 0)) == []
        assert not resident(cache, 0) and cache.resident_bytes() == (0, 0)
        assert len(problems) == 3  # each copy dropped, then the expert given up
        assert use(cache, 1) == data[(0, 1)]  # the worker's other experts are still served
    finally:
        pool.close()


def test_without_checks_a_corrupt_read_is_not_noticed(tmp_path):
    # The contrast that shows the checks above are what catch it (verify_reads off).
    folders, data, copies = two_drives(tmp_path, corrupt=(0, 1))
    cache, pool, problems = make_cache(folders, copies, capacity=2 * SIZE, checks=None)
    try:
        assert use(cache, 0) != data[(0, 0)] and problems == []
    finally:
        pool.close()
