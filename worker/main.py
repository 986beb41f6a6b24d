"""A rank process: connect to the scheduler, load the shard, apply plans until told to stop.

Started by `deepinfer-run`, or by `torchrun` itself:
    torchrun --nproc-per-node 4 -m worker.main --scheduler ipc:///run/dir/workers.sock
It reads the standard torchrun variables; the engine configuration comes from the
scheduler, so every rank runs with exactly the scheduler's settings.
"""

from __future__ import annotations

import argparse
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
from wire.lifecycle import Shutdown, WorkerConnect, host_identity
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

# Fault injection for tests of the engine's own checks: "RANK:STEP" makes that rank
# corrupt its mirrored state at that step, as a rank that missed an op would.
FAULT_DIVERGE_ENV = "DEEPINFER_FAULT_DIVERGE"
# Test-only faults for the inspect CLI. CORRUPT_TABLE "RANK:STEP": from that step on,
# the first sequence run gets a wrong block in its table (a real divergence the digest,
# which mirrors the plans, cannot see). STALL "RANK:STEP:SECONDS": that step sleeps after
# its table deltas, as a hung kernel would (the other ranks then wait in a collective);
# it ends early when CONTROL_DIR/fault-stall-release exists.
FAULT_CORRUPT_TABLE_ENV = "DEEPINFER_FAULT_CORRUPT_TABLE"
FAULT_STALL_ENV = "DEEPINFER_FAULT_STALL"


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
        sock.send(codec.encode(StepResult(-1, info.rank, 0, error=f"{type(exc).__name__}: {exc}")))
        return 1
    log.info("worker_ready", device=str(device), threads=threads,
             num_device_blocks=runner.num_device_blocks, num_host_blocks=runner.num_host_blocks)
    control_dir = control_dir_for(args.scheduler)
    control = None
    if control_dir is not None:
        control = RankControl(runner, info.rank, info.world_size,
                              control_address(control_dir, f"rank{info.rank}"), log)
    runner.on_applied = _step_hooks(runner, control, control_dir, info.rank, log)
    sock.send(codec.encode(ready_message(runner, info.rank)))
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
    fault = _parse_fault(os.environ.get(FAULT_DIVERGE_ENV), rank)
    while True:
        msg = codec.decode(sock.recv())
        if isinstance(msg, Shutdown):
            log.info("worker_shutdown", reason=msg.reason)
            return 0
        assert isinstance(msg, StepPlan), f"unexpected message {type(msg).__name__}"
        structlog.contextvars.bind_contextvars(step=msg.step)
        try:
            if fault == msg.step:
                runner.digest.add_blocks(-1, [0])  # a phantom table entry: state diverges
            out = runner.execute(msg)
            if control is not None:
                control.finished(out.digest)
            sock.send(codec.encode(
                StepResult(msg.step, rank, out.digest, out.sampled, out.forward_s)))
        except Exception as exc:
            # A rank that failed mid-step cannot rejoin the collectives: report and exit.
            log.error("step_failed", error=traceback.format_exc())
            if control is not None:
                control.failed(f"step {msg.step}: {type(exc).__name__}: {exc}")
            sock.send(codec.encode(
                StepResult(msg.step, rank, 0, error=f"{type(exc).__name__}: {exc}")))
            return 1


def _step_hooks(runner: ModelRunner, control: RankControl | None, control_dir: Path | None,
                rank: int, log):
    """What runs between a plan's table deltas and its forward pass: the control mark,
    and the test-only faults."""
    corrupt_at = _parse_fault(os.environ.get(FAULT_CORRUPT_TABLE_ENV), rank)
    stall = (os.environ.get(FAULT_STALL_ENV) or "").split(":")
    stall_at = int(stall[1]) if len(stall) == 3 and int(stall[0]) == rank else None
    pending = {"corrupt": corrupt_at is not None}

    def on_applied(plan: StepPlan) -> None:
        if control is not None:
            control.applied(plan)
        if pending["corrupt"] and plan.step >= corrupt_at and plan.chunks:
            pending["corrupt"] = False
            table = runner.block_tables[plan.chunks[0].seq_id]
            good, table[0] = table[0], (table[0] + 1) % runner.num_device_blocks
            log.warning("fault_corrupt_table", seq_id=plan.chunks[0].seq_id, index=0,
                        block=table[0], expected=good)
        if plan.step == stall_at:
            log.warning("fault_stall", seconds=float(stall[2]))
            release = control_dir / "fault-stall-release" if control_dir else None
            deadline = time.monotonic() + float(stall[2])
            while time.monotonic() < deadline and not (release and release.exists()):
                time.sleep(0.05)

    return on_applied


def _parse_fault(spec: str | None, rank: int) -> int | None:
    if not spec:
        return None
    fault_rank, step = (int(x) for x in spec.split(":"))
    return step if fault_rank == rank else None


if __name__ == "__main__":
    sys.exit(main())
