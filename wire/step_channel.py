"""The step channel: plans to the ranks and their results back through shared memory, for
ranks on the scheduler's host (EngineConfig.step_channel = "shm"; ZeroMQ otherwise).

Over ZeroMQ every message crosses the sender's and the receiver's I/O threads: a plan to
4 ranks and their 4 results wake about 16 threads a step, and where processes outnumber
cores each wake-up waits for a core. Here the scheduler writes a plan once, into a slot
every rank reads, and wakes each rank with a byte on the rank's FIFO; a rank writes its
result into a slot of its own and wakes the scheduler with a byte on one FIFO, so one
wake-up may collect several results. Measured alone (tools/benchmarks/transport.py: 4 ranks,
2 cores), the exchange costs 0.05 ms a step against 0.13 over ZeroMQ.

Only the steps use it: connecting, the configuration, WorkerReady and Shutdown stay on
the ZeroMQ socket, and so does a frame too large for its slot (the slot then says "on the
socket" and the frame follows there, in order).

The mapped file (in /dev/shm under a random name, written into the private run directory
for the ranks; made exclusively, its space reserved up front, unlinked with the FIFOs
once every rank has opened them) holds 2 plan slots, then 2 result slots per rank. A
slot is a sequence number (int64, written last), a length (int64; ON_SOCKET: the frame
comes over ZeroMQ) and the frame. Message n of a sender goes in its slot n % 2. The
scheduler posts plan n + 2 only after it has taken every rank's result n (with overlap
scheduling at most two plans are in flight, scheduler/engine.py, and `post` checks it),
and a rank answers plan n + 2 only after it came, so no slot is overwritten before it is
read. The sequence number is stored after the frame and loaded before it; x86-64 keeps
stores in order and loads in order, so a reader that sees the number sees the frame.
Elsewhere the engine keeps ZeroMQ (`supported`).
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import secrets
import struct
import sys
import time
from pathlib import Path

import zmq

# A batch-256 decode plan is ~3 KB, a prefill chunk of 8K tokens ~40 KB: larger frames
# (new tables of very long prompts) go over the socket. The space is reserved at start
# (6 MiB at world size 4), so a full /dev/shm fails there, never mid-step.
PLAN_SLOT_BYTES = 2 << 20
RESULT_SLOT_BYTES = 256 << 10
_INT64 = struct.Struct("<q")  # a slot's sequence number (at 0), then its length (at 8)
HEADER_BYTES = 16
ON_SOCKET = -1  # the slot's length when the frame went over the ZeroMQ socket instead
NOTHING = -1  # the sequence number of a slot nothing was written to yet


def supported(address: str) -> str | None:
    """Why the shared-memory channel cannot serve ranks at this address; None if it can."""
    path = address[len("ipc://"):]
    if not address.startswith("ipc://") or not path.startswith("/"):
        return "it needs every rank on the scheduler's host (an ipc:// address, absolute)"
    if not sys.platform.startswith("linux"):
        return f"it needs Linux (FIFOs, /dev/shm), not {sys.platform}"
    if platform.machine() != "x86_64":
        return f"it relies on x86-64's store order ({platform.machine()} is not)"
    return None


def _paths(address: str, world_size: int) -> tuple[Path, Path, list[Path]]:
    """In the run directory of the ipc:// address: the file naming the mapped file, the
    scheduler's FIFO and each rank's."""
    run_dir = Path(address[len("ipc://"):]).parent
    return (run_dir / "steps-channel", run_dir / "steps-results.fifo",
            [run_dir / f"steps-plan-{r}.fifo" for r in range(world_size)])


def _open_fifo(path: Path) -> int:
    # read-write: neither end blocks on open, and the FIFO never reports end-of-file
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # the FIFO is full of unread wake-ups: the reader wakes anyway
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class _Slots:
    """The mapped file's slots: plans 0 and 1, then rank r's results at 2 + 2r and 3 + 2r."""

    def __init__(self, mem: mmap.mmap) -> None:
        self.mem = mem

    @staticmethod
    def offset(slot: int) -> int:
        if slot < 2:
            return slot * PLAN_SLOT_BYTES
        return 2 * PLAN_SLOT_BYTES + (slot - 2) * RESULT_SLOT_BYTES

    @staticmethod
    def capacity(slot: int) -> int:
        return (PLAN_SLOT_BYTES if slot < 2 else RESULT_SLOT_BYTES) - HEADER_BYTES

    def seq(self, slot: int) -> int:
        return _INT64.unpack_from(self.mem, self.offset(slot))[0]

    def read(self, slot: int) -> bytes | None:
        """The slot's frame; None when it went over the socket."""
        at = self.offset(slot)
        length = _INT64.unpack_from(self.mem, at + 8)[0]
        if length == ON_SOCKET:
            return None
        return self.mem[at + HEADER_BYTES:at + HEADER_BYTES + length]

    def write(self, slot: int, seq: int, frame: bytes | None) -> None:
        """`frame` into the slot as message `seq` (None: "on the socket"); the sequence
        number last."""
        at = self.offset(slot)
        if frame is not None:
            self.mem[at + HEADER_BYTES:at + HEADER_BYTES + len(frame)] = frame
        _INT64.pack_into(self.mem, at + 8, ON_SOCKET if frame is None else len(frame))
        _INT64.pack_into(self.mem, at, seq)

    def fits(self, slot: int, frame: bytes) -> bool:
        return len(frame) <= self.capacity(slot)


