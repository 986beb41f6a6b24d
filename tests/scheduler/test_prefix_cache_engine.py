"""The prefix cache inside the engine: multi-turn hits, tiers, budget, close timing."""

from __future__ import annotations

import random

import pytest

from cache.hashing import make_extra_key
from cache.manager import CacheAccountingError
from scheduler.scheduler import Scheduler
from tests.scheduler.engine_harness import inprocess_engine, run_until_done, zmq_engine
from wire.client import GenerateRequest

BLOCK_BYTES_TINY = 8 * 2 * 16 * 4 * 64 * 4  # layers * K/V * block * kv heads * head_dim * fp32


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_multi_turn_conversation_hits_at_world_size_4(default_model, overlap):
    """The silent-miss regression: each turn resends the last prompt plus its output."""
    rng = random.Random(1)
    with zmq_engine(default_model, 4, async_scheduling=overlap) as core:
        prompt = tokens(rng, 300) + tokens(rng, 40)  # system prompt + first user turn
        ratios = []
        for turn in range(5):
            done = run_until_done(core, [GenerateRequest(f"turn{turn}", prompt, 16)])
            res = done[f"turn{turn}"]
            if turn:
                ratios.append(res["cached"] / len(prompt))
            prompt = prompt + res["tokens"] + tokens(rng, 30)  # + output + tool result
        assert min(ratios) >= 0.9, ratios
        # ranks agreed on every step (the engine checks each step's digests)
        assert all(len({r.digest for r in step}) == 1 for step in core.executor.results)
        assert core.scheduler.cache.usage()["device"]["used"] == 0


SHARED = 120  # tokens of context the two agents below share


def sharing_prompts() -> dict[str, list[int]]:
    """Two agents' prompts: the same fresh context, then each its own turn."""
    rng = random.Random(3)
    shared = tokens(rng, SHARED)
    return {"a": shared + tokens(rng, 9), "b": shared + tokens(rng, 21)}


@pytest.fixture(scope="module")
def alone(default_model) -> dict[str, list[int]]:
    """Each prompt's 8 tokens, run alone on an engine of its own (the same for every
    budget below, so run once)."""
    return {rid: run_until_done(inprocess_engine(default_model),
                                [GenerateRequest(rid, p, 8, ignore_eos=True)])[rid]["tokens"]
            for rid, p in sharing_prompts().items()}


@pytest.mark.parametrize("budget", [512, 70, 40])
def test_requests_sharing_a_prefix_in_one_step_match_running_alone(default_model, budget,
                                                                   alone):
    """Two agents sent the same fresh context at once: the second reads blocks the first
    writes in that very step (whole, or a chunk at a time under a small token budget),
    and both answer exactly as each does alone."""
    prompts = sharing_prompts()
    core = inprocess_engine(default_model, max_num_batched_tokens=budget)
    both = run_until_done(core, [GenerateRequest(rid, p, 8, ignore_eos=True)
                                 for rid, p in prompts.items()])
    assert {rid: r["tokens"] for rid, r in both.items()} == alone
    first = core.executor.plans[0]
    if budget >= 2 * SHARED:  # one step: b admitted beside a, onto a's fresh blocks
        assert both["b"]["cached"] == 112 and len(first.batch()) == 2


