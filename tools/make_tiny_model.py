"""Generate a tiny Llama-family checkpoint with random weights, locally and deterministically.

The engine's tests and `make install` need a real Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer files, chat template) without downloading
anything. This tool writes one:

    python -m tools.make_tiny_model --out models/tiny-llama
    python -m tools.make_tiny_model --out models/tiny-qwen3 --arch qwen3 \
        --tokenizer-from models/tiny-llama

The same arguments always give byte-identical files (weights from a seeded
torch.Generator in a fixed order, tokenizer trained by a deterministic BPE trainer on
the Python standard library sources). A `deepinfer_tiny.json` stamp records the
arguments, so a second run with the same arguments does nothing.

Only torch, safetensors and tokenizers are needed (transformers is not: it is a dev
dependency, used by the tests to check that the output loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tools.tiny_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    CORPUS_MAX_CHARS,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    token_ids,
    tokenizer_size,
    train_tokenizer_json,
)

# Bump when the output for the same arguments changes (init scheme, template, ...):
# the stamp then no longer matches and `make install` regenerates.
FORMAT_VERSION = 2
STAMP_NAME = "deepinfer_tiny.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Everything that determines the generated files (stored in the stamp)."""

    arch: str
    seed: int
    dtype: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # head_dim 64 with hidden 256 / 8 heads: head_dim != hidden / heads, as in real Qwen3.
    "qwen3": dict(
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen2 has no head_dim in its config: it is always hidden / heads.
    "qwen2": dict(
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
        vocab_size=8192,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}

HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_spec(arch: str, seed: int, overrides: dict[str, Any]) -> TinySpec:
    """Arch defaults + overrides (None means "use the default"), validated."""
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_DEFAULTS)}")
    fields = {f.name for f in dataclasses.fields(TinySpec)} - {"arch", "seed"}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown model options: {sorted(unknown)}")
    values: dict[str, Any] = {"dtype": "bfloat16", **ARCH_DEFAULTS[arch]}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if arch == "qwen2" and overrides.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    spec = TinySpec(arch=arch, seed=int(seed), **values)
    _validate(spec)
    return spec


def _validate(spec: TinySpec) -> None:
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
    for name in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "max_position_embeddings",
    ):
        if getattr(spec, name) < 1:
            raise ValueError(f"{name} must be positive")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if spec.head_dim % 2:
        raise ValueError("head_dim must be even (rotary embedding)")
    if spec.arch == "qwen2" and spec.head_dim * spec.num_heads != spec.hidden_size:
        # HF's Qwen2 derives head_dim from hidden / heads and ignores a head_dim key.
        raise ValueError("qwen2 requires head_dim == hidden_size / num_heads")
    # 256 byte symbols + the special tokens must fit, plus room for some merges.
    if spec.vocab_size < 512:
        raise ValueError("vocab_size must be at least 512")


# ---------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------

# Init scheme. The usual std=0.02 everywhere gives a model whose output barely depends
# on the context (uniform attention, layers adding little to the residual), so a broken
# KV cache or a wrong position would go unnoticed in tests. Instead every linear layer
# is scaled by 1/sqrt(fan_in) so each sublayer adds O(1) to the residual, q/k get a
# gain so attention scores have a std of ~QK_GAIN^2 (peaked, position-dependent
# attention), and the lm_head is scaled so logits have a std of ~LOGIT_STD (clear
# winners for greedy decoding, yet a non-degenerate distribution).
QK_GAIN = 1.5
LOGIT_STD = 3.0
UNTIED_EMBED_STD = 1.0
NORM_NOISE_STD = 0.05
BIAS_STD = 0.5


