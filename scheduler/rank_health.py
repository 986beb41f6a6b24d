"""Is a rank dead, or hung: the checks the executor runs while it waits for a step.

A rank that dies is seen by its pid (ranks on this host only; the others are seen by
the step timeout). A rank that is alive but silent past the step timeout is hung; its
peers, blocked in a collective waiting for it, are silent too, so the ranks' control
sockets are asked which of them are waiting in a collective: the ones that are not
are named as hung.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from wire.control import RankSnapshot, SnapshotRequest
from wire.control_server import ControlUnavailable, ask, control_address
from wire.lifecycle import host_identity

PROBE_TIMEOUT_S = 1.0


_HERE = host_identity()


@dataclass(frozen=True)
class RankProcess:
    """Where a rank runs, from its WorkerConnect."""

    rank: int
    pid: int
    host_id: str  # host_identity() of the rank's process

    @property
    def local(self) -> bool:
        """On this host, in this PID namespace: its pid means something here."""
        return self.host_id == _HERE


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie (exited, not yet reaped by its parent) is dead:
    the launcher reaps its children only every few hundred milliseconds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        # gone between the two calls (dead), or a system without /proc (trust the kill)
        return not Path("/proc").is_dir()
    # the state follows the command name, which may hold spaces and parentheses
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X", "x")


def dead_ranks(ranks: list[RankProcess]) -> list[RankProcess]:
    return [r for r in ranks if r.local and not pid_alive(r.pid)]


def describe_dead(dead: list[RankProcess]) -> str:
    """"rank 2 (pid 1234)", or "ranks 1 (pid 11), 2 (pid 12)"."""
    parts = [f"{r.rank} (pid {r.pid})" for r in dead]
    return ("rank " if len(parts) == 1 else "ranks ") + ", ".join(parts)


def describe_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def waiting_in_collective(ranks: list[RankProcess], control_dir: Path | None) -> list[int]:
    """Of `ranks`, those whose control socket says they are blocked in a collective
    (waiting for a peer). A rank that does not answer is not waiting: its main thread
    holds the interpreter, which is what a hung rank looks like too."""
    probed = [r for r in ranks if r.local] if control_dir is not None else []
    if not probed:
        return []

    def one(r: RankProcess) -> RankSnapshot | None:
        try:
            return ask(control_address(control_dir, f"rank{r.rank}"), SnapshotRequest(),
                       PROBE_TIMEOUT_S)
        except ControlUnavailable:
            return None

    with ThreadPoolExecutor(max_workers=len(probed)) as pool:
        snaps = list(pool.map(one, probed))
    return [r.rank for r, s in zip(probed, snaps)
            if isinstance(s, RankSnapshot) and s.seconds_in_collective > 0]


def hung_ranks(missing: list[RankProcess], control_dir: Path | None) -> tuple[list[int], list[int]]:
    """(hung, waiting) among the ranks that did not answer a step. When no rank can be
    told apart (none waiting, or all of them), every silent rank is named as hung."""
    waiting = waiting_in_collective(missing, control_dir)
    hung = [r.rank for r in missing if r.rank not in waiting]
    if not hung:
        return [r.rank for r in missing], []
    return hung, waiting
