"""Does the scaling benchmark's read limit (a cgroup's blkio/io throttle) hold for one
expert-sized read after the drive sat idle, or does the read go through at the device's speed?
`python -m benchmarks.probes.throttle_burst [--mbps 40] [--read-mib 2.5] [--idle-ms 200]`"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.stream_limits import MemberLimits, block_device, drop_page_cache  # noqa: E402
from builders.demo_models import cache_root  # noqa: E402
from worker.uncached import open_uncached, read_into, round_up  # noqa: E402


def reads(path: str, size: int, count: int, idle: float) -> None:
    """In the cgroup: `count` reads of `size` bytes at fresh offsets, `idle` seconds apart
    (0: back to back); prints each read's MB/s as one JSON line."""
    buffer = mmap.mmap(-1, size)
    view = memoryview(buffer)
    file = open_uncached(Path(path))
    rates = []
    for i in range(count):
        time.sleep(idle)
        started = time.perf_counter()
        got, offset = 0, i * size
        while got < size and (n := read_into(file, view[got:], offset + got)):
            got += n
        rates.append(got / (time.perf_counter() - started) / 1e6)
    os.close(file.fd)
    print(json.dumps(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbps", type=float, default=40.0)
    parser.add_argument("--read-mib", type=float, default=2.5, help="one expert's bytes")
    parser.add_argument("--idle-ms", type=float, default=200.0)
    parser.add_argument("--count", type=int, default=12)
    args = parser.parse_args()
    size = round_up(int(args.read_mib * (1 << 20)))
    folder = cache_root()
    folder.mkdir(parents=True, exist_ok=True)
    device = block_device(folder)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".throttle-") as f:
        f.write(os.urandom(size * args.count * 2))
        f.flush()
        os.fsync(f.fileno())
        results = {}
        for idle in (0.0, args.idle_ms / 1e3):
            drop_page_cache([Path(f.name)])
            limit = MemberLimits(f"shoal-throttle-{os.getpid()}", None, int(args.mbps * 1e6),
                                 device)
            try:
                code = (f"from benchmarks.probes.throttle_burst import reads; "
                        f"reads({f.name!r}, {size}, {args.count}, {idle})")
                run = subprocess.run(limit.wrap([sys.executable, "-c", code]), cwd=REPO,
                                     capture_output=True, text=True, timeout=600)
                if run.returncode != 0:
                    raise SystemExit(run.stderr[-600:])
                results[idle] = json.loads(run.stdout.strip().splitlines()[-1])
            finally:
                limit.close()
    print(f"read limit {args.mbps:g} MB/s ({', '.join(limit.kinds) or 'none set'}), reads of "
          f"{size / 2**20:.2f} MiB around the page cache, load {os.getloadavg()[0]:.1f}")
    for idle, rates in results.items():
        print(f"  {idle * 1e3:5.0f} ms idle before each: MB/s per read "
              + " ".join(f"{r:.0f}" for r in rates))


if __name__ == "__main__":
    main()
