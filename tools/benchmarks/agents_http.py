"""Coding-agent benchmark over HTTP (Anthropic Messages API), prefix cache on and off.

    python -m tools.benchmarks.agents_http [--model models/tiny-llama] [--nproc-per-node 4]
        [--agents 4] [--turns 6] [--system-tokens 1024] [--tool-result-tokens 128] [--max-tokens 16]
        [--think-s 0.5] [--kv-cache-memory BYTES] [--host-cache-memory BYTES]
        [--dtype float32] [--serve-args "..."] [--json OUT.json] [--plot OUT.png]
    python -m tools.benchmarks.agents_http --url http://127.0.0.1:8000 [--api-key KEY] ...  # one

Starts `deepinfer-run serve` twice (prefix cache on, then --no-prefix-caching) and runs
the same workload against each: N agents share one system prompt and one set of tool
definitions (Read, Edit, Bash); every turn an agent streams POST /v1/messages with its
whole history plus a new tool result (temperature 0, a short answer), then thinks for
a random pause (uniform 0..2x --think-s), so some sessions sit idle while others run.
With --url, the endpoint already running is benched once (no on/off ratio).

Reported per run: the share of prompt tokens served from each cache tier (deltas of the
/metrics counters), prompt tokens read per second (cached ones included; prompt =
input + cache_read + cache_creation tokens of the usage), TTFT p50/p95/p99 (to the
first content delta), output tokens per second, queue wait (the /metrics histogram
delta), and the on/off ratios. Writes a JSON result and a PNG plot (TTFT and cached
share per request over time, both runs on the same axes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from tqdm import tqdm

from orchestrator.cache_gate import usage_counts
from tools.benchmarks.agents import percentile
from tools.benchmarks.agents_http_report import plot, print_report, ratios
from tools.harness.served import Served

RESULTS_DIR = Path("bench-results")
QUEUE_HISTOGRAM = "deepinfer_request_queue_time_seconds"
_SCHEMA = {"type": "object", "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"name": "Read", "description": "Reads a file from the local filesystem. The path must "
     "be absolute. Lines are numbered from 1; offset and limit read part of a long file.",
     "input_schema": {**_SCHEMA, "required": ["file_path"], "properties": {
         "file_path": {"type": "string", "description": "Absolute path of the file"},
         "offset": {"type": "integer", "description": "First line to read"},
         "limit": {"type": "integer", "description": "Number of lines to read"}}}},
    {"name": "Edit", "description": "Replaces one exact occurrence of old_string with "
     "new_string in a file. Fails if old_string is absent or not unique.",
     "input_schema": {**_SCHEMA, "required": ["file_path", "old_string", "new_string"],
                      "properties": {
         "file_path": {"type": "string", "description": "Absolute path of the file"},
         "old_string": {"type": "string", "description": "The text to replace"},
         "new_string": {"type": "string", "description": "The text to put instead"},
         "replace_all": {"type": "boolean", "default": False}}}},
    {"name": "Bash", "description": "Runs a bash command in a persistent shell and returns "
     "its output. Use it for tests, git and builds; not for reading files.",
     "input_schema": {**_SCHEMA, "required": ["command"], "properties": {
         "command": {"type": "string", "description": "The command to run"},
         "timeout": {"type": "number", "description": "Milliseconds, at most 600000"},
         "description": {"type": "string", "description": "What it does, in a few words"}}}},
]
# Code-ish words that the tiny model's tokenizer (trained on Python sources) keeps whole,
# so --system-tokens and --tool-result-tokens come out within ~10% of their token counts.
WORDS = ("self return def import from class if else for in not None True False value name "
         "path file data result error args list dict str int len range print open read "
         "write line index key items update append raise except try with as yield lambda "
         "while break continue pass assert test config module object").split()


def filler(rng: random.Random, num_words: int) -> str:
    """Code-like lines of `num_words` words: a file read, a test log, a diff."""
    lines, n = [], 0
    while n < num_words:
        k = min(rng.randint(4, 12), num_words - n)
        lines.append("    " * rng.randint(0, 2) + " ".join(rng.choice(WORDS) for _ in range(k)))
        n += k
    return "\n".join(lines)


@dataclass
class Step:
    """One request of one agent, as the client saw it."""

    agent: int
    turn: int
    sent_s: float  # since the run started
    ttft_s: float  # to the first content delta (to the end if the answer is empty)
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


async def stream_message(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[float, float, dict, list[dict]]:
    """POST /v1/messages streamed: (TTFT s, end-to-end s, final usage, content blocks)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, int] = {}
    blocks: list[dict[str, Any]] = []
    partial_json: dict[int, str] = {}  # tool_use input arrives as JSON text
    async with client.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"POST /v1/messages: HTTP {r.status_code}: {r.text[:500]}")
        event = ""
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
                continue
            if not line.startswith("data: "):
                continue
            data = json.loads(line[len("data: "):])
            if event == "error":
                raise RuntimeError(f"error event mid-stream: {data}")
            if event == "message_start":
                usage = dict(data["message"]["usage"])
            elif event == "content_block_start":
                blocks.append(dict(data["content_block"]))
            elif event == "content_block_delta":
                if ttft is None:
                    ttft = time.perf_counter() - t0
                i, delta = data["index"], data["delta"]
                if delta["type"] == "text_delta":
                    blocks[i]["text"] += delta["text"]
                elif delta["type"] == "input_json_delta":
                    partial_json[i] = partial_json.get(i, "") + delta["partial_json"]
            elif event == "message_delta":
                usage.update(data["usage"])
    for i, text in partial_json.items():
        blocks[i]["input"] = json.loads(text) if text else {}
    e2e = time.perf_counter() - t0
    return (e2e if ttft is None else ttft), e2e, usage, blocks


