"""The HTTP shim: a Starlette app in front of the scheduler, served by uvicorn.

    python -m orchestrator.shim.server --run-dir DIR --model MODEL_DIR \
        [--host 127.0.0.1] [--port 8000] [--api-key-file FILE] [--served-model-name NAME] \
        [--max-model-len N] [--max-output-tokens N] [--tool-call-parser hermes] \
        [--max-request-bytes N] [--max-tools N] [--max-messages N] [--max-header-bytes N] \
        [--connect-timeout S] [--resume-timeout S]

The API key: --api-key-file, --api-key, or $DEEPINFER_API_KEY (how `deepinfer-run`
passes it: a command line is visible to every local user in `ps`). Every endpoint but
/health requires it. --cache-salt-per-api-key KEYS_FILE adds tenants' keys, each request
salted with its key's tenant (`tenants`).

Endpoints: POST /v1/messages and /v1/messages/count_tokens (Anthropic,
`anthropic_request` and `anthropic_response`), POST /v1/chat/completions and
POST /v1/completions (OpenAI, `openai_request` and `openai_response`), POST /v1/responses
(OpenAI's Responses API, for Codex CLI: `responses_request` and `responses_response`), each
through one
pipeline (`pipeline.serve`); their prompts' token ids at .../render (`render`, for a
router); GET /v1/models, /health, /metrics here.

It renders chat templates (`chat_template`), tokenizes (MODEL_DIR/tokenizer.json),
validates, sends token ids to the scheduler (ipc://DIR/requests.sock, or the "requests"
address in DIR/addresses.json), and detokenizes the streamed tokens. Anything it can
tell is bad is refused here, in the shape of the API the path belongs to, so it never
reaches the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from orchestrator.shim import anthropic_response, openai_response, render, responses_response
from orchestrator.shim.admission import (
    HeaderLimit,
    admit,
    check_auth,
    error_response,
    is_anthropic_path,
)
from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.errors import ApiError
from orchestrator.shim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.shim.options import API_KEY_ENV, ShimOptions, add_shim_arguments, api_key_from
from orchestrator.shim.resume import ResumePolicy
from orchestrator.shim.state import Engine, ServerState
from orchestrator.shim.tenants import Tenants
from wire.log import configure_logging

log = structlog.get_logger()


# --- endpoints ---------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    if state.unavailable is not None:
        return JSONResponse({"status": "unavailable", "reason": state.unavailable},
                            status_code=503, headers={"retry-after": str(state.retry_after_s)})
    if state.engine.connected:
        return JSONResponse({"status": "ok"})
    # the engine failed or is restarting: the client reconnects when it is back
    return JSONResponse({"status": "unavailable", "reason": "the engine is not connected"},
                        status_code=503, headers={"retry-after": str(state.retry_after_s)})


async def root(request: Request) -> Response:
    """Clients probe the base URL (Claude Code sends `HEAD /`)."""
    check_auth(request, request.app.state.shim)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    check_auth(request, state)  # scraped during the self-check and restarts too
    try:
        stats = await state.engine.stats()
    except Exception as exc:  # still serve the shim's own series
        log.warning("engine_stats_unavailable", error=str(exc))
        stats = None
    return Response(state.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    """One card both SDKs parse: OpenAI's fields and Anthropic's."""
    created_at = datetime.fromtimestamp(state.created, timezone.utc).isoformat()
    return {"id": name, "object": "model", "created": state.created,
            "owned_by": "deepinfer", "max_model_len": state.max_model_len,
            "block_size": state.block_size,
            "type": "model", "display_name": name,
            "created_at": created_at.replace("+00:00", "Z")}


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    admit(request, state)
    cards = [_model_card(state, name) for name in state.model_names]
    return JSONResponse({"object": "list", "data": cards, "has_more": False,
                         "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.shim
    admit(request, state)
    model_id = request.path_params["model_id"]
    if model_id not in state.model_names:
        raise ApiError(f"model {model_id!r} not found (this engine serves "
                       f"{', '.join(map(repr, state.model_names))})", status=404,
                       type="not_found_error")
    return JSONResponse(_model_card(state, model_id))


# --- the app -------------------------------------------------------------------------


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    max_model_len: int = 0,
    chat_template: ChatTemplate | None = None,
    options: ShimOptions | None = None,
    ping_interval_s: float = 5.0,
    tenants: Tenants | None = None,
) -> Starlette:
    """The ASGI app. `engine` is started by the app's lifespan; `max_model_len` > 0
    lowers the engine's context limit for requests (it cannot raise it). Without a
    `chat_template` the chat endpoints answer 400. `tenants`: the keys of
    --cache-salt-per-api-key (read from options.cache_salt_per_api_key when not given).
    ``model_name``: one name or several (the first is the one replies carry)."""
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    assert names, "at least one served model name"
    options = options or ShimOptions()
    if tenants is None and options.cache_salt_per_api_key:
        tenants = Tenants.from_file(options.cache_salt_per_api_key)
    state = ServerState(engine, tokenizer, names[0], api_key, tenants=tenants,
                        chat_template=chat_template, options=options,
                        ping_interval_s=ping_interval_s, model_aliases=names[1:])
    if hasattr(engine, "attach_metrics"):  # TTFT/ITL are observed where outputs arrive
        engine.attach_metrics(state.metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            info = await engine.start()
        except Exception as exc:
            log.error("engine_unavailable", error=str(exc))
            raise
        limits = info.limits
        state.vocab_size = limits.vocab_size
        state.block_size = info.block_size
        state.metrics.engine.model_name = names[0]
        state.metrics.engine.block_size = info.block_size
        state.created = int(time.time())
        state.max_model_len = limits.max_model_len
        if max_model_len > 0:
            if max_model_len > limits.max_model_len:
                log.warning("max_model_len_above_engine", requested=max_model_len,
                            engine=limits.max_model_len)
            state.max_model_len = min(max_model_len, limits.max_model_len)
        log.info("shim_ready", model=list(names), max_model_len=state.max_model_len,
                 tenants=state.tenants.names if state.tenants is not None else None)
        try:
            yield
        finally:
            await engine.close()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(msg, status=exc.status_code, type=kind),
                              anthropic=is_anthropic_path(request.url.path))

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc, anthropic=is_anthropic_path(request.url.path))

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client left while we read its body
            return Response(status_code=499)
        log.exception("internal_error", path=request.url.path)
        return error_response(ApiError(f"internal error: {type(exc).__name__}",
                                           status=500, type="internal_error"),
                              anthropic=is_anthropic_path(request.url.path))

    app = Starlette(
        routes=[
            Route("/", root, methods=["GET", "HEAD"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
            Route("/v1/completions", openai_response.completions, methods=["POST"]),
            Route("/v1/chat/completions", openai_response.chat_completions,
                  methods=["POST"]),
            Route("/v1/responses", responses_response.responses, methods=["POST"]),
            Route("/v1/messages", anthropic_response.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic_response.count_tokens,
                  methods=["POST"]),
            Route("/v1/chat/completions/render", render.chat_completions, methods=["POST"]),
            Route("/v1/completions/render", render.completions, methods=["POST"]),
            Route("/v1/messages/render", render.messages, methods=["POST"]),
            Route("/v1/responses/render", render.responses, methods=["POST"]),
        ],
        middleware=[Middleware(HeaderLimit, limit=options.max_header_bytes)],
        exception_handlers={
            HTTPException: on_http_error,
            ApiError: on_api_error,
            Exception: on_internal_error,
        },
        lifespan=lifespan,
    )
    app.state.shim = state
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.shim.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the engine's run directory")
    p.add_argument("--model", required=True, help="model directory (holds tokenizer.json)")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the engine's")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait for the scheduler's EngineInfo")
    p.add_argument("--resume-timeout", type=float, default=0.0,
                   help="when the engine dies, how long a request in flight waits for a "
                        "restarted one to continue on (deepinfer-run passes its own with "
                        "--restart); 0: it fails at once")
    add_shim_arguments(p)
    return p.parse_args(argv)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file, --api-key, else $DEEPINFER_API_KEY (the launcher's way), which is
    taken out of the environment so that nothing this process starts inherits it."""
    env_key = os.environ.pop(API_KEY_ENV, None)
    return api_key_from(args) or env_key or None


