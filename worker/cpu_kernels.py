"""The compiled CPU kernels: paged attention (decode, prefill) and the few-row linear layer.

Decoding is memory-bound on CPU, and plain torch reads memory badly in both places:
- Attention reads every sequence's whole context once per layer. Gathering the pages
  into a padded copy first (all plain torch can do) reads and writes that context twice
  more; at 16 sequences of 3,000 tokens the gather cost several times the attention
  itself. `csrc/paged_decode.cpp` reads the pages where they are, 16 keys' dot products
  reduced together and bf16 pairs multiplied by the CPU's bf16 dot product, and reads
  the pages that several sequences share (a common system prompt) once for all of them.
- A linear layer over a few rows (a decode batch, a speculative verify) is a read of
  its weights; torch's GEMM reads them at a fraction of the memory's rate.
  `csrc/small_linear.cpp` streams them once (worker/linear.py picks it).
- A prefill chunk's attention is compute-bound; torch's fused SDPA needs the pages
  gathered first and computes bfloat16 in float32 FMAs, at half a bf16 CPU's rate.
  `csrc/paged_prefill.cpp` reads the pages in place and multiplies bf16 pairs with
  the CPU's bf16 dot product (AVX512_BF16) where it has one.
- The elementwise passes of a layer (RMSNorm after the residual add, SiLU * up, the
  rotary of q and k with the K/V stores) are one pass each in `csrc/elementwise.cpp`,
  not four to ten torch ops.
- FP8 KV (`--kv-cache-dtype`, `csrc/fp8.h`): the K/V store quantizes each token's head
  vector, and both attention kernels widen the FP8 rows they read in registers, half the
  bytes of bf16 from memory; bit for bit worker/kv_quant.py, the torch reference.

It is compiled once per machine by torch's extension builder (`make install` does
it: `python -m worker.cpu_kernels`), for this CPU's instruction set: the build's name
carries a digest of the CPU flags and of the sources, so a checkout that moves to
another processor builds anew instead of loading instructions the CPU lacks, and two
checkouts with different kernel sources never share (or rebuild each other's) module.
A rank imports the built module directly: torch's builder takes a lock file even when
there is nothing to build, and a process killed while holding it (kill -9, the OOM
killer) left every later start waiting on that lock forever. Without a C++
compiler, or with DEEPINFER_CPU_KERNELS=0, the engine keeps plain torch
(the reference the kernels are tested against).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType

import structlog

from worker.budget import cpu_flags

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name
           for name in ("module.cpp", "paged_decode.cpp", "paged_prefill.cpp", "small_linear.cpp",
                        "elementwise.cpp")]
HEADERS = [CSRC / "kernels.h", CSRC / "kv_rows.h", CSRC / "vec_math.h", CSRC / "fp8.h"]
ENV_SWITCH = "DEEPINFER_CPU_KERNELS"
# The instruction set the kernels are built for: this CPU's (`native`), or another one
# this CPU can run, e.g. `x86-64-v3` (AVX2 and FMA, no AVX-512): the tests build and check
# the paths of CPU kinds other than the one they run on (tests/worker/test_kernels_portable.py).
ENV_MARCH = "DEEPINFER_CPU_KERNELS_MARCH"
# -fno-trapping-math (torch builds itself with it): without it GCC vectorizes no loop
# that calls vec_math.h's exp_nonpositive for AVX2 (its clamp and rounding might trap),
# so a decode's softmax and the SiLU ran one float at a time on AVX2-only CPUs. The
# results are the same: only FP exception flags, which nothing reads, may differ.
CFLAGS = ["-O3", f"-march={os.environ.get(ENV_MARCH, 'native')}", "-fopenmp",
          "-fno-trapping-math"]
# The head dims paged_prefill is built for (others prefill in torch).
PREFILL_KERNEL_HEAD_DIMS = (32, 64, 128)

log = structlog.get_logger("deepinfer.worker")
_lock = threading.Lock()
_loaded: ModuleType | None = None
_failed: str | None = None


def build_name() -> str:
    digest = hashlib.sha256(" ".join(sorted(cpu_flags()) + CFLAGS).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return f"deepinfer_cpu_kernels_{digest.hexdigest()[:12]}"


def _import_built(name: str) -> ModuleType | None:
    """The module `make install` built, imported without the builder; None if not there
    (or not loadable: a link cut short), and then the builder runs."""
    from torch.utils.cpp_extension import _get_build_directory

    path = Path(_get_build_directory(name, False)) / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        log.warning("cpu_kernels_rebuild", path=str(path), error=str(e)[:300])
        return None
    return module


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first use; None where they cannot be (logged once)."""
    global _loaded, _failed
    if not enabled():
        return None
    with _lock:
        if _loaded is not None or _failed is not None:
            return _loaded
        try:
            from torch.utils.cpp_extension import load as build

            name = build_name()
            _loaded = _import_built(name) or build(
                name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as e:  # no compiler, no ninja, a build error: keep plain torch
            _failed = f"{type(e).__name__}: {e}"
            log.warning("cpu_kernels_unavailable", error=_failed[:500],
                        fallback="plain torch (gathered pages, torch GEMM)")
        return _loaded


def main() -> None:
    module = load(verbose=True)
    if module is None:
        raise SystemExit(f"the CPU kernels did not build: {_failed}")
    print(f"built {build_name()} ({module.__file__})")


if __name__ == "__main__":
    main()
