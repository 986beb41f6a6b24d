"""TTFT of a resumed long session: served from the disk tier after a restart, against
recomputed from scratch. The real scheduler and model, in process.

    python -m tools.benchmarks.disk                         # 50K tokens, a 64K-context model
    python -m tools.benchmarks.disk --context-tokens 8000 --model models/tiny-llama

By default it first makes (once, deterministically: tools/tiny_models/make.py) a tiny
random Llama with a 64K context, small enough that a 50K-token prefill runs on a CPU in
minutes: 2 layers, hidden 128, 2 query heads, 1 KV head of 64 (1 KiB of float32 KV per
token). Three engines on the same disk directory, one after the other:
  1. cold: computes the session (its 50K prompt tokens), writing the blocks through to
     disk;
  2. restarted on the same directory: the session resumed with a new turn (64 tokens);
     its prefix is found on disk (warm restart) and read back;
  3. restarted with the disk tier off: the same resumed request, recomputed.
Each engine runs a short warm-up request first, so no figure pays for first calls.
Prints the machine (tools/benchmarks/machine.py), TTFT (one output token) and the disk's read and
write bandwidth as measured, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from scheduler.engine import EngineCore, agree_limits, restore_disk
from scheduler.scheduler import Scheduler
from tools.benchmarks import machine
from tools.tiny_models.make import make_tiny_model
from wire.client import GenerateRequest
from wire.config import EngineConfig
from worker.inprocess import InProcessExecutor

REPO = Path(__file__).resolve().parents[2]
# the 64K-context model this benchmark makes (outside models/, which may be shared)
LONG_MODEL = Path(tempfile.gettempdir()) / "deepinfer-tiny-llama-64k"
LONG_SPEC = dict(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                 intermediate_size=256, max_position_embeddings=65536, dtype="float32")


def long_model(out: Path = LONG_MODEL) -> Path:
    """The 64K-context tiny Llama (made once; the same bytes every time: seed 0, the
    tiny model's tokenizer copied)."""
    return make_tiny_model(out, "llama", 0, tokenizer_from=REPO / "models" / "tiny-llama",
                           quiet=True, **LONG_SPEC)


def kv_bytes_per_token(model: str, dtype: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = 4 if dtype == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * elem


def engine(config: EngineConfig) -> EngineCore:
    executor = InProcessExecutor(config)
    ready = executor.start()
    core = EngineCore(Scheduler(config, agree_limits(ready)), executor)
    restore_disk(core.scheduler, ready)
    return core


def ttft(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, int, float]:
    """Seconds to the first output token, the prompt tokens the disk served, and the
    seconds until its disk reads were all in (0 without reads)."""
    core.scheduler.add_request(GenerateRequest(rid, prompt, 1, ignore_eos=True))
    t0 = time.perf_counter()
    disk, reads_s, was_reading = 0, 0.0, False
    while core.has_work():
        for out in core.step().outputs:
            disk = max(disk, out.num_disk_cached_tokens)
        seq = core.scheduler.sequence(rid)
        reading = seq is not None and core.scheduler.cache.reading(seq.seq_id)
        if was_reading and not reading and not reads_s:
            reads_s = time.perf_counter() - t0
        was_reading |= reading
    return time.perf_counter() - t0, disk, reads_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"default: the 64K-context tiny model, made at {LONG_MODEL}")
    p.add_argument("--context-tokens", type=int, default=50_000)
    p.add_argument("--new-turn-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--disk-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    model = args.model or str(long_model())
    n = args.context_tokens
    rng = random.Random(0)
    session = [rng.randrange(10, 8000) for _ in range(n)]
    resumed = session + [rng.randrange(10, 8000) for _ in range(args.new_turn_tokens)]
    warmup = [rng.randrange(10, 8000) for _ in range(64)]
    per_token = kv_bytes_per_token(model, args.dtype)
    total = len(resumed) + 64
    tiers = dict(kv_cache_memory=max(64 << 20, 2 * total * per_token),
                 host_cache_memory=max(32 << 20, 2 * total * per_token),
                 kv_write_policy="write_through", max_model_len=total,
                 max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    info = machine.describe(measure=True)
    print(machine.summary_line(info), flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-disk-") as tmp:
        disk_dir = args.disk_dir or str(Path(tmp) / "disk")
        with_disk = EngineConfig(model=model, disk_cache_dir=disk_dir,
                                 disk_cache_size=4 * total * per_token + (64 << 20), **tiers)
        cold = engine(with_disk)
        ttft(cold, "warmup", warmup)
        cold_s, _, _ = ttft(cold, "cold", session)
        store = cold.executor.runner.disk.store
        store.flush()
        written, write_s = store.stats.bytes_written, store.stats.write_s
        cold.executor.shutdown()

        warm = engine(with_disk)  # a restarted engine: same model, same directory
        found = warm.scheduler.cache.disk.num_found_at_start
        ttft(warm, "warmup", warmup)
        disk_s, disk_tokens, reads_s = ttft(warm, "resumed", resumed)
        rstore = warm.executor.runner.disk.store
        read, read_s = rstore.stats.bytes_read, rstore.stats.read_s
        warm.executor.shutdown()

        plain = engine(EngineConfig(model=model, **tiers))  # restarted, no disk tier
        ttft(plain, "warmup", warmup)
        recompute_s, _, _ = ttft(plain, "recomputed", resumed)
        plain.executor.shutdown()

    print(f"session of {n:,} tokens resumed with {args.new_turn_tokens} new, {model}, "
          f"{args.dtype}, {per_token} B of KV per token, CPU")
    print(f"  cold (the session's first)   TTFT {cold_s:8.3f} s")
    print(f"  after restart, from disk     TTFT {disk_s:8.3f} s   ({disk_tokens:,} tokens "
          f"from disk, {found} blocks found at start-up)")
    print(f"    of which the disk reads    {reads_s:8.3f} s   (then the swap-in and the new "
          f"turn's prefill)")
    print(f"  after restart, recomputed    TTFT {recompute_s:8.3f} s")
    print(f"  speed-up from disk           {recompute_s / disk_s:8.1f}x")
    print(f"  disk read  {read / max(reads_s, 1e-9) / 1e9:6.2f} GB/s while reading "
          f"({read / 1e6:.1f} MB; {read_s * 1e3:.1f} ms summed over the reader threads; "
          "page cache warm)")
    print(f"  disk write {written / max(write_s, 1e-9) / 1e9:6.2f} GB/s ({written / 1e6:.1f} MB "
          f"in {write_s * 1e3:.1f} ms, background thread)")
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(at the start: {info['load_avg_1m']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
