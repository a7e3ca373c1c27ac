"""The remote switch's parts that need no network: the shared expert computed ahead (once,
same result), where install() puts it, where prefetch hints go when experts have copies,
and a prompt pass cut into pieces and put back together in place."""


import mlx.core as mx
import mlx.nn as nn
import numpy as np

from coordinator.cluster.snapshot import Snapshot
from coordinator.dataplane.call_plan import plan_call
from coordinator.dataplane.dispatch import Dispatcher, RemoteSwitch, SharedAhead, install
from coordinator.dataplane.link import answer_of, request_bytes
from engine.experts import build_skeleton
from engine.manifest import read_manifest
from engine.moe_layers import get_module
from engine.placement import LayerRoutes
from engine.sharding import shard
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        return self.linear(x)


def test_a_shared_expert_computed_ahead_is_computed_once_and_is_the_same():
    inner = Counting()
    ahead = SharedAhead(inner)
    x = mx.random.normal((3, 4))
    ahead.start(x)  # the first call only learns what the block passes its shared expert
    assert inner.calls == 0
    assert mx.array_equal(ahead(x), inner.linear(x)).item()
    assert ahead.valid and inner.calls == 1

    x2 = mx.random.normal((3, 4))
    ahead.start(x2)
    ahead.start(x2)  # the dispatcher retrying a call after losing a worker
    assert inner.calls == 2
    assert mx.array_equal(ahead(x2), inner.linear(x2)).item()
    assert inner.calls == 2  # the block's own call reused the early result

    x3, other = mx.random.normal((3, 4)), mx.random.normal((3, 4))
    ahead.start(x3)
    assert mx.array_equal(ahead(other), inner.linear(other)).item()  # not for another input
    assert inner.calls == 4


def test_a_block_that_calls_its_shared_expert_first_is_never_computed_ahead():
    inner = Counting()
    ahead = SharedAhead(inner)
    for _ in range(3):
        x = mx.random.normal((2, 4))
        ahead(x)
        ahead.start(x)
    assert ahead.valid is False and inner.calls == 3


def test_a_block_whose_switch_takes_a_latent_never_gives_it_to_the_shared_expert():
    # Kimi K3: switch_mlp(down_proj(x)), shared_experts(x). The latent has another width:
    # computing the shared expert on it ahead would fail (or, worse, compute something else).
    inner = Counting()
    ahead = SharedAhead(inner)
    for _ in range(3):
        x = mx.random.normal((2, 4))
        ahead.start(mx.random.normal((2, 3)))
        assert mx.array_equal(ahead(x), inner.linear(x)).item()
    assert ahead.valid is False and inner.calls == 3


def test_install_wraps_a_shared_expert_where_the_block_has_one(tiny_checkpoint, tmp_path):
    for family, has_shared in (("deepseek_v3", True), ("qwen3_moe", False)):
        out = tmp_path / family
        shard(tiny_checkpoint(family), out, progress=False)
        manifest = read_manifest(out)
        model = build_skeleton(manifest.config)
        blocks = [get_module(model, layer.path.rsplit(".", 1)[0]) for layer in manifest.layers]
        originals = [getattr(block, "shared_experts", None) for block in blocks]
        install(model, manifest, dispatcher=None)
        for block, original in zip(blocks, originals, strict=True):
            assert isinstance(block.switch_mlp, RemoteSwitch)
            shared = getattr(block, "shared_experts", None)
            assert isinstance(shared, SharedAhead) == has_shared
            if has_shared:
                assert shared.inner is original  # the same weights, now computed ahead


class _Link:
    """Answers a request in process with zeros, through a worker's request and reply bytes:
    enough to see who was sent what."""

    in_process = False
    path = "lane"

    def __init__(self) -> None:
        self.inventory = None
        self.address = "in-process"
        self.replies: dict[int, list] = {}  # by channel: each answers in order
        self.experts: list[int] = []

    def whole(self, layer, x, inds, timing=None) -> None:
        return None

    def submit(self, share, timeout: float) -> int:
        data = request_bytes(share)
        self.send(data, share.channel)
        return len(data)

    def collect(self, share, timeout: float):
        return answer_of(self.receive(timeout, share.channel), self.address)

    def hint(self, layer, hint) -> None:
        pass

    def reset(self) -> None:
        pass

    def send(self, data: bytes, lane: int = 0, *, reply: bool = True,
             timeout: float = 0.0) -> None:
        request, tensors = EXPERT_REQUEST.read(data, "request")
        if "hidden" not in tensors:
            return  # a hint alone
        experts = np.frombuffer(tensors["experts"].data, np.int32)
        self.experts += experts.tolist()
        width = tensors["hidden"].shape[1]
        self.replies.setdefault(lane, []).append(EXPERT_REPLY.write(
            shoal_pb2.ExpertReply(seq=request.seq),
            output=(np.zeros((experts.size, width), np.float32), "float32")))

    def receive(self, timeout: float, lane: int = 0):
        return self.replies[lane].pop(0)

    def end_pass(self) -> None:
        assert not any(self.replies.get(lane) for lane in self.replies if lane), "replies owed"
        self.closed_lanes = True


