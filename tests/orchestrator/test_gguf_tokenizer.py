"""The tokenizer built from GGUF metadata equals the one transformers builds from the same
file (token ids on a corpus of code and prose), and the file's own tokenizer.json where
there is one; other tokenizer kinds and non-GGUF files are refused by name."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from orchestrator.gguf_tokenizer import GGUFTokenizerError, load_gguf_tokenizer
from orchestrator.shim.chat_template import ChatTemplate
from tests.conftest import SMOLLM2, needs_smollm2
from tests.orchestrator.gguf_vocab import write_tokenizer_gguf

CORPUS = [
    '''def reverse(s: str) -> str:
    """Return s reversed."""
    return s[::-1]


class Stack:
    def __init__(self):
        self._items = []  # list[int]

    def push(self, x):\n\tself._items.append(x)\r\n        return len(self._items) >= 0x1F
''',
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // 12345678 3.14159 1e-5 0xdeadbeef",
    "SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name;  -- don't, won't, I'll",
    "The quick brown fox jumps over the lazy dog. It's a pangram; they're used for typing.",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文, 한국어, "
    "العربية, עברית, हिन्दी, emoji 😀🚀👩‍💻, math ∑∫√∞ ≤ ≥, arrows → ← ⇒.",
    "combining: e\u0301 a\u0308 o\u0303; zero-width\u200bspace; nbsp\u00a0here; tab\there.",
    "    four spaces\n        eight spaces\n\n\n\nblank lines\t\t\ttabs   \n"
    "   \r\n\r\n  trailing   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n<think>ok</think><tool_call>{\"a\": 1}</tool_call><|im_end|>",
    "{\"json\": [1, 2, 3], \"nested\": {\"key\": \"value with \\\"quotes\\\"\"}, \"n\": null}",
    "   ", "\n", "", "a", "!!!???...", "ALLCAPS and MiXeD CaSe and snake_case_name and camelCase",
]
CORPUS.append("\n".join(CORPUS) * 3)  # a few KB in one piece


@pytest.fixture(scope="module")
def tiny_gguf(default_model, tmp_path_factory) -> Path:
    return write_tokenizer_gguf(default_model, tmp_path_factory.mktemp("gguf") / "tok.gguf")


def hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same_ids(ours: Tokenizer, encode, texts: list[str]) -> None:
    for text in texts:
        got = ours.encode(text, add_special_tokens=False).ids
        want = encode(text)
        assert got == want, f"{text[:60]!r}: first difference at {first_diff(got, want)}"
        assert ours.decode(got, skip_special_tokens=False) == text


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_tiny_equals_its_tokenizer_json_and_transformers(default_model, tiny_gguf):
    g = load_gguf_tokenizer(tiny_gguf)
    own = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    # the tiny tokenizer.json has an NFC normalizer, which a GGUF cannot say: NFC text only
    nfc = [unicodedata.normalize("NFC", t) for t in CORPUS]
    assert_same_ids(g.tokenizer, lambda t: own.encode(t, add_special_tokens=False).ids, nfc)
    hf = hf_tokenizer(tiny_gguf)
    assert_same_ids(g.tokenizer, lambda t: hf(t, add_special_tokens=False).input_ids, CORPUS)
    assert g.tokenizer.get_vocab_size() == own.get_vocab_size()
    assert g.special_tokens["eos_token"] == "<|im_end|>"
    assert g.eos_token_id == own.token_to_id("<|im_end|>") and not g.add_bos_token
    assert g.chat_template == ChatTemplate.from_model_dir(default_model).source


def test_refuses_other_tokenizer_kinds(default_model, tmp_path):
    path = write_tokenizer_gguf(default_model, tmp_path / "spm.gguf", kind="llama")
    with pytest.raises(GGUFTokenizerError, match="'llama' is not supported") as info:
        load_gguf_tokenizer(path)
    assert "gpt2" in str(info.value) and "\n" not in str(info.value)


def test_refuses_a_file_that_is_not_gguf(default_model):
    with pytest.raises(GGUFTokenizerError, match="is not a GGUF file"):
        load_gguf_tokenizer(default_model / "tokenizer.json")


@needs_smollm2
def test_smollm2_equals_transformers():
    g = load_gguf_tokenizer(SMOLLM2)
    hf = hf_tokenizer(SMOLLM2)
    assert_same_ids(g.tokenizer, lambda t: hf(t, add_special_tokens=False).input_ids, CORPUS)
    assert (g.bos_token_id, g.eos_token_id) == (1, 2)
    assert g.special_tokens["eos_token"] == "<|im_end|>" == hf.eos_token
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    ours = ChatTemplate(g.chat_template, special_tokens=g.special_tokens).render(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in ours  # the default system prompt
