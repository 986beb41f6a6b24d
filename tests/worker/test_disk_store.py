"""The disk tier's per-rank store: records round-trip, damage is detected, identity and
budget hold (worker/disk_store.py)."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest

from worker.disk_store import (
    HEADER_BYTES,
    DiskIdentity,
    DiskStore,
    model_files_digest,
    record_bytes,
)

PAYLOAD = 3000  # not a multiple of the page size: records are padded


def identity(**kw) -> DiskIdentity:
    base = DiskIdentity(model_digest="m1", dtype="float32", block_size=16, world_size=2,
                        rank=0, num_layers=2, num_kv_heads=1, head_dim=8,
                        payload_bytes=PAYLOAD)
    return replace(base, **kw)


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(PAYLOAD))


def store(tmp_path, budget_slots: int = 8, **kw) -> DiskStore:
    ident = kw.pop("ident", identity())
    return DiskStore(tmp_path / "disk", ident, budget_slots * record_bytes(PAYLOAD), **kw)


def write_all(s: DiskStore, items: list[tuple[int, int]]) -> None:
    for wid, (slot, i) in enumerate(items):
        assert s.submit_write(wid, slot, 1000 + i, 2000 + i, payload(i))
    s.flush()


def test_round_trip_and_budget(tmp_path) -> None:
    s = store(tmp_path)
    write_all(s, [(0, 0), (5, 5), (7, 7)])
    assert s.take_completed() == ([0, 1, 2], [])
    assert s.read(5, 1005, 2005) == payload(5)
    assert s.read(5, 1005, 9999) is None  # another hash: never served
    assert s.read(1, 0, 0) is None  # never written
    budget = 8 * record_bytes(PAYLOAD)
    assert os.path.getsize(s.path) <= budget and s.num_slots == 8
    s.close()


def test_directory_is_private(tmp_path) -> None:
    s = store(tmp_path)
    assert stat.S_IMODE(os.stat(s.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    s.close()
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match="open to others"):
        DiskStore(open_dir, identity(), record_bytes(PAYLOAD))


def test_warm_restart_finds_records_and_drops_damage(tmp_path) -> None:
    s = store(tmp_path)
    write_all(s, [(i, i) for i in range(6)])
    s.close()
    rb = record_bytes(PAYLOAD)
    with open(s.path, "r+b") as f:
        f.seek(1 * rb + HEADER_BYTES + 100)  # a flipped byte in slot 1's payload
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
        f.seek(2 * rb + 20)  # a flipped byte in slot 2's header (its hash)
        f.write(b"\xff")
        # slot 3: a torn write, the new header is there but the payload only half
        f.seek(3 * rb + HEADER_BYTES + PAYLOAD // 2)
        f.write(b"\0" * (PAYLOAD // 2))
    again = store(tmp_path)
    found = again.scan()
    assert found.slots.tolist() == [0, 4, 5]
    assert found.lo.tolist() == [1000, 1004, 1005] and found.hi.tolist() == [2000, 2004, 2005]
    assert found.num_torn == 3 and again.stats.torn_at_start == 3
    assert again.read(1, 1001, 2001) is None and again.stats.num_bad_reads == 1
    assert again.read(4, 1004, 2004) == payload(4)
    again.close()


def test_truncated_file_drops_the_cut_record(tmp_path) -> None:
    s = store(tmp_path)
    write_all(s, [(0, 0), (1, 1)])
    s.close()
    rb = record_bytes(PAYLOAD)
    os.truncate(s.path, rb + HEADER_BYTES + 10)  # slot 1 cut mid-payload
    again = store(tmp_path)  # the file is sized back to the budget, the cut stays zeros
    found = again.scan()
    assert found.slots.tolist() == [0] and found.num_torn == 1
    assert again.read(1, 1001, 2001) is None
    again.close()


@pytest.mark.parametrize("change", [{"model_digest": "m2"}, {"dtype": "bfloat16"},
                                    {"world_size": 4}, {"block_size": 32}])
def test_another_identity_ignores_the_directory(tmp_path, change) -> None:
    s = store(tmp_path)
    write_all(s, [(0, 0), (1, 1)])
    s.close()
    other = store(tmp_path, ident=identity(**change))
    assert other.stats.identity_mismatch
    assert other.scan().slots.tolist() == []
    assert other.read(0, 1000, 2000) is None
    other.close()
    # and the original one, back, finds nothing either: the mismatch started it empty
    back = store(tmp_path)
    assert back.stats.identity_mismatch and back.scan().slots.tolist() == []
    back.close()


def test_records_of_another_identity_never_pass(tmp_path) -> None:
    """Even in the same file (the identity file lost), a record carries its identity."""
    s = store(tmp_path)
    write_all(s, [(0, 0)])
    s.close()
    os.remove(tmp_path / "disk" / "identity-rank0.json")
    other = store(tmp_path, ident=identity(model_digest="m2"))
    assert not other.stats.identity_mismatch  # nothing stored to compare with
    assert other.scan().slots.tolist() == [] and other.read(0, 1000, 2000) is None
    other.close()


def test_full_queue_drops_writes_and_says_so(tmp_path) -> None:
    # one queued write at a time, and a disk that takes 0.2 s per record
    s = store(tmp_path, max_queued_writes=1,
              max_write_bytes_per_s=record_bytes(PAYLOAD) / 0.2)
    accepted = [s.submit_write(i, i, i, i, payload(i)) for i in range(6)]
    s.flush()
    done, dropped = s.take_completed()
    assert not all(accepted) and dropped
    assert sorted(done + dropped) == list(range(6))
    assert s.stats.num_dropped_writes == len(dropped)
    for i in done:
        assert s.read(i, i, i) == payload(i)
    s.close()


def test_smaller_budget_never_exceeded(tmp_path) -> None:
    s = store(tmp_path, budget_slots=8)
    write_all(s, [(i, i) for i in range(8)])
    s.close()
    small = store(tmp_path, budget_slots=3)
    assert os.path.getsize(small.path) == 3 * record_bytes(PAYLOAD)
    assert small.scan().slots.tolist() == [0, 1, 2]
    small.close()


def test_model_files_digest_follows_the_files(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    d1 = model_files_digest(str(model))
    assert d1 == model_files_digest(str(model))
    (model / "config.json").write_text('{"a": 2}')
    assert model_files_digest(str(model)) != d1


WRITER = r"""
import sys
from dataclasses import replace
from worker.disk_store import DiskStore
from tests.worker.test_disk_store import identity, big_payload, BIG
store = DiskStore(sys.argv[1], replace(identity(), payload_bytes=BIG), 16 * (BIG + 8192))
wid = 0
while True:  # overwrite the slots round and round, as fast as the disk takes them
    for slot in range(store.num_slots):
        while not store.submit_write(wid, slot, wid + 1, slot, big_payload(wid)):
            pass
        wid += 1
        if wid == 8:
            print("writing", flush=True)