def _tensor_plan(spec: TinySpec) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """(HF name, shape, kind, std) for every tensor, in the fixed generation order."""
    h, d = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    embed_std = LOGIT_STD / math.sqrt(h) if spec.tie_word_embeddings else UNTIED_EMBED_STD

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0):
        return (name, (out_f, in_f), "normal", gain / math.sqrt(in_f))

    yield ("model.embed_tokens.weight", (spec.vocab_size, h), "normal", embed_std)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        yield (f"{p}.input_layernorm.weight", (h,), "norm", NORM_NOISE_STD)
        yield linear(f"{p}.self_attn.q_proj.weight", q_out, h, QK_GAIN)
        yield linear(f"{p}.self_attn.k_proj.weight", kv_out, h, QK_GAIN)
        yield linear(f"{p}.self_attn.v_proj.weight", kv_out, h)
        if spec.qkv_bias:
            yield (f"{p}.self_attn.q_proj.bias", (q_out,), "normal", BIAS_STD)
            yield (f"{p}.self_attn.k_proj.bias", (kv_out,), "normal", BIAS_STD)
            yield (f"{p}.self_attn.v_proj.bias", (kv_out,), "normal", BIAS_STD)
        if spec.qk_norm:
            yield (f"{p}.self_attn.q_norm.weight", (d,), "norm", NORM_NOISE_STD)
            yield (f"{p}.self_attn.k_norm.weight", (d,), "norm", NORM_NOISE_STD)
        yield linear(f"{p}.self_attn.o_proj.weight", h, q_out)
        yield (f"{p}.post_attention_layernorm.weight", (h,), "norm", NORM_NOISE_STD)
        yield linear(f"{p}.mlp.gate_proj.weight", spec.intermediate_size, h)
        yield linear(f"{p}.mlp.up_proj.weight", spec.intermediate_size, h)
        yield linear(f"{p}.mlp.down_proj.weight", h, spec.intermediate_size)
    yield ("model.norm.weight", (h,), "norm", NORM_NOISE_STD)
    if not spec.tie_word_embeddings:
        yield linear("lm_head.weight", spec.vocab_size, h, LOGIT_STD)


def make_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """All tensors from one CPU generator, in a fixed order: same spec, same bytes."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind, std in _tensor_plan(spec):
        # Always sample in float32, then cast: the stream of random numbers must not
        # depend on the output dtype.
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if kind == "norm":
            t += 1.0
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def tokenizer_config(spec: TinySpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte-level BPE decodes exactly; the cleanup would break decode(encode(s)) == s.
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------


def model_config(spec: TinySpec, ids: dict[str, int]) -> dict[str, Any]:
    """config.json in the classic hub layout (rope_theta, torch_dtype at top level),
    which is what most published checkpoints have and transformers 4.x and 5.x read."""
    architecture, model_type = HF_ARCH[spec.arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": ids.get(BOS_TOKEN),
        "eos_token_id": ids.get(IM_END_TOKEN),
        "pad_token_id": ids.get(PAD_TOKEN),
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.arch == "llama":
        cfg.update(head_dim=spec.head_dim, attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif spec.arch == "qwen3":
        cfg.update(
            head_dim=spec.head_dim,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec.num_layers,
        )
    elif spec.arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    return cfg


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    eos = [ids[t] for t in (IM_END_TOKEN, END_OF_TEXT_TOKEN) if t in ids]
    return {
        "bos_token_id": ids.get(BOS_TOKEN),
        "eos_token_id": eos,
        "pad_token_id": ids.get(PAD_TOKEN),
    }


# ---------------------------------------------------------------------------------
# Output directory, stamp
# ---------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_atomic(path: Path, data: bytes) -> None:
    # Write-then-rename: an interrupted run never leaves a truncated file that looks done.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _tokenizer_source(tokenizer_from: Path | None) -> dict[str, Any]:
    """What the tokenizer comes from; part of the stamp's arguments."""
    if tokenizer_from is None:
        import tokenizers

        return {
            "source": "trained",
            "corpus": "python-stdlib",
            "python": ".".join(map(str, sys.version_info[:3])),
            "tokenizers": tokenizers.__version__,
            "corpus_max_chars": CORPUS_MAX_CHARS,
        }
    src = tokenizer_from.resolve()
    missing = [n for n in TOKENIZER_FILES if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"--tokenizer-from {src}: missing {missing}")
    return {
        "source": "copied",
        "from": str(src),
        "sha256": {n: _sha256(src / n) for n in TOKENIZER_FILES},
    }


def _stamp_args(spec: TinySpec, tok_source: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "tokenizer": tok_source,
    }


def is_up_to_date(out_dir: Path, args: dict[str, Any]) -> bool:
    """True when out_dir holds a complete model made with exactly these arguments."""
    try:
        stamp = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("args") != args:
        return False
    files: dict[str, dict[str, Any]] = stamp.get("files", {})
    # Sizes, not hashes: cheap, and enough to catch a file replaced or cut short.
    return bool(files) and all(
        (out_dir / name).is_file() and (out_dir / name).stat().st_size == info["size"]
        for name, info in files.items()
    )


