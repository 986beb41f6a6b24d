"""The scheduler: one loop, one owner of every block id.

Each step it turns the queue and the running sequences into one `StepPlan`
(continuous batching: decodes and prefill chunks together under a token
budget), and after the ranks ran it, turns their sampled tokens into outputs.
Workers decide nothing; this class and `cache/` decide everything.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from operator import itemgetter

import numpy as np

from cache.hashing import BlockHashChain, make_extra_key
from cache.manager import CacheConfig, KVCacheManager
from scheduler.guided import GrammarError, GuideFactory
from scheduler.queue import QueueFullError, RequestQueue
from scheduler.request import SeqStatus, Sequence
from scheduler.session_chains import SessionChains
from scheduler.speculation import NgramIndex, SpecStats, guided_drafts, propose_drafts
from scheduler.state_snapshots import take_snapshots
from scheduler.thinking import ThinkingBudget
from scheduler.validation import RequestRejected, validate_request
from wire.client import GenerateRequest, RequestOutput
from wire.config import SNAPSHOT_INTERVAL_AUTO, EngineConfig
from wire.digest import StateDigest
from wire.lifecycle import EngineLimits
from wire.step import (
    PENDING_TOKEN,
    AppendBlocks,
    NewSequence,
    ScheduledChunk,
    StepPlan,
    TrimBlocks,
)

GRAMMAR_WAIT_S = 0.05  # an idle step waits this long for the queue head's grammar
CLOSED_CHAINS_KEPT = 1024  # closed requests a late TurnEnd can still find


class Scheduler:
    def __init__(self, config: EngineConfig, limits: EngineLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limits = limits
        self.block_size = config.block_size
        self.cache = KVCacheManager(CacheConfig(
            block_size=config.block_size,
            num_device_blocks=limits.num_device_blocks,
            num_host_blocks=limits.num_host_blocks,
            write_policy=config.kv_write_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            max_retained_fraction=config.max_retained_fraction,
            record_events=bool(config.kv_events_endpoint),
            num_disk_blocks=limits.num_disk_blocks,
            num_ranks=config.world_size,
            num_state_slots=limits.num_state_slots,
            num_host_state_slots=limits.num_host_state_slots,
            num_disk_state_slots=limits.num_disk_state_slots,
        ), clock)
        assert not (limits.is_hybrid and config.speculative is not None), (
            "speculative decoding is refused for a hybrid model (scheduler/main.py)")
        # a hybrid model's chunks snapshot their state at block boundaries (for prefix hits),
        # every this many blocks: the ranks' (under `auto` they chose it), never the config's
        self._snapshots = limits.is_hybrid and config.enable_prefix_caching
        self._snapshot_interval = interval = limits.state_snapshot_interval
        if limits.is_hybrid:
            assert interval >= 1, "the ranks reported state slots but no snapshot interval"
            assert config.state_snapshot_interval in (SNAPSHOT_INTERVAL_AUTO, interval), (
                f"the ranks snapshot every {interval} blocks, not the "
                f"{config.state_snapshot_interval} asked")
        # Where a sequence is, from `add_request` until the ranks close it: in at most one
        # of the first five at a time, and in `_by_request` all along.
        #   queue        waiting its turn. In: `add_request`; at the head again when
        #                preempted (`_preempt`) or when its disk reads are in but its blocks
        #                are not. Out: admitted, parked in `_reading`, aborted, or ended by a
        #                grammar that failed to compile (`_settle_grammar`).
        #   _reading     out of the queue, waiting on the disk reads its admission started
        #                (cache/disk_flow.py), so the queue behind it is not held up. Out:
        #                admitted (before the queue), back to the queue head, or aborted.
        #   running      admitted: holds blocks, open on the ranks, oldest first. In:
        #                `_start`. Out: an end (a stop token or a length in `update`, an
        #                abort, a deadline, a prompt that can never fit), a preemption, or
        #                a close ahead of its last token (`_close_ahead`).
        #   _to_close    ended while open on the ranks (`_finish`). Out: the next plan
        #                closes it (`_close`, where the close-timing rule is).
        #   _awaiting    closed ahead of its last token, which the step in flight samples
        #                (seq id -> sequence; `_close_ahead`). Out: `update` emits that
        #                token as its end, or an abort drops it.
        #   _by_request  request id -> sequence. Out: at its end if the ranks do not hold it
        #                open, else when the plan after closes it.
        self.queue = RequestQueue(config.max_queued_requests, config.max_queued_tokens)
        self._reading: list[Sequence] = []
        self.running: list[Sequence] = []
        self._to_close: list[Sequence] = []
        self._awaiting: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap: (deadline, seq id, request id)
        self._pending_outputs: list[RequestOutput] = []  # decided while planning
        self._trims: list[TrimBlocks] = []  # tables to shorten by the next plan (`_trim`)
        self._next_seq_id = 1
        self.step = 0
        # what the ranks must hold after each plan
        self.digest = StateDigest(limits.num_device_blocks, limits.num_host_blocks,
                                  limits.num_disk_blocks)
        self.digest_s = 0.0  # seconds the last plan's digest prediction took
        # Until then (time.monotonic), the engine plans only after each step's results:
        # an inspection is comparing the ranks with the scheduler (scheduler/control.py).
        self.overlap_hold_until = 0.0
        self._model_key = config.model
        self._sessions = SessionChains(config.block_size)
        # the chains of recently closed sequences, for a TurnEnd that comes after the close
        self._closed_chains: OrderedDict[str, BlockHashChain] = OrderedDict()
        self.disk_torn_at_start = 0  # disk blocks the ranks dropped at start-up
        self._head_blocked = False  # this step, the queue's head found no room
        self._guides = GuideFactory(config.tokenizer_dir, limits.vocab_size,
                                    list(limits.eos_token_ids))
        self.speculative = config.speculative  # None: no drafts
        self.spec_stats = SpecStats()

    # --- requests ------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request, or raise RequestRejected with a message for the client."""
        if req.request_id in self._by_request:
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        validate_request(req, self.limits, self.block_size)
        extra_key = make_extra_key(self._model_key, req.cache_salt)
        eos = frozenset() if req.ignore_eos else frozenset(self.limits.eos_token_ids)
        seq = Sequence(
            self._next_seq_id, req, frozenset(req.stop_token_ids) | eos, extra_key,
            guide_pending=self._guides.compile(req.grammar) if req.grammar is not None else None,
            thinking=(ThinkingBudget(req.thinking, self.limits.vocab_size)
                      if req.thinking is not None else None),
            chain=(self._sessions.chain_for(req.session_id, extra_key, req.prompt_token_ids)
                   if self.config.enable_prefix_caching else None))
        if self.speculative is not None:
            seq.ngram = NgramIndex(self.speculative.prompt_lookup_min,
                                   self.speculative.prompt_lookup_max)
        try:
            if req.resumed_output is None:
                self.queue.push(seq)
            else:  # a continuation after an engine restart: a client waits mid-answer
                seq.resume(req.resumed_output)
                self.queue.push_resumed(seq)
        except QueueFullError as exc:
            raise RequestRejected(str(exc), "overloaded") from exc
        self._next_seq_id += 1
        self._by_request[req.request_id] = seq
        if req.timeout_s is not None:
            deadline = seq.arrival + req.timeout_s
            heapq.heappush(self._deadlines, (deadline, seq.seq_id, req.request_id))

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now. A queued one just leaves; a running one ends like a finished
        one, and the next plan closes it (`_close`)."""
        seq = self._by_request.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return None
        if seq.status is SeqStatus.WAITING and not seq.opened:
            if seq.guide_pending is not None:  # a grammar nobody will use: not compiled
                seq.guide_pending.cancel()
            if seq in self._reading:
                self._reading.remove(seq)
            else:
                self.queue.remove(request_id)
            self.cache.cancel_reads(seq.seq_id)  # its disk reads in flight, if any
            self._release_hold(seq)
            del self._by_request[request_id]
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            return seq.take_output()
        if self._awaiting.pop(seq.seq_id, None) is None:
            self.running.remove(seq)
        self._finish(seq, reason)  # an awaiting one is closed already: its token is dropped
        return seq.take_output()

    def end_turn(self, request_id: str, tool_call: bool) -> None:
        """How a request's answer ended (the shim's TurnEnd). A tool call keeps its blocks
        retained (`_finish` marked them); an answer without one lets them go: evicted
        before any retained block, so a finished sub-agent goes before its parent, which
        waits on a tool call. The client's own marks (cache_control) stay as they are."""
        if tool_call:
            return
        seq = self._by_request.get(request_id)
        if seq is not None:  # not closed yet: its blocks are not released with a mark
            seq.turn_ended = True
            if seq.status is SeqStatus.FINISHED and not seq.request.retention and (
                    self.cache.has_seq(seq.seq_id)):
                self.cache.retain(seq.seq_id, [])
            return
        chain = self._closed_chains.pop(request_id, None)
        if chain is not None and chain.num_blocks:
            self.cache.release_retained(*chain.keys())

    def _expire(self, now: float) -> None:
        """End every live request whose deadline has passed, through the abort path
        (so a running one is closed by the plan being built, like any other end)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq_id, request_id = heapq.heappop(self._deadlines)
            seq = self._by_request.get(request_id)
            # ended already (the id may even be reused by a newer request): nothing to do
            if seq is None or seq.seq_id != seq_id or seq.status is SeqStatus.FINISHED:
                continue
            seq.error_type = "timeout"
            seq.error = (f"the request's deadline passed ({now - seq.arrival:.1f}s after it "
                         f"arrived, {len(seq.output)} tokens generated)")
            out = self.abort_request(request_id, "error")
            if out is not None:
                self._pending_outputs.append(out)

    def restore_disk(self, found: list[tuple[int, int, int]]) -> None:
        """Warm restart: the disk slots every rank found valid at start-up, (slot, hash lo,
        hash hi), into the index and the predicted digest (as each rank put them in its
        own)."""
        if not found:
            return
        slots, lo, hi = (np.array(col, dtype=dt) for col, dt in
                         zip(zip(*found), (np.int32, np.uint64, np.uint64)))
        self.cache.restore_disk(slots, lo, hi)
        self.digest.restore_disk(slots, lo)

    def restore_disk_states(self, found: list[tuple[int, int, int]]) -> None:
        """Warm restart: a hybrid model's state records every rank found valid, (slot,
        hash lo, hash hi), into the state disk index and the predicted digest."""
        if found:
            self.cache.restore_disk_states(found)
            self.digest.restore_disk_states([s for s, _, _ in found], [lo for _, lo, _ in found])

    def check_accounting(self) -> None:
        """Every step, always on: the cache holds blocks for exactly the sequences the
        ranks hold open (running, or finished and waiting for their close). Raises
        cache.manager.CacheAccountingError."""
        live = {s.seq_id for s in self.running} | {s.seq_id for s in self._to_close}
        live |= {s.seq_id for s in self.queue if s.held}
        self.cache.check_accounting(live)

    def sequence(self, request_id: str) -> Sequence | None:
        """The live (or just finished, not yet closed) sequence of a request."""
        return self._by_request.get(request_id)

    def waiting(self) -> list[Sequence]:
        """Sequences not running yet: those waiting on their disk reads, then the queue."""
        return self._reading + list(self.queue)

    @property
    def num_waiting(self) -> int:
        return len(self._reading) + len(self.queue)

    def has_work(self) -> bool:
        return bool(self.running or len(self.queue) or self._to_close or self._awaiting
                    or self._reading)

    def needs_tokens(self) -> bool:
        """Whether the next plan needs the tokens of the step in flight: a sequence
        whose next sample is masked (a grammar, a thinking budget) by a state that
        depends on its pending token. The engine then plans after the results (no
        overlap for that step). With speculative decoding, any sequence with a pending
        token: its drafts are proposed from every token it has, and a drafted step's
        results say how much of its table to keep (`_trim`)."""
        spec = self.speculative is not None
        return any(s.num_pending and (spec or s.guide is not None or s.thinking is not None)
                   for s in self.running)

    # --- ends and closes ----------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence; if the ranks hold it open, the next plan closes it (`_close`)."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.chain is not None:
            self._sessions.remember(seq.session_id, seq.extra_key, seq.tokens, seq.chain)
        if (self.config.session_ttl_s > 0 and reason in ("stop", "length")
                and not seq.request.retention and not seq.turn_ended
                and self.cache.has_seq(seq.seq_id)):
            # An agent's turn: retained until its next one (a tool runs meanwhile), so the
            # history outlives the plain LRU's one-offs (cache/retention.py). `end_turn`
            # lets it go when the answer was not a tool call.
            self.cache.retain(seq.seq_id, [(seq.num_tokens, self.config.session_ttl_s)])
        if seq.opened:
            self._to_close.append(seq)
        else:
            self._by_request.pop(seq.request_id, None)

    def _close(self, seq: Sequence, plan: StepPlan) -> None:
        """Close a sequence on every rank with `plan`, and release its blocks *to the
        cache* (kept, hittable, evictable), never dropped. Every close goes through here:
        an end (finish, abort, deadline) by the plan after the one that last ran it
        (`_finish` defers it), a preemption by the plan that preempts it.

        The close-timing rule: a sequence whose final token is sampled at step k is
        closed by the plan of step k+1, never by a plan that runs it. During step k
        every rank still writes and reads its pages, and the scheduler learns that a
        token is final only from step k's results; a release any earlier lets a block
        be reused or forgotten under a step that still uses it -- every request then
        re-reads its prompt in full and nothing complains. So the rule is checked
        here rather than trusted (the cache and the ranks check it again, each
        across its own boundary)."""
        assert seq.opened and seq.last_step < plan.step, (
            f"close-timing violated: seq {seq.seq_id} closed in step {plan.step}, "
            f"last ran in step {seq.last_step}")
        # Register the full blocks whose tokens are all known and whose KV is written
        # before they are released, so they stay hittable. A plan registers only the
        # tokens known when it is made, so the last block may still be unregistered: one
        # that a drafted step's kept drafts filled, or one whose last token was pending
        # (overlap) when the sequence last ran. Tokens past `num_tokens` (a pending token,
        # rejected drafts) are never registered. Recorded as the step that wrote them.
        self.cache.commit(seq.seq_id, seq.tokens, min(seq.num_computed, seq.num_tokens),
                          seq.last_step, closing=True)
        self.cache.free(seq.seq_id, plan.step)
        seq.opened = False
        seq.block_ids = []
        plan.close.append(seq.seq_id)
        if (seq.status is SeqStatus.FINISHED and seq.chain is not None and not seq.turn_ended
                and not seq.request.retention):  # a client's own marks stay its own
            self._closed_chains[seq.request_id] = seq.chain
            while len(self._closed_chains) > CLOSED_CHAINS_KEPT:
                self._closed_chains.popitem(last=False)
        if seq.status is SeqStatus.FINISHED:
            self._by_request.pop(seq.request_id, None)

    # --- planning ------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan, made in four phases: close what ended, run the running
        sequences, admit waiting ones into the budget left, then seal the plan with the
        cache's ops and the digest the ranks must then hold."""
        plan = StepPlan(step=self.step)
        self._expire_and_close(plan)
        num_running = len(self.running)
        budget = self._run_running(plan, self.config.max_num_batched_tokens)
        # not in a step whose running set shrank (a preemption: blocks are short, and
        # admitting would only thrash)
        self._head_blocked = False
        if len(self.running) == num_running:
            self._admit_waiting(plan, budget)
        self._hold_waiting()
        return self._seal(plan)

    def _expire_and_close(self, plan: StepPlan) -> None:
        """End the requests whose deadline passed, then close on the ranks, with `plan`,
        every sequence that ended since the last plan and every one whose token in flight
        is certain to be its last (`_close_ahead`)."""
        if self._deadlines:
            self._expire(time.monotonic())
        to_close, self._to_close = self._to_close, []
        for seq in to_close:
            self._close(seq, plan)
        self._close_ahead(plan)

    def _run_running(self, plan: StepPlan, budget: int) -> int:
        """The running sequences' tokens (decodes and unfinished prefills), oldest first,
        within `budget`; returns the budget left. When blocks run out, the newest running
        sequence is preempted (it has not been planned in this step yet: the loop goes
        oldest to newest)."""
        self._grow_running(budget)
        # the running sequences' commits, registered together after the loop (before any
        # admission, which may hit them; none of them is closed in this step)
        commits: list[tuple[int, list[int], int]] = []
        i = 0
        no_drafts: tuple[list[int], list[bytes]] = ([], [])
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            drafts, draft_masks = (self._drafts(seq, budget) if seq.ngram is not None
                                   else no_drafts)
            num_new = _tokens_to_run(seq, budget)
            grown = self._grow(seq, num_new + len(drafts))
            if drafts and not grown:  # no room for the drafts: a plain decode
                drafts, draft_masks = [], []
                grown = self._grow(seq, num_new)
            while not grown and self._release_last_hold():  # waiting ones give way first
                grown = self._grow(seq, num_new)
            while not grown and self.running[-1] is not seq:
                self._preempt(self.running[-1], plan)
                grown = self._grow(seq, num_new)
            if grown:
                self._run_tokens(plan, seq, num_new, drafts, draft_masks, commits)
                budget -= num_new + len(drafts)
                i += 1
            elif len(self.running) == 1 and seq.num_pending:
                i += 1  # decide once its pending token is known (it may end the sequence)
            elif len(self.running) == 1:  # alone and still out of room: it can never fit
                self.running.pop(i)
                self._finish(seq, "length")
                self._pending_outputs.append(seq.take_output())
            else:
                self._preempt(seq, plan)
        self.cache.commit_many(commits, plan.step)
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting sequences while `budget`, sequence slots and blocks last: first
        those whose disk reads are in, then the queue in order."""
        room = lambda: budget > 0 and len(self.running) < self.config.max_num_seqs  # noqa: E731
        for seq in list(self._reading):
            if not room():
                break
            if self._admit(seq, budget):
                self._reading.remove(seq)
                budget -= self._start(plan, seq, budget)
            elif not self.cache.reading(seq.seq_id):  # read, but no room: queue head again
                self._reading.remove(seq)
                self.queue.push_front(seq)
        while room():
            seq = self.queue.peek()
            if seq is None or not self._settle_grammar(seq, wait=not plan.num_chunks):
                break
            if seq.status is SeqStatus.FINISHED:  # its grammar failed: popped, ended
                continue
            admitted = self._admit(seq, budget)
            while not admitted and not self.cache.reading(seq.seq_id) and (
                    self._release_last_hold(keep=seq)):  # those behind it give way
                admitted = self._admit(seq, budget)
            if not admitted:
                if not self.cache.reading(seq.seq_id):
                    self._head_blocked = True  # no room for it: nothing behind it holds
                    break
                self.queue.pop()  # its disk reads started: the next ones may come in
                self._reading.append(seq)
                continue
            self.queue.pop()
            budget -= self._start(plan, seq, budget)

    def _seal(self, plan: StepPlan) -> StepPlan:
        """Finish `plan`: the table trims still due, the cache's ops of this step (tier
        copies, registrations, disk reads and writes), and the digest the ranks must hold
        once they applied it; the next plan is the next step's."""
        closed = set(plan.close)  # closed whole on the ranks, before any trim
        plan.trim = [t for t in self._trims if t.seq_id not in closed]
        self._trims = []
        ops = self.cache.take_ops()
        plan.swap_out, plan.swap_in, plan.register = ops.swap_out, ops.swap_in, ops.registered
        plan.state_copy, plan.state_register = ops.state_copy, ops.state_register
        plan.state_swap_out, plan.state_swap_in = ops.state_swap_out, ops.state_swap_in
        plan.disk_write, plan.disk_read = ops.disk_write, ops.disk_read
        plan.state_disk_write, plan.state_disk_read = ops.state_disk_write, ops.state_disk_read
        t = time.perf_counter()
        self.digest.apply(plan)
        self.digest_s = time.perf_counter() - t  # the engine's step record splits it out
        self.step += 1
        return plan

    def _start(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        """An admitted sequence runs its first chunk in `plan`; returns its tokens."""
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        seq.admitted_time = seq.admitted_time or time.monotonic()
        if seq.num_preemptions == 0 and seq.num_computed + num_new < seq.num_tokens:
            # a prefill of several steps: tell the requester its cached share now (an
            # output without tokens), not only with the first token
            self._pending_outputs.append(seq.take_output())
        self.running.append(seq)
        self._run_tokens(plan, seq, num_new)
        return num_new

    def _run_tokens(self, plan: StepPlan, seq: Sequence, num_new: int,
                    drafts: list[int] | None = None,
                    draft_masks: list[bytes] | None = None,
                    commits: list[tuple[int, list[int], int]] | None = None) -> None:
        """Run `num_new` more tokens of `seq` in `plan`, with the block-table delta the
        ranks need first. The blocks whose KV this step writes are registered at once:
        steps run in order, and in each layer the ranks write the whole batch's KV
        before attention reads any, so a later step -- or a sequence admitted later in
        this one, e.g. a second agent sent the same fresh context -- may hit them. Draft
        tokens (`drafts`, after the last known one) run too but are never committed: a
        block is registered only once every token in it is verified. A guided sequence's
        drafts come with the mask of the sample after each (`draft_masks`, `_drafts`).
        With `commits`, the registration is queued there instead, and the caller makes
        all of them at once before anything may hit them (`_run_running`: the running
        sequences', before the admissions)."""
        # Written for the common case, a running sequence's one-token decode, which
        # every sequence of the batch goes through every step: few calls, few lookups.
        seq_id, tokens, num_pending = seq.seq_id, seq.tokens, seq.num_pending
        start = seq.num_computed
        end = start + num_new
        known = len(tokens)
        # taken before the commit below, which registers those whose block it commits
        snaps = (take_snapshots(self.cache, seq_id, start, end,
                                self._snapshot_interval)
                 if self._snapshots else None)
        # A block whose last token is pending is registered by the sequence's next plan,
        # once the token is known, or by its close if no plan runs it again (`_close`).
        if commits is None:
            self.cache.commit(seq_id, tokens, end if end < known else known, plan.step)
        else:  # the caller commits them all at once (cache.commit_many)
            commits.append((seq_id, tokens, end if end < known else known))
        block_ids = seq.block_ids
        if not seq.opened:
            plan.new_seqs.append(NewSequence(seq_id, list(block_ids), seq.request.sampling,
                                             self.cache.state_slot(seq_id)))
            seq.opened = True
            seq.num_sent_blocks = len(block_ids)
        elif len(block_ids) > seq.num_sent_blocks:
            plan.append.append(AppendBlocks(seq_id, block_ids[seq.num_sent_blocks:]))
            seq.num_sent_blocks = len(block_ids)
        sample = end == known + num_pending
        allowed = None
        if sample and (seq.guide is not None or seq.thinking is not None):
            assert not num_pending, (
                "a masked sample planned before its sequence's pending token is known")
            allowed = self._allowed(seq)
        if num_new == 1 and sample and allowed is None and not drafts and not snaps:
            # a plain decode
            plan.decodes.append(seq_id, tokens[start] if start < known else PENDING_TOKEN,
                                start)
            seq.num_computed = end
            seq.num_drafts = 0
            seq.num_pending = num_pending + 1
            seq.last_step = plan.step
            return
        if end > known:  # the token sampled by the step in flight, resolved by the ranks
            token_ids = tokens[start:known]
            token_ids.extend([PENDING_TOKEN] * (end - known))
        else:
            token_ids = tokens[start:end]
        num_draft = 0
        if drafts:
            assert sample and end == known, "drafts only after every known token"
            token_ids.extend(drafts)
            num_draft = len(drafts)
        assert len(draft_masks or ()) == (num_draft if allowed is not None else 0), (
            "a masked drafted decode needs a mask for each draft row, an unmasked one none")
        plan.chunks.append(ScheduledChunk(seq_id, token_ids, start, sample, allowed, num_draft,
                                          draft_masks if draft_masks else [], snaps or []))
        seq.num_computed = end + num_draft
        seq.num_drafts = num_draft
        seq.num_pending = num_pending + sample
        seq.last_step = plan.step

    def _close_ahead(self, plan: StepPlan) -> None:
        """Overlap scheduling: a sequence whose pending token is certain to be its last
        (max_tokens, or the context is full) is never planned past it, and is closed by
        this plan, the one after the step that samples that token -- exactly when the
        close-timing rule wants it. It waits in `_awaiting` for its token, which `update`
        emits as the end."""
        # its pending token reaches max_tokens or fills the context (a test of every
        # running sequence, every step: written inline)
        max_len = self.limits.max_model_len
        for seq in [s for s in self.running if s.num_pending and (
                len(s.output) + s.num_pending >= s.request.max_tokens
                or len(s.tokens) + s.num_pending >= max_len)]:
            self.running.remove(seq)
            self._close(seq, plan)
            self._awaiting[seq.seq_id] = seq

    def _drafts(self, seq: Sequence, budget: int) -> tuple[list[int], list[bytes]]:
        """Draft tokens for a decode of `seq` (scheduler/speculation.py), and for a guided
        sequence the mask of the sample after each (`guided_drafts`); ([], []) when it is
        not a decode whose tokens are all known. A sequence with a thinking span gets no
        drafts: its mask depends on the span's state too, which would have to be played
        forward over the drafts as the grammar is (not done)."""
        if (seq.ngram is None or seq.num_pending or seq.thinking is not None
                or seq.num_computed != seq.num_tokens - 1):
            return [], []
        # never past max_tokens nor the context: the step's own token comes on top
        room = min(seq.request.max_tokens - len(seq.output),
                   self.limits.max_model_len - seq.num_tokens, budget) - 1
        drafts = propose_drafts(seq.ngram, seq.tokens, self.speculative, room)
        if seq.guide is None or not drafts:
            return drafts, []
        return guided_drafts(drafts, seq.guide, seq.stop_token_ids)

    def _settle_grammar(self, seq: Sequence, *, wait: bool) -> bool:
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
            self._pending_outputs.append(seq.take_output())
        return True

    def _admit(self, seq: Sequence, budget: int) -> bool:
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

    def _hold_waiting(self) -> None:
        """Hold the cached prefixes of waiting sequences, in queue order (cache `hold`),
        while the device tier keeps room for the running sequences' next step: a turn
        that waits behind other sessions' prefills keeps its history instead of having
        it evicted by their new blocks. A hold is let go (`_release_last_hold`), the last
        in the queue first, when a running sequence or the queue's head needs the blocks,
        before any running sequence is preempted."""
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
            if self._head_blocked:
                break  # the head waits for blocks: none behind it may take them

    def _release_last_hold(self, keep: Sequence | None = None) -> bool:
        """Let go the held prefix of the last waiting sequence that holds one (not
        `keep`); False if none does."""
        for seq in reversed(list(self.queue)):
            if seq.held and seq is not keep:
                self._release_hold(seq)
                return True
        return False

    def _release_hold(self, seq: Sequence) -> None:
        if seq.held:
            self.cache.release_hold(seq.seq_id)
            seq.held = False

    def _grow_running(self, budget: int) -> None:
        """The running sequences' new blocks for this step in one allocation
        (cache.grow), when they all fit: the loop in `_run_running` then finds room for each
        as it goes. When they do not, nothing is taken here and the loop grows them one
        by one, preempting the newest. The tokens each is given are the loop's, budget
        included, so the loop's outcome is the same either way; drafts are decided in the
        loop, so with speculative decoding the loop grows each itself."""
        if self.speculative is not None:
            return
        needs = []
        for seq in self.running:
            if budget <= 0:
                break
            num_new = _tokens_to_run(seq, budget)
            budget -= num_new
            end = seq.num_computed + num_new
            if not self._has_room(seq, end):
                needs.append((seq, end))
        if not needs:
            return
        grown = self.cache.grow([(seq.seq_id, end) for seq, end in needs])
        if grown is not None:
            for (seq, _), blocks in zip(needs, grown):
                seq.block_ids.extend(blocks)

    def _has_room(self, seq: Sequence, end: int) -> bool:
        """Whether `seq`'s blocks hold its first `end` tokens."""
        return -(-end // self.block_size) <= len(seq.block_ids)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        if self._has_room(seq, seq.num_computed + num_new):
            return True  # most decode steps: the last block has room
        blocks = self.cache.allocate(seq.seq_id, seq.tokens, seq.num_computed + num_new,
                                     seq.extra_key)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute later: close it on the ranks now, requeue it in front."""
        self.running.remove(seq)
        self._close(seq, plan)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        # a token sampled by the step in flight is dropped: the recompute samples it again
        # (the same token at temperature 0 or with a seed), after its tokens are all known
        seq.num_pending = 0
        seq.num_preemptions += 1
        self.queue.push_front(seq)

    @staticmethod
    def _allowed(seq: Sequence) -> bytes | None:
        """The mask of a sequence's next sample: its grammar's, and around it its thinking
        span's (scheduler/thinking.py); None: any token."""
        if seq.guide is None and seq.thinking is None:
            return None
        answer = seq.guide.allowed if seq.guide is not None else lambda: None
        return seq.thinking.mask(answer) if seq.thinking is not None else answer()

    # --- results ----------------------------------------------------------------------

    def update(self, plan: StepPlan, sampled: list[tuple[int, int]]) -> list[RequestOutput]:
        """Apply rank 0's sampled tokens of `plan`; return the outputs to stream."""
        by_id = {seq.seq_id: seq for seq in self.running}
        now = time.monotonic()
        outputs, self._pending_outputs = self._pending_outputs, []
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
                assert self.step == plan.step + 1, "a plan was made before a drafted step's end"
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
        """The token of a sequence closed ahead of it (`_close_ahead`): certain to end it."""
        seq.num_pending -= 1
        seq.append_output(token)
        seq.first_token_time = seq.first_token_time or now
        reason = seq.stop_reason(token, self.limits.max_model_len)
        assert reason is not None, f"seq {seq.seq_id} was closed ahead of a token not its last"
        self._finish(seq, reason)  # closed already: it only leaves
        return seq.take_output()


def _catch_up(seq: Sequence) -> None:
    """A continuation's grammar takes the answer it had given before the restart
    (`Sequence.resume`), so that its next mask is the one the undisturbed run had."""
    backlog, seq.guide_backlog = seq.guide_backlog, []
    for token in backlog:
        if not seq.guide.accept(token):
            raise GrammarError(f"the resumed output breaks the grammar at token {token}: "
                               f"{seq.guide.error}")


def _tokens_to_run(seq: Sequence, budget: int) -> int:
    """The tokens a running sequence runs this step: what it has not computed (its
    pending samples included), at most `budget`."""
    return min(seq.num_tokens + seq.num_pending - seq.num_computed, budget)
