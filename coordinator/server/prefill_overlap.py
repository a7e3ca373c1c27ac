"""One engine step of `shoal serve` that runs the decode step beside the prompt piece
(`overlapped_step`): two forwards whose MoE layer calls go together (merged_calls.py), so a
piece adds its own work to the running streams' step, not a second pass over the cluster."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from coordinator.dataplane.merged_calls import TURN_TIMEOUT, MergedCalls
from coordinator.server.prefill_pacing import PrefillPacer, paced_step
from engine.errors import ShoalError

PIECE, DECODE = "prompt piece", "decode step"


class _DecodeAside:
    """Stands in for the generator's generation batch while mlx-lm's step runs: the step's
    decode starts on the engine's decode thread, taking turns with the piece at each layer
    call; its responses fill the list returned once it ends (the caller waits for it)."""

    def __init__(self, batch, merged: MergedCalls, decoder: ThreadPoolExecutor) -> None:
        self.batch = batch
        self.merged = merged
        self.decoder = decoder
        self.responses: list = []
        self.seconds = 0.0
        self.done: Future | None = None

    def __len__(self) -> int:
        return len(self.batch)

    def next(self) -> list:
        _computed(self.batch)  # on the engine's thread, before the decode's uses it
        self.merged.join(DECODE)  # before the piece's first layer call: it waits for this one
        self.done = self.decoder.submit(self._run)
        return self.responses

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            with self.merged.taking_part(DECODE):
                self.responses.extend(self.batch.next())
                _computed(self.batch)  # and back: the next step's inputs, the grown caches
        finally:
            self.seconds = time.perf_counter() - started


def _computed(batch) -> None:
    """Compute every array a generation batch holds (its next inputs, its caches' keys,
    values and offsets): MLX streams belong to a thread, and the batch crosses threads."""
    held = [batch._next_tokens, batch._next_logprobs]
    for part in (*batch.prompt_cache, *batch._token_context):
        held += [v for v in vars(part).values() if isinstance(v, mx.array)]
    mx.eval(held)


def can_overlap(generator: BatchGenerator) -> bool:
    """Whether this step is only a decode step and a piece of prompts already being
    prefilled: no prompt admitted and none ending (those steps change the batches' shapes,
    and run as mlx-lm runs them)."""
    processing = generator._currently_processing
    return (len(generator._generation_batch) > 0 and not generator._unprocessed_sequences
            and bool(processing)
            and not any(len(seq[0]) == 1 and len(seq[0][0]) == 1 for seq in processing))


def overlapped_step(pacer: PrefillPacer, generator: BatchGenerator, merged: MergedCalls,
                    decoder: ThreadPoolExecutor, *, streams: bool) -> list:
    """`paced_step`, with the decode step run on `decoder`'s one thread beside the piece when
    the step is only those (`can_overlap`); the step's generation responses. The thread lives
    as long as the engine: MLX gives each thread its own streams."""
    if not pacer.next_piece(streams=streams) or not can_overlap(generator):
        return paced_step(pacer, generator, streams=streams)
    batch = generator._generation_batch
    aside = _DecodeAside(batch, merged, decoder)

    def step() -> tuple[list, list]:
        try:
            with merged.taking_part(PIECE):  # first: the decode thread waits for its turn
                prompted, _ = generator.next()
        finally:
            if aside.done is not None:
                try:
                    aside.done.result(TURN_TIMEOUT)  # raises the decode's error, if any
                except TimeoutError:
                    raise ShoalError("a decode step did not end") from None
        generator._counters.generation_tokens += len(aside.responses)
        generator._counters.decode_time += aside.seconds
        return prompted, aside.responses

    generator._generation_batch = aside
    try:
        return paced_step(pacer, generator, streams=streams, step=step)
    finally:
        generator._generation_batch = batch
