"""Fixtures of the worker tests: HF transformers' reference outputs per model dir."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_reference import NEW_TOKENS, make_prompt


@pytest.fixture(scope="session")
def hf_reference(request):
    """(prompt, prompt logits, greedy tokens) from transformers, per model dir, float32;
    `new_tokens` greedy tokens (each a forward over the whole sequence)."""
    import transformers

    cache = {}

    def get(model_dir, new_tokens=NEW_TOKENS):
        if (model_dir, new_tokens) not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf.eval()
            prompt = make_prompt(hf.config.vocab_size)
            ids = list(prompt)
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0]
                for _ in range(new_tokens):  # plain argmax: no EOS suppression or stopping
                    ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            cache[model_dir, new_tokens] = (prompt, logits, ids[len(prompt):])
        return cache[model_dir, new_tokens]

    return get


@pytest.fixture
def kernels():
    """The compiled CPU kernels (worker/cpu_kernels.py); skipped where they cannot build."""
    from worker import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    return module