class _Cluster:
    def __init__(self, links: list, routes: dict) -> None:
        self.current = Snapshot(tuple(links), (), routes, 1)


def decode_call(dispatcher: Dispatcher, links: list, layer: int, experts: list[int]
                ) -> tuple[np.ndarray, dict[int, int]]:
    """One decode step's call of `layer` for `experts`: (the members the hints named for
    them just before, {expert: the member it was sent to})."""
    chosen = np.array(experts, dtype=np.int32)
    hinted = dispatcher.next_owners(layer, chosen)
    for link in links:
        link.experts.clear()
    dispatcher(layer, mx.zeros((1, 1, 4)), mx.array(chosen.reshape(1, 1, -1)))
    return hinted, {int(e): w for w, link in enumerate(links) for e in link.experts}


def test_hints_name_the_copy_that_the_next_decode_step_will_use():
    # Every expert of layer 1 has a copy on both workers: calls take turns between them.
    copies = np.array([[0, 1]] * 8, dtype=np.int32)
    routes = {1: LayerRoutes(copies=copies, counts=np.full(8, 2, dtype=np.int32))}
    links = [_Link(), _Link()]
    dispatcher = Dispatcher(_Cluster(links, routes))
    for _ in range(3):
        hinted, sent_to = decode_call(dispatcher, links, 1, [0, 3, 5, 6])
        assert [sent_to[e] for e in [0, 3, 5, 6]] == hinted.tolist()
    assert set(hinted.tolist()) == {0, 1}  # the copies really are spread


def test_spread_deals_an_experts_tokens_over_its_copies_deterministically():
    from coordinator.dataplane.call_plan import spread
    from engine.placement import replica_routes

    holdings = [{(0, 0), (0, 1)}, {(0, 0)}, {(0, 0)}]
    routes = replica_routes({0: 2}, holdings)[0]
    experts = np.array([1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0], dtype=np.int32)
    owner = spread(routes, experts, turn=5)
    assert np.bincount(owner[experts == 0], minlength=3).tolist() == [3, 3, 3]
    assert set(owner[experts == 1].tolist()) == {0}
    assert spread(routes, experts, turn=5).tolist() == owner.tolist()
    # one pair per call (decode): successive calls go round the copies
    single = [int(spread(routes, np.array([0]), turn)[0]) for turn in range(6)]
    assert sorted(single) == [0, 0, 1, 1, 2, 2]


