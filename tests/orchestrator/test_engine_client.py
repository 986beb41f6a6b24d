"""EngineClient's side of the wire: the hello handshake, a clear error when no scheduler
answers, and the abort sent when a consumer stops early.

The "scheduler" here is a bare ROUTER socket in the test that records what it receives;
it never produces tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from orchestrator.shim.engine_client import EngineClient, EngineUnavailableError
from wire.client import AbortRequest, GenerateRequest
from wire.codec import decode, encode
from wire.lifecycle import ClientHello, EngineInfo, EngineLimits, Shutdown

INFO = EngineInfo("tiny", 16, 1, EngineLimits(vocab_size=100, max_model_len=64,
                                               eos_token_ids=(1,), num_device_blocks=8,
                                               num_host_blocks=0))


def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/requests.sock"


class Router:
    """The scheduler's end of the socket, driven by the test."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(addr)
        self.identity: bytes | None = None

    async def recv(self, timeout_s: float = 5.0) -> Any:
        ident, frame = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        self.identity = ident
        return decode(frame)

    async def send(self, message: Any) -> None:
        assert self.identity is not None
        await self.sock.send_multipart([self.identity, encode(message)])

    async def handshake(self) -> None:
        hello = await self.recv()
        assert isinstance(hello, ClientHello) and hello.pid > 0
        await self.send(INFO)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_no_scheduler_is_a_clear_error(tmp_path: Path) -> None:
    async def main() -> None:
        client = EngineClient(address(tmp_path), connect_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="did not answer ClientHello"):
            await client.start()
        assert time.monotonic() - t0 < 3
        assert not client.connected

    asyncio.run(main())


@asynccontextmanager
async def connected(tmp_path: Path) -> AsyncIterator[Wire]:
    """A client that has said hello to a test-driven router (`wire.router` may be
    replaced, as by a restarted scheduler: the current one is closed at the end)."""
    wire = Wire(Router(address(tmp_path)), EngineClient(address(tmp_path), connect_timeout_s=5))
    try:
        start = asyncio.create_task(wire.client.start())
        await wire.router.handshake()
        assert await start == INFO
        yield wire
    finally:
        await wire.client.close()
        wire.router.close()


@dataclass
class Wire:
    router: Router
    client: EngineClient


async def collect(client: EngineClient, rid: str, outs: list[Any]) -> None:
    async for out in client.generate(GenerateRequest(rid, [1], 4)):
        outs.append(out)


def test_handshake_and_abort_when_the_consumer_leaves(tmp_path: Path) -> None:
    async def main() -> None:
        async with connected(tmp_path) as wire:
            router, client = wire.router, wire.client
            assert client.connected and client.info == INFO

            # A consumer that is cancelled while waiting (the HTTP client went away).
            async def consume(rid: str) -> None:
                async for _ in client.generate(GenerateRequest(rid, [1, 2, 3], 4)):
                    pass

            task = asyncio.create_task(consume("r1"))
            req = await router.recv()
            assert isinstance(req, GenerateRequest) and req.prompt_token_ids == [1, 2, 3]
            task.cancel()
            abort = await router.recv()
            assert abort == AbortRequest("r1", "abort")
            assert client.num_live_requests == 0

            # An explicit abort (a stop string matched) is sent once, with its reason;
            # closing the generator afterwards does not send a second one.
            gen = client.generate(GenerateRequest("r2", [4], 4))
            waiting = asyncio.create_task(gen.__anext__())
            assert isinstance(await router.recv(), GenerateRequest)
            await client.abort("r2", "stop")
            assert await router.recv() == AbortRequest("r2", "stop")
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await gen.aclose()
            with pytest.raises(asyncio.TimeoutError):
                await router.recv(timeout_s=0.2)

    asyncio.run(main())


def test_shutdown_fails_live_requests(tmp_path: Path) -> None:
    async def main() -> None:
        async with connected(tmp_path) as wire:
            router, client = wire.router, wire.client
            outs: list[Any] = []
            task = asyncio.create_task(collect(client, "r1", outs))
            await router.recv()
            await router.send(Shutdown("test over"))
            await asyncio.wait_for(task, 5)
            assert [(o.finished, o.finish_reason, o.error_type) for o in outs] == [
                (True, "error", "unavailable")]
            assert "test over" in outs[0].error
            assert not client.connected
            with pytest.raises(EngineUnavailableError):
                async for _ in client.generate(GenerateRequest("r2", [1], 4)):
                    pass
            with pytest.raises(EngineUnavailableError):
                await client.stats()
            # it keeps saying hello; the next EngineInfo (a restarted engine) reconnects it
            await router.handshake()
            await wait_until(lambda: client.connected)

    asyncio.run(main())


async def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_scheduler_gone_without_goodbye_fails_live_requests_then_reconnects(
        tmp_path: Path) -> None:
    """A scheduler killed with SIGKILL sends no Shutdown: the socket monitor sees the
    connection drop. A new scheduler on the same address is found again."""

    async def main() -> None:
        async with connected(tmp_path) as wire:
            router, client = wire.router, wire.client
            outs: list[Any] = []
            task = asyncio.create_task(collect(client, "r1", outs))
            await router.recv()
            router.close()  # no goodbye
            await asyncio.wait_for(task, 5)
            assert [(o.finish_reason, o.error_type) for o in outs] == [("error", "unavailable")]
            assert not client.connected

            # the restarted scheduler binds the same path
            router = wire.router = Router(address(tmp_path))
            t0 = time.monotonic()
            await router.handshake()
            await wait_until(lambda: client.connected)
            assert time.monotonic() - t0 < 3
            task = asyncio.create_task(collect(client, "r2", []))
            msg = await router.recv()
            while isinstance(msg, ClientHello):  # hellos queued while it was away
                msg = await router.recv()
            assert isinstance(msg, GenerateRequest)
            task.cancel()

    asyncio.run(main())
