"""How a torch process's OpenMP threads wait between parallel regions: set in the
environment before libgomp loads (it reads it once), so for every rank and benchmark child.

libgomp's default spins a while, then sleeps, which is right on an idle machine. On a
shared one (this project's CPU box: 2 cores, load 5-6 from other work) a spinning thread
burns the slice that the thread it waits for needs, and every parallel region can cost a
whole scheduler slice: a [256, 576] multiply took 3-10 ms with 2 threads against 32 us
with one, and a SmolLM2 decode step 630 ms against 61 ms with PASSIVE (BENCHMARKS.md).
PASSIVE sleeps at once: about 20 us more per region when the machine is idle, never a
slice. An explicit setting in the environment wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_openmp_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    for key, value in OPENMP_DEFAULTS.items():
        env.setdefault(key, value)
