"""A rank's block tables: every open sequence's device block ids, one row each of a 2-D
int32 array (as vLLM's and SGLang's workers hold theirs).

The batch's page tables (AttentionMetadata.kv_indices) are the concatenation of every
scheduled sequence's table prefix. Held as Python lists they were copied element by
element into a tensor every step, O(context) Python work per sequence: 28K list items
for a 450K-token agent history, each step. Held as one array per sequence, a step still
paid a few Python calls per sequence (its table, its length, its slice) and a
concatenate of as many arrays: about 50 us at batch 64, on every rank, every step. In
one array, a step's page tables are one gather (`page_lists`): a few numpy calls
whatever the batch and the context lengths.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping

import numpy as np


class BlockTables(Mapping[int, "BlockTable"]):
    """seq_id -> its BlockTable. Rows and columns double as needed (appends stay O(1)
    amortised), columns up to `max_cols` (a sequence's most blocks) unless a table needs
    more; a closed sequence's row is reused.

    The main thread changes the tables; the rank's control thread reads them (`snapshot`,
    `copy_of`) under a lock the changes take too, uncontended but for those reads."""

    def __init__(self, rows: int = 16, cols: int = 16, max_cols: int | None = None) -> None:
        self._ids = np.zeros((rows, cols), dtype=np.int32)
        self._lens = np.zeros(rows, dtype=np.int64)
        self._row: dict[int, int] = {}  # seq_id -> its row
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first
        self._max_cols = max_cols
        self._lock = threading.Lock()

    # --- the mapping ---------------------------------------------------------------

    def __getitem__(self, seq_id: int) -> BlockTable:
        return BlockTable(self, self._row[seq_id])

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row

    def __iter__(self) -> Iterator[int]:
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)

    def __repr__(self) -> str:
        return f"BlockTables({self.snapshot()})"

    # --- for another thread -----------------------------------------------------------

    def snapshot(self) -> dict[int, list[int]]:
        """Every open table, copied at one instant."""
        with self._lock:
            return {s: self._ids[r, :self._lens[r]].tolist() for s, r in self._row.items()}

    def copy_of(self, seq_id: int) -> list[int] | None:
        """One table, copied (None: not open)."""
        with self._lock:
            row = self._row.get(seq_id)
            return None if row is None else self._ids[row, :self._lens[row]].tolist()

    # --- what plans do to them ------------------------------------------------------

    def open(self, seq_id: int, block_ids: Iterable[int]) -> None:
        assert seq_id not in self._row, f"seq {seq_id} opened twice"
        block_ids = list(block_ids)
        with self._lock:
            if not self._free_rows:
                self._grow(rows=2 * len(self._lens))
            row = self._free_rows.pop()
            self._lens[row] = 0
            self._extend_row(row, block_ids)
            self._row[seq_id] = row

    def close(self, seq_id: int) -> None:
        with self._lock:
            self._free_rows.append(self._row.pop(seq_id))

    def extend(self, seq_id: int, block_ids: list[int]) -> None:
        with self._lock:
            self._extend_row(self._row[seq_id], block_ids)

    def _extend_row(self, row: int, block_ids: list[int]) -> None:
        start = int(self._lens[row])
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            doubled = 2 * self._ids.shape[1]
            self._grow(cols=max(end, min(doubled, self._max_cols or doubled)))
        self._ids[row, start:end] = block_ids
        self._lens[row] = end

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self._ids.shape
        rows, cols = rows or old_rows, cols or old_cols
        ids = np.zeros((rows, cols), dtype=np.int32)
        ids[:old_rows, :old_cols] = self._ids
        self._ids = ids
        if rows > old_rows:
            self._lens = np.concatenate([self._lens, np.zeros(rows - old_rows, np.int64)])
            self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows

    # --- a step's page tables --------------------------------------------------------

    def rows(self, seq_ids: list[int]) -> np.ndarray:
        row = self._row
        return np.array([row[s] for s in seq_ids], dtype=np.int64)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return self._lens[rows]

    def page_lists(self, rows: np.ndarray, num_pages: np.ndarray,
                   starts: np.ndarray) -> np.ndarray:
        """The first num_pages[i] block ids of row rows[i], for every i, concatenated
        (row i's from starts[i] on: the exclusive cumulative sum of num_pages): one
        gather over the flat array (the caller checked num_pages <= the lengths)."""
        flat = np.repeat(rows * self._ids.shape[1] - starts, num_pages)
        flat += np.arange(len(flat))
        return self._ids.ravel()[flat]


class BlockTable:
    """One sequence's row of a BlockTables, read and changed like a list of ints (the
    rank's own checks, the tests and their fault injection use it so; another thread
    reads `BlockTables.snapshot` instead). Only valid while its sequence is open."""

    __slots__ = ("_tables", "_row")

    def __init__(self, tables: BlockTables, row: int) -> None:
        self._tables, self._row = tables, row

    def _view(self) -> np.ndarray:
        t = self._tables
        return t._ids[self._row, :t._lens[self._row]]

    def extend(self, block_ids: list[int]) -> None:
        with self._tables._lock:
            self._tables._extend_row(self._row, block_ids)

    def __len__(self) -> int:
        return int(self._tables._lens[self._row])

    def __getitem__(self, i: int | slice) -> int | list[int]:
        view = self._view()
        if isinstance(i, slice):
            return view[i].tolist()
        if not -len(view) <= i < len(view):
            raise IndexError(i)
        return int(view[i])

    def __delitem__(self, i: slice) -> None:
        """Only a tail: `del table[n:]` (blocks appended for tokens that were dropped)."""
        assert isinstance(i, slice) and i.stop is None and i.step is None, "only a tail"
        n = len(self)
        with self._tables._lock:
            self._tables._lens[self._row] = min(n, range(n)[i].start if i.start is not None
                                                else 0)

    def __setitem__(self, i: int, block: int) -> None:  # tests inject faults through it
        view = self._view()
        if not -len(view) <= i < len(view):
            raise IndexError(i)
        with self._tables._lock:
            view[i] = block

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        return self._view().tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.tolist() == other.tolist()
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"
