"""The pause clients see when the engine group dies under their streams, against the
engine's restart time (`deepinfer-run --restart`: requests in flight are continued).

    python -m tools.benchmarks.resume                                  # tiny-llama, 2 ranks
    python -m tools.benchmarks.resume --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --nproc 1                     # SmolLM2's 3 KV heads do not split over 2 ranks
    python -m tools.benchmarks.resume --kill scheduler --disk

Starts `deepinfer-run --nproc-per-node N --restart 1 serve` (tools/harness/served.py),
runs S streamed completions at once (token prompts, greedy, ignore_eos) undisturbed, then
again, killing a process of the engine group with SIGKILL once every stream is under way
(the last rank by default, or the scheduler). Prints the machine
(tools/benchmarks/machine.py), the restart time (the kill to the shim's
`engine_reconnected`, from its log), and per stream the pause it saw (its longest gap
between two tokens after the kill, measured here as a client sees it) as p50 and max;
whether every stream's tokens equal its undisturbed run's; the keep-alives that came
during the pauses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from tools.benchmarks import machine
from tools.harness.served import Served


@dataclass
class Stream:
    """One streamed completion as its client sees it: when each token chunk came."""

    prompt: list[int]
    sent_at: float = 0.0
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() per chunk
    pings: list[float] = field(default_factory=list)
    error: str | None = None


def run_stream(url: str, stream: Stream, max_tokens: int) -> None:
    body = {"model": "m", "prompt": stream.prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stream.sent_at = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(":"):
                    stream.pings.append(time.monotonic())
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    stream.error = str(event["error"])
                    return
                stream.tokens += event["choices"][0]["token_ids"]
                stream.arrivals.append(time.monotonic())
    except httpx.HTTPError as exc:
        stream.error = repr(exc)


def run_all(url: str, prompts: list[list[int]], max_tokens: int,
            kill: tuple[int, int] | None = None) -> tuple[list[Stream], float | None]:
    """Every prompt streamed at once; with `kill` (pid, tokens), that pid is killed once
    every stream has that many tokens. Returns the streams and the kill's time."""
    streams = [Stream(p) for p in prompts]
    threads = [threading.Thread(target=run_stream, args=(url, s, max_tokens), daemon=True)
               for s in streams]
    for t in threads:
        t.start()
    killed_at = None
    if kill is not None:
        pid, after = kill
        while not all(len(s.tokens) >= after or s.error for s in streams):
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(900)
    return streams, killed_at


def pause_of(stream: Stream, killed_at: float) -> tuple[float, float] | None:
    """The stream's pause: its longest gap between two chunks that ends after the kill
    (chunks already on their way when the engine died may still come after the kill), as
    (start, end); None if it got nothing after the kill, or nothing before."""
    gaps = [(a, b) for a, b in zip(stream.arrivals, stream.arrivals[1:]) if b > killed_at]
    return max(gaps, key=lambda gap: gap[1] - gap[0]) if gaps else None


def log_time(engine: Served, event: str) -> float:
    """The wall-clock time of the log's last `event` line."""
    lines = [json.loads(line) for line in engine.log().splitlines() if line.startswith("{")]
    stamp = [e for e in lines if e.get("event") == event][-1]["timestamp"]
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kill-after", type=int, default=16,
                   help="kill once every stream has this many tokens")
    p.add_argument("--kill", choices=("rank", "scheduler"), default="rank",
                   help="the last rank (default) or the scheduler process")
    p.add_argument("--disk", action="store_true",
                   help="with a disk tier: the continuations' prefills read it back")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    info = machine.describe(measure=True)
    print(machine.summary_line(info), flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(args.prompt_tokens)]
               for _ in range(args.streams)]
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-resume-") as tmp:
        extra = ["--disk-cache-dir", f"{tmp}/disk", "--disk-cache-size", str(256 << 20),
                 "--host-cache-memory", str(64 << 20)] if args.disk else []
        engine = Served(Path(args.model), Path(tmp) / "run", args.nproc, extra,
                        dtype=args.dtype, launcher_args=["--restart", "1"])
        try:
            reference, _ = run_all(engine.url, prompts, args.max_tokens)
            target = "scheduler" if args.kill == "scheduler" else f"rank {args.nproc - 1}"
            pid = engine.pids()[target]
            streams, killed_at = run_all(engine.url, prompts, args.max_tokens,
                                         (pid, args.kill_after))
            killed_wall = time.time() - (time.monotonic() - killed_at)
            # from the kill: the launcher saw the death, the new scheduler was ready, the
            # shim reconnected (the restart time)
            marks = {event: log_time(engine, event) - killed_wall for event in
                     ("engine_restarting", "scheduler_ready", "engine_reconnected")}
            reconnected_at = killed_at + marks["engine_reconnected"]
            resumed = [json.loads(line) for line in engine.log().splitlines()
                       if '"request_resumed"' in line]
        finally:
            engine.stop()
    gaps = [(s, gap) for s in streams if (gap := pause_of(s, killed_at)) is not None]
    pauses = [end - start for _, (start, end) in gaps]
    same = sum(s.tokens == r.tokens and not s.error for s, r in zip(streams, reference))
    pinged = sum(any(start < t < end for t in s.pings) for s, (start, end) in gaps)
    print(f"{args.streams} streams of {args.max_tokens} tokens ({args.prompt_tokens}-token "
          f"prompts), {args.model}, {args.nproc} rank(s), {args.dtype}, "
          f"{'disk tier' if args.disk else 'no disk tier'}; killed: {target} (SIGKILL) "
          f"after {args.kill_after} tokens a stream")
    print(f"  restart (kill -> the shim reconnected)  {marks['engine_reconnected']:7.2f} s  "
          f"(the death seen by the launcher {marks['engine_restarting']:.2f} s, the new "
          f"scheduler ready {marks['scheduler_ready']:.2f} s)")
    if pauses:
        print(f"  pause a client saw, p50 / max          {statistics.median(pauses):7.2f} s /"
              f" {max(pauses):.2f} s   ({len(pauses)} streams)")
        print(f"    of which after the reconnection, p50  "
              f"{statistics.median(end - reconnected_at for _, (_, end) in gaps):7.2f} s  "
              "(the continuations' prefills: prompt + resumed output)")
        ttft = statistics.median(r.arrivals[0] - r.sent_at for r in reference if r.arrivals)
        print(f"    against the undisturbed run's TTFT   {ttft:7.2f} s  (the same prompts, "
              "at once, on the engine just started)")
    print(f"  the shim's request_resumed lines        {len(resumed)} (pause_s p50 "
          f"{statistics.median([r['pause_s'] for r in resumed]) if resumed else 0:.2f} s)")
    print(f"  streams equal to the undisturbed run    {same} / {len(streams)}")
    print(f"  streams with a keep-alive in the pause  {pinged} / {len(streams)} (one each "
          "5 s of silence)")
    errors = [s.error for s in streams if s.error]
    if errors:
        print(f"  errors: {errors[:3]}")
    return 0 if same == len(streams) else 1


if __name__ == "__main__":
    raise SystemExit(main())
