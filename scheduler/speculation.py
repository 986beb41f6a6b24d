"""Draft tokens by prompt lookup (n-gram speculation), and their acceptance.

A coding agent's output repeats its context: an edit rewrites lines it just read, a
tool call quotes a path. So the tokens that followed the last earlier occurrence of the
sequence's last n tokens are a good guess for what comes next. The scheduler proposes
them as drafts, the ranks score the last known token and the drafts in one forward (a
decode chunk of 1 + K tokens, like a short prefill), and the longest prefix that the
model's own samples agree with is kept, plus the model's token after it. Greedy output
is therefore exactly what plain decoding gives; with sampling too, the kept tokens have
the model's distribution (a draft is a point guess: it is kept only when the token the
model samples at its position equals it).

The lookup runs every step for every decoding sequence, so it is incremental: each
sequence keeps, per n, a dict from a hash of an n-gram to the position just after its
latest occurrence, extended by the tokens that arrived since the last proposal (a long
prompt, at its first decode, in one numpy pass). A hash collision can only propose a bad
draft, which verification rejects: output never depends on it. The index costs about
100 bytes per prompt token and n: long contexts may want a lookup window (not done).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from wire.client import HistogramData
from wire.config import SpeculativeConfig

if TYPE_CHECKING:
    from scheduler.guided import Guide

_MASK64 = (1 << 64) - 1
_P = 0x100000001B3  # an odd multiplier: a polynomial hash of the n-gram, mod 2^64
_BULK = 64  # from this many new positions on, index with numpy (a prompt at first decode)


def _ngram_hash(window: Tokens[int]) -> int:
    h = 0
    for t in window:
        h = (h * _P + t) & _MASK64
    return h


def _ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """The hash of every window of n tokens, as `_ngram_hash` computes it one at a time."""
    num = len(tokens) - n + 1
    h = np.zeros(num, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(_P) + tokens[j:j + num]
    return h


@dataclass
class NgramIndex:
    """Per sequence: where each n-gram (min_n <= n <= max_n) last ended, for n-grams that
    end before the sequence's last token (so one token at least follows each)."""

    min_n: int
    max_n: int
    # n -> hash of the n-gram -> the position just after its latest occurrence
    ends: dict[int, dict[int, int]] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending at positions < this are in `ends`

    def __post_init__(self) -> None:
        self.ends = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def _extend(self, tokens: Tokens[int], upto: int) -> None:
        """Index the n-grams that end at positions [num_indexed, upto)."""
        lo = self.num_indexed
        if upto - lo >= _BULK:
            start = max(lo - self.max_n, 0)
            arr = np.asarray(tokens[start:upto], dtype=np.uint64)
        for n, table in self.ends.items():
            first = max(lo, n)
            if first >= upto:
                continue
            if upto - lo >= _BULK:  # later windows overwrite earlier ones: the latest wins
                hashes = _ngram_hashes(arr[first - n - start:upto - 1 - start], n)
                table.update(zip(hashes.tolist(), range(first, upto)))
            else:
                for end in range(first, upto):
                    table[_ngram_hash(tokens[end - n:end])] = end
        self.num_indexed = max(lo, upto)

    def propose(self, tokens: Tokens[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier occurrence of the
        longest suffix n-gram of `tokens` found (n from max_n down to min_n); [] if none."""
        num = len(tokens)
        if max_drafts <= 0 or num <= self.min_n:
            return []
        # every n-gram that ends before the last token (the suffix itself is the query)
        self._extend(tokens, num)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            end = self.ends[n].get(_ngram_hash(tokens[num - n:num]))
            if end is not None:
                return list(tokens[end:min(end + max_drafts, num)])
        return []


@dataclass
class SpecStats:
    """Counters since start, for /metrics: draft tokens proposed and accepted, and how many
    steps accepted each number of drafts (index: accepted drafts, 0 to the most drafted)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafted_steps: int = 0
    accepted_histogram: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_drafted_steps += 1
        if len(self.accepted_histogram) <= num_accepted:
            self.accepted_histogram.extend([0] * (num_accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[num_accepted] += 1

    def histogram(self, max_drafts: int) -> HistogramData:
        """Drafts kept per drafted decode, as /metrics' histogram (bucket <= 0, <= 1, ...)."""
        counts = self.accepted_histogram + [0] * (max_drafts + 2 - len(self.accepted_histogram))
        return HistogramData([float(b) for b in range(max_drafts + 1)], counts,
                             float(self.num_accepted_tokens))


def propose_drafts(index: NgramIndex, tokens: Tokens[int], config: SpeculativeConfig,
                   room: int) -> list[int]:
    """The drafts for a sequence whose tokens are `tokens`, at most `room` of them (what
    max_tokens and the context leave after the token the step samples anyway)."""
    return index.propose(tokens, min(config.num_speculative_tokens, room))


def guided_drafts(drafts: list[int], guide: Guide,
                  stop_token_ids: Set[int]) -> tuple[list[int], list[bytes]]:
    """A guided sequence's drafts, and the mask of the sample after each.

    They end at a stop token (which ends the sequence before the grammar sees it), or at
    the first token the grammar refuses (the model could never sample it there, so
    nothing after it could be kept, and the grammar cannot mask past it). The grammar is
    left as it was (`Guide.draft_masks`): the results advance it by the kept tokens
    alone."""
    stop = next((i for i, t in enumerate(drafts) if t in stop_token_ids), len(drafts))
    masks = guide.draft_masks(drafts[:stop])
    return drafts[: len(masks)], masks
