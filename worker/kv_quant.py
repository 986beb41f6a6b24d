"""FP8 KV (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`): how a token's K or V is stored in one
byte an element, and read back. This module is the reference: the compiled kernels
(worker/csrc/fp8.h) store and read the same bytes, bit for bit.

Each token's K (and V) vector of each KV head gets its own float32 scale,
`amax / FP8_MAX` (1 for a vector of zeros), and is stored as `x / scale` clamped to
+-FP8_MAX and rounded to nearest even in the FP8 format. A scale per token and head,
not per tensor or per block: a token's bytes depend on nothing but its own K and V, so a
decode that appends a token to a partly filled block writes what a prefill of the whole
prompt writes, and a prefix read back from any tier is the same bytes either way (the
warm path equals the cold path). The scales sit beside the blocks, indexed by the same
block ids (worker/kv_cache.py), so every tier copy moves them with their block.

Read back, a value is `fp8 * scale` in float32 (the FP8 value is exact in float32, so this
is one rounding), rounded to the model's dtype: attention then runs exactly as over KV of
that dtype holding those values.

Per element the cost is the byte and, per head of `head_dim` elements, 4 bytes of scale:
for head_dim 64, 68 bytes against 128 in bfloat16 (1.88x the tokens per byte), 132
against 256 for head_dim 128 (1.94x).
"""

from __future__ import annotations

import torch

# vLLM's names for the flag; `fp8` is E4M3 (3 mantissa bits, max 448); E5M2 trades a
# mantissa bit for range (max 57344).
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (its FP8 values [..., head_dim], the float32
    scales [...]), one scale per vector."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax == 0, 1.0, amax / FP8_MAX[dtype])
    limit = FP8_MAX[dtype]
    return (xf / scale[..., None]).clamp(-limit, limit).to(dtype), scale


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse, in `dtype`: x [..., head_dim] FP8, scale [...] float32."""
    return (x.float() * scale[..., None]).to(dtype)
