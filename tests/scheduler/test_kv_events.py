"""KV events end to end: the real scheduler and cache, the real ZeroMQ publisher, and a
subscriber that rebuilds the replica's cached blocks from the events alone; at the end
its set must equal the prefix index, medium by medium."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from scheduler.kv_events import KVEventPublisher
from scheduler.scheduler import Scheduler
from tests.scheduler.kv_event_subscriber import Subscriber
from wire.client import GenerateRequest
from wire.config import EngineConfig
from wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from wire.lifecycle import EngineLimits

BLOCK = 4


class Replica:
    """A scheduler whose ranks are faked (every sample is token 7), publishing its events
    after each step as the scheduler process does (scheduler/main.py)."""

    def __init__(self, write_policy: str = "write_back", num_device_blocks: int = 40,
                 num_host_blocks: int = 48) -> None:
        config = EngineConfig(model="/models/m", block_size=BLOCK, kv_write_policy=write_policy,
                              kv_events_endpoint="tcp://127.0.0.1:*",
                              kv_events_replay_endpoint="tcp://127.0.0.1:*",
                              served_model_name="tiny-llama")
        self.sched = Scheduler(config, EngineLimits(
            vocab_size=1000, max_model_len=512, eos_token_ids=(3,),
            num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks))
        self.pub = KVEventPublisher(config.kv_events_endpoint, "tiny-llama",
                                    config.kv_events_replay_endpoint, host="replica-0")
        self.num_batches = 0
        self._publish()

    def _publish(self) -> None:
        events = self.sched.cache.take_events()
        self.pub.publish(events)
        self.num_batches += bool(events)

    def run(self, requests: list[GenerateRequest]) -> None:
        for r in requests:
            self.sched.add_request(r)
        while self.sched.has_work():
            plan = self.sched.schedule()
            self.sched.update(plan, [(c.seq_id, 7) for c in plan.batch() if c.sample])
            self._publish()

    def index(self) -> dict[str, set[int]]:
        out = {}
        for medium, tier in (("GPU", self.sched.cache.device), ("CPU", self.sched.cache.host)):
            items = tier.index.registered_items()
            out[medium] = set(tier.index.keys_of(items)[0].tolist())
        return out


def agent_turns(num_agents: int, num_turns: int, seed: int = 0):
    """Turn by turn, each agent resends its whole history plus a new message: the
    coding-agent shape, here long enough to overflow a small device tier."""
    rng = random.Random(seed)
    histories = [[rng.randrange(10, 1000) for _ in range(rng.randrange(12, 30))]
                 for _ in range(num_agents)]
    for turn in range(num_turns):
        yield [GenerateRequest(f"a{a}-t{turn}", list(h), 4) for a, h in enumerate(histories)]
        for h in histories:
            h += [7] * 4 + [rng.randrange(10, 1000) for _ in range(rng.randrange(3, 12))]


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_subscriber_rebuilds_both_tiers_through_evictions_swaps_and_a_dropped_link(
        write_policy):
    rep = Replica(write_policy)
    sub = Subscriber(rep.pub.endpoint, rep.pub.replay_endpoint)
    turns = list(agent_turns(num_agents=5, num_turns=8))
    try:
        for turn in turns[:4]:
            rep.run(turn)
            sub.drain()
        sub.catch_up(rep.num_batches)
        assert sub.held == rep.index()
        # The router's link drops; the replica goes on; a new link resumes from the seq
        # after the last one applied, keeping what it knew.
        sub.close()
        for turn in turns[4:6]:
            rep.run(turn)
        missed = rep.num_batches - sub.next_seq
        sub = Subscriber(rep.pub.endpoint, rep.pub.replay_endpoint, sub.held, sub.next_seq)
        for turn in turns[6:]:
            rep.run(turn)
            sub.drain()
        sub.catch_up(rep.num_batches)
        held, index = sub.held, rep.index()
    finally:
        sub.close()
        rep.pub.close()
    stats = rep.sched.cache.stats
    # the run went through every path that moves a block
    assert stats.num_device_evictions > 0 and stats.num_swap_in_blocks > 0
    assert stats.num_swap_out_blocks > 0 and stats.num_host_evictions > 0
    assert missed > 0 and sub.num_replayed >= missed
    assert held == index
    assert held["GPU"] and held["CPU"]
    assert sub.topics <= {b"kv@replica-0@tiny-llama"}


def test_stored_events_carry_each_blocks_tokens_and_parent():
    rep = Replica(num_device_blocks=64, num_host_blocks=0)
    sub = Subscriber(rep.pub.endpoint, rep.pub.replay_endpoint)
    prompt = list(range(100, 130))  # 7 full blocks and 2 tokens
    try:
        rep.run([GenerateRequest("r", prompt, 4)])
        sub.catch_up(rep.num_batches)
    finally:
        sub.close()
        rep.pub.close()
    seq_chain = rep.sched.cache.device.index
    items = seq_chain.registered_items()
    assert len(items) == 8  # 34 tokens known when the last block filled: 8 full blocks
    lo = seq_chain.keys_of(items)[0]
    # walk the chain back from its last block through the parents the events named
    by_tokens = {tuple(sub.stored_tokens[("GPU", int(h))]): int(h) for h in lo}
    assert by_tokens.keys() >= {tuple(prompt[i:i + BLOCK]) for i in range(0, 28, BLOCK)}
    head = by_tokens[tuple(prompt[:BLOCK])]
    assert sub.parent[head] is None
    second = by_tokens[tuple(prompt[BLOCK:2 * BLOCK])]
    assert sub.parent[second] == head
    assert sub.num_events["AllBlocksCleared"] == 1


def test_a_restarted_replica_clears_what_its_last_life_announced():
    first = Replica()
    sub = Subscriber(first.pub.endpoint, first.pub.replay_endpoint)
    try:
        first.run(next(agent_turns(3, 1, seed=1)))
        sub.catch_up(first.num_batches)
        assert sub.held["GPU"]
    finally:
        sub.close()
        first.pub.close()
    # The same router state meets the new life, whose seqs count from 0 again.
    second = Replica()
    sub = Subscriber(second.pub.endpoint, second.pub.replay_endpoint, sub.held, 0)
    try:
        second.run(next(agent_turns(2, 1, seed=2)))
        sub.catch_up(second.num_batches)
    finally:
        sub.close()
        second.pub.close()
    assert sub.held == second.index()


def test_wire_format_is_vllms():
    """The frames as llm-d's vLLM adapter reads them: [ts, [event maps], dp_rank]."""
    batch = EventBatch(12.5, [AllBlocksCleared(),
                              BlockStored([1, 2**64 - 1], None, list(range(8)), 4, "CPU"),
                              BlockRemoved([5], "GPU")])
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw[0] == 12.5 and raw[2] == 0
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {"type": "BlockStored", "block_hashes": [1, 2**64 - 1],
                         "parent_block_hash": None, "token_ids": list(range(8)),
                         "block_size": 4, "lora_id": None, "medium": "CPU",
                         "lora_name": None, "extra_keys": None, "group_idx": 0,
                         "kv_cache_spec_kind": "full_attention"}
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU",
                         "group_idx": 0}
    assert decode_batch(encode_batch(batch)) == batch
    # the positional events of older vLLM revisions decode the same
    old = msgpack.packb([1.0, [["BlockStored", [9], 8, [1, 2, 3, 4], 4, None, "GPU"],
                               ["BlockRemoved", [9], "GPU"]], 0])
    assert decode_batch(old).events == [BlockStored([9], 8, [1, 2, 3, 4], 4, "GPU"),
                                        BlockRemoved([9], "GPU")]


def test_live_frames_are_topic_seq_payload():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "m", host="h")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        # a SUB joins late (ZeroMQ's slow joiner): publish until one batch gets through
        for _ in range(200):
            pub.publish([BlockRemoved([1])])
            if sub.poll(20):
                break
        topic, seq, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        pub.close()
    assert topic == b"kv@h@m"
    assert len(seq) == 8 and int.from_bytes(seq, "big") < 200
    assert decode_batch(payload).events == [BlockRemoved([1], "GPU")]


def test_connect_mode_reaches_a_subscriber_that_binds():
    """llm-d's indexer with a static zmqEndpoint binds, and the engines connect to it."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind("tcp://127.0.0.1:*")
    pub = KVEventPublisher("connect:" + sub.getsockopt_string(zmq.LAST_ENDPOINT), "m")
    try:
        for _ in range(200):
            pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                break
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        pub.close()
    assert decode_batch(payload).events == [AllBlocksCleared()]
