"""tools/benchmarks/kv_dtype.py: FP8 KV against the model's dtype, on small settings."""

from __future__ import annotations

import json

import pytest

from tools.benchmarks.kv_dtype import main

pytestmark = pytest.mark.slow


def test_fp8_against_the_models_dtype(default_model, tmp_path, capsys):
    out = tmp_path / "kv.json"
    main(["--model", str(default_model), "--dtype", "float32", "--prompts", "2",
          "--new-tokens", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    auto, e4m3, e5m2 = (report["kv"][kv] for kv in ("auto", "fp8_e4m3", "fp8_e5m2"))
    # tiny-llama: 8 layers, 4 KV heads of 64; float32 against a byte and a 4-byte scale
    assert auto["bytes_per_token"] == 2 * 8 * 4 * 64 * 4
    assert e4m3["bytes_per_token"] == e5m2["bytes_per_token"] == 2 * 8 * 4 * (64 + 4)
    assert e4m3["tokens_per_gib"] == pytest.approx(auto["tokens_per_gib"] * 256 / 68)
    assert e4m3["disk_tokens_per_gib"] < e4m3["tokens_per_gib"]  # record headers, alignment
    assert auto["greedy_same_prompts"] == 2 and "max_logit_diff" not in auto  # itself
    for fp8 in (e4m3, e5m2):
        assert 0 < fp8["mean_logit_diff"] < fp8["max_logit_diff"] < report["logit_scale"]
        assert 0 <= fp8["argmax_agreement"] <= 1 and fp8["decode_tok_s"] > 0
    printed = capsys.readouterr().out
    assert printed.startswith("machine: ") and "fp8_e5m2" in printed
