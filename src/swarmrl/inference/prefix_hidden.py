"""Hidden states of the token sequences an engine computed, found again by a shared prefix.

With prefix caching, vLLM does not compute a prompt's leading blocks when it still holds their
keys and values from an earlier request (the same task's other samples, an episode's earlier
turns): its hidden-state capture then starts at the first computed position. A proof needs the
hidden state of every position, so :class:`HiddenPrefixes` keeps those of the sequences the
engine computed, and :meth:`~HiddenPrefixes.find` gives back the first ``length`` of them for
a new sequence with the same first ``length`` tokens. The cached blocks hold what the engine
computed for exactly those tokens with the same weights, so the rows are the ones it would
have computed again (the engine clears both caches whenever its weights change).

Sequences are indexed at every multiple of the engine's block size (a cache hit always ends
on a block boundary) by a chained hash of their blocks; a hit is confirmed token for token.
The oldest sequences are forgotten first once the rows held pass ``max_bytes``. Knows nothing
about vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Stored:
    tokens: tuple[int, ...]
    hidden: torch.Tensor  # [rows, hidden]: row i is position i (rows ≤ len(tokens))
    keys: list[tuple[int, int]]


class HiddenPrefixes:
    """Hidden states by token prefix (see the module docstring)."""

    def __init__(self, block: int, max_bytes: int) -> None:
        if block <= 0:
            raise ValueError(f"block size must be positive, got {block}")
        self.block = block
        self.max_bytes = max_bytes
        self.bytes = 0
        self._stored: OrderedDict[int, _Stored] = OrderedDict()  # oldest first
        self._index: dict[tuple[int, int], int] = {}  # (length, chained hash) -> stored id
        self._next = 0

    def __len__(self) -> int:
        return len(self._stored)

    def _keys(self, tokens: Sequence[int], rows: int) -> list[tuple[int, int]]:
        keys, chained = [], 0
        for end in range(self.block, rows + 1, self.block):
            chained = hash((chained, tuple(tokens[end - self.block : end])))
            keys.append((end, chained))
        return keys

    def add(self, tokens: Sequence[int], hidden: torch.Tensor) -> None:
        """Keep ``hidden`` (row i = position i of ``tokens``) for later :meth:`find` calls."""
        rows = min(len(hidden), len(tokens))
        keys = self._keys(tokens, rows)
        size = hidden.element_size() * hidden.numel()
        if not keys or size > self.max_bytes:
            return
        ident, self._next = self._next, self._next + 1
        self._stored[ident] = _Stored(tuple(tokens[:rows]), hidden[:rows], keys)
        self.bytes += size
        for key in keys:
            self._index[key] = ident  # the newest holder of a prefix answers for it
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self._stored)))

    def _forget(self, ident: int) -> None:
        stored = self._stored.pop(ident)
        self.bytes -= stored.hidden.element_size() * stored.hidden.numel()
        for key in stored.keys:
            if self._index.get(key) == ident:
                del self._index[key]

    def find(self, tokens: Sequence[int], length: int) -> torch.Tensor | None:
        """Rows ``[0, length)`` of a kept sequence whose first ``length`` tokens are
        ``tokens[:length]``, or None."""
        if length <= 0 or length % self.block or length > len(tokens):
            return None
        ident = self._index.get(self._keys(tokens, length)[-1])
        if ident is None:
            return None
        stored = self._stored[ident]
        if stored.tokens[:length] != tuple(tokens[:length]):
            return None  # a hash collision
        self._stored.move_to_end(ident)
        return stored.hidden[:length]

    def clear(self) -> None:
        self._stored.clear()
        self._index.clear()
        self.bytes = 0
