"""Every torch child starts with the OpenMP wait policy, unless the environment says
otherwise (wire/threads.py says why)."""

from __future__ import annotations

import subprocess
import sys

from orchestrator.config import repo_env
from wire.threads import OPENMP_DEFAULTS, apply_openmp_defaults


def test_defaults_fill_in_and_an_explicit_setting_wins():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    apply_openmp_defaults(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {}
    apply_openmp_defaults(env)
    assert env == OPENMP_DEFAULTS


def test_a_child_process_gets_the_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'])"],
                         env=repo_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