async def run_agent(i: int, client: httpx.AsyncClient, url: str, headers: dict[str, str],
                    args: argparse.Namespace, system: str, t0: float, steps: list[Step],
                    progress: tqdm) -> None:
    rng = random.Random(f"{args.seed}-agent-{i}")
    # the shim keys its prefix tracker on this header, as for Claude Code
    headers = {**headers, "x-claude-code-session-id": f"bench-{uuid.uuid4().hex[:12]}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": (
        f"The tests of module_{i} fail; find the bug and fix it.\n" + filler(rng, 48))}]
    for turn in range(args.turns):
        body = {"model": args.served_model, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "system": system, "tools": TOOLS, "messages": messages}
        sent = time.perf_counter() - t0
        ttft, e2e, usage, blocks = await stream_message(client, url, body, headers)
        steps.append(Step(i, turn, sent, ttft, e2e, usage_counts("anthropic", usage)[0],
                          usage.get("cache_read_input_tokens", 0),
                          usage.get("output_tokens", 0)))
        progress.update(1)
        if turn == args.turns - 1:
            break
        # The answer goes back verbatim (so the prompt extends the previous prompt plus
        # its output), then a tool result. The shim does not check tool_use ids, so a
        # plain-text answer (the random-weight model rarely calls tools) gets one too.
        messages.append({"role": "assistant", "content": blocks or ""})
        ids = [b["id"] for b in blocks if b["type"] == "tool_use"] or [f"toolu_bench{i}_{turn}"]
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id,
             "content": filler(rng, args.tool_result_tokens // len(ids))} for tool_id in ids]})
        await asyncio.sleep(rng.uniform(0, 2 * args.think_s))


async def run_workload(url: str, headers: dict[str, str], args: argparse.Namespace,
                       progress: tqdm) -> tuple[list[Step], float]:
    system = ("You are a coding agent working in a repository. Use the tools to read, edit "
              "and test code; answer briefly.\n" + filler(random.Random(args.seed),
                                                           args.system_tokens))
    steps: list[Step] = []
    # no pool limit: every agent keeps its own connection, however many there are
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_agent(i, client, url, headers, args, system, t0, steps,
                                         progress) for i in range(args.agents)))
        return steps, time.perf_counter() - t0


