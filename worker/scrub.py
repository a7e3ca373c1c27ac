"""`shoal-worker --scrub`: re-read the expert files this worker serves, slowly, and check each
against the manifest's checksum, so that rot is found before a read or a migration needs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache_policy import format_bytes, parse_budget
from engine.errors import InvalidInput
from worker.residency import Residency
from worker.uncached import file_problem

DEFAULT_RATE = 32 << 20  # bytes/s: a few percent of one SSD; 100 GB are checked in ~an hour
PASS_PAUSE = 1.0  # seconds between passes (the rate already bounds the drive's load)


def parse_rate(text: str, flag: str = "--scrub") -> int:
    """A RATE in bytes per second (`flag`'s): '32M', '200M', '1G', or a plain byte count."""
    try:
        spec = parse_budget(text)
    except InvalidInput:
        spec = None
    if spec is None or spec.bytes is None:
        raise InvalidInput(f"{flag} {text!r} is not a rate in bytes per second like 32M or 1G")
    return spec.bytes


@dataclass
class ScrubPass:
    """What one pass over the files found."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    rotted: list[str] = field(default_factory=list)  # "path: why" of each file that failed


class _Stopped(Exception):
    pass


# One thread walks the files of the experts served (and draining) in turn, reading around the
# page cache at no more than the rate, so the drive stays free for demand reads. A file that
# fails stops being served (`ExpertCache.lose_copy`, a failed read's path too), is reported on
# stderr and in GetInventory/GetStats problems, and an expert with no intact file left is no
# longer offered, so coordinators route to another copy and deploy/rebalance can send one.
class Scrubber:
    """Checks `residency`'s files at `rate` bytes/s on its own thread, pass after pass."""

    def __init__(
        self, residency: Residency, rate: int, *, log: Callable[[str], None] = lambda m: None
    ) -> None:
        if rate <= 0:
            raise InvalidInput(f"the scrub rate must be above 0 bytes/s, got {rate}")
        self.residency = residency
        self.rate = rate
        self.log = log
        self.passes = 0
        self._files = {(e.layer, e.expert): e for e in residency.scan.manifest.experts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="shoal-scrub")
        self._budget_start = time.monotonic()
        self._budget_bytes = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                found = self.check_pass()
                self.passes += 1
                if self.passes == 1 or found.rotted:
                    verdict = (f"{len(found.rotted)} rotted (no longer served)" if found.rotted
                               else "all intact")
                    self.log(f"scrub pass {self.passes}: {found.files} files, "
                             f"{format_bytes(found.bytes)} in {found.seconds:.1f} s, {verdict}")
                self._stop.wait(PASS_PAUSE)
        except _Stopped:
            return

    def check_pass(self) -> ScrubPass:
        """Check every file of every expert served or draining now, once."""
        started = time.monotonic()
        found = ScrubPass()
        cache = self.residency.cache
        for key in list(cache.keys):
            entry = self._files[key]
            for _, path in cache.copies(key):
                why = file_problem(path, entry.bytes, entry.sha256, pace=self._pace)
                found.files += 1
                found.bytes += entry.bytes
                if why is not None:
                    found.rotted.append(f"{path}: {why}")
                    cache.lose_copy(key, path, f"{why} (found by the scrub)")
        found.seconds = time.monotonic() - started
        return found

    def _pace(self, count: int) -> None:
        """Sleep so that reading stays under `rate` on average; stop when closing."""
        self._budget_bytes += count
        ahead = self._budget_bytes / self.rate - (time.monotonic() - self._budget_start)
        if self._stop.wait(max(ahead, 0.0)):
            raise _Stopped
        if ahead < -1.0:  # idle between passes: do not bank it as a burst
            self._budget_start, self._budget_bytes = time.monotonic(), 0
