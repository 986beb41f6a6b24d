"""The trace-shaped agent load (tools/benchmarks/trace_load.py) on the real scheduler and
cache, with the simulator's cost-model ranks, in virtual time: the policies of the
engine under memory pressure compared in seconds instead of the minutes `make
bench-trace` takes, and deterministically.

    python -m tools.sim.trace [--device-tokens 131072] [--host-tokens 0] [--policies all]
        [--prefill-s-per-token 2e-4] [trace options: see tools/benchmarks/trace_load.py]

Each policy runs the same sessions (same seed; the answers are the cost model's tokens,
so the prompts are the same in every run): sessions start staggered, each request is
sent when the one before it ended plus its pause, its sub-agents and title requests as
the trace makes them. The cost model's rates are given per prompt token (its matmuls)
and per (token, context token) pair (its attention), calibrated on the CPU machine's
measured long-history prefill; decode steps cost a fixed part plus a part per sequence.

Policies (switched on the scheduler object, not by flags): `engine` (as served: waiting
requests hold their prefixes, finished turns retained for the session TTL), `no-holds`
(waiting requests hold nothing), `no-retention` (--session-ttl 0), `lru` (neither).
Reported per policy: the hit ratio, tokens recomputed that the engine had seen before,
TTFT and latency percentiles, the longest queue, evictions.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
from dataclasses import asdict, dataclass, fields, replace

from rich.console import Console
from rich.table import Table

from scheduler.engine import EngineCore, agree_limits
from scheduler.scheduler import Scheduler
from tools.benchmarks.agents import percentile
from tools.benchmarks.trace_load import (
    SeenPrefix,
    TraceParams,
    TraceRequest,
    TraceSession,
    make_trace,
)
from tools.sim.executor import CostModel, CostModelExecutor
from wire.client import GenerateRequest
from wire.config import EngineConfig

BLOCK = 16
POLICIES = ("engine", "no-holds", "no-retention", "lru")


@dataclass
class SimSettings:
    device_tokens: int = 131_072  # 1 GiB of the 16K tiny Llama's bf16 KV
    host_tokens: int = 0
    prefill_s_per_token: float = 2e-4
    prefill_s_per_token_context: float = 1.2e-8
    decode_s_per_step: float = 0.03
    decode_s_per_seq: float = 0.002
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass
class Done:
    session_id: str
    kind: str
    arrival: float
    first_token: float
    end: float
    prompt: int
    cached: int
    seen: int
    pause_s: float


def run(params: TraceParams, sim: SimSettings, policy: str) -> list[Done]:
    cost = CostModel(prefill_s_per_token=sim.prefill_s_per_token,
                     prefill_s_per_token_context=sim.prefill_s_per_token_context,
                     decode_s_per_step=sim.decode_s_per_step,
                     decode_s_per_seq=sim.decode_s_per_seq)
    ex = CostModelExecutor(cost, sim.device_tokens // BLOCK, sim.host_tokens // BLOCK,
                           vocab_size=max(params.vocab) + 1, max_model_len=params.context_limit)
    config = EngineConfig(model="simulated", block_size=BLOCK, max_num_seqs=sim.max_num_seqs,
                          max_num_batched_tokens=sim.max_num_batched_tokens,
                          session_ttl_s=0.0 if policy in ("no-retention", "lru") else 90.0)
    core = EngineCore(Scheduler(config, agree_limits(ex.start()), clock=lambda: ex.clock), ex)
    sched = core.scheduler
    if policy in ("no-holds", "lru"):
        sched.admission.hold_waiting = lambda head_blocked: None  # type: ignore[method-assign]
    seen = SeenPrefix(BLOCK)
    order = itertools.count()
    # (time, order, session, answer): the session's next request is asked for then
    ready: list[tuple[float, int, TraceSession, list[int] | None]] = []
    sends: list[tuple[float, int, TraceSession, TraceRequest]] = []  # (time, ...) to send
    blocked: list[tuple[TraceSession, TraceRequest]] = []
    ends: dict[str, float] = {}
    live: dict[str, tuple[TraceSession, TraceRequest, float, int, list[int]]] = {}
    firsts: dict[str, float] = {}
    done: list[Done] = []
    for session in make_trace(params):
        heapq.heappush(ready, (session.start_s, next(order), session, None))

    def send_after(t: float, session: TraceSession, request: TraceRequest) -> None:
        heapq.heappush(sends, (t + request.pause_before_s, next(order), session, request))

    def advance(t: float) -> None:
        """Ask every session whose answer came (or whose start is) by `t` for its next."""
        while ready and ready[0][0] <= t:
            at, _, session, answer = heapq.heappop(ready)
            request = session.next_request(answer)
            for child in session.spawned():
                heapq.heappush(ready, (at + child.start_s, next(order), child, None))
            if request is None:
                ends[session.session_id] = at
                for parent, waiting in list(blocked):
                    if all(w in ends for w in waiting.wait_for):
                        blocked.remove((parent, waiting))
                        send_after(max(ends[w] for w in waiting.wait_for), parent, waiting)
            elif all(w in ends for w in request.wait_for):
                send_after(max([at, *(ends[w] for w in request.wait_for)]), session, request)
            else:
                blocked.append((session, request))

    while ready or sends or core.has_work():
        advance(ex.clock)
        while sends and sends[0][0] <= ex.clock:
            t, n, session, req = heapq.heappop(sends)
            rid = f"{req.session_id}-{n}"
            sched.add_request(GenerateRequest(rid, list(req.prompt), req.max_tokens,
                                              ignore_eos=True, session_id=req.session_id))
            live[rid] = (session, req, t, seen.seen_tokens(req.prompt), [])
        if not core.has_work():
            nxt = min([q[0][0] for q in (ready, sends) if q], default=None)
            if nxt is None:
                break
            ex.clock = max(ex.clock, nxt)
            continue
        for out in core.step().outputs:
            session, req, t, n_seen, answer = live[out.request_id]
            answer += out.token_ids
            if out.token_ids:
                firsts.setdefault(out.request_id, ex.clock)
            if not out.finished:
                continue
            del live[out.request_id]
            seen.add(req.prompt, answer)
            done.append(Done(req.session_id, req.kind, t, firsts.pop(out.request_id, ex.clock),
                             ex.clock, len(req.prompt), out.num_device_cached_tokens
                             + out.num_host_cached_tokens, n_seen, req.pause_before_s))
            heapq.heappush(ready, (ex.clock, next(order), session, answer))
    assert not blocked and not live, "a session never ended"
    return done


def summarize(done: list[Done], long_pause_s: float) -> dict[str, float]:
    prompt = sum(d.prompt for d in done)
    cached = sum(d.cached for d in done)
    recomputed_seen = sum(max(0, d.seen - d.cached) for d in done)
    seen = sum(d.seen for d in done)
    ttft = [d.first_token - d.arrival for d in done]
    after_pause = [d for d in done if d.pause_s >= long_pause_s]
    return {
        "requests": len(done), "wall_s": max((d.end for d in done), default=0.0),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "recomputed_seen": recomputed_seen,
        "recomputed_seen_share": recomputed_seen / seen if seen else 0.0,
        "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99),
        "after_long_pause": len(after_pause),
        "ttft_p90_after_long_pause": percentile(
            [d.first_token - d.arrival for d in after_pause], 0.9) if after_pause else 0.0,
    }


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(SimSettings):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    for f in fields(TraceParams):
        if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                           default=f.default, dest=f"trace_{f.name}")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--long-pause-s", type=float, default=10.0)
    p.add_argument("--json", default=None)
    args = vars(p.parse_args(argv))
    sim = SimSettings(**{f.name: args[f.name] for f in fields(SimSettings)})
    params = replace(TraceParams(), **{k[len("trace_"):]: v for k, v in args.items()
                                      if k.startswith("trace_")})
    console = console or Console(width=140)
    results = {}
    for policy in args["policies"].split(","):
        results[policy] = summarize(run(params, sim, policy), args["long_pause_s"])
    table = Table(title=f"trace load in virtual time: {params.sessions} sessions, device "
                        f"{sim.device_tokens:,} / host {sim.host_tokens:,} tokens")
    cols = ("policy", "requests", "wall s", "hit ratio", "recomputed seen", "TTFT p50/p90/p99 s",
            f"TTFT p90 after {args['long_pause_s']:g} s pauses")
    for col in cols:
        table.add_column(col, justify="right")
    for policy, r in results.items():
        table.add_row(policy, str(r["requests"]), f"{r['wall_s']:.0f}", f"{r['hit_ratio']:.3f}",
                      f"{r['recomputed_seen']:,} ({r['recomputed_seen_share']:.1%})",
                      f"{r['ttft_p50']:.1f} / {r['ttft_p90']:.1f} / {r['ttft_p99']:.1f}",
                      f"{r['ttft_p90_after_long_pause']:.1f} ({r['after_long_pause']})")
    console.print(table)
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump({"sim": asdict(sim), "trace": asdict(params), "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
