"""The lookahead sends only the ranks of guess its own record shows to be used often enough."""

import numpy as np

from coordinator.dataplane.lookahead import MIN_RANK_HIT_RATE, RankRates


def test_every_rank_is_sent_until_its_guesses_go_unused():
    rates = RankRates.start(3)
    assert rates.confident().tolist() == [True, True, True]
    for step in range(200):
        # rank 0 is always used, rank 1 half the time, rank 2 never
        used = np.array([10, 11] if step % 2 else [10])
        rates.record(np.array([[10, 11, 12]]), used)
    rate = rates.used / rates.guessed
    assert rate[0] > 0.95 and rate[2] < 0.05
    assert abs(rate[1] - 0.5) < 0.1
    assert rates.confident()[[0, 2]].tolist() == [True, False]


def test_a_rank_that_turns_useful_again_is_sent_again():
    rates = RankRates.start(2)
    for _ in range(100):
        rates.record(np.array([[1, 2]]), np.array([1]))
    assert not rates.confident()[1]
    for _ in range(100):
        rates.record(np.array([[1, 2]]), np.array([1, 2]))
    assert rates.confident()[1] and rates.used[1] / rates.guessed[1] >= MIN_RANK_HIT_RATE
