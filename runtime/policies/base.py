"""What every draft-length policy (controller) meets, and what it reports.

``choose(limit) -> DraftPlan`` picks k in 0..limit (0 = a plain target step) and the drafter's
source to draft from (``ANY_SOURCE`` unless the controller chooses one); ``observe(step)``
feeds back how much of the step was accepted (its costs go to the CostModel, which the loop
feeds; a controller only reads it); ``snapshot()`` is all the loop and the Generator read back:
the stats every policy reports (:class:`Snapshot`), its own counters, and what the next reply's
controller of the same policy starts from (``from_snapshot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..costs import CostModel, StepOutcome
from ..drafting import ANY_SOURCE, SOURCES


@dataclass(frozen=True)
class DraftPlan:
    """A controller's choice for the next step."""

    k: int  # tokens to draft, 0..limit (0: a plain target step)
    source: str = ANY_SOURCE  # which of the drafter's sources drafts them (runtime/drafting.py SOURCES)

    def __post_init__(self) -> None:
        if self.k < 0 or self.source not in SOURCES:
            raise ValueError(f"a draft plan needs k >= 0 and a source in {SOURCES}; got {self.k}, {self.source!r}")


PLAIN = DraftPlan(0)


@dataclass(frozen=True)
class Snapshot:
    """What any controller reports after a run (read by the Generator, never probed). A policy that
    carries something to the next reply subclasses it with those fields; only the policy reads them."""

    catchup_deferred: int = 0  # steps run plain because a catch-up would not have paid off
    mode_s: tuple[tuple[str, float], ...] = ()  # ("speculative" | "plain", seconds) pairs; empty: not tracked

    def counters(self) -> dict[str, float]:
        """The policy's own counters, by name (``GenerationStats.policy``); none by default."""
        return {}


@dataclass(frozen=True)
class PolicySetup:
    """What a call gives the controller it builds, beside the drafter's last snapshot of that policy."""

    draft_tokens: int  # the call's k (a fixed policy drafts exactly this many)
    start_k: int  # an adaptive policy's first k (the call's k, or the bundle's when the call's is 0)
    max_draft_tokens: int  # the largest k an adaptive policy may choose
    costs: CostModel  # the drafter's one CostModel: the loop feeds it, the controller only reads it
    has_model: bool  # whether the drafter runs a draft model here


class Controller(Protocol):
    """Chooses the draft length k (and the source) of each step.

    ``name`` is its registry key (runtime/policies/__init__.py POLICIES); ``from_snapshot`` builds
    it for one call from ``setup`` and the snapshot its own policy's last controller for this
    drafter ended with (None: none yet)."""

    name: str

    @classmethod
    def from_snapshot(cls, setup: PolicySetup, learned: Snapshot | None) -> "Controller": ...

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        """k in 0..limit and its source. ``catchup_tokens``: what the drafter's model reads before
        drafting; ``expected_remaining``: tokens this reply is still expected to run (None =
        unknown); ``lookup_tokens``/``lookup_match``: what the drafter's lookup has ready (no model)
        and the match length it continues (its ``LookupOffer``; match 0: not known)."""
        ...

    def observe(self, step: StepOutcome) -> None: ...

    def snapshot(self) -> Snapshot: ...
