"""Attention backends behind one interface, chosen by `create_backend`.

CUDA libraries are imported inside the factory, only when that backend is chosen.
"""

from __future__ import annotations

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata


def create_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from worker.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(
            num_qo_heads, num_kv_heads, head_dim, page_size, dtype, device
        )
    if name == "torch":
        from worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(num_qo_heads, num_kv_heads, head_dim, device)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
