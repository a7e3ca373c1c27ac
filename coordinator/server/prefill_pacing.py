"""How many prompt tokens each step of `shoal serve`'s engine prefills (`PrefillPacer`): a piece
sized by time, measured as it runs, so running streams wait about two decode steps at most; a
whole prompt when no stream is running."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `shoal serve --help` imports this module: no MLX for a constant
    from mlx_lm.generate import BatchGenerator

WHOLE = 1 << 30  # a piece no prompt reaches: nothing else runs, so nothing waits for it
FIRST_PIECE = 16  # tokens of the first piece beside running streams, before any is measured
BUDGET_STEPS = 2.0  # a piece costs at most about this many decode steps of the running streams
REFRESH = 8  # beside streams, every this many steps with a piece, one that only decodes
RECENT = 4096  # pieces kept for inspection (tests, /health)


@dataclass(frozen=True)
class Piece:
    """One engine step's prefill: `tokens` computed, the step taking `step_seconds` in all,
    of which `seconds` the piece (beyond a decode step alone); `streams`: whether running
    streams waited for it, whose decode step alone took `decode_seconds` then."""

    tokens: int
    seconds: float
    step_seconds: float
    streams: bool
    decode_seconds: float


@dataclass
class PrefillPacer:
    """Chooses each step's prefill piece. Beside running streams it aims at `budget_steps`
    times their decode step, both measured as they run (a step's wall time: what the streams
    wait, whichever part of it mlx-lm books the device's work to): each piece is the last one
    scaled by how far its cost fell from the budget (at most halved or doubled a step), which
    follows a cost that grows with the context, and `most` tokens at most. Alone, a whole
    prompt: the model then computes it in its own passes of `--prefill-step`, and nobody waits."""

    most: int = WHOLE
    budget_steps: float = BUDGET_STEPS
    decode_step: float = 0.0  # seconds of a step that only decodes, moving average
    piece: int = FIRST_PIECE  # the next piece beside running streams
    pieces: deque[Piece] = field(default_factory=lambda: deque(maxlen=RECENT))
    since_decode: int = 0  # steps with a piece beside streams since the last decode alone

    @property
    def budget(self) -> float:
        """Seconds a piece may cost beside running streams (0 until a decode step is seen)."""
        return self.budget_steps * self.decode_step

    def next_piece(self, *, streams: bool) -> int:
        """Tokens of prompt the next step may prefill; `streams`: whether any stream decodes.
        Every REFRESH-th step beside streams only decodes: the budget follows the decode
        step as the load and the context change it."""
        if not streams:
            return WHOLE
        return 0 if self.since_decode >= REFRESH else min(self.piece, self.most)

    def observe(self, *, step_seconds: float, decode_steps: int, prompt_tokens: int,
                streams: bool) -> None:
        """What one engine step did: its wall time, its decode steps (0 or 1), the prompt
        tokens it computed."""
        if decode_steps and not prompt_tokens:
            step = step_seconds
            self.decode_step = step if not self.decode_step else 0.8 * self.decode_step + 0.2 * step
            self.since_decode = 0
        if not prompt_tokens:
            return
        self.since_decode += streams
        cost = step_seconds - (self.decode_step if decode_steps else 0.0)
        self.pieces.append(Piece(prompt_tokens, cost, step_seconds, streams, self.decode_step))
        if not streams or prompt_tokens < self.piece or not self.budget:
            return  # a prompt's last tokens, or one alone: says nothing of a full piece's cost
        # prompts prefilled together each take a piece: their cost scales the piece itself
        scale = min(2.0, max(0.5, self.budget / max(cost, 1e-6)))
        piece = self.piece * scale  # down to the budget, never rounded back over it
        self.piece = max(1, min(self.most, int(piece) if scale < 1 else round(piece)))


def paced_step(pacer: PrefillPacer, generator: BatchGenerator, *, streams: bool,
               step: Callable[[], tuple[list, list]] | None = None) -> list:
    """One step of mlx-lm's BatchGenerator with its prefill piece chosen by `pacer` (the
    generator slices each prompt by `prefill_step_size` at every step, and computes a slice
    in passes of the size it was made with); the step's generation responses. `step` stands
    in for the generator's `next` (prefill_overlap.py)."""
    generator.prefill_step_size = pacer.next_piece(streams=streams)
    with generator.stats() as spent:
        _, responses = (step or generator.next)()
    pacer.observe(step_seconds=spent.wall_time, decode_steps=spent.generation_steps,
                  prompt_tokens=spent.prompt_tokens, streams=streams)
    return responses
