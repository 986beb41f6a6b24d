"""Generate a tiny Llama-family checkpoint with random weights, locally and deterministically.

The engine's tests and `make install` need a real Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer files, chat template) without downloading
anything. This tool writes one:

    python -m tools.tiny_models.make --out models/tiny-llama
    python -m tools.tiny_models.make --out models/tiny-qwen3 --arch qwen3 \
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
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from tools.tiny_models.hybrid import HYBRID_ARCHS, HybridSpec, write_hybrid
from tools.tiny_models.spec import (
    ARCH_DEFAULTS,
    DTYPES,
    HF_ARCH,
    TinySpec,
    make_weights,
    resolve_spec,
)
from tools.tiny_models.tokenizer import (
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
    elif spec.arch in ("qwen3", "qwen3_moe"):  # the MoE model is Qwen3's attention + experts
        cfg.update(
            head_dim=spec.head_dim,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec.num_layers,
        )
    if spec.arch == "qwen3_moe":
        cfg.update(
            decoder_sparse_step=1,
            mlp_only_layers=list(spec.mlp_only_layers),
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    if spec.arch == "mixtral":
        cfg.update(
            head_dim=spec.head_dim,
            sliding_window=None,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            router_jitter_noise=0.0,
            output_router_logits=False,
            router_aux_loss_coef=0.02,
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


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers")


def _stamp_args(spec: TinySpec, tok_source: dict[str, Any]) -> dict[str, Any]:
    fields = dataclasses.asdict(spec)
    if spec.num_experts:  # JSON has no tuples: a list, so the stamp compares equal re-read
        fields["mlp_only_layers"] = list(spec.mlp_only_layers)
    else:  # a dense model's stamp is what it was before the MoE fields
        fields = {k: v for k, v in fields.items() if k not in MOE_FIELDS}
    return {
        "format_version": FORMAT_VERSION,
        "spec": fields,
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
    out_dir = Path(out_dir)
    if arch in HYBRID_ARCHS:  # written by transformers itself (tools/tiny_models/hybrid.py)
        if any(v is not None for v in overrides.values()):
            raise TypeError(f"--arch {arch} takes no model options")
        src = Path(tokenizer_from) if tokenizer_from is not None else None
        return make_hybrid_model(out_dir, arch, seed, src, quiet)
    log = (lambda _msg: None) if quiet else print
    t0 = time.perf_counter()
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


def make_hybrid_model(out_dir: Path, arch: str, seed: int, tokenizer_from: Path | None,
                      quiet: bool = False) -> Path:
    """make_tiny_model for the hybrid archs (tools/tiny_models/hybrid.py): the same stamp,
    the tokenizer copied, the model written by transformers."""
    import transformers

    if tokenizer_from is None:
        raise ValueError(f"--arch {arch}: give --tokenizer-from (e.g. models/tiny-llama)")
    log = (lambda _msg: None) if quiet else print
    t0 = time.perf_counter()
    spec = HybridSpec(arch=arch, seed=int(seed))
    args = {"format_version": FORMAT_VERSION, "spec": dataclasses.asdict(spec),
            "tokenizer": _tokenizer_source(tokenizer_from),
            "transformers": transformers.__version__}
    if is_up_to_date(out_dir, args):
        os.utime(out_dir / STAMP_NAME)
        log(f"{out_dir}: tiny {arch} model already made with these arguments; nothing to do")
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP_NAME).unlink(missing_ok=True)
    names = token_ids(_copy_tokenizer(tokenizer_from, out_dir))
    ids = {"bos": names.get(BOS_TOKEN), "eos": names.get(IM_END_TOKEN),
           "pad": names.get(PAD_TOKEN)}
    n_params = write_hybrid(spec, out_dir, ids)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != STAMP_NAME}
    stamp = {"args": args, "files": files, "num_parameters": n_params}
    _write_atomic(out_dir / STAMP_NAME, _json_bytes(stamp))  # last: marks the dir complete
    log(f"{out_dir}: tiny {arch} model, {n_params / 1e6:.2f}M params, written by "
        f"transformers {transformers.__version__}, {time.perf_counter() - t0:.1f}s")
    return out_dir


# ---------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.tiny_models.make",
        description="Generate a tiny random-weight Llama/Qwen checkpoint, deterministically.",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--arch", choices=sorted([*ARCH_DEFAULTS, *HYBRID_ARCHS]), default="llama")
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
