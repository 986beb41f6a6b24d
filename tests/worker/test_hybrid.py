"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet layers beside gated
attention, their state in slots.

- the delta rule's chunked form equals its recurrent form, and the chunked conv its steps;
- the three tiny hybrids (written by transformers) give HF's logits and greedy tokens at
  world sizes 1, 2 and 4, float32 (one launch of the ranks per world size);
- a prompt prefilled in several chunks, with a snapshot taken mid-chunk and restored
  into another sequence's slot (`state_copy`), gives the logits of one chunk;
- a multimodal wrapper's checkpoint (text model under model.language_model.) loads;
- speculative decoding is refused at the rank's start.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.worker.ranks import run_ranks_many
from tests.worker.test_reference import make_prompt
from wire.config import EngineConfig, SpeculativeConfig
from wire.step import DecodeBatch, NewSequence, ScheduledChunk, StepPlan
from worker.distributed import TensorParallelGroup
from worker.gated_delta import (
    causal_conv,
    causal_conv_step,
    chunked_delta_rule,
    normalize_qk,
    recurrent_delta_rule,
    sum_taps,
    window_after,
)
from worker.gguf import load_config
from worker.model_config import UnsupportedModelError
from worker.model_runner import ModelRunner

HF_NEW_TOKENS = 8  # greedy tokens checked against HF at every world size


def test_chunked_delta_rule_equals_the_recurrent_rule():
    g = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 45, 2, 4, 16, 8  # 45: blocks of 16 and a short one
    q, k = (torch.randn(t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.rand(t, hv, generator=g)
    beta = torch.rand(t, hv, generator=g)
    start = torch.randn(hv, dk, dv, generator=g)
    qn, kn = normalize_qk(q, k, hv)
    out, end = chunked_delta_rule(qn, kn, v, decay, beta, start, block=16)
    state, steps = start[None], []
    for i in range(t):
        o, state = recurrent_delta_rule(qn[i:i + 1], kn[i:i + 1], v[i:i + 1],
                                        decay[i:i + 1], beta[i:i + 1], state)
        steps.append(o)
    assert torch.allclose(out, torch.cat(steps), atol=1e-5)
    assert torch.allclose(end, state[0], atol=1e-5)
    # the state is carried: two pieces give what one run does
    _, mid = chunked_delta_rule(qn[:20], kn[:20], v[:20], decay[:20], beta[:20], start)
    _, end2 = chunked_delta_rule(qn[20:], kn[20:], v[20:], decay[20:], beta[20:], mid)
    assert torch.allclose(end2, end, atol=1e-5)


def test_chunked_conv_equals_its_steps():
    g = torch.Generator().manual_seed(1)
    t, c, width = 9, 6, 4
    x, weight = torch.randn(t, c, generator=g), torch.randn(c, width, generator=g)
    window = torch.randn(c, width - 1, generator=g)
    out, padded = causal_conv(x, window, weight)
    windows, steps = window[None], []
    for i in range(t):
        y, windows = causal_conv_step(x[i:i + 1], windows, weight)
        steps.append(y)
        assert torch.equal(windows[0], window_after(padded, i + 1, width))
    assert torch.allclose(out, torch.cat(steps), atol=1e-6)
    # the taps summed (CUDA float32's conv: cuDNN's would round to TF32) are the conv
    torch.testing.assert_close(F.silu(sum_taps(padded, weight)), out)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_hybrids_match_hf(world_size, hybrid_models, hf_reference, tmp_path):
    """Logits within 1e-3 of their scale and the greedy tokens of HF, every hybrid; the
    prompt prefilled in chunks of 23 (each chunk reading the state the one before left)."""
    refs = {arch: hf_reference(str(path), HF_NEW_TOKENS) for arch, path in hybrid_models.items()}
    outs = run_ranks_many(world_size, [
        dict(model=str(path), dtype="float32", prompt=refs[arch][0], chunk=23,
             new_tokens=HF_NEW_TOKENS, out=tmp_path / f"{arch}.st")
        for arch, path in hybrid_models.items()])
    for (arch, (_, ref_logits, ref_tokens)), out in zip(refs.items(), outs):
        scale = ref_logits.abs().max().item()
        diff = (out["logits"] - ref_logits).abs().max().item()
        assert diff < 1e-3 * scale, f"{arch}: max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
        assert out["tokens"].tolist() == ref_tokens, arch
        assert len(out["digests"]) == 1, f"{arch}: ranks ended with different cache state"
        assert len(out["routing"]) == 1, f"{arch}: ranks routed tokens differently"


def runner_for(model, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model), dtype="float32", kv_cache_memory=4 << 20,
                                    max_model_len=256, max_num_seqs=4, **config),
                       TensorParallelGroup(0, 1), torch.device("cpu"))


