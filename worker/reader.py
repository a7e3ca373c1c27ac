"""The worker's reader pool, for a worker whose experts do not all fit in memory: a few reader
threads per drive (one `--store` folder), a demand queue served before a prefetch queue, an
expert with copies on several drives read in chunks from the drive expected to finish first."""
# Reads go into reusable page-aligned buffers through worker/uncached.py, so the worker's
# memory budget is what it really uses; a drive that fails is reported and its chunks read from
# another copy. A job's checksum (`digest`) is fed chunk by chunk in file order as they arrive,
# so checking every read costs little more than its last chunk's share.

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine.manifest import ExpertKey
from worker.uncached import ALIGN, open_uncached, read_into, round_up

READ_CHUNK_BYTES = 1 << 20  # an expert's read from disk is split in pieces of this size
READERS_PER_DRIVE = 4  # queue depth per drive: SSDs reach full speed only with several reads
# Prefetch chunks a drive reads at once: the other readers stay free for demand reads, which
# then share the drive with one guess at most, never queue behind several.
PREFETCHES_IN_FLIGHT = 1
INITIAL_BANDWIDTH = 1e9  # bytes/s assumed for a drive before its first read is measured
_BANDWIDTH_WEIGHT = 0.2  # weight of each new measurement in a drive's moving average


# ---------------------------------------------------------------------------------------
# Planning: which drive reads which chunk (pure)


@dataclass(frozen=True)
class ReadChunk:
    """One piece of an expert's read from disk (the last may be shorter), and the drive and
    copy of the file it is planned on."""

    drive: int
    path: Path
    offset: int
    length: int


def plan_chunks(
    size: int,
    copies: Sequence[tuple[int, Path]],
    backlog: Mapping[int, float],
    bandwidth: Mapping[int, float],
    chunk_bytes: int = READ_CHUNK_BYTES,
) -> list[ReadChunk]:
    """Split a read of `size` bytes into chunks, each on the drive expected to finish it first.

    `copies` are (drive, path) of intact copies of the file; `backlog` the seconds of reading
    already queued on each drive and `bandwidth` its bytes per second. Ties go to the lower
    drive, so the plan is deterministic.
    """
    finish = {drive: backlog.get(drive, 0.0) for drive, _ in copies}
    chunks = []
    for offset in range(0, max(size, 1), chunk_bytes):
        length = min(chunk_bytes, size - offset)
        drive, path = min(
            copies, key=lambda c: (finish[c[0]] + length / bandwidth[c[0]], c[0])
        )
        finish[drive] += length / bandwidth[drive]
        chunks.append(ReadChunk(drive, path, offset, length))
    return chunks


# ---------------------------------------------------------------------------------------
# The pool of reader threads


@dataclass
class DriveStats:
    folder: Path
    bytes_read: int = 0
    reads: int = 0
    active_seconds: float = 0.0  # time with at least one read in flight on this drive
    failed: str | None = None  # why the drive was taken out of service


