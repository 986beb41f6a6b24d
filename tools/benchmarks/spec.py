"""Speculative decoding by prompt lookup, measured on the real model: decode tokens/s and
draft acceptance with and without `--speculative-config`, side by side, in one run.

Two workloads, one request at a time (decode speed is what speculation changes):

- edit: the prompt holds a ~200-line Python file and asks for it back with one small
  change, what an agent's edit does; most of the answer is a copy of the prompt.
- free: a free-text answer that quotes nothing (speculation must not slow it down).

Each request runs in process (world size 1, the scheduler and the model in this process:
no sockets in the figures) with greedy decoding, once plain and once with speculation;
the tokens must be the same, and the tool says so. Decode tokens/s counts from the first
token to the last, so prefill is out of it. Prints the machine beside the figures.

    python -m tools.benchmarks.spec [--model M] [--max-tokens 256] [--num-speculative-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.gguf_tokenizer import load_gguf_tokenizer
from scheduler.engine import EngineCore, agree_limits
from scheduler.scheduler import Scheduler
from tools.benchmarks.machine import describe, summary_line
from wire.client import GenerateRequest
from wire.config import EngineConfig, SpeculativeConfig
from worker.inprocess import InProcessExecutor

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

_WORDS = ("order", "item", "price", "stock", "user", "cart", "invoice", "report", "region",
          "discount", "tax", "shipment", "vendor", "ledger", "balance", "refund")


def code_file(num_functions: int = 29, seed: int = 0) -> str:
    """A deterministic ~200-line Python module: small functions over made-up records."""
    rng = random.Random(seed)
    lines = ['"""Inventory helpers."""', "", "import math", ""]
    for i in range(num_functions):
        a, b = rng.sample(_WORDS, 2)
        k = rng.randrange(2, 9)
        lines += [
            f"def {a}_{b}_{i}(records, limit={k}):",
            f'    """Sum the {b} of each {a} record, at most {k} of them."""',
            "    total = 0",
            "    for record in records[:limit]:",
            f"        total += record.get('{b}', 0) * {rng.randrange(1, 20)}",
            f"    return math.floor(total / {k})",
            "",
        ]
    return "\n".join(lines)


def chat(user: str) -> str:
    """SmolLM2's chat template, rendered by hand (the engine sees token ids only)."""
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def workloads() -> dict[str, str]:
    code = code_file()
    first = code.split("def ", 2)[1].split("(")[0]
    return {
        "edit": chat(f"Here is a file:\n```python\n{code}\n```\nRewrite the whole file with "
                     f"one change: rename `{first}` to `first_total`. Output only the code."),
        "free": chat("Write a short story about a lighthouse keeper who finds a message "
                     "in a bottle. Use vivid, original language."),
    }


@dataclass
class Run:
    tokens: list[int]
    decode_s: float  # first token to last
    num_steps: int
    num_draft: int
    num_accepted: int

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s else 0.0


def engine(model: str, spec: SpeculativeConfig | None, threads: int) -> EngineCore:
    config = EngineConfig(model=model, dtype="float32", kv_cache_memory=192 << 20,
                          max_model_len=4096, max_num_batched_tokens=4096,
                          torch_threads=threads, speculative=spec)
    executor = InProcessExecutor(config)
    return EngineCore(Scheduler(config, agree_limits(executor.start())), executor)


def run_one(core: EngineCore, prompt: list[int], max_tokens: int) -> Run:
    sched = core.scheduler
    sched.add_request(GenerateRequest("bench", prompt, max_tokens))
    tokens: list[int] = []
    first = last = 0.0
    step0, draft0, acc0 = sched.step, sched.spec_stats.num_draft_tokens, \
        sched.spec_stats.num_accepted_tokens
    while core.has_work():
        for out in core.step().outputs:
            if out.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += out.token_ids
    return Run(tokens, last - first, sched.step - step0,
               sched.spec_stats.num_draft_tokens - draft0,
               sched.spec_stats.num_accepted_tokens - acc0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per mode, interleaved; the fastest counts (a shared CPU's load "
                        "changes under a run)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    spec = SpeculativeConfig("ngram", args.num_speculative_tokens, args.prompt_lookup_max,
                             args.prompt_lookup_min)
    tok = load_gguf_tokenizer(args.model).tokenizer
    cores = {"plain": engine(args.model, None, args.torch_threads),
             "spec": engine(args.model, spec, args.torch_threads)}
    machine = describe()
    print(summary_line(machine))
    print(f"model {Path(args.model).name}, float32, greedy, max_tokens {args.max_tokens}, "
          f"one request at a time; {json.dumps(vars(spec))}")
    report = {"machine": machine, "spec": vars(spec), "max_tokens": args.max_tokens}
    print(f"{'workload':<9}{'prompt':>7}  {'plain tok/s':>11}  {'spec tok/s':>10}  "
          f"{'speedup':>7}  {'accepted':>14}  {'tokens/step':>11}  same")
    for name, text in workloads().items():
        prompt = tok.encode(text).ids
        tries: dict[str, list[Run]] = {mode: [] for mode in cores}
        for _ in range(args.repeats):
            for mode, core in cores.items():
                tries[mode].append(run_one(core, prompt, args.max_tokens))
        runs = {mode: max(rs, key=lambda r: r.decode_tok_s) for mode, rs in tries.items()}
        same = all(r.tokens == tries["plain"][0].tokens for rs in tries.values() for r in rs)
        plain, fast = runs["plain"], runs["spec"]
        rate = fast.num_accepted / fast.num_draft if fast.num_draft else 0.0
        speedup = fast.decode_tok_s / plain.decode_tok_s
        print(f"{name:<9}{len(prompt):>7}  {plain.decode_tok_s:>11.2f}  "
              f"{fast.decode_tok_s:>10.2f}  {speedup:>6.2f}x  "
              f"{fast.num_accepted:>5}/{fast.num_draft:<4} {rate:>3.0%}  "
              f"{len(fast.tokens) / max(fast.num_steps - 1, 1):>11.2f}  "
              f"{'yes' if same else 'NO'}")
        report[name] = {"prompt_tokens": len(prompt), "speedup": speedup,
                        "same_tokens": same,
                        **{m: {"decode_tok_s": r.decode_tok_s, "tokens": len(r.tokens),
                               "steps": r.num_steps, "draft": r.num_draft,
                               "accepted": r.num_accepted} for m, r in runs.items()}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
