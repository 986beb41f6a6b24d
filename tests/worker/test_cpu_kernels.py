"""Building and loading the compiled CPU kernels (worker/cpu_kernels.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def test_the_name_follows_the_sources(tmp_path, monkeypatch):
    """Two checkouts with different kernel sources never share a build (each would
    rebuild the other's module in place, under a running engine)."""
    copies = []
    for path in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        shutil.copy(path, tmp_path / path.name)
        copies.append(tmp_path / path.name)
    monkeypatch.setattr(cpu_kernels, "SOURCES", copies[: len(cpu_kernels.SOURCES)])
    monkeypatch.setattr(cpu_kernels, "HEADERS", copies[len(cpu_kernels.SOURCES):])
    before = cpu_kernels.build_name()
    with open(copies[1], "a") as f:
        f.write("\n// changed\n")
    assert cpu_kernels.build_name() != before


def test_a_stale_build_lock_does_not_hang_a_start():
    """A process killed while torch's builder held its lock file leaves the file behind;
    a rank starting later imports the built module and does not wait on it."""
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(cpu_kernels.build_name(), False)) / "lock"
    lock.touch()
    try:
        code = "from worker import cpu_kernels; assert cpu_kernels.load() is not None"
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    finally:
        lock.unlink(missing_ok=True)
