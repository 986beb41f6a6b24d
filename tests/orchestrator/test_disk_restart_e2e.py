"""The disk tier end to end (`deepinfer-run --restart 1 serve`, 2 ranks on gloo): a
session's prefix is a cache hit right after the engine group was killed and restarted
by the launcher, and the usage and the metrics say how much of it the disk served."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from tests.orchestrator.e2e_helpers import complete
from tests.orchestrator.test_faults_e2e import poll_until_healthy
from tests.tools.engine import Engine

pytestmark = pytest.mark.slow
BLOCK_BYTES_TINY = 8 * 2 * 16 * 4 * 64 * 4  # layers * K/V * block * kv heads * head_dim * fp32


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_a_session_hits_the_disk_right_after_restart(default_model, tmp_path):
    disk = tmp_path / "disk"
    engine = Engine(default_model, tmp_path / "run", "--dtype", "float32",
                    "--host-cache-memory", str(32 * BLOCK_BYTES_TINY),
                    "--kv-write-policy", "write_through",
                    "--disk-cache-dir", str(disk),
                    "--disk-cache-size", str(256 * BLOCK_BYTES_TINY),
                    nproc=2, launcher_args=["--restart", "1"])
    try:
        rng = random.Random(5)
        prompt = [rng.randrange(10, 8000) for _ in range(200)]
        ask = lambda: complete(engine.url, prompt=prompt, max_tokens=8,  # noqa: E731
                               temperature=0, ignore_eos=True)
        first = ask()
        time.sleep(1.0)  # the ranks' background writes land (no step waits for them)
        old = engine.pids()
        os.kill(old["rank 1"], signal.SIGKILL)
        poll_until_healthy(engine.url, timeout_s=90)
        started, restored = engine.events("disk_tier_restored")  # the start, the restart
        assert started["blocks_found_after_restart"] == 0
        assert restored["blocks_found_after_restart"] >= 12  # the prompt's 12 full blocks

        again = ask()
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        details = again["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == details["cached_tokens_disk"] == 192
        assert metric(engine.url, 'deepinfer_prefix_cache_hit_tokens_total{tier="disk"}') == 192
        assert metric(engine.url, "deepinfer_disk_blocks_found_after_restart") >= 12
        assert os.stat(disk).st_mode & 0o777 == 0o700
        # deepinfer-inspect cache shows the third tier: its hits, blocks and counters
        status, view = engine.inspect_json("cache")
        assert status == 0 and view["num_disk_hit_tokens"] == 192
        assert view["usage"]["disk"]["cached"] >= 12
        assert view["disk"]["found_after_restart"] >= 12
        status, text = engine.inspect("cache")
        assert status == 0 and "disk tier since start" in text and "found after restart" in text
    finally:
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]


def test_disk_cache_dir_alone_serves_with_a_disk_tier(default_model, tmp_path):
    """`deepinfer-run serve --disk-cache-dir DIR` and no other tier flag: the launcher
    sizes the disk tier from the free space at DIR and the host tier that feeds it from
    the free RAM, says so in its log, and a request's blocks reach the disk."""
    disk = tmp_path / "disk"
    engine = Engine(default_model, tmp_path / "run", "--disk-cache-dir", str(disk), nproc=1)
    try:
        sized = {e["event"]: e for e in engine.events("disk_tier_sized")
                 + engine.events("host_tier_sized")}
        disk_bytes = sized["disk_tier_sized"]["bytes_per_rank"]
        host_bytes = sized["host_tier_sized"]["bytes_per_rank"]
        assert disk_bytes > 0 and host_bytes > 0
        assert sized["disk_tier_sized"]["share"] > 0 and sized["host_tier_sized"]["share"] > 0
        (restored,) = engine.events("disk_tier_restored")
        assert restored["disk_blocks"] > 0

        rng = random.Random(7)
        complete(engine.url, prompt=[rng.randrange(10, 8000) for _ in range(100)],
                 max_tokens=4, temperature=0, ignore_eos=True)
        # write-through (the default with a disk tier): the prompt's 6 full blocks are
        # written in the background and committed once the rank reports them
        engine.wait_for("the prompt's blocks written to disk", lambda: metric(
            engine.url, 'deepinfer_disk_bytes_total{direction="written"}') >= 6 * BLOCK_BYTES_TINY)
        status, view = engine.inspect_json("cache")
        assert status == 0 and view["disk"]["committed_writes"] >= 6
        assert os.path.getsize(disk / "rank0.kv") <= disk_bytes
        assert os.stat(disk).st_mode & 0o777 == 0o700
    finally:
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]
