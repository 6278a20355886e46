"""Draft-length policies (controllers), and the registry that names them.

Adding a policy is one module here (a class meeting :class:`Controller`: ``name``,
``from_snapshot(setup, learned)``, ``choose``, ``observe``, ``snapshot``) plus one entry in
:data:`POLICIES` (and, to have calls pick it, the rule in :func:`policy_for`). The Generator
builds the chosen policy's controller from :class:`PolicySetup` and the snapshot that policy's
last controller for the same drafter ended with (kept in ``SpeculationMemory.learned``); it reads
back only what :class:`Snapshot` declares (``mode_s``, ``catchup_deferred``, ``counters()``, which
become ``GenerationStats.policy``). So what a policy carries or counts is its own module's business.

A script that traces or varies a policy replaces its entry (``POLICIES["default"] = TracedK``,
a subclass keeps its ``name``); the next call builds it.
"""

from __future__ import annotations

from .adaptive import AdaptiveK, AdaptiveSnapshot
from .base import PLAIN, Controller, DraftPlan, PolicySetup, Snapshot
from .default import DefaultK, DefaultSnapshot
from .fixed import FixedK

FIXED_POLICY = "fixed"  # the call's k, every step
ADAPTIVE_POLICY = "adaptive"  # k from the cost model and the drafter's acceptance
DEFAULT_POLICY = "default"  # per step the source (lookup, guess, model, plain) expected fastest

POLICIES: dict[str, type[Controller]] = {
    FIXED_POLICY: FixedK,
    ADAPTIVE_POLICY: AdaptiveK,
    DEFAULT_POLICY: DefaultK,
}


def policy_for(*, adaptive: bool, per_source: bool) -> str:
    """The policy a call runs: a fixed k unless adaptive; an adaptive drafter with several sources
    (``DrafterSpec.per_source``) needs a policy that chooses the source of each step."""
    if not adaptive:
        return FIXED_POLICY
    return DEFAULT_POLICY if per_source else ADAPTIVE_POLICY


__all__ = ["ADAPTIVE_POLICY", "DEFAULT_POLICY", "FIXED_POLICY", "PLAIN", "POLICIES", "AdaptiveK", "AdaptiveSnapshot",
           "Controller", "DefaultK", "DefaultSnapshot", "DraftPlan", "FixedK", "PolicySetup", "Snapshot", "policy_for"]
