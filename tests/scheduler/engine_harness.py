"""Drive the real scheduler against real worker ranks (ZeroMQ, torchrun env), no HTTP."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from scheduler.engine import EngineCore, agree_limits, restore_disk
from scheduler.executor import Executor, ZmqExecutor
from scheduler.scheduler import Scheduler
from tests.conftest import REPO, fitting_max_model_len, free_port, subprocess_env
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.step import PENDING_TOKEN, StepPlan, StepResult


@dataclass
class RecordingExecutor:
    """Passes every call through and keeps the plans and results, for assertions."""

    inner: Executor
    plans: list[StepPlan] = field(default_factory=list)
    results: list[list[StepResult]] = field(default_factory=list)
    # per plan, its chunks naming a PENDING_TOKEN when submitted (an in-process rank
    # resolves them in place)
    num_pending: list[int] = field(default_factory=list)

    def start(self):
        return self.inner.start()

    def submit(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        self.num_pending.append(sum(c.token_ids[-1] == PENDING_TOKEN for c in plan.batch()))
        self.inner.submit(plan)

    def collect(self) -> list[StepResult]:
        out = self.inner.collect()
        self.results.append(out)
        return out

    def step(self, plan: StepPlan) -> list[StepResult]:
        self.submit(plan)
        return self.collect()

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def last_exchange(self):
        """The inner executor's timing of its last exchange (None in process)."""
        return getattr(self.inner, "last_exchange", None)


@contextlib.contextmanager
def zmq_engine(model: str, world_size: int, env: dict[str, str] | None = None, **overrides):
    kv_cache_memory = overrides.pop("kv_cache_memory", 16 << 20)
    overrides.setdefault("max_model_len",
                         fitting_max_model_len(model, kv_cache_memory, world_size))
    config = EngineConfig(model=str(model), world_size=world_size, dtype="float32",
                          kv_cache_memory=kv_cache_memory,
                          # the full cache check after every step: tests can afford it
                          full_cache_check_every=overrides.pop("full_cache_check_every", 1),
                          **overrides)
    with tempfile.TemporaryDirectory(prefix="deepinfer-test-") as run_dir:
        address = f"ipc://{run_dir}/workers.sock"
        executor = ZmqExecutor(address, config, start_timeout_s=180, step_timeout_s=120)
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "worker.main", "--scheduler", address], cwd=REPO,
                env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=port, **(env or {})),
                stderr=subprocess.DEVNULL,
            )
            for r in range(world_size)
        ]
        try:
            recorder = RecordingExecutor(executor)
            ready = recorder.start()
            core = EngineCore(Scheduler(config, agree_limits(ready)), recorder)
            restore_disk(core.scheduler, ready)  # the disk tier's warm restart, if any
            core.ready = ready
            yield core
            executor.shutdown()
            for p in procs:
                p.wait(timeout=30)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def run_until_done(core: EngineCore, requests: list[GenerateRequest],
                   max_steps: int = 10_000) -> dict[str, dict]:
    """Submit, step until idle; per request: tokens, finish reason, cached tokens, final step."""
    for req in requests:
        core.scheduler.add_request(req)
    results: dict[str, dict] = {r.request_id: {"tokens": []} for r in requests}
    for _ in range(max_steps):
        if not core.has_work():
            return results
        step = core.scheduler.step
        for out in core.step().outputs:
            res = results.setdefault(out.request_id, {"tokens": []})
            res["tokens"].extend(out.token_ids)
            if out.finished:
                res.update(finish_reason=out.finish_reason, final_step=step,
                           cached=out.num_device_cached_tokens + out.num_host_cached_tokens,
                           reasoning=out.num_reasoning_tokens)
    raise AssertionError("engine did not go idle")


def inprocess_engine(model: str, scheduler_cls: type[Scheduler] = Scheduler,
                     **overrides) -> EngineCore:
    """The real scheduler and the real model at world size 1, in this process."""
    from worker.inprocess import InProcessExecutor

    kv_cache_memory = overrides.pop("kv_cache_memory", 16 << 20)
    overrides.setdefault("max_model_len", fitting_max_model_len(model, kv_cache_memory))
    config = EngineConfig(model=str(model), dtype=overrides.pop("dtype", "float32"),
                          kv_cache_memory=kv_cache_memory,
                          # the full cache check after every step: tests can afford it
                          full_cache_check_every=overrides.pop("full_cache_check_every", 1),
                          **overrides)
    recorder = RecordingExecutor(InProcessExecutor(config))
    ready = recorder.start()
    core = EngineCore(scheduler_cls(config, agree_limits(ready)), recorder)
    restore_disk(core.scheduler, ready)  # the disk tier's warm restart, if any
    core.ready = ready
    return core
