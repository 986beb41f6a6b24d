"""FP8 KV (`--kv-cache-dtype`) against KV in the model's dtype, on the real model: how far
the logits move, whether greedy decoding still picks the same tokens, and how many tokens
a GiB of each tier then holds.

    python -m tools.benchmarks.kv_dtype [--model M] [--dtype bfloat16] [--prompts 20]
        [--new-tokens 256] [--json OUT]

Each KV dtype gets one rank's `ModelRunner` in this process (world size 1, no scheduler,
no sockets), driven by plans:

1. greedy generation: every prompt prefilled in one step, then `--new-tokens` decode steps
   of the whole batch; the reference is the model's dtype (`auto`);
2. teacher-forced logits: each prompt followed by the reference's own continuation,
   prefilled in one chunk, the logits read at every continuation position, so every KV
   dtype is compared on the same tokens (free-running outputs part at the first
   difference, and a comparison after it says nothing).

Printed per FP8 dtype: the largest and the mean |logit difference| over those positions,
the share whose argmax is the reference's, and, free-running, how many of the prompts
give the reference's tokens throughout and how many tokens come before the first
difference on average; with the KV bytes per token and tokens per GiB of the device and
host tiers and of the disk tier (its records: a header and 4 KiB alignment), and the
machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from orchestrator.config import DEFAULT_MODEL
from orchestrator.gguf_tokenizer import load_gguf_tokenizer
from tools.benchmarks.machine import describe, summary_line
from tools.benchmarks.spec import chat
from wire.config import EngineConfig
from wire.step import DecodeBatch, NewSequence, ScheduledChunk, StepPlan
from worker.disk_store import record_bytes
from worker.distributed import TensorParallelGroup
from worker.model_runner import ModelRunner

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
GIB = 1 << 30
QUESTIONS = (
    "Explain how a hash map handles collisions.",
    "Write a Python function that reverses a linked list.",
    "What is the difference between TCP and UDP?",
    "Summarize the causes of the French Revolution in a paragraph.",
    "How do vaccines train the immune system?",
    "Describe the water cycle to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "What are the trade-offs of microservices against a monolith?",
    "Give three tips for writing clear commit messages.",
    "How does a binary search work, and what is its complexity?",
    "Explain photosynthesis step by step.",
    "Write a SQL query that finds the five most recent orders per customer.",
    "Why is the sky blue?",
    "Compare Python lists and tuples.",
    "What does a compiler's register allocator do?",
    "Plan a three-day trip to Kyoto.",
    "How do I center a div in CSS?",
    "Explain the CAP theorem with an example.",
    "Write a short story opening set on a night train.",
    "What is gradient descent, intuitively?",
)


@dataclass
class Runner:
    """One KV dtype's model and its figures."""

    kv: str
    runner: ModelRunner
    next_step: int = 0

    def execute(self, return_logits: bool = False, **plan: object):
        out = self.runner.execute(StepPlan(step=self.next_step, **plan), return_logits)
        self.next_step += 1
        return out

    @property
    def bytes_per_token(self) -> float:
        return self.runner.kv_bytes_per_block / self.runner.config.block_size

    @property
    def disk_bytes_per_token(self) -> float:
        payload = self.runner.kv_bytes_per_block  # a host slot: the block's K, V and scales
        return record_bytes(payload) / self.runner.config.block_size


