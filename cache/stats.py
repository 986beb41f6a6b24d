"""Counters of the prefix cache, in tokens and blocks, for metrics and the verify tool."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    # Counted once per sequence, when its first `allocate` takes the hit (not by `lookup`,
    # which a waiting request may call every step).
    num_queried_tokens: int = 0  # prompt tokens of new sequences
    num_device_hit_tokens: int = 0  # of those, served by device-resident blocks
    num_host_hit_tokens: int = 0  # of those, served by host slots (swapped in)
    num_disk_hit_tokens: int = 0  # of those, served by disk slots (read, swapped in)
    num_device_evictions: int = 0  # cached device blocks reused (their hash dropped)
    num_host_evictions: int = 0  # host slots reused (their hash dropped)
    num_swap_in_blocks: int = 0
    num_swap_out_blocks: int = 0
    num_disk_read_blocks: int = 0
    num_disk_write_blocks: int = 0  # planned; the disk tier's own counters say which landed
    # Retained blocks (a client's retention hint) evicted before their TTL: 0 while the
    # retained ones fit under --max-retained-fraction of the tier.
    num_device_retained_evictions: int = 0
    num_host_retained_evictions: int = 0
    # Of the prompt tokens of new sequences, those not served, by why they were computed
    # (cache/miss_reasons.py; wire/client.py UNCACHED_REASONS): with prefix caching on they
    # add up to the queried tokens minus the hits.
    num_uncached_evicted_tokens: int = 0
    num_uncached_diverged_tokens: int = 0
    num_uncached_compaction_tokens: int = 0
    num_uncached_salt_tokens: int = 0
    num_uncached_no_room_tokens: int = 0
    num_uncached_no_state_tokens: int = 0
    num_uncached_new_tokens: int = 0
    num_uncached_block_remainder_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        hits = self.num_device_hit_tokens + self.num_host_hit_tokens + self.num_disk_hit_tokens
        return hits / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}
