"""FixedK: always the call's k (fewer only near the context or token limit)."""

from __future__ import annotations

from ...errors import InvalidParameterError
from ..costs import StepOutcome
from .base import DraftPlan, PolicySetup, Snapshot


class FixedK:
    """Always draft ``k`` tokens (fewer only near the context or token limit); learns nothing."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise InvalidParameterError(f"draft_tokens must be >= 0; got {k}")
        self.k = k

    @classmethod
    def from_snapshot(cls, setup: PolicySetup, learned: Snapshot | None) -> "FixedK":
        return cls(setup.draft_tokens)

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        return DraftPlan(max(min(self.k, limit), 0))

    def observe(self, step: StepOutcome) -> None:
        pass

    def snapshot(self) -> Snapshot:
        return Snapshot()