class Digest(Protocol):
    """What hashlib's objects offer (and Crc32): fed bytes in order, then read."""

    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class Crc32:
    """zlib's CRC-32 behind hashlib's interface (8 hex digits)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview, /) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


@dataclass(eq=False)
class ReadJob:
    """One expert file read into one buffer, possibly in chunks from several drives."""

    key: ExpertKey
    size: int
    copies: list[tuple[int, Path]]
    demand: bool
    on_done: Callable[[ReadJob], None]
    buffer: memoryview | None = None
    remaining: int = 0  # chunks not yet read
    started: bool = False  # a chunk is being read or was read: too late to cancel
    cancelled: bool = False
    error: OSError | None = None
    sources: set[Path] = field(default_factory=set)  # the files its bytes came from
    digest: Digest | None = None  # fed the bytes in order; complete when `digested == size`
    digested: int = 0
    _slot: int = -1
    _ready: dict[int, int] = field(default_factory=dict)  # offset -> length, read, not digested
    _digesting: bool = False
    _finished: bool = False


class _Drive:
    def __init__(self, index: int, folder: Path) -> None:
        self.index = index
        self.stats = DriveStats(folder)
        self.bandwidth = INITIAL_BANDWIDTH
        self.queued = {True: 0, False: 0}  # bytes queued, by demand
        self.demand: deque[tuple[ReadJob, ReadChunk]] = deque()
        self.prefetch: deque[tuple[ReadJob, ReadChunk]] = deque()
        self.in_flight = 0
        self.prefetching = 0  # prefetch chunks in flight
        self.active_since = 0.0
        self.free_at = 0.0  # with a read limit: when the paced drive has read what it was given


class ReaderPool:
    """Reader threads per drive, a demand and a prefetch queue per drive, reusable buffers.

    `submit` returns at once; the job's `on_done` runs on a reader thread when all its chunks
    are in the buffer (or it failed), and must call `release(job)` to give the buffer back.
    """

    def __init__(
        self,
        folders: Sequence[Path],
        buffer_bytes: int,
        buffers: int,
        *,
        readers_per_drive: int = READERS_PER_DRIVE,
        chunk_bytes: int = READ_CHUNK_BYTES,
        on_problem: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.chunk_bytes = round_up(chunk_bytes)
        self.buffer_bytes = round_up(buffer_bytes)
        self._on_problem = on_problem
        self._drives = [_Drive(i, Path(f)) for i, f in enumerate(folders)]
        self._memory = [mmap.mmap(-1, self.buffer_bytes) for _ in range(max(buffers, 1))]
        self._views = [memoryview(m) for m in self._memory]
        self._free = list(range(len(self._memory)))
        self._waiting = {True: deque(), False: deque()}  # jobs waiting for a buffer, by demand
        self._cond = threading.Condition()
        self._closed = False
        self.read_bps: float | None = None  # a limit on each drive's bytes/s (`_pace`)
        self._threads = [
            threading.Thread(target=self._serve, args=(drive,), daemon=True,
                             name=f"shoal-reader-{drive.index}-{n}")
            for drive in self._drives for n in range(readers_per_drive)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def buffer_count(self) -> int:
        return len(self._memory)

    def drive_stats(self) -> list[DriveStats]:
        with self._cond:
            now = time.perf_counter()
            out = []
            for d in self._drives:
                s = DriveStats(**vars(d.stats))
                if d.in_flight:
                    s.active_seconds += now - d.active_since
                out.append(s)
            return out

    def failed_drives(self) -> set[int]:
        with self._cond:
            return {d.index for d in self._drives if d.stats.failed}

    # -- jobs --------------------------------------------------------------------------

    def submit(
        self,
        key: ExpertKey,
        size: int,
        copies: Sequence[tuple[int, Path]],
        *,
        demand: bool,
        on_done: Callable[[ReadJob], None],
        digest: Digest | None = None,
    ) -> ReadJob:
        if size > self.buffer_bytes:
            raise ValueError(f"{size} bytes do not fit a {self.buffer_bytes}-byte read buffer")
        job = ReadJob(key, size, list(copies), demand, on_done, digest=digest)
        with self._cond:
            self._waiting[demand].append(job)
            self._dispatch()
        return job

    def promote(self, job: ReadJob) -> None:
        """A prefetch that is now needed: move whatever of it is still queued to demand."""
        with self._cond:
            if job.demand or job.cancelled:
                return
            job.demand = True
            if job in self._waiting[False]:
                self._waiting[False].remove(job)
                self._waiting[True].appendleft(job)
                self._dispatch()
                return
            for drive in self._drives:
                moved = [item for item in drive.prefetch if item[0] is job]
                for item in moved:
                    drive.prefetch.remove(item)
                    drive.demand.append(item)
                    drive.queued[False] -= item[1].length
                    drive.queued[True] += item[1].length
            self._cond.notify_all()

    def cancel(self, job: ReadJob) -> bool:
        """Drop a job none of whose chunks has started; False if it is too late."""
        with self._cond:
            if job.started or job.cancelled:
                return False
            job.cancelled = True
            if job in self._waiting[job.demand]:
                self._waiting[job.demand].remove(job)
                return True
            for drive in self._drives:
                for queue in (drive.demand, drive.prefetch):
                    for item in [item for item in queue if item[0] is job]:
                        queue.remove(item)
                        drive.queued[queue is drive.demand] -= item[1].length
            self._give_back(job)
            return True

    def release(self, job: ReadJob) -> None:
        """Give a finished job's buffer back to the pool."""
        with self._cond:
            self._give_back(job)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- internals (called with self._cond held) -----------------------------------------

    def _give_back(self, job: ReadJob) -> None:
        if job._slot >= 0:
            self._free.append(job._slot)
            job._slot = -1
            job.buffer = None
            self._dispatch()

    def _dispatch(self) -> None:
        """Give free buffers to waiting jobs, demand first, and queue their chunks."""
        while self._free and (self._waiting[True] or self._waiting[False]):
            job = (self._waiting[True] or self._waiting[False]).popleft()
            job._slot = self._free.pop()
            job.buffer = self._views[job._slot]
            chunks = self._plan(job)
            if not chunks:
                self._fail_later(job)
                continue
            job.remaining = len(chunks)
            for chunk in chunks:
                self._queue(job, chunk)
        self._cond.notify_all()

    def _plan(self, job: ReadJob) -> list[ReadChunk]:
        live = [(d, p) for d, p in job.copies if not self._drives[d].stats.failed]
        if not live:
            return []
        backlog = {}
        for drive in {d for d, _ in live}:
            state = self._drives[drive]
            queued = state.queued[True] + (0 if job.demand else state.queued[False])
            backlog[drive] = queued / state.bandwidth
        bandwidth = {d.index: d.bandwidth for d in self._drives}
        return plan_chunks(job.size, live, backlog, bandwidth, self.chunk_bytes)

    def _queue(self, job: ReadJob, chunk: ReadChunk) -> None:
        drive = self._drives[chunk.drive]
        (drive.demand if job.demand else drive.prefetch).append((job, chunk))
        drive.queued[job.demand] += chunk.length

    def _fail_later(self, job: ReadJob) -> None:
        paths = ", ".join(str(p) for _, p in job.copies)
        job.error = OSError(errno.ENODEV, f"no working drive holds a copy ({paths})")
        job.remaining = 0
        job.started = True
        threading.Thread(target=job.on_done, args=(job,), daemon=True).start()

    def _next(self, drive: _Drive) -> tuple[ReadJob, ReadChunk, bool] | None:
        """The drive's next chunk, demand reads first (and whether it was read for demand)."""
        while not self._closed:
            queue = drive.demand or (drive.prefetch if drive.prefetching < PREFETCHES_IN_FLIGHT
                                     else None)
            if queue:
                job, chunk = queue.popleft()
                drive.queued[queue is drive.demand] -= chunk.length
                drive.prefetching += not job.demand
                job.started = True
                if drive.in_flight == 0:
                    drive.active_since = time.perf_counter()
                drive.in_flight += 1
                return job, chunk, job.demand
            self._cond.wait()
        return None

    # -- the reader threads ------------------------------------------------------------

    def _serve(self, drive: _Drive) -> None:
        while True:
            with self._cond:
                item = self._next(drive)
            if item is None:
                return
            job, chunk, demand = item
            started = time.perf_counter()
            error = None
            try:
                self._read_chunk(job, chunk)
                self._pace(drive, chunk.length, started)
            except OSError as e:
                error = e
            elapsed = time.perf_counter() - started
            self._finish_chunk(drive, job, chunk, error, elapsed, demand)

    def _pace(self, drive: _Drive, length: int, started: float) -> None:
        """Under a read limit, finish the chunk no sooner than a drive of that speed would,
        reading one chunk at a time: after the ones before it, `length / read_bps` later."""
        if not self.read_bps:
            return
        with self._cond:
            drive.free_at = max(started, drive.free_at) + length / self.read_bps
            done = drive.free_at
        time.sleep(max(0.0, done - time.perf_counter()))

    def _read_chunk(self, job: ReadJob, chunk: ReadChunk) -> None:
        file = open_uncached(chunk.path)
        try:
            length = round_up(chunk.length) if file.direct else chunk.length
            view = job.buffer[chunk.offset : chunk.offset + length]
            got = read_into(file, view, chunk.offset)
        finally:
            os.close(file.fd)
        if got < chunk.length:
            raise OSError(errno.EIO, f"{chunk.path} is shorter than the manifest says")

    def _finish_chunk(
        self, drive: _Drive, job: ReadJob, chunk: ReadChunk, error: OSError | None,
        elapsed: float, demand: bool,
    ) -> None:
        problem = None
        with self._cond:
            drive.in_flight -= 1
            if not demand:
                drive.prefetching -= 1
                self._cond.notify_all()  # the drive may start its next prefetch
            if drive.in_flight == 0:
                drive.stats.active_seconds += time.perf_counter() - drive.active_since
            if error is None:
                drive.stats.bytes_read += chunk.length
                drive.stats.reads += 1
                if chunk.length >= ALIGN and elapsed > 0:
                    rate = chunk.length / elapsed
                    drive.bandwidth += _BANDWIDTH_WEIGHT * (rate - drive.bandwidth)
                job.sources.add(chunk.path)
                job._ready[chunk.offset] = chunk.length
                job.remaining -= 1
            else:
                problem = self._take_out(drive, chunk, error)
                others = [(d, p) for d, p in job.copies
                          if p != chunk.path and not self._drives[d].stats.failed]
                job.copies = [(d, p) for d, p in job.copies if p != chunk.path]
                if others:  # read this chunk again from another copy
                    bandwidth = {d.index: d.bandwidth for d in self._drives}
                    replan = plan_chunks(chunk.length, others, {}, bandwidth, chunk.length)[0]
                    again = ReadChunk(replan.drive, replan.path, chunk.offset, chunk.length)
                    self._queue(job, again)
                    self._cond.notify_all()
                else:
                    job.error = error if job.error is None else job.error
                    job.remaining -= 1
        if problem:
            self._on_problem(problem)
        self._digest_and_finish(job)

    def _digest_and_finish(self, job: ReadJob) -> None:
        """Feed the job's digest the chunks that are next in file order (one thread at a
        time per job, outside the lock: hashing releases the GIL, so other chunks and jobs
        go on meanwhile); the thread that finds the job complete calls `on_done`, once."""
        while True:
            with self._cond:
                length = None if job._digesting else job._ready.pop(job.digested, None)
                if length is None:
                    finish = (not job._digesting and job.remaining == 0 and not job._finished)
                    job._finished |= finish
                    break
                job._digesting = True
            if job.digest is not None:
                job.digest.update(job.buffer[job.digested : job.digested + length])
            with self._cond:
                job.digested += length
                job._digesting = False
        if finish:
            job.on_done(job)

    def _take_out(self, drive: _Drive, chunk: ReadChunk, error: OSError) -> str:
        """Report a failed read; if the drive's folder itself is gone, stop using the drive."""
        reason = error.strerror or str(error)
        if not drive.stats.failed and not drive.stats.folder.is_dir():
            drive.stats.failed = f"{drive.stats.folder} is no longer reachable ({reason})"
            return f"drive {drive.stats.folder} failed: {reason}; reading its experts elsewhere"
        return f"{chunk.path}: read failed ({reason})"
