"""A mixture-of-experts MLP block (Qwen3-MoE, Mixtral) behind a small interface.

`MoEWeights` holds one layer's router and this rank's slices of every expert;
`moe_forward(x, w)` returns this rank's partial output, which the caller all-reduces
as it does a dense MLP's (experts' gate/up are column-parallel, down row-parallel, so
that all-reduce stays the only collective). The router is replicated and routing is
computed from the same (all-reduced) hidden states on every rank, so every rank picks
the same experts for every token.

The CPU path groups the tokens by expert: one matmul per expert over the tokens routed
to it, outputs weighted and scatter-added back. A fused CUDA MoE kernel can replace
`moe_forward` behind the same signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from worker.model_config import ModelConfig


@dataclass
class MoEWeights:
    router: torch.Tensor  # [num_experts, hidden], replicated on every rank
    gate_up: torch.Tensor  # [num_experts, 2 * moe_intermediate on this rank, hidden]
    down: torch.Tensor  # [num_experts, hidden, moe_intermediate on this rank]
    top_k: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) HF tensor names of one expert, as the family's checkpoints name it."""
    if config.architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_name(config: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def fused_names(layer: int) -> tuple[str, str, str]:
    """(gate_up, down, router) of one layer in transformers 5's own layout, both families:
    every expert in one tensor, gate_up [num_experts, 2 * moe_intermediate, hidden] (gate
    rows, then up rows) and down [num_experts, hidden, moe_intermediate]. What it holds in
    memory, and saves with save_pretrained(save_original_format=False); by default it
    saves the per-expert names above."""
    p = f"model.layers.{layer}.mlp."
    return p + "experts.gate_up_proj", p + "experts.down_proj", p + "gate.weight"


def load_moe_weights(reader, config: ModelConfig, layer: int, rank: int, world_size: int,
                     stacked: bool = False) -> MoEWeights:
    """This rank's slices of every expert of one layer (only those are read: the reader's
    row / column slicing), and the whole router. `reader`: a CheckpointReader or
    GGUFCheckpointReader (worker/gguf.py). `stacked`: the checkpoint holds the experts in
    transformers 5's own layout (fused_names; only a CheckpointReader reads it)."""
    inter = config.moe_intermediate_size // world_size
    m0, m1 = rank * inter, (rank + 1) * inter
    if stacked:
        gate_up_name, down_name, router = fused_names(layer)
        full = config.moe_intermediate_size
        gate_up = reader.expert_rows(gate_up_name, [(m0, m1), (full + m0, full + m1)])
        down = reader.expert_cols(down_name, m0, m1)
    else:
        gate_ups, downs = [], []
        for e in range(config.num_experts):
            gate, up, dn = expert_names(config, layer, e)
            gate_ups.append(torch.cat([reader.rows(gate, m0, m1), reader.rows(up, m0, m1)]))
            downs.append(reader.cols(dn, m0, m1))
        gate_up, down = torch.stack(gate_ups), torch.stack(downs)
        router = router_name(config, layer)
    w = MoEWeights(router=reader.full(router), gate_up=gate_up, down=down,
                   top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob)
    if not w.num_experts == gate_up.shape[0] == config.num_experts:
        raise ValueError(f"layer {layer}: the checkpoint holds {w.num_experts} experts (its "
                         f"router's rows), config.json says {config.num_experts}")
    return w


def route(x: torch.Tensor, w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, hidden] -> (weights [T, top_k] in x's dtype, expert ids [T, top_k]).

    Softmax in float32 over all experts, then top-k, as HF does; with norm_topk_prob the
    chosen k are renormalised (for Mixtral that is the softmax over the selected logits).
    """
    probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, w.top_k, dim=-1)  # [T, k]
    if w.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def moe_forward(x: torch.Tensor, w: MoEWeights,
                linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
                ) -> torch.Tensor:
    """[T, hidden] -> this rank's partial MoE output [T, hidden] (all-reduce it).
    `linear` computes the expert matmuls (the model's: at decode each expert sees a few
    rows, where the few-row CPU kernel reads its weights once)."""
    with record_function("moe_routing"):
        weights, experts = route(x, w)
        k = w.top_k
        flat = experts.flatten()  # [T * k]: (token, slot) pairs, token-major
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        tokens = order // k  # [T * k]: the token of each grouped pair
        pair_weights = weights.flatten()[order][:, None]  # [T * k, 1]
        counts = torch.bincount(flat, minlength=w.num_experts).tolist()
    out = torch.zeros_like(x)
    with record_function("moe_experts"):
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start : start + n]
            gate, up = linear(x[idx], w.gate_up[e]).chunk(2, dim=-1)  # [n, inter] each
            y = linear(F.silu(gate) * up, w.down[e])  # [n, hidden]
            out.index_add_(0, idx, y * pair_weights[start : start + n])
            start += n
    return out


@dataclass
class SharedExpert:
    """Qwen3-Next's and Qwen3.5-MoE's shared expert: a dense MLP every token goes through,
    scaled per token by sigmoid(gate . x). Split as a dense MLP (gate/up by rows, down by
    columns), the gate replicated: each rank's scaled partial output sums to the whole in
    the MoE layer's all-reduce."""

    gate_up: torch.Tensor  # [2 * shared intermediate on this rank, hidden]
    down: torch.Tensor  # [hidden, shared intermediate on this rank]
    gate: torch.Tensor  # [1, hidden]

    @classmethod
    def load(cls, reader, prefix: str, size: int, rank: int, world_size: int) -> SharedExpert:
        """`prefix`: the layer's "model.layers.{i}.mlp."; `size`: the expert's width."""
        inter = size // world_size
        m0, m1 = rank * inter, (rank + 1) * inter
        p = prefix + "shared_expert."
        return cls(gate_up=torch.cat([reader.rows(p + "gate_proj.weight", m0, m1),
                                      reader.rows(p + "up_proj.weight", m0, m1)]),
                   down=reader.cols(p + "down_proj.weight", m0, m1),
                   gate=reader.full(prefix + "shared_expert_gate.weight"))

    def forward(self, x: torch.Tensor, linear: Callable = F.linear,
                silu_mul: Callable | None = None) -> torch.Tensor:
        """[T, hidden] -> this rank's partial output [T, hidden]."""
        gate_up = linear(x, self.gate_up)
        if silu_mul is None:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = silu_mul(gate_up)
        return torch.sigmoid(F.linear(x, self.gate)) * linear(hidden, self.down)
