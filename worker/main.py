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
from wire.cpu_policy import run_as_rank
from wire.gc_policy import settle_heap
from wire.lifecycle import Shutdown, StartFailed, WorkerConnect, host_identity
from wire.log import configure_logging
from wire.security import secure_connect
from wire.step import StepPlan, StepResult
from wire.step_channel import RankChannel
from worker.control import RankControl
from worker.distributed import (
    RankInfo,
    init_tensor_parallel,
    resolve_device,
    set_torch_threads,
    shutdown_tensor_parallel,
)
from worker.forward import PreparedStep
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
    run_as_rank()  # before ZeroMQ's and OpenMP's threads start: they inherit it

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
        # the steps' way in and out: the socket, or the shared-memory channel beside it
        # (opened before the rank says it is ready: the scheduler then unlinks its file)
        link = sock if config.step_channel != "shm" else RankChannel(
            args.scheduler, info.rank, info.world_size, sock)
    except Exception as exc:
        log.error("worker_start_failed", error=str(exc))
        sock.send(codec.encode(StartFailed(info.rank, f"{type(exc).__name__}: {exc}")))
        return 1
    log.info("worker_ready", device=str(device), threads=threads,
             num_device_blocks=runner.num_device_blocks, num_host_blocks=runner.num_host_blocks,
             device_tokens=runner.num_device_blocks * config.block_size,
             host_tokens=runner.num_host_blocks * config.block_size,
             step_channel=config.step_channel)
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
        code = serve(link, runner, info.rank, log, control)
    finally:
        if control is not None:
            control.close()
    if code == 0:  # a clean stop: every rank got Shutdown after the same last step
        shutdown_tensor_parallel()
    return code


def serve(sock: zmq.Socket | RankChannel, runner: ModelRunner, rank: int, log,
          control: RankControl | None = None) -> int:
    """Apply plans until Shutdown. Under overlap scheduling the next plan is often there
    while a forward runs: it is prepared then, so the device goes from one forward to
    the next with only this step's samples read and the next launched between
    (worker/model_runner.py)."""
    ahead: PreparedStep | None = None  # the next plan, prepared during the last forward
    while True:
        cpu0 = time.thread_time()
        if ahead is None:
            t0 = time.perf_counter()
            frame = sock.recv()
            t1 = time.perf_counter()
            msg = codec.decode(frame)
            decode_s = time.perf_counter() - t1
            if isinstance(msg, Shutdown):
                return _shut_down(runner, log, msg)
            assert isinstance(msg, StepPlan), f"unexpected message {type(msg).__name__}"
            try:
                step = runner.prepare(msg)
            except Exception as exc:
                return _fail(sock, rank, log, control, msg.step, exc)
            step.timing.wait_s, step.timing.decode_s = t1 - t0, decode_s
        else:
            step, ahead = ahead, None
        structlog.contextvars.bind_contextvars(step=step.plan.step)
        then: StepPlan | Shutdown | None = None
        failed_ahead: Exception | None = None
        try:
            runner.launch(step)
            then, decode_s = _next_message(sock, runner)
            if isinstance(then, StepPlan):
                try:
                    ahead = runner.prepare(then)
                    ahead.timing.decode_s = decode_s  # wait_s 0: the plan was there first
                except Exception as exc:  # noqa: BLE001 -- reported after this step's result
                    failed_ahead = exc
            out = runner.finish(step)
            if control is not None:
                control.finished(out.digest)
            out.timing.cpu_s = time.thread_time() - cpu0
            sock.send(codec.encode(
                StepResult(step.plan.step, rank, out.digest, out.sampled, out.timing,
                           sampled_digest=out.sampled_digest, disk_done=out.disk_done,
                           disk_dropped=out.disk_dropped,
                           disk_queue_depth=out.disk_queue_depth,
                           disk_read_done=out.disk_read_done,
                           disk_read_bad=out.disk_read_bad,
                           state_disk_done=out.state_disk_done,
                           state_disk_dropped=out.state_disk_dropped,
                           state_disk_read_done=out.state_disk_read_done,
                           state_disk_read_bad=out.state_disk_read_bad)))
        except Exception as exc:
            return _fail(sock, rank, log, control, step.plan.step, exc)
        if failed_ahead is not None:
            return _fail(sock, rank, log, control, then.step, failed_ahead)
        if isinstance(then, Shutdown):
            return _shut_down(runner, log, then)


def _shut_down(runner: ModelRunner, log, msg: Shutdown) -> int:
    log.info("worker_shutdown", reason=msg.reason)
    if runner.disk is not None:  # the queued writes land before the rank exits
        runner.disk.close()
    return 0


LOOK_S = 100e-6  # between looks at a forward's end while a plan is awaited


def _next_message(sock: zmq.Socket | RankChannel, runner: ModelRunner
                  ) -> tuple[object, float]:
    """The next message and its decode time, if it comes before the forward in flight
    ends; (None, 0) otherwise. Only under overlap scheduling does the scheduler send a
    plan before it has this step's result, so without it nothing is waited for; nor
    when the forward ran on this core (CPU): the result would only be later."""
    if not (runner.config.async_scheduling and runner.forward_in_flight()):
        return None, 0.0
    # The plan comes a little after the launch: the scheduler plans it once it has the
    # result this rank sent just before. So it is waited for until the forward ends, not
    # looked for once: by polls for the whole milliseconds left where that is known (the
    # null model), and between them the forward's end looked at every LOOK_S (a GPU's
    # end cannot be polled beside the socket).
    while not sock.poll(int(runner.busy_s() * 1000)):
        if runner.forward_done():
            return None, 0.0
        time.sleep(LOOK_S)
    frame = sock.recv()
    t0 = time.perf_counter()
    msg = codec.decode(frame)
    decode_s = time.perf_counter() - t0
    assert isinstance(msg, StepPlan | Shutdown), f"unexpected message {type(msg).__name__}"
    return msg, decode_s


def _fail(sock: zmq.Socket | RankChannel, rank: int, log, control: RankControl | None, step: int,
          exc: BaseException) -> int:
    """A rank that failed mid-step cannot rejoin the collectives: report and exit."""
    log.error("step_failed", error="".join(traceback.format_exception(exc)))
    if control is not None:
        control.failed(f"step {step}: {type(exc).__name__}: {exc}")
    sock.send(codec.encode(StepResult(step, rank, 0, error=f"{type(exc).__name__}: {exc}")))
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
