"""Test helper (no torch): an HF tokenizer.json (byte-level BPE) written as llama.cpp's
GGUF tokenizer keys, the way its converter does for a `gpt2`-kind vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import gguf


def add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, kind: str = "gpt2",
                  pre: str = "qwen2") -> None:
    """`pre`: the tiny model's split is Qwen2's (single digits), llama.cpp's name for it;
    `kind` (tokenizer.ggml.model) other than gpt2 only to test refusals."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    kinds = {}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["content"]] = (gguf.TokenType.CONTROL if added["special"]
                                   else gguf.TokenType.USER_DEFINED)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([kinds.get(t, gguf.TokenType.NORMAL) for t in tokens])
    w.add_token_merges(merges)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])
    w.add_bos_token_id(vocab[cfg["bos_token"]])
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_add_bos_token(False)


def write_tokenizer_gguf(model_dir: Path, out: Path, kind: str = "gpt2") -> Path:
    """A GGUF holding only metadata: a llama header and the tokenizer (`kind` overrides
    tokenizer.ggml.model, to test refusals)."""
    w = gguf.GGUFWriter(str(out), "llama")
    add_tokenizer(w, model_dir, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
