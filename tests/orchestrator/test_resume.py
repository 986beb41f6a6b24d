"""Continuing a request across an engine restart, on the engine client's side
(orchestrator/shim/resume.py): what the restarted scheduler is sent, what the consumer
sees, and when a request ends with its error instead.

The "scheduler" is a ROUTER socket driven by the test (tests/orchestrator/
test_engine_client.py): one dies (an error per request and a goodbye, as when a rank
dies; or no word at all, as when the scheduler is killed), another binds the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.shim.engine_client import EngineClient
from orchestrator.shim.metrics import Metrics
from orchestrator.shim.resume import ResumePolicy, request_seed
from orchestrator.shim.server import build_app
from tests.orchestrator.test_engine_client import INFO, Router, Wire, address, wait_until
from wire.client import AbortRequest, GenerateRequest, RequestOutput, SamplingParams, TurnEnd
from wire.lifecycle import ClientHello, EngineInfo, EngineLimits, Shutdown


@asynccontextmanager
async def resuming(tmp_path: Path, timeout_s: float = 10.0) -> AsyncIterator[Wire]:
    client = EngineClient(address(tmp_path), connect_timeout_s=5,
                          resume=ResumePolicy(timeout_s))
    client.attach_metrics(Metrics())
    wire = Wire(Router(address(tmp_path)), client)
    try:
        start = asyncio.create_task(client.start())
        await wire.router.handshake()
        assert await start == INFO
        yield wire
    finally:
        await client.close()
        wire.router.close()


async def next_request(router: Router) -> Any:
    """The next message but the hellos a client sends while its engine is away."""
    msg = await router.recv()
    while isinstance(msg, ClientHello):
        msg = await router.recv()
    return msg


async def new_router(wire: Wire, tmp_path: Path) -> Router:
    """The restarted scheduler: a new socket on the same address, answering hello."""
    router = wire.router = Router(address(tmp_path))
    await router.handshake()
    await wait_until(lambda: wire.client.connected)
    return router


def dies(how: str):
    """How the engine goes: a rank died (the scheduler fails each request, then says
    goodbye), or the scheduler itself was killed (its socket just closes)."""
    async def die(router: Router, request_ids: list[str]) -> None:
        if how == "rank":
            for rid in request_ids:
                await router.send(RequestOutput(rid, finished=True, finish_reason="error",
                                                error="engine failed: rank 1 died",
                                                error_type="unavailable"))
            await router.send(Shutdown("engine failed: rank 1 died"))
            await asyncio.sleep(0.1)
        router.close()
    return die


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("how", ["rank", "scheduler"])
def test_a_request_goes_on_from_the_restarted_engine(tmp_path: Path, how: str) -> None:
    async def main() -> None:
        async with resuming(tmp_path) as wire:
            router, client = wire.router, wire.client
            outs: list[RequestOutput] = []

            async def consume() -> None:
                async for out in client.generate(GenerateRequest(
                        "r1", [1, 2, 3], 8, sampling=SamplingParams(temperature=1.0),
                        timeout_s=60)):
                    outs.append(out)

            task = asyncio.create_task(consume())
            sent = await router.recv()
            # sampled without a seed: it gets its id's, which its continuation keeps
            assert sent.sampling.seed == request_seed("r1")
            await router.send(RequestOutput("r1", [10, 11], num_prompt_tokens=3,
                                            num_device_cached_tokens=2))
            await wait_until(lambda: len(outs) == 1)
            await dies(how)(router, ["r1"])
            await asyncio.sleep(0.3)
            assert not task.done() and len(outs) == 1  # a pause, not an error

            router = await new_router(wire, tmp_path)
            assert await next_request(router) == AbortRequest("r1", "abort")
            cont = await next_request(router)
            assert isinstance(cont, GenerateRequest) and cont.request_id == "r1.r1"
            assert (cont.prompt_token_ids, cont.resumed_output, cont.max_tokens,
                    cont.sampling.seed) == ([1, 2, 3], [10, 11], 8, request_seed("r1"))
            assert 55 < cont.timeout_s < 60  # what is left of its deadline
            # the continuation's cached counts include the resumed output: dropped
            await router.send(RequestOutput("r1.r1", [12], num_prompt_tokens=3,
                                            num_device_cached_tokens=4))
            await router.send(RequestOutput("r1.r1", [13], finished=True,
                                            finish_reason="length", num_prompt_tokens=3))
            await asyncio.wait_for(task, 5)
            assert [(o.request_id, o.token_ids, o.num_device_cached_tokens, o.finish_reason)
                    for o in outs] == [("r1", [10, 11], 2, None), ("r1", [12], 0, None),
                                       ("r1", [13], 0, "length")]
            m = client._metrics
            assert sample(m, "deepinfer_requests_resumed_total") == 1
            assert sample(m, "deepinfer_request_resume_pause_seconds_count") == 1
            assert sample(m, "deepinfer_request_resume_pause_seconds_sum") >= 0.3
            assert client.num_live_requests == 0
            # the answer's TurnEnd names the sequence the restarted scheduler closed
            client.turn_end("r1", tool_call=True)
            assert await next_request(router) == TurnEnd("r1.r1", tool_call=True)

    asyncio.run(main())


def test_a_queued_request_is_sent_again_and_a_stop_aborts_the_continuation(
        tmp_path: Path) -> None:
    """A request with no output yet is sent again whole (its cached counts are then its
    own); the consumer's abort (a stop string) reaches the continuation's id."""
    async def main() -> None:
        async with resuming(tmp_path) as wire:
            client = wire.client
            gen = client.generate(GenerateRequest("q", [4, 5], 6))
            first = asyncio.create_task(gen.__anext__())
            assert (await wire.router.recv()).sampling.seed is None  # greedy: no seed
            await dies("scheduler")(wire.router, [])
            router = await new_router(wire, tmp_path)
            assert await next_request(router) == AbortRequest("q", "abort")
            cont = await next_request(router)
            assert (cont.request_id, cont.resumed_output) == ("q.r1", [])
            await router.send(RequestOutput("q.r1", [7], num_prompt_tokens=2,
                                            num_device_cached_tokens=1))
            out = await asyncio.wait_for(first, 5)
            assert (out.request_id, out.token_ids, out.num_device_cached_tokens) == (
                "q", [7], 1)
            await client.abort("q", "stop")
            assert await next_request(router) == AbortRequest("q.r1", "stop")
            await gen.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("why", ["timeout", "deadline", "stopping"])
def test_a_request_not_continued_ends_with_the_error_of_the_loss(tmp_path: Path,
                                                                 why: str) -> None:
    """No engine within --resume-timeout, the request's own deadline first, or the shim
    told that none will come (its restarts spent): the error a request got without
    --restart, once that is known."""
    async def main() -> None:
        async with resuming(tmp_path, timeout_s=0.5 if why == "timeout" else 30) as wire:
            client = wire.client
            outs: list[RequestOutput] = []

            async def consume() -> None:
                async for out in client.generate(GenerateRequest(
                        "r", [1], 4, timeout_s=0.5 if why == "deadline" else None)):
                    outs.append(out)

            task = asyncio.create_task(consume())
            await wire.router.recv()
            t0 = time.monotonic()
            await dies("rank")(wire.router, ["r"])
            if why == "stopping":
                await asyncio.sleep(0.2)
                client.stop_resuming("the HTTP server is stopping")
            await asyncio.wait_for(task, 5)
            assert 0.2 <= time.monotonic() - t0 < 3
            assert [(o.finish_reason, o.error_type, o.error) for o in outs] == [
                ("error", "unavailable", "engine failed: rank 1 died")]
            assert sample(client._metrics, "deepinfer_requests_resume_failed_total",
                          reason=why) == 1
            # once stopping, a later loss is not waited out either
            if why == "stopping":
                router = await new_router(wire, tmp_path)
                task = asyncio.create_task(consume())
                await next_request(router)
                await dies("scheduler")(router, [])
                await asyncio.wait_for(task, 2)

    asyncio.run(main())


# --- through the HTTP app: keep-alives during the pause, the parsers across it -------------

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                           "parameters": {"type": "object", "properties": {}}}}]


def big_info(vocab_size: int) -> EngineInfo:
    return EngineInfo("tiny", 16, 1, EngineLimits(vocab_size=vocab_size, max_model_len=4096,
                                                  eos_token_ids=(3,), num_device_blocks=512,
                                                  num_host_blocks=0))


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_stream_pauses_with_keepalives_and_its_parsers_read_on(
        tmp_path: Path, tiny_tokenizer, tiny_template, api: str) -> None:
    """A tool call (OpenAI chat) or a stop string (Anthropic) whose text the restart cuts
    in two: the shim's parsers, above the engine client, read one stream and give the
    whole call, or stop at the whole string; keep-alives (`: ping`, `event: ping`) go out
    while the engine is away."""
    info = big_info(tiny_tokenizer.get_vocab_size())
    before, after = (('Sure. <tool_call>{"name": "get_ti', 'me", "arguments": {}}</tool_call>')
                     if api == "openai" else ("The answer is EN", "D of it, not sent"))
    ids = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731

    async def main() -> str:
        client = EngineClient(address(tmp_path), connect_timeout_s=5,
                              resume=ResumePolicy(10))
        app = build_app(client, tiny_tokenizer, model_name="tiny", chat_template=tiny_template,
                        ping_interval_s=0.05)
        router = Router(address(tmp_path))

        async def handshake(r: Router) -> None:
            assert isinstance(await r.recv(), ClientHello)
            await r.send(info)

        async with contextlib.AsyncExitStack() as stack:
            stack.callback(lambda: routers[-1].close())
            routers = [router]
            hello = asyncio.create_task(handshake(router))
            await stack.enter_async_context(app.router.lifespan_context(app))
            await hello
            http = await stack.enter_async_context(httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://shim"))
            path, body = (("/v1/chat/completions", {"tools": TOOLS}) if api == "openai" else
                          ("/v1/messages", {"stop_sequences": ["END"]}))
            body = {"model": "m", "max_tokens": 64, "stream": True,
                    "messages": [{"role": "user", "content": "What time is it?"}], **body}
            response = asyncio.create_task(http.post(path, json=body))
            sent = await router.recv()
            await router.send(RequestOutput(sent.request_id, ids(before), num_prompt_tokens=9))
            await asyncio.sleep(0.2)
            await dies("rank")(router, [sent.request_id])
            await asyncio.sleep(0.3)  # the engine is away: keep-alives go out
            router = Router(address(tmp_path))
            routers.append(router)
            await handshake(router)
            assert isinstance(await next_request(router), AbortRequest)
            cont = await next_request(router)
            assert cont.resumed_output == ids(before)
            await router.send(RequestOutput(cont.request_id, [*ids(after), 3], finished=True,
                                            finish_reason="stop", num_prompt_tokens=9))
            r = await asyncio.wait_for(response, 10)
            assert r.status_code == 200, r.text
            return r.text

    text = asyncio.run(main())
    ping = ": ping" if api == "openai" else "event: ping"
    first, rest = text.split(ping, 1)  # the first keep-alive came after the first text
    assert ("Sure." if api == "openai" else "The answer is") in first
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: {")]
    if api == "openai":
        calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_time", "{}")]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        said = "".join(e["delta"]["text"] for e in events
                       if e["type"] == "content_block_delta")
        assert said == "The answer is "
        (delta,) = [e for e in events if e["type"] == "message_delta"]
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert "error" not in text
