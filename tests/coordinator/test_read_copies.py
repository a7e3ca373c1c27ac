"""Which copy reads a miss when members stream experts from their drives: `spread_reads` (pure)
and the coordinator's guess of what each member holds (`CacheGuess`), in the dispatcher."""

import numpy as np

from coordinator.dataplane.cache_guess import CacheGuess
from coordinator.dataplane.call_plan import spread_reads
from coordinator.dataplane.dispatch import Dispatcher
from engine.placement import LayerRoutes, replica_routes
from proto import shoal_pb2
from tests.coordinator.test_dispatch import _Cluster, _Link, decode_call


def routes_of(holdings: list[set]) -> LayerRoutes:
    return replica_routes({0: 8}, holdings)[0]


# experts 0-5 on members 0 and 1; 6 on member 0 alone; 7 on members 2 and 3
PAIRED = routes_of([{(0, e) for e in range(7)}, {(0, e) for e in range(6)}, {(0, 7)},
                    {(0, 7)}])


def reads(owner: np.ndarray, experts: np.ndarray, members: int = 4) -> list[int]:
    """Distinct experts each member was given (each a read when none is warm)."""
    return [len(set(experts[owner == m].tolist())) for m in range(members)]


def test_cold_misses_go_to_the_copy_whose_drive_ends_soonest():
    experts = np.array([0, 1, 2, 3], dtype=np.int32)
    owner = spread_reads(PAIRED, experts, lambda m, e: False)
    assert reads(owner, experts) == [2, 2, 0, 0]
    # An expert with one copy is placed first; the others go around it.
    experts = np.array([6, 0, 1, 7], dtype=np.int32)
    owner = spread_reads(PAIRED, experts, lambda m, e: False)
    assert owner[0] == 0 and sorted(owner[1:3].tolist()) == [0, 1]
    assert reads(owner, experts)[:2] == [2, 1] and owner[3] in (2, 3)
    # the same call gives the same answer
    assert spread_reads(PAIRED, experts, lambda m, e: False).tolist() == owner.tolist()


def test_a_copy_that_probably_holds_the_expert_computes_it_even_behind_reads():
    experts = np.array([0, 1, 2], dtype=np.int32)
    owner = spread_reads(PAIRED, experts, lambda m, e: m == 1)  # member 1 holds 0-5
    assert owner.tolist() == [1, 1, 1]
    owner = spread_reads(PAIRED, experts, lambda m, e: m == 1 and e == 2)
    assert owner[2] == 1 and reads(owner, experts)[:2] == [1, 2]


def test_every_pair_of_an_expert_goes_to_one_copy_and_faster_drives_take_more():
    experts = np.array([0, 0, 1, 0, 1, 2, 3, 4, 5, 2], dtype=np.int32)
    owner = spread_reads(PAIRED, experts, lambda m, e: False, read_seconds=[1.0, 0.5, 1, 1])
    for expert in np.unique(experts):
        assert len(set(owner[experts == expert].tolist())) == 1
    assert reads(owner, experts)[:2] == [2, 4]  # member 1's drive reads twice as fast


class _Streaming(_Link):
    """A worker that streams under a budget of `room` experts of 100 bytes."""

    def __init__(self, address: str, room: int, read_bps: int = 0) -> None:
        super().__init__()
        self.address = address
        self.inventory = shoal_pb2.Inventory(streaming=True, memory_budget=100 * room,
                                             read_bps=read_bps)
        self.hinted: list[int] = []

    def hint(self, layer, hint) -> None:
        self.hinted += list(hint.experts)


def test_the_guess_keeps_what_was_last_sent_as_far_as_the_budget_holds():
    guess, host = CacheGuess(100), _Streaming("a", room=2)
    resident = _Link()  # no inventory: holds its experts in memory
    assert guess.warm(resident, (0, 3)) and not guess.warm(host, (0, 3))
    guess.sent(host, 0, [1, 2])
    guess.sent(host, 0, [3, 1])
    assert [guess.warm(host, (0, e)) for e in (1, 2, 3)] == [True, False, True]


def test_streaming_members_read_each_miss_once_and_hints_name_the_copy_the_call_uses():
    links = [_Streaming("a", room=3), _Streaming("b", room=3)]
    routes = replica_routes({1: 8}, [{(1, e) for e in range(8)}] * 2)
    dispatcher = Dispatcher(_Cluster(links, routes))
    dispatcher.guess = CacheGuess(100)
    first: dict[int, int] = {}
    for step, experts in enumerate([[0, 3, 5, 6], [0, 3, 5, 6], [1, 2, 4, 7]]):
        hinted, sent_to = decode_call(dispatcher, links, 1, experts)
        assert [sent_to[e] for e in experts] == hinted.tolist()
        assert sorted(len(link.experts) for link in links) == [2, 2]  # two reads per drive
        if step == 1:  # the same experts again: each to the member that has it
            assert sent_to == first
        first = first or sent_to


def test_members_drive_rates_share_the_reads_and_a_whole_local_layer_is_dealt():
    slow, fast = _Streaming("slow", room=1, read_bps=40 * 10**6), \
        _Streaming("fast", room=1, read_bps=80 * 10**6)
    routes = replica_routes({0: 8}, [{(0, e) for e in range(8)}] * 2)
    members = _Cluster([slow, fast], routes).current
    experts = np.arange(6, dtype=np.int32)
    owner = CacheGuess(100).owners(members, 0, experts, turn=0)
    assert reads(owner, experts, 2) == [2, 4]  # the 80 MB/s drive reads twice as many
    # The coordinator's own store (first) holds layer 0 whole but streams: its reads are
    # dealt over the copies. A layer nobody else holds stays whole.
    assert CacheGuess(100).deals(members, 0)
    alone = _Cluster([slow, fast], replica_routes({0: 8}, [{(0, e) for e in range(8)},
                                                           set()])).current
    assert not CacheGuess(100).deals(alone, 0)
