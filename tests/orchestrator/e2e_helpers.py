"""Helpers for end-to-end tests against a running shim (`python -m orchestrator.shim.server`).

    wait_healthy(base_url)
    out = complete(base_url, prompt="Hello", max_tokens=8, temperature=0)
    out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]
    text, token_ids, usage = stream_complete(base_url, prompt=[1, 2, 3], max_tokens=8)
    engine = Served(model_dir, run_dir)   # deepinfer-run serve, 4 ranks; engine.url

Served and wait_healthy live in tools/harness/served.py (the HTTP agent benchmark uses
them too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

from tools.harness.served import Served, wait_healthy  # noqa: F401  (re-exported for the tests)

DEFAULT_TIMEOUT_S = 120.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its (gone) parent counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


class CompletionError(AssertionError):
    """The shim answered with an error status or sent an error event mid-stream."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def complete(base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, **body: Any) -> dict:
    """POST /v1/completions (non-streaming); returns the JSON response.

    Raises CompletionError on any status but 200 (its `.status` and `.body` hold the
    OpenAI-shaped error).
    """
    body.setdefault("model", "default")
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise CompletionError(r.status_code, _json_or_text(r))
    return r.json()


def stream_complete(
    base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, **body: Any
) -> tuple[str, list[int], dict | None]:
    """POST /v1/completions with stream=true; returns (text, token ids, usage).

    Usage is requested (stream_options.include_usage) unless the caller says otherwise;
    it is None when not sent. Checks the stream ends with `data: [DONE]`.
    """
    body.setdefault("model", "default")
    body["stream"] = True
    body.setdefault("stream_options", {"include_usage": True})
    text: list[str] = []
    token_ids: list[int] = []
    usage: dict | None = None
    done = False
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise CompletionError(r.status_code, _json_or_text(r))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue  # blank separators (and comments, if any)
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise CompletionError(200, event)
            for choice in event.get("choices", []):
                text.append(choice.get("text", ""))
                token_ids.extend(choice.get("token_ids", []))
            if event.get("usage"):
                usage = event["usage"]
    if not done:
        raise CompletionError(200, "the stream ended without data: [DONE]")
    return "".join(text), token_ids, usage


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text
