"""Prefill in chunks gives the same logits as one pass (4,000 tokens, 512-token chunks)."""

from __future__ import annotations

import torch

from wire.config import EngineConfig
from wire.step import NewSequence, ScheduledChunk, StepPlan
from worker.distributed import TensorParallelGroup
from worker.model_runner import ModelRunner

PROMPT = 4000
CHUNK = 512


def prefill(runner: ModelRunner, prompt: list[int], chunk: int, seq_id: int) -> torch.Tensor:
    bs = runner.config.block_size
    first = StepPlan(step=0, new_seqs=[NewSequence(seq_id, list(range(-(-len(prompt) // bs))))])
    runner.execute(first)
    logits = []
    for start in range(0, len(prompt), chunk):
        plan = StepPlan(step=1, chunks=[ScheduledChunk(seq_id, prompt[start:start + chunk],
                                                       start, False)])
        logits.append(runner.execute(plan, return_logits=True).logits)
    runner.execute(StepPlan(step=2, close=[seq_id]))
    return torch.cat(logits)


def test_chunked_prefill_equals_one_pass(default_model):
    config = EngineConfig(model=str(default_model), dtype="float32",
                          kv_cache_memory=128 * 1024 * 1024)
    runner = ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, runner.vocab_size, (PROMPT,), generator=g).tolist()
    whole = prefill(runner, prompt, PROMPT, seq_id=1)
    chunked = prefill(runner, prompt, CHUNK, seq_id=2)
    scale = whole.abs().max().item()
    assert (whole - chunked).abs().max().item() < 1e-4 * scale
    assert torch.equal(whole.argmax(-1), chunked.argmax(-1))
