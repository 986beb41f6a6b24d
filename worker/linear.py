"""The model's linear layers: torch's GEMM, or for a few rows on CPU a kernel that
streams the weights once.

A decode step multiplies one row per sequence, a speculative verify 1 + K rows; with
so few rows a linear layer is a read of its weights, and torch's CPU GEMM reads them
at a fraction of the memory's rate (worker/csrc/small_linear.cpp says how much). From
`SMALL_ROWS` rows up the GEMM's packing pays and torch is used: a prefill chunk, a
large decode batch. Both compute in float32 and round once, so the choice changes a
result by float32 rounding only (the reference tests hold at their tolerances). Which row
counts take the kernel on this machine is measured at the rank's start
(worker/kernel_choice.py: at 1, 4 and 16 rows, on the model's own weights).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from worker import cpu_kernels

SMALL_ROWS = 16  # up to here the kernel beat torch's GEMM on every layer shape measured
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    """y = x @ w.T (+ bias) for x [M, K] and a contiguous w [N, K]."""

    def __init__(self, device: torch.device,
                 kernel_rows: Iterable[int] = range(1, SMALL_ROWS + 1)) -> None:
        self.kernels = cpu_kernels.load() if device.type == "cpu" else None
        self.kernel_rows = frozenset(kernel_rows)  # the row counts the kernel takes

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if (self.kernels is not None and x.dim() == 2 and x.shape[0] in self.kernel_rows
                and w.dtype in KERNEL_DTYPES and x.dtype == w.dtype):
            y = self.kernels.small_linear(x, w)
            return y if bias is None else y + bias
        return F.linear(x, w, bias)