"""
BIG = 4 << 20  # 4 MiB records: a kill lands mid-write more often than not


def big_payload(wid: int) -> bytes:
    return bytes([wid % 251]) * BIG


def test_kill_9_during_writes_never_serves_a_torn_record(tmp_path) -> None:
    """A process writing records is killed with SIGKILL; every record the scan then
    accepts holds exactly what was written under its hash, and none is half old."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO, subprocess_env

    disk = tmp_path / "disk"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(disk)], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = DiskStore(disk, replace(identity(), payload_bytes=BIG), 16 * (BIG + 8192))
    found = store.scan()
    assert len(found.slots) > 0
    for slot, lo, hi in zip(found.slots.tolist(), found.lo.tolist(), found.hi.tolist()):
        assert hi == slot
        assert store.read(slot, lo, hi) == big_payload(lo - 1)  # write id lo - 1's bytes
    print(f"found {len(found.slots)} records, {found.num_torn} torn (dropped)")
    store.close()


def test_model_files_digest_ignores_files_the_kv_does_not_depend_on(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    d1 = model_files_digest(str(model))
    (model / "tokenizer.json").write_text("{}")  # and markers like deepinfer_tiny.json
    assert model_files_digest(str(model)) == d1
    (model / "model.safetensors").write_bytes(b"y" * 11)
    assert model_files_digest(str(model)) != d1


def bytes_read_by_this_process() -> int:
    """The bytes this process's read syscalls returned so far (the kernel's count)."""
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(io["rchar"])


def test_the_scan_reads_no_payload_of_an_empty_slot(tmp_path) -> None:
    """A fresh tier is a sparse file of empty slots (an automatically sized one, hundreds
    of thousands of them): the start-up scan reads their headers only, and still reads,
    checks and finds every written record."""
    s = store(tmp_path, budget_slots=2000)
    write_all(s, [(3, 3), (1500, 9)])
    before = bytes_read_by_this_process()
    found = s.scan()
    read = bytes_read_by_this_process() - before
    assert found.slots.tolist() == [3, 1500] and found.num_torn == 0
    assert read < 2000 * HEADER_BYTES + 2 * record_bytes(PAYLOAD) + 4096  # /proc/self/io
    s.close()


def test_the_kv_dtype_is_part_of_the_identity(tmp_path) -> None:
    """FP8 records (--kv-cache-dtype) are never read by an engine storing another KV dtype,
    nor the other way; KV in the model's dtype keeps the identity it had before the field
    existed, so such a directory stays warm."""
    e4m3 = identity(kv_dtype="float8_e4m3fn")
    assert identity(kv_dtype="float32").as_dict() == identity().as_dict()
    assert "kv_dtype" not in identity().as_dict()
    assert identity(kv_dtype="float32").digest() == identity().digest()
    assert len({identity().digest(), e4m3.digest(),
                identity(kv_dtype="float8_e5m2").digest()}) == 3
    s = store(tmp_path)
    write_all(s, [(0, 0), (1, 1)])
    s.close()
    fp8 = store(tmp_path, ident=e4m3)
    assert fp8.stats.identity_mismatch and fp8.scan().slots.tolist() == []
    write_all(fp8, [(2, 2)])
    fp8.close()
    again = store(tmp_path, ident=e4m3)  # the FP8 engine restarted: warm
    assert not again.stats.identity_mismatch and again.scan().slots.tolist() == [2]
    again.close()
    back = store(tmp_path)  # the model's dtype again: empty
    assert back.stats.identity_mismatch and back.scan().slots.tolist() == []
    back.close()
