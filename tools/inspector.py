"""`deepinfer-inspect`: every rank's own view of the engine, asked directly.

    deepinfer-inspect [--run-dir DIR] [--json] [--timeout S] COMMAND
      ranks            one row per rank and one for the scheduler
      check            ranks vs each other and the scheduler; exit 1 naming what differs
      seq ID           one sequence (seq id, or request id) as every process sees it
      cache [--last N] prefix-cache hit ratios, why the rest was computed, top sessions,
                       evictions, prefix breaks
      queue            waiting requests: age, size, and why they wait
      trace [--steps N]  the last step plans as the scheduler sent them
      stacks [--all-threads]  every process's main-thread Python stack (for a hang)

Each rank and the scheduler answer on their own control socket from a control thread,
so the answers come even while the engine is stuck. The engine is found through its
run directory: --run-dir, $DEEPINFER_RUN_DIR, or the one running under the temp dir.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, is_dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tools.inspection.check import run_check
from tools.inspection.client import (
    EngineAddresses,
    EngineNotFound,
    ask_all,
    find_run_dir,
    load_engine,
)
from wire.client import UncachedTokens
from wire.control import (
    CacheRequest,
    CacheView,
    SeqRequest,
    SnapshotRequest,
    StacksRequest,
    TraceRequest,
)
from wire.control_server import ControlUnavailable, ask
from wire.digest import STATE_TIERS


def _plain(x: Any) -> Any:
    if isinstance(x, Exception):
        return {"error": str(x)}
    return asdict(x) if is_dataclass(x) else x


def _blocks(usage: dict[str, dict[str, int]], tier: str) -> str:
    u = usage.get(tier, {})
    return f"{u.get('used', 0)}/{u.get('cached', 0)}/{u.get('free', 0)}"


def _table(title: str, *columns: str) -> Table:
    """Light borders, so the tables fit 80 columns; the first column never wraps."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, col in enumerate(columns):
        table.add_column(col, overflow="fold", no_wrap=i == 0)
    return table


# --- commands: each returns (json data, renderables, exit status) ------------------------


