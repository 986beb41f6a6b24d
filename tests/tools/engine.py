"""A 4-rank engine started as the README says (`deepinfer-run serve`), and the inspect CLI
run against it in this process (with an 80-column console)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import wait_healthy
from tools import inspect as inspect_cli


class Engine:
    def __init__(self, model: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None,
                 nproc: int = 4) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir.parent / f"launcher-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", str(nproc),
             "--run-dir", str(run_dir), "serve", "--model", str(model), "--port", str(self.port),
             "--dtype", "float32", *args],
            cwd=REPO, env=subprocess_env(**(env or {})), stdout=self._log,
            stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, timeout_s=180)
        except Exception:
            self.stop(signal.SIGKILL)
            raise

    def inspect(self, *args: str) -> tuple[int, str]:
        """Run `deepinfer-inspect --run-dir RUN ARGS...`; (exit status, output)."""
        out = io.StringIO()
        console = Console(file=out, width=80, color_system=None)
        status = inspect_cli.main(["--run-dir", str(self.run_dir), *args], console=console)
        return status, out.getvalue()

    def inspect_json(self, *args: str) -> tuple[int, Any]:
        status, text = self.inspect("--json", *args)
        return status, json.loads(text)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = 60) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"{what}: not within {timeout_s:g}s\n{self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def events(self, name: str) -> list[dict]:
        lines = [line for line in self.log().splitlines() if line.startswith("{")]
        return [e for e in map(json.loads, lines) if e.get("event") == name]

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
