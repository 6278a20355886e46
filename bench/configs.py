"""The configurations a bench compares, and how a ``--configs`` list names them.

Names: ``baseline`` (plain decoding with 1-row steps, as ONNX Runtime GenAI and llama.cpp run it, and
the runtime's default: every speedup divides by it), ``baseline-exact`` (plain decoding with exact
2-row steps, engines/invariant.py: comparing it with ``baseline`` measures what exactness costs),
``<drafter>-k<k>`` (fixed draft length) and ``<drafter>-adaptive`` (the cost model picks k per step,
0 included), with drafter one of the registry's (runtime/drafters.py); a ``-pipelined`` or ``-auto``
suffix runs verify-while-draft (or the measured choice between it and sequential steps), a ``-w<N>``
suffix sets the draft window (``-w0``: the draft reads the whole prompt), and a final ``-exact`` runs
the configuration in exact mode (``GenerationConfig.exact``), checked against ``baseline-exact``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidParameterError
from ..runtime.drafters import DRAFTERS, needs_draft_model
from ..runtime.options import MODES, check

SPEC_DRAFTERS = tuple(DRAFTERS)  # the registry's drafters, in its order
DEFAULT_K_SWEEP = (2, 4, 6, 8)
BASELINE = "baseline"  # plain decoding, 1-row steps: the fastest plain decoding, what every speedup divides by
BASELINE_EXACT = "baseline-exact"  # plain decoding with exact 2-row steps (GenerationConfig.exact=True)
BASELINES = (BASELINE, BASELINE_EXACT)
EXACT_SUFFIX = "-exact"
_NAME = re.compile(rf"^({'|'.join(map(re.escape, SPEC_DRAFTERS))})-(adaptive|k(\d+))"
                   rf"(?:-({'|'.join(m for m in MODES if m != 'sequential')}))?(?:-w(\d+))?({EXACT_SUFFIX})?$")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    drafter: str | None = None  # None = baseline (speculation off)
    draft_tokens: int | None = None  # fixed k; None with a drafter = adaptive
    mode: str = "sequential"  # loop mode: sequential | pipelined | auto
    draft_window: int | None = -1  # tokens; None = the whole history, -1 = the runtime's default
    exact: bool = False  # exact mode: batch-invariant 2-row target steps (off: the runtime's default)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def adaptive(self) -> bool:
        return self.drafter is not None and self.draft_tokens is None

    def generation_config(self, max_new_tokens: int, chat: bool = True):
        """The GenerationConfig for this configuration (greedy: outputs must equal the baseline's)."""
        from ..runtime.options import GenerationConfig

        # Every run is a cold request (reuse_prefix off): the configurations run the same prompt one
        # after another on one Generator, and a kept slot would hand the later ones the prompt's
        # target cache (no prefill: a near-zero TTFT) and a warm draft cache (no catch-up: an
        # inflated speedup). Conversation reuse is measured by `specedge bench conversation`.
        if not self.speculative:
            return GenerationConfig(max_new_tokens=max_new_tokens, speculation=False, chat=chat, exact=self.exact,
                                    reuse_prefix=False)
        window = {} if self.draft_window == -1 else {"draft_window": self.draft_window}
        return GenerationConfig(max_new_tokens=max_new_tokens, drafter=self.drafter, draft_tokens=self.draft_tokens,
                                adaptive=self.adaptive, chat=chat, mode=self.mode, reuse_prefix=False,
                                exact=self.exact, **window)


def parse_config_name(name: str) -> BenchConfig:
    """``baseline`` | ``baseline-exact`` | ``model-k4`` | ``ngram-adaptive-exact`` ... -> BenchConfig."""
    if name == BASELINE:
        return BenchConfig(BASELINE)
    if name == BASELINE_EXACT:
        return BenchConfig(BASELINE_EXACT, exact=True)
    if name == "baseline-1row":  # the name before fast mode became the default
        raise InvalidParameterError("'baseline-1row' is now 'baseline' (1-row plain steps are the default); exact "
                                    "2-row plain decoding is 'baseline-exact'")
    m = _NAME.match(name)
    if not m:
        raise InvalidParameterError(f"unknown bench configuration {name!r}; use baseline, baseline-exact, "
                                    f"<drafter>-k<k> or <drafter>-adaptive (optionally ending in {EXACT_SUFFIX}) "
                                    f"with drafter one of {', '.join(SPEC_DRAFTERS)}")
    drafter, k, mode = m.group(1), m.group(3), m.group(4) or "sequential"
    if k is not None and int(k) < 1:
        raise InvalidParameterError(f"{name!r}: a fixed draft length must be >= 1 (k=0 is the baseline)")
    window: int | None = -1
    if m.group(5) is not None:
        window = check("draft_window", int(m.group(5)) or None, where=f"{name!r}: the draft window (-w0 = the whole "
                       "history)")
    return BenchConfig(name, drafter, int(k) if k is not None else None, mode, window, exact=m.group(6) is not None)


def expand_configs(spec: str | None, *, has_draft: bool, max_draft_tokens: int,
                   k_sweep: tuple[int, ...] = DEFAULT_K_SWEEP) -> tuple[list[BenchConfig], list[str]]:
    """Resolve a comma list into configurations, baseline first; returns (configs, notes).

    ``None`` or ``all``: every available drafter x (the k sweep + adaptive). A bare
    drafter name expands to its sweep + adaptive. Drafters that need a draft model are
    dropped (with a note) when the bundle has none, as are k above max_draft_tokens.
    """
    notes: list[str] = []
    tokens = [t.strip() for t in (spec or "all").split(",") if t.strip()]
    names: list[str] = []
    for token in tokens:
        drafters = SPEC_DRAFTERS if token == "all" else (token,) if token in SPEC_DRAFTERS else ()
        if drafters:
            for d in drafters:
                names += [f"{d}-k{k}" for k in k_sweep] + [f"{d}-adaptive"]
        else:
            names.append(token)
    configs = [BenchConfig(BASELINE)]
    seen = {BASELINE}
    no_draft: list[str] = []
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        config = parse_config_name(name)
        if needs_draft_model(config.drafter) and not has_draft:
            no_draft.append(name)
            continue
        if config.draft_tokens is not None and config.draft_tokens > max_draft_tokens:
            notes.append(f"{name}: skipped, k > the bundle's max_draft_tokens ({max_draft_tokens})")
            continue
        configs.append(config)
    if no_draft:
        notes.append(f"skipped {', '.join(no_draft)}: the bundle has no draft model")
    if any(c.exact for c in configs) and BASELINE_EXACT not in seen:
        # Exact runs are checked against exact plain decoding, token for token.
        configs.insert(1, BenchConfig(BASELINE_EXACT, exact=True))
    return configs, notes
