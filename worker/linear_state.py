"""A hybrid model's recurrent state, in slots: what its linear-attention layers keep in
place of KV.

Every Gated DeltaNet layer keeps, per sequence, a conv window (the last K-1 inputs of
each conv channel) and a recurrent matrix per value head (worker/gated_delta.py). The
cache holds them in `num_slots` slots, each slot one sequence's state at every linear
layer. The scheduler owns the slots (wire/step.py): a running sequence's live slot
(`NewSequence.state_slot`), snapshots a chunk leaves in other slots at block boundaries
(`ScheduledChunk.state_snapshots`), and `StepPlan.state_copy` to restore one on a prefix
hit. A slot is a copy, never shared: restoring a snapshot copies it, so the snapshot
stays as it was for the next hit. The host tier holds more snapshots, in RAM (pinned on
CUDA): `StepPlan.state_swap_out` demotes one there, `state_swap_in` restores one from
there into a live slot (cache/state_host.py). A host slot's bytes are a disk record's
payload (`host_slot_bytes` / `load_host_slot`, worker/disk_tier.py).

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
                 device: torch.device, num_host_slots: int = 0) -> None:
        """Shapes on this rank: `conv_dim` its conv channels (q, k and v of its heads),
        `num_v_heads` its value heads. The conv windows are in the model's dtype (the
        inputs they hold are), the recurrent matrices in float32."""
        self.num_slots = num_slots
        self.num_host_slots = num_host_slots
        self.conv_width = conv_width
        # [L, S, conv channels on this rank, K-1]
        self.conv = torch.zeros(num_linear_layers, num_slots, conv_dim, conv_width - 1,
                                dtype=dtype, device=device)
        # [L, S, value heads on this rank, Dk, Dv]
        self.recurrent = torch.zeros(num_linear_layers, num_slots, num_v_heads, head_k_dim,
                                     head_v_dim, dtype=RECURRENT_DTYPE, device=device)
        pin = device.type == "cuda" and num_host_slots > 0
        # the host tier's slots, the same shapes: [L, host slots, ...]
        self.conv_host = torch.zeros(self.conv.shape[0], num_host_slots, *self.conv.shape[2:],
                                     dtype=dtype, pin_memory=pin)
        self.recurrent_host = torch.zeros(self.recurrent.shape[0], num_host_slots,
                                          *self.recurrent.shape[2:], dtype=RECURRENT_DTYPE,
                                          pin_memory=pin)

    def apply(self, swap_out: list[tuple[int, int]], copies: list[tuple[int, int]],
              swap_in: list[tuple[int, int]]) -> None:
        """A plan's state ops, in its order (wire/step.py): (slot, host slot) demotions,
        (slot, slot) copies, then (host slot, slot) restores -- every op that reads a slot
        before any that may write it. On the compute stream, so a snapshot written by
        the step before is complete when it is read, and the next forward sees these."""
        for slot, host in swap_out:
            self._check(slot)
            self._check_host(host)
            self.conv_host[:, host].copy_(self.conv[:, slot], non_blocking=True)
            self.recurrent_host[:, host].copy_(self.recurrent[:, slot], non_blocking=True)
        for src, dst in copies:
            self.copy(src, dst)
        for host, slot in swap_in:
            self._check(slot)
            self._check_host(host)
            self.conv[:, slot].copy_(self.conv_host[:, host], non_blocking=True)
            self.recurrent[:, slot].copy_(self.recurrent_host[:, host], non_blocking=True)

    def sync(self) -> None:
        """Wait for the state ops queued on the compute stream (CUDA): a host slot is read
        on the CPU next (a disk write)."""
        if self.conv.is_cuda:
            torch.cuda.current_stream(self.conv.device).synchronize()

    def host_slot_bytes(self, host: int) -> bytes:
        """A copy of a host slot's conv windows and recurrent matrices, every layer: a
        disk record's payload (cache/state_disk.py). The swap_out that filled it must be
        complete (the caller syncs)."""
        self._check_host(host)
        return b"".join(t[:, host].contiguous().view(torch.uint8).numpy().tobytes()
                        for t in (self.conv_host, self.recurrent_host))

    def load_host_slot(self, host: int, payload: bytes) -> None:
        """The inverse of `host_slot_bytes` (on a reader thread: the slot is the read's
        alone until it is reported)."""
        self._check_host(host)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for t in (self.conv_host, self.recurrent_host):
            view = t[:, host].view(torch.uint8)
            view.copy_(buf[at:at + view.numel()].view(view.shape))
            at += view.numel()
        assert at == len(buf), f"a payload of {len(buf)} bytes for a {at}-byte state slot"

    @property
    def host_slot_nbytes(self) -> int:
        return (self.conv_host[:, 0].nbytes + self.recurrent_host[:, 0].nbytes
                if self.num_host_slots else 0)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src`, every layer."""
        self._check(src)
        self._check(dst)
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def _check(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots, f"state slot {slot} out of range ({self.num_slots})"

    def _check_host(self, slot: int) -> None:
        assert 0 <= slot < self.num_host_slots, (
            f"host state slot {slot} out of range ({self.num_host_slots})")

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
            self.__dict__[key] = tuple(_on(device, [values[i] for i in self.steps])
                                       for values in (self.first_rows, self.slots, self.fresh))
        return self.__dict__[key]


def _on(device: torch.device, values: list) -> torch.Tensor:
    """`values` as a tensor on `device`; to a GPU through pinned memory, without waiting:
    made inside the forward, where a copy from pageable memory would wait for the layers
    already queued (worker/forward.py to_device)."""
    tensor = torch.tensor(values)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor
