"""This rank's shard of every KV block, in two preallocated tiers.

Device tier: K and V as `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
(FlashInfer's NHD page layout per layer). Host tier: the same shape in RAM
(pinned on CUDA) with `num_host_blocks` slots. Both are allocated once at
start-up from the agreed block counts and never grow. Which block holds what is
decided by the scheduler alone; this class only moves bytes where a plan says.

With FP8 KV (worker/kv_quant.py) K and V hold one byte an element, and each tier has
their scales beside them, `[num_layers, num_blocks, block_size, num_kv_heads]` float32,
indexed by the same block ids: every copy between tiers, and a disk record, moves a
block's scales with its bytes, so a block is whole wherever it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.kv_quant import SCALE_BYTES, SCALE_DTYPE, is_fp8, quantize

# The most blocks a tier copy stages on the device at once (a chunk of a step's swaps):
# 32 KiB a block a layer for the 1B benchmark model, so 8 MiB a staging tensor.
STAGING_BLOCKS = 256


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    return [pairs[i:i + STAGING_BLOCKS] for i in range(0, len(pairs), STAGING_BLOCKS)]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """FP8 as bytes (a view): torch's indexed copies take no FP8 on CPU."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_host_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`dtype`: what K and V are stored as, the model's dtype or an FP8 one (with
        scales)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda" and num_host_blocks > 0  # nothing to pin without a tier
        self.k_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.v_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        # FP8: a float32 scale per token and KV head, beside K and V in both tiers
        self.k_scale = self.v_scale = self.k_scale_host = self.v_scale_host = None
        if is_fp8(dtype):
            self.k_scale, self.v_scale = (torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
                                          for _ in range(2))
            self.k_scale_host, self.v_scale_host = (
                torch.ones(host_shape[:-1], dtype=SCALE_DTYPE, pin_memory=pin) for _ in range(2))
        # (device tier, host tier) of each part of a block, in the order a disk record holds
        # them: K, V, then the scales. A tier copy moves every part; FP8 parts move as
        # bytes (torch has no indexed copies of FP8 tensors on CPU).
        self._parts = [(_bytes_of(dev), _bytes_of(host)) for dev, host in (
            (self.k, self.k_host), (self.v, self.v_host),
            (self.k_scale, self.k_scale_host), (self.v_scale, self.v_scale_host))
            if dev is not None]
        self.device = device
        # Copies between tiers run on a side stream on CUDA, so the next forward
        # pass only waits where it touches the blocks being moved.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._layer_events: list[torch.cuda.Event] = []
        # On CPU the tier copies go through numpy views of the same memory, as bytes (numpy
        # has no bfloat16): numpy's fancy-index copy of a step's few blocks costs a third
        # to a quarter of torch's advanced indexing (its dispatch and TensorIterator setup
        # are most of a small copy; 4 SmolLM2 blocks: 31 us against 120).
        self._bytes = None if self._stream is not None else [
            (dev.view(torch.uint8).numpy(), host.view(torch.uint8).numpy())
            for dev, host in self._parts]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """One block's K and V on this rank, with their scales where `dtype` is FP8."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_head = head_dim * elem + (SCALE_BYTES if is_fp8(dtype) else 0)
        return 2 * num_layers * block_size * num_kv_heads * per_head

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V scales [num_blocks, block_size, num_kv_heads] (FP8), else
        (None, None): what the attention kernels take beside the pages."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) at flat slots block * size + offset
        (FP8: quantized, each token's scales at the same slots)."""
        if self.k_scale is None:
            self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)
            return
        for x, pages, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            values, scale = quantize(x, self.dtype)
            pages[layer].view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(
                0, slots, values.view(torch.uint8))
            scales[layer].view(-1, x.shape[1]).index_copy_(0, slots, scale)

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
        # per part, a chunk's worth each way: bounded device memory
        staging = [tuple(torch.empty((min(len(pairs), STAGING_BLOCKS), *dev.shape[2:]),
                                     dtype=dev.dtype, device=self.device)
                         for pairs in (swap_out, swap_in)) for dev, _ in self._parts]
        for layer in range(self.k.shape[0]):
            # first the copies out: a block going out may be one coming in (or new KV)
            for blocks, runs in outs:
                for (dev, host), (out, _) in zip(self._parts, staging):
                    rows = out[:len(blocks)]
                    torch.index_select(dev[layer], 0, blocks, out=rows)
                    for row, slot, n in runs:  # pinned destination: a true async copy
                        host[layer, slot:slot + n].copy_(rows[row:row + n], non_blocking=True)
            for blocks, runs in ins:
                for (dev, host), (_, into) in zip(self._parts, staging):
                    rows = into[:len(blocks)]
                    for row, slot, n in runs:
                        rows[row:row + n].copy_(host[layer, slot:slot + n], non_blocking=True)
                    dev[layer].index_copy_(0, blocks, rows)
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
        for dev, host in self._bytes:
            if swap_out:
                blocks, slots = [b for b, _ in swap_out], [s for _, s in swap_out]
                host[:, slots] = dev[:, blocks]
            if swap_in:
                slots, blocks = [s for s, _ in swap_in], [b for _, b in swap_in]
                dev[:, blocks] = host[:, slots]

    # --- the disk tier (worker/disk_tier.py): one host slot as bytes ---------------------

    def host_slot_nbytes(self) -> int:
        return sum(host[:, 0].nbytes for _, host in self._parts) if self.num_host_blocks else 0

    def host_slot_bytes(self, slot: int) -> bytes:
        """A copy of a host slot's K and V of every layer, then (FP8) their scales: the disk
        record's payload."""
        return b"".join(host[:, slot].contiguous().view(torch.uint8).numpy().tobytes()
                        for _, host in self._parts)

    def load_host_slot(self, slot: int, payload: bytes) -> None:
        """The inverse of `host_slot_bytes`."""
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for _, host in self._parts:
            view = host[:, slot].view(torch.uint8)  # [layers, block, kv_heads, bytes a row]
            view.copy_(buf[at:at + view.numel()].view(view.shape))
            at += view.numel()
        assert at == len(buf), f"a payload of {len(buf)} bytes for a {at}-byte slot"
