"""A hybrid model's recurrent state, in slots: what its linear-attention layers keep in
place of KV.

Every Gated DeltaNet layer keeps, per sequence, a conv window (the last K-1 inputs of
each conv channel) and a recurrent matrix per value head (worker/gated_delta.py). The
cache holds them in `num_slots` slots, each slot one sequence's state at every linear
layer. The scheduler owns the slots (wire/step.py): a running sequence's live slot
(`NewSequence.state_slot`), snapshots a chunk leaves in other slots at block boundaries
(`ScheduledChunk.state_snapshots`), and `StepPlan.state_copy` to restore one on a prefix
hit. A slot is a copy, never shared: restoring a snapshot copies it, so the snapshot
stays as it was for the next hit.

`StateBatch` is a step's view of the slots: per chunk, in batch order, where its rows
are, which slot it reads and writes, whether it starts from zero, and its snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

RECURRENT_DTYPE = torch.float32  # the delta rule accumulates in float32, as its reference


class LinearStateCache:
    def __init__(self, num_linear_layers: int, num_slots: int, conv_dim: int, conv_width: int,
                 num_v_heads: int, head_k_dim: int, head_v_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Shapes on this rank: `conv_dim` its conv channels (q, k and v of its heads),
        `num_v_heads` its value heads. The conv windows are in the model's dtype (the
        inputs they hold are), the recurrent matrices in float32."""
        self.num_slots = num_slots
        self.conv_width = conv_width
        # [L, S, conv channels on this rank, K-1]
        self.conv = torch.zeros(num_linear_layers, num_slots, conv_dim, conv_width - 1,
                                dtype=dtype, device=device)
        # [L, S, value heads on this rank, Dk, Dv]
        self.recurrent = torch.zeros(num_linear_layers, num_slots, num_v_heads, head_k_dim,
                                     head_v_dim, dtype=RECURRENT_DTYPE, device=device)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src`, every layer."""
        self._check(src)
        self._check(dst)
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def _check(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots, f"state slot {slot} out of range ({self.num_slots})"

    @staticmethod
    def bytes_per_slot(num_linear_layers: int, conv_dim: int, conv_width: int,
                       num_v_heads: int, head_k_dim: int, head_v_dim: int,
                       conv_elem_size: int) -> int:
        """Bytes one slot takes on one rank (its shapes, as the constructor's), conv
        windows at `conv_elem_size` bytes an element, recurrent matrices in float32."""
        conv = conv_dim * (conv_width - 1) * conv_elem_size
        recurrent = num_v_heads * head_k_dim * head_v_dim * 4
        return num_linear_layers * (conv + recurrent)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class StateBatch:
    """A step's chunks as the linear layers see them, in batch order (decodes first)."""

    slots: list[int]  # the slot each chunk reads (unless fresh) and leaves its state in
    first_rows: list[int]  # its first row in the flattened batch
    num_tokens: list[int]
    fresh: list[bool]  # starts at position 0: from a zero state, its slot not read
    # (tokens of the chunk consumed, slot): the state after that many copied there
    snapshots: list[list[tuple[int, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.snapshots:
            self.snapshots = [[] for _ in self.slots]
        assert len(set(self.slots)) == len(self.slots), "two chunks of a step share a slot"
        assert min(self.slots, default=0) >= 0, "a hybrid model's chunk without a state slot"
        for n, snaps in zip(self.num_tokens, self.snapshots):
            assert all(0 <= k <= n for k, _ in snaps), f"a snapshot outside its chunk: {snaps}"

    @cached_property
    def steps(self) -> list[int]:
        """The chunks of one token and no snapshot (decodes): one batched recurrent step."""
        return [i for i, (n, s) in enumerate(zip(self.num_tokens, self.snapshots))
                if n == 1 and not s]

    @cached_property
    def prefills(self) -> list[int]:
        """The other chunks: each through the chunked rule, split at its snapshots."""
        steps = set(self.steps)
        return [i for i in range(len(self.slots)) if i not in steps]

    def step_tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows, slots, fresh) of `steps` as tensors, made once per step."""
        key = ("_step_tensors", device)
        if key not in self.__dict__:
            rows = torch.tensor([self.first_rows[i] for i in self.steps], device=device)
            slots = torch.tensor([self.slots[i] for i in self.steps], device=device)
            fresh = torch.tensor([self.fresh[i] for i in self.steps], device=device)
            self.__dict__[key] = (rows, slots, fresh)
        return self.__dict__[key]
