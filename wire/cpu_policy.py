"""The scheduler process runs under SCHED_BATCH: its wake-ups do not preempt a rank.
A rank runs under the default policy whatever started it.

Under overlap scheduling a rank's critical path is the device's: from the end of one
forward to the launch of the next, the device waits. In that window the rank sends its
result, which wakes the scheduler; the kernel often queues the woken scheduler on the
rank's own core and runs it at once, and the rank waits out the scheduler's handling of
the result (planning the next step: 0.5-1 ms). Timed in the rank on the 2-core CPU box
(null model, 5 ms forward, world size 1, over the shared-memory channel, where a rank
wakes the scheduler directly): a result's send took 30 us at the median but 650-900 us
of wall time in its worst cases, against 30-50 us of CPU, the rank on the same core
throughout; the ranks idled 2-5% of their time beside the forward.

SCHED_BATCH keeps the scheduler's priority and share of CPU; it only stops its wake-ups
from preempting the running task, so the rank launches its next step first and the
scheduler runs a few tens of microseconds later, or on another core. Measured, two
alternated rounds of `python -m tools.benchmarks.overhead` (BENCHMARKS.md): beside a 5 ms
forward the ranks idle 1.4-2.5% against 1.8-4.3%, and the steps with no forward take as
long as before. Nothing to do off Linux; DEEPINFER_SCHEDULER_POLICY=normal in the
environment keeps the default policy (for comparisons, or a machine where it misbehaves).
"""

from __future__ import annotations

import os

POLICY_ENV = "DEEPINFER_SCHEDULER_POLICY"  # "batch" (the default) or "normal"


def defer_to_ranks() -> bool:
    """Every thread of this process under SCHED_BATCH, and so the threads they start from
    now on (a thread takes its creator's policy). Whether it took: a sandbox may refuse
    (an unprivileged process may otherwise always move its own threads to this policy)."""
    if not hasattr(os, "SCHED_BATCH") or os.environ.get(POLICY_ENV, "batch") == "normal":
        return False
    return _set_every_thread(os.SCHED_BATCH)


def run_as_rank() -> None:
    """A rank under the default policy, the one the scheduler defers to, even when it was
    started by a process under SCHED_BATCH (a child keeps its parent's policy: a
    benchmark's ranks, started by a process that runs a scheduler)."""
    if hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) == os.SCHED_BATCH:
        _set_every_thread(os.SCHED_OTHER)


def _set_every_thread(policy: int) -> bool:
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # this thread alone
    took = True
    for tid in threads:  # on Linux the policy is a thread's own
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError:  # a sandbox that refuses: that thread keeps its policy
            took = False
    return took
