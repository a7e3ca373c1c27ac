import hashlib
import mmap
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from worker.reader import ReadChunk, ReaderPool, plan_chunks
from worker.uncached import ALIGN, read_file, sha256_uncached


def test_chunks_go_to_the_drive_expected_to_finish_first():
    a, b = Path("a"), Path("b")
    # Equal drives, nothing queued: chunks alternate, ties to the lower drive.
    plan = plan_chunks(4 * 100, [(0, a), (1, b)], {}, {0: 100.0, 1: 100.0}, chunk_bytes=100)
    assert [c.drive for c in plan] == [0, 1, 0, 1]
    assert [c.offset for c in plan] == [0, 100, 200, 300]
    # Drive 1 is three times as fast: it gets three chunks of every four.
    plan = plan_chunks(8 * 100, [(0, a), (1, b)], {}, {0: 100.0, 1: 300.0}, chunk_bytes=100)
    assert sum(c.drive == 1 for c in plan) == 6
    # Drive 0 has two seconds of work queued: everything goes to drive 1 first.
    plan = plan_chunks(2 * 100, [(0, a), (1, b)], {0: 2.0}, {0: 100.0, 1: 100.0}, 100)
    assert plan == [ReadChunk(1, b, 0, 100), ReadChunk(1, b, 100, 100)]
    # The last chunk is shorter.
    assert [c.length for c in plan_chunks(250, [(0, a)], {}, {0: 1.0}, 100)] == [100, 100, 50]


@pytest.fixture
def two_drives(tmp_path):
    """The same 50 KB file (not a multiple of the block size) in two store folders."""
    data = os.urandom(50_000 + 123)
    folders = [tmp_path / "drive-a", tmp_path / "drive-b"]
    for folder in folders:
        (folder / "L000").mkdir(parents=True)
        (folder / "L000" / "E0000.safetensors").write_bytes(data)
    return data, folders


def read(pool, key, size, copies, demand=True):
    done = threading.Event()
    box = {}

    def on_done(job):
        box["bytes"] = None if job.error else bytes(job.buffer[: job.size])
        box["job"] = job
        pool.release(job)
        done.set()

    pool.submit(key, size, copies, demand=demand, on_done=on_done)
    assert done.wait(30)
    return box


def test_a_read_split_over_two_folders_returns_the_same_bytes(two_drives):
    data, folders = two_drives
    path = Path("L000/E0000.safetensors")
    pool = ReaderPool(folders, len(data), 2, readers_per_drive=2, chunk_bytes=ALIGN)
    try:
        box = read(pool, (0, 0), len(data), [(0, folders[0] / path), (1, folders[1] / path)])
        assert box["bytes"] == data
        assert box["job"].sources == {folders[0] / path, folders[1] / path}
        stats = pool.drive_stats()
        assert all(s.bytes_read > 0 for s in stats)
        assert sum(s.bytes_read for s in stats) == len(data)
    finally:
        pool.close()
    assert sha256_uncached(folders[1] / path, len(data)) == hashlib.sha256(data).hexdigest()
    buffer = mmap.mmap(-1, len(data) + ALIGN)  # page-aligned, as O_DIRECT wants
    read_file(folders[0] / path, memoryview(buffer), len(data))
    assert bytes(buffer[: len(data)]) == data


def test_a_drive_that_disappears_is_reported_and_its_copy_elsewhere_is_read(two_drives):
    data, folders = two_drives
    path = Path("L000/E0000.safetensors")
    problems = []
    pool = ReaderPool(folders, len(data), 2, readers_per_drive=1, chunk_bytes=ALIGN,
                      on_problem=problems.append)
    try:
        shutil.rmtree(folders[0])
        box = read(pool, (0, 0), len(data), [(0, folders[0] / path), (1, folders[1] / path)])
        assert box["bytes"] == data
        assert pool.failed_drives() == {0}
        assert any(str(folders[0]) in p and "failed" in p for p in problems)
        # With no copy left, the read fails instead of returning anything.
        box = read(pool, (0, 1), len(data), [(0, folders[0] / path)])
        assert box["bytes"] is None and box["job"].error is not None
    finally:
        pool.close()


