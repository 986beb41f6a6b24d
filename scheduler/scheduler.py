"""The scheduler: one loop, one owner of every block id.

Each step it turns the queue and the running sequences into one `StepPlan`
(continuous batching: decodes and prefill chunks together under a token
budget), and after the ranks ran it, turns their sampled tokens into outputs.
Workers decide nothing; this class and `cache/` decide everything, with
`AdmissionControl` (admission.py), plan_rows.py and `Results` (results.py) for parts.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from cache.hashing import BlockHashChain, make_extra_key
from cache.manager import CacheConfig, KVCacheManager
from scheduler.admission import AdmissionControl
from scheduler.guided import GuideFactory
from scheduler.plan_rows import decode_drafts, run_tokens, tokens_to_run
from scheduler.queue import QueueFullError, RequestQueue
from scheduler.request import SeqStatus, Sequence
from scheduler.results import Results
from scheduler.session_chains import SessionChains
from scheduler.speculation import NgramIndex
from scheduler.thinking import ThinkingBudget
from scheduler.validation import RequestRejected, validate_request
from wire.client import GenerateRequest, RequestOutput
from wire.config import SNAPSHOT_INTERVAL_AUTO, EngineConfig
from wire.digest import StateDigest
from wire.lifecycle import EngineLimits
from wire.step import StepPlan

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
        # (None: no snapshots)
        interval = limits.state_snapshot_interval
        if limits.is_hybrid:
            assert interval >= 1, "the ranks reported state slots but no snapshot interval"
            assert config.state_snapshot_interval in (SNAPSHOT_INTERVAL_AUTO, interval), (
                f"the ranks snapshot every {interval} blocks, not the "
                f"{config.state_snapshot_interval} asked")
        self._snapshot_interval = (interval if limits.is_hybrid and config.enable_prefix_caching
                                   else None)
        # Where a sequence is, from `add_request` until the ranks close it: in at most one
        # of the first five at a time, and in `_by_request` all along.
        #   queue        waiting its turn. In: `add_request`; at the head again when
        #                preempted (`_preempt`) or when its disk reads are in but its blocks
        #                are not. Out: admitted, parked in `_reading`, aborted, or ended by a
        #                grammar that failed to compile (`AdmissionControl._settle_grammar`).
        #   _reading     out of the queue, waiting on the disk reads its admission started
        #                (cache/disk_flow.py), so the queue behind it is not held up. Out:
        #                admitted (before the queue), back to the queue head, or aborted.
        #   running      admitted: holds blocks, open on the ranks, oldest first. In:
        #                `AdmissionControl._start`. Out: an end (a stop token or a length in
        #                `update`, an abort, a deadline, a prompt that can never fit), a
        #                preemption, or a close ahead of its last token (`_close_ahead`).
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
        self._guides = GuideFactory(config.tokenizer_dir, limits.vocab_size,
                                    list(limits.eos_token_ids))
        self.speculative = config.speculative  # None: no drafts
        # the waiting side and the block budget (admissions, growth, prefix holds), and the
        # results side: each holds the lists above it uses (changed in place, never rebound)
        self.admission = AdmissionControl(config, self.cache, self._sessions, self.queue,
                                          self._reading, self.running,
                                          self._snapshot_interval, self._finish)
        self.results = Results(config, limits, self.cache, self.running, self._awaiting,
                               self._finish)
        self.spec_stats = self.results.spec_stats

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
            self.admission.release_hold(seq)
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
        results say how much of its table to keep (`Results._trim`)."""
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
        head_blocked = False  # this step, the queue's head found no room
        if len(self.running) == num_running:
            head_blocked = self.admission.admit_waiting(plan, budget, self._pending_outputs)
        self.admission.hold_waiting(head_blocked)
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
        self.admission.grow_running(budget)
        # bound once: the loop below runs for every running sequence, every step
        grow, cache, interval = self.admission.grow, self.cache, self._snapshot_interval
        # the running sequences' commits, registered together after the loop (before any
        # admission, which may hit them; none of them is closed in this step)
        commits: list[tuple[int, list[int], int]] = []
        i = 0
        no_drafts: tuple[list[int], list[bytes]] = ([], [])
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            drafts, draft_masks = (decode_drafts(seq, budget, self.speculative,
                                                 self.limits.max_model_len)
                                   if seq.ngram is not None else no_drafts)
            num_new = tokens_to_run(seq, budget)
            grown = grow(seq, num_new + len(drafts))
            if drafts and not grown:  # no room for the drafts: a plain decode
                drafts, draft_masks = [], []
                grown = grow(seq, num_new)
            while not grown and self.admission.release_last_hold():  # waiting ones give way first
                grown = grow(seq, num_new)
            while not grown and self.running[-1] is not seq:
                self._preempt(self.running[-1], plan)
                grown = grow(seq, num_new)
            if grown:
                run_tokens(plan, seq, cache, num_new, interval, drafts, draft_masks, commits)
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

    def _seal(self, plan: StepPlan) -> StepPlan:
        """Finish `plan`: the table trims still due, the cache's ops of this step (tier
        copies, registrations, disk reads and writes), and the digest the ranks must hold
        once they applied it; the next plan is the next step's."""
        closed = set(plan.close)  # closed whole on the ranks, before any trim
        plan.trim = [t for t in self.results.take_trims() if t.seq_id not in closed]
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

    # --- results ----------------------------------------------------------------------

    def update(self, plan: StepPlan, sampled: list[tuple[int, int]]) -> list[RequestOutput]:
        """Apply rank 0's sampled tokens of `plan`; return the outputs to stream."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return self.results.update(plan, sampled, self.step, outputs)