def test_same_tokens_cold_device_hit_and_host_hit(default_model):
    # 24 device blocks: a few other prompts push ours out to the 256-slot host tier.
    core = inprocess_engine(default_model, kv_cache_memory=24 * BLOCK_BYTES_TINY,
                            host_cache_memory=256 * BLOCK_BYTES_TINY)
    rng = random.Random(2)
    prompt = tokens(rng, 150)
    req = lambda rid: GenerateRequest(rid, prompt, 12, ignore_eos=True)  # noqa: E731
    cold = run_until_done(core, [req("cold")])["cold"]
    warm = run_until_done(core, [req("warm")])["warm"]
    assert warm["cached"] == 144 and core.scheduler.cache.stats.num_device_hit_tokens >= 144
    for i in range(4):  # evict: other prompts need the device blocks
        run_until_done(core, [GenerateRequest(f"other{i}", tokens(rng, 300), 4)])
    hit = core.scheduler.cache.lookup(prompt, make_extra_key(core.scheduler.config.model, None))
    assert hit.num_host_tokens > 0, "the prompt's blocks were not written back to the host"
    host_hits_before = core.scheduler.cache.stats.num_host_hit_tokens
    back = run_until_done(core, [req("back")])["back"]
    assert core.scheduler.cache.stats.num_host_hit_tokens - host_hits_before > 0
    assert any(p.swap_in for p in core.executor.plans), "nothing was swapped back in"
    assert cold["tokens"] == warm["tokens"] == back["tokens"]


def test_workload_larger_than_the_device_budget(default_model):
    """48 device blocks (768 tokens) serve 24 requests of ~200 tokens; the host tier hits."""
    core = inprocess_engine(default_model, kv_cache_memory=48 * BLOCK_BYTES_TINY,
                            host_cache_memory=512 * BLOCK_BYTES_TINY, max_num_seqs=6,
                            max_num_batched_tokens=256)
    rng = random.Random(3)
    shared = tokens(rng, 96)
    prompts = [shared + tokens(rng, 100 + 7 * i) for i in range(12)]
    reqs = [GenerateRequest(f"r{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)]
    cache = core.scheduler.cache
    first = {}
    for req in reqs:
        core.scheduler.add_request(req)
    while core.has_work():
        for out in core.step().outputs:
            first.setdefault(out.request_id, []).extend(out.token_ids)
        usage = cache.usage()
        for tier in ("device", "host"):
            u = usage[tier]
            assert u["used"] + u["cached"] + u["free"] == u["capacity"]
        cache.check_invariants()
    # the same prompts again: now mostly on the host tier
    again = run_until_done(core, [GenerateRequest(f"again{i}", p, 8, ignore_eos=True)
                                  for i, p in enumerate(prompts)])
    assert cache.stats.num_host_hit_tokens > 0
    assert usage["device"]["capacity"] == 48 and usage["host"]["capacity"] == 512
    for i in range(len(prompts)):
        assert again[f"again{i}"]["tokens"] == first[f"r{i}"], f"request {i}"
    assert cache.usage()["device"]["used"] == 0 and cache.usage()["host"]["used"] == 0


class EarlyCloseScheduler(Scheduler):
    """The bug docs/design.md tells of: release a sequence's cache entries the
    moment its final token is emitted, instead of in the plan of the next step."""

    def update(self, plan, sampled):
        outputs = super().update(plan, sampled)
        for seq in self._to_close:
            if seq.opened:
                self.cache.free(seq.seq_id, self.step)
                seq.opened, seq.block_ids = False, []
        return outputs


def test_closing_at_the_final_token_is_caught(default_model):
    # Without overlap: with it, an end by max_tokens is closed ahead (scheduler/engine.py)
    # and never waits in `_to_close`, where this bug strikes.
    # Caught twice over: by the accounting check that runs after every step (the cache
    # let go of a sequence the ranks still hold open)...
    core = inprocess_engine(default_model, scheduler_cls=EarlyCloseScheduler,
                            async_scheduling=False)
    with pytest.raises(CacheAccountingError, match=r"open \[1\] holding none"):
        run_until_done(core, [GenerateRequest("early", list(range(20, 60)), 3)])
    # ...and, were that check off, by the close-timing rule when the next plan closes it.
    core = inprocess_engine(default_model, scheduler_cls=EarlyCloseScheduler,
                            async_scheduling=False)
    core.scheduler.check_accounting = lambda: None
    with pytest.raises(AssertionError, match="close-timing violated"):
        run_until_done(core, [GenerateRequest("early", list(range(20, 60)), 3)])
