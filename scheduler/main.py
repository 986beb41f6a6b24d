"""The scheduler process: requests in from the shim, step plans out to the ranks.

One loop in one thread: take every message waiting on the client socket, run one
engine step if there is work (or disk writes the ranks have yet to report), send each
output to the client that asked.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import zmq
from rich.console import Console
from rich.table import Table

from cache.manager import CacheAccountingError
from scheduler.control import SchedulerControl
from scheduler.engine import EngineCore, RankDivergenceError, agree_limits, restore_disk
from scheduler.executor import WorkerFailure, ZmqExecutor
from scheduler.kv_events import KVEventPublisher
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.telemetry import Telemetry
from wire import codec
from wire.client import AbortRequest, GenerateRequest, RequestOutput, StatsRequest, TurnEnd
from wire.config import CONFIG_FILE, EngineConfig
from wire.control import PrefixBreak
from wire.control_server import control_address
from wire.cpu_policy import defer_to_ranks
from wire.gc_policy import settle_heap
from wire.lifecycle import ClientHello, EngineInfo, EngineLimits, Shutdown
from wire.log import configure_logging
from wire.security import secure_bind

IDLE_POLL_MS = 50


class SchedulerServer:
    def __init__(self, core: EngineCore, info: EngineInfo, requests_addr: str, log,
                 telemetry: Telemetry | None = None,
                 kv_events: KVEventPublisher | None = None) -> None:
        self.core = core
        self.kv_events = kv_events
        self.info = info
        self.log = log
        self.telemetry = telemetry or Telemetry(log)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 500)  # let the goodbye reach the shim
        secure_bind(self._sock, requests_addr)  # CURVE over tcp://, a 0600 file over ipc://
        self._owners: dict[str, bytes] = {}  # request id -> client identity
        self._clients: set[bytes] = set()
        self._stopping = False

    @property
    def num_in_flight(self) -> int:
        return len(self._owners)

    def stop(self, *_: object) -> None:
        self._stopping = True

    def run(self) -> None:
        while not self._stopping:
            self._drain_clients(block=not self.core.has_work())
            # idle with disk writes in flight: a step every IDLE_POLL_MS collects them
            if self.core.has_work() or self.core.has_unreported_writes():
                self._send(self.core.step().outputs)
                if self.kv_events is not None:  # what the step's plans did to the index
                    self.kv_events.publish(self.core.scheduler.cache.take_events())

    def _drain_clients(self, block: bool) -> None:
        timeout = IDLE_POLL_MS if block else 0
        while self._sock.poll(timeout):
            identity, frame = self._sock.recv_multipart()
            self._handle(identity, frame)
            timeout = 0

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = codec.decode(frame)
        except codec.ProtocolError as exc:
            self.log.warning("bad_client_frame", error=str(exc))
            return
        sched = self.core.scheduler
        if isinstance(msg, ClientHello):
            self._clients.add(identity)
            self._sock.send_multipart([identity, codec.encode(self.info)])
        elif isinstance(msg, StatsRequest):
            stats = self.core.stats()
            stats.histograms.update(self.telemetry.histograms())
            stats.num_digest_mismatches = self.telemetry.num_digest_mismatches
            self._sock.send_multipart([identity, codec.encode(stats)])
        elif isinstance(msg, GenerateRequest):
            try:
                sched.add_request(msg)
                self._owners[msg.request_id] = identity
                self.telemetry.request_added(sched.sequence(msg.request_id))
            except RequestRejected as exc:
                # the request's one log line: it ends here
                self.log.info("request_rejected", request_id=msg.request_id,
                              session=msg.session_id,
                              prompt_tokens=len(msg.prompt_token_ids),
                              error_type=exc.error_type, error=str(exc))
                err = RequestOutput(msg.request_id, finished=True, finish_reason="error",
                                    error=str(exc), error_type=exc.error_type)
                self._sock.send_multipart([identity, codec.encode(err)])
        elif isinstance(msg, PrefixBreak):
            self.telemetry.prefix_break(msg)
        elif isinstance(msg, TurnEnd):
            sched.end_turn(msg.request_id, msg.tool_call)
        elif isinstance(msg, AbortRequest):
            out = sched.abort_request(msg.request_id, msg.reason)
            if out is not None:
                self._send([out])
        else:
            self.log.warning("unexpected_client_message", type=type(msg).__name__)

    def _send(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.telemetry.request_done(out)
            identity = self._owners.get(out.request_id)
            if identity is None:
                continue
            if out.finished:
                del self._owners[out.request_id]
            self._sock.send_multipart([identity, codec.encode(out)])

    def fail_all(self, message: str) -> None:
        """Tell every client with a request in flight that the engine failed.
        "unavailable": the request was fine; retried later (the launcher may be
        restarting the engine), it can succeed."""
        for request_id in list(self._owners):
            self._send([RequestOutput(request_id, finished=True, finish_reason="error",
                                      error=message, error_type="unavailable")])
        self.say_goodbye(message)

    def say_goodbye(self, reason: str) -> None:
        """Clients stop accepting work instead of waiting on an engine that is gone."""
        for identity in self._clients:
            self._sock.send_multipart([identity, codec.encode(Shutdown(reason))])


def print_budget(config: EngineConfig, limits: EngineLimits) -> None:
    """The KV budget as agreed by every rank, in tokens per tier (printed at start-up)."""
    kv = "" if config.kv_cache_dtype == "auto" else f"{config.kv_cache_dtype} KV, "
    table = Table(title=f"KV cache budget ({config.world_size} ranks, {config.block_size}-token "
                        f"blocks, {kv}{limits.kv_bytes_per_block} B/block/rank)")
    for col in ("tier", "blocks", "tokens", "bytes per rank"):
        table.add_column(col, justify="right")
    for tier, blocks in (("device", limits.num_device_blocks), ("host", limits.num_host_blocks)):
        table.add_row(tier, f"{blocks:,}", f"{blocks * config.block_size:,}",
                      f"{blocks * limits.kv_bytes_per_block:,}")
    if limits.is_hybrid:
        table.add_row(f"state (1 per {limits.state_snapshot_interval} blocks)",
                      f"{limits.num_state_slots:,} slots", "",
                      f"{limits.num_state_slots * limits.state_bytes_per_slot:,}")
        table.add_row("host state", f"{limits.num_host_state_slots:,} slots", "",
                      f"{limits.num_host_state_slots * limits.state_bytes_per_slot:,}")
    Console(file=sys.stdout, width=100).print(table)


def refuse_for_model(config: EngineConfig, limits: EngineLimits) -> str:
    """Why the engine cannot serve this config for the model the ranks loaded ("": it
    can). A hybrid model's recurrent state cannot take back rejected drafts, so
    speculative decoding is refused for it (the ranks refuse it too)."""
    if limits.is_hybrid and config.speculative is not None:
        return ("speculative decoding is not served for a hybrid model (linear-attention "
                "layers): their recurrent state cannot take back rejected drafts")
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DeepInfer scheduler")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    config = codec.read_file(args.run_dir / CONFIG_FILE, EngineConfig)
    addresses = json.loads((args.run_dir / "addresses.json").read_text())
    log = configure_logging("scheduler")
    # before ZeroMQ's I/O threads and the control server start: they inherit it
    log.info("cpu_policy", sched_batch=defer_to_ranks())

    executor = ZmqExecutor(addresses["workers"], config,
                           control_dir=args.run_dir)
    try:
        ready = executor.start()
        limits = agree_limits(ready)
    except WorkerFailure as exc:
        log.error("workers_failed_to_start", error=str(exc), ranks=exc.ranks, cause=exc.cause)
        return 1
    refusal = refuse_for_model(config, limits)
    if refusal:
        log.error("engine_refused", error=refusal)
        executor.shutdown()
        return 1
    print_budget(config, limits)
    log.info("kv_cache_budget", block_size=config.block_size,
             device_blocks=limits.num_device_blocks,
             device_tokens=limits.num_device_blocks * config.block_size,
             host_blocks=limits.num_host_blocks,
             host_tokens=limits.num_host_blocks * config.block_size,
             state_slots=limits.num_state_slots,
             host_state_slots=limits.num_host_state_slots,
             state_bytes_per_slot=limits.state_bytes_per_slot,
             state_snapshot_interval=limits.state_snapshot_interval)
    telemetry = Telemetry(log)
    core = EngineCore(Scheduler(config, limits), executor, telemetry)
    if limits.num_disk_blocks:
        restore_disk(core.scheduler, ready)
        log.info("disk_tier_restored", directory=config.disk_cache_dir,
                 disk_blocks=limits.num_disk_blocks,
                 blocks_found_after_restart=len(ready[0].disk_found),
                 disk_state_slots=limits.num_disk_state_slots,
                 states_found_after_restart=len(ready[0].state_disk_found),
                 torn_blocks_dropped=max(r.disk_torn for r in ready),
                 identity_mismatch=any(r.disk_identity_mismatch for r in ready))
    info = EngineInfo(config.model, config.block_size, config.world_size, limits)
    kv_events = None
    if config.kv_events_endpoint:
        kv_events = KVEventPublisher(config.kv_events_endpoint, config.served_model_name,
                                     config.kv_events_replay_endpoint)
        kv_events.publish(core.scheduler.cache.take_events())  # AllBlocksCleared: a new life
        log.info("kv_events_publishing", endpoint=kv_events.endpoint,
                 replay=kv_events.replay_endpoint, topic=kv_events.topic.decode())
    server = SchedulerServer(core, info, addresses["requests"], log, telemetry, kv_events)
    control = SchedulerControl(core.scheduler, telemetry,
                               control_address(args.run_dir, "scheduler"), log)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    log.info("scheduler_ready", world_size=config.world_size, requests=addresses["requests"],
             control=control.server.address)
    settle_heap()
    try:
        server.run()
    except Exception as exc:  # noqa: BLE001 -- whatever it was, the clients hear of it
        telemetry.failed(str(exc), digest_mismatch=isinstance(exc, RankDivergenceError))
        failure = exc if isinstance(exc, WorkerFailure) else None
        expected = (RankDivergenceError, WorkerFailure, CacheAccountingError, AssertionError)
        log.error("engine_failed", error=str(exc),
                  ranks=failure.ranks if failure else None,
                  cause=failure.cause if failure else type(exc).__name__,
                  in_flight=server.num_in_flight, exc_info=not isinstance(exc, expected))
        server.fail_all(f"engine failed: {exc}")
        return 1
    finally:
        control.close()
        if kv_events is not None:
            kv_events.close()
    server.say_goodbye("the engine is stopping")
    executor.shutdown()
    log.info("scheduler_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
