"""tools/make_tiny_model: the generated checkpoints load in HF transformers, are
byte-identical run to run, and carry a working tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tools.tiny_models.make import STAMP_NAME, make_tiny_model
from tools.tiny_models.tokenizer import IM_END_TOKEN, SPECIAL_TOKENS

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is in setup.cfg?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "read_file", "arguments": {"path": "setup.cfg"}},
            }
        ],
    },
    {"role": "tool", "content": "[metadata]\nname = deepinfer"},
    {"role": "assistant", "content": "It names the package deepinfer."},
    {"role": "user", "content": "Thanks — ¿y ahora? 日本語 🚀"},
]

TEXT_SAMPLES = [
    "hello world",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "   leading and trailing spaces   ",
    "naïve café, Grüße, ½ — “quotes”",
    "日本語のテキスト 한국어 中文 🚀🔥 emoji",
    '<|im_start|>user\nhi<|im_end|>\n<tool_call>{"a": 1}</tool_call>',
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The only model in this file whose tokenizer is trained; the others copy it.
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", quiet=True)


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("small")
    return {
        arch: make_tiny_model(base / arch, arch=arch, tokenizer_from=llama_dir, quiet=True)
        for arch in ("qwen3", "qwen2")
    }


def load_hf(model_dir: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def assert_weights_match_file(model: torch.nn.Module, model_dir: Path) -> None:
    # HF silently random-inits any weight it cannot find, so check every tensor landed.
    file_tensors = load_file(str(model_dir / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in file_tensors.items():
        assert name in state, f"{name} not used by the HF model"
        torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0, msg=name)


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_default_layout(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (8192, 512, 8)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 4, 64)
    assert cfg["intermediate_size"] == 1408 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"

    tensors = load_file(str(llama_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    per_layer = {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(8) for n in per_layer}
    assert set(tensors) == expected
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 64, 512)

    # Special tokens hold ids 0..8 in the documented order; eos is <|im_end|>.
    tok = json.loads((llama_dir / "tokenizer.json").read_text())
    added = {e["content"]: e["id"] for e in tok["added_tokens"]}
    assert [added[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert cfg["eos_token_id"] == added[IM_END_TOKEN]
    gen = json.loads((llama_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == added[IM_END_TOKEN]


def test_default_loads_in_hf_with_useful_logits(llama_dir: Path) -> None:
    model = load_hf(llama_dir)
    assert_weights_match_file(model, llama_dir)
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode("import os\nprint(os.getcwd())\n")
    out = logits(model, ids)
    assert torch.isfinite(out).all()
    # Non-degenerate: logits spread out, no single token takes all the mass, and the
    # prediction changes along the sequence.
    assert out.std(dim=-1).min() > 1.0
    assert out.softmax(-1).max(-1).values.max() < 0.99
    assert len(set(out.argmax(-1).tolist())) > 1
    # The context matters (a test of the KV cache needs this): changing the first
    # token moves the last position's logits.
    changed = [ids[0] + 1, *ids[1:]]
    assert (logits(model, changed)[-1] - out[-1]).abs().mean() > 0.1


def test_byte_identical_across_runs(llama_dir: Path, tmp_path: Path) -> None:
    # A fresh process through the CLI: tokenizer retrained, weights regenerated.
    out = tmp_path / "again"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.tiny_models.make", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "params" in proc.stdout
    for name in (
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
    ):
        assert sha256(out / name) == sha256(llama_dir / name), name


def test_second_run_is_skipped(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = {
        "num_layers": 1,
        "hidden_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
    }
    out = make_tiny_model(tmp_path / "m", tokenizer_from=llama_dir, **small)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()

    make_tiny_model(out, tokenizer_from=llama_dir, **small)
    assert "nothing to do" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime

    # Other arguments: regenerated, with different weights.
    before = sha256(out / "model.safetensors")
    make_tiny_model(out, seed=1, tokenizer_from=llama_dir, **small)
    assert "nothing to do" not in capsys.readouterr().out
    assert sha256(out / "model.safetensors") != before
    assert json.loads((out / STAMP_NAME).read_text())["args"]["spec"]["seed"] == 1

    # An incomplete directory (a file cut short) is not mistaken for a finished one.
    (out / "model.safetensors").write_bytes(b"truncated")
    make_tiny_model(out, seed=1, tokenizer_from=llama_dir, **small)
    assert (
        sha256(out / "model.safetensors")
        == json.loads((out / STAMP_NAME).read_text())["files"]["model.safetensors"]["sha256"]
    )


def test_qwen3_loads_in_hf(small_dirs: dict[str, Path]) -> None:
    model_dir = small_dirs["qwen3"]
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert "model.layers.0.self_attn.q_norm.weight" in tensors
    assert "model.layers.0.self_attn.k_norm.weight" in tensors

    model = load_hf(model_dir)
    assert_weights_match_file(model, model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = logits(model, list(range(10, 40)))
    assert torch.isfinite(out).all() and out.std(dim=-1).min() > 1.0


def test_qwen2_loads_in_hf(small_dirs: dict[str, Path]) -> None:
    model_dir = small_dirs["qwen2"]
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is False
    tensors = load_file(str(model_dir / "model.safetensors"))
    for proj in ("q", "k", "v"):
        assert f"model.layers.0.self_attn.{proj}_proj.bias" in tensors
    assert "lm_head.weight" in tensors

    model = load_hf(model_dir)
    assert_weights_match_file(model, model_dir)
    out = logits(model, list(range(10, 40)))
    assert torch.isfinite(out).all() and out.std(dim=-1).min() > 1.0


def test_tokenizer_round_trips_and_agrees_across_archs(
    llama_dir: Path, small_dirs: dict[str, Path]
) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    # transformers picks a different tokenizer class per model_type (Qwen2Tokenizer for
    # qwen2, rebuilt with its own pre-tokenizer); all must give the raw file's ids.
    for model_dir in (llama_dir, *small_dirs.values()):
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        assert len(tok) == 8192
        for text in TEXT_SAMPLES:
            ids = tok.encode(text)
            assert ids == raw.encode(text).ids, (model_dir.name, text)
            assert tok.decode(ids) == text
            assert raw.decode(ids, skip_special_tokens=False) == text
    # The tool-call markers are single tokens that survive skip_special_tokens.
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>{}</tool_call>"


def test_chat_template_with_tools(llama_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    text = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert (
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.cfg"}}\n</tool_call>'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n[metadata]\nname = deepinfer\n"
        "</tool_response><|im_end|>\n"
    ) in text
    assert "<|im_start|>assistant\nIt names the package deepinfer.<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>user\nThanks — ¿y ahora? 日本語 🚀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.count("<|im_start|>") == 7  # 6 turns (the tool turn as user) + prompt

    # Tokenized: starts at <|im_start|>, no BOS prepended, round-trips to the text.
    ids = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text

    # Without tools there is no tools section; arguments given as a JSON string (as
    # OpenAI clients send them) are not encoded twice.
    plain = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
        ],
        tokenize=False,
    )
    assert plain == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
    )


def test_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path / "a", num_heads=6, num_kv_heads=4, quiet=True)
    with pytest.raises(ValueError, match="qwen2"):
        make_tiny_model(tmp_path / "b", arch="qwen2", head_dim=64, quiet=True)
    with pytest.raises(TypeError):
        make_tiny_model(tmp_path / "c", hidden=3, quiet=True)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_models_are_deterministic_and_route_to_every_expert(
        arch: str, llama_dir: Path, tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", arch=arch, tokenizer_from=llama_dir, quiet=True)
    b = make_tiny_model(tmp_path / "b", arch=arch, tokenizer_from=llama_dir, quiet=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha256(a / name) == sha256(b / name), name
    spec = json.loads((a / STAMP_NAME).read_text())["args"]["spec"]
    assert spec["num_experts"] == 8 and spec["num_experts_per_tok"] == 2
    # a dense model's stamp has no MoE fields: the stamps made before MoE still match
    assert "num_experts" not in json.loads((llama_dir / STAMP_NAME).read_text())["args"]["spec"]
    # the router spreads tokens over all experts with clear choices (a wrong routing
    # would show in the logits, not hide in a tie)
    router = next(t for n, t in load_file(str(a / "model.safetensors")).items()
                  if n.endswith(".gate.weight")).float()
    x = torch.nn.functional.rms_norm(torch.randn(512, router.shape[1],
                                                 generator=torch.Generator().manual_seed(0)),
                                     (router.shape[1],))
    top = torch.softmax(x @ router.t(), -1).topk(3, dim=-1)
    assert top.indices[:, :2].unique().numel() == 8
    assert ((top.values[:, 1] - top.values[:, 2]) > 1e-4).float().mean() > 0.95
