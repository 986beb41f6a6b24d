"""What a benchmark prints beside its figures: the machine, and its measured limits.

The CPU differs from session to session (one had AMX bf16, another AVX2 only, where a
bf16 matmul ran at 0.3 GFLOP/s against 105 in float32), so every figure is read against
the CPU's model, its vector flags, the threads used, and the matmul and memory-copy rates
measured on the spot with those threads.
"""

from __future__ import annotations

import os
import platform
import time

from rich.console import Console

from worker.budget import cpu_flags as worker_cpu_flags

# The flags that decide what a CPU forward can reach.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                "amx_int8", "bf16", "asimd", "sve")


def cpu_model() -> str:
    """The model name, with the x86 family and model numbers where the name alone does not
    tell the generation (a VM's "AMD EPYC" was a Zen 4 one session and a Zen 5 the next,
    and the kernels' figures differ between them)."""
    fields: dict[str, str] = {}  # each key's first value: the first processor's
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model")
    if not name:
        return platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def cpu_flags() -> list[str]:
    """The VECTOR_FLAGS this CPU has (the ranks read the same line to choose a dtype)."""
    have = worker_cpu_flags()
    return [f for f in VECTOR_FLAGS if f in have]


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflop_s(dtype_name: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """An n x n x n matmul's rate with the current torch threads: the roof for prefill."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats) / 1e9


def copy_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth as a large tensor copy sees it (read + write): the roof for decode,
    which reads every weight once a step."""
    import torch

    src = torch.empty(megabytes << 18, dtype=torch.float32).fill_(1.0)  # MiB / 4 bytes
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def describe(measure: bool = True) -> dict:
    """The machine as a dict (JSON-ready); with `measure`, the rates with this process's
    torch threads (seconds of work)."""
    import torch

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags(),
            "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]}
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # the libraries held below the CPU's own
        info["isa_cap"] = os.environ["ATEN_CPU_CAPABILITY"]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    if measure:
        info["matmul_gflop_s"] = {d: round(matmul_gflop_s(d), 1) for d in ("float32", "bfloat16")}
        info["copy_gb_s"] = round(copy_gb_s(), 1)
    return info


def print_summary(console: Console, info: dict) -> None:
    """The summary line on one line whatever the console's width: a CPU with a long flag
    list (AMX adds three) must not push words onto the next line, where a reader or a
    test looking for them would not find them together."""
    console.print(summary_line(info), soft_wrap=True, markup=False, highlight=False)


def summary_line(info: dict) -> str:
    line = (f"machine: {info['cpu']}, {info['cores']} cores, flags "
            f"{' '.join(info['flags']) or 'none of note'}; torch {info['torch']}, "
            f"{info['torch_threads']} threads")
    if info.get("isa_cap"):
        line += f"; code held to {info['isa_cap']} (--cap-isa)"
    if "matmul_gflop_s" in info:
        mm = info["matmul_gflop_s"]
        line += (f"; measured: matmul {mm['float32']:,.0f} GFLOP/s float32, "
                 f"{mm['bfloat16']:,.0f} bfloat16; copy {info['copy_gb_s']:,.1f} GB/s")
    return line + f"; load average {info['load_avg_1m']:.2f}"
