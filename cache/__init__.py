"""Prefix cache bookkeeping (no tensors, no torch): block hashes, the device and host
tiers, and the ops that tell workers which blocks to copy. See cache/manager.py."""

from cache.hashing import BlockHashChain, make_extra_key
from cache.manager import CacheConfig, CacheOps, KVCacheManager, PrefixHit
from cache.stats import CacheStats

__all__ = [
    "BlockHashChain",
    "CacheConfig",
    "CacheOps",
    "CacheStats",
    "KVCacheManager",
    "PrefixHit",
    "make_extra_key",
]
