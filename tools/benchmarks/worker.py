"""Worker-rank microbenchmark: prefill, decode and all-reduce speed at each world size.

    python -m tools.benchmarks.worker --model models/tiny-llama --world-sizes 1,2,4 --json out.json
    python -m tools.benchmarks.worker --model models/bench-1b --world-sizes 1 --device cuda \
        --dtype bfloat16 --batch-sizes 1,16,64 --shared-prefix-len 4096

For each world size the parent starts that many rank processes of this module,
torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free loopback
port), each with cores / ranks torch threads. Every rank builds a `ModelRunner`
(by default float32, CPU, torch attention, gloo; `--device cuda` takes the GPU of
its local rank, NCCL and FlashInfer) and applies the same hand-made step plans,
so the figures are the worker alone: no scheduler, no sockets. Each timed part
has a warm-up first and a barrier on both sides, and runs `--repeats` times; the
fastest run is reported, since other load on the machine only ever slows a run.
Rank 0 prints its figures as one JSON line after a marker; the parent parses that
line (nothing is pickled) and prints a table.

Prefill is also reported as achieved TFLOP/s: 2 x the linear layers' parameters per
token, plus causal attention (QK and PV: 2 x heads x head_dim x n(n+1) a layer for an
n-token prompt, however it is chunked), plus the LM head on the sampled row. With
`--shared-prefix-len P`, decode is measured a second time with every sequence of the
batch reading the same P cached tokens first (one prefix prefilled once, its blocks at
the head of every block table, as the prefix cache shares them).

Decode feeds fixed token ids instead of the sampled ones: sampling still runs on
rank 0, but no token is broadcast back, as the scheduler would do in a real step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.config import repo_env
from orchestrator.launcher import free_port
from tools.benchmarks.machine import describe
from tools.benchmarks.model_flops import num_parameters, prefill_flop
from tools.benchmarks.worker_report import BLOCK_SIZE, BenchArgs, add_shares, print_table

REPO = Path(__file__).resolve().parents[2]
MARKER = "DEEPINFER_BENCH_WORKER "
# --- one rank ---------------------------------------------------------------------


class RankBench:
    """Drives one rank's ModelRunner with plans that every rank builds identically."""

    def __init__(self, args: BenchArgs) -> None:
        from wire.config import EngineConfig
        from worker.distributed import (
            RankInfo,
            init_tensor_parallel,
            resolve_device,
            set_torch_threads,
        )
        from worker.model_runner import ModelRunner

        self.args = args
        info = RankInfo.from_env()
        self.threads = set_torch_threads(info.local_world_size)
        self.device = resolve_device(args.device, info.local_rank)
        self.tp = init_tensor_parallel(info, self.device)
        # the device tier holds exactly what the benchmark runs, so the context served is
        # the longest sequence it runs (a rank refuses a context its tier cannot hold)
        longest = max(args.prompt_len, args.shared_prefix_len + args.decode_len)
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                              world_size=info.world_size, max_model_len=longest,
                              attention_backend=args.attention_backend, seed=args.seed)
        bs = config.block_size
        assert bs == BLOCK_SIZE, "shared_prefix_len is checked against BLOCK_SIZE"
        blocks = max(-(-max(args.prompt_len, args.shared_prefix_len) // bs),
                     args.shared_prefix_len // bs
                     + max(args.batch_sizes) * -(-args.decode_len // bs))
        self.runner = ModelRunner(config, self.tp, self.device, num_device_blocks=blocks)
        self.block_size = bs
        self.step = 0
        self.next_seq = 0
        self.rng = random.Random(args.seed)  # the same token ids on every rank

    def token(self) -> int:
        return self.rng.randrange(16, self.runner.vocab_size)  # past the special tokens

    def barrier(self) -> None:
        if self.tp.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def timed(self, fn: Callable[[], None]) -> float:
        self.barrier()
        t0 = time.perf_counter()
        fn()
        self.barrier()
        return time.perf_counter() - t0

    def execute(self, **plan: object) -> None:
        from wire.step import StepPlan

        self.runner.execute(StepPlan(step=self.step, **plan))
        self.step += 1

    def open(self, lengths: list[int], prefix_blocks: int = 0) -> list[int]:
        """Open sequences with block tables for `lengths` tokens after `prefix_blocks`
        shared blocks (ids 0..prefix_blocks-1, at the head of every table); the other
        block ids restart after them."""
        from wire.step import NewSequence

        seqs, next_block = [], prefix_blocks
        for n in lengths:
            num_blocks = -(-n // self.block_size)
            seqs.append(NewSequence(self.next_seq, list(range(prefix_blocks))
                                    + list(range(next_block, next_block + num_blocks))))
            next_block += num_blocks
            self.next_seq += 1
        self.execute(new_seqs=seqs)
        return [s.seq_id for s in seqs]

    def close(self, seq_ids: list[int]) -> None:
        self.execute(close=seq_ids)

    # --- the measurements ------------------------------------------------------------

    def prefill_s(self, chunk: int) -> float:
        """Seconds to prefill one prompt_len-token prompt in chunks of `chunk` tokens."""
        from wire.step import ScheduledChunk

        n = self.args.prompt_len
        prompt = [self.token() for _ in range(n)]
        [seq] = self.open([n])

        def run() -> None:
            for start in range(0, n, chunk):
                part = prompt[start : start + chunk]
                self.execute(chunks=[ScheduledChunk(seq, part, start, start + chunk >= n)])

        dt = self.timed(run)
        self.close([seq])
        return dt

    def prefill_prefix(self, n: int) -> int:
        """Untimed: prefill an n-token prefix into blocks 0..n/block_size-1 and close its
        sequence; its KV stays there for the block tables that share it."""
        from wire.step import ScheduledChunk

        if n == 0:
            return 0
        [seq] = self.open([n])
        tokens = [self.token() for _ in range(n)]
        for start in range(0, n, self.args.chunk):
            part = tokens[start : start + self.args.chunk]
            self.execute(chunks=[ScheduledChunk(seq, part, start, start + len(part) >= n)])
        self.close([seq])
        return n // self.block_size

    def decode_s(self, batch: int, prefix_len: int = 0) -> list[float]:
        """Seconds for decode_steps steps of `batch` sequences (one plan a step), per repeat;
        with `prefix_len`, each sequence's context starts with the same cached prefix."""
        from wire.step import ScheduledChunk

        a = self.args
        seqs = self.open([a.decode_len] * batch, self.prefill_prefix(prefix_len))
        # Untimed: the short prompts, all in one plan (after the prefix: a prefill over
        # cached context).
        p = prefix_len + a.decode_prompt_len
        self.execute(chunks=[ScheduledChunk(s, [self.token() for _ in range(a.decode_prompt_len)],
                                            prefix_len, True) for s in seqs])
        tokens = [self.token() for _ in seqs]

        def steps(first: int, count: int) -> None:
            for pos in range(first, first + count):
                self.execute(chunks=[ScheduledChunk(s, [t], pos, True)
                                     for s, t in zip(seqs, tokens)])

        steps(p, a.warmup_steps)
        first = p + a.warmup_steps
        times = [self.timed(lambda r=r: steps(first + r * a.decode_steps, a.decode_steps))
                 for r in range(a.repeats)]
        self.close(seqs)
        return times

    def all_reduce_us(self, rows: int) -> float:
        """Mean microseconds per all-reduce of a [rows, hidden] tensor of the model's dtype."""
        import torch

        # Zeros stay zeros under summation (no denormals, no infs), and the
        # collectives' speed does not depend on the values.
        x = torch.zeros(rows, self.runner.model_config.hidden_size, dtype=self.runner.dtype,
                        device=self.device)
        iters = max(10, min(300, (30 << 20) // x.nbytes))
        for _ in range(5):
            self.tp.all_reduce(x)

        def run() -> None:
            for _ in range(iters):
                self.tp.all_reduce(x)

        return min(self.timed(run) for _ in range(self.args.repeats)) / iters * 1e6

    def run(self) -> dict:
        a = self.args
        # wall-clock timing needs the GPU idle at both ends; ModelRunner.execute
        # synchronizes at the end of every step
        prefill: dict[str, float] = {}
        for label, chunk in (("one_chunk", a.prompt_len), ("chunked", a.chunk)):
            self.prefill_s(chunk)  # warm-up
            prefill[label] = a.prompt_len / min(self.prefill_s(chunk) for _ in range(a.repeats))
        decode: dict[str, float] = {}
        decode_prefix: dict[str, float] = {}
        for b in a.batch_sizes:  # decode_s warms up itself
            decode[str(b)] = b * a.decode_steps / min(self.decode_s(b))
            if a.shared_prefix_len:
                decode_prefix[str(b)] = (b * a.decode_steps
                                         / min(self.decode_s(b, a.shared_prefix_len)))
        all_reduce: dict[str, float] = {}
        if self.tp.world_size > 1:
            for rows in sorted({1, *a.batch_sizes, a.chunk, a.prompt_len}):
                all_reduce[str(rows)] = self.all_reduce_us(rows)
        mc = self.runner.model_config
        flops = prefill_flop(mc, a.prompt_len)
        return {
            "world_size": self.tp.world_size,
            "threads_per_rank": self.threads,
            "device": str(self.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "attention_backend": type(self.runner.attn).__name__,
            "hidden_size": mc.hidden_size,
            "num_layers": mc.num_layers,
            "num_parameters": num_parameters(mc),
            # the embedding, then attention and MLP outputs of every layer
            "all_reduces_per_forward": 2 * mc.num_layers + 1,
            "prefill_tok_s": prefill,
            "prefill_flop": flops,
            "prefill_tflop_s": {k: flops * v / a.prompt_len / 1e12 for k, v in prefill.items()},
            "decode_tok_s": decode,
            "decode_prefix_tok_s": decode_prefix,
            "all_reduce_us": all_reduce,
        }


def rank_main(args: BenchArgs) -> None:
    bench = RankBench(args)
    result = bench.run()
    if bench.tp.rank == 0:
        print(MARKER + json.dumps(result), flush=True)
    if bench.tp.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


# --- the parent ---------------------------------------------------------------------


def run_world(args: BenchArgs, world_size: int, timeout: float,
              module: str = "tools.benchmarks.worker") -> dict:
    """Start `world_size` ranks (`python -m module --rank-args ...`: this module's, or one
    that prints its result after the same MARKER), wait for all, return rank 0's result."""
    port = free_port()
    env = repo_env()
    cmd = [sys.executable, "-m", module, "--rank-args", args.to_json()]
    procs, logs = [], []
    for r in range(world_size):
        # Files, not pipes: a rank blocked on a full pipe would stall the collectives.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err,
                                      text=True))
        logs.append((out, err))
    deadline = time.monotonic() + timeout
    failed: str | None = None
    bad = 0
    try:
        # One rank dying leaves the others waiting on it: stop at the first failure.
        while True:
            codes = [p.poll() for p in procs]
            dead = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if dead:
                bad = dead[0]
                failed = f"rank {bad} exited {codes[bad]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f}s"
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # the ranks left waiting on a dead peer
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    if failed:
        raise RuntimeError(f"world size {world_size}: {failed}; rank {bad} stderr:\n"
                           f"{texts[bad][1][-3000:]}")
    for line in texts[0][0].splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"world size {world_size}: rank 0 printed no result; stderr:\n"
                       f"{texts[0][1][-3000:]}")


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of our reaped children); Linux."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tick = os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq) / tick,
            children.ru_utime + children.ru_stime)


def timed_world(args: BenchArgs, world_size: int, timeout: float) -> dict:
    """run_world, plus how many cores other processes kept busy meanwhile (noise)."""
    t0, c0 = time.monotonic(), cpu_seconds()
    run = run_world(args, world_size, timeout)
    c1 = cpu_seconds()
    if c0 and c1:
        other = (c1[0] - c0[0]) - (c1[1] - c0[1])
        run["other_load_cores"] = max(0.0, other / (time.monotonic() - t0))
    return run


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--world-sizes", type=ints, default=(1, 2, 4))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--attention-backend", default="auto",
                    choices=["auto", "torch", "flashinfer"])
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512, help="chunk size of the chunked prefill")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch-sizes", type=ints, default=(1, 16))
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="also decode behind this many cached tokens shared by the batch "
                         f"(a multiple of {BLOCK_SIZE})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--rank-args", help=argparse.SUPPRESS)  # internal: run as one rank
    ns = ap.parse_args(argv)
    if ns.rank_args:
        rank_main(BenchArgs.from_json(ns.rank_args))
        return

    from tqdm import tqdm

    try:
        args = BenchArgs(model=str(Path(ns.model).resolve()), device=ns.device,
                         dtype=ns.dtype, attention_backend=ns.attention_backend,
                         prompt_len=ns.prompt_len, chunk=ns.chunk,
                         decode_prompt_len=ns.decode_prompt_len,
                         decode_steps=ns.decode_steps, batch_sizes=ns.batch_sizes,
                         shared_prefix_len=ns.shared_prefix_len, repeats=ns.repeats)
    except ValueError as e:
        ap.error(str(e))
    machine = describe(measure=False)
    command = " ".join(["python -m tools.benchmarks.worker", *(argv if argv is not None
                                                          else sys.argv[1:])])
    cores = machine["cores"] or 1
    print(f"machine: {cores} cores ({machine['cpu']}), torch {machine['torch']}, "
          f"python {machine['python']}; threads per rank: "
          + ", ".join(f"{max(1, cores // w)} at {w}" for w in ns.world_sizes)
          + f"; load average {machine['load_avg_1m']:.2f}")
    if machine["load_avg_1m"] > 0.5:
        print("warning: the machine is busy; figures will be noisy", file=sys.stderr)
    runs = []
    for w in tqdm(ns.world_sizes, desc="world sizes", unit="run"):
        try:
            run = timed_world(args, w, ns.timeout)
        except RuntimeError as e:
            sys.exit(f"bench_worker: {e}")
        add_shares(run, args)
        runs.append(run)
    print_table(runs, args)
    if ns.json:
        ns.json.write_text(json.dumps({"machine": machine, "args": dataclasses.asdict(args),
                                       "command": command, "runs": runs}, indent=2))
        print(f"wrote {ns.json}")


if __name__ == "__main__":
    main()
