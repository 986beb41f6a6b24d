"""A sequence's next tokens as rows of the step's plan.

`run_tokens` puts the tokens a sequence runs this step into the `StepPlan`: a plain
decode as a row of its three columns (`StepPlan.decodes`), anything else (a prefill
chunk, a masked or drafted decode, a chunk that snapshots state) as a `ScheduledChunk`,
with the block-table delta the ranks need first and the commit of the blocks whose KV
the step writes. Plain functions: the scheduler passes what they read
(scheduler/scheduler.py `Scheduler._run_running`, scheduler/admission.py
`AdmissionControl._start`).
"""

from __future__ import annotations

from cache.manager import KVCacheManager
from scheduler.request import Sequence
from scheduler.speculation import guided_drafts, propose_drafts
from scheduler.state_snapshots import take_snapshots
from wire.config import SpeculativeConfig
from wire.step import PENDING_TOKEN, AppendBlocks, NewSequence, ScheduledChunk, StepPlan


def tokens_to_run(seq: Sequence, budget: int) -> int:
    """The tokens a running sequence runs this step: what it has not computed (its
    pending samples included), at most `budget`."""
    return min(seq.num_tokens + seq.num_pending - seq.num_computed, budget)


def decode_drafts(seq: Sequence, budget: int, speculative: SpeculativeConfig,
                  max_model_len: int) -> tuple[list[int], list[bytes]]:
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
               max_model_len - seq.num_tokens, budget) - 1
    drafts = propose_drafts(seq.ngram, seq.tokens, speculative, room)
    if seq.guide is None or not drafts:
        return drafts, []
    return guided_drafts(drafts, seq.guide, seq.stop_token_ids)


def run_tokens(plan: StepPlan, seq: Sequence, cache: KVCacheManager, num_new: int,
               snapshot_interval: int | None,
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
    drafts come with the mask of the sample after each (`draft_masks`,
    `decode_drafts`). With `commits`, the registration is queued there instead, and
    the caller makes all of them at once before anything may hit them
    (`Scheduler._run_running`: the running sequences', before the admissions). A
    hybrid model's chunk snapshots its state every `snapshot_interval` blocks (None:
    no snapshots; scheduler/state_snapshots.py)."""
    # Written for the common case, a running sequence's one-token decode, which
    # every sequence of the batch goes through every step: few calls, few lookups.
    seq_id, tokens, num_pending = seq.seq_id, seq.tokens, seq.num_pending
    start = seq.num_computed
    end = start + num_new
    known = len(tokens)
    # taken before the commit below, which registers those whose block it commits
    snaps = (take_snapshots(cache, seq_id, start, end, snapshot_interval)
             if snapshot_interval is not None else None)
    # A block whose last token is pending is registered by the sequence's next plan,
    # once the token is known, or by its close if no plan runs it again
    # (`Scheduler._close`).
    if commits is None:
        cache.commit(seq_id, tokens, end if end < known else known, plan.step)
    else:  # the caller commits them all at once (cache.commit_many)
        commits.append((seq_id, tokens, end if end < known else known))
    block_ids = seq.block_ids
    if not seq.opened:
        plan.new_seqs.append(NewSequence(seq_id, list(block_ids), seq.request.sampling,
                                         cache.state_slot(seq_id)))
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
        allowed = _allowed(seq)
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


def _allowed(seq: Sequence) -> bytes | None:
    """The mask of a sequence's next sample: its grammar's, and around it its thinking
    span's (scheduler/thinking.py); None: any token."""
    if seq.guide is None and seq.thinking is None:
        return None
    answer = seq.guide.allowed if seq.guide is not None else lambda: None
    return seq.thinking.mask(answer) if seq.thinking is not None else answer()
