"""A rank process: connect to the scheduler, load the shard, apply plans until told to stop.

Started by `deepinfer-run`, or by `torchrun` itself:
    torchrun --nproc-per-node 4 -m worker.main --scheduler ipc:///run/dir/workers.sock
It reads the standard torchrun variables; the engine configuration comes from the
scheduler, so every rank runs with exactly the scheduler's settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import structlog
import zmq

from wire import codec
from wire.config import EngineConfig
from wire.control_server import control_address, control_dir_for
from wire.gc_policy import settle_heap
from wire.lifecycle import Shutdown, StartFailed, WorkerConnect, host_identity
from wire.log import configure_logging
from wire.security import secure_connect
from wire.step import StepPlan, StepResult
from worker.control import RankControl
from worker.distributed import (
    RankInfo,
    init_tensor_parallel,
    resolve_device,
    set_torch_threads,
    shutdown_tensor_parallel,
)
from worker.inprocess import ready_message
from worker.model_runner import ModelRunner

# Tests inject faults into a rank through this hook: a Python file whose
# `install(runner, rank, control_dir, log)` runs once before the first step
# (tests/worker/faults.py). Unset in production.
RANK_HOOK_ENV = "DEEPINFER_RANK_HOOK"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DeepInfer worker rank")
    parser.add_argument("--scheduler", default=os.environ.get("DEEPINFER_SCHEDULER"),
                        help="the scheduler's worker address, e.g. ipc:///run/dir/workers.sock")
    args = parser.parse_args(argv)
    if not args.scheduler:
        parser.error("--scheduler (or DEEPINFER_SCHEDULER) is required")
    info = RankInfo.from_env()
    log = configure_logging("worker", info.rank)

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank-{info.rank}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    secure_connect(sock, args.scheduler)  # CURVE over tcp://
    sock.send(codec.encode(WorkerConnect(info.rank, info.world_size, os.getpid(),
                                         host_identity())))
    config = codec.decode(sock.recv())
    assert isinstance(config, EngineConfig), config

    try:
        threads = set_torch_threads(info.local_world_size, config.torch_threads)
        device = resolve_device(config.device, info.local_rank)
        tp = init_tensor_parallel(info, device)
        runner = ModelRunner(config, tp, device)
    except Exception as exc:
        log.error("worker_start_failed", error=str(exc))
        sock.send(codec.encode(StartFailed(info.rank, f"{type(exc).__name__}: {exc}")))
        return 1
    log.info("worker_ready", device=str(device), threads=threads,
             num_device_blocks=runner.num_device_blocks, num_host_blocks=runner.num_host_blocks)
    control_dir = control_dir_for(args.scheduler)
    control = None
    if control_dir is not None:
        control = RankControl(runner, info.rank, info.world_size,
                              control_address(control_dir, f"rank{info.rank}"), log)
    runner.on_applied = control.applied if control is not None else None
    if os.environ.get(RANK_HOOK_ENV):
        _install_rank_hook(os.environ[RANK_HOOK_ENV], runner, info.rank, control_dir, log)
    sock.send(codec.encode(ready_message(runner, info.rank)))
    settle_heap()
    try:
        code = serve(sock, runner, info.rank, log, control)
    finally:
        if control is not None:
            control.close()
    if code == 0:  # a clean stop: every rank got Shutdown after the same last step
        shutdown_tensor_parallel()
    return code


def serve(sock: zmq.Socket, runner: ModelRunner, rank: int, log,
          control: RankControl | None = None) -> int:
    while True:
        t0 = time.perf_counter()
        frame = sock.recv()
        t1 = time.perf_counter()
        msg = codec.decode(frame)
        decode_s = time.perf_counter() - t1
        if isinstance(msg, Shutdown):
            log.info("worker_shutdown", reason=msg.reason)
            if runner.disk is not None:  # the queued writes land before the rank exits
                runner.disk.close()
            return 0
        assert isinstance(msg, StepPlan), f"unexpected message {type(msg).__name__}"
        structlog.contextvars.bind_contextvars(step=msg.step)
        try:
            out = runner.execute(msg)
            out.timing.wait_s, out.timing.decode_s = t1 - t0, decode_s
            if control is not None:
                control.finished(out.digest)
            sock.send(codec.encode(
                StepResult(msg.step, rank, out.digest, out.sampled, out.timing,
                           sampled_digest=out.sampled_digest, disk_done=out.disk_done,
                           disk_dropped=out.disk_dropped,
                           disk_queue_depth=out.disk_queue_depth)))
        except Exception as exc:
            # A rank that failed mid-step cannot rejoin the collectives: report and exit.
            log.error("step_failed", error=traceback.format_exc())
            if control is not None:
                control.failed(f"step {msg.step}: {type(exc).__name__}: {exc}")
            sock.send(codec.encode(
                StepResult(msg.step, rank, 0, error=f"{type(exc).__name__}: {exc}")))
            return 1


def _install_rank_hook(path: str, runner: ModelRunner, rank: int, control_dir: Path | None,
                       log) -> None:
    spec = importlib.util.spec_from_file_location("deepinfer_rank_hook", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log.warning("rank_hook_installed", path=path)
    module.install(runner, rank, control_dir, log)


if __name__ == "__main__":
    sys.exit(main())
