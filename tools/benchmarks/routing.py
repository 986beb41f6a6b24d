"""Coding agents over HTTP through a router in front of several replicas: does each
agent's next turn land where its prefix is cached?

    python -m tools.benchmarks.routing --replicas 2 [--agents 8] [--turns 6] [--json OUT]

Starts the replicas and SMG (tools/replicas.py) once per policy, cache_aware then
round_robin, and runs the same load through each: agents (concurrent, one request in
flight each) that share a system prompt, then resend their whole growing history every
turn (previous prompt + answer + a new tool result), as Claude Code does. Reports, per
policy, the share of prompt tokens served from cache (`cached_tokens` of each reply)
and prompt tokens read per second (cached ones count as read).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from orchestrator.config import TINY_MODEL
from tools.replicas import Replicas

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu file line test build error patch diff commit branch merge read write grep "
         "edit run stack trace value index table cache block token").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class AgentLoad:
    num_agents: int = 6
    num_turns: int = 4
    system_words: int = 200
    first_words: int = 60
    tool_words: int = 40
    max_tokens: int = 4
    seed: int = 0
    model: str = "tiny-llama"
    turns: list[Turn] = field(default_factory=list)
    first_bodies: dict[int, dict] = field(default_factory=dict)  # agent -> its first request

    def run(self, url: str, concurrent: bool = True) -> float:
        """Every agent's turns, in order per agent; returns the wall time in seconds."""
        rng = random.Random(self.seed)
        system = f"[{self.seed}] You are a coding agent. " + words(rng, self.system_words)
        histories = [[{"role": "system", "content": system},
                      {"role": "user", "content": f"agent {a}: " + words(rng, self.first_words)}]
                     for a in range(self.num_agents)]
        tools = [[words(rng, self.tool_words) for _ in range(self.num_turns)]
                 for _ in range(self.num_agents)]
        lock = threading.Lock()

        def agent(a: int) -> None:
            with httpx.Client(timeout=600) as http:
                for t in range(self.num_turns):
                    body = {"model": self.model, "messages": list(histories[a]),
                            "max_tokens": self.max_tokens, "temperature": 0}
                    self.first_bodies.setdefault(a, body)
                    r = http.post(f"{url}/v1/chat/completions", json=body)
                    r.raise_for_status()
                    body = r.json()
                    usage = body["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    with lock:
                        self.turns.append(Turn(a, t, usage["prompt_tokens"], cached))
                    reply = body["choices"][0]["message"]["content"] or ""
                    histories[a] += [{"role": "assistant", "content": reply},
                                     {"role": "user", "content": "tool result: " + tools[a][t]}]

        t0 = time.perf_counter()
        if concurrent:
            threads = [threading.Thread(target=agent, args=(a,)) for a in range(self.num_agents)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        else:
            for a in range(self.num_agents):
                agent(a)
        return time.perf_counter() - t0

    def summary(self, wall_s: float) -> dict:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        later = [t for t in self.turns if t.turn > 0]
        return {"requests": len(self.turns), "prompt_tokens": prompt, "cached_tokens": cached,
                "hit_ratio": cached / prompt if prompt else 0.0,
                "later_turn_hit_ratio": (sum(t.cached_tokens for t in later)
                                         / max(sum(t.prompt_tokens for t in later), 1)),
                "prompt_tokens_read_per_s": prompt / wall_s, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=TINY_MODEL)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--tool-words", type=int, default=60)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args(argv)
    name = args.model.name.removesuffix(".gguf")
    results = {}
    for i, policy in enumerate(args.policies):
        with Replicas(args.replicas, args.model, served_names=(name,), policy=policy,
                      extra_args=extra) as r:
            load = AgentLoad(args.agents, args.turns, args.system_words, 60, args.tool_words,
                             seed=i, model=name)
            results[policy] = load.summary(load.run(r.url))
    table = Table(title=f"{args.agents} agents x {args.turns} turns over {args.replicas} "
                        f"replicas behind SMG")
    for col in ("policy", "hit ratio", "later turns' hit ratio", "prompt tok/s", "wall s"):
        table.add_column(col, justify="right")
    for policy, s in results.items():
        table.add_row(policy, f"{s['hit_ratio']:.1%}", f"{s['later_turn_hit_ratio']:.1%}",
                      f"{s['prompt_tokens_read_per_s']:,.0f}", f"{s['wall_s']:.1f}")
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
