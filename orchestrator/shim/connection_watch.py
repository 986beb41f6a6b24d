"""The engine client's watch on its connection, and its calls for a new scheduler.

A scheduler that goes away says so (Shutdown), but one killed outright says no goodbye:
the socket's monitor sees the connection drop, and tells the client it lost its engine.
From then ClientHello is sent again every HELLO_INTERVAL_S until a scheduler answers: the
DEALER reconnects by itself when a new scheduler binds the same address, and its
EngineInfo makes the client connected again (engine_client.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from wire.lifecycle import ClientHello

HELLO_INTERVAL_S = 1.0  # while the engine is lost: how often ClientHello is resent
DISCONNECT_GRACE_S = 0.2  # a disconnect waits this long for the reader to drain


class ConnectionWatch:
    """The monitor of the client's socket (`watch`), and the hellos sent while no
    scheduler answers (`call_until_answered`)."""

    def __init__(self, sock: zmq.asyncio.Socket, send_nowait: Callable[[Any, int], None],
                 connected: Callable[[], bool], lost: Callable[[str], None]) -> None:
        self._sock = sock
        self._send_nowait = send_nowait
        self._connected = connected  # whether a scheduler has answered since the loss
        self._lost = lost  # the client's: fail what is live
        self._monitor: zmq.asyncio.Socket = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._rehello: asyncio.Task[None] | None = None

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """What close() cancels besides `watch`: the hellos, if they were started."""
        return [self._rehello] if self._rehello else []

    def close(self) -> None:
        """Stop monitoring the socket (its tasks cancelled first: `tasks`)."""
        self._rehello = None
        self._sock.disable_monitor()
        self._monitor.close(linger=0)

    def call_until_answered(self) -> None:
        """The scheduler is gone: say hello every HELLO_INTERVAL_S until a new one answers."""
        if self._rehello is None or self._rehello.done():
            self._rehello = asyncio.create_task(self._hello_until_answered(),
                                                name="engine-client-rehello")

    async def _hello_until_answered(self) -> None:
        while not self._connected():
            self._send_hello()
            await asyncio.sleep(HELLO_INTERVAL_S)

    def _send_hello(self) -> None:
        """Never waits: queued for the (re)connection, or dropped if the queue is full
        (the next one goes out a second later)."""
        self._send_nowait(ClientHello(pid=os.getpid()), zmq.DONTWAIT)

    async def watch(self) -> None:
        """The socket's own view of its connection: a scheduler killed with SIGKILL
        sends no Shutdown, but its peer sees the connection drop."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                # What a failing scheduler sent before it went (each request's error naming
                # the failed rank, then its Shutdown) is already queued on the other
                # socket: let the reader route it first, so those words are not lost.
                await asyncio.sleep(DISCONNECT_GRACE_S)
                self._lost("the connection to the scheduler was lost")
            elif event == zmq.EVENT_CONNECTED and self._rehello is not None \
                    and not self._connected():
                self._send_hello()  # a new scheduler: no need to wait for the next tick