class _Scaling(_Link):
    """Answers pair i with its hidden row times (its expert + 1): where each output lands in
    the result shows whether the dispatcher put it back in its place."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_sent = 0
        self.lanes: set[int] = set()

    def send(self, data: bytes, lane: int = 0, *, reply: bool = True,
             timeout: float = 0.0) -> None:
        request, tensors = EXPERT_REQUEST.read(data, "request")
        self.lanes.add(lane)
        hidden = np.frombuffer(tensors["hidden"].data, np.float32).reshape(
            tensors["hidden"].shape)
        rows = np.frombuffer(tensors["rows"].data, np.int32)
        experts = np.frombuffer(tensors["experts"].data, np.int32)
        self.rows_sent += hidden.shape[0]
        self.experts += experts.tolist()
        self.replies.setdefault(lane, []).append(EXPERT_REPLY.write(
            shoal_pb2.ExpertReply(seq=request.seq),
            output=((hidden[rows] * (experts[:, None] + 1)).astype(np.float32), "float32")))


def test_a_prompt_pass_goes_in_pieces_of_whole_tokens_and_comes_back_in_place():
    # Even experts on worker 0, odd on worker 1; 9 tokens of 3 experts each: 27 pairs.
    copies = (np.arange(8, dtype=np.int32) % 2)[:, None]
    routes = {0: LayerRoutes(copies=copies, counts=np.ones(8, dtype=np.int32))}
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(1, 9, 4)).astype(np.float32))
    inds = np.stack([rng.permutation(8)[:3] for _ in range(9)]).astype(np.int32)[None]
    expected = (np.asarray(x)[..., None, :] * (inds[..., None] + 1)).astype(np.float32)
    requests = {}
    # whole, pieces of about 4 pairs, one token a piece; over 4 streams a worker, then one
    for piece_pairs, lanes in ((0, 4), (4, 4), (1, 4), (1, 1)):
        links = [_Scaling(), _Scaling()]
        dispatcher = Dispatcher(_Cluster(links, routes))
        dispatcher.piece_pairs, dispatcher.channels = piece_pairs, lanes
        out = dispatcher(0, x, mx.array(inds))
        assert np.array_equal(np.asarray(out), expected), piece_pairs
        owners = [inds.reshape(9, 3) % 2 == w for w in range(2)]
        # every token a worker needs is sent to it once, whatever the pieces
        assert [link.rows_sent for link in links] == [int(o.any(axis=1).sum()) for o in owners]
        # pieces are dealt over the streams, each reply read from its own (_Link.receive)
        used = {0: {0}, 1: set(range(lanes))}.get(piece_pairs)  # whole: one; a token each: all
        assert used is None or all(link.lanes == used for link in links), piece_pairs
        # streams beyond the first are ended once a call goes whole, not while in pieces
        assert all(hasattr(link, "closed_lanes") == (piece_pairs == 0) for link in links)
        requests[piece_pairs] = dispatcher.stats.prefill.requests
    assert requests[0] == 2 and 2 < requests[4] < requests[1] <= 18, requests
    # a decode step's few pairs always go whole
    links = [_Scaling(), _Scaling()]
    dispatcher = Dispatcher(_Cluster(links, routes))
    dispatcher.piece_pairs = 1
    dispatcher(0, x[:, :1], mx.array(inds[:, :1]))
    assert dispatcher.stats.decode.requests <= 2
    assert any(hasattr(link, "closed_lanes") for link in links)


def test_a_calls_plan_sends_every_workers_first_piece_first_in_whole_tokens_over_its_lanes():
    k = 2
    owner = np.array([0, 1] * 8 + [1, 1] * 8)  # 16 tokens: worker 1 has 24 pairs, 0 has 8
    plan = plan_call(owner, k, piece_pairs=4, channels=2)
    assert [p.worker for p in plan[:2]] == [0, 1]  # each worker's first piece before seconds
    for worker in (0, 1):
        pieces = [p for p in plan if p.worker == worker]
        pairs = np.concatenate([p.pairs for p in pieces])
        assert np.array_equal(pairs, np.flatnonzero(owner == worker))  # all, once, in order
        assert [p.channel for p in pieces] == [i % 2 for i in range(len(pieces))]
        for p in pieces:
            tokens = p.pairs // k
            assert len(set(tokens.tolist()) & {t for q in pieces if q is not p
                                               for t in (q.pairs // k).tolist()}) == 0
            needed = np.arange(16)[p.needed]
            assert np.array_equal(needed[p.rows], tokens)  # each pair's row is its token's
    assert len([p for p in plan if p.worker == 1]) == 6
    # a worker that streams from its drives, and a decode-sized call, go whole
    assert len([p for p in plan_call(owner, k, piece_pairs=4, channels=2, whole=lambda w: w == 1)
                if p.worker == 1]) == 1
    assert len(plan_call(owner, k, piece_pairs=0, channels=4)) == 2


class _Members:
    """Two fake workers holding every expert of layer 0; counts how often it is read."""

    def __init__(self, links: list) -> None:
        self.links, self.version, self.reads = links, 1, 0
        self.holdings = [frozenset((0, e) for e in range(8))] * 2
        self._watchers: list = []

    def live(self):
        self.reads += 1
        return self.version, list(self.links), list(self.holdings)

    def watch(self, changed) -> None:
        self._watchers.append(changed)

    def report_failure(self, link, detail: str) -> None:
        self.holdings[self.links.index(link)] = frozenset()
        self.version += 1
        for changed in self._watchers:
            changed()


def test_layer_calls_read_the_members_snapshot_and_it_changes_only_by_events():
    from coordinator.cluster.snapshot import Cluster

    links = [_Link(), _Link()]
    members = _Members(links)
    dispatcher = Dispatcher(Cluster.of(members, {0: 8}))
    made = members.reads  # at the start (again once the cluster watches: nothing missed)
    inds = mx.array(np.array([[[0, 3, 5, 6]]], dtype=np.int32))
    for _ in range(5):
        dispatcher(0, mx.zeros((1, 1, 4)), inds)
    assert members.reads == made  # never re-read inside a call
    assert links[0].experts and links[1].experts  # copies on both take turns
    members.report_failure(links[1], "lost")  # an event: the snapshot is made anew, once
    assert members.reads == made + 1
    links[0].experts.clear()
    links[1].experts.clear()
    for _ in range(3):
        dispatcher(0, mx.zeros((1, 1, 4)), inds)
    assert members.reads == made + 1
    assert len(links[0].experts) == 12 and not links[1].experts
