"""How many tokens a draft proposes: the acceptance estimate (`Acceptance`, `observe`), the
rule that turns it into the next depth (`DraftPolicy`, `draft_count`, `next_draft`), and what a
speculative run counted (`SpeculativeStats`); shared by a draft model and the MTP module."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidInput

DEFAULT_DRAFT_TOKENS = 3


@dataclass(frozen=True)
class DraftPolicy:
    """How many tokens to draft, from the acceptance and the step times seen so far.

    `alpha` estimates the chance that a drafted token is accepted given that the ones before
    it were, so the n-th drafted token is used with chance alpha**n. It is worth proposing when
    that exceeds what it costs, in plain decode steps: the measured extra time of a drafting
    step per drafted token (the draft's forward and one more row for the target), and never
    less than `min_gain` (the default stops drafting at an acceptance of 25% or less, as
    deltafin's drafter does on general chat). Drafting starts at one token and grows as the
    draft proves itself. While stopped, one token is drafted every `probe_every` tokens, the
    wait doubling after each failed probe, so that a draft that becomes useful is noticed and
    a useless one costs little; a probe first feeds the draft what it missed (at most the last
    `probe_every` tokens), so where drafting is dear the wait is also long enough for a probe
    to cost at most `probe_budget` of the time between probes. Every `measure_every` drafting
    steps one plain step keeps the plain step time current.
    """

    max_draft: int = DEFAULT_DRAFT_TOKENS
    min_gain: float = 0.25
    decay: float = 0.8  # per verification step: older steps count less
    probe_every: int = 32
    probe_budget: float = 0.02
    measure_every: int = 32
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft <= 64:
            raise InvalidInput(f"--num-draft-tokens must be between 1 and 64, "
                               f"got {self.max_draft}")


@dataclass(frozen=True)
class Acceptance:
    """What the policy knows: decayed counts of accepted drafted tokens and of rejections (one
    per step that did not accept all it was offered), step times, and where plain decoding
    stands while drafting is stopped."""

    accepted: float = 0.0
    rejected: float = 0.0
    plain_seconds: float | None = None  # a plain step's time (moving average)
    cost: float | None = None  # a drafting step's extra time per drafted token, in plain steps
    steps: int = 0
    since_measure: int = 0  # drafting steps since the last plain step
    plain_tokens: int = 0  # generated without drafting since drafting last stopped
    probe_wait: int = 0  # plain tokens before the next probe

    @property
    def alpha(self) -> float:
        """Accepted over offered, with one accepted and one rejected token of prior belief,
        so that one unlucky step does not stop drafting."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (old + new) / 2


def observe(
    policy: DraftPolicy, state: Acceptance, proposed: int, accepted: int,
    seconds: float | None = None,
) -> Acceptance:
    """Fold one target forward into the estimate: `proposed` 0 is a plain step; `seconds`,
    its time (None for the first, which also read the prompt)."""
    state = replace(state, steps=state.steps + 1)
    if proposed == 0:
        return replace(state, plain_tokens=state.plain_tokens + 1, since_measure=0,
                       plain_seconds=state.plain_seconds if seconds is None
                       else _average(state.plain_seconds, seconds))
    was_drafting = draft_count(policy, state) > 0
    if seconds is not None and state.plain_seconds:
        extra = max(0.0, seconds - state.plain_seconds) / (proposed * state.plain_seconds)
        state = replace(state, cost=_average(state.cost, extra))
    rejected = 1.0 if accepted < proposed else 0.0
    state = replace(state, accepted=state.accepted * policy.decay + accepted,
                    rejected=state.rejected * policy.decay + rejected, plain_tokens=0,
                    since_measure=state.since_measure + 1)
    if draft_count(policy, state) == 0:  # stopped: wait before probing again
        first = was_drafting or state.probe_wait == 0
        wait = policy.probe_every if first else 2 * state.probe_wait
        # a probe reads up to probe_every + 1 tokens into the draft, each at most `cost`
        dear = math.ceil((policy.probe_every + 1) * (state.cost or 0.0) / policy.probe_budget)
        state = replace(state, probe_wait=max(wait, dear))
    return state


def draft_count(policy: DraftPolicy, state: Acceptance) -> int:
    """Tokens worth drafting for the next step: the most n with alpha**n above the cost."""
    if not policy.adaptive:
        return policy.max_draft
    alpha = state.alpha
    threshold = max(policy.min_gain, state.cost or 0.0)
    if alpha <= threshold:
        return 0
    n = math.ceil(math.log(threshold) / math.log(alpha)) - 1 if threshold < 1 else 0
    return max(0, min(policy.max_draft, n))


def next_draft(policy: DraftPolicy, state: Acceptance) -> int:
    """Tokens to draft in the next step: draft_count; or a plain step to time when the plain
    step time is unknown or old; or one token as a probe when drafting is stopped and its wait
    is over."""
    n = draft_count(policy, state)
    if not policy.adaptive:
        return n
    if n > 0 and state.steps > 0 and (
        state.plain_seconds is None or state.since_measure >= policy.measure_every
    ):
        return 0
    if n == 0 and state.plain_tokens >= state.probe_wait:
        return 1
    return n


@dataclass
class SpeculativeStats:
    """What the draft did in one generation, for --stats and --json."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # target forwards that checked drafted tokens
    plain_steps: int = 0  # target forwards without drafted tokens (drafting stopped)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (token index, new N)
    draft: str = "model"  # what drafted: "model" (a draft model) or "mtp" (the model's own)
    draft_forwards: int = 0  # the MTP module's forwards: one round trip to its experts each

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def report(self, generated: int) -> dict:
        steps = self.verify_steps + self.plain_steps
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "tokens_per_step": generated / steps if steps else 0.0,
            "draft": self.draft,
            "draft_forwards": self.draft_forwards,
            "draft_changes": [{"token": t, "num_draft_tokens": n} for t, n in self.changes],
        }