def _copy_tokenizer(src: Path, out_dir: Path) -> str:
    for name in TOKENIZER_FILES:
        _write_atomic(out_dir / name, (src / name).read_bytes())
    # Optional extras some tokenizers ship with; copied so the copy behaves the same.
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
    return (out_dir / "tokenizer.json").read_text(encoding="utf-8")


def make_tiny_model(
    out_dir: Path | str,
    arch: str = "llama",
    seed: int = 0,
    *,
    tokenizer_from: Path | str | None = None,
    quiet: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight HF checkpoint to out_dir (skipped if already there).

    overrides: any TinySpec field (num_layers, hidden_size, num_heads, num_kv_heads,
    head_dim, intermediate_size, vocab_size, max_position_embeddings, dtype, ...).
    """
    log = (lambda _msg: None) if quiet else print
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    spec = resolve_spec(arch, seed, overrides)
    src = Path(tokenizer_from) if tokenizer_from is not None else None
    args = _stamp_args(spec, _tokenizer_source(src))
    if is_up_to_date(out_dir, args):
        # Touch the stamp: `make` uses it as the target, and it must look newer than
        # this script after a no-op run, or make would rerun us every time.
        os.utime(out_dir / STAMP_NAME)
        log(f"{out_dir}: tiny {arch} model already made with these arguments; nothing to do")
        return out_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    # Remove the stamp first: if this run dies halfway, the next one starts over.
    (out_dir / STAMP_NAME).unlink(missing_ok=True)

    t_tok = time.perf_counter()
    if src is None:
        tok_json = train_tokenizer_json(spec.vocab_size)
        _write_atomic(out_dir / "tokenizer.json", tok_json.encode("utf-8"))
        _write_atomic(out_dir / "tokenizer_config.json", _json_bytes(tokenizer_config(spec)))
    else:
        tok_json = _copy_tokenizer(src, out_dir)
    t_tok = time.perf_counter() - t_tok

    n_tok = tokenizer_size(tok_json)
    if n_tok > spec.vocab_size:
        raise ValueError(f"tokenizer has {n_tok} ids but the model vocab is {spec.vocab_size}")
    ids = token_ids(tok_json)
    if IM_END_TOKEN not in ids:
        raise ValueError(f"tokenizer has no {IM_END_TOKEN} token (needed as eos)")

    tensors = make_weights(spec)
    n_params = sum(t.numel() for t in tensors.values())
    tmp = out_dir / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the same mode as the other files.
    tmp.chmod(0o666 & ~_umask())
    os.replace(tmp, out_dir / WEIGHTS_NAME)
    _write_atomic(out_dir / "config.json", _json_bytes(model_config(spec, ids)))
    _write_atomic(out_dir / "generation_config.json", _json_bytes(generation_config(ids)))

    names = [WEIGHTS_NAME, "config.json", "generation_config.json", *TOKENIZER_FILES]
    files = {
        n: {"size": (out_dir / n).stat().st_size, "sha256": _sha256(out_dir / n)} for n in names
    }
    stamp = {"args": args, "files": files, "num_parameters": n_params}
    _write_atomic(out_dir / STAMP_NAME, _json_bytes(stamp))  # last: marks the dir complete

    size_mb = files[WEIGHTS_NAME]["size"] / 1e6
    tok_note = f"trained in {t_tok:.1f}s" if src is None else f"copied from {src}"
    log(
        f"{out_dir}: tiny {arch} model, {n_params / 1e6:.2f}M params, {WEIGHTS_NAME} "
        f"{size_mb:.1f} MB ({spec.dtype}), tokenizer {n_tok} ids {tok_note}, "
        f"eos {IM_END_TOKEN}={ids[IM_END_TOKEN]}, total {time.perf_counter() - t0:.1f}s"
    )
    return out_dir


# ---------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.make_tiny_model",
        description="Generate a tiny random-weight Llama/Qwen checkpoint, deterministically.",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), default="llama")
    p.add_argument("--seed", type=int, default=0)
    for flag in (
        "num-layers",
        "hidden-size",
        "num-heads",
        "num-kv-heads",
        "head-dim",
        "intermediate-size",
        "vocab-size",
        "max-position-embeddings",
    ):
        p.add_argument(f"--{flag}", type=int, default=None, help="override the arch default")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default bfloat16)"
    )
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="copy tokenizer files from this model dir instead of training",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    overrides = {
        k: getattr(a, k)
        for k in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "dtype",
        )
    }
    try:
        make_tiny_model(a.out, a.arch, a.seed, tokenizer_from=a.tokenizer_from, **overrides)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"make_tiny_model: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
