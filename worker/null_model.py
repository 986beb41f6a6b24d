"""The null model: a forward pass that costs a chosen fixed time and computes nothing.

With `--null-model-forward-ms MS` (EngineConfig.null_model_forward_ms) every rank's
ModelRunner holds a NullModel in place of the LlamaModel: no weights are read, and each
forward waits MS milliseconds and samples tokens that depend on the input alone. All
around it stays real: the scheduler, the cache and its tiers, the step protocol, the
plans' cache ops and table deltas applied on every rank, the digests, the sockets. What
a run costs beyond MS per step is therefore the engine's own cost, the part a GPU, whose
steps are short, exposes.

Choices, and why:

- The wait is a sleep, not a busy loop. A rank on a GPU spends its forward waiting on
  the device, its core free; a busy loop would instead take a core from the scheduler
  and the other ranks (on a 2-core machine, from the very processes being measured).
  A sleep overshoots by tens of microseconds; `RankTiming.forward_s` reports the time it
  really took. Like a GPU's, the forward runs beside the rank: `launch` starts it,
  `finish` waits for its end, and in between the rank may prepare its next step
  (worker/main.py), as it does over a real GPU forward.
- It is the ModelRunner's forward pass as the real model's `ModelForward` is, with the
  same interface (worker/forward.py), so the runner never asks which it holds. What it
  has no use for is a no-op: it attends to nothing (no backend, nor its compiled
  kernel, is loaded), has no memory to profile, takes no logits and ignores the KV
  pages and the batch's device inputs (a rank still builds them every step: its page
  tables check every chunk against its block table).
- The token at position p is a fixed hash of (the chunk's last input token, p), never
  an end-of-sequence id: runs are reproducible, a prompt gives the same tokens with and
  without a prefix hit, and lengths are set by max_tokens alone. Sampling parameters
  are ignored (every request decodes as if greedy); a guided request's mask is honoured.
- No collectives: in the real model the all-reduces are part of the forward's time (on
  a GPU, of the device's), so the null forward has none, and the ranks run side by side.
- The KV pages keep the model's number of layers (tier copies issue as many per-layer
  copies as they would) but one head of one element, so a device tier of thousands of
  blocks costs kilobytes and a benchmark can make it small enough to swap.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

# the digest's fixed, seedless integer hash: the same in every process and every run
from wire.digest import _mix64, _mix64_np
from wire.step import ScheduledChunk, StepPlan
from worker.distributed import TensorParallelGroup
from worker.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from worker.forward import PreparedStep
    from worker.kv_cache import KVCache

# The KV page of one layer: one head of one element (see the module's docstring).
NULL_KV_HEADS = 1
NULL_HEAD_DIM = 1


class NullModel:
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, forward_ms: float,
                 logits_everywhere: bool = False) -> None:
        # The world sizes the real model would take, and no others: a benchmark of the
        # null model stands for a configuration that can be served.
        config.check_tensor_parallel(tp.world_size)
        self.rank = tp.rank
        # every rank samples, as the real model's ranks do under overlap scheduling
        self.samples = tp.rank == 0 or logits_everywhere
        self.forward_s = forward_ms / 1000
        self.vocab_size = config.vocab_size
        self.num_heads = NULL_KV_HEADS
        self.num_kv_heads = NULL_KV_HEADS
        self.head_dim = NULL_HEAD_DIM
        # the tokens the null model may emit, in id order: all but the end-of-sequence ids
        eos = set(config.eos_token_ids)
        self._tokens = np.array([t for t in range(config.vocab_size) if t not in eos],
                                dtype=np.int64)
        assert len(self._tokens), "a vocabulary of end-of-sequence ids only"
        self._busy_until = 0.0  # perf_counter: the end of the forward in flight
        self._sampled: list[tuple[int, int]] = []

    # --- the forward pass (worker/forward.py) -------------------------------------

    attn = None  # it attends to nothing

    def profile_num_blocks(self, num_tokens: int, block_bytes: int,
                           memory_fraction: float) -> None:
        """Nothing to measure (no weights, no activations): the device tier is sized as
        without profiling."""
        return None

    def launch(self, step: PreparedStep, ids: torch.Tensor, kv: KVCache,
               return_logits: bool = False) -> None:
        """Start the forward of `step.plan`: from now the "device" is busy for the forward
        time, and the rank's core is free (it may prepare its next step meanwhile, as on
        a GPU). Its tokens come from the plan, whose pending tokens are resolved."""
        assert not return_logits, "the null model has no logits"
        self._start(step.plan)

    def busy_s(self) -> float:
        """How long the forward in flight still runs."""
        return max(0.0, self._busy_until - time.perf_counter())

    def done(self) -> bool:
        return self.busy_s() == 0

    def finish(self, step: PreparedStep | None = None) -> list[tuple[int, int]]:
        """Wait for the forward in flight; its samples."""
        if (wait := self.busy_s()) > 0:
            time.sleep(wait)
        return self._sampled

    def forward(self, plan: StepPlan) -> list[tuple[int, int]]:
        """A plan's forward at once: `launch`, then `finish`."""
        self._start(plan)
        return self.finish()

    def _start(self, plan: StepPlan) -> None:
        self._busy_until = time.perf_counter() + self.forward_s
        # a rank that samples (rank 0, or every rank under overlap scheduling, as with the
        # real model) has a (seq_id, token) for each chunk that samples, the others none
        # (a drafted decode samples at each draft position too, each row under its own
        # mask, as the real model does)
        if not self.samples:
            self._sampled = []
            return
        d = plan.decodes  # the batch's first rows (wire/step.py DecodeBatch)
        self._sampled = list(zip(d.seq_ids, self.decode_tokens(d.token_ids, d.start_pos)))
        self._sampled += [(c.seq_id, self.token(c, len(c.token_ids) - c.num_draft + k))
                          for c in plan.chunks if c.sample for k in range(c.num_draft + 1)]

    # --- the tokens -----------------------------------------------------------------

    def token(self, chunk: ScheduledChunk, upto: int | None = None) -> int:
        """The token after the chunk's first `upto` tokens (all: None): a function of the
        token before it and its position only, under that row's mask (a drafted decode's
        rows each have their own: ScheduledChunk.row_masks)."""
        upto = len(chunk.token_ids) if upto is None else upto
        position = chunk.start_pos + upto
        index = _mix64((chunk.token_ids[upto - 1] << 32) ^ position) % len(self._tokens)
        row = upto - (len(chunk.token_ids) - chunk.num_draft)
        allowed = chunk.row_masks()[row] if 0 <= row <= chunk.num_draft else chunk.allowed
        if allowed is not None:
            index = self._first_allowed(index, allowed)
        return int(self._tokens[index])

    def decode_tokens(self, token_ids: list[int], start_pos: list[int]) -> list[int]:
        """`token` of each plain decode (one token, no mask) of a DecodeBatch, over the
        whole batch at once: the token after `token_ids[i]`, at `start_pos[i] + 1`."""
        if not token_ids:
            return []
        x = ((np.array(token_ids, dtype=np.uint64) << np.uint64(32))
             ^ (np.array(start_pos, dtype=np.uint64) + np.uint64(1)))
        index = _mix64_np(x) % np.uint64(len(self._tokens))
        return self._tokens[index.astype(np.int64)].tolist()

    def _first_allowed(self, index: int, allowed: bytes) -> int:
        """The first emittable token at or after `index` (cyclically) that the mask allows
        (bit i of the little-endian words: token i); `index` itself when the mask allows
        none, as the real sampler then samples unmasked and the scheduler ends the request."""
        bits = np.unpackbits(np.frombuffer(allowed, dtype=np.uint8), bitorder="little")
        ok = np.zeros(self.vocab_size, dtype=bool)
        n = min(len(bits), self.vocab_size)
        ok[:n] = bits[:n].astype(bool)
        candidates = np.flatnonzero(ok[self._tokens])  # indices into self._tokens
        if not len(candidates):
            return index
        after = candidates[candidates >= index]
        return int(after[0] if len(after) else candidates[0])
