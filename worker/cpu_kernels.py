"""The compiled CPU kernels: paged decode attention and the few-row linear layer.

Decoding is memory-bound on CPU, and plain torch reads memory badly in both places:
- Attention reads every sequence's whole context once per layer. Gathering the pages
  into a padded copy first (all plain torch can do) reads and writes that context twice
  more; at 16 sequences of 3,000 tokens the gather cost several times the attention
  itself. `csrc/paged_decode.cpp` reads the pages where they are.
- A linear layer over a few rows (a decode batch, a speculative verify) is a read of
  its weights; torch's GEMM reads them at a fraction of the memory's rate.
  `csrc/small_linear.cpp` streams them once (worker/linear.py picks it).
- The elementwise passes of a layer (RMSNorm after the residual add, SiLU * up) are
  one pass each in `csrc/elementwise.cpp`, not four to six torch ops.

It is compiled once per machine by torch's extension builder (`make install` does
it: `python -m worker.cpu_kernels`), for this CPU's instruction set: the
build's name carries a digest of the CPU flags, so a checkout that moves to another
processor builds anew instead of loading instructions the CPU lacks. Without a C++
compiler, or with DEEPINFER_CPU_KERNELS=0, the engine keeps plain torch
(the reference the kernels are tested against).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

import structlog

from worker.budget import cpu_flags

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("module.cpp", "paged_decode.cpp", "small_linear.cpp", "elementwise.cpp")]
ENV_SWITCH = "DEEPINFER_CPU_KERNELS"

log = structlog.get_logger("deepinfer.worker")
_lock = threading.Lock()
_loaded: ModuleType | None = None
_failed: str | None = None


def build_name() -> str:
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:10]
    return f"deepinfer_cpu_kernels_{digest}"


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

            _loaded = build(
                name=build_name(), sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
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
