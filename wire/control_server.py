"""The control socket every rank and the scheduler serve, and the client the CLI uses.

A daemon thread with its own REP socket answers one request at a time by calling a
handler; the handler reads the process's state (copies, never iterators), so it
answers while the main thread is inside a forward pass or blocked in a collective,
as long as that thread lets go of the GIL (torch ops, collectives and sleeps do).

Addresses: `ipc://RUN_DIR/control-rank{N}.sock` and `ipc://RUN_DIR/control-scheduler.sock`.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from wire import codec
from wire.control import ControlError, StackDump
from wire.security import secure_bind

CONTROL_DIR_ENV = "DEEPINFER_CONTROL_DIR"
POLL_MS = 200


def control_address(run_dir: Path | str, name: str) -> str:
    """`name`: "scheduler" or "rank{N}"."""
    return f"ipc://{Path(run_dir).resolve()}/control-{name}.sock"


def control_dir_for(scheduler_address: str) -> Path | None:
    """Where a rank puts its control socket: the run directory of an ipc:// scheduler
    address (ranks started by torchrun know no other), else $DEEPINFER_CONTROL_DIR."""
    if os.environ.get(CONTROL_DIR_ENV):
        return Path(os.environ[CONTROL_DIR_ENV])
    if scheduler_address.startswith("ipc://"):
        return Path(scheduler_address[len("ipc://"):]).parent
    return None  # tcp:// without a control dir: no control socket


def stack_dump(role: str, rank: int, all_threads: bool = False) -> StackDump:
    """The main thread's Python stack (every thread's with `all_threads`), for a hang."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    threads = {}
    for ident, frame in sys._current_frames().items():
        if ident == main_id or all_threads:
            name = names.get(ident, f"thread-{ident}")
            threads[name] = "".join(traceback.format_stack(frame))
    return StackDump(role, rank, os.getpid(), threads)


class ControlServer:
    def __init__(self, address: str, handler: Callable[[Any], Any], log: Any = None) -> None:
        self.address = address
        self.handler = handler
        self.log = log
        self._stop = threading.Event()
        self._ctx = zmq.Context()  # its own: the main thread's context is left alone
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        # In the caller's thread, so a bad address fails loudly; a 0600 socket file.
        secure_bind(self._sock, address)
        self._thread = threading.Thread(target=self._serve, name="deepinfer-control",
                                        daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_MS / 1000)
        if not self._thread.is_alive():
            self._sock.close(linger=0)
            self._ctx.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            frame = self._sock.recv()
            try:
                reply = self.handler(codec.decode(frame))
            except Exception as exc:  # a bad question must not kill the control thread
                if self.log is not None:
                    self.log.warning("control_request_failed", error=repr(exc))
                reply = ControlError(f"{type(exc).__name__}: {exc}")
            self._sock.send(codec.encode(reply))


class ControlUnavailable(RuntimeError):
    """No answer from a control socket (the process is gone, or not answering)."""


def ask(address: str, request: Any, timeout_s: float = 5.0) -> Any:
    """One request, one reply; raises ControlUnavailable on timeout, or a ControlError's
    message as ControlUnavailable too (the process answered but could not serve it)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(codec.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlUnavailable(f"no answer from {address} within {timeout_s:g}s")
        reply = codec.decode(sock.recv())
    finally:
        sock.close(linger=0)
    if isinstance(reply, ControlError):
        raise ControlUnavailable(f"{address}: {reply.message}")
    return reply
