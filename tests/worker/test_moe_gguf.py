"""Mixture-of-experts GGUFs: the tiny Qwen3-MoE (GGUF arch `qwen3moe`) and Mixtral (arch
`llama` with experts, Q/K permuted), written by the test as llama.cpp's converter does
(experts stacked into `ffn_{gate,up,down}_exps`, the router as `ffn_gate_inp`), load to
the config and the logits the HF directories give, and a rank's expert slices of a
quantized file are the gguf package's own dequantization, cut.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch

from tests.worker.gguf_files import run_engine, write_gguf
from tests.worker.ranks import run_ranks
from tests.worker.test_moe_reference import scaled_copy
from tests.worker.test_reference import make_prompt
from worker.gguf import GGUFCheckpointReader, load_gguf_config
from worker.model_config import load_model_config
from worker.moe import expert_names, router_name

Q = gguf.GGMLQuantizationType
MODELS = ["qwen3_moe_model", "mixtral_model"]


@pytest.fixture(scope="module")
def gguf_of(tmp_path_factory):
    out, made = tmp_path_factory.mktemp("moe-gguf"), {}

    def get(model_dir: Path, qtype: Q = Q.F32) -> Path:
        key = (model_dir, qtype)
        if key not in made:
            made[key] = write_gguf(model_dir, out / f"{model_dir.name}-{qtype.name}.gguf", qtype)
        return made[key]

    return get


@pytest.mark.parametrize("model_name", MODELS)
def test_config_equals_the_hf_config(model_name, gguf_of, request):
    model_dir = request.getfixturevalue(model_name)
    hf = load_model_config(model_dir)
    assert load_gguf_config(gguf_of(model_dir)) == dataclasses.replace(hf, torch_dtype="float32")


@pytest.mark.parametrize("model_name", MODELS)
def test_gguf_gives_the_hf_dir_logits_and_tokens(model_name, gguf_of, request):
    model_dir = request.getfixturevalue(model_name)
    prompt = make_prompt(8192, 40)
    ref_logits, ref_tokens = run_engine(model_dir, prompt, 8)
    logits, tokens = run_engine(gguf_of(model_dir), prompt, 8)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert tokens == ref_tokens


def test_yarn_gguf_equals_the_hf_dir(qwen3_moe_model, tmp_path):
    """A yarn rope_scaling crosses into GGUF metadata and back, logits past the original
    context included."""
    model = scaled_copy(qwen3_moe_model, tmp_path / "yarn", {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256)
    path = write_gguf(model, tmp_path / "yarn.gguf")
    hf = load_model_config(model)
    assert hf.rope_scaling["rope_type"] == "yarn"
    assert load_gguf_config(path) == dataclasses.replace(hf, torch_dtype="float32")
    prompt = make_prompt(8192, 100, seed=1)
    ref_logits, ref_tokens = run_engine(model, prompt, 4)
    logits, tokens = run_engine(path, prompt, 4)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.slow
def test_gguf_split_over_two_ranks_matches_the_hf_dir(mixtral_model, gguf_of, tmp_path):
    """Each rank reads its rows of the stacked gate/up and its columns of down."""
    prompt = make_prompt(8192, 40)
    ref_logits, ref_tokens = run_engine(mixtral_model, prompt, 8)
    out = run_ranks(2, tmp_path / "out.st", model=str(gguf_of(mixtral_model)),
                    dtype="float32", prompt=prompt, chunk=len(prompt), new_tokens=8)
    torch.testing.assert_close(out["logits"], ref_logits, rtol=0, atol=1e-4)
    assert out["tokens"].tolist() == ref_tokens


@pytest.mark.parametrize("model_name", MODELS)
def test_expert_slices_of_a_quantized_file(model_name, gguf_of, request):
    model_dir = request.getfixturevalue(model_name)
    path = gguf_of(model_dir, Q.Q8_0)
    cfg = load_gguf_config(path)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    reader = GGUFCheckpointReader(path, torch.float32, False)

    def whole(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())

    layer, expert = cfg.moe_layers[-1], 5
    gate, up, down = expert_names(cfg, layer, expert)
    m = cfg.moe_intermediate_size // 2  # rank 1 of 2
    assert tensors[f"blk.{layer}.ffn_gate_exps.weight"].tensor_type == Q.Q8_0
    assert torch.equal(reader.rows(gate, m, 2 * m),
                       whole(f"blk.{layer}.ffn_gate_exps.weight")[expert, m:])
    assert torch.equal(reader.rows(up, 0, m), whole(f"blk.{layer}.ffn_up_exps.weight")[expert, :m])
    assert torch.equal(reader.cols(down, m, 2 * m),
                       whole(f"blk.{layer}.ffn_down_exps.weight")[expert, :, m:])
    assert torch.equal(reader.full(router_name(cfg, layer)),
                       whole(f"blk.{layer}.ffn_gate_inp.weight"))
