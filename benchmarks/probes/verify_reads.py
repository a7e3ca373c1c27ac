"""What checking every expert read costs: a worker's ReaderPool reading one expert-sized file
with no check, SHA-256 or CRC-32 after the read or fed chunk by chunk, and each checksum's raw
speed on one core."""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from worker.reader import Crc32, ReaderPool  # noqa: E402


def raw_speeds(data: bytes) -> dict[str, float]:
    """GB/s of each checksum over `data`, best of 5."""
    view = memoryview(data)
    out = {}
    for name, run in [("sha256", lambda: hashlib.sha256(view).digest()),
                      ("crc32", lambda: zlib.crc32(view)),
                      ("blake2b", lambda: hashlib.blake2b(view).digest())]:
        best = min(_timed(run) for _ in range(5))
        out[name] = len(data) / best / 1e9
    return out


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def read_times(path: Path, size: int, repeat: int) -> dict[str, float]:
    """Median ms per read of `path` for each way of checking it."""
    pool = ReaderPool([path.parent], size, 2)

    def once(digest=None, after=None) -> float:
        done, box = threading.Event(), {}

        def on_done(job):
            if after is not None:
                after(job.buffer[:size])
            box["job"] = job
            done.set()

        started = time.perf_counter()
        pool.submit((0, 0), size, [(0, path)], demand=True, on_done=on_done, digest=digest)
        done.wait()
        elapsed = time.perf_counter() - started
        pool.release(box["job"])
        return elapsed

    cases = {
        "no check": lambda: once(),
        "sha256 after": lambda: once(after=lambda v: hashlib.sha256(v).digest()),
        "crc32 after": lambda: once(after=zlib.crc32),
        "sha256 fed per chunk": lambda: once(digest=hashlib.sha256()),
        "crc32 fed per chunk": lambda: once(digest=Crc32()),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(repeat):
            for name, run in cases.items():  # interleaved, so load changes hit all alike
                times[name].append(run())
    finally:
        pool.close()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,16,64", help="file sizes in MiB")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--dir", type=Path,
                        help="where to write the test files: on the drive the worker's store "
                        "is on (default a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        speeds = raw_speeds(os.urandom(8 << 20))
        print("one core: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in speeds.items()))
        for mib in (int(s) for s in args.sizes.split(",")):
            path = Path(tmp) / f"expert-{mib}.bin"
            path.write_bytes(os.urandom(mib << 20))
            ms = read_times(path, mib << 20, args.repeat)
            base = ms["no check"]
            print(f"{mib:3d} MiB: " + "; ".join(
                f"{k} {v:.1f} ms" + ("" if k == "no check" else f" (+{v / base - 1:.0%})")
                for k, v in ms.items()))


if __name__ == "__main__":
    main()
