"""Two tiny-model replicas behind SMG (cache-aware): agents with growing histories find
their prefix cached on every later turn, and Claude Code's model name is served.
Skipped where smg is not installed (it is in the dev extras)."""

from __future__ import annotations

import httpx
import pytest

from orchestrator.launcher import free_port
from tests.orchestrator.claude_code_body import claude_code_request
from tests.scheduler.kv_event_subscriber import Subscriber
from tools.benchmarks.routing import AgentLoad
from tools.replicas import Replicas, smg_binary

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smg_binary() is None, reason="smg is not installed")]


def requests_served(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("deepinfer_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def holds_chain(sub: Subscriber, ids: list[int], block_size: int = 16) -> bool:
    """The events said this replica caches every full block of ``ids``, chained."""
    by_content = {(sub.parent[h], tuple(toks)): h for (medium, h), toks in
                  sub.stored_tokens.items() if h in sub.held[medium]}
    parent = None
    for i in range(len(ids) // block_size):
        parent = by_content.get((parent, tuple(ids[i * block_size:(i + 1) * block_size])))
        if parent is None:
            return False
    return True


def test_agents_land_on_the_replica_holding_their_prefix(default_model, tmp_path) -> None:
    with Replicas(2, served_names=("tiny-llama", "claude-sonnet-4-5"),
                  extra_args=["--dtype", "float32", "--torch-threads", "1"],
                  kv_events_base_port=free_port(span=4), log_dir=tmp_path) as r:
        # distinct agents (a short shared system prompt): a turn routed to the other
        # replica would find almost nothing of its history there
        load = AgentLoad(num_agents=4, num_turns=3, system_words=10, first_words=120,
                         tool_words=30)
        load.run(r.url, concurrent=False)
        by_agent: dict[int, list] = {}
        for t in load.turns:
            by_agent.setdefault(t.agent, []).append(t)
        for turns in by_agent.values():
            for prev, cur in zip(turns, turns[1:]):
                # all but the last, partial block of the previous prompt is a hit
                assert cur.cached_tokens >= prev.prompt_tokens - 16, (prev, cur)
        # Every turn was served once. How many replicas took a share is SMG's choice
        # among replicas that hold none of a new agent's prefix (ties, tree sizes, the
        # order the replicas came up), so it is not asserted: what matters is below,
        # each agent's history on exactly one replica and its turns following it there.
        served = [requests_served(u) for u in r.replica_urls]
        assert sum(served) == len(load.turns)

        # Each replica's KV events (read from seq 0 by the replay) name the blocks of
        # the agents it served: their first prompts, as the render endpoint gives them
        port = int(r.kv_event_endpoints[0].rsplit(":", 1)[1])
        subs = [Subscriber(ep, f"tcp://127.0.0.1:{port + 2 * i + 1}")
                for i, ep in enumerate(r.kv_event_endpoints)]
        try:
            for sub, requests in zip(subs, served):
                sub.replay(0)
                assert sub.num_events["AllBlocksCleared"] == 1
                assert bool(sub.held["GPU"]) == (requests > 0)  # what it served, it holds
            for a, body in load.first_bodies.items():
                ids = httpx.post(f"{r.replica_urls[0]}/v1/chat/completions/render",
                                 json=body, timeout=60).json()["token_ids"]
                holders = [holds_chain(sub, ids) for sub in subs]
                assert sum(holders) == 1, (a, holders)
        finally:
            for sub in subs:
                sub.close()

        # what Claude Code sends by default reaches a replica (an SMG alias of ours)
        body, headers = claude_code_request("3f2a9c1e-0000-4000-8000-000000000001",
                                            stream=False)
        body["model"], body["max_tokens"] = "claude-sonnet-4-5", 4
        reply = httpx.post(f"{r.url}/v1/messages", json=body, headers=headers, timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["type"] == "message"
