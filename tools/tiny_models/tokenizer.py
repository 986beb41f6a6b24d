"""The default model's tokenizer: byte-level BPE trained locally, and its chat template.

Trained with the `tokenizers` library on the Python standard library's sources
already on the machine (nothing is downloaded); the trainer is deterministic, so the
same Python gives byte-identical files. The setup (NFC, Qwen's split regex, byte
level) matches what transformers rebuilds for a `qwen2` model type, so every
architecture made by `make_tiny_model` tokenizes identically in `tokenizers` and HF.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: 0..8 in this order.
SPECIAL_TOKENS = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    PAD_TOKEN,
)
# As in Qwen's tokenizers, the tool-call and thinking markers are single tokens but not
# "special": decode(skip_special_tokens=True) keeps them, so a tool-call parser still
# sees them in the text.
NON_SPECIAL_MARKERS = frozenset({"<tool_call>", "</tool_call>", "<think>", "</think>"})

# Qwen2/Qwen2.5/Qwen3 pre-tokenizer split (like Llama 3's: digits one by one, a word
# keeps its leading space or punctuation).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Tokenizer training corpus: top-level stdlib modules, sorted, capped so training
# stays around a second on 2 cores.
CORPUS_MAX_CHARS = 4_000_000

# ChatML (Qwen 2.5 style) with Hermes-style tools. Content may be a string or a list
# of {"type": "text", "text": ...} parts; tool-call arguments may be a dict or an
# already-encoded JSON string (OpenAI clients send strings).
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part.type == 'text' -%}{{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name '
        'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\\n' + render_content(message.content) + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) }}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""




def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"), key=lambda p: p.name)


def load_corpus(max_chars: int = CORPUS_MAX_CHARS) -> list[str]:
    """Sorted top-level stdlib sources, up to max_chars (a fixed, local corpus)."""
    texts: list[str] = []
    total = 0
    for path in _corpus_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # skipping is deterministic too; a replacement char would pollute merges
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total < 100_000:
        raise RuntimeError(f"too little training text found under {_corpus_files()[:1]}")
    return texts


@functools.lru_cache(maxsize=4)
def train_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer; returns tokenizer.json text.

    Cached per process so tests that build several models train once. The HF BPE
    trainer breaks count ties by pair order, so the result does not depend on the
    thread count (checked: identical bytes with RAYON_NUM_THREADS=1 and default).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers 5.x's Qwen2Tokenizer rebuilds (it ignores the
    # normalizer/pre-tokenizer in tokenizer.json and is forced for model_type qwen2), so
    # HF and the engine's own `tokenizers` instance give the same ids for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # No BOS/EOS added on encode (ChatML style: the template carries the markers).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[
            AddedToken(t, special=t not in NON_SPECIAL_MARKERS, normalized=False)
            for t in SPECIAL_TOKENS
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(load_corpus(), trainer=trainer)
    data = json.loads(tok.to_str())
    # The trainer registers every special_tokens entry as special; restore the
    # intended flag for the tool-call / thinking markers.
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] not in NON_SPECIAL_MARKERS
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def token_ids(tokenizer_json: str) -> dict[str, int]:
    """Ids of our special tokens in a tokenizer.json (trained or copied)."""
    data = json.loads(tokenizer_json)
    ids = {e["content"]: e["id"] for e in data.get("added_tokens", [])}
    vocab = data.get("model", {}).get("vocab", {})
    out: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        if t in ids:
            out[t] = ids[t]
        elif isinstance(vocab, dict) and t in vocab:
            out[t] = vocab[t]
    return out


def tokenizer_size(tokenizer_json: str) -> int:
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [e["id"] for e in data.get("added_tokens", [])]
    return max(ids) + 1
