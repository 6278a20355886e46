"""Per-generation statistics, returned as data (the loop prints nothing)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V a conversation slot already held (not prefilled)
    new_tokens: int = 0
    steps: int = 0  # target forward passes after prefill
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # draft tokens committed
    drafted_per_position: list[int] = field(default_factory=list)  # [i] = steps that drafted a token at i
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = steps that accepted the token at i
    k_chosen: dict[int, int] = field(default_factory=dict)  # draft length -> steps
    near_ties: int = 0  # greedy positions whose target top-2 logit gap was below the bundle's near-tie gap
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    total_s: float = 0.0
    time_to_first_token_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # commit time of each new token, from start
    drafter: str = "none"
    mode_s: dict[str, float] = field(default_factory=dict)  # adaptive controller: seconds per mode
    pipelined_steps: int = 0  # steps whose verify ran concurrently with the next block's draft
    overlap_s: float = 0.0  # time draft and verify ran at once (counted in both draft_s and verify_s)
    catchup_s: float = 0.0  # draft time spent reading history it had not seen (counted in draft_s)
    catchup_tokens: int = 0  # tokens fed in those catch-ups (the draft's prefill, bounded by its window)
    catchup_deferred: int = 0  # steps run plain because the draft's catch-up would not have paid off
    reply_memory_tokens: int = 0  # the Generator's cross-reply memory after this reply: tokens held
    reply_memory_bytes: int = 0  # ... and its approximate size in bytes (SuffixTrie.approx_nbytes)
    # The draft-length policy's own counters, by name (its Snapshot.counters(); empty: none). The
    # default policy's (runtime/policies/default.py): lookup_steps (guesses included), guess_steps,
    # model_steps, explore_plain_s (what plain decoding would have spent on this reply's decode steps)
    # and explore_overhead_s (the net seconds speculation spent beyond it; negative: it saved time).
    policy: dict[str, float] = field(default_factory=dict)
    # By step source, any drafter ("lookup": a lookup drafted the step, "model": a draft model did,
    # "plain": nothing was drafted): the steps' seconds (draft with its catch-up, plus verify; a
    # pipelined step's overlap counts in both) and the tokens they committed. Their ratio is what
    # each source really cost a token, catch-ups included (bench: "ms/tok l/m/p").
    source_s: dict[str, float] = field(default_factory=dict)
    source_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Fraction of drafted tokens that were accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target step: 1 + accepted/steps, as vLLM reports it."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens after the first, over the time after the first token."""
        decode_s = self.total_s - self.time_to_first_token_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def record_step(self, k: int, n_drafted: int, n_accepted: int) -> None:
        self.steps += 1
        self.k_chosen[k] = self.k_chosen.get(k, 0) + 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        grow = n_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1

    def record_source(self, source: str, seconds: float, tokens: int) -> None:
        """Add one step of ``source`` ("lookup", "model" or "plain"): its seconds and committed tokens."""
        self.source_s[source] = self.source_s.get(source, 0.0) + seconds
        self.source_tokens[source] = self.source_tokens.get(source, 0) + tokens

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("token_times_s")
        out["k_chosen"] = {str(k): v for k, v in sorted(self.k_chosen.items())}
        out.update(acceptance=self.acceptance, mean_accepted_length=self.mean_accepted_length,
                   tokens_per_s=self.tokens_per_s, acceptance_per_position=self.acceptance_per_position)
        return out
