"""Helpers for end-to-end tests against a running shim (`python -m orchestrator.http_server`).

    wait_healthy(base_url)
    out = complete(base_url, prompt="Hello", max_tokens=8, temperature=0)
    out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]
    text, token_ids, usage = stream_complete(base_url, prompt=[1, 2, 3], max_tokens=8)
    engine = Served(model_dir, run_dir)   # deepinfer-run serve, 4 ranks; engine.url
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import REPO, free_port, subprocess_env

DEFAULT_TIMEOUT_S = 120.0


class Served:
    """`deepinfer-run serve` in a subprocess, its log in a file next to the run dir."""

    def __init__(self, model: Path, run_dir: Path, nproc: int = 4,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 launcher_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir.parent / f"launcher-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", str(nproc),
             "--run-dir", str(run_dir), *(launcher_args or []),
             "serve", "--model", str(model), "--port", str(self.port),
             "--dtype", "float32", *(extra_args or [])],
            cwd=REPO, env=subprocess_env(**(env or {})), stdout=self._log,
            stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, timeout_s=180)
        except Exception:
            self.stop(signal.SIGKILL)
            raise

    def pids(self) -> dict[str, int]:
        engine = json.loads((self.run_dir / "engine.json").read_text())
        return {p["name"]: p["pid"] for p in engine["processes"]}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


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


def wait_healthy(base_url: str, timeout_s: float = 60.0) -> None:
    """Poll GET /health until it answers 200 (the shim is up and has the scheduler)."""
    deadline = time.monotonic() + timeout_s
    last: str = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/health", timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{base_url}/health not ready after {timeout_s:g}s ({last})")


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
