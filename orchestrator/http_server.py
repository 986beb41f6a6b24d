"""The HTTP shim: a Starlette app in front of the scheduler, served by uvicorn.

    python -m orchestrator.http_server --run-dir DIR --model MODEL_DIR \
        [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME] \
        [--max-model-len N] [--connect-timeout S]

It tokenizes (MODEL_DIR/tokenizer.json), validates, sends token ids to the scheduler
(ipc://DIR/requests.sock, or the "requests" address in DIR/addresses.json), and
detokenizes the streamed tokens. Anything it can tell is bad is refused here with an
OpenAI-shaped error, so it never reaches the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from orchestrator import openai_api as oai
from orchestrator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.metrics import Metrics
from scheduler.protocol import EngineInfo, EngineStats, GenerateRequest, RequestOutput

log = structlog.get_logger()
T = TypeVar("T")
# Prompts longer than this are tokenized in a thread so the event loop keeps streaming.
TOKENIZE_IN_THREAD_CHARS = 20_000


class Engine(Protocol):
    """What the app needs of `EngineClient` (tests pass a stand-in)."""

    @property
    def connected(self) -> bool: ...
    @property
    def info(self) -> EngineInfo: ...
    async def start(self) -> EngineInfo: ...
    async def close(self) -> None: ...
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...
    async def stats(self) -> EngineStats: ...
    async def abort(self, request_id: str, reason: str = "abort") -> None: ...


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None
    metrics: Metrics = field(default_factory=Metrics)
    max_model_len: int = 0  # the limit requests are checked against; set at start-up
    vocab_size: int = 0
    created: int = 0


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


def error_response(err: oai.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# --- endpoints ---------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    if state.engine.connected:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    _check_auth(request, state)
    try:
        stats = await state.engine.stats()
    except Exception as exc:  # still serve the shim's own series
        log.warning("engine_stats_unavailable", error=str(exc))
        stats = None
    return Response(state.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    _check_auth(request, state)
    card = {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "deepinfer", "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    _check_auth(request, state)
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise oai.ApiError("the request body must be a JSON object")
    prompt = oai.prompt_input(body)
    if isinstance(prompt, str):
        prompt_ids = await _tokenize(state.tokenizer, prompt)
    else:
        prompt_ids = prompt
    params = oai.parse_completion(
        body, prompt_ids, vocab_size=state.vocab_size, max_model_len=state.max_model_len
    )
    if not state.engine.connected:
        raise oai.ApiError("the engine is not available", status=503, type="service_unavailable")

    run = oai.CompletionRun(
        state.engine, state.tokenizer, f"cmpl-{uuid.uuid4().hex}", params, state.model_name
    )
    if not params.stream:
        try:
            result = await _unless_disconnected(request, run.collect())
        except ClientGone:
            run.log_done(finish_reason="abort")
            return Response(status_code=499)
        except oai.ApiError as err:
            run.log_done(finish_reason="error", error=err.message)
            raise
        run.log_done()
        return JSONResponse(result)

    # Wait for the first output before answering 200: an overloaded engine must still
    # get a 429 with retry-after, which is impossible once the stream has started.
    chunks = run.sse_chunks()
    try:
        first = await _unless_disconnected(request, chunks.__anext__())
    except ClientGone:
        await chunks.aclose()
        run.log_done(finish_reason="abort")
        return Response(status_code=499)
    except oai.ApiError as err:
        await chunks.aclose()
        run.log_done(finish_reason="error", error=err.message)
        raise
    return ClosingStreamingResponse(_prepend(first, chunks), media_type="text/event-stream",
                                    headers={"cache-control": "no-cache"})


# --- helpers -----------------------------------------------------------------------


def _check_auth(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else request.headers.get(
        "x-api-key", ""  # the Anthropic SDKs send the key here
    )
    if not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise oai.ApiError("invalid or missing API key", status=401,
                           type="authentication_error", code="invalid_api_key")


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise oai.ApiError(f"the request body is not valid JSON: {exc}") from None


async def _tokenize(tokenizer: Tokenizer, text: str) -> list[int]:
    if len(text) > TOKENIZE_IN_THREAD_CHARS:
        return (await asyncio.to_thread(tokenizer.encode, text)).ids
    return tokenizer.encode(text).ids


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its request) if the client leaves first.

    Starlette only watches for disconnects while a streaming body is being sent; a
    request queued for minutes before its first token must be abortable too.
    """

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its abort go out
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _prepend(first: str, rest: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()  # closed from outside, this generator must close `rest` too


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the stream ends.

    Depending on the ASGI version, a client disconnect either cancels the stream or
    makes `send` raise; in the second case the body generator would be left suspended
    until garbage collection, and the engine would keep generating for nobody.
    """

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        except OSError:
            pass  # ASGI >= 2.4: the client left; an expected end, not a server error
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# --- the app -------------------------------------------------------------------------


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    api_key: str | None = None,
    max_model_len: int = 0,
) -> Starlette:
    """The ASGI app. `engine` is started by the app's lifespan; `max_model_len` > 0
    lowers the engine's context limit for requests (it cannot raise it)."""
    state = ServerState(engine, tokenizer, model_name, api_key)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            info = await engine.start()
        except Exception as exc:
            log.error("engine_unavailable", error=str(exc))
            raise
        state.vocab_size = info.vocab_size
        state.created = int(time.time())
        state.max_model_len = info.max_model_len
        if max_model_len > 0:
            if max_model_len > info.max_model_len:
                log.warning("max_model_len_above_engine", requested=max_model_len,
                            engine=info.max_model_len)
            state.max_model_len = min(max_model_len, info.max_model_len)
        log.info("shim_ready", model=model_name, max_model_len=state.max_model_len)
        try:
            yield
        finally:
            await engine.close()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(oai.ApiError(msg, status=exc.status_code, type=kind))

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, oai.ApiError)
        return error_response(exc)

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client left while we read its body
            return Response(status_code=499)
        log.exception("internal_error", path=request.url.path)
        return error_response(oai.ApiError(f"internal error: {type(exc).__name__}",
                                           status=500, type="internal_error"))

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={
            HTTPException: on_http_error,
            oai.ApiError: on_api_error,
            Exception: on_internal_error,
        },
        lifespan=lifespan,
    )
    app.state.shim = state
    return app


def configure_logging(role: str, level: int = logging.INFO) -> None:
    """One JSON object per line on stderr, uvicorn's records included, each with `role`."""

    def add_role(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("role", role)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_role,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.http_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the engine's run directory")
    p.add_argument("--model", required=True, help="model directory (holds tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=0, help="0: the engine's")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait for the scheduler's EngineInfo")
    return p.parse_args(argv)


def requests_address(run_dir: Path) -> str:
    """The scheduler's client socket: the launcher's addresses.json names it (tcp:// when
    several nodes are asked for); without one, ipc://RUN_DIR/requests.sock."""
    addresses = run_dir / "addresses.json"
    if addresses.is_file():
        return json.loads(addresses.read_text())["requests"]
    return f"ipc://{run_dir.resolve()}/requests.sock"


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from orchestrator.engine_client import EngineClient

    args = parse_args(argv)
    configure_logging("shim")
    model_dir = Path(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine = EngineClient(requests_address(Path(args.run_dir)),
                          connect_timeout_s=args.connect_timeout)
    app = build_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or model_dir.resolve().name,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
    )
    # log_config=None: uvicorn's records go through the JSON logging set up above.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    # uvicorn exits quietly with started=False when the lifespan (engine start) failed.
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
