"""TTFT of a resumed long session: served from the disk tier after a restart, against
recomputed from scratch (issue 18). The real scheduler and model, in process.

    python -m tools.bench_disk --context-tokens 8000      # the tiny model allows 8K

Three engines on the same disk directory, one after the other:
  1. cold: computes the session's prompt (and writes its blocks through to disk);
  2. restarted, the same directory: the prompt's prefix is found on disk (warm restart);
  3. restarted with the disk tier off: the prompt is recomputed.
Each engine runs a short warm-up request first, so no figure pays for first calls.
Prints TTFT (one output token) and the disk's read and write bandwidth as measured.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from scheduler.engine import EngineCore, agree_limits, restore_disk
from scheduler.scheduler import Scheduler
from wire.client import GenerateRequest
from wire.config import EngineConfig
from worker.inprocess import InProcessExecutor

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"


def engine(config: EngineConfig) -> EngineCore:
    executor = InProcessExecutor(config)
    ready = executor.start()
    core = EngineCore(Scheduler(config, agree_limits(ready)), executor)
    restore_disk(core.scheduler, ready)
    return core


def ttft(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first output token, and the prompt tokens the disk served."""
    core.scheduler.add_request(GenerateRequest(rid, prompt, 1, ignore_eos=True))
    t0 = time.perf_counter()
    disk = 0
    while core.has_work():
        for out in core.step().outputs:
            disk = max(disk, out.num_disk_cached_tokens)
    return time.perf_counter() - t0, disk


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--context-tokens", type=int, default=8000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--disk-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    n = args.context_tokens
    rng = random.Random(0)
    prompt = [rng.randrange(10, 8000) for _ in range(n)]
    warmup = [rng.randrange(10, 8000) for _ in range(64)]
    bytes_per_token = 8 * 2 * 4 * 64 * 4  # tiny model, float32: a guide for the budgets
    tiers = dict(kv_cache_memory=max(64 << 20, 2 * n * bytes_per_token),
                 host_cache_memory=max(32 << 20, 2 * n * bytes_per_token),
                 kv_write_policy="write_through", max_model_len=n + 64,
                 max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-disk-") as tmp:
        disk_dir = args.disk_dir or str(Path(tmp) / "disk")
        with_disk = EngineConfig(model=args.model, disk_cache_dir=disk_dir,
                                 disk_cache_size=4 * n * bytes_per_token + (64 << 20), **tiers)
        cold = engine(with_disk)
        ttft(cold, "warmup", warmup)
        cold_s, _ = ttft(cold, "cold", prompt)
        store = cold.executor.runner.disk.store
        store.flush()
        written, write_s = store.stats.bytes_written, store.stats.write_s
        cold.executor.shutdown()

        warm = engine(with_disk)  # a restarted engine: same model, same directory
        found = warm.scheduler.cache.disk.num_found_at_start
        ttft(warm, "warmup", warmup)
        disk_s, disk_tokens = ttft(warm, "resumed", prompt)
        rstore = warm.executor.runner.disk.store
        read, read_s = rstore.stats.bytes_read, rstore.stats.read_s
        warm.executor.shutdown()

        plain = engine(EngineConfig(model=args.model, **tiers))  # restarted, no disk tier
        ttft(plain, "warmup", warmup)
        recompute_s, _ = ttft(plain, "recomputed", prompt)
        plain.executor.shutdown()

    print(f"session of {n:,} prompt tokens, {args.model}, {args.dtype}, CPU")
    print(f"  cold (first time)            TTFT {cold_s:8.3f} s")
    print(f"  after restart, from disk     TTFT {disk_s:8.3f} s   ({disk_tokens:,} tokens "
          f"from disk, {found} blocks found at start-up)")
    print(f"  after restart, recomputed    TTFT {recompute_s:8.3f} s")
    print(f"  speed-up from disk           {recompute_s / disk_s:8.1f}x")
    print(f"  disk read  {read / max(read_s, 1e-9) / 1e9:6.2f} GB/s ({read / 1e6:.1f} MB in "
          f"{read_s * 1e3:.1f} ms, page cache warm)")
    print(f"  disk write {written / max(write_s, 1e-9) / 1e9:6.2f} GB/s ({written / 1e6:.1f} MB "
          f"in {write_s * 1e3:.1f} ms, background thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
