"""Admission and prefix holds under the device block budget.

Each step the scheduler (scheduler/scheduler.py `Scheduler.schedule`) runs the running
sequences first, growing their block tables (`grow_running`, `grow`), then admits
waiting sequences into the token budget left (`admit_waiting`): those whose disk reads
are in, then the queue in order, each once its grammar has compiled. Last, the waiting
sequences hold their cached prefixes with the blocks left (`hold_waiting`), so that
other sessions' prefills do not evict them; a hold gives way, the last in the queue
first, to a running sequence or to the queue's head before anything is preempted.

`AdmissionControl` works on the scheduler's own queue and lists, given at construction
(where a sequence is, and when it moves: `Scheduler.__init__`), and takes its blocks
through the cache (cache/manager.py `allocate`, `grow`, `hold`; the cache's side of a
prefix hit and a hold is cache/admission.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cache.manager import KVCacheManager
from scheduler.guided import GrammarError
from scheduler.plan_rows import run_tokens, tokens_to_run
from scheduler.queue import RequestQueue
from scheduler.request import SeqStatus, Sequence
from scheduler.session_chains import SessionChains
from wire.client import RequestOutput
from wire.config import EngineConfig
from wire.step import StepPlan

GRAMMAR_WAIT_S = 0.05  # an idle step waits this long for the queue head's grammar


class AdmissionControl:
    def __init__(self, config: EngineConfig, cache: KVCacheManager, sessions: SessionChains,
                 queue: RequestQueue, reading: list[Sequence], running: list[Sequence],
                 snapshot_interval: int | None,
                 finish: Callable[[Sequence, str], None]) -> None:
        """`queue`, `reading` and `running` are the scheduler's (never rebound: changed in
        place, here and there); `finish` ends a sequence (`Scheduler._finish`);
        `snapshot_interval` as for `run_tokens`."""
        self.config = config
        self.block_size = config.block_size
        self.cache = cache
        self._sessions = sessions
        self.queue = queue
        self._reading = reading
        self.running = running
        self._snapshot_interval = snapshot_interval
        self._finish = finish
        self.speculative = config.speculative  # None: no drafts

    def admit_waiting(self, plan: StepPlan, budget: int,
                      outputs: list[RequestOutput]) -> bool:
        """Admit waiting sequences while `budget`, sequence slots and blocks last, and
        while the step's prefill tokens are fewer than `prefill_pack_tokens`: first
        those whose disk reads are in, then the queue in order. The outputs decided on
        the way go to `outputs`. True: the queue's head found no room (`hold_waiting`).

        Why the pack limit: prompts that arrive together (agents in step, a burst of
        sub-agents) and are packed into one step all get their first token when that
        step ends; run one after another, the first waits for its own tokens only, the
        last as long as before, and the work is the same, as long as each step's prefill
        is large enough to run at the machine's full rate (a few hundred tokens on a
        CPU; a GPU wants the whole budget, so there it is off)."""
        # 0: up to the whole budget, which `budget > 0` already bounds (the step's prefill
        # tokens are below max_num_batched_tokens while any budget is left)
        pack = self.config.prefill_pack_tokens or self.config.max_num_batched_tokens
        packed = sum(len(c.token_ids) - c.num_draft for c in plan.chunks)
        room = lambda: (budget > 0 and packed < pack  # noqa: E731
                        and len(self.running) < self.config.max_num_seqs)
        for seq in list(self._reading):
            if not room():
                break
            if self.admit(seq, budget):
                self._reading.remove(seq)
                started = self._start(plan, seq, budget, outputs)
                budget, packed = budget - started, packed + started
            elif not self.cache.reading(seq.seq_id):  # read, but no room: queue head again
                self._reading.remove(seq)
                self.queue.push_front(seq)
        while room():
            seq = self.queue.peek()
            if seq is None or not self._settle_grammar(seq, outputs,
                                                       wait=not plan.num_chunks):
                break
            if seq.status is SeqStatus.FINISHED:  # its grammar failed: popped, ended
                continue
            admitted = self.admit(seq, budget)
            while not admitted and not self.cache.reading(seq.seq_id) and (
                    self.release_last_hold(keep=seq)):  # those behind it give way
                admitted = self.admit(seq, budget)
            if not admitted:
                if not self.cache.reading(seq.seq_id):
                    return True  # no room for it: nothing behind it holds
                self.queue.pop()  # its disk reads started: the next ones may come in
                self._reading.append(seq)
                continue
            self.queue.pop()
            started = self._start(plan, seq, budget, outputs)
            budget, packed = budget - started, packed + started
        return False

    def _start(self, plan: StepPlan, seq: Sequence, budget: int,
               outputs: list[RequestOutput]) -> int:
        """An admitted sequence runs its first chunk in `plan`; returns its tokens."""
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        seq.admitted_time = seq.admitted_time or time.monotonic()
        if seq.num_preemptions == 0 and seq.num_computed + num_new < seq.num_tokens:
            # a prefill of several steps: tell the requester its cached share now (an
            # output without tokens), not only with the first token
            outputs.append(seq.take_output())
        self.running.append(seq)
        run_tokens(plan, seq, self.cache, num_new, self._snapshot_interval)
        return num_new

    def _settle_grammar(self, seq: Sequence, outputs: list[RequestOutput], *,
                        wait: bool) -> bool:
        """Whether the queue's head is settled: it has no grammar, or its grammar has
        compiled (False: it waits its turn; with nothing else to run this step, up to a
        poll's length). A grammar that failed settles it too: the request is popped and
        ended here with the error (400), and the caller goes on to the next."""
        future = seq.guide_pending
        if future is None:
            return True
        if not future.done():
            if not wait:
                return False
            try:
                future.exception(timeout=GRAMMAR_WAIT_S)  # waits; the error comes below
            except TimeoutError:
                return False
        seq.guide_pending = None
        try:
            seq.guide = future.result()
            _catch_up(seq)
        except GrammarError as exc:
            self.queue.pop()
            seq.error_type, seq.error = "invalid_request", str(exc)
            self._finish(seq, "error")
            outputs.append(seq.take_output())
        return True

    def admit(self, seq: Sequence, budget: int) -> bool:
        """Take the prefix hit and blocks for the first chunk; False (nothing changed) if
        the blocks are not there."""
        tokens = seq.tokens
        first = seq.num_preemptions == 0  # a readmission hits its own blocks: not counted
        # the whole prompt, capped at `budget` tokens past the hit the cache finds; the
        # session's previous sequence tells why the rest missed (cache/miss_reasons.py)
        previous = self._sessions.latest(seq.session_id) if first else None
        blocks = self.cache.allocate(seq.seq_id, tokens, len(tokens), seq.extra_key,
                                     seq.chain, count_hit=first, budget=budget,
                                     previous=previous)
        if blocks is None:
            seq.held = self.cache.has_seq(seq.seq_id)  # a hold let go for a longer hit
            return False
        seq.held = False
        took = self.cache.num_cached_tokens(seq.seq_id)
        seq.num_computed = took.num_tokens
        if first:  # accounting is for the prompt as first received
            seq.num_device_cached = took.num_device_tokens
            seq.num_host_cached = took.num_host_tokens
            seq.num_disk_cached = took.num_disk_tokens
            seq.uncached = self.cache.uncached_tokens(seq.seq_id)
        seq.block_ids = blocks
        seq.status = SeqStatus.RUNNING
        if seq.request.retention:  # again after a preemption: the blocks are new
            self.cache.retain(seq.seq_id, [(r.num_tokens, r.ttl_s)
                                           for r in seq.request.retention])
        return True

    def hold_waiting(self, head_blocked: bool) -> None:
        """Hold the cached prefixes of waiting sequences, in queue order (cache `hold`),
        while the device tier keeps room for the running sequences' next step: a turn
        that waits behind other sessions' prefills keeps its history instead of having
        it evicted by their new blocks. A hold is let go (`release_last_hold`), the last
        in the queue first, when a running sequence or the queue's head needs the blocks,
        before any running sequence is preempted. With `head_blocked` (this step, the
        queue's head found no room) only the head may hold."""
        if not self.config.enable_prefix_caching or not len(self.queue):
            return
        reserve = (-(-self.config.max_num_batched_tokens // self.block_size)
                   + len(self.running) + 1)
        for seq in self.queue:
            if not (seq.held or seq.guide_pending is not None
                    or self.cache.reading(seq.seq_id)):
                first = seq.num_preemptions == 0
                if self.cache.hold(seq.seq_id, seq.tokens, seq.extra_key, seq.chain,
                                   reserve=reserve, first=first, previous=(
                                       self._sessions.latest(seq.session_id) if first
                                       else None)) is not None:
                    seq.held = True
                elif not self.cache.reading(seq.seq_id):
                    break  # no room: the ones after it wait unheld
            if head_blocked:
                break  # the head waits for blocks: none behind it may take them

    def release_last_hold(self, keep: Sequence | None = None) -> bool:
        """Let go the held prefix of the last waiting sequence that holds one (not
        `keep`); False if none does."""
        for seq in reversed(list(self.queue)):
            if seq.held and seq is not keep:
                self.release_hold(seq)
                return True
        return False

    def release_hold(self, seq: Sequence) -> None:
        if seq.held:
            self.cache.release_hold(seq.seq_id)
            seq.held = False

    def grow_running(self, budget: int) -> None:
        """The running sequences' new blocks for this step in one allocation
        (cache.grow), when they all fit: the loop in `Scheduler._run_running` then finds
        room for each as it goes. When they do not, nothing is taken here and the loop
        grows them one by one, preempting the newest. The tokens each is given are the
        loop's, budget included, so the loop's outcome is the same either way; drafts are
        decided in the loop, so with speculative decoding the loop grows each itself."""
        if self.speculative is not None:
            return
        needs = []
        for seq in self.running:
            if budget <= 0:
                break
            num_new = tokens_to_run(seq, budget)
            budget -= num_new
            end = seq.num_computed + num_new
            if not self.has_room(seq, end):
                needs.append((seq, end))
        if not needs:
            return
        grown = self.cache.grow([(seq.seq_id, end) for seq, end in needs])
        if grown is not None:
            for (seq, _), blocks in zip(needs, grown):
                seq.block_ids.extend(blocks)

    def has_room(self, seq: Sequence, end: int) -> bool:
        """Whether `seq`'s blocks hold its first `end` tokens."""
        return -(-end // self.block_size) <= len(seq.block_ids)

    def grow(self, seq: Sequence, num_new: int) -> bool:
        if self.has_room(seq, seq.num_computed + num_new):
            return True  # most decode steps: the last block has room
        blocks = self.cache.allocate(seq.seq_id, seq.tokens, seq.num_computed + num_new,
                                     seq.extra_key)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True


def _catch_up(seq: Sequence) -> None:
    """A continuation's grammar takes the answer it had given before the restart
    (`Sequence.resume`), so that its next mask is the one the undisturbed run had."""
    backlog, seq.guide_backlog = seq.guide_backlog, []
    for token in backlog:
        if not seq.guide.accept(token):
            raise GrammarError(f"the resumed output breaks the grammar at token {token}: "
                               f"{seq.guide.error}")
