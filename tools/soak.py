"""`make soak`: thousands of mixed requests against a 4-rank engine; nothing may leak.

    python -m tools.soak [--requests 3000] [--concurrency 24] [--duration 900]
        [--world-size 4] [--url URL --run-dir DIR] [--json OUT]

Each request is drawn at random: an API (Anthropic messages, OpenAI chat, OpenAI
completions), streaming or not, a prompt of random size that often continues one of a
few shared conversations (so the prefix cache is exercised), a small max_tokens, and a
fate: served to the end, cancelled by the client part-way (closing the stream, or
giving up before the answer), given a deadline too short to meet (408), replaced by
a malformed body (4xx), or guided (structured outputs: a JSON schema the answer must
follow, checked). The engine runs with a small queue so overload (529/429) is exercised
too.

At the end, once the engine is idle, it prints requests served, responses by kind,
blocks (and a hybrid model's state slots) still referenced (leaks: must be 0), rank digest
mismatches (must be 0), whether `deepinfer-inspect check` finds every rank agreeing with
the scheduler, and the peak resident memory of each process. Exit status 1 if anything
leaked, diverged, any response was a 5xx or a broken connection, or a guided answer broke
its schema.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from orchestrator.config import TINY_MODEL
from tools import inspector as inspect_cli
from tools.benchmarks.agents_http import scrape
from tools.harness.served import Served

USED_BLOCKS = 'deepinfer_kv_blocks{state=used,tier=device}'
# a hybrid model's live state slots and snapshots not committed yet (absent for others)
USED_STATE_SLOTS = 'deepinfer_state_slots{state=used,tier=device}'
DIGEST_MISMATCHES = "deepinfer_rank_digest_mismatches_total"
_WORDS = ("read", "file", "edit", "test", "fails", "because", "the", "cache", "block",
          "index", "returns", "None", "when", "empty", "fix", "line", "diff", "patch")
BAD_BODIES: list[Any] = [
    b"{not json", b"", b"[]", b'"text"', {"messages": "hi"}, {"max_tokens": -3},
    {"max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"prompt": [1, 2, 10**9], "max_tokens": 2}, {"prompt": "", "max_tokens": 2},
    {"max_tokens": 4, "messages": []}, {"max_tokens": 4.5, "messages": "x"},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 10}], "tools": "all"},
]
GUIDED_SCHEMA = {"type": "object", "properties": {
    "file": {"enum": ["a.py", "b.py"]}, "line": {"type": "integer", "minimum": 1, "maximum": 999},
    "fixed": {"type": "boolean"}}, "required": ["file", "line", "fixed"],
    "additionalProperties": False}
GUIDED_MAX_TOKENS = 64  # the schema's answer is about 20 tokens: it always completes
BROKE_SCHEMA = "guided answer broke its schema"


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def make_request(rng: random.Random, conversations: list[str], args: argparse.Namespace
                 ) -> tuple[str, str, Any, dict[str, str]]:
    """(fate, path, body, extra headers) of one random request."""
    api = rng.choice(["anthropic", "chat", "completions"])
    roll = rng.random()
    if roll < args.bad_share:
        path = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions",
                "completions": "/v1/completions"}[api]
        return "bad", path, rng.choice(BAD_BODIES), {}
    fate = ("cancel" if roll < args.bad_share + args.cancel_share else
            "deadline" if roll < args.bad_share + args.cancel_share + 0.05 else "serve")
    if fate == "serve" and api != "completions" and rng.random() < args.guided_share:
        fate = "guided"
    base = rng.choice(conversations)
    prompt = base + " " + text(rng, rng.randint(1, args.max_prompt_words))
    stream = rng.random() < 0.6 or fate == "cancel"
    max_tokens = rng.randint(1, args.max_tokens)
    headers = {"x-request-timeout": "0.001"} if fate == "deadline" else {}
    messages = [{"role": "user", "content": prompt}]
    if fate == "guided":  # answered whole, so the answer can be checked
        stream, max_tokens = False, GUIDED_MAX_TOKENS
    if api == "anthropic":
        body = {"model": "m", "max_tokens": max_tokens, "messages": messages, "stream": stream,
                "temperature": 0}
        if fate == "guided":
            body["output_config"] = {"format": {"type": "json_schema", "schema": GUIDED_SCHEMA}}
        return fate, "/v1/messages", body, headers
    if api == "chat":
        body = {"model": "m", "max_tokens": max_tokens, "messages": messages, "stream": stream}
        if fate == "guided":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "fix", "schema": GUIDED_SCHEMA}}
        return fate, "/v1/chat/completions", body, headers
    return fate, "/v1/completions", {"model": "m", "max_tokens": max_tokens, "prompt": prompt,
                                     "stream": stream}, headers


async def send(client: httpx.AsyncClient, url: str, fate: str, path: str, body: Any,
               headers: dict[str, str], rng: random.Random) -> str:
    """One request; returns how it ended, as a kind for the report."""
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    try:
        if fate == "guided":
            r = await client.post(url + path, headers=headers, **kwargs)
            if r.status_code != 200:
                return _error_kind(r)
            return "served (guided)" if follows_schema(r.json()) else BROKE_SCHEMA
        if fate == "cancel" and rng.random() < 0.3:  # give up before any answer
            async with asyncio.timeout(rng.uniform(0.01, 0.5)):
                await client.post(url + path, headers=headers, **kwargs)
            return "served (cancel too late)"
        async with client.stream("POST", url + path, headers=headers, **kwargs) as r:
            if r.status_code != 200:
                await r.aread()
                return _error_kind(r)
            events = 0
            async for line in r.aiter_lines():
                if fate == "cancel" and line.startswith("data:"):
                    events += 1
                    if events >= rng.randint(1, 4):
                        return "cancelled mid-stream"
                if '"error"' in line and line.startswith("data:"):
                    return f"error event in stream ({_event_error_type(line)})"
        return "served"
    except TimeoutError:
        return "cancelled before the answer"
    except httpx.HTTPError as exc:
        return f"connection failed ({type(exc).__name__})"


def follows_schema(response: dict[str, Any]) -> bool:
    """The answer of a guided request (either API) is a JSON object GUIDED_SCHEMA allows."""
    if "choices" in response:
        text = response["choices"][0]["message"]["content"]
    else:
        text = "".join(b.get("text", "") for b in response["content"])
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return False
    return (isinstance(value, dict) and set(value) == {"file", "line", "fixed"}
            and value["file"] in ("a.py", "b.py") and isinstance(value["fixed"], bool)
            and isinstance(value["line"], int) and 1 <= value["line"] <= 999)


def _event_error_type(line: str) -> str:
    try:
        return json.loads(line[len("data:"):])["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "unreadable"


def _error_kind(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} (not JSON)"
    kind = err.get("type") if isinstance(err, dict) else None
    return f"{r.status_code} {kind}"


async def run_soak(url: str, args: argparse.Namespace, progress: tqdm) -> Counter:
    rng = random.Random(args.seed)
    conversations = [text(rng, 200 + 40 * i) for i in range(6)]
    kinds: Counter = Counter()
    deadline = time.monotonic() + args.duration
    todo = iter(range(args.requests))

    async def worker(wid: int) -> None:
        wrng = random.Random(args.seed * 1000 + wid)
        async with httpx.AsyncClient(timeout=300) as client:
            for _ in todo:
                if time.monotonic() > deadline:
                    return
                fate, path, body, headers = make_request(wrng, conversations, args)
                kinds[await send(client, url, fate, path, body, headers, wrng)] += 1
                progress.update(1)

    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    return kinds


def wait_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    """The engine's /metrics once no block (nor a hybrid model's state slot) is referenced
    any more (or the last scrape)."""
    end = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url, {}) or {}
        idle = metrics.get(USED_BLOCKS, 1) == 0 and metrics.get(USED_STATE_SLOTS, 0) == 0
        if idle or time.monotonic() > end:
            return metrics
        time.sleep(0.5)


def ranks_agree(run_dir: Path) -> tuple[bool, str]:
    out = io.StringIO()
    status = inspect_cli.main(["--run-dir", str(run_dir), "check"],
                              console=Console(file=out, width=120, color_system=None))
    return status == 0, out.getvalue()


def peak_rss_mib(pids: dict[str, int]) -> dict[str, float]:
    """VmHWM (peak resident set) of each process, MiB."""
    peaks = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmHWM:")), 0)
        peaks[name] = kb / 1024
    return peaks


def report(kinds: Counter, metrics: dict[str, float], agree: bool, peaks: dict[str, float],
           wall_s: float) -> dict[str, Any]:
    # 5xx other than 529 (overloaded: expected, the queue is small on purpose), and
    # connections that broke: neither may happen
    broken = sum(n for k, n in kinds.items()
                 if k.startswith(("5", "connection", BROKE_SCHEMA)) and not k.startswith("529"))
    return {
        "requests": sum(kinds.values()), "wall_s": round(wall_s, 1),
        "served": sum(n for k, n in kinds.items() if k.startswith("served")),
        "by_kind": dict(kinds.most_common()),
        "blocks_leaked": int(metrics.get(USED_BLOCKS, -1)),
        # None: the model keeps no state (not a hybrid)
        "state_slots_leaked": (int(metrics[USED_STATE_SLOTS]) if USED_STATE_SLOTS in metrics
                               else None),
        "digest_mismatches": int(metrics.get(DIGEST_MISMATCHES, -1)),
        "ranks_agree": agree, "server_errors": broken,
        "peak_rss_mib": {k: round(v) for k, v in peaks.items()},
    }


def print_report(r: dict[str, Any], console: Console) -> None:
    table = Table(title=f"soak: {r['requests']} requests in {r['wall_s']} s")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for kind, n in r["by_kind"].items():
        table.add_row(kind, str(n))
    console.print(table)
    console.print(f"served {r['served']}; blocks leaked {r['blocks_leaked']}; state slots "
                  f"leaked {r['state_slots_leaked']}; digest "
                  f"mismatches {r['digest_mismatches']}; ranks agree: {r['ranks_agree']}; "
                  f"5xx/broken: {r['server_errors']}")
    console.print("peak RSS MiB: " + ", ".join(f"{k} {v}" for k, v in r["peak_rss_mib"].items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TINY_MODEL))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--duration", type=float, default=1200, help="stop sending after this")
    p.add_argument("--max-prompt-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--bad-share", type=float, default=0.25)
    p.add_argument("--cancel-share", type=float, default=0.2)
    p.add_argument("--guided-share", type=float, default=0.2,
                   help="of the chat requests served to the end: guided by a JSON schema")
    p.add_argument("--max-queued-requests", type=int, default=16)
    p.add_argument("--url", default=None, help="soak a running engine (with --run-dir)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(argv)
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="deepinfer-soak-") as tmp:
        engine = None
        if args.url:
            url, run_dir = args.url.rstrip("/"), Path(args.run_dir)
        else:
            engine = Served(Path(args.model), Path(tmp) / "run", nproc=args.world_size,
                            extra_args=["--max-queued-requests", str(args.max_queued_requests)])
            url, run_dir = engine.url, engine.run_dir
        try:
            start = time.perf_counter()
            with tqdm(total=args.requests, desc="soak requests") as progress:
                kinds = asyncio.run(run_soak(url, args, progress))
            wall = time.perf_counter() - start
            metrics = wait_idle(url)
            agree, detail = ranks_agree(run_dir)
            pids = engine.pids() if engine else {}
            result = report(kinds, metrics, agree, peak_rss_mib(pids), wall)
        finally:
            if engine is not None:
                engine.stop()
    print_report(result, console)
    if not agree:
        console.print(detail)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = (result["blocks_leaked"] == 0 and result["state_slots_leaked"] in (0, None)
          and result["digest_mismatches"] == 0 and agree
          and result["server_errors"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
