"""The worker's thread pools: a bounded pool reuses its threads and says when it is full, a
failing job ends only itself, and gRPC's executor has every thread started up front."""

import threading
from concurrent import futures

from worker.threads import ThreadPool, started


def test_a_pool_reuses_its_threads_and_refuses_beyond_its_size():
    logged: list[str] = []
    pool = ThreadPool(3, "test", logged.append)
    release = threading.Event()
    running = threading.Semaphore(0)

    def hold() -> None:
        running.release()
        release.wait(10)

    assert all(pool.submit(hold) for _ in range(3))
    for _ in range(3):
        assert running.acquire(timeout=10)
    assert not pool.submit(hold)  # all three busy
    release.set()
    done = threading.Event()
    for _ in range(50):  # one job after another: the same threads serve them
        done.clear()
        while not pool.submit(done.set):
            pass
        assert done.wait(10)
    assert pool.threads == 3
    pool.close()


def test_a_failing_job_is_logged_and_its_thread_serves_the_next():
    logged: list[str] = []
    pool = ThreadPool(1, "test", logged.append)

    def fail() -> None:
        raise RuntimeError("boom")

    assert pool.submit(fail)
    done = threading.Event()
    while not pool.submit(done.set):
        pass
    assert done.wait(10)
    assert pool.threads == 1 and logged == ["test: RuntimeError: boom"]
    pool.close()


def test_an_executor_started_in_full_never_starts_another_thread():
    executor = started(futures.ThreadPoolExecutor(max_workers=5), 5)
    before = threading.active_count()
    results = [executor.submit(lambda i=i: i * 2) for i in range(100)]
    assert [r.result(10) for r in results] == [i * 2 for i in range(100)]
    assert threading.active_count() == before
    executor.shutdown()
