"""A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) over a step's batch: its weights, this
rank's slices of them, and its forward.

Tensor parallel: the layer's heads split across ranks, each rank taking whole key-head
groups (a key head and the value heads that read it), so the conv channels, the delta
rule and the gated norm of a head never leave its rank; the output projection is
row-parallel (its columns are the value heads), all-reduced by the caller as an
attention layer's is. Qwen3.5 stores q/k/v, z, b and a as separate projections (each
rank takes its rows of each section); Qwen3-Next interleaves them per key-head group
(`in_proj_qkvz`, `in_proj_ba`: each rank takes its groups' rows), and the loader puts
them in Qwen3.5's order, so one forward serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.delta_kernels import DeltaOps
from worker.gated_delta import window_after
from worker.linear import Linear
from worker.linear_state import StateBatch
from worker.model_config import ModelConfig


@dataclass(frozen=True)
class DeltaNetShape:
    """One rank's share of a Gated DeltaNet layer."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int

    @classmethod
    def of(cls, config: ModelConfig, world_size: int) -> DeltaNetShape:
        return cls(config.linear_num_key_heads // world_size,
                   config.linear_num_value_heads // world_size, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the conv's channels: q, k and v
        return 2 * self.key_dim + self.value_dim


@dataclass
class DeltaNetWeights:
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2 * v_heads, hidden]: q k v | z | b | a
    conv: torch.Tensor  # [conv_dim, K]
    neg_a: torch.Tensor  # [v_heads] float32: -exp(A_log), the decay rate
    dt_bias: torch.Tensor  # [v_heads] float32
    norm: torch.Tensor  # [head_v_dim]: the gated RMSNorm's weight (plain, not 1 + w)
    out: torch.Tensor  # [hidden, value_dim]


def load_delta_net(reader, prefix: str, config: ModelConfig, rank: int,
                   world_size: int) -> DeltaNetWeights:
    """This rank's slices of one layer (`prefix`: "model.layers.{i}.linear_attn.")."""
    s = DeltaNetShape.of(config, world_size)
    kd, vd = s.key_dim, s.value_dim
    k0, v0, h0 = rank * kd, rank * vd, rank * s.num_v_heads
    full_kd = config.linear_num_key_heads * s.head_k_dim
    if prefix + "in_proj_qkv.weight" in reader:  # Qwen3.5: a section each
        qkv = prefix + "in_proj_qkv.weight"
        q = reader.rows(qkv, k0, k0 + kd)
        k = reader.rows(qkv, full_kd + k0, full_kd + k0 + kd)
        v = reader.rows(qkv, 2 * full_kd + v0, 2 * full_kd + v0 + vd)
        z = reader.rows(prefix + "in_proj_z.weight", v0, v0 + vd)
        b = reader.rows(prefix + "in_proj_b.weight", h0, h0 + s.num_v_heads)
        a = reader.rows(prefix + "in_proj_a.weight", h0, h0 + s.num_v_heads)
    else:  # Qwen3-Next: per key-head group, [q k v z] and [b a]
        q, k, v, z, b, a = _split_grouped(reader, prefix, s, rank)
    conv = prefix + "conv1d.weight"  # [conv channels, 1, K], channels q | k | v
    conv_w = torch.cat([reader.rows(conv, k0, k0 + kd),
                        reader.rows(conv, full_kd + k0, full_kd + k0 + kd),
                        reader.rows(conv, 2 * full_kd + v0, 2 * full_kd + v0 + vd)])
    return DeltaNetWeights(
        in_proj=torch.cat([q, k, v, z, b, a]),
        conv=conv_w[:, 0, :],
        neg_a=-reader.rows(prefix + "A_log", h0, h0 + s.num_v_heads).float().exp(),
        dt_bias=reader.rows(prefix + "dt_bias", h0, h0 + s.num_v_heads).float(),
        norm=reader.full(prefix + "norm.weight"),
        out=reader.cols(prefix + "out_proj.weight", v0, v0 + vd),
    )


