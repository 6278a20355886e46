"""What a Generator learns across replies, kept apart from the call path.

Per drafter: its step costs (a :class:`CostModel`, started from the bundle's measured
profile) and, per draft-length policy, the snapshot its last controller ended with (its
per-position acceptance among it, so the next reply's first, costly catch-up is judged on
what drafting achieved last time rather than on an optimistic prior). Across
drafters: recent reply lengths, which tell the controller how much of a reply is still
to come. Step costs belong to the machine; acceptance and reply lengths to the text.

Cross-reply memory: the replies themselves (a bounded :class:`ReplyMemory`), which the suffix
drafter drafts from. It lives here, per Generator, so a server (one Generator) shares it
across conversations and slots: a reply in one conversation can speed up another, but never
changes its tokens (every proposal is verified by the target).
"""

from __future__ import annotations

from typing import Sequence

from ..bundle.extra import CostProfile
from .costs import CostModel
from .drafters import needs_draft_model
from .horizon import ReplyLengths
from .policies import Snapshot
from .suffix import ReplyMemory
from .suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS, REPLY_CUE_TOKENS


class SpeculationMemory:
    """Learned state, keyed by drafter name; not thread-safe (the Generator's lock guards it)."""

    def __init__(self, profile: CostProfile | None = None) -> None:
        self.profile = profile  # the measured cost profile new CostModels start from (None: from scratch)
        self.costs: dict[tuple[str, bool], CostModel] = {}  # (drafter, exact) -> its step costs
        # (drafter, policy) -> the last snapshot of that policy's controller for that drafter (what it
        # carries to the next reply; only the policy reads it: runtime/policies)
        self.learned: dict[tuple[str, str], Snapshot] = {}
        self.reply_lengths = ReplyLengths()
        self.replies = ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS)  # earlier replies' tokens

    def costs_for(self, drafter: str, *, exact: bool, uses_model: bool | None = None) -> CostModel:
        """The drafter's learned step costs, kept across calls (created from the profile on first use).
        ``exact``: plain steps run 2 rows (exact mode) or 1; the two are priced apart, since a plain
        step's cost is what every speculative step is weighed against. ``uses_model``: whether it runs
        a draft model here (default: whether it needs one)."""
        costs = self.costs.get((drafter, exact))
        if costs is None:
            uses_model = needs_draft_model(drafter) if uses_model is None else uses_model
            costs = self.costs[(drafter, exact)] = (
                CostModel.from_profile(self.profile, uses_draft_model=uses_model, exact=exact)
                if self.profile is not None else CostModel())
        return costs

    def learned_for(self, drafter: str, policy: str) -> Snapshot | None:
        """What ``policy``'s controller for ``drafter`` carried out of its last reply (None: none yet).
        Keyed by policy too, so a call under another policy (a fixed k) leaves it as it was."""
        return self.learned.get((drafter, policy))

    def remember(self, new_tokens: int, reason: str, drafter: str | None = None,
                 learned: Snapshot | None = None, *, policy: str | None = None) -> None:
        """Record a finished reply: its length (unless cancelled: a cancelled reply's length says
        nothing about the traffic) and the snapshot of its drafter's controller (``policy``'s), if any."""
        if drafter is not None and policy is not None and learned is not None:
            self.learned[(drafter, policy)] = learned
        if reason != "cancelled":
            self.reply_lengths.record(new_tokens, finished=reason in ("stop", "stop_string"))

    def remember_reply(self, tokens: list[int], prompt: Sequence[int] = ()) -> None:
        """Add a reply's tokens, after the last ``REPLY_CUE_TOKENS`` of its prompt, to the cross-reply
        memory (evicting the oldest replies past its bound)."""
        self.replies.add(tokens, cue=list(prompt)[-REPLY_CUE_TOKENS:] if prompt else ())

    def forget_replies(self) -> None:
        """Forget what replies taught (acceptance, reply lengths, the replies themselves); keep the
        machine's step costs."""
        self.learned.clear()
        self.reply_lengths = ReplyLengths()
        self.replies.clear()

    def use_profile(self, profile: CostProfile | None) -> None:
        """A new measured profile: learned step costs restart from it."""
        self.profile = profile
        self.costs.clear()
