"""The engine's forward against HF transformers on the same model, side by side in one run.

    python -m tools.benchmarks.vs_hf [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--batch-sizes 1,16,64] [--prompt-len 2000] [--json OUT]

Both read the same checkpoint (a GGUF is dequantized by each), in float32 by default,
with all of the machine's cores, one after the other:

- DeepInfer: one rank's `ModelRunner` driven by tools/benchmarks/worker.py's plans (no
  scheduler, no sockets): a `--prompt-len`-token prefill in one chunk, then decode at each
  batch size (`--decode-prompt-len` tokens of context per sequence, `--decode-steps`
  steps after warm-up);
- HF transformers: the same shapes through `model(...)` with its KV cache, in a process
  of its own (`--hf-args`, internal), greedy inputs fixed as in bench_worker.

Each part runs `--repeats` times and the fastest run is reported. Printed beside the
figures: the CPU, its flags, the threads, the measured matmul and copy rates, and each
figure as a share of its limit (prefill: model FLOPs against the float32 matmul rate;
decode at batch 1: the weights read once a step against the copy rate).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.config import DEFAULT_MODEL, repo_env
from tools.benchmarks.machine import describe, summary_line
from tools.benchmarks.model_flops import linear_parameters, prefill_flop
from tools.benchmarks.worker import timed_world
from tools.benchmarks.worker_report import BenchArgs

MARKER = "DEEPINFER_BENCH_HF "


def hf_main(args: BenchArgs) -> None:
    """In its own process: transformers on the same shapes; prints one JSON line."""
    import torch
    import transformers

    model_path = Path(args.model)
    kwargs = ({"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {})
    source = model_path.parent if model_path.suffix == ".gguf" else model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, args.dtype), **kwargs).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = lambda *shape: torch.randint(16, vocab, shape, generator=gen)  # noqa: E731

    def step(ids_: torch.Tensor, cache=None):
        return model(ids_, past_key_values=cache, use_cache=True).past_key_values

    def prefill_seconds(prompt: torch.Tensor) -> float:
        t0 = time.perf_counter()
        step(prompt)
        return time.perf_counter() - t0

    def decode_seconds(context: torch.Tensor, step_ids: torch.Tensor) -> float:
        cache = step(context)
        for _ in range(args.warmup_steps):
            cache = step(step_ids, cache)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            cache = step(step_ids, cache)
        return time.perf_counter() - t0

    runs = range(args.repeats + 1)  # the first is a warm-up; the fastest is reported
    with torch.inference_mode():
        prompt = ids(1, args.prompt_len)
        prefill = args.prompt_len / min(prefill_seconds(prompt) for _ in runs)
        decode = {}
        for batch in args.batch_sizes:
            context, step_ids = ids(batch, args.decode_prompt_len), ids(batch, 1)
            seconds = min(decode_seconds(context, step_ids) for _ in runs)
            decode[str(batch)] = batch * args.decode_steps / seconds
    print(MARKER + json.dumps({"prefill_tok_s": prefill, "decode_tok_s": decode,
                               "threads": torch.get_num_threads()}), flush=True)


def run_hf(args: BenchArgs, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.vs_hf", "--hf-args", args.to_json()],
        capture_output=True, text=True, timeout=timeout, env=repo_env())
    for line in out.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"transformers run failed ({out.returncode}):\n{out.stderr[-3000:]}")


def limits(args: BenchArgs, machine: dict) -> dict:
    """The machine's roofs for this model: prefill tok/s at the float32 matmul rate, and
    decode steps/s at the copy rate (every linear weight and the LM head read once)."""
    from worker.gguf import load_config

    mc = load_config(args.model)
    bytes_per_weight = 2 if args.dtype in ("bfloat16", "float16") else 4
    rate = machine["matmul_gflop_s"]["bfloat16" if bytes_per_weight == 2 else "float32"] * 1e9
    weights = (linear_parameters(mc) + mc.vocab_size * mc.hidden_size) * bytes_per_weight
    return {"prefill_tok_s": rate * args.prompt_len / prefill_flop(mc, args.prompt_len),
            "decode_steps_s": machine["copy_gb_s"] * 1e9 / weights,
            "weights_bytes": weights}


def print_report(args: BenchArgs, ours: dict, hf: dict, roof: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(args.model).name}, {args.dtype}: {args.prompt_len}-token "
                        f"prefill; decode at {args.decode_prompt_len} tokens of context")
    table.add_column("engine")
    table.add_column("prefill tok/s", justify="right")
    for b in args.batch_sizes:
        table.add_column(f"decode tok/s b={b}", justify="right")
    rows = {"DeepInfer (1 rank)": ours, "HF transformers": hf}
    for name, r in rows.items():
        table.add_row(name, f"{r['prefill_tok_s']:,.0f}",
                      *(f"{r['decode_tok_s'][str(b)]:,.1f}" for b in args.batch_sizes))
    table.add_row("DeepInfer / HF", f"{ours['prefill_tok_s'] / hf['prefill_tok_s']:.2f}x",
                  *(f"{ours['decode_tok_s'][str(b)] / hf['decode_tok_s'][str(b)]:.2f}x"
                    for b in args.batch_sizes))
    table.add_row("machine limit", f"{roof['prefill_tok_s']:,.0f}",
                  f"{roof['decode_steps_s']:,.1f}", *([""] * (len(args.batch_sizes) - 1)))
    table.add_row("DeepInfer / limit",
                  f"{ours['prefill_tok_s'] / roof['prefill_tok_s']:.0%}",
                  f"{ours['decode_tok_s']['1'] / roof['decode_steps_s']:.0%}"
                  if "1" in ours["decode_tok_s"] else "",
                  *([""] * (len(args.batch_sizes) - 1)))
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print("machine limit: prefill at the measured matmul rate in model FLOPs; decode "
                  f"at batch 1: {roof['weights_bytes'] / 1e6:,.0f} MB of weights read once "
                  "a step at the measured copy rate")


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--batch-sizes", type=ints, default=(1, 16, 64))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per engine")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--hf-args", help=argparse.SUPPRESS)  # internal: the transformers side
    ns = ap.parse_args(argv)
    if ns.hf_args:
        hf_main(BenchArgs.from_json(ns.hf_args))
        return

    from tqdm import tqdm

    args = BenchArgs(model=str(Path(ns.model).resolve()), dtype=ns.dtype,
                     prompt_len=ns.prompt_len, chunk=ns.prompt_len,
                     decode_prompt_len=ns.decode_prompt_len, decode_steps=ns.decode_steps,
                     batch_sizes=ns.batch_sizes, repeats=ns.repeats)
    machine = describe()  # this process's threads: all cores, as each engine gets
    print(summary_line(machine))
    results = {}
    for name in tqdm(["deepinfer", "transformers"], desc="engines", unit="engine"):
        if name == "deepinfer":
            run = timed_world(args, 1, ns.timeout)
            results[name] = {"prefill_tok_s": run["prefill_tok_s"]["one_chunk"],
                             "decode_tok_s": run["decode_tok_s"],
                             "threads": run["threads_per_rank"]}
        else:
            results[name] = run_hf(args, ns.timeout)
    roof = limits(args, machine)
    print_report(args, results["deepinfer"], results["transformers"], roof)
    if ns.json:
        command = " ".join(["python -m tools.benchmarks.vs_hf",
                            *(argv if argv is not None else sys.argv[1:])])
        ns.json.write_text(json.dumps({"machine": machine, "command": command,
                                       "args": vars(ns), "limits": roof, **results},
                                      indent=2, default=str))
        print(f"wrote {ns.json}")


if __name__ == "__main__":
    main()