def _split_grouped(reader, prefix: str, s: DeltaNetShape, rank: int) -> list[torch.Tensor]:
    """Qwen3-Next's interleaved projections, this rank's key-head groups, in sections."""
    group = s.num_v_heads // s.num_k_heads  # value heads per key head
    per = 2 * s.head_k_dim + 2 * group * s.head_v_dim
    g0 = rank * s.num_k_heads
    qkvz = reader.rows(prefix + "in_proj_qkvz.weight", g0 * per, (g0 + s.num_k_heads) * per)
    ba = reader.rows(prefix + "in_proj_ba.weight", g0 * 2 * group,
                     (g0 + s.num_k_heads) * 2 * group)
    hidden = qkvz.shape[-1]
    parts = qkvz.view(s.num_k_heads, per, hidden).split(
        [s.head_k_dim, s.head_k_dim, group * s.head_v_dim, group * s.head_v_dim], dim=1)
    b, a = ba.view(s.num_k_heads, 2 * group, hidden).split([group, group], dim=1)
    return [p.reshape(-1, hidden) for p in (*parts, b, a)]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm of each head's output (float32 math, rounded before the weight), times
    SiLU of its gate z. x, gate [T, H, Dv]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def delta_net_forward(w: DeltaNetWeights, s: DeltaNetShape, x: torch.Tensor,
                      conv_state: torch.Tensor, recurrent: torch.Tensor, batch: StateBatch,
                      linear: Linear, eps: float, ops: DeltaOps) -> torch.Tensor:
    """x [T, hidden] -> this rank's partial output [T, hidden] (all-reduce it). Reads each
    chunk's state from its slot (zero when it starts fresh) and leaves the new one there;
    snapshots go to their slots as the chunk passes them. conv_state [S, C, K-1] and
    recurrent [S, Hv, Dk, Dv]: this layer's slots. `ops`: the conv and the delta rule
    for the model's device (worker/delta_kernels.py)."""
    t = x.shape[0]
    mixed, z, b, a = linear(x, w.in_proj).split(
        [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1)
    beta = b.float().sigmoid()  # [T, Hv]
    g = w.neg_a * F.softplus(a.float() + w.dt_bias)  # [T, Hv]: log decay, <= 0
    core = torch.empty(t, s.num_v_heads, s.head_v_dim, dtype=torch.float32, device=x.device)
    if batch.steps:
        rows, slots, fresh = batch.step_tensors(x.device)
        windows = conv_state[slots].masked_fill(fresh[:, None, None], 0)
        conv_out, conv_state[slots] = ops.conv_step(mixed[rows], windows, w.conv)
        q, k, v = _qkv(conv_out, s)
        state = recurrent[slots].masked_fill(fresh[:, None, None, None], 0)
        core[rows], recurrent[slots] = ops.step(q, k, v, g[rows], beta[rows], state)
    for i in batch.prefills:
        r0, n, slot = batch.first_rows[i], batch.num_tokens[i], batch.slots[i]
        window = conv_state[slot]
        if batch.fresh[i]:
            window = torch.zeros_like(window)
        conv_out, padded = ops.conv(mixed[r0 : r0 + n], window, w.conv)
        q, k, v = _qkv(conv_out, s)
        state = recurrent[slot] if not batch.fresh[i] else torch.zeros_like(recurrent[slot])
        done, snaps = 0, batch.snapshots[i]
        for end in sorted({m for m, _ in snaps} | {n}):  # in pieces, split at the snapshots
            if end > done:
                core[r0 + done : r0 + end], state = ops.chunk(
                    q[done:end], k[done:end], v[done:end], g[r0 + done : r0 + end],
                    beta[r0 + done : r0 + end], state)
                done = end
            for _, dst in (snap for snap in snaps if snap[0] == end):
                conv_state[dst] = window_after(padded, end, s.conv_width)
                recurrent[dst] = state
        conv_state[slot] = window_after(padded, n, s.conv_width)
        recurrent[slot] = state
    y = gated_rms_norm(core.to(x.dtype), z.view(t, s.num_v_heads, s.head_v_dim), w.norm, eps)
    return linear(y.reshape(t, s.value_dim), w.out)


def _qkv(conv_out: torch.Tensor, s: DeltaNetShape) -> tuple[torch.Tensor, ...]:
    """The conv's output [N, C] -> q, k [N, Hk, Dk] and v [N, Hv, Dv] (the delta rule
    normalises q and k, DeltaOps.chunk and .step)."""
    n = conv_out.shape[0]
    q, k, v = conv_out.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    return (q.reshape(n, s.num_k_heads, s.head_k_dim), k.reshape(n, s.num_k_heads, s.head_k_dim),
            v.reshape(n, s.num_v_heads, s.head_v_dim))
