"""/metrics under vLLM's names, as a router scrapes a vLLM server: the figures of a real
scheduler mid-run (its queue, its running batch, its cache), through the shim."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from orchestrator.shim.server import build_app
from scheduler.scheduler import Scheduler
from wire.client import EngineStats, GenerateRequest
from wire.config import EngineConfig
from wire.lifecycle import EngineInfo, EngineLimits

BLOCK = 4
LIMITS = EngineLimits(vocab_size=1000, max_model_len=512, eos_token_ids=(3,),
                      num_device_blocks=64, num_host_blocks=16)


def snapshot(sched: Scheduler) -> EngineStats:
    """What EngineCore.stats() sends (scheduler/engine.py), without ranks."""
    return EngineStats(step=sched.step, num_waiting=len(sched.queue),
                       num_running=len(sched.running), num_prefill_tokens=0,
                       num_decode_tokens=0, step_seconds=0.0, kv_bytes_per_block=1,
                       cache={k: int(v) for k, v in vars(sched.cache.stats).items()},
                       usage=sched.cache.usage())


@dataclass
class SchedulerEngine:
    """Stands in for the engine client: answers start() and stats() from a real
    scheduler (it generates nothing)."""

    sched: Scheduler

    async def start(self) -> EngineInfo:
        return EngineInfo("tiny", BLOCK, 1, LIMITS)

    async def close(self) -> None:
        pass

    async def stats(self) -> EngineStats:
        return snapshot(self.sched)


def scrape(client: TestClient) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_a_router_reads_load_and_cache_under_vllms_names(tokenizer: Tokenizer) -> None:
    sched = Scheduler(EngineConfig(model="/models/m", block_size=BLOCK, max_num_seqs=2),
                      LIMITS)
    shared = list(range(100, 140))  # 10 blocks every request shares
    sched.add_request(GenerateRequest("first", shared + [5, 6], 2))
    while sched.has_work():  # the first one runs alone and leaves its blocks cached
        plan = sched.schedule()
        sched.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
    for i in range(4):
        sched.add_request(GenerateRequest(f"r{i}", shared + [10 + i] * 9, 8))
    plan = sched.schedule()  # two admitted (max_num_seqs), two waiting
    sched.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])

    app = build_app(SchedulerEngine(sched), tokenizer, model_name=["tiny-llama", "claude"])
    with TestClient(app) as client:
        m = scrape(client)
    labels = {"engine": "0", "model_name": "tiny-llama"}

    def value(name: str) -> float:
        [sample] = m[name]
        assert sample.labels == labels
        return sample.value

    assert value("vllm:num_requests_waiting") == 2
    assert value("vllm:num_requests_running") == 2
    usage = sched.cache.usage()["device"]
    assert 0 < usage["used"] < usage["capacity"]
    assert value("vllm:kv_cache_usage_perc") == usage["used"] / usage["capacity"]
    stats = sched.cache.stats
    assert value("vllm:prefix_cache_queries_total") == stats.num_queried_tokens > 0
    assert value("vllm:prefix_cache_hits_total") == stats.num_device_hit_tokens >= 2 * 40
    [info] = m["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels == {"engine": "0", "block_size": "4", "num_gpu_blocks": "64",
                           "num_cpu_blocks": "16"}
    # our own names stay beside them
    assert m["deepinfer_num_requests_waiting"][0].value == 2
