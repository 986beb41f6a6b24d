"""Block-hash chains of recent sessions, so a session's next prompt hashes only its new turn.

A coding agent resends its whole conversation every step: the prompt of turn n+1
extends the prompt and output of turn n. Hashing a 450K-token prompt from scratch
costs ~30 ms of blake2b in CPython; starting from the previous turn's chain and
hashing only the new blocks costs a few ms. The shared prefix is found by comparing
token ids (a vectorised compare, well under a millisecond), never assumed, so a
session whose history was edited still gets correct hashes.

The latest sequence of each session, whatever its cache key, is also what a miss is
measured against (`latest`, cache/miss_reasons.py: an edited history, a compaction,
another salt).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from cache.hashing import BlockHashChain
from cache.miss_reasons import PreviousPrompt


class SessionChains:
    def __init__(self, block_size: int, max_sessions: int = 256) -> None:
        self.block_size = block_size
        self.max_sessions = max_sessions
        self._last: OrderedDict[tuple[bytes, str], tuple[np.ndarray, BlockHashChain]] = (
            OrderedDict())
        self._latest_key: dict[str, bytes] = {}  # session -> key of its latest sequence

    def chain_for(self, session: str | None, extra_key: bytes,
                  tokens: list[int]) -> BlockHashChain:
        """A chain for this prompt, seeded with the hashes it shares with the session's
        last sequence (empty if the session is unknown or diverged at block 0)."""
        entry = self._last.get((extra_key, session)) if session else None
        if entry is None:
            return BlockHashChain(self.block_size, extra_key)
        self._last.move_to_end((extra_key, session))
        known, chain = entry
        n = min(len(known), len(tokens), chain.num_blocks * self.block_size)
        new = np.asarray(tokens[:n], dtype=np.int64)
        mismatch = np.flatnonzero(known[:n] != new)
        common = int(mismatch[0]) if mismatch.size else n
        return chain.prefix(common // self.block_size)

    def remember(self, session: str | None, extra_key: bytes, tokens: list[int],
                 chain: BlockHashChain) -> None:
        """Keep a finished sequence's tokens and chain as its session's latest."""
        if not session:
            return
        key = (extra_key, session)
        self._last[key] = (np.asarray(tokens, dtype=np.int64), chain)
        self._last.move_to_end(key)
        self._latest_key[session] = extra_key
        while len(self._last) > self.max_sessions:
            (old_key, old_session), _ = self._last.popitem(last=False)
            if self._latest_key.get(old_session) == old_key:
                del self._latest_key[old_session]

    def latest(self, session: str | None) -> PreviousPrompt | None:
        """The session's latest finished sequence, under whichever cache key it had."""
        key = self._latest_key.get(session) if session else None
        if key is None:
            return None
        tokens, chain = self._last[(key, session)]
        return PreviousPrompt(tokens, chain)
