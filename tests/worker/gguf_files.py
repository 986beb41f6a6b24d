"""Test helpers: write a GGUF from an HF safetensors checkpoint, as llama.cpp's converter
does, and run the engine's ModelRunner in this process (world size 1, greedy).

The writer is the test's own (not the reader's code run backwards): HF names to GGUF
names, Q/K rows permuted for llama.cpp's rotary, 1-D tensors kept F32, matrices in
the requested type; hyperparameters and the tokenizer as llama.cpp's keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.conftest import fitting_max_model_len
from tests.orchestrator.gguf_vocab import add_tokenizer
from wire.config import EngineConfig
from wire.step import NewSequence, ScheduledChunk, StepPlan
from worker.distributed import TensorParallelGroup
from worker.model_runner import ModelRunner

Q = gguf.GGMLQuantizationType
LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
# An expert's matrix -> the stacked tensor llama.cpp's converter puts it in.
EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama",
             "Qwen3MoeForCausalLM": "qwen3moe"}


def to_gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_PARTS[rest]}"


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF's per-expert matrices -> GGUF-named tensors, each layer's experts stacked
    [num_experts, rows, cols] in expert order; every other tensor by its GGUF name."""
    out, experts = {}, {}
    for name, a in weights.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.<block>.experts.E.<kind>.weight
            layer, e, kind = parts[2], int(parts[5]), parts[6]
            experts.setdefault(f"blk.{layer}.{EXPERT_PARTS[kind]}.weight", {})[e] = a
        else:
            out[to_gguf_name(name)] = a
    for gname, by_index in experts.items():
        out[gname] = np.stack([by_index[e] for e in sorted(by_index)])
    return out


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotary halves -> llama.cpp's interleaved pairs, per head (what its converter does)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, qtype: Q = Q.F32, arch: str | None = None,
               tokenizer: bool = True) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    arch = arch or GGUF_ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":  # llama.cpp's keys for a yarn rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if tokenizer:
        add_tokenizer(w, model_dir)
    else:
        w.add_eos_token_id(cfg["eos_token_id"])
    arrays = {}
    for name in sorted(weights):
        a = weights[name].float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):  # qwen3moe: no permutation
            a = permute_for_llama_cpp(a, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute_for_llama_cpp(a, cfg["num_key_value_heads"])
        arrays[name] = a
    for gname, a in sorted(stack_experts(arrays).items()):
        if a.ndim == 1 or qtype == Q.F32 or "ffn_gate_inp" in gname:  # norms, router: F32
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_dir(gguf_path: Path, model_dir: Path, out: Path) -> Path:
    """A safetensors dir holding what the gguf package itself dequantizes from the file,
    rows un-permuted by the test's own inverse: the reference for a quantized GGUF."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    reader = gguf.GGUFReader(str(gguf_path))
    by_gguf = {to_gguf_name(n): n for n in load_file(str(model_dir / "model.safetensors"))}
    tensors = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        kind = t.name.split(".")[-2]  # blk.N.attn_q.weight -> attn_q
        if kind in heads:  # inverse of permute_for_llama_cpp: the same view, other order
            h = heads[kind]
            d = a.shape[0] // h
            a = a.reshape(h, d // 2, 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        tensors[by_gguf[t.name]] = torch.from_numpy(np.ascontiguousarray(a))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    return out


def run_engine(model: str | Path, prompt: list[int], new_tokens: int,
               dtype: str = "float32") -> tuple[torch.Tensor, list[int]]:
    """(prompt logits [len(prompt), vocab], greedy tokens) through ModelRunner.execute."""
    config = EngineConfig(model=str(model), dtype=dtype, kv_cache_memory=64 << 20,
                          max_model_len=fitting_max_model_len(model, 64 << 20))
    runner = ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"))
    blocks = -(-(len(prompt) + new_tokens) // config.block_size)
    runner.execute(StepPlan(step=0, new_seqs=[NewSequence(1, list(range(blocks)))]))
    out = runner.execute(StepPlan(step=1, chunks=[ScheduledChunk(1, prompt, 0, True)]),
                         return_logits=True)
    logits, tokens = out.logits, [out.sampled[0][1]]
    while len(tokens) < new_tokens:
        pos = len(prompt) + len(tokens) - 1
        out = runner.execute(StepPlan(step=1 + len(tokens),
                                      chunks=[ScheduledChunk(1, [tokens[-1]], pos, True)]))
        tokens.append(out.sampled[0][1])
    return logits, tokens
