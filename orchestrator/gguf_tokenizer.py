"""The tokenizer and chat template of a GGUF file, built from its metadata.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges, each token's type (normal, control, user-defined, ...), the special ids
and the chat template as metadata. For `tokenizer.ggml.model = gpt2` (byte-level BPE:
Llama 3, SmolLM, Qwen2 and most recent models) this builds the equivalent
`tokenizers.Tokenizer`; other kinds (SentencePiece `llama`, `t5`, `bert`, `rwkv`, ...)
are refused by name. This reads the file with the `gguf` package (numpy only, no torch).

The launcher writes what it builds as a Hugging Face tokenizer directory in the run
directory (`write_tokenizer_dir`), which the shim (tokenization, the chat template) and
the scheduler (guided decoding) read as they read any model's (EngineConfig.tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SUPPORTED_KINDS = ("gpt2",)
# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (never split, dropped
# on decode with skip_special_tokens); USER_DEFINED ones are matched whole but are text.
CONTROL, USER_DEFINED = 3, 4

# The pre-tokenizer split of `tokenizer.ggml.pre`, where it is not GPT-2's own regex (which
# ByteLevel applies by itself). Same regexes as llama.cpp's llama-vocab.cpp for each name.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


class GGUFTokenizerError(ValueError):
    pass


@dataclass
class GGUFTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    # name -> token text, as ChatTemplate(special_tokens=...) takes them (bos_token, ...)
    special_tokens: dict[str, str] = field(default_factory=dict)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def _spelled(token: str, alphabet: set[str], spell: dict[int, str]) -> str:
    # Byte-level vocabularies are written in the byte alphabet; a token that is not
    # (llama.cpp writes some added tokens as raw text) is re-spelled byte by byte so the
    # BPE model can reach it.
    if set(token) <= alphabet:
        return token
    return "".join(spell[b] for b in token.encode("utf-8"))


def build_tokenizer(meta: dict) -> GGUFTokenizer:
    """From the metadata as `read_tokenizer_metadata` returns it."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_KINDS:
        raise GGUFTokenizerError(
            f"GGUF tokenizer {kind!r} is not supported: only byte-level BPE ('gpt2') is built; "
            f"SentencePiece ('llama'), 't5', 'bert', 'rwkv' and other kinds are refused"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    spell = byte_alphabet()
    alphabet = set(spell.values())
    vocab = {_spelled(t, alphabet, spell): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:  # GPT-2's regex, inside ByteLevel
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a mislabel: adding it would create an
    # id past the model's vocabulary, so only byte-alphabet ones become special.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= value < len(tokens) else None

    ids = {name: token_id(key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    return GGUFTokenizer(
        tokenizer=tok,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=ids["bos_token"],
        eos_token_id=ids["eos_token"],
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        special_tokens={name: tokens[i] for name, i in ids.items() if i is not None},
    )


TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def read_tokenizer_metadata(path: str | Path) -> dict:
    """The tokenizer keys of a GGUF file (those present), as Python values."""
    import gguf  # imported here: only a GGUF model needs it

    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFTokenizerError(f"{path} is not a GGUF file")
    reader = gguf.GGUFReader(path)
    return {k: reader.fields[k].contents() for k in TOKENIZER_KEYS if k in reader.fields}


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer, chat template and special tokens of a GGUF file."""
    return build_tokenizer(read_tokenizer_metadata(path))


def write_tokenizer_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """The GGUF's tokenizer as `tokenizer.json` and its chat template and special tokens as
    `tokenizer_config.json` in `out_dir`, the files a Hugging Face model directory holds."""
    built = load_gguf_tokenizer(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    built.tokenizer.save(str(out / "tokenizer.json"))
    config = {"add_bos_token": built.add_bos_token, **built.special_tokens}
    if built.chat_template is not None:
        config["chat_template"] = built.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out
