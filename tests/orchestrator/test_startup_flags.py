"""Every flag of `deepinfer-run` and of `deepinfer-run serve` started the way a user starts
it: the launcher in a subprocess, with the flag on its command line.

`--speculative-config` once shipped broken because tests built its config in-process only,
and `--disk-cache-dir DIR` alone was refused although the README documents it so. Hence
ROWS: each row is some flags, as typed, and a probe, one request that shows them at work
(the spec counters move, a request without the key is refused, the disk tier is written).
Rows of the same launch share one engine (a start costs seconds on 2 cores): it is started
with their flags together, each probe runs in turn, and it must stop cleanly (exit 0).

`test_every_flag_is_started` reads the option strings from the real parsers
(`orchestrator.launcher.build_parser`) and every `--flag` the README and docs/ name, and
holds that each deepinfer-run flag is in a row, is started by one of the tests in ELSEWHERE
(two nodes; ranks from torchrun), or is one of the few EXCEPTIONS; a documented flag that is
no deepinfer-run flag must be defined or passed by the project's other commands (or be a
THIRD_PARTY one).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from tokenizers import Tokenizer

from orchestrator.launcher import build_parser
from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.test_security_e2e import listening_addresses
from tests.scheduler.kv_event_subscriber import Subscriber
from tools import inspector
from tools.harness.served import wait_healthy
from tools.inspection.client import load_engine
from wire import codec
from wire.config import CONFIG_FILE, EngineConfig
from wire.control import SnapshotRequest, TierRequest
from wire.control_server import ask

KEY = "startup-operator-key-0123"
TENANTS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}
TINY = "models/tiny-llama"  # as a user types it, from the repository's root
MIB = 1 << 20
# tiny-llama's KV bytes per token and rank in float32: K and V, 8 layers, 4 KV heads of 64
KV_BYTES_PER_TOKEN = 2 * 8 * 4 * 64 * 4
# ... and in FP8: a byte an element, a float32 scale per head
FP8_KV_BYTES_PER_TOKEN = 2 * 8 * 4 * (64 + 4)


class Launched:
    """One `deepinfer-run` started from a launch's rows; its output goes to a file."""

    def __init__(self, argv: list[str], values: dict[str, str], tmp: Path) -> None:
        self.values = values
        self.port = int(values["port"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.log_path = tmp / "launcher.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=subprocess_env(), stdout=log,
                                         stderr=subprocess.STDOUT)

    def client(self, key: str | None = KEY, timeout_s: float = 60) -> httpx.Client:
        headers = {"x-api-key": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def post(self, path: str, body: dict[str, Any], key: str | None = KEY,
             **headers: str) -> httpx.Response:
        with self.client(key) as c:
            return c.post(path, json=body, headers=headers)

    def complete(self, **body: Any) -> dict[str, Any]:
        r = self.post("/v1/completions", {"model": "m", **body})
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str, **labels: str) -> float:
        """One /metrics sample by its name and (some of) its labels."""
        with self.client() as c:
            text = c.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    return s.value
        raise AssertionError(f"no sample {name}{labels} in /metrics")

    def labels_of(self, name: str) -> dict[str, str]:
        with self.client() as c:
            text = c.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name:
                    return s.labels
        raise AssertionError(f"no sample {name} in /metrics")

    def log(self) -> str:
        return self.log_path.read_text()

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = [line for line in self.log().splitlines() if line.startswith("{")]
        return [e for e in map(json.loads, lines) if e.get("event") == name]

    def run_dir(self) -> Path:
        return Path(self.events("engine_started")[0]["run_dir"])

    def config(self) -> EngineConfig:
        """The EngineConfig the launcher handed to every process (the run directory's
        codec frame)."""
        return codec.read_file(self.run_dir() / CONFIG_FILE, EngineConfig)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = 30) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"{what}: not within {timeout_s:g}s")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9


@dataclass(frozen=True)
class Row:
    """Flags as typed after `deepinfer-run` (`launcher`) and after `serve` (`serve`);
    {port}, {master_port}, {events_port}, {replay_port} and {tmp} are filled in at launch
    ({tmp}/key and {tmp}/tenants are written first). `probe` is the request that shows
    them at work."""

    launch: str
    serve: tuple[str, ...]
    probe: Callable[[Launched], None]
    launcher: tuple[str, ...] = ()

    @property
    def flags(self) -> set[str]:
        return {a for a in (*self.launcher, *self.serve) if a.startswith("--")}

    def __str__(self) -> str:
        return " ".join(("deepinfer-run", *self.launcher, "serve", *self.serve))


# --- probes: the agent launch (one rank, the shim's options) ------------------------


