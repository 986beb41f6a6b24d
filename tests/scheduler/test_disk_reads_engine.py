"""Disk reads in the background (cache/disk_flow.py, worker/disk_tier.py): a sequence whose
prefix is on disk waits for its reads while the others step, comes in token-identical,
and leaks nothing if aborted mid-read; a record damaged on one rank is recomputed on
every rank, the digests agreeing."""

from __future__ import annotations

import os
import random

from cache.hashing import make_extra_key
from tests.scheduler.engine_harness import run_until_done
from tests.scheduler.test_disk_tier_engine import (
    BLOCK_BYTES_TINY,
    BS,
    disk_engine,
    prompt_keys,
    push_out,
    settle_writes,
    tokens,
)
from wire.client import GenerateRequest
from worker.disk_store import record_bytes

READ_DELAY_S = 0.25  # each read, on a slow disk (DiskStore.read_delay_s)


def on_disk_only(core, rng, prompt: list[int]) -> list[int]:
    """Run ``prompt`` once, then push it out of the device and host tiers. Returns its
    greedy output (the reference)."""
    cold = run_until_done(core, [GenerateRequest("cold", prompt, 8, ignore_eos=True)])
    settle_writes(core)
    push_out(core, rng, 3)
    settle_writes(core)
    hit = core.scheduler.cache.lookup(prompt, make_extra_key(core.scheduler.config.model, None))
    assert hit.num_disk_tokens == 144 and hit.num_device_tokens == hit.num_host_tokens == 0
    return cold["cold"]["tokens"]


def no_reads_held(core) -> None:
    cache = core.scheduler.cache
    assert cache.host.num_reserved == 0 and not cache.disk.reading.any()
    cache.check_invariants()


def test_a_slow_read_does_not_stall_a_decoding_sequence(default_model, tmp_path) -> None:
    core = disk_engine(default_model, tmp_path / "disk")
    rng = random.Random(21)
    prompt = tokens(rng, 150)
    reference = on_disk_only(core, rng, prompt)
    other = tokens(rng, 20)
    other_ref = run_until_done(core, [GenerateRequest("ref", other, 30, ignore_eos=True)])
    core.executor.inner.runner.disk.store.read_delay_s = READ_DELAY_S

    sched = core.scheduler
    sched.add_request(GenerateRequest("dec", other, 30, ignore_eos=True))
    got: dict[str, list[int]] = {"dec": [], "back": [], "next": []}
    waiting_steps = decoded_while_waiting = 0
    behind = tokens(rng, 20)  # queued behind the reading one: not held up by it
    next_first_token_while_waiting = False
    first_plan = len(core.executor.plans)
    while core.has_work():
        if len(got["dec"]) == 3 and sched.sequence("back") is None:
            sched.add_request(GenerateRequest("back", prompt, 8, ignore_eos=True))
            sched.add_request(GenerateRequest("next", behind, 4, ignore_eos=True))
        back = sched.sequence("back")
        reading = back is not None and sched.cache.reading(back.seq_id)
        for out in core.step().outputs:
            got[out.request_id].extend(out.token_ids)
            if reading and out.request_id == "dec":
                decoded_while_waiting += len(out.token_ids)
            if reading and out.request_id == "next" and out.token_ids:
                next_first_token_while_waiting = True
        waiting_steps += reading
    assert got["back"] == reference and got["dec"] == other_ref["ref"]["tokens"]
    # 9 reads of >= 0.25 s on 4 reader threads: >= 0.75 s in which "dec" kept decoding
    assert waiting_steps >= 3 and decoded_while_waiting >= 3
    assert next_first_token_while_waiting and len(got["next"]) == 4
    plans = core.executor.plans[first_plan:]
    started = next(i for i, p in enumerate(plans) if p.disk_read)
    filled = {op[2] for op in plans[started].disk_read}
    swapped = next(i for i, p in enumerate(plans) if {s for s, _ in p.swap_in} & filled)
    assert swapped > started + 1  # a later plan, after steps of the others
    assert sum(1 for p in plans[started:swapped] if p.batch()) >= 3  # the others' steps
    assert sched.cache.stats.num_disk_hit_tokens == 144
    no_reads_held(core)
    core.executor.shutdown()


def test_an_abort_mid_read_leaks_nothing(default_model, tmp_path) -> None:
    core = disk_engine(default_model, tmp_path / "disk")
    rng = random.Random(22)
    prompt = tokens(rng, 150)
    reference = on_disk_only(core, rng, prompt)
    store = core.executor.inner.runner.disk.store
    store.read_delay_s = READ_DELAY_S
    sched = core.scheduler
    sched.add_request(GenerateRequest("back", prompt, 8, ignore_eos=True))
    core.step()
    assert sched.cache.reading(sched.sequence("back").seq_id)
    assert sched.cache.host.num_reserved == 9
    sched.abort_request("back")
    assert sched.cache.host.num_reserved == 9  # the reader threads may still fill them
    while store.stats.num_reads < 9 or sched.cache.host.num_reserved:
        settle_writes(core)  # idle steps carry the reads' reports
    no_reads_held(core)
    store.read_delay_s = 0.0
    # the blocks are still on disk, and read again for the next request
    again = run_until_done(core, [GenerateRequest("again", prompt, 8, ignore_eos=True)])
    assert again["again"]["tokens"] == reference
    no_reads_held(core)
    core.executor.shutdown()


def test_a_record_damaged_on_one_rank_is_recomputed_on_all(default_model, tmp_path) -> None:
    """Two gloo ranks; rank 1's copy of the prompt's 4th block is damaged after it was
    committed: rank 1's read fails its check, rank 0's passes, and the scheduler drops the
    block for both: the digests agree (checked every step) and the output is the same."""
    disk = tmp_path / "disk"
    rng = random.Random(23)
    prompt = tokens(rng, 150)
    req = lambda rid: GenerateRequest(rid, prompt, 8, ignore_eos=True)  # noqa: E731
    with disk_engine(default_model, disk, world_size=2) as core:
        cold = run_until_done(core, [req("cold")])["cold"]
        push_out(core, rng, 6)
        cache = core.scheduler.cache
        slots = cache.disk.find(*prompt_keys(core, prompt))
        assert (slots >= 0).all()
        with open(disk / "rank1.kv", "r+b") as f:  # past the header: the payload
            f.seek(int(slots[3]) * record_bytes(BLOCK_BYTES_TINY // 2) + 555)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        back = run_until_done(core, [req("back")])["back"]
        assert back["tokens"] == cold["tokens"]
        assert cache.disk.num_bad_reads == 1
        assert cache.stats.num_disk_hit_tokens == 3 * BS  # the chain stops at the bad one
        assert cache.host.num_reserved == 0 and not cache.disk.reading.any()
