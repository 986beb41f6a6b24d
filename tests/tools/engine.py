"""A 4-rank engine started as the README says (`deepinfer-run serve`), and the inspect CLI
run against it in this process (with an 80-column console)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tests.orchestrator.e2e_helpers import Served
from tools import inspector as inspect_cli


class Engine(Served):
    """A served engine plus the inspect CLI pointed at its run directory."""

    def __init__(self, model: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None,
                 nproc: int = 4, launcher_args: list[str] | None = None) -> None:
        super().__init__(model, run_dir, nproc, list(args), env, launcher_args=launcher_args)

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

    def events(self, name: str) -> list[dict]:
        lines = [line for line in self.log().splitlines() if line.startswith("{")]
        return [e for e in map(json.loads, lines) if e.get("event") == name]
