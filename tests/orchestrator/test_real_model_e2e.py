"""The real model (SmolLM2-135M-Instruct, served from its GGUF) through the whole engine:
chat completions over HTTP answer what HF transformers' greedy `generate` answers on the
same chat template and the same file, cold and from the prefix cache (whole blocks, and
a prompt that shares only its first blocks with a cached one)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import SMOLLM2, needs_smollm2
from tests.orchestrator.e2e_helpers import Served

pytestmark = [pytest.mark.slow, needs_smollm2]

MAX_TOKENS = 32
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is to a new programmer, briefly.",
]
SOURCE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''
# Two questions on the same file: the second prompt shares the system prompt and the
# file with the first (its first blocks), not the question at the end.
FILE_QUESTIONS = [f"Here is a file:\n\n{SOURCE}\nWhat does it do? One sentence.",
                  f"Here is a file:\n\n{SOURCE}\nWhat does it return for an empty file?"]


@pytest.fixture(scope="module")
def reference():
    """HF transformers' greedy answer to one user message, from the same GGUF."""
    import torch
    import transformers

    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32).eval()

    def answer(text: str) -> str:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return answer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    served = Served(SMOLLM2, tmp_path_factory.mktemp("real") / "run", nproc=1,
                    dtype="float32")
    yield served
    assert served.stop() == 0, served.log()[-3000:]


def ask(engine: Served, text: str) -> tuple[str, int]:
    """The engine's greedy answer, and how many prompt tokens came from the cache."""
    r = httpx.post(f"{engine.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["message"]["content"], cached


def test_chat_completions_equal_transformers_generate(engine, reference):
    for text in PROMPTS:
        answer, _ = ask(engine, text)
        assert answer == reference(text), text
        assert len(answer.split()) >= 3  # a trained model: words, not noise


def test_cold_and_warm_answers_are_the_same(engine, reference):
    first, second = FILE_QUESTIONS
    cold, cached_cold = ask(engine, first)
    warm, cached_warm = ask(engine, first)  # every full block of the prompt is cached
    shared, cached_shared = ask(engine, second)  # the system prompt and the file are
    # (the first block, the default system prompt, is cached from the test before)
    assert cached_cold < cached_warm and cached_cold < cached_shared < cached_warm + 16
    assert cold == warm == reference(first)
    assert shared == reference(second)
