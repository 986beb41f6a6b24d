"""The engine started as the README says (`deepinfer-run serve`, 4 ranks on gloo) over HTTP.

Covers: /v1/completions stream and non-stream, text and token-id prompts, greedy
output equal to HF transformers, bad inputs answered with OpenAI-shaped 400s while
the engine keeps serving, kill -9 of a rank stopping everything with a log line
naming it, and Ctrl-C leaving no process or socket behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import Served, alive, complete, stream_complete, wait_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    engine = Served(default_model, tmp_path_factory.mktemp("serve") / "run")
    pids = engine.pids()
    yield engine
    # Ctrl-C leaves nothing behind: exit 0, every child gone, run dir and sockets removed.
    assert engine.stop(signal.SIGINT) == 0, engine.log()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in pids.items() if alive(p)], "processes left behind"
    assert not engine.run_dir.exists(), "run directory (and its ipc sockets) left behind"


def test_the_scheduler_runs_under_sched_batch_and_the_ranks_do_not(served):
    # wire/cpu_policy.py: its wake-ups must not preempt a rank feeding the device
    logged = [json.loads(line) for line in served.log().splitlines()
              if '"cpu_policy"' in line and line.startswith("{")]
    assert logged, "the scheduler did not log its CPU policy"
    if not logged[-1]["sched_batch"]:
        pytest.skip("this sandbox refuses SCHED_BATCH")
    pids = served.pids()

    def policies(pid: int) -> list[int]:
        found = []
        for tid in os.listdir(f"/proc/{pid}/task"):  # every thread of it
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                found.append(os.sched_getscheduler(int(tid)))
        return found

    assert set(policies(pids["scheduler"])) == {os.SCHED_BATCH}
    ranks = [p for name, p in pids.items() if name.startswith("rank")]
    assert ranks and all(set(policies(p)) == {os.SCHED_OTHER} for p in ranks)


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_token_prompt_greedy_equals_hf_stream_and_not(served, default_model):
    prompt = [17, 423, 1200, 77, 5000, 31, 8, 999, 2500, 64, 3100]
    ref = hf_greedy(default_model, prompt, 16)
    body = dict(prompt=prompt, max_tokens=16, temperature=0, ignore_eos=True)
    out = complete(served.url, **body)
    assert out["choices"][0]["token_ids"] == ref
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == 16
    text, ids, _ = stream_complete(served.url, **body)
    assert ids == ref
    assert text == out["choices"][0]["text"]


def test_text_prompt_and_cached_tokens(served):
    prompt = "def fibonacci(n):\n    " * 4
    first = complete(served.url, prompt=prompt, max_tokens=8, temperature=0)
    again = complete(served.url, prompt=prompt, max_tokens=8, temperature=0)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 16 * 16 > 0


def test_concurrent_requests_match_sequential(served):
    prompts = [[(i * 37 + j * 11) % 8000 + 10 for j in range(5 + 13 * i)] for i in range(8)]
    body = dict(max_tokens=10, temperature=0, ignore_eos=True)
    alone = [complete(served.url, prompt=p, **body)["choices"][0]["token_ids"] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(
            lambda p: complete(served.url, prompt=p, **body)["choices"][0]["token_ids"], prompts))
    assert together == alone


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "JSON"),
    (json.dumps({"prompt": 5, "max_tokens": 4}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"prompt": [1, 2, 8192], "max_tokens": 4}).encode(), "8192"),
    (json.dumps({"prompt": [5] * 9000, "max_tokens": 4}).encode(), "maximum context length"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
])
def test_bad_input_is_a_400_and_the_engine_keeps_serving(served, body, fragment):
    r = httpx.post(f"{served.url}/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    ok = complete(served.url, prompt="hello", max_tokens=3, temperature=0)
    assert ok["usage"]["completion_tokens"] >= 1


def test_kill_9_of_a_rank_stops_the_engine(default_model, tmp_path):
    engine = Served(default_model, tmp_path / "run")
    pids = engine.pids()
    os.kill(pids["rank 2"], signal.SIGKILL)
    code = engine.proc.wait(timeout=30)
    assert code != 0
    events = [json.loads(line) for line in engine.log().splitlines() if line.startswith("{")]
    exits = [e for e in events if e.get("event") == "child_exited"]
    assert exits and exits[0]["process"] == "rank 2" and "SIGKILL" in exits[0]["status"]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in pids.items() if alive(p)]
    assert not engine.run_dir.exists()


def test_workers_started_by_torchrun(default_model, tmp_path):
    """The launcher runs scheduler and shim; torchrun starts the two ranks."""
    run_dir = tmp_path / "run"
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", "2",
         "--external-workers", "--run-dir", str(run_dir), "serve", "--model", str(default_model),
         "--port", str(port), "--dtype", "float32"],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (run_dir / "addresses.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    workers_addr = json.loads((run_dir / "addresses.json").read_text())["workers"]
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "worker.main", "--scheduler", workers_addr],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s=120)
        out = complete(url, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(out["choices"][0]["token_ids"]) == 4
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
        torchrun.wait(timeout=30)  # ranks exit on the scheduler's shutdown message


def test_metrics_expose_the_prefix_cache(served):
    prompt = "class Cache:\n    def get(self, key):\n        return self.d[key]\n" * 3
    for _ in range(2):
        complete(served.url, prompt=prompt, max_tokens=2, temperature=0)
    r = httpx.get(f"{served.url}/metrics", timeout=10)
    assert r.status_code == 200
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['deepinfer_prefix_cache_hit_tokens_total{tier="device"}'] > 0
    assert samples["deepinfer_prefix_cache_queried_tokens_total"] > 0
    assert samples['deepinfer_kv_blocks{state="capacity",tier="device"}'] > 0
    assert samples["deepinfer_steps_total"] > 0
