"""A hybrid decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet layers
(worker/linear_attention.py) beside gated full-attention layers over the paged KV cache.

The KV cache holds only the attention layers (`kv_index` maps a layer to its place
there); the linear layers keep their state in a `LinearStateCache`, in the slots each
chunk's `StateBatch` names. What is the same as in a Llama layer is LlamaModel's:
embedding and LM head (vocab-parallel), the paged attention backend, the MLP and the
experts (worker/moe.py), the projections (`Linear`), the norms (`Elementwise`).
Different here:

- the norms are Gemma's, x * (1 + w): the 1 is added to the weights at load, so the
  plain RMSNorm kernels apply;
- q_proj yields each head's query and an output gate side by side; after attention the
  heads' output is multiplied by sigmoid(gate) before o_proj;
- rotary turns only the first `rotary_dim` dims of each head (`partial_rotary_factor`);
- an MoE layer may have a shared expert scaled by sigmoid(shared_expert_gate(x)).

Tensor parallel as LlamaModel: attention heads, MLP columns and experts split over ranks;
the linear layers' heads too (whole key-head groups).

On CUDA the attention layers run on the attention backend LlamaModel's do (FlashInfer in
16 bits, worker/attention/), through the same interface and paged KV metadata, and the
linear layers' conv and delta rule on the kernels `delta_ops` picks for the device and
dtype (worker/delta_kernels.py: fla and causal_conv1d where they import, else torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wire.config import EngineConfig
from worker.attention import AttentionBackend
from worker.delta_kernels import delta_ops
from worker.distributed import TensorParallelGroup
from worker.gguf import is_gguf_path
from worker.kv_cache import KVCache
from worker.layers import Rotary, rms_norm
from worker.linear_attention import (
    DeltaNetShape,
    DeltaNetWeights,
    delta_net_forward,
    load_delta_net,
)
from worker.linear_state import LinearStateCache, StateBatch
from worker.model import LlamaModel
from worker.model_config import ModelConfig, UnsupportedModelError
from worker.moe import MoEWeights, SharedExpert, fused_names, load_moe_weights, moe_forward
from worker.weights import CheckpointReader, TextModelReader


@dataclass
class HybridLayer:
    input_norm: torch.Tensor  # 1 + w
    post_norm: torch.Tensor
    delta_net: DeltaNetWeights | None = None  # a linear-attention layer
    qkv: torch.Tensor | None = None  # an attention layer: [q|gate per head, k, v] rows
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # dense MLP
    down: torch.Tensor | None = None
    moe: MoEWeights | None = None
    shared: SharedExpert | None = None


def state_bytes_per_slot(config: ModelConfig, world_size: int, dtype: torch.dtype) -> int:
    """The bytes of one state slot on a rank: every linear layer's conv window (in `dtype`)
    and recurrent matrices (float32) of the rank's heads (what its LinearStateCache
    holds, from the config alone: worker/budget.py sizes the tiers with it)."""
    s = DeltaNetShape.of(config, world_size)
    return LinearStateCache.bytes_per_slot(
        len(config.linear_layers), s.conv_dim, s.conv_width, s.num_v_heads, s.head_k_dim,
        s.head_v_dim, torch.empty((), dtype=dtype).element_size())


class HybridModel(LlamaModel):
    """Gated DeltaNet layers beside output-gated attention layers (Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next): the Llama model's parallel pieces (embedding, LM head, rotary, linear and
    elementwise ops), its own layers, load and forward."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
                 device: torch.device, logits_everywhere: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, tp, dtype, device, logits_everywhere, kv_dtype)
        self.rotary_dim = config.rotary_dim
        self.delta_shape = DeltaNetShape.of(config, tp.world_size)
        self.delta_ops = delta_ops(device, dtype)  # the linear layers' conv and delta rule
        # layer index -> its index in the KV cache (attention) or the state cache (linear)
        self.kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self.state_index = {layer: i for i, layer in enumerate(config.linear_layers)}
        self.layers: list[HybridLayer] = []  # type: ignore[assignment]

    # --- state -----------------------------------------------------------------

    def new_state_cache(self, num_slots: int, num_host_slots: int = 0) -> LinearStateCache:
        s = self.delta_shape
        return LinearStateCache(len(self.state_index), num_slots, s.conv_dim, s.conv_width,
                                s.num_v_heads, s.head_k_dim, s.head_v_dim, self.dtype,
                                self.device, num_host_slots)

    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.config, self.tp.world_size, self.dtype)

    # --- loading ---------------------------------------------------------------

    def load(self, model_dir: str, show_progress: bool = False) -> None:
        cfg = self.config
        if is_gguf_path(model_dir):
            raise NotImplementedError(f"{cfg.architecture} from a GGUF file is not supported")
        reader = TextModelReader(CheckpointReader(model_dir, self.dtype, show_progress))
        self._load_vocab_parallel(reader)
        self.norm = self._gemma_norm(reader, "model.norm.weight")
        self.layers = [self._load_layer(reader, i) for i in range(cfg.num_layers)]
        reader.close()

    def _load_layer(self, reader, i: int) -> HybridLayer:
        cfg, r, world, d = self.config, self.tp.rank, self.tp.world_size, self.head_dim
        p = f"model.layers.{i}."
        layer = HybridLayer(input_norm=self._gemma_norm(reader, p + "input_layernorm.weight"),
                            post_norm=self._gemma_norm(reader, p + "post_attention_layernorm"
                                                       ".weight"))
        if i in self.state_index:
            w = load_delta_net(reader, p + "linear_attn.", cfg, r, world)
            layer.delta_net = DeltaNetWeights(*(self._dev(t) for t in (
                w.in_proj, w.conv, w.neg_a, w.dt_bias, w.norm, w.out)))
        else:
            attn = p + "self_attn."
            q0, q1 = r * self.num_heads * 2 * d, (r + 1) * self.num_heads * 2 * d
            k0, k1 = r * self.num_kv_heads * d, (r + 1) * self.num_kv_heads * d
            layer.qkv = self._dev(torch.cat([reader.rows(attn + "q_proj.weight", q0, q1),
                                             reader.rows(attn + "k_proj.weight", k0, k1),
                                             reader.rows(attn + "v_proj.weight", k0, k1)]))
            layer.q_norm = self._gemma_norm(reader, attn + "q_norm.weight")
            layer.k_norm = self._gemma_norm(reader, attn + "k_norm.weight")
            layer.o = self._dev(reader.cols(attn + "o_proj.weight", r * self.num_heads * d,
                                            (r + 1) * self.num_heads * d))
        mlp = p + "mlp."
        if i in cfg.moe_layers:
            moe = load_moe_weights(reader, cfg, i, r, world, stacked=fused_names(i)[0] in reader)
            moe.router, moe.gate_up, moe.down = map(self._dev, (moe.router, moe.gate_up,
                                                                  moe.down))
            layer.moe = moe
            if cfg.shared_expert_intermediate_size:
                shared = SharedExpert.load(reader, mlp, cfg.shared_expert_intermediate_size,
                                           r, world)
                layer.shared = SharedExpert(*(self._dev(t) for t in (
                    shared.gate_up, shared.down, shared.gate)))
        else:
            inter = cfg.intermediate_size // world
            m0, m1 = r * inter, (r + 1) * inter
            layer.gate_up = self._dev(torch.cat([reader.rows(mlp + "gate_proj.weight", m0, m1),
                                                 reader.rows(mlp + "up_proj.weight", m0, m1)]))
            layer.down = self._dev(reader.cols(mlp + "down_proj.weight", m0, m1))
        return layer

    def _gemma_norm(self, reader, name: str) -> torch.Tensor:
        """A Gemma-style RMSNorm weight w as 1 + w (added in float32), for rms_norm."""
        return self._dev((reader.full(name).float() + 1.0).to(self.dtype))

    # --- forward ---------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv: KVCache, attn: AttentionBackend, seq_lens: torch.Tensor | None = None,
                state: LinearStateCache | None = None,
                state_batch: StateBatch | None = None) -> torch.Tensor:
        """LlamaModel.forward's, and the linear layers' state: `state_batch` names each
        chunk's slot in `state`, which the forward reads and leaves the new state in
        (with the chunks' snapshots). Returns the final hidden states [T, hidden]."""
        assert state is not None and state_batch is not None, "a hybrid model needs its state"
        cos, sin = self.rotary.cos_sin(positions, self.dtype, seq_lens)
        ops, eps = self.elementwise, self.config.rms_norm_eps
        h = self.embed(input_ids)  # [T, hidden]: the residual stream
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            if layer.delta_net is not None:
                j = self.state_index[i]
                mixed = delta_net_forward(layer.delta_net, self.delta_shape, x, state.conv[j],
                                          state.recurrent[j], state_batch, self.linear, eps,
                                          self.delta_ops)
                mixed = self.tp.all_reduce(mixed)
            else:
                mixed = self._attention(self.kv_index[i], layer, x, cos, sin, slots, kv, attn)
            x = ops.add_rms_norm(h, mixed, layer.post_norm, eps)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, self._mlp(layer, x), after, eps)
        return x

    def _attention(self, i: int, w: HybridLayer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, kv: KVCache,
                   attn: AttentionBackend) -> torch.Tensor:
        """Gated attention; `i` the layer's index in the KV cache."""
        t, d, eps = x.shape[0], self.head_dim, self.config.rms_norm_eps
        qg, k, v = self.linear(x, w.qkv).split(
            [self.num_heads * 2 * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = qg.reshape(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self._rotate(rms_norm(q, w.q_norm, eps), cos, sin)  # [T, H, D]
        k = self._rotate(rms_norm(k.reshape(t, self.num_kv_heads, d), w.k_norm, eps), cos, sin)
        kv.wait_layer(i)
        kv.write(i, k, v.reshape(t, self.num_kv_heads, d).contiguous(), slots)
        o = attn.forward(q.contiguous(), kv.k[i], kv.v[i], *kv.scales(i))  # [T, H, D]
        o = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.tp.all_reduce(self.linear(o, w.o))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary over the first rotary_dim dims of each head; the rest pass. x [T, H, D]."""
        rd = self.rotary_dim
        if rd == x.shape[-1]:
            return Rotary.apply(x, cos, sin)
        return torch.cat([Rotary.apply(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def _mlp(self, w: HybridLayer, x: torch.Tensor) -> torch.Tensor:
        if w.moe is not None:
            out = moe_forward(x, w.moe, self.linear)
            if w.shared is not None:
                out += w.shared.forward(x, self.linear, self.elementwise.silu_mul)
            return self.tp.all_reduce(out)
        hidden = self.elementwise.silu_mul(self.linear(x, w.gate_up))
        return self.tp.all_reduce(self.linear(hidden, w.down))


def check_hybrid(config: EngineConfig, architecture: str) -> None:
    """Refuse what a hybrid model cannot serve yet, at the rank's start."""
    if config.speculative is not None:
        raise UnsupportedModelError(
            f"--speculative-config is not supported with {architecture}, a hybrid model: a "
            f"rejected draft would need its linear-attention state rolled back")
