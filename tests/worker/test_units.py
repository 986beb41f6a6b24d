"""Sampling, model-config checks and the worker's own guards."""

from __future__ import annotations

import json

import pytest
import torch

from scheduler.guided import token_mask
from wire.client import SamplingParams
from wire.config import EngineConfig
from wire.step import NewSequence, ScheduledChunk, StepPlan
from worker.budget import StartupError, resolve_max_model_len
from worker.distributed import TensorParallelGroup
from worker.model_config import UnsupportedModelError, load_model_config
from worker.model_runner import ModelRunner
from worker.sampler import sample


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    lg = logits()
    assert sample(lg, [SamplingParams()] * 4, [0] * 4, [0] * 4) == lg.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    lg = logits()
    p = SamplingParams(temperature=1.0, seed=123)
    alone = sample(lg[2:3], [p], [123], [7])
    batched = sample(lg, [SamplingParams()] * 2 + [p, SamplingParams(1.0)], [0, 0, 123, 5],
                     [0, 0, 7, 0])
    assert batched[2] == alone[0]
    draws = {sample(lg[:1], [SamplingParams(1.0)], [s], [0])[0] for s in range(40)}
    assert len(draws) > 3, "different seeds should give different tokens"


def test_top_k_and_top_p_restrict_the_support():
    lg = logits(1, 50)[0]
    top3 = set(lg.topk(3).indices.tolist())
    for seed in range(30):
        t = sample(lg[None], [SamplingParams(temperature=2.0, top_k=3)], [seed], [0])[0]
        assert t in top3
    probs = torch.softmax(lg, -1)
    best = int(probs.argmax())
    tiny_p = float(probs[best]) / 2  # the smallest set reaching it is the top token alone
    for seed in range(10):
        assert sample(lg[None], [SamplingParams(1.0, top_p=tiny_p)], [seed], [0])[0] == best
    # A top_p below float32's range compares as 0: the top token still stays (the fuzzer
    # found a request with top_p 5e-324 that made every rank fail the step).
    assert sample(lg[None], [SamplingParams(1.0, top_p=5e-324)], [0], [0])[0] == best
    # A temperature too small to divide by samples greedily, whoever sent it (1e-300
    # overflows the logits to inf and softmax to NaN).
    assert sample(lg[None], [SamplingParams(1e-300)], [0], [0])[0] == best


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_guided_rows_sample_only_allowed_tokens(device):
    vocab = 45  # the logits may be wider than the mask (padding): the rest is excluded
    lg = logits(4, vocab + 3).to(device)
    allowed = [{3, 40}, None, {44}, set()]  # an empty mask (a broken grammar): unmasked
    masks = [None if a is None else token_mask(a, vocab) for a in allowed]
    params = [SamplingParams(1.0), SamplingParams(), SamplingParams(), SamplingParams()]
    for seed in range(20):
        tokens = sample(lg.clone(), params, [seed] * 4, [0] * 4, masks)
        assert tokens[0] in {3, 40} and tokens[2] == 44
        assert tokens[1] == int(lg[1].argmax()) and tokens[3] == int(lg[3].argmax())


def write_config(tmp_path, **fields):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    base.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return tmp_path


def test_unknown_architecture_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(write_config(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_scaling_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model_config(write_config(tmp_path, rope_scaling={"rope_type": "longrope",
                                                                "factor": 4.0}))


def test_heads_that_do_not_divide_are_refused(tmp_path):
    cfg = load_model_config(write_config(tmp_path, num_key_value_heads=2))
    cfg.check_tensor_parallel(2)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=2 does not divide"):
        cfg.check_tensor_parallel(4)


LLAMA3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_keeps_high_frequencies(tmp_path):
    cfg = load_model_config(write_config(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3_1))
    plain = load_model_config(write_config(tmp_path, rope_theta=500000.0))
    scaled, base = cfg.inv_freq(), plain.inv_freq()
    assert scaled[0] == base[0]  # shortest wavelength untouched
    assert scaled[-1] == pytest.approx(base[-1] / 8.0)  # longest divided by the factor


@pytest.mark.parametrize("max_pos, scaling, served", [
    (40960, None, 40960),
    # Qwen3-30B-A3B's model card: YaRN x4 over the 32,768 tokens it was trained on
    (40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     131072),
    # Qwen3-Coder-30B-A3B: 262,144 native, YaRN to 1M
    (262144, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144},
     1048576),
    (4096, {"rope_type": "linear", "factor": 2.0}, 8192),
    (4096, {"rope_type": "dynamic", "factor": 2.0}, 8192),
    (131072, LLAMA3_1, 131072),  # a llama3 config states the extended length already
])
def test_the_served_context_is_the_scaled_one(tmp_path, max_pos, scaling, served):
    """The context a checkpoint is served at by default, and the longest accepted, is
    its extended one (as vLLM derives it), not the pretrained length."""
    cfg = load_model_config(write_config(tmp_path, max_position_embeddings=max_pos,
                                         rope_scaling=scaling))
    assert cfg.max_context == served
    assert resolve_max_model_len(EngineConfig(model=str(tmp_path)), cfg) == served
    with pytest.raises(StartupError, match=f"supports: {served} tokens"):
        resolve_max_model_len(EngineConfig(model=str(tmp_path), max_model_len=served + 1), cfg)


def test_worker_refuses_token_ids_outside_the_vocabulary(default_model):
    runner = ModelRunner(EngineConfig(model=str(default_model), dtype="float32",
                                      kv_cache_memory=8 << 20, max_model_len=512),
                         TensorParallelGroup(0, 1), torch.device("cpu"))
    plan = StepPlan(0, new_seqs=[NewSequence(1, [0])],
                    chunks=[ScheduledChunk(1, [5, 8192], 0, True)])
    with pytest.raises(AssertionError, match="outside the vocabulary"):
        runner.execute(plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_hf_rotate_half_bit_for_bit(dtype):
    """Rotary.apply skips building rotate_half(x); the result is HF's to the bit, on a
    strided view too (q and k heads of the fused qkv output)."""
    from worker.layers import Rotary

    g = torch.Generator().manual_seed(3)
    rotary = Rotary([10000 ** (-i / 16) for i in range(16)], torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.arange(40) * 7, dtype)
    qkv = torch.randn(40, 7 * 32, generator=g).to(dtype)
    x = qkv[:, : 5 * 32].view(40, 5, 32)  # rows strided by 7 heads
    half = 16
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    assert torch.equal(Rotary.apply(x, cos, sin), x * cos + rotated * sin)