def requests_address(run_dir: Path) -> str:
    """The scheduler's client socket: the launcher's addresses.json names it (tcp:// when
    several nodes are asked for); without one, ipc://RUN_DIR/requests.sock."""
    addresses = run_dir / "addresses.json"
    if addresses.is_file():
        return json.loads(addresses.read_text())["requests"]
    return f"ipc://{run_dir.resolve()}/requests.sock"


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from orchestrator.shim.engine_client import EngineClient

    class ShimServer(uvicorn.Server):
        """uvicorn's server, but a stop signal first ends the requests that wait for a
        restarted engine: none will come (the launcher stops the shim once its restarts
        are spent), and their error events must go out before the graceful shutdown
        waits on their streams."""

        def __init__(self, config: uvicorn.Config, engine: EngineClient) -> None:
            super().__init__(config)
            self.engine = engine

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.engine.stop_resuming("the HTTP server is stopping")
            super().handle_exit(sig, frame)

    args = parse_args(argv)
    configure_logging("shim")
    api_key = resolve_api_key(args)
    model_dir = Path(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine = EngineClient(requests_address(Path(args.run_dir)),
                          connect_timeout_s=args.connect_timeout,
                          resume=ResumePolicy(args.resume_timeout))
    app = build_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or [model_dir.resolve().name],
        api_key=api_key,
        max_model_len=args.max_model_len,
        chat_template=ChatTemplate.from_model_dir(model_dir),
        options=ShimOptions.from_args(args),
    )
    # log_config=None: uvicorn's records go through the JSON logging set up above.
    # The header limit, at the transport too: h11 stops buffering a head past it
    # (http="h11": httptools, if installed, would ignore the setting).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                            http="h11", h11_max_incomplete_event_size=args.max_header_bytes)
    server = ShimServer(config, engine)
    check = None
    if args.self_check:  # imported only then: the gate's HTTP client is not needed else
        from orchestrator.shim.self_check import SelfCheck

        check = SelfCheck(server, app.state.shim, args.host, args.port, api_key,
                          args.self_check_tokens)
        check.start()
    server.run()
    if check is not None and check.failed:
        return check.EXIT_STATUS
    # uvicorn exits quietly with started=False when the lifespan (engine start) failed.
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
