"""How the cache tests read hashes: the hashes of a token list (`block_hashes`), and a
snapshot of what each block and slot of a KVCacheManager holds, by hash, to compare
before and after an operation (`digest_state`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cache.hashing import HASH_BYTES, BlockHash, BlockHashChain
from cache.manager import KVCacheManager


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, extra_key: bytes,
                 parent: bytes | int | None = None) -> list[BlockHash]:
    """Hashes of the FULL blocks of ``token_ids`` (a trailing partial block is not hashed).

    ``parent`` continues a chain: pass the last hash of the previous part (bytes or a
    128-bit int); None starts at the fixed ROOT_PARENT.
    """
    chain = BlockHashChain(block_size, extra_key, parent)
    chain.extend(token_ids)
    return chain.digests()


def keys_to_bytes(lo: np.ndarray, hi: np.ndarray) -> list[BlockHash]:
    """Inverse of `BlockHashChain.keys`: (lo, hi) arrays back to 16-byte hashes."""
    words = np.empty((len(lo), 2), dtype="<u8")
    words[:, 0] = lo
    words[:, 1] = hi
    raw = words.tobytes()
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


@dataclass(frozen=True)
class CacheDigest:
    """Registered device blocks and host slots with the hash of the KV they hold.

    Arrays, not dicts: at full scale there are ~42M entries. ``fingerprint()`` is what
    to compare; ``device_map()``/``host_map()`` to look inside.
    """

    device_blocks: np.ndarray  # int32 [n], ascending
    device_keys: np.ndarray  # uint64 [n, 2] (lo, hi)
    host_slots: np.ndarray  # int32 [m], ascending
    host_keys: np.ndarray  # uint64 [m, 2]

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16, person=b"deepinfer.dgst")
        for a in (self.device_blocks, self.device_keys, self.host_slots, self.host_keys):
            h.update(len(a).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes())
        return h.hexdigest()

    def device_map(self) -> dict[int, BlockHash]:
        keys = keys_to_bytes(self.device_keys[:, 0], self.device_keys[:, 1])
        return dict(zip(self.device_blocks.tolist(), keys))

    def host_map(self) -> dict[int, BlockHash]:
        keys = keys_to_bytes(self.host_keys[:, 0], self.host_keys[:, 1])
        return dict(zip(self.host_slots.tolist(), keys))


def digest_state(m: KVCacheManager) -> CacheDigest:
    """Registered device blocks and host slots of ``m`` with their hashes."""
    def snap(index) -> tuple[np.ndarray, np.ndarray]:
        items = index.registered_items()
        return items, np.stack(index.keys_of(items), axis=1)

    db, dk = snap(m.device.index)
    hs, hk = snap(m.host.index)
    return CacheDigest(db, dk, hs, hk)
