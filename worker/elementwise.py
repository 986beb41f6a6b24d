"""The elementwise passes of a decoder layer: one compiled pass each on CPU, plain torch
elsewhere (and the reference the kernels are tested against).

- `rms_norm(x, w)`: HF's RMSNorm (float32 math, rounded to the dtype before the weight).
- `add_rms_norm(h, delta, w)`: the residual stream `h += delta` in place, then its
  RMSNorm; a layer does this twice, and the sum never needs a tensor of its own.
- `silu_mul(gate_up)`: SiLU(gate) * up of the MLP's fused gate/up projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker import cpu_kernels
from worker.layers import rms_norm as torch_rms_norm

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Elementwise:
    def __init__(self, device: torch.device, dtype: torch.dtype, use_kernels: bool = True) -> None:
        """`use_kernels=False`: plain torch (where the rank's kernel choice found it faster,
        worker/kernel_choice.py)."""
        kernels = cpu_kernels.load() if device.type == "cpu" and use_kernels else None
        self.kernels = kernels if dtype in KERNEL_DTYPES else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self.kernels.rms_norm(x, weight, eps)
        return torch_rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if self.kernels is not None and residual.dim() == 2 and residual.is_contiguous():
            return self.kernels.add_rms_norm(residual, delta, weight, eps)
        residual.add_(delta)
        return torch_rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and gate_up.dim() == 2:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
