"""A world-size-1 executor that runs the ModelRunner in the calling process.

It implements the scheduler's executor interface (start, submit, collect, step, shutdown;
a submitted plan runs at its collect, in order), so tests
and benchmarks drive the real scheduler against the real model without ZeroMQ.
"""

from __future__ import annotations

from collections import deque

from wire.config import EngineConfig
from wire.lifecycle import EngineLimits, WorkerReady
from wire.step import StepPlan, StepResult
from worker.distributed import TensorParallelGroup, resolve_device
from worker.model_runner import ModelRunner


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        assert config.world_size == 1, "in-process execution is world size 1"
        self.config = config
        self.runner: ModelRunner | None = None
        self._submitted: deque[StepPlan] = deque()

    def start(self) -> list[WorkerReady]:
        device = resolve_device(self.config.device, 0)
        self.runner = ModelRunner(self.config, TensorParallelGroup(0, 1), device)
        return [ready_message(self.runner, 0)]

    def submit(self, plan: StepPlan) -> None:
        """Queue a plan: it runs at its `collect`, after every plan submitted before it."""
        self._submitted.append(plan)

    def collect(self) -> list[StepResult]:
        return self.step(self._submitted.popleft())

    def step(self, plan: StepPlan) -> list[StepResult]:
        out = self.runner.execute(plan)
        return [StepResult(plan.step, 0, out.digest, out.sampled, out.timing,
                           disk_done=out.disk_done, disk_dropped=out.disk_dropped,
                           disk_queue_depth=out.disk_queue_depth,
                           disk_read_done=out.disk_read_done,
                           disk_read_bad=out.disk_read_bad,
                           state_disk_done=out.state_disk_done,
                           state_disk_dropped=out.state_disk_dropped,
                           state_disk_read_done=out.state_disk_read_done,
                           state_disk_read_bad=out.state_disk_read_bad)]

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.disk is not None:
            self.runner.disk.close()
        self.runner = None


def ready_message(runner: ModelRunner, rank: int) -> WorkerReady:
    disk = runner.disk
    return WorkerReady(rank, str(runner.device), EngineLimits(
        vocab_size=runner.vocab_size,
        max_model_len=runner.max_model_len,
        eos_token_ids=tuple(runner.model_config.eos_token_ids),
        num_device_blocks=runner.num_device_blocks,
        num_host_blocks=runner.num_host_blocks,
        kv_bytes_per_block=runner.kv_bytes_per_block,
        num_disk_blocks=runner.num_disk_blocks,
        # a hybrid model's runner sizes its state slots (worker/budget.py
        # split_state_budget); any other has none
        num_state_slots=runner.num_state_slots,
        state_bytes_per_slot=runner.state_bytes_per_slot,
        num_host_state_slots=runner.num_host_state_slots,
        num_disk_state_slots=runner.num_disk_state_slots,
        state_snapshot_interval=runner.state_snapshot_interval,
    ), disk_found=disk.found if disk is not None else [],
       state_disk_found=disk.state_found if disk is not None else [],
       disk_torn=disk.num_torn if disk is not None else 0,
       disk_identity_mismatch=disk.store.stats.identity_mismatch if disk is not None else False)


__all__ = ["InProcessExecutor", "ready_message"]
