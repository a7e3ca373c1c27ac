"""Thread pools whose threads live as long as the worker: the lanes' (ThreadPool) and gRPC's
(started in full at once: `started`), so that serving never needs a new thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent import futures


class ThreadPool:
    """At most `size` threads, each running one job at a time and then waiting for the next:
    a thread, and the state MLX keeps for each thread that computes, outlive the connection it
    served, so the count follows the most connections served at once, never their total."""

    def __init__(self, size: int, name: str, log: Callable[[str], None]) -> None:
        self.size, self.name, self._log = size, name, log
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = 0

    def submit(self, job: Callable[[], None]) -> bool:
        """Run `job` on an idle thread, or a new one; False when all `size` are busy.
        RuntimeError when no thread can be started (the process is at its thread limit)."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return True
            if self._threads >= self.size:
                return False
            self._threads += 1
        try:
            threading.Thread(target=self._run, args=(job,), name=f"{self.name}-{self._threads}",
                             daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise
        return True

    def _run(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            try:
                job()
            except Exception as e:  # a job's failure ends the job, never the thread
                self._log(f"{self.name}: {type(e).__name__}: {e}")
            with self._lock:
                self._idle += 1
            job = self._jobs.get()

    @property
    def threads(self) -> int:
        return self._threads

    def close(self) -> None:
        """End the idle threads (a busy one ends when its job does)."""
        with self._lock:
            for _ in range(self._threads):
                self._jobs.put(None)


def started(executor: futures.ThreadPoolExecutor, count: int) -> futures.ThreadPoolExecutor:
    """`executor` with all its `count` threads started now: it starts threads only while
    fewer than its maximum run, so later calls never need one (gRPC's serving thread, which
    hands each call to it, would die where none can be started)."""
    barrier = threading.Barrier(count + 1)
    for _ in range(count):
        executor.submit(barrier.wait, 10)
    barrier.wait(10)
    return executor
