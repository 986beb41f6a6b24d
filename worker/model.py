"""A tensor-parallel Llama-family decoder over the paged KV cache.

Split (Megatron style): QKV and gate/up are column-parallel (each rank computes
its heads and its MLP columns), O and down are row-parallel and all-reduced.
Embedding and LM head are vocab-parallel. Each rank reads only its slices.
A mixture-of-experts layer (Qwen3-MoE, Mixtral) splits each expert the same way as the
dense MLP (worker/moe.py), so its all-reduce is the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention import AttentionBackend
from worker.distributed import TensorParallelGroup
from worker.elementwise import Elementwise
from worker.gguf import open_checkpoint
from worker.kernel_choice import KernelChoice, ModelShapes, choose
from worker.kernel_measure import measure_model
from worker.kv_cache import KVCache
from worker.layers import ParallelLMHead, Rotary, VocabParallelEmbedding, rms_norm
from worker.linear import SMALL_ROWS, Linear
from worker.model_config import ModelConfig
from worker.moe import MoEWeights, fused_names, load_moe_weights, moe_forward
from worker.weights import CheckpointReader


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(q_heads + 2 * kv_heads) * head_dim on this rank, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [hidden, q_heads * head_dim on this rank]
    o_bias: torch.Tensor | None  # added after the all-reduce, so once
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate on this rank, hidden]; None: MoE
    down: torch.Tensor | None  # [hidden, intermediate on this rank]
    moe: MoEWeights | None = None  # the layer's experts, in place of gate_up / down


class LlamaModel:
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
                 device: torch.device, logits_everywhere: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: what the KV cache stores (None: `dtype`), which the attention kernels'
        choice is measured with."""
        config.check_tensor_parallel(tp.world_size)
        self.config = config
        self.tp = tp
        self.logits_everywhere = logits_everywhere  # full logits on every rank, not rank 0
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = device
        self.num_heads = config.num_heads // tp.world_size
        self.num_kv_heads = config.num_kv_heads // tp.world_size
        self.head_dim = config.head_dim
        inv_freq, scaling = config.rope()
        self.rotary = Rotary(inv_freq, device, scaling, config.dynamic_rope)
        self.linear = Linear(device)  # the few-row CPU kernel where it pays, else torch
        self.elementwise = Elementwise(device, dtype)  # fused norms and SiLU on CPU
        # which of those compiled CPU kernels (and the attention's) beat torch here: once
        # the weights are loaded (worker/kernel_choice.py)
        self.kernel_choice: KernelChoice | None = None
        self.layers: list[LayerWeights] = []

    # --- loading ---------------------------------------------------------------

    def load(self, model_dir: str, show_progress: bool = False) -> None:
        cfg = self.config
        reader = open_checkpoint(model_dir, self.dtype, show_progress)  # HF dir or .gguf
        self._load_vocab_parallel(reader)
        self.norm = self._dev(reader.full("model.norm.weight"))
        self.layers = [self._load_layer(reader, i) for i in range(cfg.num_layers)]
        reader.close()
        if self.device.type == "cpu":
            self._choose_kernels()

    def _load_vocab_parallel(self, reader: CheckpointReader) -> None:
        """This rank's rows of the embedding and the LM head (the embedding's, tied)."""
        cfg, r = self.config, self.tp.rank
        vocab_rows = -(-cfg.vocab_size // self.tp.world_size)  # ceil: last shard may be short
        v0, v1 = r * vocab_rows, min((r + 1) * vocab_rows, cfg.vocab_size)
        embed = reader.rows("model.embed_tokens.weight", v0, v1)
        self.embed = VocabParallelEmbedding(self._dev(embed), v0, cfg.vocab_size, self.tp)
        head = embed if cfg.tie_word_embeddings else reader.rows("lm_head.weight", v0, v1)
        self.lm_head = ParallelLMHead(self._dev(head), vocab_rows, cfg.vocab_size, self.tp,
                                      self.linear, self.logits_everywhere)

    def _choose_kernels(self) -> None:
        """Each compiled kernel only where it beats torch on this machine, at this rank's
        thread count: decided by the instruction set or measured on the model's shapes
        (read from the cache beside the kernel build after the first start)."""
        layers = [[w for w in (layer.qkv, layer.o, layer.gate_up, layer.down) if w is not None]
                  for layer in self.layers]
        intermediate = next((w.down.shape[1] for w in self.layers if w.down is not None), 0)
        shapes = ModelShapes(self.dtype, self.num_heads, self.num_kv_heads, self.head_dim,
                             self.config.hidden_size, intermediate,
                             tuple((w.shape[0], w.shape[1]) for w in layers[0]), self.kv_dtype)
        self.kernel_choice = choose(shapes, measure_model(shapes, layers, self._eps))
        self.linear.kernel_rows = self.kernel_choice.linear_rows(SMALL_ROWS)
        if not self.kernel_choice.uses("elementwise"):
            self.elementwise = Elementwise(self.device, self.dtype, use_kernels=False)

    def _load_layer(self, reader: CheckpointReader, i: int) -> LayerWeights:
        cfg, r, d = self.config, self.tp.rank, self.head_dim
        p = f"model.layers.{i}."
        q0, q1 = r * self.num_heads * d, (r + 1) * self.num_heads * d
        k0, k1 = r * self.num_kv_heads * d, (r + 1) * self.num_kv_heads * d
        inter = cfg.intermediate_size // self.tp.world_size
        m0, m1 = r * inter, (r + 1) * inter
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = torch.cat([
            reader.rows(attn + "q_proj.weight", q0, q1),
            reader.rows(attn + "k_proj.weight", k0, k1),
            reader.rows(attn + "v_proj.weight", k0, k1),
        ])
        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = torch.cat([
                reader.rows(attn + "q_proj.bias", q0, q1),
                reader.rows(attn + "k_proj.bias", k0, k1),
                reader.rows(attn + "v_proj.bias", k0, k1),
            ])
        moe, gate_up, down = None, None, None
        if i in cfg.moe_layers:
            moe = load_moe_weights(reader, cfg, i, r, self.tp.world_size,
                                   stacked=fused_names(i)[0] in reader)
            moe.router, moe.gate_up, moe.down = map(self._dev, (moe.router, moe.gate_up,
                                                                  moe.down))
        else:
            gate_up = torch.cat([
                reader.rows(mlp + "gate_proj.weight", m0, m1),
                reader.rows(mlp + "up_proj.weight", m0, m1),
            ])
            down = reader.cols(mlp + "down_proj.weight", m0, m1)
        return LayerWeights(
            input_norm=self._dev(reader.full(p + "input_layernorm.weight")),
            qkv=self._dev(qkv),
            qkv_bias=self._dev(qkv_bias),
            q_norm=self._dev(reader.full(attn + "q_norm.weight")) if cfg.qk_norm else None,
            k_norm=self._dev(reader.full(attn + "k_norm.weight")) if cfg.qk_norm else None,
            o=self._dev(reader.cols(attn + "o_proj.weight", q0, q1)),
            o_bias=self._dev(reader.full(attn + "o_proj.bias")) if cfg.o_bias else None,
            post_norm=self._dev(reader.full(p + "post_attention_layernorm.weight")),
            gate_up=self._dev(gate_up),
            down=self._dev(down),
            moe=moe,
        )

    def _dev(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device).contiguous()

    # --- forward ---------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv: KVCache, attn: AttentionBackend,
                seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions, slots: [T]. Returns final hidden states [T, hidden].

        `attn.plan(...)` has been called for this step; each layer writes its new
        K/V into the pages first, then attends over the full context. seq_lens [T]: each
        token's sequence length at the end of its chunk (dynamic NTK rope needs it).
        """
        cos, sin = self.rotary.cos_sin(positions, self.dtype, seq_lens)
        ops, eps = self.elementwise, self._eps
        h = self.embed(input_ids)  # [T, hidden]: the residual stream, summed into in place
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            attended = self._attention(i, layer, x, cos, sin, slots, kv, attn)
            x = ops.add_rms_norm(h, attended, layer.post_norm, eps)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, self._mlp(layer, x), after, eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[B, hidden] -> [B, vocab] float32 on rank 0 (on every rank with
        `logits_everywhere`); None on the others."""
        out = self.lm_head(hidden)
        return None if out is None else out.float()

    @property
    def _eps(self) -> float:
        return self.config.rms_norm_eps

    def _attention(self, i: int, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, kv: KVCache,
                   attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.linear(x, w.qkv, w.qkv_bias)
        kv.wait_layer(i)  # this layer's tier copies (CUDA side stream) are done
        if w.q_norm is None and self.elementwise.kernels is not None:
            # CPU: the rotary of q and k and the K/V stores in one compiled pass (about ten
            # torch dispatches a layer otherwise, a tenth of a small model's decode step)
            q = self.elementwise.kernels.rope_store_kv(qkv, cos, sin, kv.k[i], kv.v[i], slots,
                                                      self.num_heads, *kv.scales(i))
        else:
            q = self._rope_and_store(i, w, qkv, cos, sin, slots, kv)
        # [T, heads on this rank, head_dim]
        o = attn.forward(q, kv.k[i], kv.v[i], *kv.scales(i))
        out = self.tp.all_reduce(self.linear(o.reshape(t, -1), w.o))
        return out if w.o_bias is None else out + w.o_bias

    def _rope_and_store(self, i: int, w: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, slots: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """The rotary of q and k in torch, k and v written to their slots; returns q."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        v = v.view(t, self.num_kv_heads, d)
        if w.q_norm is not None:  # Qwen3: RMSNorm over each head before rotary
            q = Rotary.apply(rms_norm(q.view(t, self.num_heads, d), w.q_norm, self._eps),
                             cos, sin)
            k = Rotary.apply(rms_norm(k.view(t, self.num_kv_heads, d), w.k_norm, self._eps),
                             cos, sin)
        else:  # q and k heads side by side in qkv: one rotary over both
            heads = self.num_heads + self.num_kv_heads
            qk = Rotary.apply(qkv[:, : heads * d].view(t, heads, d), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H | Hkv, D]
        kv.write(i, k, v, slots)
        return q

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if w.moe is not None:
            return self.tp.all_reduce(moe_forward(x, w.moe, self.linear))
        hidden = self.elementwise.silu_mul(self.linear(x, w.gate_up))
        return self.tp.all_reduce(self.linear(hidden, w.down))