def cmd_ranks(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    replies = ask_all(engine.named(), SnapshotRequest(), args.timeout)
    table = _table("blocks: used/cached/free; s: since the last step ended, (in this step)",
                   "process", "step", "state", "seqs", "device", "host", "digest", "s")
    for name, r in replies.items():
        if isinstance(r, Exception):
            table.add_row(name, "-", "no answer", "-", "-", "-", "-", "-")
            continue
        digest = r.expected_digest if name == "scheduler" else r.digest
        since = f"{r.seconds_since_step:.1f}" + (f" ({r.seconds_in_step:.1f})"
                                                 if r.seconds_in_step else "")
        table.add_row(name, str(r.step), r.state, str(len(r.seqs)), _blocks(r.usage, "device"),
                      _blocks(r.usage, "host"), f"{digest:016x}"[:8], since)
    data = {"scheduler": _plain(replies["scheduler"]),
            "ranks": [_plain(r) for n, r in replies.items() if n != "scheduler"]}
    missing = [n for n, r in replies.items() if isinstance(r, Exception)]
    return data, [table], 1 if missing else 0


def cmd_check(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    result = run_check(engine, args.timeout)
    data = _plain(result)
    states = _state_tables(result.state_entries)
    if result.agree:
        note = (f"[green]agree[/]: {len(engine.ranks)} ranks and the scheduler at step "
                f"{result.step} (block tables, live sequences, tier contents, digests"
                f"{_state_count(result.state_entries)})")
        return data, [note, *states], 0
    table = _table(f"differences (step {result.step}, "
                   f"{'aligned' if result.aligned else 'not aligned'})",
                   "process", "kind", "what differs")
    for d in result.differences:
        table.add_row(d.process, d.kind, d.detail)
    return data, [table, *states], 1


def _state_count(entries: dict[str, dict[str, int]]) -> str:
    """The verdict's count of a hybrid model's state snapshots, as the scheduler planned
    them (the ranks' tables are compared with its own)."""
    mine = entries.get("scheduler") or next(iter(entries.values()), {})
    if not mine:
        return ""
    return ("; state snapshots: " + ", ".join(f"{mine.get(table, 0):,} {where}" for table, where
                                             in (("state", "on the device"),
                                                 ("host_state", "on the host"),
                                                 ("disk_state", "on disk"))))


def _state_tables(entries: dict[str, dict[str, int]]) -> list[Table]:
    """A hybrid model's state tables, process by process: the slots each was told to hold
    a snapshot in (wire/digest.py STATE_TIERS); none for any other model."""
    if not entries:
        return []
    table = _table("state slots holding a snapshot", "process", *STATE_TIERS)
    for name, counts in entries.items():
        table.add_row(name, *(f"{counts.get(t, 0):,}" for t in STATE_TIERS))
    return [table]


def cmd_seq(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    req = SeqRequest(int(args.id)) if args.id.isdigit() else SeqRequest(request_id=args.id)
    sched = ask(engine.scheduler, req, args.timeout)
    ranks = ask_all({f"rank {r}": a for r, a in engine.ranks.items()},
                    SeqRequest(sched.seq_id), args.timeout)
    table = _table(f"seq {sched.seq_id} (request {sched.request_id or '?'}, "
                   f"{sched.status or 'not live'})", "process", "blocks", "tokens",
                   "same as scheduler", "first blocks")
    for name, v in [("scheduler", sched), *ranks.items()]:
        if isinstance(v, Exception):
            table.add_row(name, "no answer", "-", "-", "-")
            continue
        same = "-" if name == "scheduler" else ("yes" if v.block_ids == sched.block_ids
                                                else _first_diff(v.block_ids, sched.block_ids))
        shown = " ".join(map(str, v.block_ids[:8])) + (" ..." if len(v.block_ids) > 8 else "")
        table.add_row(name, str(len(v.block_ids)) if v.found else "none", str(v.num_tokens),
                      same, shown)
    cached = _table("prompt tokens served from cache", "prompt", "device", "host", "computed")
    hit = sched.num_device_cached_tokens + sched.num_host_cached_tokens
    cached.add_row(str(sched.num_prompt_tokens), str(sched.num_device_cached_tokens),
                   str(sched.num_host_cached_tokens), str(sched.num_prompt_tokens - hit))
    data = {"seq_id": sched.seq_id, "request_id": sched.request_id,
            "scheduler": _plain(sched), "ranks": [_plain(v) for v in ranks.values()]}
    return data, [table, cached], 0 if sched.found or sched.status else 1


def _first_diff(got: list[int], want: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    return f"no: index {i}"


def cmd_cache(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    v = ask(engine.scheduler, CacheRequest(args.last), args.timeout)
    ratios = _table(f"prompt tokens over the last {v.num_requests} requests", "tier",
                    "tokens", "share")
    q = max(1, v.num_queried_tokens)
    hits = v.num_device_hit_tokens + v.num_host_hit_tokens + v.num_disk_hit_tokens
    for tier, n in (("device", v.num_device_hit_tokens), ("host", v.num_host_hit_tokens),
                    ("disk", v.num_disk_hit_tokens), ("computed", v.num_queried_tokens - hits)):
        ratios.add_row(tier, f"{n:,}", f"{n / q:.1%}")
    totals = _table("since start", "counter", "value")
    for key, value in v.totals.items():
        totals.add_row(key.removeprefix("num_"), f"{value:,}")
    # disk: used = writes in flight (committed once every rank wrote them)
    usage = _table("blocks per tier", "tier", "used", "cached", "free", "capacity")
    for tier, u in v.usage.items():
        usage.add_row(tier, *(f"{u.get(k, 0):,}" for k in ("used", "cached", "free", "capacity")))
    states = _table("state slots per tier (hybrid model)", "tier", "used", "cached", "free",
                    "capacity")
    for tier, u in v.state_usage.items():
        states.add_row(tier, *(f"{u.get(k, 0):,}" for k in ("used", "cached", "free",
                                                             "capacity")))
    disk = _table("disk tier since start (blocks)", "counter", "value")
    for key, value in v.disk.items():
        disk.add_row(key.replace("_", " "), f"{value:,}")
    sessions = _table("top sessions by cached tokens", "session", "requests", "prompt", "cached")
    for s in v.sessions:
        sessions.add_row(s.session, str(s.num_requests), f"{s.num_prompt_tokens:,}",
                         f"{s.num_cached_tokens:,}")
    breaks = _table("recent prefix breaks (reported by the shim)", "session", "request",
                    "common", "prompt", "reason")
    for b in v.prefix_breaks[-10:]:
        breaks.add_row(b.session, b.request_id, str(b.num_common_tokens),
                       str(b.num_prompt_tokens), b.reason)
    tables = [ratios, *_miss_tables(v), totals, usage, *([states] if v.state_usage else []),
              *([disk] if v.disk else []), sessions, breaks]
    return _plain(v), tables, 0


def _miss_tables(v: CacheView) -> list[Table]:
    """Why the prompt tokens the cache did not serve were computed (cache/miss_reasons.py):
    by reason over the last requests, then the latest requests' own reasons."""
    total = max(1, sum(v.uncached.values()))
    reasons = _table(f"computed prompt tokens by reason, last {v.num_requests} requests",
                     "reason", "tokens", "share", "requests it led")
    for reason, n in v.uncached.items():
        reasons.add_row(reason, f"{n:,}", f"{n / total:.1%}",
                        f"{v.uncached_requests.get(reason, 0):,}")
    recent = _table("latest requests: computed tokens and why", "request", "computed",
                    "reason", "detail")
    for r in v.recent:
        if r.uncached is not None:
            recent.add_row(r.request_id, f"{r.uncached.num_tokens:,}",
                           r.uncached.main_reason or "-", _miss_detail(r.uncached))
    return [reasons, recent] if v.uncached else []


def _miss_detail(u: UncachedTokens) -> str:
    parts = [f"{reason} {n:,}" for reason, n in u.by_reason().items() if n]
    if u.evicted:
        parts.append(f"first evicted from {u.evicted_tier} {u.evicted_age_s:,.0f} s before "
                     f"({u.evicted_by})")
    if u.diverged_at >= 0:
        parts.append(f"left the previous prompt at token {u.diverged_at:,}")
    return "; ".join(parts)


def cmd_queue(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    s = ask(engine.scheduler, SnapshotRequest(), args.timeout)
    table = _table(f"waiting {s.num_waiting}/{s.max_queued_requests}, running "
                   f"{s.num_running}/{s.max_num_seqs}, {s.max_num_batched_tokens} tokens/step",
                   "#", "request", "seq", "age s", "prompt", "preempted", "why waiting")
    for w in s.waiting:
        table.add_row(str(w.position), w.request_id, str(w.seq_id), f"{w.age_s:.1f}",
                      str(w.num_prompt_tokens), str(w.num_preemptions), w.reason)
    data = {k: getattr(s, k) for k in ("step", "num_waiting", "num_running", "max_num_seqs",
                                       "max_num_batched_tokens", "max_queued_requests")}
    data["waiting"] = [_plain(w) for w in s.waiting]
    data["running"] = [_plain(r) for r in s.running]
    data["pending_closes"] = s.pending_closes
    return data, [table], 0


def cmd_trace(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    reply = ask(engine.scheduler, TraceRequest(args.steps), args.timeout)
    table = _table(f"last {len(reply.plans)} step plans; swaps in/out; chunks seq:tokens@pos",
                   "step", "ms", "prefill", "decode", "new", "close", "swaps", "chunks")
    for p in reply.plans:
        chunks = " ".join(f"{c.seq_id}:{c.num_tokens}@{c.start_pos}" for c in p.chunks[:6])
        chunks += f" +{len(p.chunks) - 6}" if len(p.chunks) > 6 else ""
        table.add_row(str(p.step), f"{p.duration_s * 1000:.1f}", str(p.num_prefill_tokens),
                      str(p.num_decode_tokens), " ".join(map(str, p.new_seqs)),
                      " ".join(map(str, p.close)), f"{p.num_swap_in}/{p.num_swap_out}", chunks)
    return _plain(reply), [table], 0


def cmd_stacks(engine: EngineAddresses, args) -> tuple[Any, list, int]:
    replies = ask_all(engine.named(), StacksRequest(args.all_threads), args.timeout)
    out: list = []
    for name, r in replies.items():
        if isinstance(r, Exception):
            out.append(f"[bold red]{name}: no answer[/] ({r})")
            continue
        for thread, stack in r.threads.items():
            out.append(f"[bold]{name}[/] (pid {r.pid}) thread {thread}:")
            out.append(Text(stack.rstrip()))  # plain text: no markup in a stack
    data = {"scheduler": _plain(replies["scheduler"]),
            "ranks": [_plain(r) for n, r in replies.items() if n != "scheduler"]}
    return data, out, 1 if any(isinstance(r, Exception) for r in replies.values()) else 0


COMMANDS = {"ranks": cmd_ranks, "check": cmd_check, "seq": cmd_seq, "cache": cmd_cache,
            "queue": cmd_queue, "trace": cmd_trace, "stacks": cmd_stacks}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deepinfer-inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None, help="the engine's run directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per process")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("ranks", "check", "queue"):
        sub.add_parser(name)
    sub.add_parser("seq").add_argument("id", help="seq id, or request id")
    sub.add_parser("cache").add_argument("--last", type=int, default=100)
    sub.add_parser("trace").add_argument("--steps", type=int, default=10)
    sub.add_parser("stacks").add_argument("--all-threads", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(argv)
    console = console or Console()
    try:
        engine = load_engine(find_run_dir(args.run_dir))
        data, renderables, status = COMMANDS[args.command](engine, args)
    except (EngineNotFound, ControlUnavailable) as exc:
        if args.json:
            console.file.write(json.dumps({"error": str(exc)}) + "\n")
        else:
            console.print(f"[red]deepinfer-inspect: {exc}[/]", highlight=False)
        return 2
    if args.json:
        console.file.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        for r in renderables:
            console.print(r, highlight=False)
    return status


if __name__ == "__main__":
    sys.exit(main())
