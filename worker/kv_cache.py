"""This rank's shard of every KV block, in two preallocated tiers.

Device tier: K and V as `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
(FlashInfer's NHD page layout per layer). Host tier: the same shape in RAM
(pinned on CUDA) with `num_host_blocks` slots. Both are allocated once at
start-up from the agreed block counts and never grow. Which block holds what is
decided by the scheduler alone; this class only moves bytes where a plan says.
"""

from __future__ import annotations

import contextlib

import torch


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
        pin = device.type == "cuda"
        self.k_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.v_host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.device = device
        # Copies between tiers run on a side stream on CUDA, so the next forward
        # pass only waits where it touches the blocks being moved.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) at flat slots block * size + offset."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host slots: [(device block, host slot), ...]."""
        if not pairs:
            return
        blocks = torch.tensor([b for b, _ in pairs], device=self.device)
        slots = torch.tensor([s for _, s in pairs])
        with self._side_stream():
            self.k_host[:, slots] = self.k[:, blocks].to("cpu", non_blocking=True)
            self.v_host[:, slots] = self.v[:, blocks].to("cpu", non_blocking=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots to device blocks: [(host slot, device block), ...]."""
        if not pairs:
            return
        slots = torch.tensor([s for s, _ in pairs])
        blocks = torch.tensor([b for _, b in pairs], device=self.device)
        with self._side_stream():
            self.k[:, blocks] = self.k_host[:, slots].to(self.device, non_blocking=True)
            self.v[:, blocks] = self.v_host[:, slots].to(self.device, non_blocking=True)

    def _side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return _StreamThenJoin(self._stream, self.device)


class _StreamThenJoin:
    """Run copies on the side stream; the compute stream waits for them before the forward."""

    def __init__(self, stream: torch.cuda.Stream, device: torch.device) -> None:
        self.stream = stream
        self.device = device
        self._ctx = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
