"""A step's forward pass: the model over the batch, its logits and its samples, launched
without waiting and read when the rank needs the tokens; and the prepared step it runs.

`ModelRunner` drives a step as prepare, launch and finish (worker/model_runner.py): it
prepares a `PreparedStep`, and the forward pass is what it launches and finishes. Two
kinds have the same interface, so the runner never asks which it holds:

- `ModelForward` (here): the model on its device, with its attention backend and the
  sampler;
- `NullModel` (worker/null_model.py): a clock in place of the device, for measuring the
  engine's own cost; what it has no use for is a no-op on it.

The interface:

- `attn`: the attention backend (None: it attends to nothing);
- `profile_num_blocks(num_tokens, block_bytes, memory_fraction)`: the device blocks that
  fit in that share of the GPU beside the largest step (None: nothing to measure);
- `launch(step, ids, kv, return_logits)`: start a prepared step's forward and sampling,
  `ids` its token ids on the device, every pending token resolved;
- `busy_s()`: how long the forward in flight still runs, where that is known (else 0);
- `done()`: whether it has ended;
- `finish(step)`: its samples, (seq_id, token) in the plan's row order, once read (which
  waits for the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wire.client import SamplingParams
from wire.step import RankTiming, StepPlan
from worker.attention import AttentionMetadata, create_backend
from worker.hybrid_model import HybridModel
from worker.kv_cache import KVCache
from worker.linear_state import LinearStateCache, StateBatch
from worker.model import LlamaModel
from worker.sampler import sample_tensor


@dataclass
class BatchInputs:
    """A step's inputs, built while the step before may still run (`ModelRunner.prepare`)."""

    token_ids: np.ndarray  # on the host: PENDING_TOKEN rows are filled in at the launch
    positions: torch.Tensor
    slots: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    # (row of token_ids, its sequence, the plan's list holding the token, index in it):
    # each PENDING_TOKEN, resolved at the launch in the batch and in the plan alike
    pending: list[tuple[int, int, list[int], int]]
    seq_lens: torch.Tensor | None = None  # [T] context at the chunk's end: dynamic NTK only
    state_batch: StateBatch | None = None  # a hybrid model's chunks' state slots


