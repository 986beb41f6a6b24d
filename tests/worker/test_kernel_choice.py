"""The rank's kernel choice (worker/kernel_choice.py): each compiled CPU kernel where it
beats torch, by the instruction set or a measurement, cached and logged; forced by
DEEPINFER_KERNEL_CHOICE. Timings are injected (a fake measure) and CPU flags given, so
nothing here depends on the machine's speed or flags."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from tests.worker.test_reference import NEW_TOKENS
from worker import kernel_choice
from worker.kernel_choice import (
    ENV_CHOICE,
    VERDICTS,
    ModelShapes,
    cache_key,
    decide,
    override,
)
from worker.linear import SMALL_ROWS

F32 = ModelShapes(torch.float32, 8, 4, 64, 256, 512, ((512, 256), (256, 256), (1024, 256),
                                                      (256, 512)))
BF16 = ModelShapes(torch.bfloat16, *[getattr(F32, f) for f in (
    "num_heads", "num_kv_heads", "head_dim", "hidden", "intermediate", "linear")])
ZEN4 = {"avx2", "fma", "avx512f", "avx512_bf16"}  # bf16 dot products, no AMX
XEON_AMX = ZEN4 | {"amx_tile", "amx_bf16"}
AVX2_ONLY = {"avx2", "fma"}
MEASURE_ALL = dict.fromkeys(kernel_choice.PATHS, "measure")
MACHINE_BUSY = kernel_choice.machine_busy  # the real one, before any test patches it


class FakeMeasure:
    """(kernel s, torch s) per verdict from a table; counts what it was asked."""

    def __init__(self, seconds: dict[str, tuple[float, float]]) -> None:
        self.seconds = seconds
        self.asked: list[str] = []

    def __call__(self, name: str) -> tuple[float, float]:
        self.asked.append(name)
        return self.seconds[name]


def never(name: str) -> tuple[float, float]:
    raise AssertionError(f"{name} was measured")


# kernel faster on prefill, decode, 1 and 16 rows; torch on 4 rows and the elementwise
TIMES = {"prefill": (0.010, 0.030), "decode": (0.002, 0.010), "small_linear_1": (0.001, 0.002),
         "small_linear_4": (0.004, 0.002), "small_linear_16": (0.003, 0.005),
         "elementwise": (0.002, 0.001)}


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The machine counts as idle (what is measured is cached) whatever its load here."""
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: False)


def test_the_faster_path_wins_per_kernel():
    measure = FakeMeasure(TIMES)
    choice = decide(F32, "key", ZEN4, measure, None, MEASURE_ALL)
    assert sorted(measure.asked) == sorted(VERDICTS)
    assert {name: choice.uses(name) for name in VERDICTS} == {
        "prefill": True, "decode": True, "small_linear_1": True, "small_linear_4": False,
        "small_linear_16": True, "elementwise": False}
    assert choice.verdicts["small_linear_4"].kernel_ms == 4.0
    assert choice.verdicts["small_linear_4"].torch_ms == 2.0
    # rows 2-4 take the verdict at 4, rows 5-16 the one at 16
    assert choice.linear_rows(SMALL_ROWS) == frozenset([1, *range(5, SMALL_ROWS + 1)])


def test_a_near_tie_keeps_the_kernel():
    """Within TIE the two paths are a tie (a measurement's noise on a busy machine), and
    the kernel stays; a clear win for torch takes torch."""
    times = dict(TIMES, prefill=(0.0100, 0.0095), decode=(0.0100, 0.0080))
    choice = decide(F32, "key", ZEN4, FakeMeasure(times), None, MEASURE_ALL)
    assert choice.uses("prefill") and not choice.uses("decode")


def test_the_cache_is_written_read_back_and_keyed(tmp_path):
    cache = tmp_path / "kernel_choice.json"
    first = decide(F32, "key one", ZEN4, FakeMeasure(TIMES), cache, MEASURE_ALL)
    assert {v.by for v in first.verdicts.values()} == {"measured"}
    stored = json.loads(cache.read_text())
    assert stored["key one"]["decode"] == {"kernel_ms": 2.0, "torch_ms": 10.0}

    again = decide(F32, "key one", ZEN4, never, cache, MEASURE_ALL)  # no measurement
    assert {v.by for v in again.verdicts.values()} == {"cache"}
    assert {n: again.uses(n) for n in VERDICTS} == {n: first.uses(n) for n in VERDICTS}
    assert again.verdicts["prefill"].torch_ms == 30.0

    other = FakeMeasure({name: (t, k) for name, (k, t) in TIMES.items()})  # the reverse
    third = decide(F32, "key two", ZEN4, other, cache, MEASURE_ALL)
    assert sorted(other.asked) == sorted(VERDICTS)
    assert {n: third.uses(n) for n in VERDICTS} != {n: first.uses(n) for n in VERDICTS}
    assert set(json.loads(cache.read_text())) == {"key one", "key two"}


