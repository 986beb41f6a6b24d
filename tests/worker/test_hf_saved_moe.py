"""Mixture-of-experts checkpoints as the installed transformers (5.x) saves them.

Its config.json names the expert count `num_local_experts` (Qwen3-MoE's and Mixtral's
`attribute_map` alias of `num_experts`; the engine read Qwen3-MoE's as `num_experts`,
defaulted to 128 and looked for expert 8 of 8), and, asked not to revert its own layout
(`save_original_format=False`), it stacks every expert of a layer in one tensor. A tiny
random Qwen3-MoE and Mixtral, built from transformers' config classes and saved with
`save_pretrained` (a tokenizer copied from models/tiny-llama), load through the engine's
loader and give HF's logits and greedy tokens at world size 2; one is served by
`deepinfer-run serve`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.ranks import run_ranks
from tests.worker.test_moe_reference import config_copy
from tests.worker.test_reference import NEW_TOKENS
from tools.harness.served import Served
from tools.tiny_models.make import TOKENIZER_FILES
from worker import model_config
from worker.gguf import load_config
from worker.model_config import SUPPORTED_ARCHITECTURES, attribute_map
from worker.moe import load_moe_weights
from worker.weights import CheckpointReader

FAMILIES = ("qwen3_moe", "mixtral")
LAYOUTS = {"per-expert": True, "fused": False}  # save_pretrained's save_original_format


def save_hf_moe(family: str, out: Path, tokenizer_from: Path, original_format: bool) -> Path:
    """A tiny random `family` model (8 experts, top-2; Qwen3-MoE with a dense layer 1)
    made and saved by transformers itself."""
    import transformers

    common = dict(vocab_size=8192, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  num_experts_per_tok=2, bos_token_id=0, eos_token_id=3, pad_token_id=8,
                  initializer_range=0.2)  # HF's 0.02 leaves near-uniform logits
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32,
                                             intermediate_size=64, mlp_only_layers=[1],
                                             norm_topk_prob=True, **common)
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(num_local_experts=8, intermediate_size=32,
                                            **common)
        model_class = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    model_class(config).save_pretrained(out, save_original_format=original_format)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_saved(default_model, tmp_path_factory):
    """(family, layout) -> the checkpoint's directory, each saved once."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, layout: str) -> Path:
        if (family, layout) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{layout}")
            made[family, layout] = save_hf_moe(family, out, default_model, LAYOUTS[layout])
        return made[family, layout]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_expert_count_transformers_saves(family, hf_saved):
    model = hf_saved(family, "per-expert")
    saved = json.loads((model / "config.json").read_text())
    assert saved["num_local_experts"] == 8 and "num_experts" not in saved
    cfg = load_config(model)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.moe_layers == ((0, 2) if family == "qwen3_moe" else (0, 1, 2))


def test_the_aliases_are_transformers_own_and_known_without_it(hf_saved, monkeypatch):
    """The engine's table of aliases is the installed transformers' attribute_map of every
    family served, and a config is read through it with transformers not importable."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for family in SUPPORTED_ARCHITECTURES.values():
        installed = CONFIG_MAPPING[family].attribute_map
        assert attribute_map(family).items() >= installed.items(), family
        assert model_config.ATTRIBUTE_MAPS.get(family, {}) == installed, family
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert attribute_map("qwen3_moe") == {"num_experts": "num_local_experts"}
    assert load_config(hf_saved("qwen3_moe", "per-expert")).num_experts == 8


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_expert_count_the_weights_do_not_have_is_refused(layout, hf_saved, tmp_path):
    model = config_copy(hf_saved("mixtral", layout), tmp_path / "m", num_local_experts=4)
    reader = CheckpointReader(model, torch.float32, show_progress=False)
    with pytest.raises(ValueError, match="holds 8 experts .* config.json says 4"):
        load_moe_weights(reader, load_config(model), layer=0, rank=0, world_size=1,
                         stacked=layout == "fused")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_hf(family, layout, hf_saved, hf_reference, tmp_path):
    """At world size 2: each rank reads its half of every expert (of the stacked tensors
    too) and the router whole."""
    model = str(hf_saved(family, layout))
    prompt, ref_logits, ref_tokens = hf_reference(model)
    out = run_ranks(2, tmp_path / "out.st", model=model, dtype="float32", prompt=prompt,
                    chunk=len(prompt), new_tokens=NEW_TOKENS)
    scale = ref_logits.abs().max().item()
    diff = (out["logits"] - ref_logits).abs().max().item()
    assert diff < 1e-3 * scale, f"max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
    assert out["tokens"].tolist() == ref_tokens
    assert len(out["digests"]) == 1 and len(out["routing"]) == 1


@pytest.mark.slow
def test_serve_answers_from_a_transformers_saved_moe(hf_saved, hf_reference, tmp_path):
    from tests.orchestrator.e2e_helpers import complete

    model = hf_saved("qwen3_moe", "per-expert")
    prompt, _, ref_tokens = hf_reference(str(model))
    engine = Served(model, tmp_path / "run", nproc=2)
    try:
        out = complete(engine.url, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                       ignore_eos=True)
    finally:
        assert engine.stop() == 0, engine.errors()
    assert out["choices"][0]["token_ids"] == ref_tokens