def serves(e: Launched) -> None:
    out = e.complete(prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, ignore_eos=True)
    assert len(out["choices"][0]["token_ids"]) == 4


def kv_memory_is_the_budget(e: Launched) -> None:
    """--kv-cache-memory bytes of float32 KV (--dtype float32), in 16-token blocks."""
    blocks = 32 * MIB // (16 * KV_BYTES_PER_TOKEN)
    assert e.labels_of("vllm:cache_config_info")["num_gpu_blocks"] == str(blocks)


def listens_on_loopback(e: Launched) -> None:
    assert listening_addresses(e.port) == ["0100007F"]  # 127.0.0.1, little-endian


def key_is_required(e: Launched) -> None:
    with e.client(key=None) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def tenants_do_not_share_blocks(e: Launched) -> None:
    prompt = list(range(200, 264))  # 4 full blocks

    def cached(tenant: str) -> int:
        r = e.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1},
                   key=TENANTS[tenant])
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") == 48  # its own blocks, all but the last (which runs)
    assert cached("bob") == 0


def model_names_are_listed(e: Launched) -> None:
    with e.client() as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert ids == ["tiny-llama", "claude-sonnet-4-5"]
    assert e.complete(prompt="hi", max_tokens=1)["model"] == "tiny-llama"


def output_is_capped(e: Launched) -> None:
    out = e.complete(prompt="hi", max_tokens=100, ignore_eos=True)
    assert len(out["choices"][0]["token_ids"]) == 16


def host_tier_is_written_through(e: Launched) -> None:
    """write_through: every block is copied to the host tier once written; under
    write_back only an eviction copies one."""
    e.complete(prompt=list(range(300, 364)), max_tokens=1)
    e.wait_for("more blocks copied to the host tier than evicted",
               lambda: e.metric("deepinfer_kv_swap_out_blocks_total")
               >= 4 + e.metric("deepinfer_kv_evictions_total", tier="device"))


GET_TIME = {"name": "get_time", "description": "the time",
            "input_schema": {"type": "object", "properties": {}}}


def qwen3_coder_calls(e: Launched) -> None:
    body = {"model": "m", "max_tokens": 100, "tools": [GET_TIME],
            "tool_choice": {"type": "tool", "name": "get_time"},
            "messages": [{"role": "user", "content": "What time is it?"}]}
    rendered = e.post("/v1/messages/render", body)
    assert rendered.status_code == 200, rendered.text
    tokenizer = Tokenizer.from_file(str(REPO / TINY / "tokenizer.json"))
    prompt = tokenizer.decode(rendered.json()["token_ids"], skip_special_tokens=False)
    assert prompt.rstrip().endswith("<function=get_time>"), prompt[-80:]  # Qwen3-Coder's form
    r = e.post("/v1/messages", body)
    assert r.status_code == 200, r.text
    assert [(b["type"], b.get("name")) for b in r.json()["content"]] == [("tool_use", "get_time")]


