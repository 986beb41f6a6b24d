"""Why a prompt missed, against the real engine (`deepinfer-run serve`, one rank, the tiny
model, a device tier of 32 blocks): the `x-deepinfer-cache` header of a JSON answer and of
a stream (and the stream's closing comment) for a new prompt, its repeat and, after other
prompts took its blocks, its eviction; the counter on /metrics; the scheduler's
request_done line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.e2e_helpers import Served

pytestmark = pytest.mark.slow

BLOCK_BYTES = 16 * 2 * 8 * 4 * 64 * 4  # 16 tokens of float32 K and V, 8 layers, 4 heads of 64
PROMPT = list(range(200, 350))  # 150 tokens: 9 cacheable blocks, 6 tokens of remainder


@pytest.fixture(scope="module")
def served(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    engine = Served(default_model, tmp_path_factory.mktemp("miss") / "run", nproc=1,
                    extra_args=["--kv-cache-memory", str(32 * BLOCK_BYTES),
                                "--max-model-len", "512"])
    yield engine
    assert engine.stop() == 0, engine.log()[-3000:]


def report(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


def complete(url: str, prompt: list[int], **body) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                         **body})
    assert r.status_code == 200, r.text
    return r


def test_new_repeated_then_evicted(served) -> None:
    first = report(complete(served.url, PROMPT).headers["x-deepinfer-cache"])
    assert first == {"cached": "0", "recomputed": "150", "reason": "new", "new": "144",
                     "block_remainder": "6"}
    again = report(complete(served.url, PROMPT).headers["x-deepinfer-cache"])
    assert again == {"cached": "144", "recomputed": "6", "reason": "block_remainder",
                     "block_remainder": "6"}
    for i in range(3):  # 10 blocks each: the 32-block device tier reuses PROMPT's
        complete(served.url, list(range(1000 + 200 * i, 1150 + 200 * i)))
    r = complete(served.url, PROMPT, stream=True)
    header = r.headers["x-deepinfer-cache"]
    evicted = report(header)
    # the LRU took the blocks tail first: what is left of the head still hits
    assert evicted["reason"] == "evicted" and int(evicted["cached"]) < 144
    assert int(evicted["cached"]) + int(evicted["evicted"]) == 144
    assert (evicted["evicted_tier"], evicted["evicted_by"]) == ("device", "admission")
    assert f": x-deepinfer-cache: {header}" in r.text.split("\n")

    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("deepinfer_prompt_tokens_unc")}
    assert samples['deepinfer_prompt_tokens_uncached_total{reason="new"}'] == 144 + 3 * 144
    assert samples['deepinfer_prompt_tokens_uncached_total{reason="evicted"}'] == \
        int(evicted["evicted"])
    assert samples['deepinfer_prompt_tokens_uncached_total{reason="diverged"}'] == 0

    done = [json.loads(line) for line in served.log().splitlines()
            if '"request_done"' in line and '"miss_reason"' in line]  # the scheduler's
    assert [d["miss_reason"] for d in done] == ["new", "block_remainder", "new", "new", "new",
                                                "evicted"]
    last = done[-1]
    assert last["miss_reason"] == "evicted" and last["evicted_tier"] == "device"
    assert last["uncached_evicted"] == int(evicted["evicted"])
