"""tools/benchmarks/trace.py (`make bench-trace`) without vLLM: the flags, the KV sizing,
/metrics and the engine's log read back, the report from a round's records; end to end
(slow) with a DeepInfer standing in for the peer, on a tiny trace."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
from rich.console import Console

from tools.benchmarks import trace as bt
from tools.benchmarks.trace_load import TraceParams, instant_timeline
from tools.benchmarks.trace_report import report_table, summarize
from tools.benchmarks.trace_run import (
    RequestRecord,
    RoundResult,
    Sample,
    add_engine_log,
    parse_metrics,
)


def test_every_trace_param_is_a_flag_of_the_same_name():
    args = bt.parse_args(["--sessions", "7", "--pause-p99-s", "40", "--salt", "x",
                          "--subagent-turns-max", "3", "--time-scale", "0.25"])
    params = bt.trace_params(args, [5, 6, 7], bos=1)
    assert (params.sessions, params.pause_p99_s, params.salt) == (7, 40.0, "x")
    assert (params.subagent_turns_max, params.time_scale) == (3, 0.25)
    assert params.vocab == (5, 6, 7) and params.bos == 1
    defaults = TraceParams()
    for f in fields(TraceParams):
        if f.name in ("sessions", "pause_p99_s", "salt", "subagent_turns_max", "time_scale",
                      "vocab", "bos"):
            continue
        assert getattr(params, f.name) == getattr(defaults, f.name), f.name
    assert bt.parse_args([]).salt  # drawn per run when not given


def test_kv_memory_is_whole_blocks_for_both_engines_and_sized_from_the_live_context():
    params = TraceParams(sessions=10, vocab=tuple(range(10, 500)))
    live = instant_timeline(params).live_context().mean()
    s = bt.size_kv(params, bytes_per_token=8192, max_model_len=4096, pressure=1.6,
                   kv_bytes=None, host_factor=4)
    assert s.kv_tokens % bt.KV_GRANULE_TOKENS == 0 and s.kv_bytes == s.kv_tokens * 8192
    assert live / 1.6 - bt.KV_GRANULE_TOKENS < s.kv_tokens <= live / 1.6
    assert s.pressure == pytest.approx(1.6, rel=0.02) and s.host_bytes == 4 * s.kv_bytes
    # never below one full-context sequence (and vLLM's null block)
    small = bt.size_kv(params, 8192, max_model_len=16384, pressure=100.0, kv_bytes=None,
                       host_factor=4)
    assert small.kv_tokens == small.floor_tokens == 16384 + 128
    given = bt.size_kv(params, 8192, 4096, 1.6, kv_bytes=300 * 8192 * 128 + 5, host_factor=1)
    assert given.kv_tokens == 300 * 128 and given.asked_pressure is None


def test_every_deepinfer_column_gets_the_same_kv_bytes_and_the_fp8_one_stores_fp8(tmp_path):
    sizing = bt.size_kv(TraceParams(sessions=2, vocab=tuple(range(10, 500))), 8192, 4096,
                        1.6, kv_bytes=300 * 8192 * 128, host_factor=4)
    args = bt.parse_args(["--peer", "deepinfer", "--json", str(tmp_path / "t.json")])
    args.peer_max_model_len = 4096
    engines = bt.columns(tmp_path, args, sizing)
    assert list(engines) == ["DeepInfer (stand-in peer)", "DeepInfer", "DeepInfer + host",
                             "DeepInfer FP8 KV"]
    flags = {name: engine.keywords["extra_args"] for name, engine in engines.items()}
    for name, extra in flags.items():
        kv = extra[extra.index("--kv-cache-memory") + 1]
        assert kv == str(sizing.kv_bytes), name
        host = extra[extra.index("--host-cache-memory") + 1]
        assert host == (str(sizing.host_bytes) if name == "DeepInfer + host" else "0")
        assert ("--kv-cache-dtype" in extra) == (name == "DeepInfer FP8 KV")
    assert flags["DeepInfer FP8 KV"][-2:] == ["--kv-cache-dtype", "fp8"]
    args.fp8_column = False
    assert "DeepInfer FP8 KV" not in bt.columns(tmp_path, args, sizing)


VLLM_METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="bench"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bench"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="bench"} 4.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="bench"} 1.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="bench"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="bench"} 3.5
vllm:request_queue_time_seconds_count{engine="0",model_name="bench"} 2.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",\
num_cpu_blocks="None",num_gpu_blocks="168"} 1.0
"""


