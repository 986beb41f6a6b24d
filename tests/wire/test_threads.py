"""Every torch child starts with the OpenMP spin setting, unless the environment says
otherwise (wire/threads.py says why)."""

from __future__ import annotations

import subprocess
import sys

from orchestrator.config import repo_env
from wire.threads import OPENMP_DEFAULTS, apply_openmp_defaults


def test_defaults_fill_in_and_an_explicit_setting_wins():
    for explicit in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(explicit)
        apply_openmp_defaults(env)
        assert env == explicit  # the user's own choice, nothing added beside it
    env = {}
    apply_openmp_defaults(env)
    assert env == OPENMP_DEFAULTS


def test_a_child_process_gets_the_setting(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['GOMP_SPINCOUNT'])"],
                         env=repo_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == OPENMP_DEFAULTS["GOMP_SPINCOUNT"]


def test_a_peer_child_gets_the_environment_without_our_defaults(monkeypatch):
    import os

    from wire import threads

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "_added_here", {})
    threads.apply_openmp_defaults()  # this process's own environment
    env = threads.without_our_openmp_defaults({**os.environ, "OTHER": "1"})
    assert "GOMP_SPINCOUNT" not in env and env["OTHER"] == "1"
    # a setting the user made is theirs, and stays
    monkeypatch.setattr(threads, "_added_here", {})
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    threads.apply_openmp_defaults()
    assert threads.without_our_openmp_defaults(dict(os.environ))["GOMP_SPINCOUNT"] == "5"
