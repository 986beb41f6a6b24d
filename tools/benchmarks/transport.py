"""The step protocol's transport alone: a plan to every rank and a result back from each,
three ways, with the engine's overlap (the next plan sent before this one's results).

    python -m tools.benchmarks.transport [--ranks 4] [--batch 64] [--steps 2000]
        [--rank-us 0,200] [--sched-us 0,400] [--transports zmq,unix,shm]

A shared-memory broadcast of the plan is worth its code only if the socket is what bounds
the step. This measures whether it is, with nothing of the engine around the exchange:

- zmq: ROUTER / DEALER over ipc://, as scheduler/executor.py and worker/main.py use them
  (each message through the sender's and the receiver's ZeroMQ I/O threads);
- unix: a SOCK_SEQPACKET socket pair per rank (one system call each way, no I/O thread);
- shm: the engine's step channel (wire/step_channel.py): the plan written once into
  shared memory and each rank woken by a byte on its FIFO; each rank's result in a slot
  of its own, the sender woken through one FIFO.

The plan is a real StepPlan of `--batch` plain decodes and the result a StepResult, both
through wire/codec.py. Each rank decodes the plan, spins `rank_us` microseconds (its
work: the engine's rank spends ~150 us of CPU on a batch-64 decode step) and answers; the
sender spins `sched_us` a step (its planning: ~300 us). The figure is ms per step; where
the processes outnumber the cores it is as much the machine's scheduling as the transport.
Rank processes are forked before anything else starts threads; nothing is pickled.
"""

from __future__ import annotations

import argparse
import multiprocessing
import select
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from rich.console import Console
from rich.table import Table

from tools.benchmarks.machine import describe, print_summary
from wire import codec
from wire.step import PENDING_TOKEN, RankTiming, StepPlan, StepResult
from wire.step_channel import RankChannel, SchedulerChannel

TRANSPORTS = ("zmq", "unix", "shm")
SLOT_BYTES = 1 << 20  # the most a SEQPACKET message is read with
STOP = b"stop"


@dataclass
class Cell:
    transport: str
    rank_us: float
    sched_us: float
    ms_per_step: float


def spin(us: float) -> None:
    """Busy for `us` microseconds: work that holds a core, as planning or a rank's step does."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def make_plan(step: int, batch: int) -> StepPlan:
    plan = StepPlan(step=step)
    for seq_id in range(batch):
        plan.decodes.append(seq_id, PENDING_TOKEN, 1000 + step)
    return plan


def check(frame: bytes, step: int) -> None:
    """The sender's side of a result: decoded, and for the step collected."""
    result = codec.decode(frame)
    assert isinstance(result, StepResult) and result.step == step, (result, step)


def answer(frame: bytes, rank: int, rank_us: float) -> bytes:
    """A rank's step: the plan decoded, its work, its result encoded."""
    plan = codec.decode(frame)
    spin(rank_us)
    return codec.encode(StepResult(plan.step, rank, 12345, [], RankTiming()))


# --- the three transports: start N ranks, then submit(frame) / collect() from the sender

class ZmqLink:
    SHM = False  # the ranks' steps over the socket itself

    def __init__(self, ranks: int, rank_us: float, run_dir: str) -> None:
        self.address = f"ipc://{run_dir}/transport.sock"
        # forked before this process has a ZeroMQ context (a forked one is not usable)
        self.procs = start_ranks(
            ranks, lambda r: _socket_rank(self.address, r, ranks, rank_us, self.SHM))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.address)
        self.ids = [self.sock.recv_multipart()[0] for _ in range(ranks)]
        self.collected = 0
        self.early = 0  # results of the next step, from ranks ahead of the others

    def submit(self, frame: bytes) -> None:
        for identity in self.ids:
            self.sock.send_multipart([identity, frame])

    def _arrived(self) -> list[bytes]:
        """The next result frames to come in (at least one)."""
        return [self.sock.recv_multipart()[1]]

    def collect(self) -> None:
        """Results come in arrival order: a rank may answer step k+1 (sent before step k
        is collected) before a slower one answers step k."""
        step, needed, self.early = self.collected, len(self.ids) - self.early, 0
        while needed:
            for frame in self._arrived():
                result = codec.decode(frame)
                assert result.step in (step, step + 1), (result.step, step)
                if result.step == step:
                    needed -= 1
                else:
                    self.early += 1
        self.collected += 1

    def close(self) -> None:
        for identity in self.ids:
            self.sock.send_multipart([identity, STOP])
        join(self.procs)
        self.sock.close(linger=0)
        self.ctx.term()


