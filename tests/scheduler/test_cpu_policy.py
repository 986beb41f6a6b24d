"""scheduler/cpu_policy.py: the scheduler's threads under SCHED_BATCH, those started
before and after alike (run in a child: the policy would stay on the test process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env

CHILD = """
import os, threading
from scheduler.cpu_policy import defer_to_ranks
before = threading.Event()
t = threading.Thread(target=before.wait, daemon=True)
t.start()
took = defer_to_ranks()
after = threading.Thread(target=lambda: print(os.sched_getscheduler(0)))
after.start()
after.join()
print(took, os.sched_getscheduler(0), os.sched_getscheduler(t.native_id))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")
def test_every_thread_runs_under_sched_batch():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, check=True).stdout.split()
    batch = str(os.SCHED_BATCH)
    assert out == [batch, "True", batch, batch]  # started after; this thread; started before


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")
def test_the_environment_can_keep_the_default_policy():
    child = "from scheduler.cpu_policy import defer_to_ranks; import os; " \
            "print(defer_to_ranks(), os.sched_getscheduler(0))"
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True,
                         env=subprocess_env(DEEPINFER_SCHEDULER_POLICY="normal"), text=True,
                         check=True).stdout.split()
    assert out == ["False", str(os.SCHED_OTHER)]
