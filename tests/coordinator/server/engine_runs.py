"""Running one request through serve's BatchEngine to its end, for the tests of what the
engine does beside it."""

import queue

from coordinator.server.batching import BatchEngine, Event, Sampling


def tokens_of(engine: BatchEngine, prompt: list[int], n: int) -> list[int]:
    """The `n` tokens `engine` answers `prompt` with (greedy), each event checked for errors."""
    events: queue.Queue[Event] = queue.Queue()
    engine.submit(prompt, Sampling(max_tokens=n, top_logprobs=0), events.put)
    tokens = []
    while True:
        event = events.get(timeout=120)
        assert event.error is None, event.error
        tokens += [s.token for s in event.logprobs]
        if event.finish_reason is not None:
            return tokens
