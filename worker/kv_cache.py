"""This rank's shard of every KV block, in two preallocated tiers.

Device tier: K and V as `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
(FlashInfer's NHD page layout per layer). Host tier: the same shape in RAM
(pinned on CUDA) with `num_host_blocks` slots. Both are allocated once at
start-up from the agreed block counts and never grow. Which block holds what is
decided by the scheduler alone; this class only moves bytes where a plan says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The most blocks a tier copy stages on the device at once (a chunk of a step's swaps):
# 32 KiB a block a layer for the 1B benchmark model, so 8 MiB a staging tensor.
STAGING_BLOCKS = 256


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    return [pairs[i:i + STAGING_BLOCKS] for i in range(0, len(pairs), STAGING_BLOCKS)]


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_host_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda" and num_host_blocks > 0  # nothing to pin without a tier
        self.k_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.v_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.device = device
        # Copies between tiers run on a side stream on CUDA, so the next forward
        # pass only waits where it touches the blocks being moved.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._layer_events: list[torch.cuda.Event] = []
        # On CPU the tier copies go through numpy views of the same memory, as bytes (numpy
        # has no bfloat16): numpy's fancy-index copy of a step's few blocks costs a third
        # to a quarter of torch's advanced indexing (its dispatch and TensorIterator setup
        # are most of a small copy; 4 SmolLM2 blocks: 31 us against 120).
        self._bytes = None if self._stream is not None else tuple(
            t.view(torch.uint8).numpy() for t in (self.k, self.v, self.k_host, self.v_host))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) at flat slots block * size + offset."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Apply a step's tier copies: first device -> host [(block, slot)], then host ->
        device [(slot, block)]. swap_out goes first because a block written out this step
        may be the target of a swap_in (or of new KV) in the same step.

        On CUDA the copies run layer by layer on a side stream, batched (`_swap_by_layer`),
        each layer recording an event; the forward pass waits on layer i's event just
        before layer i touches the cache (`wait_layer`), so the copies of later layers
        overlap earlier layers' compute.
        """
        if not swap_out and not swap_in:
            return
        if self._stream is None:
            self._swap_cpu(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # earlier steps' writes to these blocks are done
        self._layer_events = []

        def layer_queued() -> None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._layer_events.append(event)

        with torch.cuda.stream(self._stream):
            self._swap_by_layer(swap_out, swap_in, layer_queued)

    def _swap_by_layer(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       layer_queued: Callable[[], None] = lambda: None) -> None:
        """The tier copies, a layer at a time (`layer_queued` after each), batched: a
        layer's blocks going out are gathered into one staging tensor on the device and
        leave it in one copy per run of consecutive host slots; blocks coming in arrive
        the same way and one kernel scatters them into their blocks. Block by block, a
        step that moves n blocks issues 2n copies a layer each way, each a few
        microseconds of launch for a few KB; here 2 a layer each way where the slots run
        on, plus the gather or the scatter. The same code runs on the CPU, where the
        tests hold it to `_swap_cpu`."""
        if len({b for _, b in swap_in}) != len(swap_in):  # the scatter would pick one at random
            raise ValueError(f"two swap_ins into one block: {swap_in}")
        outs = [self._moves(c) for c in _chunks(sorted((s, b) for b, s in swap_out))]
        ins = [self._moves(c) for c in _chunks(sorted(swap_in))]
        page = self.k.shape[2:]
        out_k, out_v, in_k, in_v = (  # a chunk's worth: bounded device memory
            torch.empty((min(len(pairs), STAGING_BLOCKS), *page), dtype=self.k.dtype,
                        device=self.device)
            for pairs in (swap_out, swap_out, swap_in, swap_in))
        for layer in range(self.k.shape[0]):
            # first the copies out: a block going out may be one coming in (or new KV)
            for blocks, runs in outs:
                k, v = out_k[:len(blocks)], out_v[:len(blocks)]
                torch.index_select(self.k[layer], 0, blocks, out=k)
                torch.index_select(self.v[layer], 0, blocks, out=v)
                for row, slot, n in runs:  # pinned destination: a true async copy
                    self.k_host[layer, slot:slot + n].copy_(k[row:row + n], non_blocking=True)
                    self.v_host[layer, slot:slot + n].copy_(v[row:row + n], non_blocking=True)
            for blocks, runs in ins:
                k, v = in_k[:len(blocks)], in_v[:len(blocks)]
                for row, slot, n in runs:
                    k[row:row + n].copy_(self.k_host[layer, slot:slot + n], non_blocking=True)
                    v[row:row + n].copy_(self.v_host[layer, slot:slot + n], non_blocking=True)
                self.k[layer].index_copy_(0, blocks, k)
                self.v[layer].index_copy_(0, blocks, v)
            layer_queued()

    def _moves(self, pairs: list[tuple[int, int]]
               ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """(host slot, device block) pairs, in slot order: the blocks as an index on the
        device, and the runs of consecutive slots as (first staging row, first slot,
        count)."""
        runs: list[tuple[int, int, int]] = []
        for row, (slot, _) in enumerate(pairs):
            if runs and runs[-1][1] + runs[-1][2] == slot:
                first_row, first_slot, n = runs[-1]
                runs[-1] = (first_row, first_slot, n + 1)
            else:
                runs.append((row, slot, 1))
        cuda = self.device.type == "cuda"
        # pinned, so the copy to the device does not wait for the stream's earlier work
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.long, pin_memory=cuda)
        if cuda:
            blocks = blocks.to(self.device, non_blocking=True)
        return blocks, runs

    def sync_copies(self) -> None:
        """Wait for the tier copies queued so far (CUDA): the host side is read next."""
        if self._stream is not None:
            self._stream.synchronize()

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for this step's copies of `layer` (CUDA only)."""
        if self._layer_events:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])
            if layer == len(self._layer_events) - 1:
                self._layer_events = []

    def _swap_cpu(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        k, v, k_host, v_host = self._bytes
        if swap_out:
            blocks, slots = [b for b, _ in swap_out], [s for _, s in swap_out]
            k_host[:, slots] = k[:, blocks]
            v_host[:, slots] = v[:, blocks]
        if swap_in:
            slots, blocks = [s for s, _ in swap_in], [b for _, b in swap_in]
            k[:, blocks] = k_host[:, slots]
            v[:, blocks] = v_host[:, slots]

    # --- the disk tier (worker/disk_tier.py): one host slot as bytes, K then V ----------

    def host_slot_nbytes(self) -> int:
        return 2 * self.k_host[:, 0].numel() * self.k_host.element_size() if \
            self.num_host_blocks else 0

    def host_slot_bytes(self, slot: int) -> bytes:
        """A copy of a host slot's K and V of every layer (the disk record's payload)."""
        k = self.k_host[:, slot].contiguous().view(torch.uint8)
        v = self.v_host[:, slot].contiguous().view(torch.uint8)
        return k.numpy().tobytes() + v.numpy().tobytes()

    def load_host_slot(self, slot: int, payload: bytes) -> None:
        """The inverse of `host_slot_bytes`."""
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        half = len(buf) // 2
        for dst, part in ((self.k_host, buf[:half]), (self.v_host, buf[half:])):
            view = dst[:, slot].view(torch.uint8)  # [layers, block, kv_heads, head_dim * elem]
            view.copy_(part.view(view.shape))