def test_metrics_are_read_by_name_and_label_and_the_cache_config_by_its_labels():
    values, cache = parse_metrics(VLLM_METRICS)
    assert values["vllm:num_requests_waiting"] == 3 and values["vllm:num_requests_running"] == 2
    assert values["vllm:num_preemptions_total"] == 4
    assert values["vllm:request_queue_time_seconds_sum"] == 3.5
    assert not any(k.endswith("_bucket") for k in values)
    assert cache == {"block_size": 128, "num_gpu_blocks": 168}
    deepinfer, _ = parse_metrics('# TYPE deepinfer_kv_evictions counter\n'
                                 'deepinfer_kv_evictions_total{tier="device"} 9.0\n'
                                 'deepinfer_kv_evictions_total{tier="host"} 1.0\n')
    assert deepinfer == {"deepinfer_kv_evictions_total{tier=device}": 9.0,
                         "deepinfer_kv_evictions_total{tier=host}": 1.0}


def _record(sid: str, turn: int, *, seen: int, cached: int, ttft: float,
            idle: float | None = None, **more) -> RequestRecord:
    return RequestRecord(sid, "turn", turn, sent_s=turn, idle_s=idle, prompt_tokens=1000,
                         seen_tokens=seen, cached_tokens=cached,
                         recomputed_seen=max(0, seen - cached), output_tokens=8, ttft_s=ttft,
                         latency_s=ttft + 1, **more)


def _round(records: list[RequestRecord], before: dict, after: dict) -> RoundResult:
    samples = [Sample(0.5 * i, waiting=i % 3, running=1, kv_usage=0.5, live_tokens=100 * i)
               for i in range(30)]
    return RoundResult(records, samples, 20.0, before, after,
                       {"block_size": 16, "num_gpu_blocks": 100}, 0.5, 0.7)


def test_the_summary_counts_what_was_recomputed_though_seen_and_after_long_pauses():
    records = [_record("a", 0, seen=0, cached=0, ttft=0.5),
               _record("a", 1, seen=800, cached=800, ttft=0.2, idle=2.0),
               _record("a", 2, seen=900, cached=100, ttft=3.0, idle=30.0,
                       engine_queue_s=2.0, engine_ttft_s=2.8, preemptions=1),
               _record("b", 0, seen=0, cached=0, ttft=0.4),
               _record("b", 1, seen=800, cached=0, ttft=2.0, idle=12.0)]
    records.append(replace(records[-1], turn=2, error="HTTP 429"))
    before = {"deepinfer_request_queue_time_seconds_sum": 1.0,
              "deepinfer_request_queue_time_seconds_count": 2.0,
              "deepinfer_time_to_first_token_seconds_sum": 2.0,
              "deepinfer_time_to_first_token_seconds_count": 2.0}
    after = {"deepinfer_request_queue_time_seconds_sum": 5.0,
             "deepinfer_request_queue_time_seconds_count": 7.0,
             "deepinfer_time_to_first_token_seconds_sum": 10.0,
             "deepinfer_time_to_first_token_seconds_count": 7.0,
             "deepinfer_kv_evictions_total{tier=device}": 12.0}
    s = summarize(_round(records, before, after), long_pause_s=10.0)
    assert (s["requests"], s["failed"], s["errors"]) == (6, 1, ["HTTP 429"])
    assert s["prompt_tokens"] == 5000 and s["cached_tokens"] == 900
    assert s["hit_ratio"] == pytest.approx(0.18)
    assert s["seen_tokens"] == 2500 and s["recomputed_seen"] == 800 + 800
    assert s["recomputed_seen_share"] == pytest.approx(1600 / 2500)
    assert s["after_long_pause_requests"] == 2  # idle 30 s and 12 s; not 2 s
    assert s["after_long_pause_recomputed_seen"] == 1600
    assert s["after_long_pause_recomputed_seen_share"] == pytest.approx(1600 / 1700)
    assert s["server_queue_mean_s"] == pytest.approx(4 / 5)
    assert s["server_prefill_mean_s"] == pytest.approx(8 / 5 - 4 / 5)  # ttft - queue
    assert s["device_evictions"] == 12 and s["preemptions"] == 1  # from the engine's log
    assert s["kv_capacity_tokens"] == 1600 and s["waiting_max"] == 2
    assert s["queue_series"][0] == [0.0, 2, 1.0, 900]  # the first 5 s
    slow = s["slow_turns"]
    assert slow["requests"] == 1 and slow["engine_queue_mean_s"] == 2.0
    assert slow["engine_prefill_mean_s"] == pytest.approx(0.8)
    assert slow["outside_engine_mean_s"] == pytest.approx(0.2)


