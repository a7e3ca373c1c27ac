"""MergedCalls: forwards on two threads take turns, their layer calls go as one with each
forward's rows, each gets its own rows back; one that ends or fails leaves the other going."""

import threading

import mlx.core as mx
import pytest

from coordinator.dataplane.merged_calls import MergedCalls


class Members:
    """A layer call that scales each row by its layer's number plus one, and records it."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []  # (layer, rows)
        self.fail_at = fail_at

    def __call__(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        self.calls.append((layer, x.shape[0]))
        if layer == self.fail_at:
            raise RuntimeError(f"layer {layer} failed")
        return (x * (layer + 1))[:, None, :] + mx.zeros((1, inds.shape[1], 1))


def forward(merged: MergedCalls, members: Members, name: str, x: mx.array, layers: int,
            out: dict) -> None:
    try:
        with merged.taking_part(name):
            for layer in range(layers):
                inds = mx.zeros((*x.shape[:-1], 2), dtype=mx.uint32)
                x = merged.call(layer, x, inds, members)[..., 0, :]
            mx.eval(x)  # on this thread's stream
            out[name] = x
    except Exception as e:  # noqa: BLE001 (checked by the test)
        out[name] = e


def run_two(members: Members, layers: tuple[int, int]) -> dict:
    merged, out = MergedCalls(), {}
    piece = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    decode = mx.ones((2, 1, 4))
    mx.eval(piece, decode)  # made on this thread's stream, used on others
    threads = [threading.Thread(target=forward, args=(merged, members, name, x, n, out))
               for name, x, n in (("piece", piece, layers[0]), ("decode", decode, layers[1]))]
    merged.join("piece")
    merged.join("decode")  # both take part before either starts, as the engine's step does
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    out["merged"] = merged.merged
    return out


def test_two_forwards_make_each_layer_call_together_and_get_their_own_rows_back():
    members = Members()
    out = run_two(members, (3, 3))
    assert members.calls == [(0, 5), (1, 5), (2, 5)] and out["merged"] == 3
    piece = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    assert mx.array_equal(out["piece"], piece * 6) and out["piece"].shape == (1, 3, 4)
    assert mx.array_equal(out["decode"], mx.ones((2, 1, 4)) * 6)


def test_a_forward_that_ends_first_leaves_the_other_going_alone():
    members = Members()
    out = run_two(members, (4, 2))
    assert members.calls == [(0, 5), (1, 5), (2, 3), (3, 3)]
    assert mx.array_equal(out["decode"], mx.ones((2, 1, 4)) * 2)


def test_a_failed_call_fails_every_forward_in_it():
    out = run_two(Members(fail_at=1), (3, 3))
    assert isinstance(out["piece"], RuntimeError) and isinstance(out["decode"], RuntimeError)


def test_a_thread_not_taking_part_is_not_a_forward_of_the_merge():
    merged = MergedCalls()
    assert not merged.taking_part_now()
    with merged.taking_part("alone"):
        assert merged.taking_part_now()
        x = merged.call(0, mx.ones((1, 2, 4)), mx.zeros((1, 2, 2), dtype=mx.uint32),
                        Members())
    assert x.shape == (1, 2, 2, 4) and not merged.taking_part_now()


if __name__ == "__main__":
    pytest.main([__file__])