class SchedulerChannel:
    """The scheduler's end: made before the ranks are sent the configuration (they open it
    then), its names removed once they all have. An OSError here (no room in /dev/shm)
    leaves nothing behind."""

    def __init__(self, address: str, world_size: int) -> None:
        self.world_size = world_size
        name_file, results_fifo, plan_fifos = _paths(address, world_size)
        shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else name_file.parent
        self._file = shm_dir / f"deepinfer-steps-{secrets.token_hex(8)}"
        self._names = [name_file, results_fifo, *plan_fifos]
        size = _Slots.offset(2 + 2 * world_size)
        try:
            for path in (results_fifo, *plan_fifos):
                path.unlink(missing_ok=True)
                os.mkfifo(path, 0o600)
            # a fresh file of this process's (never one someone else put there), its space
            # reserved now: a full tmpfs fails here, not with SIGBUS at a later write
            fd = os.open(self._file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                self._slots = _Slots(mmap.mmap(fd, size))
            finally:
                os.close(fd)
            name_file.write_text(str(self._file))
        except OSError:
            self.unlink()
            raise
        for slot in range(2 + 2 * world_size):
            self._slots.write(slot, NOTHING, b"")
        self.results_fd = _open_fifo(results_fifo)
        self._plan_fds = [_open_fifo(p) for p in plan_fifos]
        self._posted = 0  # plans posted
        self._taken = [0] * world_size  # results read, per rank

    def unlink(self) -> None:
        """Every rank has opened the file and the FIFOs: their names can go (nothing is
        left behind if the scheduler dies later)."""
        for path in (self._file, *self._names):
            path.unlink(missing_ok=True)

    def post(self, frame: bytes, send_over_socket) -> None:
        """Plan `frame` to every rank; `send_over_socket(frame)` sends it over ZeroMQ when
        it does not fit its slot (after the slot says so: a rank reading the slot then
        waits for it on the socket)."""
        n, slot = self._posted, self._posted % 2
        # the slot's last plan (n - 2) must have been answered by every rank (read by it)
        assert min(self._taken) >= n - 1, f"plan {n} posted before every result {n - 2}"
        fits = self._slots.fits(slot, frame)
        self._slots.write(slot, n, frame if fits else None)
        self._posted += 1
        for fd in self._plan_fds:
            _wake(fd)
        if not fits:
            send_over_socket(frame)

    def take_results(self) -> list[bytes]:
        """The results written since the last call, in rank order (a rank's own in order);
        one that went over the socket is not among them (it comes there)."""
        _drain(self.results_fd)
        frames = []
        for r in range(self.world_size):
            while self._slots.seq(slot := 2 + 2 * r + self._taken[r] % 2) == self._taken[r]:
                frame = self._slots.read(slot)
                self._taken[r] += 1
                if frame is not None:
                    frames.append(frame)
        return frames

    def close(self) -> None:
        if self._slots.mem.closed:
            return
        self.unlink()
        for fd in (self.results_fd, *self._plan_fds):
            os.close(fd)
        self._slots.mem.close()


class RankChannel:
    """A rank's end, in place of its ZeroMQ socket once it has the configuration: `recv`,
    `poll` and `send` as the socket's (worker/main.py serves either). A Shutdown, and a plan
    too large for its slot, still come over the socket."""

    def __init__(self, address: str, rank: int, world_size: int, sock: zmq.Socket) -> None:
        name_file, results_fifo, plan_fifos = _paths(address, world_size)
        fd = os.open(name_file.read_text(), os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._slots = _Slots(mmap.mmap(fd, 0))
        finally:
            os.close(fd)
        self.rank = rank
        self._sock = sock
        self._results_fd = _open_fifo(results_fifo)
        self._plan_fd = _open_fifo(plan_fifos[rank])
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._plan_fd, zmq.POLLIN)
        self._received = 0  # plans read
        self._sent = 0  # results written

    def _ready(self) -> bool:
        """The next plan is posted, or a message (a Shutdown) is on the socket."""
        if self._slots.seq(self._received % 2) == self._received:
            return True
        return bool(self._sock.poll(0))

    def poll(self, timeout_ms: int | None = None) -> bool:
        """Whether a message is there within `timeout_ms` (None: however long it takes),
        as zmq.Socket.poll. A wake-up may be stale (a plan read before its byte was), so
        each is checked and the wait goes on for the rest of the time."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while not self._ready():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if self._poller.poll(None if remaining is None else math.ceil(remaining * 1000)):
                _drain(self._plan_fd)
        return True

    def recv(self) -> bytes:
        """The next plan (in posting order), or what came over the socket."""
        self.poll()
        slot = self._received % 2
        if self._slots.seq(slot) == self._received:
            frame = self._slots.read(slot)
            self._received += 1
            return frame if frame is not None else self._sock.recv()
        return self._sock.recv()  # a Shutdown: no plan of the socket's is announced

    def send(self, frame: bytes) -> None:
        """A result (or a failure) to the scheduler."""
        slot = 2 + 2 * self.rank + self._sent % 2
        fits = self._slots.fits(slot, frame)
        self._slots.write(slot, self._sent, frame if fits else None)
        self._sent += 1
        if not fits:
            self._sock.send(frame)
        _wake(self._results_fd)