@dataclass
class PreparedStep:
    """A plan applied to this rank's state, its batch built: ready to launch."""

    plan: StepPlan
    digest: int  # this rank's state digest after the plan: what its result reports
    timing: RankTiming
    batch: BatchInputs | None = None  # None: the plan runs no chunk
    launched_at: float = 0.0  # perf_counter
    sampled: torch.Tensor | None = None  # the real model's tokens, maybe still on the device
    logits: torch.Tensor | None = None


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`. On CUDA through pinned memory, without waiting: under overlap
    scheduling the next step's inputs are made while this step's forward runs, and a copy
    from pageable memory would wait for that forward to end (torch synchronizes the
    stream for it), which is the overlap undone."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class ModelForward:
    """The model's forward pass on its device. On a GPU nothing in `launch` waits for the
    device, so the rank prepares its next step while the forward runs; reading the
    samples in `finish` is the one wait."""

    def __init__(self, model: LlamaModel, attention_backend: str, block_size: int,
                 sampling: dict[int, tuple[SamplingParams, int]],
                 state: LinearStateCache | None = None) -> None:
        """`model`: a LlamaModel or a HybridModel (worker/hybrid_model.py), whose
        linear-attention `state` each forward reads and writes."""
        self.model = model
        self.state = state
        self.device = model.device
        self.block_size = block_size
        self.attn = create_backend(attention_backend, model.num_heads, model.num_kv_heads,
                                   model.head_dim, block_size, model.dtype, model.device,
                                   model.kernel_choice)
        # seq id -> (its sampling parameters, its seed): the runner's, kept by its plans
        self.sampling = sampling
        self._end: torch.cuda.Event | None = None  # recorded after a CUDA launch

    def profile_num_blocks(self, num_tokens: int, block_bytes: int,
                           memory_fraction: float) -> int:
        """CUDA: blocks that fit in `memory_fraction` of the GPU after the weights and the
        activations of a step of `num_tokens` tokens (measured by running one). A hybrid
        model's state slots are not counted: they share this room with the blocks
        (ModelRunner splits it)."""
        m, bs, device = self.model, self.block_size, self.device
        scratch_blocks = -(-num_tokens // bs)
        kv = KVCache(m.config.num_kv_layers, scratch_blocks, 0, bs, m.num_kv_heads, m.head_dim,
                     m.dtype, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        self.attn.plan(AttentionMetadata(i32([0, num_tokens]), i32([0, scratch_blocks]),
                                         i32(list(range(scratch_blocks))),
                                         i32([num_tokens - (scratch_blocks - 1) * bs]), bs))
        positions = torch.arange(num_tokens, device=device)
        # a hybrid's linear layers run too, from a fresh state in a scratch slot
        state = {} if not isinstance(m, HybridModel) else dict(
            state=m.new_state_cache(1),
            state_batch=StateBatch(slots=[0], first_rows=[0], num_tokens=[num_tokens],
                                   fresh=[True]))
        hidden = m.forward(torch.zeros(num_tokens, dtype=torch.long, device=device),
                           positions, positions, kv, self.attn, **state)
        m.logits(hidden[-1:])
        torch.cuda.synchronize(device)
        scratch = kv.k.nbytes + kv.v.nbytes + (state["state"].nbytes if state else 0)
        peak = torch.cuda.max_memory_allocated(device) - scratch
        del kv, hidden, state
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        return max(0, int(total * memory_fraction - peak) // block_bytes)

    def launch(self, step: PreparedStep, ids: torch.Tensor, kv: KVCache,
               return_logits: bool = False) -> None:
        """Issue the model over the batch and the samples (this rank's, if it samples;
        and, asked, every row's logits), into `step.sampled` and `step.logits`."""
        b, plan = step.batch, step.plan
        self.attn.plan(b.meta)
        state = {} if b.state_batch is None else dict(state=self.state,
                                                      state_batch=b.state_batch)
        hidden = self.model.forward(ids, b.positions, b.slots, kv, self.attn, b.seq_lens,
                                    **state)
        rows = to_device(np.array(b.sample_rows, dtype=np.int64), self.device)
        logits = self.model.logits(hidden if return_logits else hidden[rows])
        if logits is not None and b.sample_rows:
            step.sampled = self._sample(plan, logits[rows] if return_logits else logits,
                                        b.sample_rows)
        step.logits = logits if return_logits else None
        if self.device.type == "cuda":  # its end, for `done`
            self._end = torch.cuda.Event()
            self._end.record()

    def busy_s(self) -> float:
        """A device's forward has no known end: 0 (`done` looks at it)."""
        return 0.0

    def done(self) -> bool:
        """Whether the forward last launched has ended (a GPU's: its work queued so far;
        on the CPU always)."""
        return self._end is None or self._end.query()

    def finish(self, step: PreparedStep) -> list[tuple[int, int]]:
        """The step's samples; reading the tokens waits for the device."""
        if step.sampled is None:
            return []
        plan = step.plan
        rows = plan.decodes.seq_ids + [c.seq_id for c in plan.chunks if c.sample
                                       for _ in range(c.num_draft + 1)]
        return list(zip(rows, step.sampled.tolist()))

    def _sample(self, plan: StepPlan, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The tokens of the plan's sampling rows, in order, on the logits' device: one row
        per sample, a drafted decode's rows its last num_draft + 1 positions, each sampled
        as plain decoding would sample it there (its seed, its position, and a guided
        one's mask there: the grammar's after the drafts before it)."""
        d = plan.decodes  # first: one row each, at the position after its token, no mask
        rows_of = [(s, p + 1) for s, p in zip(d.seq_ids, d.start_pos)]
        rows_of += [(c.seq_id, c.start_pos + len(c.token_ids) - c.num_draft + k)
                    for c in plan.chunks if c.sample for k in range(c.num_draft + 1)]
        assert len(rows_of) == len(rows)
        params = [self.sampling[s][0] for s, _ in rows_of]
        seeds = [self.sampling[s][1] for s, _ in rows_of]
        positions = [p for _, p in rows_of]
        masks = [None] * len(d) + [m for c in plan.chunks if c.sample for m in c.row_masks()]
        return sample_tensor(logits, params, seeds, positions, masks)
