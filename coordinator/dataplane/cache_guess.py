"""The coordinator's guess of which experts each streaming member holds in memory, and the copy
each expert of a layer call goes to by it (call_plan.py: spread_reads). Wrong guesses cost
time, never a result."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from coordinator.cluster.snapshot import Snapshot
from coordinator.dataplane.call_plan import group_pairs, spread, spread_reads
from coordinator.dataplane.hosts import ExpertHost
from engine.manifest import ExpertKey


class CacheGuess:
    """Per member, the experts last sent to it (to compute, or as a prefetch hint), as many as
    its memory budget holds: what a member keeps is mostly what it was asked for lately (its hot
    set is asked for often). A member that holds all its experts in memory is warm for each."""

    def __init__(self, expert_bytes: int) -> None:
        self.expert_bytes = max(expert_bytes, 1)  # one expert's tensors (the model's mean)
        self._sent: dict[str, OrderedDict[ExpertKey, None]] = {}

    @staticmethod
    def streams(host: ExpertHost) -> bool:
        """Whether the member reads experts from its drives (its inventory says; none yet:
        not known, treated as holding everything in memory)."""
        return host.inventory is not None and host.inventory.streaming

    def warm(self, host: ExpertHost, key: ExpertKey) -> bool:
        if not self.streams(host):
            return True
        return key in self._sent.get(host.address, ())

    def owners(self, members: Snapshot, layer: int, experts: np.ndarray,
               turn: int) -> np.ndarray:
        """The member that computes each pair of a layer call: with members that stream, each
        expert's copy that probably holds it, else the one whose drive ends soonest; without,
        the pairs dealt over the copies (`spread`)."""
        hosts = members.links
        if not any(self.streams(host) for host in hosts):
            return spread(members.routes[layer], experts, turn)
        rates = [host.inventory.read_bps if host.inventory is not None else 0
                 for host in hosts]
        known = [rate for rate in rates if rate]  # unpaced drives count as the paced' mean
        seconds = None if not known else [len(known) / sum(known) if not rate else 1 / rate
                                          for rate in rates]
        return spread_reads(members.routes[layer], experts,
                            lambda m, e: self.warm(hosts[m], (layer, e)), seconds, turn)

    def deals(self, members: Snapshot, layer: int) -> bool:
        """Whether a layer the coordinator's own store holds whole is still dealt over the
        members: it streams, and other members hold copies whose drives can take reads."""
        routes = members.routes.get(layer)
        return bool(members.links) and self.streams(members.links[0]) and \
            routes is not None and routes.replicated

    def given(self, hosts: tuple[ExpertHost, ...], layer: int, experts: np.ndarray,
              owner: np.ndarray) -> None:
        """Note the experts of a layer call that each member (`owner[i]` for pair i) computes
        (nothing to note, and no work on the call's path, where no member streams)."""
        if not any(self.streams(host) for host in hosts):
            return
        for worker, pairs in group_pairs(owner):
            self.sent(hosts[worker], layer, np.unique(experts[pairs]).tolist())

    def sent(self, host: ExpertHost, layer: int, experts: Iterable[int]) -> None:
        """Note experts sent to `host` for `layer`: the most recent are kept, as many as fit."""
        if not self.streams(host):
            return
        recent = self._sent.setdefault(host.address, OrderedDict())
        for expert in experts:
            key = (layer, int(expert))
            recent[key] = None
            recent.move_to_end(key)
        room = max(host.inventory.memory_budget // self.expert_bytes, 1)
        while len(recent) > room:
            recent.popitem(last=False)
