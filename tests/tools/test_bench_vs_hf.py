"""tools/benchmarks/vs_hf.py and tools/benchmarks/machine.py, end to end on the tiny model and
small shapes."""

from __future__ import annotations

import json

import pytest

from tools.benchmarks import machine
from tools.benchmarks import vs_hf as bench_vs_hf

pytestmark = pytest.mark.slow


def test_machine_is_described_with_its_measured_rates():
    info = machine.describe()
    assert info["cores"] >= 1 and info["cpu"] and info["torch_threads"] >= 1
    assert set(info["flags"]) <= set(machine.VECTOR_FLAGS)
    assert info["matmul_gflop_s"]["float32"] > 0 and info["copy_gb_s"] > 0
    line = machine.summary_line(info)
    assert "GFLOP/s" in line and "GB/s" in line


def test_both_engines_measured_side_by_side(default_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    bench_vs_hf.main(["--model", str(default_model), "--prompt-len", "64",
                      "--decode-prompt-len", "16", "--decode-steps", "2", "--batch-sizes", "1,2",
                      "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    for name in ("deepinfer", "transformers"):
        assert result[name]["prefill_tok_s"] > 0
        assert set(result[name]["decode_tok_s"]) == {"1", "2"}
    assert result["limits"]["prefill_tok_s"] > 0 and result["limits"]["decode_steps_s"] > 0
    printed = capsys.readouterr().out
    assert "DeepInfer / HF" in printed and "machine:" in printed
