"""This rank's shard of the disk tier: fixed-size, checksummed records in one file.

The scheduler decides which block hash goes to which disk slot (cache/disk_pool.py); this
class only moves bytes where a plan says, and checks them on the way back. A record is

    header (64 bytes, little-endian)
      magic        8s   b"DIKVREC1"
      version      u16
      reserved     u16
      payload_len  u32
      identity     16s  DiskIdentity.digest(): a record of another model/layout never passes
      hash_lo      u64  the block hash the scheduler wrote it under
      hash_hi      u64
      checksum     16s  BLAKE2b-128 of the header's first 48 bytes and the payload
    payload            K then V of every layer of this rank's shard of the block; with
                       FP8 KV then their scales (worker/kv_cache.py host_slot_bytes)

so a torn write (kill -9 mid-write), a truncated file, a flipped byte anywhere, or a
record of another identity fails the check and is dropped: never served, the prefix is
recomputed. The file is preallocated to ``num_slots`` records and never grows: the
budget holds by construction.

Writes go through a bounded queue to one background thread, so a step never waits on
the disk; when the disk falls behind, a write is *dropped* (reported, never silently
lost: the scheduler commits a slot only once every rank wrote it). Reads run on the
caller's threads (worker/disk_tier.py's readers); ``pread`` on one descriptor is safe
from several.

What survives a crash. There is no separate index or manifest to lose: each record
names its block hash and identity, and the start-up scan rebuilds the index from the
records (the identity file is replaced atomically, and fsynced with its directory).
  - kill -9 (or any process crash): everything ``pwrite`` returned from is in the page
    cache, which outlives the process; a record half-written at the kill fails its
    checksum and is dropped.
  - power loss: the page cache is gone. The writer thread ``fdatasync``s the file at
    most every ``sync_interval_s`` (default 1 s), after writes and off every step's path,
    so at most the last interval's records are lost or torn -- dropped by their
    checksums, their prefixes recomputed. ``flush``/``close`` sync too.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import structlog

from wire.config import DISK_RECORDS_FILE, DISK_STATE_RECORDS_FILE

MAGIC = b"DIKVREC1"
VERSION = 1
_HEADER = struct.Struct("<8sHHI16sQQ16s")
HEADER_BYTES = _HEADER.size  # 64
_CHECKED = HEADER_BYTES - 16  # the checksum covers the header up to itself, and the payload
_ALIGN = 4096  # records start on page boundaries: a read or write touches no extra page

log = structlog.get_logger("disk_store")


@dataclass(frozen=True)
class DiskIdentity:
    """What must match for a stored record to be this engine's KV: the model
    files, dtype, KV dtype, block size, world size and this rank's shard of the layout."""

    model_digest: str
    dtype: str
    block_size: int
    world_size: int
    rank: int
    num_layers: int
    num_kv_heads: int  # of this rank's shard
    head_dim: int
    payload_bytes: int  # one block's K and V on this rank (and their scales, FP8)
    kv_dtype: str = ""  # what the records hold: FP8 (--kv-cache-dtype); "": `dtype`

    def as_dict(self) -> dict[str, object]:
        """The identity as stored. KV in the model's dtype is named by `dtype` alone, as
        before `kv_dtype` was: a directory written then is still this engine's."""
        stored = asdict(self)
        if stored["kv_dtype"] in ("", self.dtype):
            del stored["kv_dtype"]
        return stored

    def digest(self) -> bytes:
        text = json.dumps(self.as_dict(), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=16, person=b"deepinfer-disk").digest()


def model_files_digest(model: str) -> str:
    """A digest of what the KV depends on: names, sizes and modification times of the
    weight files, and the bytes of config.json (cheap: a 100 GB checkpoint is not read).
    Other files (tokenizer, markers that tools rewrite) are left out."""
    path = Path(model)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and (
            p.suffix in (".safetensors", ".gguf", ".bin") or p.name == "config.json"))
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if f.name == "config.json":
            h.update(f.read_bytes())
    return h.hexdigest()


