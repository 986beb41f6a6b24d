"""tools/benchmarks/profile_step.py on tiny settings: the scheduler and a null rank in one
process."""

from __future__ import annotations

import pytest

from tools.benchmarks.profile_step import main

pytestmark = pytest.mark.slow


def test_profile_step_prints_each_mode_and_its_parts(default_model, capsys):
    assert main(["--model", str(default_model), "--batch", "4", "--steps", "5",
                 "--repeat", "1"]) == 0
    printed = capsys.readouterr().out
    for line in ("decode: ", "mixed: ", "sched plan", "sched update", "sched encode",
                 "rank decode", "rank prepare", "rank inputs", "rank encode"):
        assert line in printed, line


def test_profile_step_writes_a_cprofile_per_mode(default_model, tmp_path):
    prefix = tmp_path / "p"
    assert main(["--model", str(default_model), "--batch", "4", "--steps", "5",
                 "--repeat", "1", "--modes", "decode", "--profile", str(prefix)]) == 0
    assert (tmp_path / "p-decode.prof").stat().st_size > 0
