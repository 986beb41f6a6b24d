"""A step's sampled tokens back into its sequences: the results side of the scheduler.

After the ranks ran a plan, rank 0's sampled tokens become each sequence's output: a
stop token or a length ends it (the next plan closes it, scheduler/scheduler.py
`Scheduler._close`), a drafted decode keeps the drafts its samples agree with and gives
back the blocks appended only for the rejected ones, and a sequence closed ahead of its
last token (`Scheduler._close_ahead`) gets that token as its end.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from operator import itemgetter

from cache.manager import KVCacheManager
from scheduler.request import Sequence
from scheduler.speculation import SpecStats
from wire.client import RequestOutput
from wire.config import EngineConfig
from wire.lifecycle import EngineLimits
from wire.step import StepPlan, TrimBlocks


class Results:
    def __init__(self, config: EngineConfig, limits: EngineLimits, cache: KVCacheManager,
                 running: list[Sequence], awaiting: dict[int, Sequence],
                 finish: Callable[[Sequence, str], None]) -> None:
        """`running` and `awaiting` are the scheduler's (never rebound: changed in place,
        here and there); `finish` ends a sequence (`Scheduler._finish`)."""
        self.limits = limits
        self.block_size = config.block_size
        self.cache = cache
        self.running = running
        self._awaiting = awaiting
        self._finish = finish
        self.speculative = config.speculative  # None: no drafts
        self.spec_stats = SpecStats()
        self._trims: list[TrimBlocks] = []  # tables to shorten by the next plan (`_trim`)

    def update(self, plan: StepPlan, sampled: list[tuple[int, int]], step: int,
               outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Apply rank 0's sampled tokens of `plan` (`step`: the scheduler's next); return
        `outputs`, the outputs decided while planning, with the new ones after them."""
        by_id = {seq.seq_id: seq for seq in self.running}
        now = time.monotonic()
        # a drafted decode yields several tokens in a row; any other chunk one (and
        # without speculative decoding every chunk is another: no grouping to do)
        groups = (((seq_id, [token]) for seq_id, token in sampled)
                  if self.speculative is None else
                  ((seq_id, [t for _, t in group])
                   for seq_id, group in itertools.groupby(sampled, key=itemgetter(0))))
        for seq_id, tokens in groups:
            seq = by_id.get(seq_id)
            if seq is None:
                ended = self._awaiting.pop(seq_id, None)
                if ended is not None:
                    (token,) = tokens
                    outputs.append(self._last_token(ended, token, now))
                # else aborted or preempted while the step ran; its close is already made
                continue
            seq.num_pending -= 1
            seq.first_token_time = seq.first_token_time or now
            drafted = seq.num_drafts > 0
            if drafted:
                assert step == plan.step + 1, "a plan was made before a drafted step's end"
                self.spec_stats.record(seq.num_drafts, len(tokens) - 1)
                # the KV of rejected drafts is garbage: no longer counted as computed
                seq.num_computed -= seq.num_drafts - (len(tokens) - 1)
                seq.num_drafts = 0
            else:
                assert len(tokens) == 1, f"seq {seq_id}: {len(tokens)} tokens, no drafts"
            for token in tokens:
                seq.append_output(token)
                reason = seq.stop_reason(token, self.limits.max_model_len)
                if reason is not None:  # the accepted tokens after it are dropped
                    self.running.remove(seq)
                    self._finish(seq, reason)
                    break
            else:
                if drafted:
                    self._trim(seq)
            outputs.append(seq.take_output())
        return outputs

    def take_trims(self) -> list[TrimBlocks]:
        """The table trims due since the last call (`_trim`), for the next plan."""
        trims, self._trims = self._trims, []
        return trims

    def _trim(self, seq: Sequence) -> None:
        """Drop the blocks a drafted step appended only for rejected drafts, from the
        cache now and on the ranks by the next plan (this step has completed: nothing
        reads or writes them any more). The table then holds exactly the blocks of the
        KV written, as after a plain decode."""
        keep = -(-seq.num_computed // self.block_size)
        if len(seq.block_ids) <= keep:
            return
        dropped = self.cache.trim(seq.seq_id, keep)
        assert dropped == seq.block_ids[keep:] and seq.num_sent_blocks == len(seq.block_ids)
        del seq.block_ids[keep:]
        seq.num_sent_blocks = keep
        self._trims.append(TrimBlocks(seq.seq_id, keep, dropped))

    def _last_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        """The token of a sequence closed ahead of it (`Scheduler._close_ahead`): certain
        to end it."""
        seq.num_pending -= 1
        seq.append_output(token)
        seq.first_token_time = seq.first_token_time or now
        reason = seq.stop_reason(token, self.limits.max_model_len)
        assert reason is not None, f"seq {seq.seq_id} was closed ahead of a token not its last"
        self._finish(seq, reason)  # closed already: it only leaves
        return seq.take_output()
