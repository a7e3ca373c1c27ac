"""The remote switch's pure parts: the shared expert computed ahead (once, same result) and
where install() puts it."""

import mlx.core as mx
import mlx.nn as nn

from coordinator.dispatch import RemoteSwitch, SharedAhead, install
from engine.checkpoint import get_module, read_manifest, shard
from engine.experts import build_skeleton


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
    expected = inner.linear(x)
    ahead.start(x)
    ahead.start(x)  # the dispatcher retrying a call after losing a worker
    assert inner.calls == 1
    assert mx.array_equal(ahead(x), expected).item()
    assert inner.calls == 1  # the block's own call reused the early result

    x2, other = mx.random.normal((3, 4)), mx.random.normal((3, 4))
    ahead.start(x2)
    assert mx.array_equal(ahead(other), inner.linear(other)).item()  # not for another input
    assert inner.calls == 3


def test_a_block_that_calls_its_shared_expert_first_is_not_computed_twice():
    inner = Counting()
    ahead = SharedAhead(inner)
    x = mx.random.normal((2, 4))
    ahead(x)
    ahead.start(x)
    assert inner.calls == 1


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
