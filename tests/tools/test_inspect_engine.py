"""`deepinfer-inspect` and /metrics against a healthy 4-rank engine (one per module).

The engine has a small device tier and a host tier, so finished prompts fall to host
RAM and come back (swaps), and at most two sequences run at once, so requests wait.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, subprocess_env
from tests.orchestrator.e2e_helpers import complete, stream_complete
from tests.tools.engine import Engine
from wire import codec
from wire.client import GenerateRequest, RequestOutput
from wire.control import PrefixBreak

pytestmark = pytest.mark.slow
BLOCK_BYTES = 8 * 16 * 2 * 64 * 4  # tiny model: 8 layers, 16 tokens, K+V, 1 KV head per rank
COMMANDS = [["ranks"], ["check"], ["seq", "1"], ["cache"], ["queue"], ["trace", "--steps", "4"],
            ["stacks"]]


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    eng = Engine(default_model, tmp_path_factory.mktemp("inspect") / "run",
                 "--kv-cache-memory", str(48 * BLOCK_BYTES), "--max-model-len", "768",
                 "--host-cache-memory", str(256 * BLOCK_BYTES), "--max-num-seqs", "2")
    yield eng
    assert eng.stop() == 0, eng.log()[-3000:]


def prompt(i: int, n: int = 100) -> list[int]:
    return [(i * 131 + j * 7) % 8000 + 10 for j in range(n)]


def in_background(fn, *args, **kwargs) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t


def running_seqs(engine: Engine) -> list[dict]:
    return engine.inspect_json("queue")[1]["running"]


def idle(engine: Engine) -> dict | None:
    status, view = engine.inspect_json("ranks")
    assert status == 0
    procs = [view["scheduler"], *view["ranks"]]
    steps = {p["step"] for p in procs}
    return view if len(steps) == 1 and all(p["state"] == "idle" for p in procs) else None


def test_ranks_and_check_agree_idle_and_while_running(engine):
    for i in range(6):  # more prompts than the device tier holds: some fall to host RAM
        complete(engine.url, prompt=prompt(i, 150), max_tokens=4, temperature=0,
                 ignore_eos=True)
    complete(engine.url, prompt=prompt(0, 150), max_tokens=4, temperature=0, ignore_eos=True)
    view = engine.wait_for("an idle engine", lambda: idle(engine))  # closes run a step later
    sched, ranks = view["scheduler"], view["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["step"] == sched["step"] >= 5 and r["state"] == "idle"
        assert r["seqs"] == [] and r["digest"] == sched["expected_digest"]
        assert set(r["usage"]["device"]) >= {"used", "cached", "free"}
        assert r["usage"]["host"]["cached"] > 0 and r["seconds_since_step"] >= 0
    status, result = engine.inspect_json("check")  # tier contents included
    assert status == 0 and result["agree"] and result["aligned"], result

    t = in_background(stream_complete, engine.url, prompt=prompt(9), max_tokens=120,
                      temperature=0, ignore_eos=True)
    seq = engine.wait_for("a running sequence", lambda: running_seqs(engine))[0]
    status, result = engine.inspect_json("check")
    assert status == 0 and result["agree"], result
    status, view = engine.inspect_json("seq", str(seq["seq_id"]))
    assert status == 0
    sched = view["scheduler"]
    assert sched["found"] and sched["request_id"] == seq["request_id"]
    assert sched["num_prompt_tokens"] == 100
    assert {"num_device_cached_tokens", "num_host_cached_tokens"} <= set(sched)
    for r in view["ranks"]:
        assert r["found"] and r["block_ids"][:len(sched["block_ids"]) - 1] == \
            sched["block_ids"][:-1]  # the engine steps on: the last block may be new
    _, same = engine.inspect_json("seq", seq["request_id"])
    assert same["seq_id"] == seq["seq_id"]
    t.join(timeout=120)


def test_queue_says_why_requests_wait(engine):
    threads = [in_background(complete, engine.url, prompt=prompt(20 + i), max_tokens=60,
                             temperature=0, ignore_eos=True) for i in range(4)]
    def waiting() -> dict | None:
        view = engine.inspect_json("queue")[1]
        return view if any(w["reason"] == "max_num_seqs" for w in view["waiting"]) else None

    view = engine.wait_for("requests waiting for a sequence slot", waiting)
    assert view["num_running"] == 2 and view["max_num_seqs"] == 2
    for w in view["waiting"]:
        # "arrived": came after the last step was planned, not yet seen by one
        assert w["reason"] in ("max_num_seqs", "arrived") and w["age_s"] >= 0
        assert w["num_prompt_tokens"] == 100
    for t in threads:
        t.join(timeout=120)


def test_trace_shows_the_last_plans(engine):
    complete(engine.url, prompt=prompt(30), max_tokens=6, temperature=0, ignore_eos=True)
    status, trace = engine.inspect_json("trace", "--steps", "5")
    plans = trace["plans"]
    assert status == 0 and len(plans) == 5
    assert [p["step"] for p in plans] == list(range(plans[0]["step"], plans[0]["step"] + 5))
    for p in plans:
        assert {"close", "new_seqs", "num_swap_in", "num_swap_out", "num_register",
                "num_prefill_tokens", "num_decode_tokens", "chunks", "duration_s"} <= set(p)
    assert any(p["chunks"] for p in plans)


def test_cache_hit_ratios_sessions_and_prefix_breaks(engine):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)  # a second client of the scheduler, with sessions
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{engine.run_dir}/requests.sock")
    try:
        for turn in range(2):
            req = GenerateRequest(f"sess-a-{turn}", prompt(40, 120 + 40 * turn), 2,
                                  ignore_eos=True, session_id="session-a")
            sock.send(codec.encode(req))
            while not (out := codec.decode(sock.recv())).finished:
                assert isinstance(out, RequestOutput)
        sock.send(codec.encode(PrefixBreak("session-a", "sess-a-1", 112, 160, "edited")))
    finally:
        sock.close()
    view = engine.wait_for("the prefix break",
                           lambda: (v := engine.inspect_json("cache", "--last", "2")[1])
                           ["prefix_breaks"] and v)
    assert view["num_requests"] == 2 and view["num_queried_tokens"] == 280
    assert view["num_device_hit_tokens"] + view["num_host_hit_tokens"] >= 112
    assert view["prefix_breaks"][-1]["num_common_tokens"] == 112
    sessions = {s["session"]: s for s in view["sessions"]}
    assert sessions["session-a"]["num_requests"] == 2
    assert sessions["session-a"]["num_cached_tokens"] >= 112
    assert {"num_device_evictions", "num_host_evictions", "num_swap_in_blocks"} <= \
        set(view["totals"])
    done = [e for e in engine.events("request_done") if e.get("role") == "scheduler"]
    last = next(e for e in done if e["request_id"] == "sess-a-1")
    assert last["session"] == "session-a" and last["prompt_tokens"] == 160
    assert {"device_cached_tokens", "host_cached_tokens", "ttft_s", "itl_s", "queue_s",
            "e2e_s", "step"} <= set(last)
    assert len([e for e in done if e["request_id"] == "sess-a-1"]) == 1


def test_stacks_of_every_process(engine):
    status, view = engine.inspect_json("stacks")
    assert status == 0
    for proc in [view["scheduler"], *view["ranks"]]:
        assert "main.py" in proc["threads"]["MainThread"]
    assert [r["rank"] for r in view["ranks"]] == [0, 1, 2, 3]


def test_every_command_renders_in_80_columns_and_its_json_parses(engine):
    t = in_background(complete, engine.url, prompt=prompt(50), max_tokens=40, temperature=0,
                      ignore_eos=True)
    engine.wait_for("a running sequence", lambda: running_seqs(engine))
    for args in COMMANDS:
        status, text = engine.inspect(*args)
        assert status in (0, 1), (args, text)
        assert text.strip() and max(map(len, text.splitlines())) <= 80, (args, text)
        engine.inspect_json(*args)  # parses
    t.join(timeout=120)


def test_console_script_entry_point(engine):
    setup = (REPO / "setup.cfg").read_text()
    assert "deepinfer-inspect = tools.inspector:main" in setup
    out = subprocess.run([sys.executable, "-m", "tools.inspector", "ranks"], cwd=REPO,
                         env=subprocess_env(DEEPINFER_RUN_DIR=str(engine.run_dir), COLUMNS="80"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rank 3" in out.stdout and "scheduler" in out.stdout


def scrape(engine: Engine) -> dict[tuple, float]:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_and_move_as_requests_are_served(engine):
    before = scrape(engine)
    stream_complete(engine.url, prompt=prompt(60), max_tokens=8, temperature=0,
                    ignore_eos=True)
    after = scrape(engine)

    def moved(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    assert moved("deepinfer_time_to_first_token_seconds_count") == 1
    assert moved("deepinfer_inter_token_latency_seconds_count") == 7
    assert moved("deepinfer_requests_total", ("finish_reason", "length")) == 1
    assert moved("deepinfer_request_queue_time_seconds_count") == 1
    assert moved("deepinfer_step_duration_seconds_count") >= 8
    assert moved("deepinfer_step_tokens_sum", ("kind", "decode")) == 7
    assert moved("deepinfer_scheduled_tokens_total", ("kind", "prefill")) >= 100
    assert moved("deepinfer_prefix_cache_queried_tokens_total") == 100
    assert moved("deepinfer_steps_total") >= 8
    for name in ("deepinfer_rank_digest_mismatches_total", "deepinfer_prefix_breaks_total",
                 "deepinfer_num_requests_waiting"):
        assert (name, ()) in after
    assert ("deepinfer_kv_blocks", (("state", "cached"), ("tier", "host"))) in after
