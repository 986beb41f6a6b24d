"""Mixture-of-experts GGUFs: the tiny Qwen3-MoE (GGUF arch `qwen3moe`) and Mixtral (arch
`llama` with experts, Q/K permuted), written by the test as llama.cpp's converter does
(experts stacked into `ffn_{gate,up,down}_exps`, the router as `ffn_gate_inp`), load to
the config and the logits the HF directories give, and a rank's expert slices of a
quantized file are the gguf package's own dequantization, cut; a rank reads only its
slices of every expert, from either source.
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
from worker.gguf import GGUFCheckpointReader, load_config, load_gguf_config
from worker.model_config import load_model_config
from worker.moe import expert_names, load_moe_weights, router_name
from worker.weights import CheckpointReader

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
    assert len(out["routing"]) == 1 and out["routing"] != {""}  # both ranks routed alike


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


class RecordingReader:
    """A checkpoint reader that notes every read: (name, how, start, end)."""

    def __init__(self, reader) -> None:
        self.reader, self.reads = reader, []

    def full(self, name: str) -> torch.Tensor:
        self.reads.append((name, "full", None, None))
        return self.reader.full(name)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        self.reads.append((name, "rows", start, end))
        return self.reader.rows(name, start, end)

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        self.reads.append((name, "cols", start, end))
        return self.reader.cols(name, start, end)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("model_name", MODELS)
def test_a_rank_reads_only_its_slices_of_every_expert(model_name, source, gguf_of, request):
    """Rank 2 of 4: each expert's gate/up rows and down columns of its quarter, once; the
    router whole; nothing else of the layer's MLP. The slices are the whole tensors' cut."""
    model_dir = request.getfixturevalue(model_name)
    path = model_dir if source == "hf" else gguf_of(model_dir, Q.Q8_0)
    cfg = load_config(path)
    reader = CheckpointReader(path, torch.float32, False) if source == "hf" else \
        GGUFCheckpointReader(path, torch.float32, False)
    spy = RecordingReader(reader)
    layer, rank, world_size = cfg.moe_layers[-1], 2, 4
    w = load_moe_weights(spy, cfg, layer, rank, world_size)
    m = cfg.moe_intermediate_size // world_size
    expected = [(router_name(cfg, layer), "full", None, None)]
    for e in range(cfg.num_experts):
        gate, up, down = expert_names(cfg, layer, e)
        expected += [(gate, "rows", 2 * m, 3 * m), (up, "rows", 2 * m, 3 * m),
                     (down, "cols", 2 * m, 3 * m)]
    assert sorted(spy.reads, key=str) == sorted(expected, key=str)  # each read once
    gate, up, down = expert_names(cfg, layer, 5)
    torch.testing.assert_close(w.gate_up[5], torch.cat([reader.full(gate)[2 * m : 3 * m],
                                                        reader.full(up)[2 * m : 3 * m]]),
                               rtol=0, atol=0)
    torch.testing.assert_close(w.down[5], reader.full(down)[:, 2 * m : 3 * m], rtol=0, atol=0)


def test_a_column_cut_inside_a_block_dequantizes_only_its_blocks(mixtral_model, gguf_of,
                                                                 monkeypatch):
    """An expert's down columns 16:32 of 64 in Q8_0 (32-column blocks): one block of each
    row is dequantized, not the row (a K-quant block is 256 columns; a rank's share of a
    real expert, 768 / 2, ends inside one)."""
    path = gguf_of(mixtral_model, Q.Q8_0)
    cfg = load_gguf_config(path)
    reader = GGUFCheckpointReader(path, torch.float32, False)
    _, _, down = expert_names(cfg, 0, 3)
    whole = reader.full(down)
    dequantize, widths = gguf.quants.dequantize, []

    def recording(data, qtype):
        widths.append(data.shape[-1])
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", recording)
    torch.testing.assert_close(reader.cols(down, 16, 32), whole[:, 16:32], rtol=0, atol=0)
    torch.testing.assert_close(reader.cols(down, 24, 40), whole[:, 24:40], rtol=0, atol=0)
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_0][1]
    assert widths == [block_bytes, 2 * block_bytes]  # a row is 2 blocks: the first cut, 1
