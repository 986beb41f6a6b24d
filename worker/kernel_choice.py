"""Which compiled CPU kernel a rank uses, path by path: a kernel only where it beats the
plain-torch path on this machine.

The kernels (worker/cpu_kernels.py) were tuned on an AMD Zen 5 (AVX512_BF16, no AMX). On
an Intel Xeon with AMX their prefill attention ran at a third of torch's SDPA, whose bf16
GEMMs run on AMX tiles through oneDNN, while their decode attention stayed 3-6x ahead of
it: no one answer holds for every CPU, dtype and shape. So each path is decided once per
rank start -- prefill attention, decode attention (worker/attention/torch_backend.py), the
few-row linear layer at 1, 4 and 16 rows (worker/linear.py) and the elementwise passes
(worker/elementwise.py: the norms and SiLU measured, the rotary-and-store pass going with
them):

1. where no kernel exists for the dtype or shape, torch;
2. where the instruction set decides, by it: bf16 prefill on a CPU with `amx_bf16` goes
   to torch (AMX tiles, which the kernel has none of); bf16 on a CPU with no bf16
   instruction at all goes to the kernels, which widen to float32 FMAs where torch's bf16
   GEMMs are emulated (0.3 GFLOP/s against 105 in float32 measured on an AVX2-only EPYC);
3. otherwise by a short measurement (worker/kernel_measure.py): the engine's own two paths on the
   model's shapes at the rank's thread count -- a 256-token chunk behind a 4K-token cached
   prefix, a decode batch of 4 sequences of 2K tokens, the model's own linear weights at
   1, 4 and 16 rows, a layer's norms and SiLU -- alternated, best of a few runs; within
   10% a tie, which keeps the kernel (`TIE`).

Measured figures are cached beside the kernel build (`kernel_choice.json` in the build
directory of `cpu_kernels.build_name()`), keyed by all they depend on (`cache_key`), so a
later start reads them instead of measuring. Every start logs one `kernel_choice` event
with each path's choice, why, and the figures.

`DEEPINFER_KERNEL_CHOICE` forces the choice (tests, benchmarks): `kernels`, `torch`,
`measure` (the default), or per path, e.g. `prefill=torch,decode=kernels` (the paths not
named are measured). `DEEPINFER_CPU_KERNELS=0` still turns every kernel off.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from worker import cpu_kernels
from worker.budget import BF16_FLAGS, cpu_flags
from worker.cpu_kernels import PREFILL_KERNEL_HEAD_DIMS
from worker.elementwise import KERNEL_DTYPES as ELEMENTWISE_DTYPES
from worker.linear import KERNEL_DTYPES as LINEAR_DTYPES

ENV_CHOICE = "DEEPINFER_KERNEL_CHOICE"
MODES = ("kernels", "torch", "measure")
PATHS = ("prefill", "decode", "small_linear", "elementwise")
# The few-row linear layer is decided at these row counts; a row count up to
# worker/linear.py's SMALL_ROWS takes the verdict of the first at or above it.
LINEAR_ROWS = (1, 4, 16)
# What each verdict is named in the log and the cache: prefill, decode, small_linear_1, ...
VERDICTS = ("prefill", "decode", *(f"small_linear_{m}" for m in LINEAR_ROWS), "elementwise")
CACHE_FILE = "kernel_choice.json"
# torch is taken only where it is faster by more than this: within it the two are a tie,
# and the kernel stays (the path every earlier measurement and reference test ran). On a
# busy machine (2 cores shared with other work) a near tie came out either way from one
# start to the next; the choices that matter differ by 1.5-10x.
TIE = 0.9

log = structlog.get_logger("deepinfer.worker")

Measure = Callable[[str], tuple[float, float]]  # verdict name -> (kernel s, torch s)


@dataclass(frozen=True)
class ModelShapes:
    """What the measured paths depend on, for one rank (its share of heads and columns)."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int  # of the dense MLP on this rank (0: every layer a mixture of experts)
    linear: tuple[tuple[int, int], ...]  # a layer's weight shapes [N, K]
    kv_dtype: torch.dtype | None = None  # what the KV pages hold (None: `dtype`); FP8 or not,
    # the attention paths read it differently (worker/kv_quant.py)

    @property
    def kv(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass(frozen=True)
class Verdict:
    kernel: bool  # the compiled kernel is used; else torch
    by: str  # "measured", "cache", "instruction set", "no kernel", "forced", "default"
    why: str = ""
    kernel_ms: float | None = None
    torch_ms: float | None = None

    def describe(self) -> str:
        """`kernel` or `torch`, how it was decided, and the figures."""
        text = f"{'kernel' if self.kernel else 'torch'} ({self.by}"
        if self.kernel_ms is not None and self.torch_ms is not None:
            text += f": kernel {self.kernel_ms:.3f} ms, torch {self.torch_ms:.3f} ms"
        return text + (f"; {self.why})" if self.why else ")")


@dataclass(frozen=True)
class KernelChoice:
    verdicts: dict[str, Verdict]  # by VERDICTS name

    def uses(self, name: str) -> bool:
        return self.verdicts[name].kernel

    def linear_rows(self, small_rows: int) -> frozenset[int]:
        """The row counts (1 .. small_rows) the few-row linear kernel takes."""
        return frozenset(m for m in range(1, small_rows + 1)
                         if self.uses(f"small_linear_{_linear_bucket(m)}"))


def _linear_bucket(rows: int) -> int:
    return next((m for m in LINEAR_ROWS if m >= rows), LINEAR_ROWS[-1])


def _path(name: str) -> str:
    return "small_linear" if name.startswith("small_linear") else name


def override(text: str | None = None) -> dict[str, str]:
    """Each path's mode from DEEPINFER_KERNEL_CHOICE (or `text`): kernels, torch or measure."""
    text = (os.environ.get(ENV_CHOICE, "") if text is None else text).strip() or "measure"
    if text in MODES:
        return dict.fromkeys(PATHS, text)
    modes = dict.fromkeys(PATHS, "measure")
    for part in text.split(","):
        path, _, mode = (s.strip() for s in part.partition("="))
        if path not in PATHS or mode not in MODES:
            raise ValueError(
                f"{ENV_CHOICE}={text!r}: expected one of {', '.join(MODES)}, or "
                f"path=mode pairs separated by commas (paths {', '.join(PATHS)})")
        modes[path] = mode
    return modes


def unmeasured() -> KernelChoice:
    """The choice of a backend or layer built without a measurement (tests, benchmarks, a
    bare `create_backend`): the kernels, unless DEEPINFER_KERNEL_CHOICE forces torch."""
    modes = override()
    return KernelChoice({name: Verdict(modes[_path(name)] != "torch",
                                       "forced" if modes[_path(name)] != "measure" else "default")
                         for name in VERDICTS})


def rule(name: str, shapes: ModelShapes, flags: set[str]) -> Verdict | None:
    """The verdict where there is no kernel or the instruction set decides; None where
    only a measurement can."""
    path, dtype = _path(name), shapes.dtype
    kernel_dtypes = {"small_linear": LINEAR_DTYPES, "elementwise": ELEMENTWISE_DTYPES}
    if path in kernel_dtypes and dtype not in kernel_dtypes[path]:
        return Verdict(False, "no kernel", f"none for {str(dtype).removeprefix('torch.')}")
    if path == "prefill" and shapes.head_dim not in PREFILL_KERNEL_HEAD_DIMS:
        return Verdict(False, "no kernel", f"none for head dim {shapes.head_dim}")
    if dtype != torch.bfloat16:
        return None
    if path == "prefill" and "amx_bf16" in flags:
        return Verdict(False, "instruction set",
                       "amx_bf16: SDPA's bf16 GEMMs run on AMX tiles, the kernel has none")
    if path in ("prefill", "decode", "small_linear") and not flags & set(BF16_FLAGS):
        return Verdict(True, "instruction set",
                       "no bf16 instructions: torch's bf16 GEMMs are emulated, the kernel "
                       "widens to float32 FMAs")
    return None


def cache_key(shapes: ModelShapes, threads: int, build: str) -> str:
    """Everything the figures depend on: the kernel build (CPU flags and sources), torch
    (the other path), the dtype, the shapes and the thread count."""
    linear = ",".join(f"{n}x{k}" for n, k in shapes.linear)
    kv = "" if shapes.kv == shapes.dtype else f" kv {str(shapes.kv).removeprefix('torch.')}"
    return (f"{build} torch {torch.__version__} {str(shapes.dtype).removeprefix('torch.')} "
            f"heads {shapes.num_heads}/{shapes.num_kv_heads}x{shapes.head_dim} "
            f"hidden {shapes.hidden} intermediate {shapes.intermediate} linear {linear} "
            f"threads {threads}{kv}")


def decide(shapes: ModelShapes, key: str, flags: set[str], measure: Measure,
           cache: Path | None, modes: dict[str, str] | None = None) -> KernelChoice:
    """Each verdict by the rules, a forced mode, the cache or `measure`, in that order;
    what is measured is written to the cache."""
    modes = override() if modes is None else modes
    verdicts: dict[str, Verdict] = {}
    for name in VERDICTS:
        fixed, mode = rule(name, shapes, flags), modes[_path(name)]
        if fixed is not None and fixed.by == "no kernel":
            verdicts[name] = fixed
        elif mode != "measure":
            verdicts[name] = Verdict(mode == "kernels", "forced", f"{ENV_CHOICE}={mode}")
        elif fixed is not None:
            verdicts[name] = fixed
    todo = [name for name in VERDICTS if name not in verdicts]
    cached = _read_cache(cache).get(key, {}) if todo and cache is not None else {}
    figures: dict[str, dict[str, float]] = {}
    for name in todo:
        entry = cached.get(name)
        if isinstance(entry, dict) and {"kernel_ms", "torch_ms"} <= entry.keys():
            k_ms, t_ms, by = float(entry["kernel_ms"]), float(entry["torch_ms"]), "cache"
        else:
            k_s, t_s = measure(name)
            k_ms, t_ms, by = round(1000 * k_s, 4), round(1000 * t_s, 4), "measured"
        verdicts[name] = Verdict(t_ms >= TIE * k_ms, by, kernel_ms=k_ms, torch_ms=t_ms)
        figures[name] = {"kernel_ms": k_ms, "torch_ms": t_ms}
    if cache is not None and any(v.by == "measured" for v in verdicts.values()):
        if machine_busy():  # used for this start, measured again at the next
            log.info("kernel_choice_not_cached", why="the machine was busy",
                     load_average=round(os.getloadavg()[0], 2), cores=os.cpu_count())
        else:
            _write_cache(cache, key, figures)
    return KernelChoice({name: verdicts[name] for name in VERDICTS})


def machine_busy() -> bool:
    """Whether other work held every core (the load average over a minute at least the
    core count): figures measured then say more about that work than about the paths,
    and a cached verdict would outlive it."""
    return os.getloadavg()[0] >= (os.cpu_count() or 1)


def _read_cache(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or cut short: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, figures: dict[str, dict[str, float]]) -> None:
    """Merged into what is there, replaced at once (ranks of one machine may write side by
    side: the last one's read may miss another's entry, which is then measured again)."""
    data = _read_cache(path)
    data[key] = {**data.get(key, {}), **figures}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only build directory: measured again next start
        log.warning("kernel_choice_not_cached", path=str(path), error=str(e))


def cache_path() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(cpu_kernels.build_name(), False)) / CACHE_FILE


