"""Serve a Llama-family GGUF file: its hyperparameters and its weights, dequantized per rank.

A GGUF (llama.cpp's format) holds the architecture as metadata and the weights in
llama.cpp's names and quantized block formats. This module turns both into what the
engine already uses: a `ModelConfig` equal to the one a Hugging Face `config.json` of the
same model gives, and a reader with `CheckpointReader`'s interface (full / rows / cols,
in HF tensor names). Reading and dequantizing is done by the `gguf` package, llama.cpp's
own Python reader.

Two facts about the format drive the code:
- A quantized 2-D tensor is stored row by row, each row a run of independent blocks, so
  a rank's rows are a slice of the raw bytes and only those are dequantized; a column
  range is a byte range of each row too (of the blocks that cover it).
- llama.cpp's converter reorders the rows of Q and K inside each head (its rotary pairs
  adjacent elements, HF's pairs element i with i + head_dim/2); the reader puts them back.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from worker.model_config import ModelConfig, UnsupportedModelError, load_model_config
from worker.weights import CheckpointReader

GGUF_MAGIC = b"GGUF"
Q = gguf.GGMLQuantizationType
# What the `gguf` package dequantizes and we have checked against it; IQ*/TQ*/MXFP4 are
# refused rather than served untested.
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})
# GGUF `general.architecture` -> (HF architecture, Q/K rows permuted by the converter).
# llama.cpp writes Mixtral as "llama" with experts (then: MixtralForCausalLM).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen3moe": ("Qwen3MoeForCausalLM", False)}
_DTYPE_OF_TYPE = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}

# HF tensor name (as the model loader asks) -> GGUF tensor name.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",  # the router (Qwen3-MoE)
    "block_sparse_moe.gate": "ffn_gate_inp",  # the router (Mixtral)
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# One expert's matrix, HF name -> its expert index in the stacked GGUF tensor.
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def gguf_location(hf_name: str) -> tuple[str, int | None] | None:
    """(GGUF name, expert index or None) of an HF tensor name; None when GGUF has no such
    tensor. llama.cpp stacks a layer's experts into one 3-D tensor per matrix."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name], None
    m = _EXPERT_RE.fullmatch(hf_name)
    if m is not None:
        return f"blk.{m.group(1)}.{_EXPERT_NAMES[m.group(3)]}.weight", int(m.group(2))
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}", None


def gguf_name(hf_name: str) -> str | None:
    """The GGUF name of an HF tensor name, or None when GGUF has no such tensor."""
    loc = gguf_location(hf_name)
    return None if loc is None else loc[0]


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


# --- the file and its metadata ---------------------------------------------------------


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader, after checking that the file exists and is a GGUF at all."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a .gguf file or an HF dir")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UnsupportedModelError(f"{path} is not a GGUF file (it starts {magic!r}, not b'GGUF')")
    stat = path.stat()
    return _parsed(path.resolve(), stat.st_ino, stat.st_size, stat.st_mtime_ns)


# GGUFReader parses every metadata entry in Python, the vocabulary's strings one by one:
# seconds for SmolLM2's 49,152 tokens and merges. A rank reads its model's config and then
# its weights, so the second read takes the parsed reader (its tensors memory-mapped,
# read-only). Keyed by the file's identity: a file rewritten in place is parsed again.
@functools.lru_cache(maxsize=2)
def _parsed(path: Path, inode: int, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _float32_value(x: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest
    # decimal that rounds to the same float32 is what config.json says (1e-05).
    return float(str(np.float32(x)))


def _architecture(reader: gguf.GGUFReader) -> tuple[str, str, bool]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; DeepInfer serves {sorted(ARCHITECTURES)}"
        )
    return (arch, *ARCHITECTURES[arch])


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if t.tensor_type not in SUPPORTED_TYPES})
    if bad:
        names = sorted(t.name for t in reader.tensors if t.tensor_type.name in bad)
        raise UnsupportedModelError(
            f"GGUF quantization type(s) {', '.join(bad)} not supported (tensor {names[0]}, "
            f"{len(names)} in all); supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
        )


def _rope_scaling(reader: gguf.GGUFReader, arch: str, tensors: set[str]) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1 GGUFs carry the scaled frequencies as a tensor, not the parameters the
        # engine's `inv_freq` needs.
        raise UnsupportedModelError("GGUF rope scaling as a rope_freqs tensor is not supported")
    if kind == "none":
        return None
    factor = _float32_value(_field(reader, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":  # as llama.cpp's converter writes a config.json's yarn rope_scaling
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(
            _field(reader, f"{arch}.rope.scaling.original_context_length"))}
        for key in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                out[key] = _float32_value(value)
        return out
    raise UnsupportedModelError(
        f"GGUF rope scaling {kind!r} is not supported (none, linear, yarn)")


def _checkpoint_dtype(reader: gguf.GGUFReader) -> str:
    # The matrices' float type when they all share one; a quantized file has no "own"
    # float dtype, and gets the default a config.json without torch_dtype gets.
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    if len(kinds) == 1 and next(iter(kinds)) in _DTYPE_OF_TYPE:
        return _DTYPE_OF_TYPE[next(iter(kinds))]
    return "bfloat16"


def config_from_reader(reader: gguf.GGUFReader) -> ModelConfig:
    arch, hf_arch, _ = _architecture(reader)
    check_tensor_types(reader)
    tensors = {t.name for t in reader.tensors}

    def get(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = _field(reader, f"{arch}.vocab_size") or (
        len(tokens.data) if tokens is not None else int(embed.shape[1]))
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(
        reader, f"{arch}.rope.dimension_count") or hidden // heads
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    moe = _moe_fields(reader, arch, tensors)
    if arch == "llama" and moe:
        hf_arch = "MixtralForCausalLM"
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=_float32_value(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        rope_theta=_float32_value(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, tensors),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=None,
        eos_token_ids=(int(eos),) if eos is not None else (),
        torch_dtype=_checkpoint_dtype(reader),
        **moe,
    )


def _moe_fields(reader: gguf.GGUFReader, arch: str, tensors: set[str]) -> dict:
    """The experts' hyperparameters; a layer is MoE where it has a router (ffn_gate_inp)."""
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        if arch == "qwen3moe":
            raise UnsupportedModelError("GGUF qwen3moe without expert_count")
        return {}
    if _field(reader, f"{arch}.expert_shared_count", 0):
        raise UnsupportedModelError("GGUF shared experts are not supported")
    layers = int(_field(reader, f"{arch}.block_count"))
    width = _field(reader, f"{arch}.expert_feed_forward_length") or _field(
        reader, f"{arch}.feed_forward_length")
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")),
        moe_intermediate_size=int(width),
        # llama.cpp renormalises the top-k weights of qwen3moe and Mixtral unless told
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", True)),
        moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors),
    )


