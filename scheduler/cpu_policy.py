"""The scheduler process runs under SCHED_BATCH: its wake-ups do not preempt a rank.

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
scheduler runs a few tens of microseconds later, or on another core. Measured, four
alternated rounds of `python -m tools.bench_overhead` (BENCHMARKS.md): beside a 5 ms
forward the ranks idle 1.1-2.6% against 1.8-5.0%, and the steps with no forward take as
long as before. Nothing to do off Linux; DEEPINFER_SCHEDULER_POLICY=normal in the
environment keeps the default policy (for comparisons, or a machine where it misbehaves).
"""

from __future__ import annotations

import os

POLICY_ENV = "DEEPINFER_SCHEDULER_POLICY"  # "batch" (the default) or "normal"


def defer_to_ranks() -> bool:
    """Every thread of this process under SCHED_BATCH, and so the threads they start from
    now on (a thread takes its creator's policy). Whether it took (an unprivileged process
    may always move its own threads to this policy)."""
    if not hasattr(os, "SCHED_BATCH") or os.environ.get(POLICY_ENV, "batch") == "normal":
        return False
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # this thread alone
    for tid in threads:  # on Linux the policy is a thread's own
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError:  # a sandbox that forbids it: the default policy stays
            return False
    return True
