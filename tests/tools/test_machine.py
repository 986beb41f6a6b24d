"""The machine line every benchmark prints: one line on every CPU kind, whatever the
console's width and however long the CPU's flag list (an Intel Xeon with AMX lists three
more flags than an AMD Zen 5, and a wrapped line split "GFLOP/s" from "float32")."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tools.benchmarks import attention as bench_attention
from tools.benchmarks import machine
from worker import cpu_kernels

# The CPU kinds these machines come in, as their lines would read (names as seen).
CPU_KINDS = {
    "avx2 only": ("AMD EPYC (family 23, model 49)", ["avx2", "fma"]),
    "avx512 bf16, no AMX": ("AMD EPYC (family 26, model 2)",
                            ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]),
    "AMX": ("Intel(R) Xeon(R) Platinum 8488C (family 6, model 143)", list(machine.VECTOR_FLAGS)),
}


def _info(cpu: str, flags: list[str]) -> dict:
    return {"cpu": cpu, "cores": 2, "flags": flags, "torch": "2.13.0+cpu", "python": "3.11.7",
            "torch_threads": 2, "load_avg_1m": 0.5,
            "matmul_gflop_s": {"float32": 399.5, "bfloat16": 1464.2}, "copy_gb_s": 27.3}


@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
@pytest.mark.parametrize("width", [40, 80, 200])
def test_summary_is_one_line_at_any_width(kind: str, width: int) -> None:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    machine.print_summary(console, _info(*CPU_KINDS[kind]))
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "GFLOP/s float32" in text and " ".join(CPU_KINDS[kind][1]) in text


def test_attention_benchmark_prints_the_rates_on_an_amx_machine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The failure seen on the AMX Xeon, replayed on any CPU: its flag list, a narrow
    console, and the benchmark's own printing."""
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    monkeypatch.setattr(machine, "cpu_flags", lambda: list(machine.VECTOR_FLAGS))
    monkeypatch.setattr(machine, "cpu_model", lambda: CPU_KINDS["AMX"][0])
    bench_attention.main(["--dtypes", "float32", "--repeats", "1", "--max-layers", "1"],
                         Console(width=80))
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("machine: ") and "amx_bf16" in first and "GFLOP/s float32" in first
