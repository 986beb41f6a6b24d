"""Fixtures for the shim's tests: a small byte-level BPE trained in-process (no model needed)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 0\n",
    "STOP here. END of the text. The end.",
]
SPECIAL = ["<|end|>"]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """A byte-level BPE whose vocabulary has no merges for non-ASCII text, so any
    multi-byte character is split across several tokens (one per byte)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[AddedToken(t, special=True) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer(default_model) -> Tokenizer:
    """The default model's tokenizer: ChatML specials, <|im_end|> = 3, <tool_call> added."""
    return Tokenizer.from_file(str(default_model / "tokenizer.json"))


@pytest.fixture(scope="session")
def tiny_template(default_model):
    from orchestrator.shim.chat_template import ChatTemplate

    return ChatTemplate.from_model_dir(default_model)


@pytest.fixture(scope="module")
def guides(default_model):
    """Grammar guides over the tiny model's tokenizer (scheduler/guided.py)."""
    from scheduler.guided import GuideFactory

    return GuideFactory(str(default_model), 8192, [3])