def _socket_rank(address: str, rank: int, ranks: int, rank_us: float, shm: bool) -> None:
    """A rank: its steps over the socket, or over the step channel beside it (the socket
    then carries the hello and the stop, as in the engine)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    link = RankChannel(address, rank, ranks, sock) if shm else sock
    sock.send(b"hello")  # after opening the channel: the sender then unlinks its names
    while (frame := link.recv()) != STOP:
        link.send(answer(frame, rank, rank_us))
    sock.close(linger=0)
    ctx.term()


class UnixLink:
    def __init__(self, ranks: int, rank_us: float, run_dir: str) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(ranks)]
        self.procs = start_ranks(ranks, lambda r: _unix_rank(pairs[r][1], r, rank_us))
        for _, theirs in pairs:
            theirs.close()
        self.socks = [ours for ours, _ in pairs]
        self.collected = 0

    def submit(self, frame: bytes) -> None:
        for s in self.socks:
            s.send(frame)

    def collect(self) -> None:
        for s in self.socks:
            check(s.recv(SLOT_BYTES), self.collected)
        self.collected += 1

    def close(self) -> None:
        for s in self.socks:
            s.send(STOP)
        join(self.procs)


def _unix_rank(sock: socket.socket, rank: int, rank_us: float) -> None:
    while (frame := sock.recv(SLOT_BYTES)) != STOP:
        sock.send(answer(frame, rank, rank_us))


class ShmLink(ZmqLink):
    """The engine's own step channel (wire/step_channel.py): plans through shared memory
    with a FIFO byte per rank, results back the same way; the ZeroMQ socket beside it
    carries the hello and the stop, as in the engine."""

    SHM = True

    def __init__(self, ranks: int, rank_us: float, run_dir: str) -> None:
        # made before the ranks open it
        self.channel = SchedulerChannel(f"ipc://{run_dir}/transport.sock", ranks)
        try:
            super().__init__(ranks, rank_us, run_dir)
        finally:  # every rank has opened it (or none will): its names go either way
            self.channel.unlink()

    def submit(self, frame: bytes) -> None:
        self.channel.post(frame, send_over_socket=None)  # a plan here always fits its slot

    def _arrived(self) -> list[bytes]:
        select.select([self.channel.results_fd], [], [])
        return self.channel.take_results()

    def close(self) -> None:
        super().close()
        self.channel.close()


LINKS = {"zmq": ZmqLink, "unix": UnixLink, "shm": ShmLink}


def start_ranks(n: int, target: Callable[[int], None]) -> list:
    fork = multiprocessing.get_context("fork")  # inherits the sockets; nothing pickled
    procs = [fork.Process(target=target, args=(r,), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    return procs


def join(procs: list) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            raise RuntimeError(f"a rank did not stop (pid {p.pid})")


def run_cell(transport: str, args: argparse.Namespace, rank_us: float,
             sched_us: float) -> Cell:
    """Steps as the engine overlaps them: plan k+1 sent, then step k collected."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-transport-") as run_dir:
        link = LINKS[transport](args.ranks, rank_us, run_dir)
        try:
            frames = [codec.encode(make_plan(s, args.batch))
                      for s in range(args.warmup + args.steps + 1)]
            link.submit(frames[0])
            t0 = 0.0
            for k in range(args.warmup + args.steps):
                if k == args.warmup:
                    t0 = time.perf_counter()
                link.submit(frames[k + 1])
                link.collect()
                spin(sched_us)
            elapsed = time.perf_counter() - t0
            link.collect()
        finally:
            link.close()
    return Cell(transport, rank_us, sched_us, 1000 * elapsed / args.steps)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="plain decodes in each plan")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rank-us", default="0,200", help="each rank's work per step, us")
    p.add_argument("--sched-us", default="0,400", help="the sender's work per step, us")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--repeats", type=int, default=2, help="rounds over the transports")
    p.add_argument("--no-machine-rates", action="store_true")
    args = p.parse_args(argv)
    console = console or Console()
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        p.error(f"unknown transports {sorted(unknown)}; choose from {', '.join(TRANSPORTS)}")
    cells: list[Cell] = []
    for rank_us in (float(x) for x in args.rank_us.split(",")):
        for sched_us in (float(x) for x in args.sched_us.split(",")):
            for _ in range(args.repeats):  # transports alternated: the machine drifts
                cells += [run_cell(t, args, rank_us, sched_us) for t in transports]
    # measured after the ranks: torch's threads must not exist when they are forked
    print_summary(console, describe(measure=not args.no_machine_rates))
    table = Table(title=f"Plan to {args.ranks} ranks and results back, batch {args.batch}: "
                        "ms per step (each round)")
    for col in ("rank us", "sched us", *transports):
        table.add_column(col, justify="right")
    for rank_us in dict.fromkeys(c.rank_us for c in cells):
        for sched_us in dict.fromkeys(c.sched_us for c in cells):
            mine = [c for c in cells if (c.rank_us, c.sched_us) == (rank_us, sched_us)]
            table.add_row(f"{rank_us:g}", f"{sched_us:g}", *(
                ", ".join(f"{c.ms_per_step:.3f}" for c in mine if c.transport == t)
                for t in transports))
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