def test_demand_reads_are_served_before_queued_prefetches(two_drives):
    data, folders = two_drives
    copies = [(0, folders[0] / "L000" / "E0000.safetensors")]
    pool = ReaderPool(folders[:1], len(data), 8, readers_per_drive=1)
    order, gate, first_started = [], threading.Event(), threading.Event()

    def on_done(name):
        def finish(job):
            if name == "blocker":
                first_started.set()
                gate.wait(30)  # holds the only reader thread until everything is queued
            order.append(name)
            pool.release(job)
        return finish

    try:
        pool.submit((0, 0), len(data), copies, demand=False, on_done=on_done("blocker"))
        assert first_started.wait(30)
        for name in ("prefetch-1", "prefetch-2"):
            pool.submit((0, 0), len(data), copies, demand=False, on_done=on_done(name))
        pool.submit((0, 0), len(data), copies, demand=True, on_done=on_done("demand"))
        promoted = pool.submit((0, 0), len(data), copies, demand=False,
                               on_done=on_done("promoted"))
        pool.promote(promoted)
        cancelled = pool.submit((0, 0), len(data), copies, demand=False,
                                on_done=on_done("cancelled"))
        assert pool.cancel(cancelled)
        gate.set()
        for _ in range(100):
            if len(order) == 5:
                break
            threading.Event().wait(0.05)
        assert order == ["blocker", "demand", "promoted", "prefetch-1", "prefetch-2"]
    finally:
        pool.close()


def test_a_digest_is_fed_every_chunk_in_file_order_as_they_arrive(two_drives):
    """13 chunks over two drives and four threads, finishing in any order; one copy is on a
    drive that vanished, so some chunks are read again elsewhere: the digest still sees the
    file's bytes once each, in order, and on_done runs once, after the last."""
    import zlib

    from worker.reader import Crc32

    data, folders = two_drives
    path = Path("L000/E0000.safetensors")
    copies = [(0, folders[0] / path), (1, folders[1] / path)]
    for vanish in (False, True):
        pool = ReaderPool(folders, len(data), 2, readers_per_drive=2, chunk_bytes=ALIGN)
        try:
            if vanish:
                shutil.rmtree(folders[0])
            for digest, expected in [(hashlib.sha256(), hashlib.sha256(data).hexdigest()),
                                     (Crc32(), f"{zlib.crc32(data):08x}")]:
                calls = []
                done = threading.Event()

                def on_done(job, calls=calls, done=done, pool=pool):
                    calls.append(job.digest.hexdigest())
                    pool.release(job)
                    done.set()

                job = pool.submit((0, 0), len(data), copies, demand=True, on_done=on_done,
                                  digest=digest)
                assert done.wait(30)
                assert job.digested == len(data) and calls == [expected]
        finally:
            pool.close()


def test_a_drive_reads_one_prefetch_at_a_time_and_demand_reads_pass_it(two_drives):
    data, folders = two_drives
    copies = [(0, folders[0] / "L000" / "E0000.safetensors")]
    pool = ReaderPool(folders[:1], len(data), 8, readers_per_drive=4)
    read_chunk, lock = pool._read_chunk, threading.Lock()
    state = {"prefetching": 0, "most": 0}
    demand_done, release = threading.Event(), threading.Event()

    def watched(job, chunk):
        if job.demand:
            return read_chunk(job, chunk)
        with lock:
            state["prefetching"] += 1
            state["most"] = max(state["most"], state["prefetching"])
        release.wait(30)  # a slow drive: the prefetch is still being read
        try:
            return read_chunk(job, chunk)
        finally:
            with lock:
                state["prefetching"] -= 1

    pool._read_chunk = watched
    finished = []

    def on_done(job):
        finished.append(job.demand)
        if job.demand:
            demand_done.set()
        pool.release(job)

    try:
        for _ in range(3):
            pool.submit((0, 0), len(data), copies, demand=False, on_done=on_done)
        pool.submit((0, 0), len(data), copies, demand=True, on_done=on_done)
        assert demand_done.wait(30), "the demand read waited behind prefetches"
        assert finished == [True]
        release.set()
        for _ in range(200):
            if len(finished) == 4:
                break
            threading.Event().wait(0.05)
        assert len(finished) == 4 and state["most"] == 1
    finally:
        release.set()
        pool.close()


def test_under_a_read_limit_a_drive_reads_no_faster_even_after_idling(two_drives):
    data, folders = two_drives
    path = Path("L000/E0000.safetensors")
    pool = ReaderPool(folders[:1], len(data), 2, readers_per_drive=2, chunk_bytes=ALIGN)
    pool.read_bps = 500_000.0  # the 50 KB file in 0.1 s at the least
    try:
        for _ in range(2):  # the second after the drive sat idle: no burst
            started = time.perf_counter()
            assert read(pool, (0, 0), len(data), [(0, folders[0] / path)])["bytes"] == data
            assert time.perf_counter() - started >= len(data) / pool.read_bps
            time.sleep(0.2)
        assert pool.drive_stats()[0].active_seconds >= 2 * len(data) / pool.read_bps
    finally:
        pool.close()