def test_a_damaged_cache_is_measured_again(tmp_path):
    cache = tmp_path / "kernel_choice.json"
    cache.write_text('{"key": {"prefill": {"kernel_ms": 1.0}}, ')  # cut short
    measure = FakeMeasure(TIMES)
    decide(F32, "key", ZEN4, measure, cache, MEASURE_ALL)
    assert sorted(measure.asked) == sorted(VERDICTS)
    assert set(json.loads(cache.read_text())) == {"key"}


def test_figures_measured_on_a_busy_machine_are_used_but_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: True)
    cache = tmp_path / "kernel_choice.json"
    choice = decide(F32, "key", ZEN4, FakeMeasure(TIMES), cache, MEASURE_ALL)
    assert {v.by for v in choice.verdicts.values()} == {"measured"}
    assert not choice.uses("small_linear_4") and not cache.exists()
    measure = FakeMeasure(TIMES)  # the next start measures again
    decide(F32, "key", ZEN4, measure, cache, MEASURE_ALL)
    assert sorted(measure.asked) == sorted(VERDICTS)


def test_busy_means_every_core_held(monkeypatch):
    monkeypatch.setattr(kernel_choice, "machine_busy", MACHINE_BUSY)
    monkeypatch.setattr(kernel_choice.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernel_choice.os, "getloadavg", lambda: (1.9, 0.0, 0.0))
    assert not kernel_choice.machine_busy()
    monkeypatch.setattr(kernel_choice.os, "getloadavg", lambda: (2.0, 0.0, 0.0))
    assert kernel_choice.machine_busy()


def test_the_key_holds_everything_the_figures_depend_on():
    base = cache_key(F32, 2, "build_a")
    assert base == cache_key(F32, 2, "build_a")
    others = [cache_key(BF16, 2, "build_a"), cache_key(F32, 1, "build_a"),
              cache_key(F32, 2, "build_b"),
              cache_key(ModelShapes(torch.float32, 4, 4, 64, 256, 512, F32.linear), 2,
                        "build_a"),
              cache_key(ModelShapes(torch.float32, 8, 4, 64, 256, 512, F32.linear[:2]), 2,
                        "build_a")]
    assert base not in others and len(set(others)) == len(others)


def test_fp8_kv_has_figures_of_its_own():
    """Both attention paths read FP8 pages otherwise (the kernels widen them per row, torch
    reads back what it gathers): their figures are keyed apart; KV in the model's dtype,
    named or not, keeps the key it had."""
    fp8 = replace(BF16, kv_dtype=torch.float8_e4m3fn)
    assert cache_key(fp8, 2, "b").endswith(" kv float8_e4m3fn")
    assert cache_key(fp8, 2, "b") != cache_key(BF16, 2, "b")
    assert cache_key(replace(BF16, kv_dtype=torch.bfloat16), 2, "b") == cache_key(BF16, 2, "b")


def test_attention_is_measured_over_fp8_pages(kernels):
    """measure_model's attention races run each path over FP8 pages and their scales."""
    from worker.kernel_measure import measure_model

    shapes = ModelShapes(torch.bfloat16, 4, 2, 64, 64, 96, ((128, 64),), torch.float8_e5m2)
    measure = measure_model(shapes, [[torch.randn(128, 64).to(torch.bfloat16)]], 1e-5)
    for name in ("prefill", "decode"):
        kernel_s, torch_s = measure(name)
        assert 0 < kernel_s < 10 and 0 < torch_s < 10, (name, kernel_s, torch_s)


@pytest.mark.parametrize("forced", ["kernels", "torch"])
def test_the_env_override_forces_either_path(forced, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_CHOICE, forced)
    choice = decide(F32, "key", ZEN4, never, tmp_path / "c.json", None)
    assert {choice.uses(name) for name in VERDICTS} == {forced == "kernels"}
    assert {v.by for v in choice.verdicts.values()} == {"forced"}
    assert not (tmp_path / "c.json").exists()  # nothing measured, nothing cached
    assert {kernel_choice.unmeasured().uses(name) for name in VERDICTS} == {forced == "kernels"}


def test_the_override_by_path(monkeypatch):
    monkeypatch.setenv(ENV_CHOICE, "prefill=torch, decode=kernels")
    measure = FakeMeasure(TIMES)
    choice = decide(F32, "key", ZEN4, measure, None, None)
    assert not choice.uses("prefill") and choice.uses("decode")
    assert sorted(measure.asked) == sorted(set(VERDICTS) - {"prefill", "decode"})
    unmeasured = kernel_choice.unmeasured()
    assert not unmeasured.uses("prefill") and unmeasured.uses("small_linear_4")


@pytest.mark.parametrize("text", ["fast", "prefill=fast", "attention=torch", "prefill"])
def test_a_bad_override_is_refused_clearly(text):
    with pytest.raises(ValueError, match=ENV_CHOICE):
        override(text)


