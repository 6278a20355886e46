"""The policy seam (runtime/policies): a policy is its module plus a registry entry.

Guards: every registered policy is named by its key; the Generator picks fixed / adaptive /
default by the same rule as before; a policy rebuilds itself from its own snapshot, so a field
added to a snapshot (or a counter) reaches the next reply and the stats without the Generator
knowing it; a call under another policy leaves a policy's learned record as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from specedge.runtime.options import GenerationConfig
from specedge.runtime.policies import (ADAPTIVE_POLICY, DEFAULT_POLICY, FIXED_POLICY, POLICIES, AdaptiveK, DefaultK,
                                       DefaultSnapshot, FixedK, Snapshot, policy_for)

PROMPT = list(range(6, 26))


def test_every_policy_is_registered_under_its_own_name():
    assert {name: cls.name for name, cls in POLICIES.items()} == {name: name for name in POLICIES}
    assert Snapshot().counters() == {}


def test_a_call_runs_fixed_k_adaptive_k_or_the_default_policy():
    assert policy_for(adaptive=False, per_source=True) == FIXED_POLICY
    assert policy_for(adaptive=True, per_source=False) == ADAPTIVE_POLICY
    assert policy_for(adaptive=True, per_source=True) == DEFAULT_POLICY


def test_the_generator_builds_the_policy_of_each_call(reference):
    gen = reference(draft="self")
    pick = gen._drafter_and_controller
    assert isinstance(pick(GenerationConfig(draft_tokens=3))[1], FixedK) and pick(GenerationConfig(draft_tokens=3))[1].k == 3
    assert type(pick(GenerationConfig(drafter="model", adaptive=True))[1]) is AdaptiveK
    assert type(pick(GenerationConfig())[1]) is DefaultK


@dataclass(frozen=True)
class CountingSnapshot(DefaultSnapshot):
    replies: int = 0  # a field the Generator has never heard of


class CountingK(DefaultK):
    """The default policy plus one carried field and one counter: a change made in its own module."""

    def __init__(self, *args, replies: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replies = replies

    @classmethod
    def from_snapshot(cls, setup, learned):
        made = super().from_snapshot(setup, learned)
        made.replies = learned.replies if learned is not None else 0
        return made

    def snapshot(self) -> CountingSnapshot:
        return CountingSnapshot(**vars(super().snapshot()), replies=self.replies + 1)


def test_a_field_added_to_a_policy_snapshot_reaches_the_next_reply_and_the_stats(reference, monkeypatch):
    monkeypatch.setitem(POLICIES, DEFAULT_POLICY, CountingK)
    monkeypatch.setattr(CountingSnapshot, "counters", lambda self: {**DefaultSnapshot.counters(self),
                                                                    "replies": self.replies})
    gen = reference(draft="self")
    first = gen.generate(input_ids=PROMPT, max_new_tokens=8)
    second = gen.generate(input_ids=PROMPT, max_new_tokens=8)
    assert first.stats.policy["replies"] == 1 and second.stats.policy["replies"] == 2
    assert {"lookup_steps", "guess_steps", "model_steps", "explore_plain_s", "explore_overhead_s"} <= set(second.stats.policy)
    assert second.stats.to_dict()["policy"] == second.stats.policy


def test_a_fixed_k_call_leaves_what_the_default_policy_learned(reference):
    gen = reference(draft="self")
    gen.generate(input_ids=PROMPT, max_new_tokens=12)
    learned = gen.memory.learned_for("auto", DEFAULT_POLICY)
    assert isinstance(learned, DefaultSnapshot)
    fixed = gen.generate(input_ids=PROMPT, max_new_tokens=12, draft_tokens=2)
    assert fixed.stats.policy == {}  # a fixed k counts nothing of its own
    assert gen.memory.learned_for("auto", DEFAULT_POLICY) is learned
    assert gen._drafter_and_controller(GenerationConfig())[1].budget_s == max(learned.budget_s, 0.0)  # an overdraft is not carried
