"""The prefix index's changes as KV events (wire/kv_events.py), for a cache-aware router.

The manager calls one method wherever a tier's hash index gains or loses a key, so the
events replayed in order rebuild exactly the set of (medium, hash) the index holds. A move
between tiers is two events: a removal from one medium and a store in the other.

A store names the block's tokens and its parent's hash (a router re-derives its own keys
from them). A device block's tokens are known when it is registered, but a copy to the
host happens later, at eviction (write_back) or a step after (write_through), from a
block whose sequence may be gone: so the recorder keeps each registered device block's
tokens and parent, 4 bytes a token of device capacity (and nothing when events are off:
the manager then has no recorder at all).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wire.kv_events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

_NO_PARENT = np.uint64(0)


class KVEventRecorder:
    def __init__(self, num_device_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._tokens = np.zeros((num_device_blocks, block_size), dtype=np.int32)
        self._parent = np.zeros(num_device_blocks, dtype=np.uint64)
        self._has_parent = np.zeros(num_device_blocks, dtype=bool)
        # A fresh manager knows nothing: a router must forget what this replica's last
        # life told it (a restart sends this too, and the seq counts from 0 again).
        self._events: list[KVEvent] = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def device_stored(self, blocks: np.ndarray, positions: np.ndarray, chain_lo: np.ndarray,
                      lo_start: int, token_ids: Sequence[int]) -> None:
        """Device ``blocks[i]`` now holds chain position ``positions[i]`` (ascending).

        ``chain_lo``: the chain's low hash words from position ``lo_start`` on, covering
        every position and the parent of the first."""
        if len(blocks) == 0:
            return
        bs = self.block_size
        for run in _runs(positions):
            ps, bl = positions[run], blocks[run]
            first = int(ps[0])
            hashes = chain_lo[ps - lo_start]
            parent = int(chain_lo[first - 1 - lo_start]) if first > 0 else None
            toks = np.asarray(token_ids[first * bs:(int(ps[-1]) + 1) * bs], dtype=np.int64)
            self._tokens[bl] = toks.reshape(-1, bs)
            self._parent[bl[1:]] = hashes[:-1]
            self._has_parent[bl[1:]] = True
            self._parent[bl[0]] = parent if parent is not None else _NO_PARENT
            self._has_parent[bl[0]] = parent is not None
            self._events.append(BlockStored(hashes.tolist(), parent, toks.tolist(), bs,
                                            MEDIUM_DEVICE))

    def host_stored(self, device_blocks: np.ndarray, lo: np.ndarray) -> None:
        """Host slots now hold copies of ``device_blocks`` (hashes ``lo``), in any order."""
        order = np.arange(len(device_blocks))
        for run in _chains(lo, self._parent[device_blocks], self._has_parent[device_blocks],
                           order):
            bl = device_blocks[run]
            parent = int(self._parent[bl[0]]) if self._has_parent[bl[0]] else None
            self._events.append(BlockStored(lo[run].tolist(), parent,
                                            self._tokens[bl].reshape(-1).tolist(),
                                            self.block_size, MEDIUM_HOST))

    def removed(self, lo: np.ndarray, medium: str) -> None:
        if len(lo):
            self._events.append(BlockRemoved(lo.tolist(), medium))

    def device_removed(self, lo: np.ndarray) -> None:
        self.removed(lo, MEDIUM_DEVICE)

    def host_removed(self, lo: np.ndarray) -> None:
        self.removed(lo, MEDIUM_HOST)


def _runs(positions: np.ndarray) -> list[np.ndarray]:
    """Index ranges of ``positions`` that are consecutive integers."""
    if len(positions) == 0:
        return []
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    return np.split(np.arange(len(positions)), cuts)


def _chains(lo: np.ndarray, parent: np.ndarray, has_parent: np.ndarray,
            order: np.ndarray) -> list[np.ndarray]:
    """Split entries into runs where each one's parent is the entry before it.

    Copies to the host come tail first (cache/tier_moves.py `copy_to_host`), so the entries
    are walked in reverse: a freed chain then goes out as one event, head first."""
    rev = order[::-1]
    runs: list[list[int]] = []
    for i in rev.tolist():
        if runs and has_parent[i] and parent[i] == lo[runs[-1][-1]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [np.asarray(r, dtype=np.intp) for r in runs]
