"""`serve --self-check`: the shim runs the prefix-cache gate against itself at start-up.

Until the gate passes, every endpoint but /health and /metrics answers 503 with
`retry-after` (and /health says why), except the gate's own requests, which carry a
secret header. If the gate fails, the shim stops with exit status 3 and the launcher
stops the engine: a deployment whose cache is silently broken refuses to start rather
than serving every agent turn at full prefill cost.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import structlog

from orchestrator.cache_gate import GateConfig, run_gate
from orchestrator.shim.admission import SELF_CHECK_HEADER
from orchestrator.shim.state import ServerState

# Short answers keep the start-up fast; one block of slack is the gate's own rule.
SELF_CHECK_MAX_TOKENS = 8
# A hung engine fails the gate (and the start-up) in minutes, not after 4 x 10 minutes.
SELF_CHECK_REQUEST_TIMEOUT_S = 120.0

log = structlog.get_logger()


class SelfCheck:
    EXIT_STATUS = 3  # the shim's, when the gate fails

    def __init__(self, server: Any, state: ServerState, host: str, port: int,
                 api_key: str | None, doc_tokens: int) -> None:
        self.server = server  # uvicorn.Server: started / should_exit
        self.state = state
        self.failed = False
        secret = secrets.token_urlsafe(24)
        state.self_check_secret = secret
        state.unavailable = "the start-up self-check is running"
        # A wildcard bind is reached over loopback.
        target = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        target = f"[{target}]" if ":" in target else target
        self.config = GateConfig(url=f"http://{target}:{port}", api_key=api_key,
                                 doc_tokens=doc_tokens, max_tokens=SELF_CHECK_MAX_TOKENS,
                                 headers={SELF_CHECK_HEADER: secret},
                                 timeout_s=SELF_CHECK_REQUEST_TIMEOUT_S)

    def start(self) -> None:
        threading.Thread(target=self._run, name="self-check", daemon=True).start()

    def _run(self) -> None:
        while not self.server.started:  # the engine connects in the app's lifespan
            if self.server.should_exit:
                return
            time.sleep(0.1)
        log.info("self_check_started", url=self.config.url, doc_tokens=self.config.doc_tokens)
        reasons, figures = ["the gate stopped before its verdict"], {}
        try:
            report = run_gate(self.config)
            reasons = report.reasons
            figures = {name: {"prompt": a.prompt_tokens, "cached": a.cached_tokens,
                              "ttft_ms": round(1000 * a.ttft_s)}
                       for name, a in report.answers.items()}
        except Exception as exc:  # whatever broke, the shim must not stay at 503 forever
            reasons = [f"the gate could not run: {exc!r}"]
        finally:
            self._verdict(reasons, figures)

    def _verdict(self, reasons: list[str], figures: dict) -> None:
        self.state.self_check_secret = None
        if not reasons:
            self.state.unavailable = None
            log.info("self_check_passed", requests=figures)
            return
        self.failed = True
        log.error("self_check_failed", reasons=reasons, requests=figures,
                  action="refusing to serve: stopping")
        self.server.should_exit = True