def record_bytes(payload_bytes: int) -> int:
    return -(-(HEADER_BYTES + payload_bytes) // _ALIGN) * _ALIGN


def prepare_directory(directory: str | Path) -> Path:
    """Create the directory 0700, or accept an existing one only if it is ours and closed
    to others: KV is the users' conversations."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise PermissionError(f"disk cache directory {path} belongs to another user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"disk cache directory {path} is open to others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); it must be 0700")
    return path


@dataclass
class DiskStoreStats:
    bytes_written: int = 0
    bytes_read: int = 0
    num_writes: int = 0
    num_dropped_writes: int = 0
    num_reads: int = 0
    num_bad_reads: int = 0  # records that failed their check when read
    found_at_start: int = 0  # valid records the start-up scan found
    torn_at_start: int = 0  # records the scan found damaged (dropped)
    identity_mismatch: bool = False  # the directory held another identity: ignored
    read_s: float = 0.0  # seconds in reads (the read bandwidth: bytes_read / read_s)
    write_s: float = 0.0  # seconds in writes, on the writer thread


@dataclass
class ScanResult:
    slots: np.ndarray  # int32: slots holding a valid record of this identity
    lo: np.ndarray  # uint64: their block hashes
    hi: np.ndarray
    num_torn: int  # slots neither empty nor valid


@dataclass
class _Write:
    write_id: int
    slot: int
    lo: int
    hi: int
    payload: bytes = field(repr=False)


class DiskStore:
    """One rank's records. ``submit_write`` and ``take_completed`` are called by the step
    loop; the writes themselves run on the store's thread. ``read`` runs on the caller's
    thread (the plan that needs it)."""

    def __init__(self, directory: str | Path, identity: DiskIdentity, budget_bytes: int,
                 max_queued_writes: int = 256, max_write_bytes_per_s: float = 0.0,
                 sync_interval_s: float = 1.0, kind: str = "kv") -> None:
        """``kind``: "kv" (KV blocks) or "state" (a hybrid model's state snapshots,
        cache/state_disk.py): a file and an identity of their own in the directory."""
        assert kind in ("kv", "state"), kind
        self.kind = kind
        self.identity = identity
        self._id_digest = identity.digest()
        self.payload_bytes = identity.payload_bytes
        self.record_bytes = record_bytes(identity.payload_bytes)
        self.num_slots = max(0, budget_bytes // self.record_bytes)
        self.stats = DiskStoreStats()
        self.directory = prepare_directory(directory)
        records = DISK_RECORDS_FILE if kind == "kv" else DISK_STATE_RECORDS_FILE
        self.path = self.directory / records.format(rank=identity.rank)
        self._check_identity()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        # Exactly the budget: a larger file from a bigger budget before is cut, its
        # records past the end are gone; never a byte over the budget.
        os.ftruncate(self._fd, self.num_slots * self.record_bytes)
        self._queue: queue.Queue[_Write | None] = queue.Queue(max(1, max_queued_writes))
        self._lock = threading.Lock()
        self._done: list[int] = []
        self._dropped: list[int] = []
        self._rate = max_write_bytes_per_s
        self._sync_interval_s = sync_interval_s
        self._unsynced = False  # records written since the last fdatasync
        self._last_sync = time.monotonic()
        # A fault hook for tests and benchmarks: every read takes at least this long (a
        # slow or busy disk), so what overlaps a read can be shown.
        self.read_delay_s = 0.0
        # Another, for the crash test: a record is written in two halves this long apart,
        # so a kill -9 in between leaves a torn record for certain (a real tear is a race).
        self.write_pause_s = 0.0
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._write_loop, name="disk-writer",
                                        daemon=True)
        self._thread.start()

    # --- identity -------------------------------------------------------------------

    def _identity_path(self) -> Path:
        infix = "" if self.kind == "kv" else f"{self.kind}-"
        return self.directory / f"identity-{infix}rank{self.identity.rank}.json"

    def _check_identity(self) -> None:
        """A stored identity that differs: log it and start empty (the old records are
        never loaded; the file is cut to zero so the budget holds)."""
        path = self._identity_path()
        mine = self.identity.as_dict()
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = {"unreadable": True}
            if stored == mine:
                return
            diff = {k: (stored.get(k), mine.get(k)) for k in sorted(set(stored) | set(mine))
                    if stored.get(k) != mine.get(k)}
            log.warning("disk_identity_mismatch", directory=str(self.directory),
                        rank=self.identity.rank, differs=diff)
            self.stats.identity_mismatch = True
            if self.path.exists():
                os.truncate(self.path, 0)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the old identity or the new one
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    # --- records ------------------------------------------------------------------

    def _header(self, lo: int, hi: int, payload: bytes | memoryview) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, 0, len(payload), self._id_digest, lo, hi,
                            b"\0" * 16)[:_CHECKED]
        h = hashlib.blake2b(head, digest_size=16)
        h.update(payload)
        return head + h.digest()

    def _check(self, record: bytes | memoryview) -> tuple[int, int] | None:
        """(lo, hi) of a valid record of this identity, else None."""
        if len(record) < HEADER_BYTES:
            return None
        magic, version, _, n, ident, lo, hi, checksum = _HEADER.unpack_from(record)
        if (magic != MAGIC or version != VERSION or ident != self._id_digest
                or n != self.payload_bytes or len(record) < HEADER_BYTES + n):
            return None
        h = hashlib.blake2b(record[:_CHECKED], digest_size=16)
        h.update(record[HEADER_BYTES:HEADER_BYTES + n])
        return (lo, hi) if h.digest() == checksum else None

    def read(self, slot: int, lo: int, hi: int) -> bytes | None:
        """The payload of ``slot`` if it holds a valid record of block hash (lo, hi); None
        otherwise (torn, truncated, damaged, overwritten): the caller recomputes."""
        assert 0 <= slot < self.num_slots, f"disk slot {slot} out of range"
        t0 = time.perf_counter()
        record = os.pread(self._fd, HEADER_BYTES + self.payload_bytes, slot * self.record_bytes)
        if self.read_delay_s:
            time.sleep(max(0.0, self.read_delay_s - (time.perf_counter() - t0)))
        ok = self._check(record) == (lo, hi)
        with self._lock:  # reads run on several threads
            self.stats.read_s += time.perf_counter() - t0
            self.stats.num_reads += 1
            self.stats.bytes_read += len(record)
            self.stats.num_bad_reads += not ok
        if not ok:
            log.warning("disk_record_dropped", slot=slot, reason="failed its check")
            return None
        return record[HEADER_BYTES:]

    def scan(self) -> ScanResult:
        """Every slot's record checked (start-up, warm restart). Empty slots (a header of
        zeros: never written) are not counted as torn, and their payload is not read: a
        fresh tier is a sparse file of empty slots, which a full read would copy (zeros)
        gigabyte by gigabyte before the engine could start."""
        slots, los, his, torn = [], [], [], 0
        size = os.fstat(self._fd).st_size
        for slot in range(self.num_slots):
            offset = slot * self.record_bytes
            if offset >= size:
                break
            if os.pread(self._fd, HEADER_BYTES, offset).count(0) == HEADER_BYTES:
                continue  # empty
            key = self._check(os.pread(self._fd, HEADER_BYTES + self.payload_bytes, offset))
            if key is not None:
                slots.append(slot)
                los.append(key[0])
                his.append(key[1])
            else:
                torn += 1
        self.stats.found_at_start = len(slots)
        self.stats.torn_at_start = torn
        return ScanResult(np.asarray(slots, np.int32), np.asarray(los, np.uint64),
                          np.asarray(his, np.uint64), torn)

    # --- writes ---------------------------------------------------------------------

    def submit_write(self, write_id: int, slot: int, lo: int, hi: int,
                     payload: bytes) -> bool:
        """Queue a record; False (reported as dropped) when the queue is full. ``payload``
        must be a copy the caller will not change (the host slot may be reused)."""
        assert 0 <= slot < self.num_slots, f"disk slot {slot} out of range"
        assert len(payload) == self.payload_bytes, (len(payload), self.payload_bytes)
        with self._lock:
            self._in_flight += 1
        try:
            self._queue.put_nowait(_Write(write_id, slot, lo, hi, payload))
        except queue.Full:
            with self._lock:
                self._in_flight -= 1
                self._dropped.append(write_id)
                self.stats.num_dropped_writes += 1
            return False
        return True

    def take_completed(self) -> tuple[list[int], list[int]]:
        """Write ids finished since the last call: (written, dropped)."""
        with self._lock:
            done, self._done = self._done, []
            dropped, self._dropped = self._dropped, []
        return done, dropped

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is written (or dropped), then sync them to the
        device: tests, shutdown."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)
        os.fdatasync(self._fd)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        os.fdatasync(self._fd)
        os.close(self._fd)

    def _maybe_sync(self) -> None:
        """On the writer thread: bound what a power cut loses to ``sync_interval_s``."""
        if self._unsynced and time.monotonic() - self._last_sync >= self._sync_interval_s:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                log.warning("disk_sync_failed", error=str(exc))
            self._unsynced = False
            self._last_sync = time.monotonic()

    def _write_loop(self) -> None:
        while True:
            try:
                w = self._queue.get(timeout=self._sync_interval_s if self._unsynced else None)
            except queue.Empty:  # idle after writes: sync them now
                self._maybe_sync()
                continue
            if w is None:
                return
            t0 = time.perf_counter()
            ok = True
            try:
                data = self._header(w.lo, w.hi, w.payload) + w.payload
                offset = w.slot * self.record_bytes
                n = 0
                if self.write_pause_s:  # the fault hook: half a record, then the rest
                    n = os.pwrite(self._fd, data[:len(data) // 2], offset)
                    time.sleep(self.write_pause_s)
                n += os.pwrite(self._fd, data[n:], offset + n)
                ok = n == len(data)
            except OSError as exc:  # a full or failing disk: drop, report, keep serving
                log.warning("disk_write_failed", slot=w.slot, error=str(exc))
                ok = False
            with self._lock:
                (self._done if ok else self._dropped).append(w.write_id)
                self.stats.write_s += time.perf_counter() - t0
                if ok:
                    self.stats.num_writes += 1
                    self.stats.bytes_written += len(data)
                else:
                    self.stats.num_dropped_writes += 1
                self._in_flight -= 1
                self._idle.notify_all()
            self._unsynced |= ok
            self._maybe_sync()
            if self._rate > 0 and ok:  # rate limit: leave the disk to reads and others
                wait = len(data) / self._rate - (time.perf_counter() - t0)
                if wait > 0:
                    time.sleep(wait)