def start(model: str, dtype: str, kv: str, max_model_len: int, num_seqs: int) -> Runner:
    config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv,
                          kv_cache_memory=0, max_model_len=max_model_len)
    runner = ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"),
                         num_device_blocks=num_seqs * -(-max_model_len // config.block_size))
    return Runner(kv, runner)


def blocks_of(seq: int, tokens: int, block_size: int, max_model_len: int) -> list[int]:
    """Sequence `seq`'s blocks: its own run of the pool, room for max_model_len tokens."""
    per_seq = -(-max_model_len // block_size)
    return list(range(seq * per_seq, seq * per_seq + -(-tokens // block_size)))


def generate(r: Runner, prompts: list[list[int]], new_tokens: int,
             max_model_len: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt, decoded as one batch; and the seconds it took."""
    bs = r.runner.config.block_size
    seqs = [NewSequence(i, blocks_of(i, len(p) + new_tokens, bs, max_model_len))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    r.execute(new_seqs=seqs)
    out = r.execute(chunks=[ScheduledChunk(i, p, 0, True) for i, p in enumerate(prompts)])
    tokens = [[t] for _, t in sorted(out.sampled)]
    for _ in range(new_tokens - 1):
        batch = DecodeBatch()
        for i, (p, t) in enumerate(zip(prompts, tokens)):
            batch.append(i, t[-1], len(p) + len(t) - 1)
        for seq, token in r.execute(decodes=batch).sampled:
            tokens[seq].append(token)
    seconds = time.perf_counter() - t0
    r.execute(close=list(range(len(prompts))))
    return tokens, seconds


def forced_logits(r: Runner, prompt: list[int], continuation: list[int],
                  max_model_len: int) -> torch.Tensor:
    """[len(continuation), vocab]: the logits predicting each continuation token, prompt
    and continuation prefilled in one chunk."""
    full = prompt + continuation
    seq = 1_000_000 + r.next_step  # a fresh id; the blocks of sequence 0
    r.execute(new_seqs=[NewSequence(seq, blocks_of(0, len(full), r.runner.config.block_size,
                                                   max_model_len))])
    out = r.execute(return_logits=True, chunks=[ScheduledChunk(seq, full, 0, True)])
    r.execute(close=[seq])
    return out.logits[len(prompt) - 1:len(full) - 1].float()


@dataclass
class Comparison:
    max_diff: float = 0.0
    sum_diff: float = 0.0
    num_logits: int = 0
    agree: int = 0
    positions: int = 0

    def add(self, logits: torch.Tensor, ref: torch.Tensor) -> None:
        diff = (logits - ref).abs()
        self.max_diff = max(self.max_diff, diff.max().item())
        self.sum_diff += diff.sum().item()
        self.num_logits += diff.numel()
        self.agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        self.positions += len(ref)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=len(QUESTIONS))
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    tok = (load_gguf_tokenizer(args.model).tokenizer if args.model.endswith(".gguf")
           else Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")))
    prompts = [tok.encode(chat(q)).ids for q in QUESTIONS[:args.prompts]]
    max_model_len = -(-(max(map(len, prompts)) + args.new_tokens) // 16) * 16
    machine = describe()
    print(summary_line(machine))
    print(f"model {Path(args.model).name}, {args.dtype}, {len(prompts)} prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {args.new_tokens} "
          f"greedy tokens each, against --kv-cache-dtype auto ({args.dtype} KV)")
    runners = {kv: start(args.model, args.dtype, kv, max_model_len, len(prompts))
               for kv in KV_DTYPES}
    generated, seconds = {}, {}
    for kv, r in runners.items():
        generate(r, prompts, 4, max_model_len)  # a warm-up: the timing is the decode's own
        generated[kv], seconds[kv] = generate(r, prompts, args.new_tokens, max_model_len)
    reference = generated["auto"]
    compared = {kv: Comparison() for kv in KV_DTYPES[1:]}
    scale = 0.0
    for prompt, continuation in zip(prompts, reference):
        ref = forced_logits(runners["auto"], prompt, continuation, max_model_len)
        scale = max(scale, ref.abs().max().item())
        for kv, c in compared.items():
            c.add(forced_logits(runners[kv], prompt, continuation, max_model_len), ref)
    report = {"machine": machine, "model": Path(args.model).name, "dtype": args.dtype,
              "prompts": len(prompts), "new_tokens": args.new_tokens,
              "logit_scale": scale, "kv": {}}
    print(f"largest |logit| of the reference: {scale:.2f}")
    print(f"{'kv dtype':<10}{'B/token':>8}{'tok/GiB':>11}{'disk tok/GiB':>13}"
          f"{'max |dlogit|':>13}{'mean':>8}{'argmax same':>12}{'greedy same':>12}"
          f"{'tokens to 1st diff':>19}{'decode tok/s':>13}")
    for kv, r in runners.items():
        c = compared.get(kv)
        firsts = [first_difference(g, ref) for g, ref in zip(generated[kv], reference)]
        same = sum(f == args.new_tokens for f in firsts)
        rate = len(prompts) * (args.new_tokens - 1) / seconds[kv]
        figures = {"bytes_per_token": r.bytes_per_token,
                   "tokens_per_gib": GIB / r.bytes_per_token,
                   "disk_tokens_per_gib": GIB / r.disk_bytes_per_token,
                   "greedy_same_prompts": same,
                   "mean_tokens_to_first_difference": sum(firsts) / len(firsts),
                   "decode_tok_s": rate}
        if c is not None:
            figures |= {"max_logit_diff": c.max_diff, "mean_logit_diff": c.sum_diff / c.num_logits,
                        "argmax_agreement": c.agree / c.positions}
        report["kv"][kv] = figures
        logit_cols = (f"{c.max_diff:>13.3f}{c.sum_diff / c.num_logits:>8.4f}"
                      f"{c.agree / c.positions:>12.2%}" if c else f"{'-':>13}{'-':>8}{'-':>12}")
        print(f"{kv:<10}{r.bytes_per_token:>8.0f}{GIB / r.bytes_per_token:>11,.0f}"
              f"{GIB / r.disk_bytes_per_token:>13,.0f}{logit_cols}"
              f"{same:>7}/{len(prompts):<4}{sum(firsts) / len(firsts):>19.1f}{rate:>13.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
