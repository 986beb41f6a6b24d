"""wire/cpu_policy.py: the scheduler's threads under SCHED_BATCH, those started before and
after alike, and a rank back under the default policy whatever started it (run in
children: a policy set here would stay on the test process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")

CHILD = """
import os, threading
from wire.cpu_policy import defer_to_ranks, run_as_rank
before = threading.Event()
t = threading.Thread(target=before.wait, daemon=True)
t.start()
took = defer_to_ranks()
after = threading.Thread(target=lambda: print(os.sched_getscheduler(0)))
after.start()
after.join()
print(took, os.sched_getscheduler(0), os.sched_getscheduler(t.native_id))
if os.environ.get("THEN_AS_RANK"):
    run_as_rank()
    print(os.sched_getscheduler(0), os.sched_getscheduler(t.native_id))
"""


def child(**env: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=subprocess_env(**env),
                          capture_output=True, text=True, check=True).stdout.split()


def test_every_thread_runs_under_sched_batch_and_a_rank_under_the_default():
    out = child(THEN_AS_RANK="1")
    if out[1] == "False":
        pytest.skip("this sandbox refuses SCHED_BATCH")
    batch, other = str(os.SCHED_BATCH), str(os.SCHED_OTHER)
    assert out[:4] == [batch, "True", batch, batch]  # started after; this thread; before
    assert out[4:] == [other, other]  # run_as_rank: every thread back


def test_the_environment_can_keep_the_default_policy():
    out = child(DEEPINFER_SCHEDULER_POLICY="normal")
    other = str(os.SCHED_OTHER)
    assert out == [other, "False", other, other]
