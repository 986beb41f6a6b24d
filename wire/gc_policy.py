"""The garbage collector's settings for the engine's long-lived processes.

A step allocates thousands of short-lived objects (plan chunks, outputs, msgpack lists),
freed by reference counting; the cyclic collector still runs every 700 allocations by
default, and each full collection walks every object start-up made (torch's and numpy's
modules, the model's objects): measured at batch 256, the collector took a quarter of
the scheduler's and over a third of a rank's time per step. As vLLM and SGLang do, each
process freezes what start-up made (never scanned again) and collects the young
generation less often.
"""

from __future__ import annotations

import gc

# allocations between two young-generation collections (Python's default: 700)
YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """Call once, when start-up is done (model loaded, sockets open), before serving."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
