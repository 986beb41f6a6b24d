"""Attention backends behind one interface, chosen by `create_backend`.

CUDA libraries are imported inside the factory, only when that backend is chosen.
"""

from __future__ import annotations

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def create_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if name == "auto":
        # FlashInfer's kernels take 16-bit queries and KV only; float32 on CUDA (the
        # exactness checks against the CPU) runs the torch backend there.
        name = "flashinfer" if device.type == "cuda" and dtype in FLASHINFER_DTYPES else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"the flashinfer attention backend takes float16 or bfloat16, "
                             f"not {dtype}")
        from worker.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(
            num_qo_heads, num_kv_heads, head_dim, page_size, dtype, device
        )
    if name == "torch":
        from worker import cpu_kernels
        from worker.attention.torch_backend import TorchAttentionBackend

        kernels = cpu_kernels.load() if device.type == "cpu" else None
        return TorchAttentionBackend(num_qo_heads, num_kv_heads, head_dim, device, kernels)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
