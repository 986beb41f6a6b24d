"""A rank's control thread: its own view of its state, for `deepinfer-inspect`.

The main thread marks each step (`applied` once the plan's cache ops and table deltas
are in, `finished` after the forward pass); everything else is read from the runner
when asked, from the control thread: block tables are copied at one instant
(`BlockTables.snapshot`, under the lock their changes take), so a rank inside a long
forward pass or blocked in a collective still answers, from the tables that pass is using.
"""

from __future__ import annotations

import os
import time

import numpy as np

from wire.control import (
    ControlError,
    RankSnapshot,
    SeqRequest,
    SeqTable,
    SeqView,
    SnapshotRequest,
    StacksRequest,
    TierContents,
    TierRequest,
)
from wire.control_server import ControlServer, stack_dump
from wire.digest import table_digest
from wire.step import StepPlan
from worker.model_runner import ModelRunner


class RankControl:
    def __init__(self, runner: ModelRunner, rank: int, world_size: int, address: str,
                 log=None) -> None:
        self.runner = runner
        self.rank = rank
        self.world_size = world_size
        self.step = -1
        self.state = "idle"
        self.last_error: str | None = None
        self._step_started = 0.0
        self._step_finished = time.monotonic()
        self._digest = runner.digest.value
        # seq id -> tokens whose KV this rank has written (positions of the last chunk run)
        self._num_tokens: dict[int, int] = {}
        self.server = ControlServer(address, self.handle, log).start()

    # --- marks from the main thread ---------------------------------------------------

    def applied(self, plan: StepPlan) -> None:
        """The plan's cache ops and table deltas are applied; its forward pass is next."""
        for seq_id in plan.close:
            self._num_tokens.pop(seq_id, None)
        d = plan.decodes
        self._num_tokens.update(zip(d.seq_ids, (p + 1 for p in d.start_pos)))
        for chunk in plan.chunks:
            self._num_tokens[chunk.seq_id] = chunk.start_pos + len(chunk.token_ids)
        self._step_started = time.monotonic()
        self.step = plan.step
        self.state = "forward"

    def finished(self, digest: int) -> None:
        self._digest = digest
        self._step_finished = time.monotonic()
        self.state = "idle"

    def failed(self, error: str) -> None:
        self.last_error = error
        self.state = "failed"

    def close(self) -> None:
        self.server.close()

    # --- answers, on the control thread -------------------------------------------------

    def handle(self, request: object) -> object:
        if isinstance(request, SnapshotRequest):
            return self.snapshot(request.detail)
        if isinstance(request, SeqRequest):
            return self.seq_view(request.seq_id)
        if isinstance(request, TierRequest):
            return self.tier_contents(request)
        if isinstance(request, StacksRequest):
            return stack_dump("rank", self.rank, request.all_threads)
        return ControlError(f"a rank does not answer {type(request).__name__}")

    def tier_contents(self, request: TierRequest) -> TierContents:
        n = self.state_slots().get(request.tier, 0)
        return TierContents(request.tier, request.start, self.runner.digest.table_slice(
            request.tier, request.start, request.stop, n))

    def state_slots(self) -> dict[str, int]:
        """A hybrid model's state tables -> the slots this rank holds of each."""
        r = self.runner
        slots = {"state": r.num_state_slots, "host_state": r.num_host_state_slots,
                 "disk_state": r.num_disk_state_slots}
        return {table: n for table, n in slots.items() if n}

    def snapshot(self, detail: bool = False) -> RankSnapshot:
        now = time.monotonic()
        tables = self.runner.block_tables.snapshot()
        seqs = [SeqTable(sid, len(t), table_digest(sid, t) if detail else 0)
                for sid, t in sorted(tables.items())]
        in_step = self.state == "forward"
        since = self.runner.tp.collective_since
        return RankSnapshot(
            rank=self.rank, pid=os.getpid(), device=str(self.runner.device),
            world_size=self.world_size, step=self.step, state=self.state,
            seconds_since_step=now - self._step_finished,
            seconds_in_step=now - self._step_started if in_step else 0.0,
            digest=self._digest, seqs=seqs, usage=self._usage(tables),
            tier_digests=self.runner.digest.tier_digests() if detail else {},
            last_error=self.last_error,
            seconds_in_collective=now - since if since else 0.0,
            state_slots=self.state_slots(),
            state_entries=(self.runner.digest.state_entries()
                           if detail and self.runner.num_state_slots else {}),
        )

    def _usage(self, tables: dict[int, list[int]]) -> dict[str, dict[str, int]]:
        """Blocks per tier as this rank holds them: used = in a live table; cached = not
        used but holding a registered hash; free = the rest."""
        digest = self.runner.digest
        device = digest.tier_hashes("device") != 0
        used = np.zeros(len(device), dtype=bool)
        if tables:
            used[np.concatenate([np.asarray(t, dtype=np.int64) for t in tables.values()])] = True
        host = digest.tier_hashes("host") != 0
        num_used, num_cached = int(used.sum()), int((device & ~used).sum())
        return {
            "device": {"capacity": len(device), "used": num_used, "cached": num_cached,
                       "free": len(device) - num_used - num_cached},
            "host": {"capacity": len(host), "used": 0, "cached": int(host.sum()),
                     "free": len(host) - int(host.sum())},
        }

    def seq_view(self, seq_id: int) -> SeqView:
        table = self.runner.block_tables.copy_of(seq_id)
        if table is None:
            return SeqView("rank", self.rank, seq_id, found=False)
        return SeqView("rank", self.rank, seq_id, found=True, block_ids=table,
                       num_tokens=self._num_tokens.get(seq_id, 0))