def thinking_is_capped(e: Launched) -> None:
    """A prompt that opens <think> (a prefill here): the span is reasoning, cut at 3."""
    r = e.post("/v1/chat/completions", {"model": "m", "max_tokens": 12, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    assert out["choices"][0]["message"]["reasoning_content"]


def self_check_passed(e: Launched) -> None:
    """/health answered only once the gate passed, on a 512-token document."""
    assert [s["doc_tokens"] for s in e.events("self_check_started")] == [512]
    assert len(e.events("self_check_passed")) == 1


def big_body_is_413(e: Launched) -> None:
    r = e.post("/v1/completions", {"model": "m", "prompt": "a" * 70_000, "max_tokens": 1})
    assert r.status_code == 413, r.text


def chat(n_messages: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 1, **extra,
            "messages": [{"role": "user", "content": "hi"}] * n_messages}


def many_tools_are_400(e: Launched) -> None:
    tools = [{**GET_TIME, "name": f"t{i}"} for i in range(3)]
    r = e.post("/v1/messages", chat(tools=tools))
    assert r.status_code == 400 and "tools" in r.text, r.text
    assert e.post("/v1/messages", chat(tools=tools[:2])).status_code == 200


def many_messages_are_400(e: Launched) -> None:
    r = e.post("/v1/messages", chat(5))
    assert r.status_code == 400 and "messages" in r.text, r.text


def big_headers_are_431(e: Launched) -> None:
    with e.client() as c:
        assert c.get("/v1/models", headers={"x-padding": "a" * 9000}).status_code == 431


def images_are_refused(e: Launched) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    r = e.post("/v1/messages", {"model": "m", "max_tokens": 1,
                                "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "--on-image reject" in r.text, r.text


def billing_header_is_rendered(e: Launched) -> None:
    """`--billing-header keep`: Claude Code's per-session header is counted as prompt."""
    def count(system: list[dict[str, str]]) -> int:
        r = e.post("/v1/messages/count_tokens", {
            "model": "m", "system": system, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    prompt = {"type": "text", "text": "You are a coding agent."}
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"}
    assert count([header, prompt]) > count([prompt])


# --- probes: the engine launch (two ranks, the cache and the engine's options) -------


def two_ranks_in_the_run_dir(e: Launched) -> None:
    engine = json.loads((e.tmp / "run" / "engine.json").read_text())
    assert engine["world_size"] == 2
    assert {p["name"] for p in engine["processes"]} >= {"scheduler", "rank 0", "rank 1"}
    serves(e)


def rendezvous_on_the_master_port(e: Launched) -> None:
    assert listening_addresses(int(e.values["master_port"])), "nothing listens there"


def blocks_and_tiers_as_asked(e: Launched) -> None:
    """32-token blocks; 32 MiB and 16 MiB per rank, each rank holding 2 of the 4 KV heads."""
    block_bytes = 32 * KV_BYTES_PER_TOKEN // 2
    labels = e.labels_of("vllm:cache_config_info")
    assert labels["block_size"] == "32"
    assert labels["num_gpu_blocks"] == str(32 * MIB // block_bytes)
    assert labels["num_cpu_blocks"] == str(16 * MIB // block_bytes)


def disk_is_written_and_a_full_queue_drops(e: Launched) -> None:
    """Four blocks reach the disk tier at once: the writer takes one a second
    (--disk-write-bytes-per-s, one block's bytes) and queues one more; the rest drop."""
    e.complete(prompt=list(range(400, 528)), max_tokens=1)
    e.wait_for("a block written to disk", lambda: disk_written(e) > 0)
    assert e.metric("deepinfer_disk_dropped_writes_total") > 0
    assert {p.name for p in (e.tmp / "disk").glob("rank*.kv")} == {"rank0.kv", "rank1.kv"}


def disk_written(e: Launched) -> float:
    """Disk bytes written, as the ranks last reported: they report in their step results,
    so a one-token request first (an idle engine's figures stay as they were)."""
    e.complete(prompt=[1], max_tokens=1)
    return e.metric("deepinfer_disk_bytes_total", direction="written")


def router_gets_kv_events(e: Launched) -> None:
    sub = Subscriber(f"tcp://127.0.0.1:{e.values['events_port']}",
                     f"tcp://127.0.0.1:{e.values['replay_port']}")
    try:
        prompt = list(range(600, 664))  # 2 full blocks
        e.complete(prompt=prompt, max_tokens=1)
        sub.replay(0)
        assert sub.num_events["AllBlocksCleared"] == 1
        stored = {tuple(t) for (medium, _), t in sub.stored_tokens.items() if medium == "GPU"}
        assert tuple(prompt[:32]) in stored and tuple(prompt[32:]) in stored
    finally:
        sub.close()


def retained_share_is_capped(e: Launched) -> None:
    """A marked prompt of 40 blocks: a quarter of the 128-block device tier is retained."""
    e.complete(prompt=list(range(1000, 2280)), max_tokens=1,
               cache_control={"type": "ephemeral"})
    retained = e.metric("deepinfer_kv_blocks", tier="device", state="retained")
    assert 0 < retained <= 128 // 4


def turns_are_not_retained(e: Launched) -> None:
    """--session-ttl 0: a finished turn's blocks are plain LRU (by default, retained for
    the agent's next turn: `turns_are_retained_by_default`)."""
    assert e.config().session_ttl_s == 0
    e.complete(prompt=list(range(1000, 1064)), max_tokens=1)
    assert e.metric("deepinfer_kv_blocks", tier="device", state="retained") == 0
    assert e.metric("deepinfer_kv_blocks", tier="device", state="cached") >= 4


def turns_are_retained_by_default(e: Launched) -> None:
    assert e.config().session_ttl_s == 90
    e.complete(prompt=list(range(3000, 3064)), max_tokens=1)
    assert e.metric("deepinfer_kv_blocks", tier="device", state="retained") >= 4


def long_prompt_is_400(e: Launched) -> None:
    r = e.post("/v1/completions", {"model": "m", "prompt": [7] * 2100, "max_tokens": 1})
    assert r.status_code == 400 and "2048" in r.text, r.text


def engine_options_reach_every_process(e: Launched) -> None:
    """Options with nothing to see from outside in a short run: the config every process
    got, and a request served under them (a failing full check stops the engine)."""
    config = e.config()
    assert (config.full_cache_check_every, config.step_timeout_s, config.seed,
            config.attention_backend, config.async_scheduling) == (1, 60, 7, "torch", False)
    serves(e)


def ranks_run_as_told(e: Launched) -> None:
    ready = e.events("worker_ready")
    assert sorted((r["rank"], r["threads"], r["step_channel"]) for r in ready) == [
        (0, 1, "zmq"), (1, 1, "zmq")]


def a_dead_rank_is_restarted(e: Launched) -> None:
    engine = json.loads((e.tmp / "run" / "engine.json").read_text())
    rank1 = next(p["pid"] for p in engine["processes"] if p["name"] == "rank 1")
    os.kill(rank1, signal.SIGKILL)
    e.wait_for("engine_restarted", lambda: e.events("engine_restarted"), timeout_s=120)
    wait_healthy(e.url, timeout_s=120)
    serves(e)


# --- probes: the null-model launch (the queue's bounds, deadlines, no cache) ---------


def null_model_sleeps_and_ignores_sampling(e: Launched) -> None:
    """Each forward sleeps 200 ms (the tiny model's take a few ms); its tokens depend on
    the input alone, even sampled (the model's would differ: each sequence its seed)."""
    started = time.monotonic()
    runs = [e.complete(prompt=[9, 10, 11], max_tokens=5, temperature=1.0)["choices"][0]
            for _ in range(2)]
    assert time.monotonic() - started >= 2 * 5 * 0.2
    assert runs[0]["token_ids"] == runs[1]["token_ids"]


def nothing_is_cached(e: Launched) -> None:
    prompt = list(range(100, 164))
    for _ in range(2):
        out = e.complete(prompt=prompt, max_tokens=1)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def deadline_is_408(e: Launched) -> None:
    # 20 s of 200 ms steps: only the deadline answers 408 (the status, not a clock, says so)
    r = e.post("/v1/completions", {"model": "m", "prompt": [5], "max_tokens": 100,
                                   "ignore_eos": True})
    assert r.status_code == 408, r.text


def prefill_is_chunked(e: Launched) -> None:
    e.complete(prompt=list(range(700, 800)), max_tokens=1)
    status, text = inspector_json(e, "trace", "--steps", "20")
    assert status == 0, text
    chunks = [c for plan in json.loads(text)["plans"] for c in plan["chunks"]]
    seq = max(c["seq_id"] for c in chunks)
    prefill = [c["num_tokens"] for c in chunks if c["seq_id"] == seq and c["start_pos"] < 100]
    assert sum(prefill) == 100 and max(prefill) <= 32 and len(prefill) == math.ceil(100 / 32)


def prefills_start_one_after_another(e: Launched) -> None:
    """--prefill-pack-tokens 8: three 10-token prompts waiting together start in three
    steps, one each (the default, 512, would pack all three into one)."""
    assert e.config().prefill_pack_tokens == 8
    with ThreadPoolExecutor(4) as pool:  # a running request keeps the 200 ms steps going
        running = pool.submit(e.complete, prompt=[9], max_tokens=30, ignore_eos=True)
        time.sleep(1.0)
        prompts = [list(range(900 + 20 * i, 910 + 20 * i)) for i in range(3)]
        for done in [pool.submit(e.complete, prompt=p, max_tokens=1) for p in prompts]:
            done.result()
        running.result()
    status, text = inspector_json(e, "trace", "--steps", "60")
    assert status == 0, text
    starts = [plan["step"] for plan in json.loads(text)["plans"] for c in plan["chunks"]
              if c["start_pos"] == 0 and c["num_tokens"] == 10]
    assert len(starts) == 3 and len(set(starts)) == 3, starts


def inspector_json(e: Launched, *args: str) -> tuple[int, str]:
    """`deepinfer-inspect --run-dir RUN --json ARGS...`: (exit status, output)."""
    out = StringIO()
    status = inspector.main(["--run-dir", str(e.run_dir()), "--json", *args],
                            console=Console(file=out, width=120, color_system=None))
    return status, out.getvalue()


def queue_is_bounded(e: Launched) -> None:
    """One sequence runs (--max-num-seqs 1); the queue holds 2 requests and 64 prompt
    tokens at most; past either bound a request is refused at once (429)."""

    async def run() -> None:
        long = {"x-request-timeout": "60"}  # longer than the server's 2 s
        async with httpx.AsyncClient(base_url=e.url, timeout=60,
                                     headers={"x-api-key": KEY, **long}) as c:
            async def count(name: str) -> float:
                text = (await c.get("/metrics")).text
                return next(s.value for f in text_string_to_metric_families(text)
                            for s in f.samples if s.name == name)

            async def until(name: str, value: int) -> None:
                for _ in range(200):
                    if await count(name) == value:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{name} never reached {value}")

            def send(prompt: list[int]) -> asyncio.Task:
                return asyncio.create_task(c.post("/v1/completions", json={
                    "model": "m", "prompt": prompt, "max_tokens": 200, "ignore_eos": True}))

            async def refused(prompt: list[int], why: str) -> None:
                try:  # a refusal is at once; an accepted request would take minutes
                    r = await asyncio.wait_for(send(prompt), timeout=10)
                except TimeoutError:
                    raise AssertionError(f"{len(prompt)} tokens queued, not refused") from None
                assert r.status_code == 429 and why in r.text, r.text

            held = [send([1, 2, 3])]
            await until("deepinfer_num_requests_running", 1)
            held.append(send(list(range(10, 50))))  # 40 tokens wait
            await until("deepinfer_num_requests_waiting", 1)
            assert await count("deepinfer_num_requests_running") == 1
            await refused(list(range(60, 100)), "prompt tokens")  # 80 tokens would wait
            held.append(send([4, 5, 6]))
            await until("deepinfer_num_requests_waiting", 2)
            await refused([7, 8, 9], "2 waiting")
            for task in held:  # the client leaves: each request is aborted
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(run())
    e.wait_for("the queue emptied",
               lambda: e.metric("deepinfer_num_requests_running") == 0
               and e.metric("deepinfer_num_requests_waiting") == 0)


# --- probes: speculation, the disk tier alone ----------------------------------------


def drafts_are_made(e: Launched) -> None:
    """The tiny model's greedy answer to this prompt falls into a loop (one token over and
    over) after three tokens: prompt lookup drafts the loop's next tokens from its start."""
    out = e.complete(prompt=[100] * 24, max_tokens=24, temperature=0, ignore_eos=True)
    assert len(out["choices"][0]["token_ids"]) == 24
    assert e.metric("deepinfer_spec_draft_tokens_total") > 0
    assert e.metric("deepinfer_spec_accepted_tokens_total") > 0


def kv_is_fp8(e: Launched) -> None:
    """--kv-cache-dtype fp8: the 32 MiB device tier holds 3.76x float32's blocks, and a
    prompt sent again is a prefix hit that answers the same tokens."""
    assert e.config().kv_cache_dtype == "fp8"
    blocks = 32 * MIB // (16 * FP8_KV_BYTES_PER_TOKEN)
    assert e.labels_of("vllm:cache_config_info")["num_gpu_blocks"] == str(blocks)
    prompt = list(range(900, 964))  # 4 full blocks
    outs = [e.complete(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
            for _ in range(2)]
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert outs[0]["choices"][0]["token_ids"] == outs[1]["choices"][0]["token_ids"]


def hybrid_hits_end_at_its_snapshots(e: Launched) -> None:
    """A hybrid model (Qwen3.5) with --state-snapshot-interval 2: a prompt sent again hits up
    to its last full block, where a snapshot is; one that shares only the first 3 blocks
    hits 2, the last multiple of the interval (the linear layers' state is kept there and
    at a sequence's last block boundary only), and both answer as a cold engine would
    (the first request's own answer for the repeat)."""
    assert e.config().state_snapshot_interval == 2
    prompt = list(range(700, 772))  # 4 full blocks and 8 tokens
    outs = [e.complete(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
            for _ in range(2)]
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert outs[0]["choices"][0]["token_ids"] == outs[1]["choices"][0]["token_ids"]
    other = e.complete(prompt=prompt[:56] + list(range(300, 320)), max_tokens=1)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def hybrid_interval_is_sized_from_the_bytes(e: Launched) -> None:
    """The same model with --state-snapshot-interval auto: the rank snapshots every 8 blocks
    (one snapshot, 116,736 bytes in float32, is worth 7.1 KV blocks of 16,384), logs why,
    and the scheduler plans there: a prompt sent again hits its last full block; one that
    shares its first 8 blocks and a half hits 8 (the interval's snapshot); one that shares
    7 and a half hits nothing (at 4 blocks it would hit 4)."""
    assert e.config().state_snapshot_interval == 0  # auto
    (chosen,) = e.events("state_snapshot_interval")
    assert (chosen["blocks"], chosen["auto"], chosen["state_bytes_per_slot"],
            chosen["kv_bytes_per_block"]) == (8, True, 116_736, 16_384)
    assert e.events("kv_cache_budget")[0]["state_snapshot_interval"] == 8
    prompt = list(range(700, 852))  # 9 full blocks and 8 tokens
    outs = [e.complete(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
            for _ in range(2)]
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 144
    assert outs[0]["choices"][0]["token_ids"] == outs[1]["choices"][0]["token_ids"]
    for shared, cached in ((120, 0), (136, 128)):
        other = e.complete(prompt=prompt[:shared] + list(range(300, 340)), max_tokens=1)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, shared


def state_slots_are_observed(e: Launched) -> None:
    """A hybrid model's state slots in /metrics, per tier like the KV blocks, and in
    `deepinfer-inspect check`, which compares every rank's state tables (device, host and
    disk snapshots) with the scheduler's and counts them in its verdict."""
    e.complete(prompt=list(range(600, 672)), max_tokens=2)
    assert e.metric("deepinfer_state_slots", tier="device", state="cached") > 0
    for tier in ("host", "disk"):
        assert e.metric("deepinfer_state_slots", tier=tier, state="capacity") > 0
    status, text = inspector_json(e, "check")
    assert status == 0, text
    entries = json.loads(text)["state_entries"]
    assert set(entries) == {"scheduler", "rank 0"}, entries
    assert entries["rank 0"] == entries["scheduler"] and entries["scheduler"]["state"] > 0
    out = StringIO()
    assert inspector.main(["--run-dir", str(e.run_dir()), "check"],
                          console=Console(file=out, width=80, color_system=None)) == 0
    assert "state snapshots:" in out.getvalue() and "host_state" in out.getvalue()
    status, text = inspector_json(e, "cache")
    assert status == 0 and json.loads(text)["state_usage"]["device"]["cached"] > 0, text
    # what `check` reads slot by slot when a table's digest differs: the same on both sides
    named = load_engine(e.run_dir()).named()
    slots = ask(named["rank 0"], SnapshotRequest(), 10).state_slots
    assert slots == ask(named["scheduler"], SnapshotRequest(), 10).state_slots
    tables = [ask(named[p], TierRequest("state", 0, slots["state"]), 10).hashes
              for p in ("scheduler", "rank 0")]
    assert tables[0] == tables[1] and len(tables[0]) == slots["state"] and any(tables[0])


def disk_is_written(e: Launched) -> None:
    e.complete(prompt=list(range(800, 864)), max_tokens=1)
    e.wait_for("a block written to disk", lambda: disk_written(e) > 0)
    assert (e.tmp / "disk" / "rank0.kv").is_file()


def a_request_in_flight_goes_on(e: Launched) -> None:
    """--restart with --resume-timeout: a stream in flight when the rank dies pauses and
    goes on from the restarted engine, with the undisturbed run's tokens."""
    body = {"model": "m", "prompt": list(range(900, 940)), "max_tokens": 150,
            "temperature": 0, "ignore_eos": True}
    want = e.complete(**body)["choices"][0]["token_ids"]
    got: list[int] = []
    killed = False
    with e.client() as c, c.stream("POST", "/v1/completions",
                                   json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                got += event["choices"][0]["token_ids"]
                if len(got) >= 8 and not killed:
                    procs = json.loads((e.run_dir() / "engine.json").read_text())["processes"]
                    os.kill(next(p["pid"] for p in procs if p["name"] == "rank 0"),
                            signal.SIGKILL)
                    killed = True
    assert killed and got == want
    assert e.metric("deepinfer_requests_resumed_total") == 1


# --- the table ------------------------------------------------------------------------

SMALL = ("--kv-cache-memory", str(32 * MIB), "--max-model-len", "1024")
BASE = ("--model", TINY, "--port", "{port}", "--dtype", "float32", "--device", "cpu", *SMALL)

ROWS = [
    Row("agent", BASE, serves),
    Row("agent", (), kv_memory_is_the_budget),  # BASE's --kv-cache-memory and --dtype
    Row("agent", ("--host", "127.0.0.1"), listens_on_loopback),
    Row("agent", ("--api-key", KEY), key_is_required),
    Row("agent", ("--cache-salt-per-api-key", "{tmp}/tenants"), tenants_do_not_share_blocks),
    Row("agent", ("--served-model-name", "tiny-llama", "claude-sonnet-4-5"),
        model_names_are_listed),
    Row("agent", ("--max-output-tokens", "16"), output_is_capped),
    Row("agent", ("--host-cache-memory", str(16 * MIB), "--kv-write-policy", "write_through"),
        host_tier_is_written_through),
    Row("agent", ("--tool-call-parser", "qwen3_coder"), qwen3_coder_calls),
    Row("agent", ("--reasoning-parser", "think", "--max-thinking-tokens", "3"),
        thinking_is_capped),
    Row("agent", ("--self-check", "--self-check-tokens", "512"), self_check_passed),
    Row("agent", ("--max-request-bytes", "65536"), big_body_is_413),
    Row("agent", ("--max-tools", "2"), many_tools_are_400),
    Row("agent", ("--max-messages", "4"), many_messages_are_400),
    Row("agent", ("--max-header-bytes", "8192"), big_headers_are_431),
    Row("agent", ("--on-image", "reject"), images_are_refused),
    Row("agent", ("--billing-header", "keep"), billing_header_is_rendered),

    Row("engine", ("--model", TINY, "--port", "{port}", "--dtype", "float32"),
        two_ranks_in_the_run_dir, launcher=("--nproc-per-node", "2", "--run-dir", "{tmp}/run")),
    Row("engine", (), rendezvous_on_the_master_port, launcher=("--master-port", "{master_port}")),
    Row("engine", ("--api-key-file", "{tmp}/key"), key_is_required),
    Row("engine", ("--block-size", "32", "--kv-cache-memory", str(32 * MIB),
                   "--host-cache-memory", str(16 * MIB)), blocks_and_tiers_as_asked),
    Row("engine", ("--disk-cache-dir", "{tmp}/disk", "--disk-cache-size", str(16 * MIB),
                   "--disk-max-queued-writes", "1",
                   "--disk-write-bytes-per-s", str(32 * KV_BYTES_PER_TOKEN // 2)),
        disk_is_written_and_a_full_queue_drops),
    Row("engine", ("--kv-events-endpoint", "{events_port}",
                   "--kv-events-replay-endpoint", "{replay_port}"), router_gets_kv_events),
    Row("engine", ("--max-model-len", "2048", "--max-retained-fraction", "0.25"),
        retained_share_is_capped),
    Row("engine", (), long_prompt_is_400),  # the --max-model-len above
    Row("engine", (), turns_are_retained_by_default),
    Row("engine", ("--full-cache-check-every", "1", "--step-timeout", "60", "--seed", "7",
                   "--attention-backend", "torch", "--no-async-scheduling"),
        engine_options_reach_every_process),
    Row("engine", ("--torch-threads", "1", "--step-channel", "zmq"), ranks_run_as_told),
    Row("engine", (), a_dead_rank_is_restarted, launcher=("--restart", "1")),

    Row("null-model", ("--model", TINY, "--port", "{port}", "--null-model-forward-ms", "200"),
        null_model_sleeps_and_ignores_sampling),
    Row("null-model", ("--no-prefix-caching",), nothing_is_cached),
    Row("null-model", ("--request-timeout", "2"), deadline_is_408),
    Row("null-model", ("--max-num-batched-tokens", "32"), prefill_is_chunked),
    # A launch of its own: the one above runs one sequence at a time (--max-num-seqs 1)
    Row("prefill-pack", ("--model", TINY, "--port", "{port}", "--null-model-forward-ms", "200",
                         "--prefill-pack-tokens", "8"), prefills_start_one_after_another),
    Row("null-model", ("--max-num-seqs", "1", "--max-queued-requests", "2",
                       "--max-queued-tokens", "64"), queue_is_bounded),

    # As a user types it; it crashed the scheduler at start (the config's codec gave it a
    # dict), which no in-process test could see.
    Row("speculative", (*BASE, "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4}'), drafts_are_made),
    Row("speculative", ("--session-ttl", "0"), turns_are_not_retained),
    # The directory alone: the disk tier's size and the host tier that feeds it take
    # their defaults (it was refused, asking for --disk-cache-size and --host-cache-memory).
    Row("disk-dir-alone", (*BASE, "--disk-cache-dir", "{tmp}/disk"), disk_is_written),
    # A launch of its own: a continuation re-reads its prompt and output as a prefill,
    # which gives the decode's tokens where the KV is exact (not with FP8 KV, above).
    Row("restart", BASE, a_request_in_flight_goes_on,
        launcher=("--restart", "1", "--resume-timeout", "60")),
    Row("disk-dir-alone", ("--kv-cache-dtype", "fp8"), kv_is_fp8),
    Row("hybrid", ("--model", "models/tiny-qwen3-5", "--port", "{port}", "--dtype", "float32",
                   "--device", "cpu", *SMALL, "--state-snapshot-interval", "2"),
        hybrid_hits_end_at_its_snapshots),
    # `auto`, the default, as typed: the ranks choose the interval (the row above: a count)
    Row("hybrid-auto", ("--model", "models/tiny-qwen3-5", "--port", "{port}", "--dtype",
                        "float32", "--device", "cpu", *SMALL, "--state-snapshot-interval",
                        "auto"), hybrid_interval_is_sized_from_the_bytes),
    Row("hybrid", ("--host-cache-memory", str(16 * MIB), "--disk-cache-dir", "{tmp}/disk",
                   "--disk-cache-size", str(16 * MIB)), state_slots_are_observed),
]
LAUNCHES = list(dict.fromkeys(row.launch for row in ROWS))

# Flags started through deepinfer-run by another test (its function's source names each).
ELSEWHERE = {
    "tests.orchestrator.test_security_e2e:test_two_nodes_talk_over_curve_and_nobody_else_does":
        ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--secret-file",
         "--nproc-per-node"),
    "tests.orchestrator.test_serve_e2e:test_workers_started_by_torchrun": ("--external-workers",),
}
# Flags no row starts, and why.
EXCEPTIONS = {
    "-h": "prints the help and exits: nothing to serve",
    "--help": "prints the help and exits: nothing to serve",
    "--gpu-memory-utilization": "CUDA only (a profiling pass on the GPU); a CPU ignores it",
}
# `--flags` the docs name that are third-party commands' (no file here defines them).
THIRD_PARTY = {
    "--last": "Codex CLI's `codex exec resume --last`",
    "--no-deps": "pip's, as the GPU wheels are fetched",
}
# Where the project's other commands define or pass their flags.
OTHER_COMMAND_SOURCES = ("tools", "tests", "Makefile")


def fill(arg: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        arg = arg.replace("{" + name + "}", value)
    return arg


def write_files(tmp: Path) -> None:
    """What rows name: an API key file and a tenants' keys file, both private."""
    (tmp / "key").write_text(KEY + "\n")
    (tmp / "tenants").write_text("".join(f"{t} {k}\n" for t, k in TENANTS.items()))
    for name in ("key", "tenants"):
        (tmp / name).chmod(0o600)


@pytest.mark.slow
@pytest.mark.parametrize("launch", LAUNCHES)
def test_launch(launch: str, default_model: Path, tmp_path: Path) -> None:
    rows = [row for row in ROWS if row.launch == launch]
    write_files(tmp_path)
    values = {"port": str(free_port()), "master_port": str(free_port(span=3)),
              "events_port": str(free_port()), "replay_port": str(free_port()),
              "tmp": str(tmp_path)}
    argv = [sys.executable, "-m", "orchestrator.launcher",
            *(fill(a, values) for row in rows for a in row.launcher), "serve",
            *(fill(a, values) for row in rows for a in row.serve)]
    engine = Launched(argv, values, tmp_path)
    try:
        try:
            wait_healthy(engine.url, timeout_s=180, proc=engine.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{shlex.join(argv[3:])}\ndid not start: {exc}\n"
                                 f"{engine.log()[-4000:]}") from None
        for row in rows:
            try:
                row.probe(engine)
            except AssertionError as exc:
                raise AssertionError(f"row `{row}` ({row.probe.__name__}): {exc}") from exc
    finally:
        code = engine.stop()
    assert code == 0, f"exit status {code}\n{engine.log()[-4000:]}"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def documented_flags() -> set[str]:
    """Every `--flag` the README and its topic pages (docs/*.md) name."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return set().union(*(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text())
                         for page in pages))


def defined_by_other_commands() -> str:
    """The text of the files where the project's other commands (the tools, the tests'
    drivers, the Makefile) define or pass their flags."""
    files = [REPO / "Makefile"] + [f for d in OTHER_COMMAND_SOURCES[:-1]
                                   for f in sorted((REPO / d).rglob("*.py"))]
    return "\n".join(f.read_text() for f in files)


def started_elsewhere() -> set[str]:
    found = set()
    for where, flags in ELSEWHERE.items():
        module, name = where.split(":")
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        for flag in flags:
            assert f'"{flag}"' in source, f"{where} does not start {flag}"
        found |= set(flags)
    return found


def test_every_flag_is_started() -> None:
    parser = build_parser()
    flags = option_strings(parser) | option_strings(serve_parser(parser))
    in_rows = set().union(*(row.flags for row in ROWS))
    assert in_rows <= flags, f"rows with flags deepinfer-run lacks: {in_rows - flags}"
    assert set(EXCEPTIONS) <= flags, "an exception for a flag that does not exist"
    assert not set(EXCEPTIONS) & in_rows, "an exception for a flag a row starts"
    not_started = flags - in_rows - started_elsewhere() - set(EXCEPTIONS)
    assert not not_started, f"flags no test starts through deepinfer-run: {not_started}"

    # a documented flag that is no deepinfer-run flag is another command's, defined or
    # passed by the project's code, or a third-party command's
    others = documented_flags() - flags
    source = defined_by_other_commands()
    # (as a string, or in a usage line: the simulator makes its flags from its fields)
    unknown = {f for f in others - set(THIRD_PARTY)
               if not re.search(re.escape(f) + r"(?![\w-])", source)}
    assert not unknown, f"documented flags that no command here defines: {unknown}"
    assert not set(THIRD_PARTY) & flags, "a third-party flag that deepinfer-run has"