def test_the_instruction_set_decides_without_measuring_where_it_can():
    # bf16 with AMX: prefill to SDPA's AMX GEMMs, the rest measured
    measure = FakeMeasure(TIMES)
    amx = decide(BF16, "key", XEON_AMX, measure, None, MEASURE_ALL)
    assert not amx.uses("prefill") and amx.verdicts["prefill"].by == "instruction set"
    assert "prefill" not in measure.asked and "decode" in measure.asked
    # bf16 with no bf16 instructions: the kernels, which widen to float32 FMAs
    measure = FakeMeasure(TIMES)
    emulated = decide(BF16, "key", AVX2_ONLY, measure, None, MEASURE_ALL)
    assert measure.asked == ["elementwise"]
    assert all(emulated.uses(n) for n in VERDICTS if n != "elementwise")
    # float32 on the same CPUs: measured
    for flags in (XEON_AMX, AVX2_ONLY):
        measure = FakeMeasure(TIMES)
        decide(F32, "key", flags, measure, None, MEASURE_ALL)
        assert sorted(measure.asked) == sorted(VERDICTS)


def test_where_there_is_no_kernel_not_even_forcing_takes_one():
    f16 = ModelShapes(torch.float16, 8, 4, 96, 256, 512, F32.linear)  # head dim 96
    measure = FakeMeasure(TIMES)
    choice = decide(f16, "key", ZEN4, measure, None, dict.fromkeys(kernel_choice.PATHS,
                                                                   "kernels"))
    assert [n for n in VERDICTS if choice.uses(n)] == ["decode"]
    assert {choice.verdicts[n].by for n in VERDICTS if n != "decode"} == {"no kernel"}
    assert measure.asked == []


def test_kernels_off_choose_torch_everywhere_without_measuring(monkeypatch):
    """DEEPINFER_CPU_KERNELS=0 still turns every kernel off: nothing measured, nothing
    cached, and the log says why."""
    from worker import cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    with capture_logs() as logs:
        choice = kernel_choice.choose(F32, never)
    assert not any(choice.uses(name) for name in VERDICTS)
    [event] = [e for e in logs if e["event"] == "kernel_choice"]
    assert event["cache"] is None
    assert event["prefill"] == "torch (no kernel; DEEPINFER_CPU_KERNELS=0)"


def test_the_real_measurement_times_both_paths():
    """measure_model runs the engine's two paths for each verdict (only that they ran is
    checked: which one is faster is this machine's business)."""
    from worker import cpu_kernels
    from worker.kernel_measure import measure_model

    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    shapes = ModelShapes(torch.float32, 4, 2, 32, 64, 96, ((128, 64), (64, 128), (192, 64),
                                                         (64, 96)))
    layers = [[torch.randn(n, k, generator=g) for n, k in shapes.linear] for _ in range(2)]
    measure = measure_model(shapes, layers, 1e-5)
    for name in VERDICTS:
        kernel_s, torch_s = measure(name)
        assert 0 < kernel_s < 10 and 0 < torch_s < 10, (name, kernel_s, torch_s)


def test_a_model_on_cpu_logs_its_choice_and_runs_it(default_model, monkeypatch):
    """A loaded model takes the choice (forced here): its linear layers, elementwise
    passes and attention backend each run the chosen path, and one `kernel_choice` event
    says so."""
    from worker import cpu_kernels
    from worker.attention import create_backend
    from worker.distributed import TensorParallelGroup
    from worker.gguf import load_config
    from worker.model import LlamaModel

    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    monkeypatch.setenv(ENV_CHOICE, "prefill=torch,decode=kernels,small_linear=torch,"
                                   "elementwise=kernels")
    cpu = torch.device("cpu")
    model = LlamaModel(load_config(default_model), TensorParallelGroup(0, 1), torch.float32,
                       cpu)
    with capture_logs() as logs:
        model.load(str(default_model))
    events = [e for e in logs if e["event"] == "kernel_choice"]
    assert len(events) == 1
    assert events[0]["prefill"].startswith("torch (forced")
    assert events[0]["decode"].startswith("kernel (forced")
    assert model.linear.kernel_rows == frozenset()
    assert model.elementwise.kernels is not None
    backend = create_backend("torch", model.num_heads, model.num_kv_heads, model.head_dim, 16,
                             torch.float32, cpu, model.kernel_choice)
    assert not backend._prefill_in_kernel and backend._decode_in_kernel


# Each forced choice, whole paths and mixed: the engine's logits and greedy tokens stay
# HF transformers' (tests/worker/test_reference.py's check, world size 1).
FORCED = ["torch", "kernels", "prefill=kernels,decode=torch,small_linear=torch",
          "prefill=torch,decode=kernels,elementwise=torch"]


@pytest.mark.slow
@pytest.mark.parametrize("forced", FORCED)
def test_each_forced_choice_matches_hf(forced, default_model, hf_reference, monkeypatch,
                                       tmp_path):
    from tests.worker.ranks import run_ranks

    monkeypatch.setenv(ENV_CHOICE, forced)  # the rank process inherits it
    prompt, ref_logits, ref_tokens = hf_reference(str(default_model))
    out = run_ranks(1, tmp_path / "out.st", model=str(default_model), dtype="float32",
                    prompt=prompt, chunk=len(prompt), new_tokens=NEW_TOKENS)
    scale = ref_logits.abs().max().item()
    diff = (out["logits"] - ref_logits).abs().max().item()
    assert diff < 1e-3 * scale, f"max |logits - HF| = {diff:.3g}, scale {scale:.3g}"
    assert out["tokens"].tolist() == ref_tokens
