"""How a torch process's OpenMP threads wait between parallel regions: set in the
environment before libgomp loads (it reads it once), so for every rank and benchmark child.

libgomp's default spins about 3 ms (300,000 spins), then sleeps. On a shared machine (this
project's CPU box: 2 cores, often loaded by other work) a spinning thread burns the slice
that the thread it waits for needs: a [256, 576] multiply took 3-10 ms with 2 threads
against 32 us with one, a SmolLM2 decode step 630 ms against 61 ms with no spinning
(OMP_WAIT_POLICY=PASSIVE, this module's setting until 2026-12-03). But sleeping at once
costs a wake-up of the other thread at every region, and a decode step is a few hundred
short regions (each linear layer and attention call of every layer): the tiny model's
bf16 decode step at 4 x 2,800 tokens took 11-12 ms passive against 7.7 ms spinning a
little, and with two busy processes beside it 35 ms against 20-27 (docs/perf-log/). So the
threads spin about 0.1 ms (GOMP_SPINCOUNT, at libgomp's ~100,000 spins a millisecond),
long enough to catch the next region of a forward, short enough that a busy machine
loses little. An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
# Either of these decides the spinning on its own (GOMP_SPINCOUNT over the policy).
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


# What apply_openmp_defaults put into this process's own environment (not the user's).
_added_here: dict[str, str] = {}


def apply_openmp_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    if not any(name in env for name in OPENMP_SETTINGS):
        env.update(OPENMP_DEFAULTS)
        if env is os.environ:
            _added_here.update(OPENMP_DEFAULTS)


def without_our_openmp_defaults(env: dict[str, str]) -> dict[str, str]:
    """`env` less the settings this process added to its own environment: for a child
    that is not ours (the peer engine of a benchmark runs with its own defaults)."""
    return {k: v for k, v in env.items() if _added_here.get(k) != v}
