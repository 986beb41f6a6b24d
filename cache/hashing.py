"""Block hashes: the identity of a full KV block, stable across processes and restarts.

A block's KV depends on every token before it, so its identity is a hash chain:
``h_i = blake2b(h_{i-1} || tokens of block i)`` under a per-tenant ``extra_key``. Only
bytes go into the hash (tokens packed as little-endian uint32), never Python objects:
LMCache got 0% hits from a per-process seed in the root hash and from ``hash(None)``.
The root parent is a fixed constant, and nothing here depends on PYTHONHASHSEED.

A hash is 16 bytes (128 bits). With 42M blocks resident and ~10^5 new blocks a second,
a 64-bit hash would serve someone else's KV roughly once a month; 128 bits makes a
collision practically impossible. The index stores the two 64-bit halves as ``lo, hi``.

Cost: one blake2b call per block, ~1 us of interpreter and C overhead (28,125 blocks of a
450K-token prompt take tens of ms). Hash each sequence once: keep its `BlockHashChain`
and extend it as tokens arrive; never re-hash a known prefix.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 16
BlockHash = bytes  # HASH_BYTES bytes

# Domain separation: a different scheme or version can never produce a matching hash.
_PERSON = b"deepinfer.kv.v1"
# The parent of block 0. A constant, so a chain starts the same in every process.
ROOT_PARENT: BlockHash = hashlib.blake2b(b"deepinfer/kv-block-hash/root", digest_size=16).digest()

_U32_MAX = 2**32 - 1


def make_extra_key(model: str, cache_salt: str | None) -> bytes:
    """The key that separates caches: a different model or salt never shares a block.

    Fields are length-prefixed so ("ab", "c") != ("a", "bc"), and a missing salt is a
    distinct flag (not the string "None"), so None and "" are different tenants too.
    """
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer.xkey")
    m = model.encode()
    h.update(struct.pack("<I", len(m)) + m)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        s = cache_salt.encode()
        h.update(b"\x01" + struct.pack("<I", len(s)) + s)
    return h.digest()


def parent_bytes(parent: bytes | int | None) -> BlockHash:
    """Normalise a chain's parent: None -> ROOT_PARENT, int -> 16 little-endian bytes."""
    if parent is None:
        return ROOT_PARENT
    if isinstance(parent, int):
        assert 0 <= parent < 2 ** (8 * HASH_BYTES), "parent int must fit 128 bits"
        return parent.to_bytes(HASH_BYTES, "little")
    assert isinstance(parent, (bytes, bytearray)) and len(parent) == HASH_BYTES, parent
    return bytes(parent)


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as little-endian uint32 bytes. Out-of-range ids raise instead of wrapping."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > _U32_MAX):
            raise OverflowError("token id out of uint32 range")
        return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    arr = array("I", token_ids)  # raises OverflowError on negative / too large ids
    assert arr.itemsize == 4
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


class BlockHashChain:
    """The hash chain of one token sequence, extended incrementally (append-only tokens).

    Digests are kept packed (16 bytes per block) so a long chain costs 16 bytes a block
    and converts to numpy ``lo, hi`` arrays without a per-block Python object.
    """

    def __init__(self, block_size: int, extra_key: bytes,
                 parent: bytes | int | None = None) -> None:
        assert block_size > 0
        self.block_size = block_size
        self.extra_key = bytes(extra_key)
        self._parent0 = parent_bytes(parent)
        # extra_key and block_size enter every block through a pre-absorbed state, length
        # prefixed so the message (key, parent, tokens) parses one way only.
        base = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)
        base.update(struct.pack("<II", len(self.extra_key), block_size) + self.extra_key)
        self._base = base
        self._digests = bytearray()

    @property
    def num_blocks(self) -> int:
        return len(self._digests) // HASH_BYTES

    def extend(self, token_ids: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> int:
        """Hash the full blocks of ``token_ids`` not hashed yet (at most up to ``max_blocks``).

        ``token_ids`` is the whole sequence so far; its first ``num_blocks`` blocks must be
        the ones already hashed (tokens only ever get appended). Returns ``num_blocks``.
        """
        bs = self.block_size
        stop = len(token_ids) // bs
        if max_blocks is not None:
            stop = min(stop, max_blocks)
        start = self.num_blocks
        if stop <= start:
            return start
        data = pack_tokens(token_ids[start * bs:stop * bs])
        step = 4 * bs
        parent = self._digests[-HASH_BYTES:] if start else self._parent0
        base_copy = self._base.copy
        out = self._digests
        for off in range(0, len(data), step):
            h = base_copy()
            h.update(parent)
            h.update(data[off:off + step])
            parent = h.digest()
            out += parent
        return stop

    def prefix(self, num_blocks: int) -> BlockHashChain:
        """A new chain holding this one's first ``num_blocks`` hashes.

        For a request that repeats a known conversation and adds a turn (coding agents
        resend everything each step): once the caller has checked that the first
        ``num_blocks * block_size`` tokens are identical, ``old.prefix(k).extend(new)``
        hashes only the new blocks instead of the whole prompt."""
        assert 0 <= num_blocks <= self.num_blocks
        out = BlockHashChain(self.block_size, self.extra_key, self._parent0)
        out._digests = bytearray(self._digests[:num_blocks * HASH_BYTES])
        return out

    def digest(self, i: int) -> BlockHash:
        assert 0 <= i < self.num_blocks
        return bytes(self._digests[i * HASH_BYTES:(i + 1) * HASH_BYTES])

    def digests(self, start: int = 0, stop: int | None = None) -> list[BlockHash]:
        stop = self.num_blocks if stop is None else stop
        return [self.digest(i) for i in range(start, stop)]

    def keys(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The hashes of blocks [start, stop) as (lo, hi) uint64 arrays (copies)."""
        stop = self.num_blocks if stop is None else stop
        assert 0 <= start <= stop <= self.num_blocks
        # bytes(...) copies: a numpy view would pin the bytearray and block later appends.
        words = np.frombuffer(bytes(self._digests[start * HASH_BYTES:stop * HASH_BYTES]),
                              dtype="<u8").reshape(-1, 2)
        return words[:, 0].astype(np.uint64), words[:, 1].astype(np.uint64)
