"""What a call returns: ``GenerationResult`` (text, token ids, why it finished, stats) and
``TextStream``, the iterator of text deltas ``Generator.stream`` hands out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..engines.base import Interrupt
from .stats import GenerationStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens (EOS included when it ended generation)
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or max_context), "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)
    prompt_ids: list[int] = field(default_factory=list)
    message: str = ""  # why it finished, in words, when that is not obvious

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "message": self.message, "prompt_tokens": len(self.prompt_ids), "stats": self.stats.to_dict()}


class TextStream:
    """Iterator of text deltas, one per committed block; ``cancel()`` stops the forward in progress
    (ONNX Runtime on CPU stops it between graph nodes; other engines finish it) or the next block.

    While a stream is being iterated it holds its Generator (one KV cache per model), so
    other calls wait: exhaust it, ``close()`` it, or use it as a context manager.
    """

    def __init__(self, deltas: Iterator[str], result: GenerationResult, cancel: Interrupt) -> None:
        self._deltas = deltas
        self._cancel = cancel  # the run checks it after every block
        self.result = result  # filled as blocks commit; final once the iterator is exhausted or closed

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop generating now; ``result`` keeps what was committed. Releases the Generator.

        Safe from any thread: while another thread is inside ``next()`` (a generator cannot be
        closed while it runs), the stream is cancelled instead; it stops at the next block
        boundary, and that thread's iteration ends there.
        """
        try:
            self._deltas.close()
        except ValueError:  # "generator already executing": another thread is iterating right now
            self._cancel.set()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
