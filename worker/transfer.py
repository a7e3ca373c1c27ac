"""Expert files arriving, leaving and being dropped on this worker (`shoal deploy`, `shoal
rebalance`): a file under its real name is always complete and verified, and nothing here
deletes an expert on its own."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CorruptData, InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import ExpertKey, Manifest, sha256_file
from proto import CHUNK_BYTES
from worker.holdings import DRAINING, SERVING
from worker.residency import Residency
from worker.uncached import file_problem

DEFAULT_QUIET = 1.0  # seconds a drained copy must go unasked before it may be deleted
MAX_QUIET = 24 * 3600.0  # longer than any migration waits: a bigger value is a mistake
BURST_QUIET = 2.0  # seconds without a drain or drop that end a burst of them (one log line)
SHOWN = 8  # experts named in a burst's line
BURST_DETAIL = {"draining": "no longer offered, still computed until they are dropped",
                "dropped": "their files deleted"}
ABSENT, PARTIAL = "absent", "partial"


@dataclass(frozen=True)
class TransferChunk:
    """A piece of an expert file pushed to or read from this worker: an ExpertChunk off the
    wire."""

    layer: int
    expert: int
    offset: int
    data: bytes
    total_bytes: int = 0  # first chunk: the file's size per the manifest
    sha256: str = ""  # first chunk: its checksum per the manifest


@dataclass(frozen=True)
class FileState:
    key: ExpertKey
    state: str  # ABSENT, PARTIAL, SERVING or DRAINING
    partial_bytes: int = 0
    idle_seconds: float = 0.0
    inventory_version: int = 0


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.incoming")


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def log_to_stderr(message: str) -> None:
    print(f"shoal-worker: {message}", file=sys.stderr, flush=True)


class Burst:
    """Lines of one kind that come in a burst (a rebalance drains and drops hundreds of
    experts, one call each), said in one line once none has come for `quiet` seconds; a
    lone one as it is. `flush` says what is pending now (the worker stopping)."""

    def __init__(self, log: Callable[[str], None], quiet: float = BURST_QUIET) -> None:
        self.log, self.quiet = log, quiet
        self._pending: dict[str, list[tuple[ExpertKey, str]]] = {}
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def add(self, kind: str, key: ExpertKey, detail: str) -> None:
        with self._lock:
            self._pending.setdefault(kind, []).append((key, detail))
            self._last = time.monotonic()
            if self._timer is None:
                self._arm(self.quiet)

    def _arm(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            left = self._last + self.quiet - time.monotonic()
            if left > 0:
                self._arm(left)
                return
            self._timer = None
        self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for kind, events in pending.items():
            if len(events) == 1:
                (layer, expert), detail = events[0]
                self.log(f"{kind} expert {layer}/{expert}: {detail}")
                continue
            shown = ", ".join(f"{layer}/{expert}" for (layer, expert), _ in events[:SHOWN])
            more = f" and {len(events) - SHOWN} more" if len(events) > SHOWN else ""
            self.log(f"{kind} {len(events)} experts ({shown}{more}): {BURST_DETAIL[kind]}")


# A pushed file is written to a hidden partial name beside its final place; an interrupted push
# leaves it, and its size is where the next push resumes. Once every byte has arrived it is
# flushed, checked against the manifest's checksum on disk, and only then renamed into place
# (the folder flushed). Dropping is two-phase: `drain` stops offering a copy while still
# computing it, `delete` removes it once drained and unasked for a while. The caller
# (coordinator/ops/migration_executor.py) first has another worker `keep` its copy, which hashes
# the file on disk against the manifest at that moment.
class ExpertFiles:
    """The expert files of one worker's store folders, as a transfer sees them. Each copy
    that arrives, each drain, undrain and deletion is logged (one line), so that what a
    rebalance did to this worker can be read from its log."""

    def __init__(
        self, residency: Residency, folders: Iterable[Path], manifest: Manifest,
        log: Callable[[str], None] = log_to_stderr,
    ) -> None:
        self.residency = residency
        self.log = log
        self.burst = Burst(log)  # a rebalance's drains and drops, a line each burst
        self.folders = tuple(Path(f) for f in folders)
        self.manifest = manifest
        self._files = {(e.layer, e.expert): e for e in manifest.experts}
        self._busy: set[ExpertKey] = set()
        self._lock = threading.Lock()

    def _entry(self, key: ExpertKey):
        entry = self._files.get(key)
        if entry is None:
            raise InvalidInput(f"expert {key[0]}/{key[1]} is not part of this model")
        return entry

    def _partial(self, key: ExpertKey) -> tuple[int, Path] | None:
        name = self._entry(key).file
        for drive, folder in enumerate(self.folders):
            path = partial_path(folder / name)
            if path.exists():
                return drive, path
        return None

    # -- status ---------------------------------------------------------------------------

    def status(self, key: ExpertKey) -> FileState:
        self._entry(key)
        holdings = self.residency.holdings
        state = holdings.state(key)
        partial_bytes = 0
        if state is None:
            found = self._partial(key)
            state = ABSENT if found is None else PARTIAL
            partial_bytes = 0 if found is None else found[1].stat().st_size
        return FileState(key, state, partial_bytes, holdings.idle_seconds(key), holdings.version)

    # -- receiving ------------------------------------------------------------------------

    def receive(self, chunks: Iterator[TransferChunk]) -> FileState:
        """Write a pushed file (resuming a partial one), verify it, rename it, serve it."""
        first = next(chunks, None)
        if first is None:
            raise InvalidInput("a push must carry at least one chunk")
        key = (first.layer, first.expert)
        entry = self._entry(key)
        if (first.total_bytes, first.sha256) != (entry.bytes, entry.sha256):
            raise InvalidInput(
                f"expert {key[0]}/{key[1]}: the pushed file ({first.total_bytes} bytes, "
                f"{first.sha256[:12]}) is not this model's ({entry.bytes}, {entry.sha256[:12]})"
            )
        with self._lock:
            if key in self._busy:
                raise Unavailable(f"expert {key[0]}/{key[1]} is already being received")
            self._busy.add(key)
        try:
            state = self.residency.holdings.state(key)
            if state == DRAINING:
                self.residency.holdings.keep(key)
                self.log(f"expert {key[0]}/{key[1]} pushed while draining: served again")
            if state is not None:
                return self.status(key)  # already verified here: nothing to write
            return self._write(key, entry, first, chunks)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _write(
        self, key: ExpertKey, entry, first: TransferChunk, rest: Iterator[TransferChunk]
    ) -> FileState:
        found = self._partial(key)
        drive, partial = found if found is not None else self._choose_folder(entry)
        final = self.folders[drive] / entry.file
        partial.parent.mkdir(parents=True, exist_ok=True)
        have = partial.stat().st_size if partial.exists() else 0
        if first.offset > have:
            raise InvalidInput(
                f"expert {key[0]}/{key[1]}: push starts at byte {first.offset} but only {have} "
                "bytes have arrived; ask ExpertFileStatus where to resume"
            )
        try:
            with open(partial, "r+b" if partial.exists() else "wb") as f:
                f.truncate(first.offset)
                f.seek(first.offset)
                position = first.offset
                for chunk in _chain(first, rest):
                    if (chunk.layer, chunk.expert) != key or chunk.offset != position:
                        raise InvalidInput(
                            f"expert {key[0]}/{key[1]}: chunk for {chunk.layer}/{chunk.expert} "
                            f"at byte {chunk.offset}, expected byte {position}"
                        )
                    if position + len(chunk.data) > entry.bytes:
                        raise InvalidInput(
                            f"expert {key[0]}/{key[1]}: more than its {entry.bytes} bytes sent"
                        )
                    f.write(chunk.data)
                    position += len(chunk.data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise ShoalError(f"cannot write {partial}: {e.strerror or e}") from None
        if position < entry.bytes:
            self.log(f"expert {key[0]}/{key[1]}: {position} of {entry.bytes} bytes received "
                     f"in {partial.parent}; the rest can resume")
            return self.status(key)  # the sender stopped early: resumable
        if sha256_file(partial) != entry.sha256:
            partial.unlink(missing_ok=True)
            raise CorruptData(
                f"expert {key[0]}/{key[1]}: the received file does not match the manifest's "
                "checksum; it was discarded, send it again"
            )
        os.replace(partial, final)
        _fsync_folder(final.parent)
        self.residency.add_expert(key, drive, final)
        resumed = f", resumed at byte {first.offset}" if first.offset else ""
        self.log(f"received expert {key[0]}/{key[1]} ({entry.bytes} bytes{resumed}, checksum "
                 f"verified) into {final.parent.parent}; serving it")
        return self.status(key)

    def _choose_folder(self, entry) -> tuple[int, Path]:
        """The store folder with the most free space that has room for the file."""
        best: tuple[int, int] | None = None
        for drive, folder in enumerate(self.folders):
            try:
                free = shutil.disk_usage(folder).free
            except OSError:
                continue
            if free >= entry.bytes and (best is None or free > best[1]):
                best = (drive, free)
        if best is None:
            raise Unavailable(
                f"no store folder of this worker has room for {entry.bytes} more bytes "
                f"(expert {entry.layer}/{entry.expert})"
            )
        return best[0], partial_path(self.folders[best[0]] / entry.file)

    # -- sending --------------------------------------------------------------------------

    def read(
        self, key: ExpertKey, offset: int, chunk_bytes: int = CHUNK_BYTES
    ) -> Iterator[TransferChunk]:
        """The verified file of an expert this worker holds, from `offset`, in chunks."""
        entry = self._entry(key)
        if self.residency.holdings.state(key) not in (SERVING, DRAINING):
            raise NotFound(f"this worker holds no copy of expert {key[0]}/{key[1]}")
        paths = [path for _, path in self.residency.cache.copies(key)]  # only trusted files
        if not paths:
            raise NotFound(f"the file of expert {key[0]}/{key[1]} is gone from this worker")
        if offset > entry.bytes:
            raise InvalidInput(f"expert {key[0]}/{key[1]} has only {entry.bytes} bytes")
        with open(paths[0], "rb") as f:
            f.seek(offset)
            position = offset
            while block := f.read(chunk_bytes):
                yield TransferChunk(key[0], key[1], position, block, entry.bytes, entry.sha256)
                position += len(block)

    # -- dropping -------------------------------------------------------------------------

    def drain(self, key: ExpertKey) -> FileState:
        self._held(key)
        if self.residency.holdings.state(key) != DRAINING:
            self.burst.add("draining", key, "no longer offered, still computed until it is "
                           "dropped")
        self.residency.holdings.drain(key)
        return self.status(key)

    def keep(self, key: ExpertKey) -> FileState:
        """Keep serving a copy (undoing a drain), once its file is verified on disk now: a
        migration asks this of the copy it keeps before it deletes another one."""
        self.verify(key)
        if self.residency.holdings.state(key) == DRAINING:
            self.log(f"keeping expert {key[0]}/{key[1]} (checksum verified): offered again")
        self.residency.holdings.keep(key)
        return self.status(key)

    def verify(self, key: ExpertKey) -> FileState:
        """Hash each file of a held expert on disk now against the manifest. A file that
        rotted (or vanished) stops being served and is reported; with none intact left, the
        expert is no longer offered here and CorruptData says why."""
        entry = self._entry(key)
        self._held(key)
        reasons = []
        for _, path in self.residency.cache.copies(key):
            why = file_problem(path, entry.bytes, entry.sha256)
            if why is not None:
                reasons.append(f"{path}: {why}")
                self.residency.cache.lose_copy(key, path, why)
        if self.residency.holdings.state(key) is None:
            raise CorruptData(
                f"expert {key[0]}/{key[1]}: no intact copy of its file is left on this worker "
                f"({'; '.join(reasons) or 'no file'}); it is no longer served here"
            )
        return self.status(key)

    def delete(self, key: ExpertKey, quiet: float = DEFAULT_QUIET) -> FileState:
        """Delete a drained copy nobody asked for during `quiet` seconds."""
        quiet = check_quiet(quiet)
        self._held(key)
        reason = self.residency.holdings.why_not_delete(key, quiet)
        if reason is not None:
            raise ShoalError(f"expert {key[0]}/{key[1]} is not deleted yet: {reason}")
        removed = self.residency.remove_expert(key)
        for path in removed:
            path.unlink(missing_ok=True)
            _fsync_folder(path.parent)
        self.burst.add("dropped", key, f"deleted {', '.join(map(str, removed))}")
        return self.status(key)

    def _held(self, key: ExpertKey) -> None:
        self._entry(key)
        if self.residency.holdings.state(key) is None:
            raise NotFound(f"this worker holds no copy of expert {key[0]}/{key[1]}")


def check_quiet(seconds: float) -> float:
    """DropExpert's quiet_seconds: a NaN or a negative would make every copy look quiet."""
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_QUIET:
        raise InvalidInput(f"quiet_seconds must be between 0 and {MAX_QUIET:.0f}, got {seconds}")
    return float(seconds)


def _chain(first: TransferChunk, rest: Iterator[TransferChunk]) -> Iterator[TransferChunk]:
    yield first
    yield from rest