def load_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file; refuses a non-GGUF, a foreign architecture or quant."""
    return config_from_reader(open_gguf(path))


# --- weights ---------------------------------------------------------------------------


def unpermute_rotary_rows(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order over whole heads (rows: a multiple of head_dim).

    Within a head llama.cpp stores row 2*i + j what HF has at row j*head_dim/2 + i
    (j in {0, 1}); viewing each head as [head_dim/2, 2] and transposing restores HF's.
    """
    heads = w.shape[0] // head_dim
    assert heads * head_dim == w.shape[0], "rotary rows must cover whole heads"
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpointReader:
    """`CheckpointReader`'s interface over a GGUF file, in HF tensor names."""

    def __init__(self, path: str | Path, dtype: torch.dtype, show_progress: bool) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self._reader = open_gguf(path)
        config = config_from_reader(self._reader)  # refuses what we cannot serve
        _, _, permuted = _architecture(self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._head_dim = config.head_dim
        self._rotary = {n for n in self._tensors if permuted and re.search(r"\.attn_[qk]\.", n)}
        self._progress = tqdm(total=len(self._tensors), desc="loading weights", unit="tensor",
                              disable=not show_progress)

    def __contains__(self, name: str) -> bool:
        return gguf_name(name) in self._tensors

    def _tensor(self, name: str):
        """(the GGUF tensor, its data: one expert's [rows, ...] of a stacked one)."""
        loc = gguf_location(name)
        if loc is None or loc[0] not in self._tensors:
            raise KeyError(f"tensor {name!r} ({loc and loc[0]}) missing from GGUF {self.path}")
        self._progress.update(1)
        t = self._tensors[loc[0]]
        # memory-mapped: indexing one expert reads none of the others' bytes
        return t, (t.data if loc[1] is None else t.data[loc[1]])

    def _to_torch(self, arr: np.ndarray) -> torch.Tensor:
        # np.array copies: F32 data is a read-only view of the memory-mapped file.
        return torch.from_numpy(np.array(arr, dtype=np.float32)).to(self.dtype)

    def _dequantized(self, t, raw: np.ndarray) -> np.ndarray:
        out = gguf.quants.dequantize(np.ascontiguousarray(raw), t.tensor_type)
        if t.name in self._rotary:
            out = unpermute_rotary_rows(out, self._head_dim)
        return out

    def full(self, name: str) -> torch.Tensor:
        t, data = self._tensor(name)
        return self._to_torch(self._dequantized(t, data))

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a 1-D or 2-D tensor (or of one expert's matrix); only those
        rows are dequantized."""
        t, data = self._tensor(name)
        if data.ndim == 1 and t.tensor_type not in (Q.F32, Q.F16):
            # a 1-D quantized tensor is a run of blocks, not of rows
            return self._to_torch(self._dequantized(t, data)[start:end])
        if t.name in self._rotary:
            assert start % self._head_dim == 0 and end % self._head_dim == 0, (
                f"{name}: rows {start}:{end} split a head")
        return self._to_torch(self._dequantized(t, data[start:end]))

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of a 2-D tensor (or of one expert's matrix): the byte range
        of each row's blocks that cover them, dequantized and cut. Not the whole row where
        the range starts or ends inside a block: a K-quant block is 256 columns, and a
        rank's share of an expert's down (Qwen3-30B-A3B: 768 / 2 = 384) ends inside one."""
        t, data = self._tensor(name)
        if t.name in self._rotary:
            return self._to_torch(self._dequantized(t, data)[:, start:end])
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        b0, b1 = start // block, -(-end // block)  # the blocks covering [start, end)
        if data.dtype == np.uint8:  # quantized or BF16: raw bytes per row
            raw = data[:, b0 * type_size : b1 * type_size]
        else:  # F32 / F16: the reader gives typed elements (a block is one element)
            raw = data[:, b0 * block : b1 * block]
        first = b0 * block
        return self._to_torch(self._dequantized(t, raw)[:, start - first : end - first])

    def close(self) -> None:
        self._progress.close()


# --- choosing the reader ---------------------------------------------------------------


def load_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of `--model`: a `.gguf` file or an HF checkpoint directory."""
    return load_gguf_config(model) if is_gguf_path(model) else load_model_config(model)


def open_checkpoint(model: str | Path, dtype: torch.dtype,
                    show_progress: bool) -> CheckpointReader | GGUFCheckpointReader:
    """The weight reader for `--model`: a `.gguf` file or an HF checkpoint directory."""
    if is_gguf_path(model):
        return GGUFCheckpointReader(model, dtype, show_progress)
    return CheckpointReader(model, dtype, show_progress)
