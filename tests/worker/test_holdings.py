"""Holdings counts requests after their replies (`settle`), yet no reader misses one."""

import numpy as np

from worker.holdings import MAX_UNSETTLED, Holdings


def test_a_reader_sees_every_request_noted_before_it_without_a_settle():
    holdings = Holdings([(0, e) for e in range(8)])
    holdings.asked(0, np.array([1, 3, 3], np.int32))
    holdings.asked(2, np.array([0], np.int32))
    assert holdings.tokens() == {(0, 1): 1, (0, 3): 2, (2, 0): 1}
    holdings.asked(0, np.array([3], np.int32))
    holdings.settle()
    holdings.settle()  # a second settle counts nothing twice
    assert holdings.tokens()[(0, 3)] == 3


def test_a_copy_just_asked_for_is_not_quiet_enough_to_delete(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("worker.holdings.time.monotonic", lambda: clock[0])
    holdings = Holdings([(0, 5)])
    holdings.drain((0, 5))
    clock[0] += 100
    holdings.asked(0, np.array([5], np.int32))  # noted, not settled
    clock[0] += 1
    assert holdings.idle_seconds((0, 5)) == 1.0  # since the note, not since the start (101)
    assert "last asked for 1.0 s ago" in holdings.why_not_delete((0, 5), quiet=30.0)


def test_requests_nobody_settles_are_counted_in_bounded_batches():
    holdings = Holdings([(1, e) for e in range(4)])
    for _ in range(3 * MAX_UNSETTLED + 7):
        holdings.asked(1, np.array([2, 0], np.int32))
    assert len(holdings._unsettled) < MAX_UNSETTLED  # never more noted than the bound
    count = 3 * MAX_UNSETTLED + 7
    assert holdings.tokens() == {(1, 0): count, (1, 2): count}
