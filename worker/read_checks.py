"""The checks every expert read must pass before its tensors are served: the manifest's
checksum, a retry copy by copy when it fails, and the expert given up alone when no intact
copy is left."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

import mlx.core as mx

from engine.errors import Moved
from engine.manifest import ExpertFile, ExpertKey
from worker.reader import Crc32, Digest, ReadJob
from worker.uncached import read_file


class ReadChecks:
    """Checks and decodes finished reads. `checks`: the manifest's entries, whose checksums
    every read must match (None: reads are not checked); `copies` and `lose_copy` are the
    cache's record of each expert's trusted files."""

    def __init__(
        self,
        checks: Mapping[ExpertKey, ExpertFile] | None,
        decode: Callable[[ExpertKey, memoryview, str], dict[str, mx.array]],
        copies: Callable[[ExpertKey], list[tuple[int, Path]]],
        lose_copy: Callable[[ExpertKey, Path, str], int],
    ) -> None:
        self._checks = checks
        self._decode = decode
        self._copies = copies
        self._lose_copy = lose_copy

    def digest(self, key: ExpertKey) -> Digest | None:
        """A fresh checksum for a read of `key`: the manifest's CRC-32 where it has one (the
        reader feeds it chunk by chunk as they arrive), else its SHA-256; None: not checked."""
        if self._checks is None:
            return None
        return Crc32() if self._checks[key].crc32 else hashlib.sha256()

    def check_and_decode(self, job: ReadJob) -> dict[str, mx.array]:
        if job.error is not None:
            # The reader already tried every other copy of each chunk that failed.
            reason = job.error.strerror or str(job.error)
            copies = self._copies(job.key) or job.copies
            for _, path in copies:
                self._lose_copy(job.key, path, f"cannot be read ({reason})")
            raise lost(job.key, f"its files cannot be read ({reason})")
        view = job.buffer[: job.size]
        if job.digest is not None and (job.digested != job.size
                                       or job.digest.hexdigest() != self._expected(job.key)):
            self._find_good_copy(job, view, self._checks[job.key].sha256)
        layer, expert = job.key
        origin = str(next(iter(job.sources))) if len(job.sources) == 1 else (
            f"expert {layer}/{expert} (read from {', '.join(map(str, sorted(job.sources)))})"
        )
        return self._decode(job.key, view, origin)

    def _expected(self, key: ExpertKey) -> str:
        entry = self._checks[key]
        return entry.crc32 or entry.sha256

    def _find_good_copy(self, job: ReadJob, view: memoryview, expected: str) -> None:
        """A read failed its checksum: check each copy alone against the SHA-256, drop the
        bad ones, keep a good one in `view`. With none left the expert alone is given up, not
        the worker."""
        for _, path in self._copies(job.key):
            try:
                read_file(path, job.buffer, job.size)
            except OSError as e:
                self._lose_copy(job.key, path, f"cannot be read ({e.strerror or e})")
                continue
            if hashlib.sha256(view).hexdigest() == expected:
                return
            self._lose_copy(job.key, path, "checksum does not match the manifest")
        raise lost(job.key, "no intact copy of its file is left (see the problems)")


def lost(key: ExpertKey, why: str) -> Moved:
    # ABORTED (Moved), not DATA_LOSS: the coordinator fetches the inventory again, which
    # no longer lists this expert here, and routes it to another copy or names it alone
    # as unowned; the worker's other experts stay in service.
    layer, expert = key
    return Moved(f"layer {layer}: expert {expert} is no longer served by this worker: "
                 f"{why}; fetch the inventory again")