def scrape(url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """Every /metrics sample as {"name{label=value}": value}; None if unavailable."""
    try:
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def queue_wait_ms(delta: dict[str, float]) -> tuple[float | None, float | None]:
    """(mean, p95) of the queue-time histogram's delta. The p95 is the upper bound of
    the bucket it falls in: a histogram holds no finer figure."""
    count = delta.get(f"{QUEUE_HISTOGRAM}_count", 0)
    if not count:
        return None, None
    buckets = sorted((float(k.split("le=")[1].rstrip("}")), v) for k, v in delta.items()
                     if k.startswith(f"{QUEUE_HISTOGRAM}_bucket"))
    p95 = next(le for le, cumulative in buckets if cumulative >= 0.95 * count)
    return 1000 * delta[f"{QUEUE_HISTOGRAM}_sum"] / count, 1000 * p95


def summarize(steps: list[Step], wall_s: float, before: dict[str, float] | None,
              after: dict[str, float] | None) -> dict[str, Any]:
    prompt = sum(s.prompt_tokens for s in steps)
    output = sum(s.output_tokens for s in steps)
    ttfts = [s.ttft_s for s in steps]
    r: dict[str, Any] = {
        "requests": len(steps), "prompt_tokens": prompt, "output_tokens": output,
        "cached_share": sum(s.cached_tokens for s in steps) / prompt,  # from the usage
        "device_hit_share": None, "host_hit_share": None,
        "queue_mean_ms": None, "queue_p95_ms": None, "prefix_breaks": None,
        "prompt_tokens_read_per_s": prompt / wall_s, "output_tokens_per_s": output / wall_s,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p95_ms": 1000 * percentile(ttfts, 0.95),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99), "wall_s": wall_s,
    }
    if before is not None and after is not None:
        # counters only grow; what another client sent meanwhile (--url) counts too
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        for tier in ("device", "host"):
            hits = delta.get(f"deepinfer_prefix_cache_hit_tokens_total{{tier={tier}}}", 0)
            r[f"{tier}_hit_share"] = hits / prompt
        r["queue_mean_ms"], r["queue_p95_ms"] = queue_wait_ms(delta)
        breaks = delta.get("deepinfer_prefix_breaks_total")
        r["prefix_breaks"] = None if breaks is None else int(breaks)
    return r


def bench_endpoint(url: str, headers: dict[str, str], args: argparse.Namespace,
                   progress: tqdm) -> dict[str, Any]:
    # one short request first: the first forward passes are slow (allocation, lazy
    # init) and would otherwise land in one run's TTFT tail only
    warm = {"model": args.served_model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "warm up"}]}
    httpx.post(f"{url}/v1/messages", json=warm, headers=headers,
               timeout=args.timeout_s).raise_for_status()
    before = scrape(url, headers)
    steps, wall_s = asyncio.run(run_workload(url, headers, args, progress))
    result = summarize(steps, wall_s, before, scrape(url, headers))
    result["steps"] = [asdict(s) for s in sorted(steps, key=lambda s: s.sent_s)]
    return result


def bench_served(args: argparse.Namespace, caching: bool, progress: tqdm) -> dict[str, Any]:
    extra = shlex.split(args.serve_args)
    for flag in ("kv_cache_memory", "host_cache_memory", "max_num_batched_tokens"):
        if getattr(args, flag) is not None:
            extra += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if not caching:
        extra.append("--no-prefix-caching")
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        engine = None
        try:
            engine = Served(Path(args.model).resolve(), Path(tmp) / "run", args.nproc_per_node,
                            extra, dtype=args.dtype)
            return bench_endpoint(engine.url, {}, args, progress)
        except Exception:
            # the launcher's log goes with the temporary dir: show why before it does
            for log in Path(tmp).glob("launcher-*.log"):
                progress.write(f"{log.name}, last lines:\n{log.read_text()[-3000:]}")
            raise
        finally:
            if engine is not None:
                engine.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--url", default=None, help="bench this endpoint once instead of "
                   "starting the engine (no on/off ratio)")
    p.add_argument("--api-key", default=None, help="sent as x-api-key (with --url)")
    p.add_argument("--served-model", default="deepinfer", help="the `model` field sent")
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes per rank")
    p.add_argument("--host-cache-memory", type=int, default=None, help="bytes per rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--serve-args", default="", help="more `deepinfer-run serve` flags, as "
                   'one string: --serve-args="--block-size 32"')
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1024,
                   help="shared system prompt, about this many tokens")
    p.add_argument("--tool-result-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each answer")
    p.add_argument("--think-s", type=float, default=0.5,
                   help="mean pause between an agent's turns (uniform 0..2x)")
    p.add_argument("--timeout-s", type=float, default=600, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="default: bench-results/bench-<time>.json")
    p.add_argument("--plot", type=Path, default=None, help="default: next to the JSON")
    args = p.parse_args(argv)
    if args.agents < 1 or args.turns < 1:
        p.error("--agents and --turns must be >= 1")
    if args.json is None:
        args.json = RESULTS_DIR / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if args.plot is None:
        args.plot = args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(argv)
    console = console or Console(width=170)
    labels = ["endpoint"] if args.url else ["on", "off"]
    runs: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(labels) * args.agents * args.turns, desc="requests") as progress:
        for label in labels:
            progress.set_postfix_str(f"cache {label}" if args.url is None else args.url)
            if args.url:
                headers = {"x-api-key": args.api_key} if args.api_key else {}
                runs[label] = bench_endpoint(args.url.rstrip("/"), headers, args, progress)
            else:
                runs[label] = bench_served(args, label == "on", progress)
    title = (f"{args.agents} agents x {args.turns} turns over HTTP, ~{args.system_tokens}-token "
             f"shared system prompt + 3 tools, ~{args.tool_result_tokens}-token tool results")
    print_report(runs, title, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                       if k != "api_key"},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "runs": runs, "ratios": ratios(runs["on"], runs["off"]) if "off" in runs else None}
    args.json.write_text(json.dumps(result, indent=2))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.plot, title)
    console.print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
