"""The scheduler's speculation partner: drafts for a decode step, and what verification taught.

Boundary: it reads requests (their ids and sampling options) and never touches the target's KV,
rows or model; a draft model's own KV and runner are its drafter's (draft_model.py), freed when
the scheduler says a request stopped running (`forget`).  Each decode step the scheduler asks
`drafts` for every running request's draft (maybe empty); if any is non-empty the step is a
TARGET_VERIFY forward, and the scheduler reports each
request's outcome (`observe`) and the step's time (`observe_step`).  Every request may draft:
each verified row samples with its own history (penalties, min_tokens: ScheduleBatch.row_histories)
and grammar state (ScheduleBatch.row_grammars); a constrained request's draft ends before the
first token its grammar refuses.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from graphexec.speculative.cost_model import StepCosts
from graphexec.speculative.ngram import NgramDrafter
from graphexec.speculative.policy import choose_lengths

if TYPE_CHECKING:
    from graphexec.batch.request import Req
    from graphexec.config import SpeculativeConfig


class Drafter(Protocol):
    """Proposes drafts for a whole decode step at once (ngram.py, draft_model.py)."""

    # True when a proposal always fills its room (a draft model); False when it may be shorter
    # or empty (prompt lookup finds no match).
    fills_room: bool

    def propose_batch(self, reqs: Sequence[Req], rooms: Sequence[int]) -> list[tuple[int, ...]]:
        """Per request at most `rooms[i]` deterministic draft tokens (room 0: ())."""
        ...

    def forget(self, req: Req) -> None:
        """The request stopped running: free whatever is kept for it."""
        ...


# Running acceptance per request: counts decay by this factor per verified draft, so a request
# that stops copying stops drafting within a few steps.  The engine-wide rate, a new request's
# prior, decays more slowly: it describes the traffic, not one text.
_DECAY = 0.8
_GLOBAL_DECAY = 0.99
# Each step a request had a draft the policy passed over, its counts shrink by this factor, so its
# rate drifts back to the prior and it tries again: text that starts copying after a miss (a
# rename in code past its first lines) must not stay priced by that miss for good.
_IDLE_DECAY = 0.9


@dataclass
class _Acceptance:
    drafted: float = 0.0
    accepted: float = 0.0

    def alpha(self, prior: float) -> float:
        """The acceptance rate with one prior draft accepted at rate `prior`: never 0 or 1."""
        return (self.accepted + prior) / (self.drafted + 1.0)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.drafted = self.drafted * decay**drafted + drafted
        self.accepted = self.accepted * decay**drafted + accepted

    def fade(self, factor: float) -> None:
        self.drafted *= factor
        self.accepted *= factor


@dataclass(frozen=True)
class SpeculationStats:
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    # Accepted drafts per verified request-step: {accepted count: how often}.
    accepted_lengths: dict[int, int]
    step_ms_by_rows: dict[int, float]

    def as_dict(self) -> dict:
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None
        verified = sum(self.accepted_lengths.values())
        mean = sum(k * n for k, n in self.accepted_lengths.items()) / verified if verified else None
        return {
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": rate,
            "mean_accepted_length": mean,
            "accepted_lengths": {str(k): n for k, n in sorted(self.accepted_lengths.items())},
            "step_ms_by_rows": {str(k): v for k, v in self.step_ms_by_rows.items()},
        }


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None):
        """`drafter`: the draft model's (the engine builds it); ngram's is built here."""
        self.config = config
        self.drafter = drafter if drafter is not None else NgramDrafter(config.ngram_min, config.ngram_max)
        self.costs = StepCosts()
        self._acceptance: weakref.WeakKeyDictionary[Req, _Acceptance] = weakref.WeakKeyDictionary()
        self._overall = _Acceptance()  # every request's drafts: a new request's prior
        self._verify_steps = 0
        self._drafted = 0
        self._accepted = 0
        self._lengths: Counter[int] = Counter()

    def drafts(self, reqs: Sequence[Req], spare_slots: int) -> list[tuple[int, ...]] | None:
        """Per request the draft to verify this step (maybe empty); None when nobody drafts (a
        plain decode step).  Never more draft tokens in all than `spare_slots`."""
        rooms = [self._room(req) for req in reqs]
        if self.drafter.fills_room:
            # A draft model proposes as many tokens as asked, each at the price of a forward:
            # decide the lengths first, so it never drafts what would not be verified.
            lengths = self._verify_lengths(reqs, rooms, spare_slots)
            drafts = self.drafter.propose_batch(reqs, lengths) if any(lengths) else []
            drafts = [_within_grammar(req, d) for req, d in zip(reqs, drafts)]
        else:
            proposals = [_within_grammar(req, p) for req, p in zip(reqs, self.drafter.propose_batch(reqs, rooms))]
            lengths = self._verify_lengths(reqs, [len(p) for p in proposals], spare_slots)
            drafts = [p[:n] for p, n in zip(proposals, lengths)]
        return drafts if any(drafts) else None

    def _verify_lengths(self, reqs: Sequence[Req], proposed: Sequence[int], spare_slots: int) -> list[int]:
        """How many of each request's `proposed` draft tokens to verify."""
        if not any(proposed):
            return [0] * len(proposed)
        if self.config.policy == "always":
            lengths, left = [], spare_slots
            for n in proposed:
                lengths.append(max(0, min(n, left)))
                left -= lengths[-1]
            return lengths
        prior = self._overall.alpha(0.5)
        alphas = [self._acceptance.get(req, _Acceptance()).alpha(prior) for req in reqs]
        lengths = choose_lengths(alphas, proposed, self.costs, spare_slots)
        for req, n, k in zip(reqs, proposed, lengths):
            if n and not k and req in self._acceptance:
                self._acceptance[req].fade(_IDLE_DECAY)
        return lengths

    def _room(self, req: Req) -> int:
        """Draft tokens the request may verify this step (0: it does not draft)."""
        # Every verified row may yield a token: the drafts plus one must fit what the request
        # may still produce, and every row's position must fit its table row.
        return max(0, min(
            self.config.num_draft_tokens,
            req.params.max_new_tokens - len(req.output_ids) - 1,
            req.max_context - req.seq_len,
        ))

    def forget(self, req: Req) -> None:
        """The request stopped running (finished, aborted, retracted): the drafter frees what it
        kept for it (a draft model's KV)."""
        self.drafter.forget(req)

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        """A request verified `drafted` tokens this step and the first `accepted` were taken."""
        if not drafted:
            return
        self._acceptance.setdefault(req, _Acceptance()).add(drafted, accepted, _DECAY)
        self._overall.add(drafted, accepted, _GLOBAL_DECAY)
        self._drafted += drafted
        self._accepted += accepted
        self._lengths[accepted] += 1

    def observe_step(self, rows: int, seconds: float, verified: bool) -> None:
        """A decode or verify step of `rows` rows took `seconds`."""
        self.costs.observe(rows, seconds)
        self._verify_steps += verified

    def stats(self) -> SpeculationStats:
        return SpeculationStats(
            self._verify_steps, self._drafted, self._accepted, dict(self._lengths), self.costs.as_dict()
        )


def _within_grammar(req: Req, draft: tuple[int, ...]) -> tuple[int, ...]:
    """A constrained request's draft up to the first token its grammar would refuse."""
    if not draft or req.grammar is None:
        return draft
    return draft[: req.grammar.valid_draft_length(draft)]
