"""Messages of the step protocol: one plan from the scheduler to every rank, one result back.

Vocabulary: a *sequence* owns a *block table* (device block ids, `block_size` tokens
each). A *step plan* carries, in the order the ranks apply them: cache ops (swap_out,
swap_in, close), block-table deltas (new sequences, appended blocks), then the chunks of
tokens to run forward. Deltas, not state: a sequence's table is sent in full once
(NewSequence), then only its appended blocks, then its close.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.client import SamplingParams

# In a chunk's token_ids: the token this sequence sampled in the step before, which the
# scheduler plans with before it knows it (overlap scheduling, scheduler/engine.py). Every
# rank resolves it from the tokens it sampled itself in that step: every rank samples
# the same tokens from the same all-gathered logits (worker/model_runner.py).
PENDING_TOKEN = -1


def count_accepted(drafts: list[int], targets: list[int]) -> int:
    """How many drafts a drafted decode keeps: `targets[i]` is the model's token at draft
    position i (one more than there are drafts); drafts are kept while each equals the
    model's token before it. The decode then yields targets[:count + 1]. Every rank that
    has the samples computes it, the same way (worker/model_runner.py)."""
    assert len(targets) == len(drafts) + 1, (len(drafts), len(targets))
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


@dataclass
class NewSequence:
    """A sequence's block table, sent in full exactly once."""

    seq_id: int
    block_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # A hybrid model (linear-attention layers beside the attention layers): the state slot
    # this sequence's recurrent state lives in while it runs (worker/linear_state.py);
    # -1: the model keeps no such state. A chunk at position 0 starts from a zero state;
    # any other reads the slot (filled by a `StepPlan.state_copy` from a snapshot on a
    # prefix hit, or left by the sequence's own chunk before).
    state_slot: int = -1


@dataclass
class AppendBlocks:
    """Blocks appended to a live sequence's table (a delta, never the whole table)."""

    seq_id: int
    block_ids: list[int]


@dataclass
class TrimBlocks:
    """Blocks dropped from the end of a live sequence's table: they were appended only for
    draft tokens the model rejected (speculative decoding, scheduler/speculation.py).
    `block_ids` are the dropped ones, in table order from index `num_blocks` on: the
    digest subtracts exactly them, and each rank checks its table ends with them."""

    seq_id: int
    num_blocks: int  # the table's length after the trim
    block_ids: list[int]


