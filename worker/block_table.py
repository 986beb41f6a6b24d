"""A rank's block table of one sequence: device block ids in a growable int32 array.

The batch's page tables (AttentionMetadata.kv_indices) are the concatenation of every
scheduled sequence's table prefix. Held as Python lists they were copied element by
element into a tensor every step, O(context) Python work per sequence: 28K list items
for a 450K-token agent history, each step. As arrays, a step's page tables are one
numpy concatenate of slices, whatever the context length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class BlockTable:
    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        ids = np.asarray(list(block_ids), dtype=np.int32)
        self._ids = np.empty(max(16, 2 * len(ids)), dtype=np.int32)
        self._ids[:len(ids)] = ids
        self._len = len(ids)

    def extend(self, block_ids: list[int]) -> None:
        n = self._len + len(block_ids)
        if n > len(self._ids):  # double: appends stay O(1) amortised
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        self._ids[self._len:n] = block_ids
        self._len = n

    def pages(self, num_pages: int) -> np.ndarray:
        """The first `num_pages` block ids (a view: valid until the next extend)."""
        return self._ids[:num_pages]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._ids[:self._len][i].tolist()
        if not -self._len <= i < self._len:
            raise IndexError(i)
        return int(self._ids[i % self._len])

    def __delitem__(self, i: slice) -> None:
        """Only a tail: `del table[n:]` (blocks appended for tokens that were dropped)."""
        assert isinstance(i, slice) and i.stop is None and i.step is None, "only a tail"
        self._len = min(self._len, range(self._len)[i].start if i.start is not None else 0)

    def __setitem__(self, i: int, block: int) -> None:  # tests inject faults through it
        if not -self._len <= i < self._len:
            raise IndexError(i)
        self._ids[i % self._len] = block

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        return self._ids[:self._len].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.tolist() == other.tolist()
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"
