"""Faults a test injects into a rank, through the rank's test hook (worker/main.py
RANK_HOOK_ENV), to see the engine's own checks catch them.

    DEEPINFER_FAULT_DIVERGE "RANK:STEP"         that rank adds a phantom table entry to its
                                                mirrored state at that step, as a rank that
                                                missed an op would (the digest catches it)
    DEEPINFER_FAULT_CORRUPT_TABLE "RANK:STEP"   from that step on, the first sequence run
                                                gets a wrong block in its table (a real
                                                divergence the digest, which mirrors the
                                                plans, cannot see: `inspect check` can)
    DEEPINFER_FAULT_SAMPLE "RANK:STEP"          that rank samples another token than the
                                                others at that step, as a kernel that is not
                                                deterministic across ranks would (overlap
                                                scheduling feeds each rank its own samples:
                                                the engine's sample check catches it)
    DEEPINFER_FAULT_STALL "RANK:STEP:SECONDS"   that step sleeps after its table deltas, as
                                                a hung kernel would (the other ranks then
                                                wait in a collective); it ends early when
                                                CONTROL_DIR/fault-stall-release exists

`with_faults(**variables)` is the environment that turns them on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

RANK_HOOK_ENV = "DEEPINFER_RANK_HOOK"  # the same name as in worker/main.py


def with_faults(**variables: str) -> dict[str, str]:
    return {RANK_HOOK_ENV: str(Path(__file__).resolve()), **variables}


def _at(name: str, rank: int) -> list[str] | None:
    spec = os.environ.get(name, "").split(":")
    return spec[1:] if len(spec) > 1 and int(spec[0]) == rank else None


def install(runner, rank: int, control_dir: Path | None, log) -> None:
    """Wrap the runner's between-deltas-and-forward callback with this rank's faults."""
    diverge = _at("DEEPINFER_FAULT_DIVERGE", rank)
    corrupt = _at("DEEPINFER_FAULT_CORRUPT_TABLE", rank)
    stall = _at("DEEPINFER_FAULT_STALL", rank)
    wrong_sample = _at("DEEPINFER_FAULT_SAMPLE", rank)
    pending = {"corrupt": corrupt is not None}
    inner = runner.on_applied

    def on_applied(plan) -> None:
        if inner is not None:
            inner(plan)
        if diverge and plan.step == int(diverge[0]):
            runner.digest.add_blocks(-1, [0])  # a phantom table entry: state diverges
        if pending["corrupt"] and plan.step >= int(corrupt[0]) and plan.batch():
            pending["corrupt"] = False
            table = runner.block_tables[plan.batch()[0].seq_id]
            good, table[0] = table[0], (table[0] + 1) % runner.num_device_blocks
            log.warning("fault_corrupt_table", seq_id=plan.batch()[0].seq_id, index=0,
                        block=table[0], expected=good)
        if stall and plan.step == int(stall[0]):
            log.warning("fault_stall", seconds=float(stall[1]))
            release = control_dir / "fault-stall-release" if control_dir else None
            deadline = time.monotonic() + float(stall[1])
            while time.monotonic() < deadline and not (release and release.exists()):
                time.sleep(0.05)

    runner.on_applied = on_applied
    if wrong_sample:
        sample = runner.forward_pass._sample  # the real model's (worker/forward.py)

        def sample_wrong(plan, logits, rows):
            out = sample(plan, logits, rows)  # a tensor of tokens, one per sampling chunk
            if plan.step == int(wrong_sample[0]) and len(out):
                out[0] = (out[0] + 1) % runner.vocab_size
                log.warning("fault_wrong_sample", token=int(out[0]))
            return out

        runner.forward_pass._sample = sample_wrong