@dataclass
class ScheduledChunk:
    """Tokens of one sequence to run this step, at positions [start_pos, start_pos + len).

    Their KV is written into the sequence's blocks; attention sees every earlier
    position (the cached prefix included). `sample` asks rank 0 for a token at
    the chunk's last position.

    A drafted decode (speculative decoding): the last `num_draft` tokens are guesses.
    Rank 0 samples at each of the last `num_draft + 1` positions, and every rank keeps
    the drafts that agree with the samples before them, plus the sample after the last
    one kept (worker/model_runner.py, scheduler/speculation.py `accept_drafts`). A guided
    one masks each of those samples with its own mask (`row_masks`).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool
    # guided decoding (scheduler/guided.py): the tokens the sample may take, bit i of
    # the little-endian 32-bit words for token i; None: any
    allowed: bytes | None = None
    num_draft: int = 0  # draft tokens at the chunk's end
    # A guided drafted decode: the mask of the sample after each draft, i.e. the grammar's
    # allowed tokens once the drafts up to it are accepted (`allowed` is the first row's,
    # after the last known token). The scheduler drafts only tokens its grammar accepts, so
    # each kept draft is a token plain decoding could have sampled there, and the sample
    # after it is drawn from what plain decoding would have allowed. num_draft of them when
    # `allowed` is set, else empty.
    draft_allowed: list[bytes] = field(default_factory=list)
    # A hybrid model: (tokens of this chunk consumed, state slot) -- the sequence's
    # recurrent state after that many of the chunk's tokens is copied into the slot during
    # the forward (a snapshot at a block boundary, which a later prefix hit restores)
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)

    def row_masks(self) -> list[bytes | None]:
        """The mask of each sampled row, in order (num_draft + 1 of them; None: any)."""
        if self.allowed is None:
            return [None] * (self.num_draft + 1)
        assert len(self.draft_allowed) == self.num_draft, (
            f"seq {self.seq_id}: {self.num_draft} drafts, {len(self.draft_allowed)} masks")
        return [self.allowed, *self.draft_allowed]


@dataclass
class DecodeBatch:
    """A step's plain decodes, column by column: entry i is the chunk
    ScheduledChunk(seq_ids[i], [token_ids[i]], start_pos[i], sample=True) -- one token, no
    mask, no drafts. Most of a batch is these, every step, so they cross the wire as three
    lists of ints (msgpack packs them in C) and ranks read them as arrays, with no object
    per sequence on either side. A chunk of any other shape goes in StepPlan.chunks."""

    seq_ids: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)  # the position of its one token
    token_ids: list[int] = field(default_factory=list)  # that token, or PENDING_TOKEN

    def __len__(self) -> int:
        return len(self.seq_ids)

    def append(self, seq_id: int, token: int, position: int) -> None:
        self.seq_ids.append(seq_id)
        self.token_ids.append(token)
        self.start_pos.append(position)

    def as_chunks(self) -> list[ScheduledChunk]:
        return [ScheduledChunk(s, [t], p, True)
                for s, t, p in zip(self.seq_ids, self.token_ids, self.start_pos)]


@dataclass
class StepPlan:
    step: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    close: list[int] = field(default_factory=list)  # seq ids whose block tables are dropped
    trim: list[TrimBlocks] = field(default_factory=list)  # applied after close, before new_seqs
    new_seqs: list[NewSequence] = field(default_factory=list)
    append: list[AppendBlocks] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # (device block, low 64 bits of its block hash): blocks registered in the prefix
    # index this step. Ranks mirror them (and carry them through swaps) only so the
    # state digest covers which hash lives in which block or host slot.
    register: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier, applied after swap_out and before swap_in (cache/manager.py CacheOps):
    # (write id, host slot, disk slot, hash lo, hash hi): the host slot's KV written to
    # disk in the background, under its full block hash (a restart finds it by that);
    # (read id, disk slot, host slot, hash lo, hash hi): a read of a committed record into
    # a host slot *started* (on the rank's reader threads); a later plan swaps it in, once
    # every rank reported it done (StepResult.disk_read_done, cache/disk_flow.py).
    disk_write: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    disk_read: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # A hybrid model's state slots (worker/linear_state.py), applied after the swaps and
    # before closes, in list order (between state_swap_out and state_swap_in, below):
    # (source slot, destination slot), a snapshot restored into a sequence's slot on a
    # prefix hit; and (snapshot slot, low 64 bits of the hash of the block it ends at):
    # snapshots registered in the prefix index this step, mirrored for the digest only,
    # as `register` is for blocks.
    state_copy: list[tuple[int, int]] = field(default_factory=list)
    state_register: list[tuple[int, int]] = field(default_factory=list)
    # Snapshots between the device's state slots and the host's (cache/state_host.py),
    # applied as: state_swap_out (device slot, host slot), a snapshot the device evicts
    # demoted to the host (the host slot then holds its hash, in the digest); state_copy;
    # state_swap_in (host slot, device slot), a host snapshot restored into a sequence's
    # live slot on a prefix hit. Read before written: a slot a swap_out or a copy reads may
    # be the destination of a later op of the same plan.
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Snapshots between the host's state slots and the disk tier (cache/state_disk.py),
    # applied after state_swap_out and before state_copy, as disk_write / disk_read are
    # for KV: (write id, host state slot, disk state slot, hash lo, hash hi), the host
    # snapshot written to disk in the background under its block hash; (read id, disk state
    # slot, host state slot, hash lo, hash hi), a read into a host state slot *started*,
    # restored by a later plan's state_swap_in once every rank reported it
    # (StepResult.state_disk_read_done).
    state_disk_write: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    state_disk_read: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # The batch is `decodes`, then `chunks`: rows, samples and results in that order.
    decodes: DecodeBatch = field(default_factory=DecodeBatch)

    def batch(self) -> list[ScheduledChunk]:
        """Every chunk this step runs, in batch order, the decodes as ScheduledChunk
        objects: for readers off the per-step path (tests, tools, inspection)."""
        return self.decodes.as_chunks() + self.chunks

    @property
    def num_chunks(self) -> int:
        return len(self.decodes) + len(self.chunks)


@dataclass
class RankTiming:
    """Where one rank's time went in one step, in seconds, measured on the rank: the
    scheduler tells its own cost from the ranks' with it (scheduler/engine.py StepTotals),
    and `gap_s` is the rank's idle time between forwards, what a GPU would sit through.
    Durations only, never timestamps: clocks of different processes (or nodes) are not
    compared."""

    wait_s: float = 0.0  # blocked on the socket, from the last result sent to this plan
    decode_s: float = 0.0  # the plan from msgpack
    apply_s: float = 0.0  # cache ops (tier copies), closes and block-table deltas
    digest_s: float = 0.0  # StateDigest.apply
    prepare_s: float = 0.0  # the batch's input tensors and page tables
    forward_s: float = 0.0  # forward pass and sampling (0 in a step without chunks)
    # from the end of this rank's previous forward to the start of this one (0 for the first
    # forward, and in a step without one: the idle time then counts in the next forward's)
    gap_s: float = 0.0
    # the rank's main thread on a CPU (time.thread_time) in the pass of its serve loop that
    # sent this result, from the pass's start to the result's encoding: on a machine with
    # fewer cores than processes the CPU per step, not the wall time, is what they share
    cpu_s: float = 0.0


@dataclass
class StepResult:
    step: int
    rank: int
    digest: int  # StateDigest.value after the step
    # (seq_id, token), rank 0 only: one per sampling chunk; for a drafted decode, the
    # accepted drafts and the token after them, in order
    sampled: list[tuple[int, int]] = field(default_factory=list)
    timing: RankTiming = field(default_factory=RankTiming)
    error: str | None = None
    # disk writes this rank finished since its last result (written, or dropped: its
    # queue was full or the disk failed); the scheduler commits a slot once every rank
    # wrote it (cache/disk_pool.py)
    disk_done: list[int] = field(default_factory=list)
    disk_dropped: list[int] = field(default_factory=list)
    disk_queue_depth: int = 0
    # disk reads this rank finished since its last result: read and checked into the host
    # slot, or bad (the record failed its check: never served; the scheduler drops the
    # block on every rank and the tokens are recomputed)
    disk_read_done: list[int] = field(default_factory=list)
    disk_read_bad: list[int] = field(default_factory=list)
    # the same for a hybrid model's state snapshot records (cache/state_disk.py)
    state_disk_done: list[int] = field(default_factory=list)
    state_disk_dropped: list[int] = field(default_factory=list)
    state_disk_read_done: list[int] = field(default_factory=list)
    state_disk_read_bad: list[int] = field(default_factory=list)
    # Under overlap scheduling every rank samples the same tokens from the same logits and
    # feeds them to its next step (worker/model_runner.py): a digest of what this rank
    # sampled, which the scheduler holds to rank 0's list (0: this rank did not sample).
    sampled_digest: int = 0
