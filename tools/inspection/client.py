"""Finding a running engine and asking its processes, for `deepinfer-inspect`.

The launcher writes RUN_DIR/engine.json, which lists every control socket; without
one (ranks started by hand), the addresses follow the convention in
`wire/control_server.py`. Every process is asked in parallel, so one
that does not answer costs one timeout, not one per process.
"""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire import codec
from wire.config import CONFIG_FILE, EngineConfig
from wire.control_server import ControlUnavailable, ask, control_address

RUN_DIR_ENV = "DEEPINFER_RUN_DIR"


class EngineNotFound(RuntimeError):
    pass


@dataclass
class EngineAddresses:
    run_dir: Path
    scheduler: str
    ranks: dict[int, str]  # rank -> control address
    http: str | None = None

    def named(self) -> dict[str, str]:
        """Process name -> control address: "scheduler", "rank 0", "rank 1", ..."""
        return {"scheduler": self.scheduler, **{f"rank {r}": a for r, a in self.ranks.items()}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_run_dir(requested: str | None = None) -> Path:
    """--run-dir, else $DEEPINFER_RUN_DIR, else the one live engine under the temp dir."""
    if requested or os.environ.get(RUN_DIR_ENV):
        path = Path(requested or os.environ[RUN_DIR_ENV])
        if not path.is_dir():
            raise EngineNotFound(f"{path} is not a directory")
        return path
    live = []
    for engine_file in Path(tempfile.gettempdir()).glob("deepinfer-*/engine.json"):
        try:
            pid = json.loads(engine_file.read_text())["launcher_pid"]
        except (OSError, ValueError, KeyError):
            continue
        if _alive(pid):
            live.append(engine_file.parent)
    if not live:
        raise EngineNotFound("no running engine found under "
                             f"{tempfile.gettempdir()}; pass --run-dir RUN_DIR")
    if len(live) > 1:
        raise EngineNotFound("several engines are running; pass --run-dir, one of: "
                             + ", ".join(str(p) for p in sorted(live)))
    return live[0]


def load_engine(run_dir: Path) -> EngineAddresses:
    engine_file = run_dir / "engine.json"
    engine = json.loads(engine_file.read_text()) if engine_file.is_file() else {}
    control = engine.get("control")
    if control:
        ranks = {int(r): a for r, a in control["ranks"].items()}
        return EngineAddresses(run_dir, control["scheduler"], dict(sorted(ranks.items())),
                               engine.get("http"))
    world_size = engine.get("world_size")
    if world_size is None:
        config = run_dir / CONFIG_FILE
        if not config.is_file():
            raise EngineNotFound(f"{run_dir} holds neither engine.json nor {CONFIG_FILE}")
        world_size = codec.read_file(config, EngineConfig).world_size
    return EngineAddresses(
        run_dir, control_address(run_dir, "scheduler"),
        {r: control_address(run_dir, f"rank{r}") for r in range(world_size)}, engine.get("http"))


def ask_all(addresses: dict[str, str], request: Any,
            timeout_s: float = 5.0) -> dict[str, Any]:
    """name -> reply, or name -> ControlUnavailable for a process that did not answer."""

    def one(address: str) -> Any:
        try:
            return ask(address, request, timeout_s)
        except ControlUnavailable as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
        replies = list(pool.map(one, addresses.values()))
    return dict(zip(addresses, replies))
