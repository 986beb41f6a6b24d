"""The compiled kernels' code paths for a CPU kind other than this one, built and checked here.

`make install` builds the kernels for this CPU (`-march=native`), so a machine only ever
tests its own paths: an AVX2-only EPYC would be the first to run the `#else` branches of
the AVX-512 code. This builds the kernels for x86-64-v3 (AVX2 and FMA, no AVX-512), which
every CPU this project has met can run, and runs the kernel tests against that build in a
child process (`DEEPINFER_CPU_KERNELS_MARCH`, worker/cpu_kernels.py): the same assertions,
the same tolerances, bit for bit where those tests say so.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker import cpu_kernels
from worker.budget import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
# The instruction set of each build checked, and what this CPU needs to run it.
TARGETS = {"x86-64-v3": {"avx2", "fma"}}
KERNEL_TESTS = ["tests/worker/test_attention.py", "tests/worker/test_elementwise.py",
                "tests/worker/test_linear.py"]
# The tests that call the kernels (and the one that fails if the build quietly did not
# happen); the torch-only paths are the same whatever the build.
SELECTION = ("kernel_matches or shared_prefix or bit_for_bit or builds or test_rms_norm "
             "or silu_mul or rope_store or float32_equals or bfloat16_weights or strided")


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_kernels_built_for_another_cpu_kind_match_the_reference(march: str) -> None:
    if platform.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("needs an x86-64 machine with a C++ compiler")
    if not cpu_kernels.enabled():
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0")
    if not TARGETS[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {march} build")
    env = {**os.environ, cpu_kernels.ENV_MARCH: march, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider",
         *KERNEL_TESTS, "-k", SELECTION],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "cannot be built" not in run.stdout, tail
