"""Applies step plans on one rank: cache ops, block-table deltas, forward, sampling.

The runner is a stateful mirror of the scheduler's view: it keeps each live
sequence's block table, updated by deltas, and decides nothing about cache
state. Everything it computes from a plan is deterministic, so every rank that
applies the same plans holds the same state (checked through `StateDigest`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from wire.client import SamplingParams
from wire.config import EngineConfig
from wire.digest import StateDigest, samples_digest
from wire.step import PENDING_TOKEN, RankTiming, StepPlan, count_accepted
from worker.attention import AttentionBackend, AttentionMetadata
from worker.block_table import BlockTables
from worker.budget import (
    check_holds_one_sequence,
    device_blocks_for,
    device_budget_for,
    device_tier_bytes,
    host_state_slots_for,
    host_tier_blocks,
    local_world_size,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_max_model_len,
    resolve_snapshot_interval,
    state_slots_for,
)
from worker.disk_tier import RankDiskTier
from worker.distributed import TensorParallelGroup
from worker.forward import BatchInputs, ModelForward, PreparedStep, to_device
from worker.gguf import load_config
from worker.hybrid_model import HybridModel, check_hybrid
from worker.kv_cache import KVCache
from worker.linear_state import LinearStateCache, StateBatch
from worker.model import LlamaModel
from worker.null_model import NullModel
from worker.tier_moves import apply_tier_moves


@dataclass
class StepOutput:
    sampled: list[tuple[int, int]]  # (seq_id, token), rank 0 only
    digest: int
    timing: RankTiming  # apply, digest, prepare, forward and gap filled in here
    logits: torch.Tensor | None = None  # [num_tokens, vocab] on rank 0 when asked (tests)
    sampled_digest: int = 0  # wire/step.py StepResult.sampled_digest
    disk_done: list[int] = field(default_factory=list)  # disk writes finished since the last
    disk_dropped: list[int] = field(default_factory=list)
    disk_queue_depth: int = 0
    disk_read_done: list[int] = field(default_factory=list)  # disk reads finished (checked)
    disk_read_bad: list[int] = field(default_factory=list)  # ... whose record failed its check
    # the same for a hybrid model's state snapshot records (wire/step.py StepResult)
    state_disk_done: list[int] = field(default_factory=list)
    state_disk_dropped: list[int] = field(default_factory=list)
    state_disk_read_done: list[int] = field(default_factory=list)
    state_disk_read_bad: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup, device: torch.device,
                 num_device_blocks: int | None = None) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.model_config = load_config(config.model)  # HF dir or .gguf
        self.dtype = resolve_dtype(config.dtype, device, self.model_config.torch_dtype)
        # what the KV tiers store: the model's dtype, or FP8 with scales (worker/kv_quant.py)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, device,
                                         self.model_config.head_dim)
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = resolve_max_model_len(config, self.model_config)

        # Under overlap scheduling the next plan names each decode's last token as
        # PENDING_TOKEN (wire/step.py), so every rank needs the tokens just sampled. Each
        # rank samples them itself from the same all-gathered logits (vLLM V1's way): a
        # broadcast from rank 0 after every forward was a sync point that cost more than
        # the step's own work at world size 4. The sampler is deterministic (greedy, or
        # seeded by position), and each rank reports what it sampled, which the scheduler
        # checks against rank 0's (StepResult.sampled_digest).
        self.every_rank_samples = config.async_scheduling and tp.world_size > 1
        # seq id -> (its sampling parameters, its seed), from the plan that opens it until
        # the launch of the plan that closes it; the forward pass holds this same dict
        # (changed in place, never rebound)
        self.sampling: dict[int, tuple[SamplingParams, int]] = {}
        # The model, and the forward pass that launches and finishes each step's forward
        # (worker/forward.py): the model's on its device, or the null model, which is its
        # own and has the same interface, so nothing below asks which it is.
        self.model: LlamaModel | HybridModel | NullModel
        self.forward_pass: ModelForward | NullModel
        # A hybrid model's linear-attention state (worker/linear_state.py), in the slots the
        # plans name: seq id -> its live slot, from the plan that opens it to its close.
        self.state: LinearStateCache | None = None
        self.state_slots: dict[int, int] = {}
        if config.null_model_forward_ms is not None:  # benchmarks: the engine's own cost
            self.model = self.forward_pass = NullModel(
                self.model_config, tp, config.null_model_forward_ms, self.every_rank_samples)
        else:
            model_class = LlamaModel
            if self.model_config.is_hybrid:
                check_hybrid(config, self.model_config.architecture)
                model_class = HybridModel
            self.model = model_class(self.model_config, tp, self.dtype, device,
                                     logits_everywhere=self.every_rank_samples,
                                     kv_dtype=self.kv_dtype)
            self.model.load(config.model, show_progress=tp.rank == 0)
            self.forward_pass = ModelForward(self.model, config.attention_backend,
                                             config.block_size, self.sampling, self.state)

        m = self.model
        num_kv_layers = self.model_config.num_kv_layers  # a hybrid's attention layers only
        block_bytes = KVCache.bytes_per_block(
            num_kv_layers, config.block_size, m.num_kv_heads, m.head_dim,
            self.kv_dtype,
        )
        # Ranks may have different free memory; every rank must hold the same
        # block ids, so all take the minimum.
        self.kv_bytes_per_block = block_bytes
        # a hybrid model's linear-attention state shares every tier's budget, a snapshot
        # every `interval` blocks (--state-snapshot-interval, or chosen from the two sizes;
        # the same on every rank, and reported to the scheduler); 0 without such state
        self.state_bytes_per_slot = (m.state_bytes_per_slot() if isinstance(m, HybridModel)
                                     else 0)
        self.state_snapshot_interval = interval = (resolve_snapshot_interval(
            config.state_snapshot_interval, self.state_bytes_per_slot, block_bytes, tp.all_max)
            if self.state_bytes_per_slot else 0)
        if num_device_blocks is None:
            budget = None
            if device.type == "cuda" and config.gpu_memory_utilization:
                # the room profiling leaves, in blocks (None: nothing to profile, the null
                # model; sized as without profiling)
                room = self.forward_pass.profile_num_blocks(
                    min(config.max_num_batched_tokens, self.max_model_len), block_bytes,
                    config.gpu_memory_utilization)
                budget = None if room is None else room * block_bytes
            if budget is None:
                budget = device_tier_bytes(config, block_bytes, self.max_model_len, device,
                                           local_world_size(), self.state_bytes_per_slot,
                                           interval)
            num_device_blocks = device_blocks_for(budget, block_bytes,
                                                  self.state_bytes_per_slot, interval, config)
        self.num_device_blocks = tp.all_min(num_device_blocks)
        # every rank the same slots: counted from the blocks all ranks agreed on
        self.num_state_slots = (state_slots_for(
            self.num_device_blocks, config.max_num_seqs, interval,
            config.enable_prefix_caching) if self.state_bytes_per_slot else 0)
        # the host tier's budget counts the host snapshots' bytes too, split alike
        self.num_host_blocks = tp.all_min(host_tier_blocks(
            config.host_cache_memory, block_bytes, self.state_bytes_per_slot, interval))
        self.num_host_state_slots = (host_state_slots_for(self.num_host_blocks, interval)
                                     if self.num_state_slots else 0)
        if isinstance(m, HybridModel):
            self.state = self.forward_pass.state = m.new_state_cache(
                self.num_state_slots, self.num_host_state_slots)
        check_holds_one_sequence(
            self.num_device_blocks, config.block_size, block_bytes, self.max_model_len,
            (lambda n: device_budget_for(n, block_bytes, self.state_bytes_per_slot,
                                         config.max_num_seqs, interval,
                                         config.enable_prefix_caching))
            if self.state_bytes_per_slot else None)
        self.kv = KVCache(
            num_kv_layers, self.num_device_blocks, self.num_host_blocks,
            config.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype, device,
        )
        self.block_tables = BlockTables(max_cols=-(-self.max_model_len // config.block_size))
        # the disk tier, below the host tier (worker/disk_tier.py); None when off
        self.disk: RankDiskTier | None = None
        if config.disk_cache_size and self.num_host_blocks:
            # a hybrid model's host snapshots go to disk too (cache/state_disk.py)
            with_state = self.state if self.num_host_state_slots else None
            self.disk = RankDiskTier(config, tp, self.kv, num_kv_layers,
                                     m.num_kv_heads, m.head_dim, self.dtype, with_state,
                                     interval)
        self.num_disk_blocks = self.disk.num_slots if self.disk is not None else 0
        self.num_disk_state_slots = self.disk.num_state_slots if self.disk is not None else 0
        self.digest = StateDigest(self.num_device_blocks, self.num_host_blocks,
                                  self.num_disk_blocks)
        if self.disk is not None:
            self.disk.restore_digest(self.digest)
        # Called once a plan's cache ops and table deltas are in, before its forward pass
        # (the rank's control thread marks the step there; test-only faults hook in too).
        self.on_applied: Callable[[StepPlan], None] | None = None
        self._last_forward_end: float | None = None  # perf_counter; for RankTiming.gap_s
        # seq id -> the token it sampled last (every rank, with overlap scheduling): what a
        # PENDING_TOKEN in the next plan stands for
        self.last_token: dict[int, int] = {}

    # --- one step ----------------------------------------------------------------
    #
    # A step is prepared (cache ops, table deltas, digest, batch inputs), launched (the
    # forward pass and sampling issued) and finished (the samples read). `execute` runs the
    # three in a row; a rank's serve loop (worker/main.py) prepares step k+1 between the
    # launch and the finish of step k when its plan has come (overlap scheduling), so the
    # device goes from one forward to the next with only the finish and the launch between.
    # This is safe because the plan order is kept where it matters: step k+1's tier copies
    # wait for step k's kernels (worker/kv_cache.py), and what step k still needs of a
    # sequence that plan k+1 closes (its sampling parameters) is dropped at k+1's launch.

    def execute(self, plan: StepPlan, return_logits: bool = False) -> StepOutput:
        step = self.prepare(plan)
        self.launch(step, return_logits)
        return self.finish(step)

    def prepare(self, plan: StepPlan) -> PreparedStep:
        t0 = time.perf_counter()
        self._apply_cache_ops(plan)
        self._apply_table_deltas(plan)
        t1 = time.perf_counter()
        self.digest.apply(plan)
        timing = RankTiming(apply_s=t1 - t0, digest_s=time.perf_counter() - t1)
        if self.on_applied is not None:
            self.on_applied(plan)
        step = PreparedStep(plan, self.digest.value, timing)
        if plan.num_chunks:
            t2 = time.perf_counter()
            # the null model takes none of these, but a rank builds them every step all
            # the same (its page tables check every chunk against its block table)
            step.batch = self._prepare_batch(plan)
            timing.prepare_s = time.perf_counter() - t2
        return step

    def launch(self, step: PreparedStep, return_logits: bool = False) -> None:
        for seq_id in step.plan.close:  # kept until the step before was finished
            del self.sampling[seq_id]
            self.last_token.pop(seq_id, None)
        if step.batch is None:
            return
        t3 = time.perf_counter()
        if self._last_forward_end is not None:
            step.timing.gap_s = t3 - self._last_forward_end
        step.launched_at = t3
        self.forward_pass.launch(step, self._resolve_pending(step), self.kv, return_logits)

    @property
    def attn(self) -> AttentionBackend | None:
        """The forward pass's attention backend (None: the null model attends to nothing)."""
        return self.forward_pass.attn

    def forward_in_flight(self) -> bool:
        """Whether the forward just launched still runs beside this core (a GPU's, or the
        null model's with a forward time), so preparing the next step now costs it
        nothing. A forward on the CPU has ended by the time `launch` returns."""
        return not self.forward_done()

    def busy_s(self) -> float:
        """How long that forward still runs, where known (the null model); else 0."""
        return self.forward_pass.busy_s()

    def forward_done(self) -> bool:
        """Whether the forward last launched has ended (a GPU's: its work queued so far;
        on the CPU always)."""
        return self.forward_pass.done()

    def finish(self, step: PreparedStep) -> StepOutput:
        if step.batch is None:
            return self._with_disk(StepOutput([], step.digest, step.timing), idle=True)
        sampled = self.forward_pass.finish(step)  # waits for the forward
        t4 = time.perf_counter()
        step.timing.forward_s = t4 - step.launched_at
        self._last_forward_end = t4
        sampled = self._accept_drafts(step.plan, sampled)
        self.last_token.update(sampled)  # (seq_id, token) pairs; a drafted decode's last wins
        sampled_digest = samples_digest(sampled) if self.every_rank_samples else 0
        if self.tp.rank != 0:
            sampled = []  # rank 0 answers for the batch
        return self._with_disk(StepOutput(sampled, step.digest, step.timing, step.logits,
                                          sampled_digest))

    def _with_disk(self, out: StepOutput, idle: bool = False) -> StepOutput:
        """The disk writes and reads finished since the last step, for the scheduler."""
        if self.disk is not None:
            r = self.disk.take_completed(idle=idle)
            out.disk_done, out.disk_dropped, out.disk_queue_depth = (
                r.write_done, r.write_dropped, r.queue_depth)
            out.disk_read_done, out.disk_read_bad = r.read_done, r.read_bad
            out.state_disk_done, out.state_disk_dropped = (r.state_write_done,
                                                           r.state_write_dropped)
            out.state_disk_read_done, out.state_disk_read_bad = (r.state_read_done,
                                                                 r.state_read_bad)
        return out

    def _resolve_pending(self, step: PreparedStep) -> torch.Tensor:
        """The batch's token ids on the device, each PENDING_TOKEN (only ever a decode's
        last token) replaced by the token its sequence sampled in the step before, which
        this rank has by now (it sampled it itself)."""
        token_ids = step.batch.token_ids
        for row, seq_id, holder, i in step.batch.pending:
            holder[i] = token_ids[row] = self.last_token[seq_id]
        # The embedding must never see an id outside the vocabulary (the
        # scheduler rejects them first; this is the worker's own guard).
        assert 0 <= token_ids.min() and token_ids.max() < self.vocab_size, (
            "token id outside the vocabulary")
        return to_device(token_ids, self.device)

    @staticmethod
    def _accept_drafts(plan: StepPlan,
                       sampled: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A drafted decode's samples (one per draft position, and one after) -> the
        tokens it yields: the drafts the samples agree with, then the first sample that
        disagrees or the one after the last draft. Deterministic, so every rank that has
        the samples gets the same; a rank without them (rank > 0, no overlap) gets []."""
        if not sampled or not any(c.num_draft for c in plan.chunks):
            return sampled
        i = len(plan.decodes)  # the decodes' samples come first, one each
        out: list[tuple[int, int]] = sampled[:i]
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            rows = sampled[i:i + chunk.num_draft + 1]
            i += chunk.num_draft + 1
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft:]
            out.extend(rows[:count_accepted(drafts, [t for _, t in rows]) + 1])
        assert i == len(sampled), "samples do not match the plan's chunks"
        return out

    def _apply_cache_ops(self, plan: StepPlan) -> None:
        for block, _ in plan.swap_out + [(b, s) for s, b in plan.swap_in]:
            self._check_block(block)
        apply_tier_moves(plan, self.kv, self.disk, self.state, self.num_host_blocks)
        running = set(plan.decodes.seq_ids).union(c.seq_id for c in plan.chunks) \
            if plan.close else set()
        for seq_id in plan.close:
            # The close-timing rule (scheduler/scheduler.py `Scheduler._close`), checked
            # again across the process boundary: never closed by a plan that runs it.
            assert seq_id not in running, f"step {plan.step}: seq {seq_id} closed while running"
            self.block_tables.close(seq_id)  # its sampling parameters: at this step's launch
            self.state_slots.pop(seq_id, None)

    def _apply_table_deltas(self, plan: StepPlan) -> None:
        for t in plan.trim:  # blocks appended for drafts the model rejected
            table = self.block_tables[t.seq_id]
            assert len(table) == t.num_blocks + len(t.block_ids) \
                and table[t.num_blocks:] == t.block_ids, f"seq {t.seq_id}: a trim not its tail"
            del table[t.num_blocks:]
        for seq in plan.new_seqs:
            for b in seq.block_ids:
                self._check_block(b)
            self.block_tables.open(seq.seq_id, seq.block_ids)
            seed = seq.sampling.seed if seq.sampling.seed is not None else (
                self.config.seed * 1_000_003 + seq.seq_id)
            self.sampling[seq.seq_id] = (seq.sampling, seed)
            if self.state is not None:
                assert 0 <= seq.state_slot < self.state.num_slots, (
                    f"seq {seq.seq_id}: state slot {seq.state_slot} out of range")
                self.state_slots[seq.seq_id] = seq.state_slot
        for app in plan.append:
            for b in app.block_ids:
                self._check_block(b)
            self.block_tables.extend(app.seq_id, app.block_ids)

    def _check_block(self, block: int) -> None:
        assert 0 <= block < self.num_device_blocks, f"device block {block} out of range"

    def _prepare_batch(self, plan: StepPlan) -> BatchInputs:
        """The batch's inputs: token ids, positions, KV slots, page tables, sample rows.
        Only what is per chunk is Python (comprehensions over the chunks); what is per
        token or per page is numpy over the whole batch (block_table.py says why)."""
        bs = self.config.block_size
        d, chunks = plan.decodes, plan.chunks
        nd = len(d)  # the decodes' rows come first, one each (wire/step.py DecodeBatch)
        bt = self.block_tables
        rows = bt.rows(d.seq_ids + [c.seq_id for c in chunks])
        n_tok = np.array([1] * nd + [len(c.token_ids) for c in chunks], dtype=np.int64)
        start = np.array(d.start_pos + [c.start_pos for c in chunks], dtype=np.int64)
        ctx = start + n_tok
        num_pages = (ctx + (bs - 1)) // bs
        table_len = bt.lengths(rows)
        if not (n_tok.min() > 0 and ctx.max() <= self.max_model_len
                and (num_pages <= table_len).all()):
            self._refuse_chunks(plan.batch(), ctx, num_pages, table_len)
        qo_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        kv_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(n_tok, out=qo_indptr[1:])
        np.cumsum(num_pages, out=kv_indptr[1:])
        kv_indices = bt.page_lists(rows, num_pages, kv_indptr[:-1])
        # token t of chunk c sits at start[c] + (t - qo_indptr[c]), on page
        # kv_indptr[c] + position // bs of the batch's page list; when every row is one
        # token (decodes, one-token chunks), token t is row t
        if len(rows) == qo_indptr[-1]:
            positions, first_page = start, kv_indptr[:-1]
        else:
            positions = np.arange(qo_indptr[-1]) + np.repeat(start - qo_indptr[:-1], n_tok)
            first_page = np.repeat(kv_indptr[:-1], n_tok)
        slots = kv_indices[first_page + positions // bs].astype(np.int64) * bs + positions % bs
        last_page_len = (ctx - (num_pages - 1) * bs).astype(np.int32)
        token_ids = np.array(d.token_ids + [t for c in chunks for t in c.token_ids],
                             dtype=np.int64)
        t32 = torch.from_numpy
        meta = AttentionMetadata(t32(qo_indptr), t32(kv_indptr), t32(kv_indices),
                                 t32(last_page_len), bs)
        ends = qo_indptr[nd + 1:].tolist()  # the chunks' (after the decodes')
        pending = [(row, s, d.token_ids, row) for row, s in enumerate(d.seq_ids)
                   if d.token_ids[row] == PENDING_TOKEN] if PENDING_TOKEN in d.token_ids else []
        pending += [(end - 1, c.seq_id, c.token_ids, len(c.token_ids) - 1)
                    for end, c in zip(ends, chunks) if c.token_ids[-1] == PENDING_TOKEN]
        return BatchInputs(
            token_ids=token_ids,
            positions=to_device(positions, self.device),
            slots=to_device(slots, self.device),
            meta=meta,
            # a drafted decode samples at each draft and after the last
            sample_rows=[*range(nd)] + [row for end, c in zip(ends, chunks) if c.sample
                                        for row in range(end - 1 - c.num_draft, end)],
            pending=pending,
            seq_lens=(to_device(np.repeat(ctx, n_tok).astype(np.int64), self.device)
                      if self.model_config.dynamic_rope else None),
            state_batch=(self._state_batch(plan, qo_indptr, n_tok, start)
                         if self.state is not None else None),
        )

    def _state_batch(self, plan: StepPlan, qo_indptr: np.ndarray, n_tok: np.ndarray,
                     start: np.ndarray) -> StateBatch:
        """Each chunk's state slot, rows and snapshots, in batch order (decodes first)."""
        d, chunks = plan.decodes, plan.chunks
        slots = self.state_slots
        return StateBatch(slots=[slots[s] for s in d.seq_ids] + [slots[c.seq_id] for c in chunks],
                          first_rows=qo_indptr[:-1].tolist(), num_tokens=n_tok.tolist(),
                          fresh=(start == 0).tolist(),
                          snapshots=[[] for _ in d.seq_ids] + [list(c.state_snapshots)
                                                                for c in chunks])

    def _refuse_chunks(self, chunks, ctx: np.ndarray, num_pages: np.ndarray,
                       table_len: np.ndarray) -> None:
        """Name the first chunk the rank cannot run (the scheduler never plans one)."""
        for c, n_ctx, p, n_table in zip(chunks, ctx.tolist(), num_pages.tolist(),
                                        table_len.tolist()):
            assert c.token_ids and n_ctx <= self.max_model_len, f"seq {c.seq_id}: bad chunk"
            # An exact page table: a spare page would read stale KV.
            assert p <= n_table, (
                f"seq {c.seq_id}: {n_ctx} tokens need {p} blocks, table has {n_table}")