def test_chunks_and_a_restored_snapshot_give_the_logits_of_one_chunk(hybrid_models):
    runner = runner_for(hybrid_models["qwen3_next"])
    prompt = make_prompt(8192, n=40, seed=3)

    def logits(plan: StepPlan) -> torch.Tensor:
        return runner.execute(plan, return_logits=True).logits

    whole = logits(StepPlan(0, new_seqs=[NewSequence(1, [0, 1, 2], state_slot=0)],
                            chunks=[ScheduledChunk(1, prompt, 0, True)]))
    # seq 2: three chunks; the second leaves the state after 16 tokens (3 into it) in slot 7
    pieces = [logits(StepPlan(1, new_seqs=[NewSequence(2, [3, 4, 5], state_slot=1)],
                              chunks=[ScheduledChunk(2, prompt[:13], 0, False)])),
              logits(StepPlan(2, chunks=[ScheduledChunk(2, prompt[13:29], 13, False,
                                                        state_snapshots=[(3, 7)])])),
              logits(StepPlan(3, chunks=[ScheduledChunk(2, prompt[29:], 29, True)]))]
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-4 * whole.abs().max())
    # seq 3: a prefix hit on seq 2's first block, the snapshot restored into its slot
    resumed = logits(StepPlan(4, new_seqs=[NewSequence(3, [3, 6, 7], state_slot=2)],
                              state_copy=[(7, 2)],
                              chunks=[ScheduledChunk(3, prompt[16:], 16, True)]))
    assert torch.allclose(resumed, whole[16:], atol=1e-4 * whole.abs().max())
    # a decode of seq 1 and seq 3 batched (the recurrent form over their slots) beside a
    # fresh one-chunk run of the same context
    token = int(whole[-1].argmax())
    decodes = DecodeBatch([1, 3], [len(prompt)] * 2, [token] * 2)
    stepped = logits(StepPlan(5, decodes=decodes, new_seqs=[
        NewSequence(4, [8, 9, 10], state_slot=3)],
        chunks=[ScheduledChunk(4, prompt + [token], 0, True)]))
    assert torch.allclose(stepped[0], stepped[-1], atol=1e-4 * whole.abs().max())
    assert torch.allclose(stepped[1], stepped[-1], atol=1e-4 * whole.abs().max())


def test_a_multimodal_wrapper_loads_its_text_model(hybrid_models, tmp_path):
    """Qwen3.5's published checkpoints are Qwen3_5ForConditionalGeneration: the text
    model's config in `text_config`, its weights under model.language_model."""
    src = hybrid_models["qwen3_5"]
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "tie_word_embeddings": False}))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(src / "model.safetensors").items()}
    weights["model.visual.patch_embed.weight"] = torch.zeros(2)  # not read
    save_file(weights, tmp_path / "model.safetensors")
    assert load_config(tmp_path) == load_config(src)
    plan = StepPlan(0, new_seqs=[NewSequence(1, [0], state_slot=0)],
                    chunks=[ScheduledChunk(1, [5, 6, 7], 0, True)])
    ours, theirs = (runner_for(d).execute(plan, return_logits=True).logits
                    for d in (tmp_path, src))
    assert torch.equal(ours, theirs)


def test_hybrid_config_counts_kv_of_attention_layers_only(hybrid_models):
    cfg = load_config(hybrid_models["qwen3_5_moe"])
    assert cfg.is_hybrid and cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert cfg.kv_bytes_per_token(1, 4) == 2 * 1 * cfg.num_kv_heads * cfg.head_dim * 4
    assert cfg.shared_expert_intermediate_size == 128 and cfg.rotary_dim == 8
    cfg.check_tensor_parallel(4)
    with pytest.raises(UnsupportedModelError, match="linear_num_value_heads=6"):
        dataclasses.replace(cfg, linear_num_value_heads=6).check_tensor_parallel(4)


def test_speculative_decoding_is_refused_for_a_hybrid(hybrid_models):
    with pytest.raises(UnsupportedModelError, match="--speculative-config"):
        runner_for(hybrid_models["qwen3_5"], speculative=SpeculativeConfig(method="ngram"))
