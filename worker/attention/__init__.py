"""Attention backends behind one interface, chosen by `create_backend`.

CUDA libraries are imported inside the factory, only when that backend is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from worker.kernel_choice import KernelChoice

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# The head dims FlashInfer's prefill and decode kernels are built for: its FA2 prefill does
# not check, and a head dim that is not a multiple of 64 reads out of bounds (an illegal
# memory access: flashinfer-ai/flashinfer#4299). The tiny hybrids' is 32.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def create_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype, device: torch.device,
                   kernel_choice: KernelChoice | None = None) -> AttentionBackend:
    """`kernel_choice`: which compiled CPU kernels the torch backend uses (the rank's,
    worker/kernel_choice.py); without one, the kernels unless DEEPINFER_KERNEL_CHOICE
    forces torch."""
    if name == "auto":
        # FlashInfer's kernels take 16-bit queries and KV only; float32 on CUDA (the
        # exactness checks against the CPU) runs the torch backend there, as does a head
        # dim FlashInfer has no kernel for.
        name = ("flashinfer" if device.type == "cuda" and dtype in FLASHINFER_DTYPES
                and head_dim in FLASHINFER_HEAD_DIMS else "torch")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"the flashinfer attention backend takes float16 or bfloat16, "
                             f"not {dtype}")
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"the flashinfer attention backend takes head dims "
                             f"{FLASHINFER_HEAD_DIMS}, not {head_dim}")
        from worker.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(
            num_qo_heads, num_kv_heads, head_dim, page_size, dtype, device
        )
    if name == "torch":
        from worker import cpu_kernels
        from worker.attention.torch_backend import TorchAttentionBackend
        from worker.kernel_choice import unmeasured

        kernels = cpu_kernels.load() if device.type == "cpu" else None
        choice = kernel_choice or unmeasured()
        return TorchAttentionBackend(num_qo_heads, num_kv_heads, head_dim, device, kernels,
                                     prefill_kernel=choice.uses("prefill"),
                                     decode_kernel=choice.uses("decode"))
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
