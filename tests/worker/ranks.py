"""Start N torchrun-style rank processes of the reference harness and collect rank 0's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import REPO, free_port, subprocess_env


def run_ranks(world_size: int, out: Path, timeout: float = 300, **args) -> dict:
    args["out"] = str(out)
    _launch(world_size, args, timeout)
    return _result(world_size, out)


def run_ranks_many(world_size: int, runs: list[dict], timeout: float = 300) -> list[dict]:
    """Several runs (each run_ranks' keyword arguments, with its own `out`) in one launch
    of the ranks; their results in order."""
    _launch(world_size, {"runs": [{**r, "out": str(r["out"])} for r in runs]}, timeout)
    return [_result(world_size, Path(r["out"])) for r in runs]


def _launch(world_size: int, args: dict, timeout: float) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.worker.tp_harness", json.dumps(args)],
            cwd=REPO,
            env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port)),
            stderr=subprocess.PIPE, text=True,
        )
        for r in range(world_size)
    ]
    errors = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        if p.returncode:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)


def _result(world_size: int, out: Path) -> dict:
    result = load_file(str(out))
    result["digests"] = {Path(f"{out}.digest{r}").read_text() for r in range(world_size)}
    result["routing"] = {Path(f"{out}.routing{r}").read_text() for r in range(world_size)}
    return result
