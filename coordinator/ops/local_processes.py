"""Start and stop shoal-worker processes, and `shoal serve`, on this machine (for `shoal demo`,
benchmarks, tests)."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ShoalError
from worker import daemon

START_TIMEOUT = 120.0
CHECKOUT = Path(__file__).resolve().parents[2]  # the folder that holds coordinator/ and worker/
_READY = re.compile(r"serving .* on (\S+:\d+)$", re.MULTILINE)
_LANE = re.compile(r"expert lane on port (\d+)$", re.MULTILINE)


class ForkedWorker:
    """A shoal-worker forked from multiprocessing's fork server, which imports worker.daemon
    once: each child runs the daemon's main() exactly as the command does, output to its log.
    It answers the few Popen calls that LocalWorker makes (poll, send_signal, wait, kill)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @classmethod
    def start(cls, args: list[str], log: Path) -> ForkedWorker:
        log.write_text("")  # the caller reads it before the child first writes
        # Daemonic: one left running is terminated when this process exits, not waited for.
        process = _fork_server().Process(target=_run_daemon, args=(args, str(log)),
                                         name="shoal-worker", daemon=True)
        process.start()
        return cls(process)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None and self._process.pid is not None:
            # The fork server, its parent, reaps it: it may be gone before exitcode says so.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("shoal-worker", timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


@functools.cache
def _fork_server() -> multiprocessing.context.BaseContext:
    # The fork server starts on first use, imports worker.daemon, and forks every worker from
    # that state; it holds no threads, gRPC channels or arrays, so forking it is safe.
    multiprocessing.set_forkserver_preload(["worker.daemon"])
    return multiprocessing.get_context("forkserver")


def _run_daemon(args: list[str], log: str) -> None:
    """In the forked child: stdout and stderr to the log, line by line, then the daemon."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    daemon.main(args)


@dataclass
class LocalWorker:
    proc: subprocess.Popen | ForkedWorker
    address: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def lane_address(self) -> str | None:
        """host:port of its expert lane, as its start-up lines say; None without one."""
        match = _LANE.search(self.output())
        return f"{self.address.rpartition(':')[0]}:{match.group(1)}" if match else None

    def stop(self, grace: float = 5.0) -> None:
        stop_process(self.proc, grace)


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def start_worker(
    stores: Sequence[Path],
    secret_file: Path,
    log: Path,
    extra: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
    forked: bool = False,
) -> LocalWorker:
    """Launch `shoal-worker` on a free port of `host` and wait until it serves (bounded).
    `prefix` runs it through another command (`ip netns exec NS` for a namespace).
    `forked` forks it from a process that has imported the worker once (see ForkedWorker):
    the same daemon in its own process, started in ~0.2 s instead of ~2 s of imports."""
    args = ["--host", host, "--port", "0", "--secret-file", str(secret_file), *extra]
    for store in stores:
        args += ["--store", str(store)]
    log.parent.mkdir(parents=True, exist_ok=True)
    if forked:
        if prefix:
            raise ShoalError("a forked worker cannot run through a command prefix")
        proc: subprocess.Popen | ForkedWorker = ForkedWorker.start(args, log)
    else:
        proc = _launch([*prefix, sys.executable, "-m", "worker.daemon", *args], log)
    worker = LocalWorker(proc, "", log)
    try:
        worker.address = _await_line(proc, log, _READY, timeout, "a local worker")
    except BaseException:
        worker.stop()  # not left running when the wait fails (or is interrupted)
        raise
    return worker


def _launch(cmd: Sequence[str], log: Path) -> subprocess.Popen:
    """`cmd` started from the checkout's folder, its output (unbuffered) into `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=CHECKOUT,
        )


def _await_line(proc, log: Path, pattern: re.Pattern, timeout: float, what: str) -> str:
    """The first group of `pattern`'s first match in `log`, once the process writes it
    (bounded); ShoalError if the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        match = pattern.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise ShoalError(f"{what} exited with status {proc.returncode}:\n{text.strip()}")
        time.sleep(0.05)
    raise ShoalError(f"{what} did not start within {timeout:.0f} s; see {log}")


def start_workers(
    store_groups: Sequence[Sequence[Path]],
    secret_file: Path,
    log_dir: Path,
    places: Sequence[tuple[Sequence[str], str]] = (),
    on_ready: Callable[[int, LocalWorker, float], None] | None = None,
    extra: Sequence[str] = (),
    *,
    forked: bool = False,
) -> list[LocalWorker]:
    """Start one worker per group of stores; if any fails, stop those already started.
    `places` gives each worker a (command prefix, host) other than loopback; `on_ready` hears
    of each as it serves (index, worker, seconds since the start), for progress; `extra`
    are more shoal-worker arguments for each; `forked` as for start_worker."""
    workers: list[LocalWorker] = []
    started = time.monotonic()
    try:
        for index, stores in enumerate(store_groups):
            prefix, host = places[index] if places else ((), "127.0.0.1")
            # Found by address, not by Bonjour: advertising would only announce several
            # workers that share this machine's node id.
            workers.append(start_worker(stores, secret_file, log_dir / f"worker-{index}.log",
                                        ("--no-advertise", *extra), host=host,
                                        prefix=prefix, forked=forked))
            if on_ready is not None:
                on_ready(index, workers[-1], time.monotonic() - started)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Sequence[LocalWorker]) -> None:
    """Signal all first, then wait for each: they shut down in parallel."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.stop()


_SERVING = re.compile(r"on (http://\S+:\d+)/v1")


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str  # http://HOST:PORT, without /v1
    log: Path

    def stop(self, grace: float = 15.0) -> None:
        LocalWorker(self.proc, "", self.log).stop(grace)


def start_server(
    model: Path, workers: Sequence[str], secret_file: Path, log: Path,
    extra: Sequence[str] = (), *, timeout: float = START_TIMEOUT,
) -> LocalServer:
    """Launch `shoal serve` over `workers` on a free loopback port and wait until it
    answers (bounded)."""
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(model),
           "--workers", ",".join(workers), "--port", "0", "--secret-file", str(secret_file),
           *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LocalServer(_launch(cmd, log), "", log)
    try:
        server.url = _await_line(server.proc, log, _SERVING, timeout, "shoal serve")
    except BaseException:
        server.stop()
        raise
    return server
