"""The launch setting Shoal gives its own processes: applied unless the user chose, and the
environment as given recovered for programs that are not Shoal's (mlx-lm's baselines)."""

import os

import pytest

from engine.process import CHOSEN_BY_SHOAL, GRAPHS, environment_as_given, launch_directly


@pytest.fixture
def unset(monkeypatch):
    """Neither variable set; whatever the test sets is undone after it."""
    for name in (GRAPHS, CHOSEN_BY_SHOAL):
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores the original
        monkeypatch.delenv(name)
    return monkeypatch


def test_graphs_are_turned_off_unless_the_user_chose(unset):
    launch_directly()
    assert os.environ[GRAPHS] == "0"
    given = environment_as_given()
    assert GRAPHS not in given and CHOSEN_BY_SHOAL not in given
    launch_directly()  # twice: still Shoal's default, still recognised as such
    assert GRAPHS not in environment_as_given()


def test_the_users_own_setting_is_kept_both_ways(unset):
    unset.setenv(GRAPHS, "1")
    launch_directly()
    assert os.environ[GRAPHS] == "1"
    assert environment_as_given()[GRAPHS] == "1"