def test_the_table_has_a_column_per_engine_and_ratios_to_the_peer():
    ours = summarize(_round([_record("a", 1, seen=800, cached=400, ttft=1.0)], {}, {}), 10.0)
    peer = summarize(_round([_record("a", 1, seen=800, cached=600, ttft=2.0)], {}, {}), 10.0)
    console = Console(width=160, record=True)
    console.print(report_table({"vLLM-CPU": peer, "DeepInfer": ours}, "vLLM-CPU", "t"))
    text = console.export_text()
    assert "DeepInfer / vLLM-CPU" in text
    assert "2.00x" in text  # recomputed though seen: 400 / 200
    assert "0.50x" in text  # TTFT: 1 / 2
    assert "recomputed though seen before" in text


def test_the_engine_log_fills_in_each_request_by_its_id(tmp_path):
    log = tmp_path / "launcher.log"
    done = {"role": "scheduler", "request_id": "cmpl-1", "event": "request_done",
            "queue_s": 0.5, "ttft_s": 1.5, "preemptions": 2, "device_cached_tokens": 96,
            "host_cached_tokens": 32}
    shim = {"role": "shim", "request_id": "cmpl-1", "event": "request_done", "queue_s": 9}
    log.write_text("not json\n" + json.dumps(done) + "\n" + json.dumps(shim) + "\n")
    records = [_record("a", 0, seen=0, cached=128, ttft=2.0, request_id="cmpl-1"),
               _record("a", 1, seen=0, cached=0, ttft=2.0, request_id="cmpl-2")]
    assert add_engine_log(records, log) == 1
    r = records[0]
    assert (r.engine_queue_s, r.engine_ttft_s, r.preemptions) == (0.5, 1.5, 2)
    assert (r.device_cached_tokens, r.host_cached_tokens) == (96, 32)
    assert records[1].engine_queue_s is None
    assert add_engine_log(records, None) == 0


TINY_TRACE = ["--sessions", "2", "--system-tokens", "64", "--first-user-tokens", "16",
              "--turn-tokens-median", "24", "--turns-median", "3", "--turns-sigma", "0",
              "--time-scale", "0.01", "--stagger-s", "1", "--subagent-prob", "1",
              "--title-prob", "1", "--summary-tokens", "32", "--compaction-prompt-tokens", "8",
              "--subagent-system-tokens", "32", "--title-system-tokens", "8",
              "--max-tokens", "4", "--context-limit", "512"]


@pytest.mark.slow
def test_end_to_end_against_a_stand_in_peer(default_model, tmp_path, capsys):
    out = tmp_path / "trace.json"
    # X holds every token of the trace many times over: nothing is evicted
    bt.main(["--model", str(default_model), "--peer", "deepinfer", "--dtype", "float32",
             "--max-model-len", "512", "--kv-cache-bytes", str(32 << 20), "--host-factor", "1",
             "--poll-s", "0.1", "--no-machine-rates", "--no-fp8-column", "--json", str(out),
             *TINY_TRACE],
            console=Console(width=160))
    result = json.loads(out.read_text())
    names = ["DeepInfer (stand-in peer)", "DeepInfer", "DeepInfer + host"]
    assert list(result["runs"]) == names and result["ratio_to"] == names[0]
    assert set(result["ratios"]) == set(names[1:])
    assert result["sizing"]["kv_bytes"] == 32 << 20 and result["sizing"]["bytes_per_token"]
    params = {k: v for k, v in result["params"].items() if k != "vocab_size"}
    expected = len(instant_timeline(TraceParams(**params, vocab=(5, 6))).sent)
    for name in names:
        row, records = result["runs"][name], result["requests"][name][0]
        assert row["requests"] == len(records) == expected and row["failed"] == 0
        assert {"turn", "subagent", "title"} <= set(row["by_kind"])
        assert row["kv_capacity_tokens"] == (32 << 20) // result["sizing"]["bytes_per_token"]
        assert row["host_capacity_tokens"] == (row["kv_capacity_tokens"]
                                               if name == names[2] else 0)
        assert row["hit_ratio"] > 0 and row["samples"] > 0 and row["queue_series"]
        assert row["engine_logged_requests"] == expected  # the scheduler's log, by id
        # nothing evicted: every later turn was seen, and nothing seen was computed again
        assert row["recomputed_seen"] == 0 and row["device_evictions"] == 0
        later = [r for r in records if r["turn"] > 0 and r["kind"] in ("turn", "subagent")]
        assert later and all(r["seen_tokens"] > 0 for r in later)
        for r in records:
            assert r["recomputed_seen"] == 0 and r["cached_tokens"] >= r["seen_tokens"]
            assert r["device_cached_tokens"] + r["host_cached_tokens"] == r["cached_tokens"]
            assert r["output_tokens"] == params["title_max_tokens" if r["kind"] == "title"
                                                else "max_tokens"]
    printed = capsys.readouterr().out
    assert "machine:" in printed and "X = 33,554,432 bytes" in printed
    assert "recomputed though seen before" in printed and "TTFT p90 s" in printed
