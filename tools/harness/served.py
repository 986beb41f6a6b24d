"""`deepinfer-run serve` in a subprocess on a free port, for benchmarks and end-to-end tests.

    engine = Served(model_dir, run_dir, nproc=4, extra_args=["--no-prefix-caching"])
    ... httpx.post(f"{engine.url}/v1/messages", ...) ...
    engine.stop()   # SIGINT: the launcher stops every child and removes run_dir
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from orchestrator.config import REPO, repo_env
from orchestrator.launcher import free_port


class Served:
    """`deepinfer-run serve` in a subprocess, its log in a file next to the run dir."""

    def __init__(self, model: Path, run_dir: Path, nproc: int = 4,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 dtype: str = "float32", startup_timeout_s: float = 180,
                 launcher_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir.parent / f"launcher-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        full_env = repo_env(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", str(nproc),
             "--run-dir", str(run_dir), *(launcher_args or []),
             "serve", "--model", str(model), "--port", str(self.port),
             "--dtype", dtype, *(extra_args or [])],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, timeout_s=startup_timeout_s, proc=self.proc)
        except Exception as exc:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"{exc}; the launcher's errors:\n{self.errors()}") from exc

    def pids(self) -> dict[str, int]:
        engine = json.loads((self.run_dir / "engine.json").read_text())
        return {p["name"]: p["pid"] for p in engine["processes"]}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def errors(self, last: int = 10) -> str:
        """The log's last error events (a failed self-check, a rank's exception)."""
        lines = [line for line in self.log_path.read_text().splitlines()
                 if '"level": "error"' in line or "Error" in line]
        return "\n".join(lines[-last:]) or "(none logged)"

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


def wait_healthy(base_url: str, timeout_s: float = 60.0,
                 proc: subprocess.Popen | None = None) -> None:
    """Poll GET /health until it answers 200 (the shim is up and has the scheduler).

    With `proc`, give up as soon as that process exits (a bad flag, say) instead of
    waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    last: str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the launcher exited with status {proc.returncode} before "
                               f"{base_url}/health answered")
        try:
            r = httpx.get(f"{base_url}/health", timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{base_url}/health not ready after {timeout_s:g}s ({last})")
