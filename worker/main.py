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
import traceback

import zmq

from scheduler.protocol import (
    EngineConfig,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerConnect,
    codec,
)
from scheduler.protocol.log import configure_logging
from worker.distributed import RankInfo, init_tensor_parallel, resolve_device, set_torch_threads
from worker.inprocess import ready_message
from worker.model_runner import ModelRunner

# Fault injection for tests of the engine's own checks: "RANK:STEP" makes that rank
# corrupt its mirrored state at that step, as a rank that missed an op would.
FAULT_DIVERGE_ENV = "DEEPINFER_FAULT_DIVERGE"


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
    sock.connect(args.scheduler)
    sock.send(codec.encode(WorkerConnect(info.rank, info.world_size, os.getpid())))
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
    sock.send(codec.encode(ready_message(runner, info.rank)))
    return serve(sock, runner, info.rank, log)


def serve(sock: zmq.Socket, runner: ModelRunner, rank: int, log) -> int:
    fault = _parse_fault(os.environ.get(FAULT_DIVERGE_ENV), rank)
    while True:
        msg = codec.decode(sock.recv())
        if isinstance(msg, Shutdown):
            log.info("worker_shutdown", reason=msg.reason)
            return 0
        assert isinstance(msg, StepPlan), f"unexpected message {type(msg).__name__}"
        try:
            if fault == msg.step:
                runner.digest.add_blocks(-1, [0])  # a phantom table entry: state diverges
            out = runner.execute(msg)
            sock.send(codec.encode(
                StepResult(msg.step, rank, out.digest, out.sampled, out.forward_s)))
        except Exception as exc:
            # A rank that failed mid-step cannot rejoin the collectives: report and exit.
            log.error("step_failed", step=msg.step, error=traceback.format_exc())
            sock.send(codec.encode(
                StepResult(msg.step, rank, 0, error=f"{type(exc).__name__}: {exc}")))
            return 1


def _parse_fault(spec: str | None, rank: int) -> int | None:
    if not spec:
        return None
    fault_rank, step = (int(x) for x in spec.split(":"))
    return step if fault_rank == rank else None


if __name__ == "__main__":
    sys.exit(main())
