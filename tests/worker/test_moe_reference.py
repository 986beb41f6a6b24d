"""Mixture-of-experts models and long-context rope scalings equal HF transformers.

The tiny Qwen3-MoE (q/k norm, norm_topk_prob, a dense layer among the sparse ones) and
Mixtral, float32, at world sizes 1, 2 and 4 on gloo: prompt logits within 1e-3 of the
logits' scale, 32 identical greedy tokens, one digest. Then YaRN (its attention factor
derived from the factor, from mscale, and stated), linear and dynamic NTK configured over
a small original context (64) and a 100-token prompt: logits equal HF's at the positions
past the original length, and so do the greedy tokens after them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.worker.gguf_files import run_engine
from tests.worker.test_reference import make_prompt
from worker.gguf import load_config
from worker.model_config import UnsupportedModelError
from worker.moe import MoEWeights, moe_forward

ORIGINAL_MAX = 64
LONG_PROMPT = 100
ROPE_TOKENS = 8


# The MoE models against HF at world size 1, 2 and 4: test_reference.py, with the dense ones.


def test_config_reads_the_sparse_layers(qwen3_moe_model, mixtral_model):
    q, m = load_config(qwen3_moe_model), load_config(mixtral_model)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_layers, q.norm_topk_prob) == (
        8, 2, (0, 2, 3), True)  # mlp_only_layers=[1]
    assert q.qk_norm and not m.qk_norm
    assert m.moe_layers == (0, 1) and m.moe_intermediate_size == m.intermediate_size


def test_what_cannot_be_split_or_served_is_refused(qwen3_moe_model, tmp_path):
    cfg = load_config(config_copy(qwen3_moe_model, tmp_path / "odd", moe_intermediate_size=66))
    cfg.check_tensor_parallel(2)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size=66 does not divide"):
        cfg.check_tensor_parallel(4)
    shared = config_copy(qwen3_moe_model, tmp_path / "shared",
                         shared_expert_intermediate_size=64)
    with pytest.raises(UnsupportedModelError, match="shared expert"):
        load_config(shared)


def test_grouped_experts_equal_a_per_token_loop():
    """The grouped matmuls give what each token's own top-k experts give, weighted."""
    g = torch.Generator().manual_seed(0)
    e, h, m, t = 6, 16, 8, 40
    w = MoEWeights(router=torch.randn(e, h, generator=g), gate_up=torch.randn(e, 2 * m, h,
                   generator=g), down=torch.randn(e, h, m, generator=g), top_k=2,
                   norm_topk_prob=False)
    x = torch.randn(t, h, generator=g)
    probs = torch.softmax(x @ w.router.t(), -1)
    expected = torch.zeros(t, h)
    for i in range(t):
        top = probs[i].topk(2)
        for p, j in zip(top.values, top.indices):
            gate, up = (w.gate_up[j] @ x[i]).chunk(2)
            expected[i] += p * (w.down[j] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_forward(x, w), expected, rtol=1e-5, atol=1e-5)


def test_unnormalised_top_k_and_sparse_step_match_hf(default_model, tmp_path):
    """norm_topk_prob=false (HF's Qwen3-MoE default: the top-k softmax weights as they
    are) and decoder_sparse_step=2 with no mlp_only_layers: layers 1 and 3 sparse."""
    from tools.tiny_models.make import make_tiny_model

    made = make_tiny_model(tmp_path / "made", arch="qwen3_moe", mlp_only_layers=(0, 2),
                           tokenizer_from=default_model, quiet=True)
    model = config_copy(made, tmp_path / "m", norm_topk_prob=False, decoder_sparse_step=2,
                        mlp_only_layers=[])
    cfg = load_config(model)
    assert cfg.moe_layers == (1, 3) and not cfg.norm_topk_prob
    prompt = make_prompt(8192, 40, seed=2)
    ref_logits, ref_tokens = hf_cached_greedy(model, prompt, ROPE_TOKENS)
    logits, tokens = run_engine(model, prompt, ROPE_TOKENS)
    assert (logits - ref_logits).abs().max().item() < 1e-3 * ref_logits.abs().max().item()
    assert tokens == ref_tokens


# --- long-context rope scaling ---------------------------------------------------------

ROPE_CONFIGS = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
              "original_max_position_embeddings": ORIGINAL_MAX}, 4 * ORIGINAL_MAX),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "original_max_position_embeddings": ORIGINAL_MAX}, 4 * ORIGINAL_MAX),
    # the attention factor as the config states it, not derived from the factor
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                               "original_max_position_embeddings": ORIGINAL_MAX},
                              4 * ORIGINAL_MAX),
    "linear": ({"rope_type": "linear", "factor": 4.0}, ORIGINAL_MAX),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL_MAX),
}


def config_copy(model_dir: Path, out: Path, **changes) -> Path:
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def scaled_copy(model_dir: Path, out: Path, scaling: dict | None, max_pos: int) -> Path:
    return config_copy(model_dir, out, rope_scaling=scaling, max_position_embeddings=max_pos)


def hf_cached_greedy(model_dir: Path, prompt: list[int], n: int) -> tuple[torch.Tensor, list]:
    """HF's prompt logits and greedy tokens with its KV cache (as `generate` runs): for
    dynamic NTK the cached keys keep the frequencies they were written with."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logits, past, tokens = out.logits[0], out.past_key_values, []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return logits, tokens


@pytest.mark.parametrize("kind", sorted(ROPE_CONFIGS))
def test_rope_scaling_matches_hf_past_the_original_context(kind, qwen3_moe_model, tmp_path):
    scaling, max_pos = ROPE_CONFIGS[kind]
    model = scaled_copy(qwen3_moe_model, tmp_path / kind, scaling, max_pos)
    prompt = make_prompt(8192, LONG_PROMPT, seed=1)
    ref_logits, ref_tokens = hf_cached_greedy(model, prompt, ROPE_TOKENS)
    logits, tokens = run_engine(model, prompt, ROPE_TOKENS)
    scale = ref_logits.abs().max().item()
    past = slice(ORIGINAL_MAX, None)  # the positions the scaling is for
    diff = (logits[past] - ref_logits[past]).abs().max().item()
    assert diff < 1e-3 * scale, f"{kind}: max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
    assert (logits - ref_logits).abs().max().item() < 1e-3 * scale
    assert tokens == ref_tokens
    # and the scaling did something: unscaled rope gives other logits past the original
    plain = scaled_copy(qwen3_moe_model, tmp_path / "plain", None, 4 * ORIGINAL_MAX)
    unscaled, _ = run_engine(plain, prompt, 1)
    assert (unscaled[past] - ref_logits[past]).abs().max().item() > 1e-2 * scale
