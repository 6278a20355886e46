"""Canonical weights that are made when read: a fused copy exists only while the graph builder writes it.

A family's ``extract`` maps most weights to views of the PyTorch parameters (no copy); the
fused ones (q|k|v, gate|up) would each be a new array, together about two thirds of a
decoder's weights, held for the whole export. ``Lazy`` defers such a copy to the read, and
``Weights`` (a read-only Mapping) runs it on every read without keeping the result, so the
export holds one fused copy at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np


class Lazy:
    """A weight computed from the source model each time it is read."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], np.ndarray]) -> None:
        self.make = make


class Weights(Mapping):
    """Canonical name -> float32 array, ``Lazy`` entries computed on each read (never cached)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items._items if isinstance(items, Weights) else items)

    def __getitem__(self, key: str) -> np.ndarray:
        value = self._items[key]
        return value.make() if isinstance(value, Lazy) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __or__(self, other: Mapping[str, Any]) -> "Weights":
        """A copy with ``other``'s entries added or replaced (as ``dict | dict``), still lazy."""
        return Weights({**self._items, **other})