def choose(shapes: ModelShapes, measure: Measure) -> KernelChoice:
    """This rank's choice for a model on CPU: decided, logged, what was measured cached.
    Called once the weights are loaded and the rank's thread count set: it measures what
    the rank will run. `measure` (worker/kernel_measure.py) runs only where needed."""
    start = time.perf_counter()
    threads, flags, cache = torch.get_num_threads(), cpu_flags(), None
    if cpu_kernels.load() is None:  # off (DEEPINFER_CPU_KERNELS=0) or not built
        why = "DEEPINFER_CPU_KERNELS=0" if not cpu_kernels.enabled() else "kernels not built"
        choice = KernelChoice({name: Verdict(False, "no kernel", why) for name in VERDICTS})
    else:
        cache = cache_path()
        key = cache_key(shapes, threads, cpu_kernels.build_name())
        choice = decide(shapes, key, flags, measure, cache)
    log.info("kernel_choice", dtype=str(shapes.dtype).removeprefix("torch."),
             kv_dtype=str(shapes.kv).removeprefix("torch."),
             heads=f"{shapes.num_heads}/{shapes.num_kv_heads}", head_dim=shapes.head_dim,
             threads=threads, isa=[f for f in ("amx_bf16", "avx512_bf16", "avx512f", "fma")
                                   if f in flags],
             seconds=round(time.perf_counter() - start, 3),
             load_average=round(os.getloadavg()[0], 2),
             cache=str(cache) if cache is not None else None,
             **{name: v.describe() for name, v in choice.verdicts.items()})
    return choice
