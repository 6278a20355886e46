"""How many more tokens will this reply run? An estimate from the replies before it.

The adaptive controller pays a draft's one-off catch-up (its deferred prompt prefill)
only when the rest of the reply can pay it back, so it needs the expected remaining
length. A deployment's replies are alike in length (a voice agent's are short, a
code assistant's long), so the best predictor is this Generator's own recent replies:
the mean remaining length of those that ran past the tokens generated so far.
"""

from __future__ import annotations

from collections import deque


class ReplyLengths:
    """Recent reply lengths (new tokens) and the expected remaining length given progress.

    With no reply on record yet, or once this reply has outrun every recorded one, the
    estimate is the tokens generated so far (a reply that has run n tokens is expected
    to run about n more, the rule behind ski rental's 2-competitive bound): the first
    reply starts plain and speculates once it has proved long enough to pay.
    """

    # 32 replies: enough to average over a conversation's turns, short enough to follow
    # a change of task within a minute of a voice agent's use.
    KEEP = 32

    def __init__(self) -> None:
        self._lengths: deque[int] = deque(maxlen=self.KEEP)

    def __len__(self) -> int:
        return len(self._lengths)

    def record(self, new_tokens: int, finished: bool) -> None:
        """Record a reply. ``finished``: it ended by itself (EOS or a stop string). A reply
        cut by max_new_tokens or the context would have run on, so its length is only a lower
        bound, counted as twice itself by the same rule as the no-history estimate."""
        if new_tokens <= 0:
            return
        self._lengths.append(new_tokens if finished else 2 * new_tokens)

    def expected_remaining(self, generated: int, budget_left: int) -> float:
        """Expected further tokens after ``generated``, at most ``budget_left``."""
        longer = [length - generated for length in self._lengths if length > generated]
        estimate = sum(longer) / len(longer) if longer else float(max(generated, 1))
        return float(min(estimate, max(budget_left, 0)))
