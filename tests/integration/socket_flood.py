"""A helper process for the hardening tests: holds thousands of TCP connections to a server
(from many loopback addresses, 127.0.0.2 and up), reconnecting each one the server closes, and
either never sends a byte (`idle`), dribbles an endless request header one byte a second
(`slowloris`), or sends the start of a TLS ClientHello and stalls (`hello`). Prints
`holding N` once the first round is open, and at the end one JSON line: what it opened, what
the server closed and after how long. `start` and `report` run it from a test; `open_files`
and `soft_file_limit` watch the server flooded (Linux's /proc).

    python -m tests.integration.socket_flood 127.0.0.1 8080 --sockets 3000 --hosts 100 \
        --mode idle --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RECONNECTS_PER_SECOND = 400  # enough pressure; more only burns this machine's two cores
HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
# a TLS record header announcing a 512-byte handshake message, and its first bytes only
HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
FIRST_BYTES = {"idle": b"", "slowloris": HEADER, "hello": HELLO}
REPO = Path(__file__).resolve().parents[2]


def start(address: str, *, sockets: int, hosts: int = 1, seconds: float,
          mode: str = "idle", source: str | None = None,
          rate: int = RECONNECTS_PER_SECOND) -> subprocess.Popen:
    """The helper flooding `address` (host:port), once it holds its first round: from
    `hosts` loopback addresses, or from `source` alone; `rate` reconnects a second at most
    (0: as fast as it can)."""
    host, port = address.rsplit(":", 1)
    where = ["--source", source] if source else ["--hosts", str(hosts)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.socket_flood", host, port, "--sockets",
         str(sockets), *where, "--mode", mode, "--seconds", str(seconds), "--rate",
         str(rate)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    first = proc.stdout.readline()
    if not first.startswith("holding"):
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"the flood did not start: {first!r}")
    return proc


def report(proc: subprocess.Popen, seconds: float) -> dict:
    """What the helper says at its end (its `seconds` over, 30 s more at most)."""
    try:
        out, _ = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def open_files(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def soft_file_limit(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    return int(re.search(r"Max open files\s+(\d+)", limits).group(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--sockets", type=int, default=3000)
    p.add_argument("--hosts", type=int, default=100, help="source addresses 127.0.0.2...")
    p.add_argument("--source", help="one source address for every socket (instead of --hosts)")
    p.add_argument("--rate", type=int, default=RECONNECTS_PER_SECOND,
                   help="reconnects a second at most (0: as fast as it can)")
    p.add_argument("--mode", choices=tuple(FIRST_BYTES), default="idle")
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    selector = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    sources = [args.source] if args.source else [
        f"127.0.0.{2 + i % 250}" if i < 250 else f"127.0.{1 + i // 250}.{2 + i % 250}"
        for i in range(args.hosts)]
    stats = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "ages": []}

    def open_one(index: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((sources[index % len(sources)], 0))
            code = sock.connect_ex((args.host, args.port))
        except OSError:
            code = -1
        if code not in (0, errno.EINPROGRESS):
            stats["connect_failed"] += 1
            sock.close()
            return
        opened_at[sock] = time.monotonic()
        selector.register(sock, selectors.EVENT_READ, index)
        stats["opened"] += 1
        if FIRST_BYTES[args.mode]:
            with contextlib.suppress(OSError):
                sock.send(FIRST_BYTES[args.mode])

    for i in range(args.sockets):
        open_one(i)
    print(f"holding {len(opened_at)}", flush=True)

    started = time.monotonic()
    deadline = [started + args.seconds]  # SIGINT ends it early, with its report
    signal.signal(signal.SIGINT, lambda *_: deadline.__setitem__(0, 0.0))
    pending: list[int] = []  # closed by the server, to open again
    next_drip = time.monotonic() + 1.0
    rate = args.rate or 1 << 62
    budget, budget_at = rate, time.monotonic()
    while (now := time.monotonic()) < deadline[0]:
        for key, _ in selector.select(timeout=0.05 if args.rate else 0.001):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if data:
                continue  # a refusal's 503 body: its close comes next
            stats["closed_by_server"] += 1
            stats["ages"].append(round(now - opened_at.pop(sock), 3))
            selector.unregister(sock)
            sock.close()
            pending.append(key.data)
        if now - budget_at >= 1.0:
            budget, budget_at = rate, now
        while pending and budget > 0:
            open_one(pending.pop())
            budget -= 1
        if args.mode == "slowloris" and now >= next_drip:
            next_drip = now + 1.0
            for sock in list(opened_at):
                with contextlib.suppress(OSError):
                    sock.send(b"a")
    stats["seconds"] = round(time.monotonic() - started, 3)
    ages = sorted(stats.pop("ages"))
    stats["held_at_end"] = len(opened_at)
    stats["median_age_closed"] = ages[len(ages) // 2] if ages else None
    stats["max_age_closed"] = ages[-1] if ages else None
    print(json.dumps(stats), flush=True)
    for sock in opened_at:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
