"""The streaming cache's memory: fixed stacked arrays, one per expert parameter, whose slots
hold the resident experts, so that any set of them runs as one gathered call (slot numbers in
place of expert numbers) and a miss costs its read and one copy into its slot."""

from __future__ import annotations

import mlx.core as mx

from engine.errors import CorruptData


class SlotPool:
    """`slots` experts' worth of each parameter, stacked: the switch module's parameters for
    every layer whose experts have the sample's tensor names, shapes and dtypes."""

    def __init__(self, sample: dict[str, mx.array], slots: int) -> None:
        self.signature = signature(sample)
        self.slots = slots
        self.params = {name: mx.zeros((slots, *a.shape), dtype=a.dtype)
                       for name, a in sample.items()}
        mx.eval(self.params)

    def fits(self, tensors: dict[str, mx.array]) -> bool:
        """Whether an expert with these tensors can take a slot."""
        return signature(tensors) == self.signature

    def put(self, slot: int, tensors: dict[str, mx.array]) -> None:
        """Copy one expert's tensors into `slot`, as part of the graph that next uses the slots
        (no evaluation of its own). In place: MLX reuses a stacked array's memory for the
        update when nothing else refers to it (no graph built on it is left unevaluated, which
        the caller sees to), else it copies, which costs time and never changes a result."""
        if not self.fits(tensors):
            raise CorruptData(f"an expert's tensors {sorted(tensors)} do not fit this worker's "
                              f"slots ({sorted(self.signature)})")
        for name, array in tensors.items():
            self.params[name][slot : slot + 1] = array[None]


def signature(tensors: dict[str, mx.array]) -> dict[str, tuple]:
    return {name: (tuple(a.shape), a.dtype) for name, a in tensors.items()}


def pool_for(samples: list[dict[str, mx.array]], slots: int) -> SlotPool | None:
    """A pool of `slots` when the samples (an expert of each layer) all have the same tensors,
    so that any layer's experts fit any slot; else None."""
    if not samples or slots < 1 or any(signature(s) != signature(samples[0]) for s in samples):
        return None
    return SlotPool(samples[0], slots)
