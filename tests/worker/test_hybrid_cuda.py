"""Hybrid models on CUDA (skipped without a GPU; `make gpu-check` runs them).

- float32: the three tiny hybrids (torch attention and the torch delta rule, as float32
  runs on CUDA) give HF's logits and greedy tokens, the prompt prefilled in chunks;
- bfloat16: FlashInfer (or the torch backend) for the attention layers and the kernels
  worker/delta_kernels.py picks for the linear ones (fla and causal_conv1d where they are
  installed) stay within bf16 rounding of float32, teacher-forced (dense Qwen3.5);
- fla's and causal_conv1d's kernels, where installed, through our adapters, against the
  torch reference on the same inputs;
- a device tier sized by profiling (--gpu-memory-utilization) holds the state slots
  beside the blocks.

Written without a GPU to run them on: until one is lent, they are the CUDA path's
specification, not yet its evidence (docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.test_reference import BF16_LOGIT_TOL, make_prompt
from wire.config import EngineConfig
from wire.step import DecodeBatch, NewSequence, ScheduledChunk, StepPlan
from worker.delta_kernels import delta_ops, torch_chunk, torch_step
from worker.distributed import TensorParallelGroup
from worker.gated_delta import causal_conv, causal_conv_step
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.cuda

NEW_TOKENS = 8
CHUNK = 23  # prompt tokens a step: each chunk reads the state the one before left
BLOCK = 16


def cuda_runner(model, dtype: str, attention_backend: str = "auto", **config) -> ModelRunner:
    config = {"kv_cache_memory": 4 << 20, **config}
    return ModelRunner(EngineConfig(model=str(model), dtype=dtype, max_model_len=256,
                                    max_num_seqs=4, attention_backend=attention_backend,
                                    **config),
                       TensorParallelGroup(0, 1), torch.device("cuda"))


def generate(runner: ModelRunner, prompt: list[int],
             new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits [len(prompt), vocab] (prefilled CHUNK tokens a step) and
    `new_tokens` greedy tokens (the first from the prompt's last logits, then decodes)."""
    blocks = list(range(-(-(len(prompt) + new_tokens) // BLOCK)))
    logits, step = [], 0
    for start in range(0, len(prompt), CHUNK):
        new = [NewSequence(1, blocks, state_slot=0)] if start == 0 else []
        last = start + CHUNK >= len(prompt)
        plan = StepPlan(step, new_seqs=new,
                        chunks=[ScheduledChunk(1, prompt[start:start + CHUNK], start, last)])
        logits.append(runner.execute(plan, return_logits=True).logits.float().cpu())
        step += 1
    prompt_logits = torch.cat(logits)
    tokens = [int(prompt_logits[-1].argmax())]
    while len(tokens) < new_tokens:
        plan = StepPlan(step, decodes=DecodeBatch([1], [len(prompt) + len(tokens) - 1],
                                                  [tokens[-1]]))
        tokens.append(int(runner.execute(plan, return_logits=True).logits[-1].argmax()))
        step += 1
    return prompt_logits, tokens


def test_float32_hybrids_on_cuda_give_hf_logits_and_tokens(hybrid_models, hf_reference):
    for arch, path in hybrid_models.items():
        prompt, ref_logits, ref_tokens = hf_reference(str(path), NEW_TOKENS)
        logits, tokens = generate(cuda_runner(path, "float32"), prompt, NEW_TOKENS)
        scale = ref_logits.abs().max().item()
        diff = (logits - ref_logits).abs().max().item()
        assert diff < 1e-3 * scale, f"{arch}: max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
        assert tokens == ref_tokens, arch


@pytest.fixture(scope="module")
def qwen3_5_head_dim_64(tmp_path_factory) -> Path:
    """The tiny Qwen3.5 with attention heads of 64, which FlashInfer has kernels for (the
    tiny one's 32 runs the torch backend, worker/attention/__init__.py); rotary over 8
    dims of each, as the tiny one's, for its M-RoPE sections."""
    from tools.tiny_models.hybrid import HybridSpec, write_hybrid

    out = tmp_path_factory.mktemp("tiny-qwen3-5-d64")
    write_hybrid(HybridSpec(arch="qwen3_5", seed=0, head_dim=64, partial_rotary_factor=0.125),
                 out, {"bos": 0, "eos": 3, "pad": 8})
    return out


# The dense Qwen3.5 only: on the CPU, teacher-forced over the prompt and float32's tokens,
# its bf16 logits are within 2.3% of the scale of float32's, while the MoE hybrids' are
# 21% and 33% off (transformers' own bf16 Qwen3.5-MoE: 19%), their routing flipped by
# bf16 rounding: no bound worth stating. The linear and attention layers are the same.
@pytest.mark.parametrize("attention_backend", ["auto", "torch"])  # auto: FlashInfer
def test_bfloat16_hybrid_on_cuda_close_to_float32(qwen3_5_head_dim_64, attention_backend):
    path = qwen3_5_head_dim_64
    prompt = make_prompt(8192)
    _, f32_tokens = generate(cuda_runner(path, "float32"), prompt, NEW_TOKENS)
    full = prompt + f32_tokens  # teacher-forced: logits at every position
    f32, _ = generate(cuda_runner(path, "float32"), full, 1)
    runner = cuda_runner(path, "bfloat16", attention_backend)
    if attention_backend == "auto":
        assert type(runner.forward_pass.attn).__name__ == "FlashInferAttentionBackend"
    bf16, _ = generate(runner, full, 1)
    scale = f32.abs().max().item()
    deviation = (bf16 - f32).abs().max().item()
    ops = runner.model.delta_ops.name
    assert deviation < BF16_LOGIT_TOL * scale, (
        f"{ops}: bf16 off by {deviation:.3g}, scale {scale:.3g}")
    top2 = f32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * deviation
    assert clear.sum() >= len(full) // 8, "too few clear positions for a meaningful check"
    flips = (~(f32.argmax(-1) == bf16.argmax(-1)) & clear).nonzero().flatten().tolist()
    assert not flips, f"{ops}: bf16 argmax differs at clear positions {flips}"


def _rule_inputs(num: int, hk: int, hv: int, d: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(num, hk, d, generator=gen, device="cuda") for _ in range(2))
    v = torch.randn(num, hv, d, generator=gen, device="cuda")
    g = -torch.rand(num, hv, generator=gen, device="cuda") * 0.5
    beta = torch.rand(num, hv, generator=gen, device="cuda")
    return q, k, v, g, beta, gen


# The tiny hybrids' shapes (4 key heads, 8 value heads, 32 dims): fla autotunes its
# kernels per shape, and the model tests above run these same ones, so the Triton
# compilations are paid once within gpu-check's time for the cuda tests.
def test_fla_kernels_through_the_adapters_equal_the_torch_rule():
    pytest.importorskip("fla.ops.gated_delta_rule")
    ops = delta_ops(torch.device("cuda"), torch.bfloat16)
    assert "fla" in ops.name.split(";")[0], ops.name
    hk, hv, d = 4, 8, 32
    # 200 tokens: three full blocks of 64 and a short one
    q, k, v, g, beta, gen = _rule_inputs(200, hk, hv, d)
    state = torch.randn(hv, d, d, generator=gen, device="cuda") * 0.1
    bf = [t.bfloat16() for t in (q, k, v)]
    o, after = ops.chunk(*bf, g, beta, state)
    o_ref, after_ref = torch_chunk(*(t.float() for t in bf), g, beta, state)
    assert after.dtype == torch.float32 and after.shape == after_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0.02 * o_ref.abs().max().item())
    torch.testing.assert_close(after, after_ref, rtol=0,
                               atol=0.02 * after_ref.abs().max().item())
    # one token each of 3 sequences, each with its own state
    q, k, v, g, beta, gen = _rule_inputs(3, hk, hv, d, seed=1)
    states = torch.randn(3, hv, d, d, generator=gen, device="cuda") * 0.1
    bf = [t.bfloat16() for t in (q, k, v)]
    o, after = ops.step(*bf, g, beta, states)
    o_ref, after_ref = torch_step(*(t.float() for t in bf), g, beta, states)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0.02 * o_ref.abs().max().item())
    torch.testing.assert_close(after, after_ref, rtol=0,
                               atol=0.02 * after_ref.abs().max().item())


def test_causal_conv1d_kernels_through_the_adapters_equal_the_torch_conv():
    pytest.importorskip("causal_conv1d")
    ops = delta_ops(torch.device("cuda"), torch.bfloat16)
    assert "causal_conv1d" in ops.name.split(";")[1], ops.name
    gen = torch.Generator(device="cuda").manual_seed(2)
    c = 512  # a multiple of 8, as the channel-last kernel needs
    x = torch.randn(37, c + 24, generator=gen, device="cuda").bfloat16()[:, :c]  # strided
    window = torch.randn(c, 3, generator=gen, device="cuda").bfloat16()
    weight = torch.randn(c, 4, generator=gen, device="cuda").bfloat16()
    out, padded = ops.conv(x, window, weight)
    out_ref, padded_ref = causal_conv(x, window, weight)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=0.02, atol=0.02)
    assert torch.equal(padded, padded_ref)
    windows = torch.randn(3, c, 3, generator=gen, device="cuda").bfloat16()
    before = windows.clone()
    out, after = ops.conv_step(x[:3], windows, weight)
    out_ref, after_ref = causal_conv_step(x[:3], windows, weight)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=0.02, atol=0.02)
    assert torch.equal(after, after_ref) and torch.equal(windows, before)


def test_a_profiled_device_tier_holds_the_state_beside_the_blocks(hybrid_models):
    fraction = 0.2
    runner = cuda_runner(hybrid_models["qwen3_5"], "bfloat16", kv_cache_memory=0,
                         gpu_memory_utilization=fraction, max_num_batched_tokens=256)
    assert runner.num_state_slots >= 4 and runner.num_device_blocks > 0
    total = torch.cuda.get_device_properties(0).total_memory
    assert runner.kv.k.nbytes + runner.kv.v.nbytes + runner.state.nbytes <= fraction * total
    prompt = make_prompt(8192)
    _, tokens = generate(runner, prompt, 4)
    assert len(tokens) == 4
