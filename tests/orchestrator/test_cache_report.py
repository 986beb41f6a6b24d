"""The cache report a client gets (orchestrator/shim/cache_report.py): the
`x-deepinfer-cache` header on every generating endpoint, as JSON and as a stream, the
comment that ends an OpenAI stream, what a stream opened before the engine's first output
says, the official SDKs reading such streams, and the counter on /metrics."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from orchestrator.shim.metrics import Metrics
from orchestrator.shim.server import build_app
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_vllm_metrics import snapshot
from tests.scheduler.test_miss_reasons_scheduler import HISTORY, make, serve
from wire.client import UncachedTokens

WHY = UncachedTokens(evicted=48, block_remainder=3, evicted_tier="host", evicted_age_s=312.46,
                     evicted_by="write_back")
REPORT = ("reason=evicted; evicted=48; block_remainder=3; evicted_tier=host; "
          "evicted_age_s=312.5; evicted_by=write_back")
HELLO = [{"role": "user", "content": "hi"}]
# path, body: one request of each generating endpoint
ENDPOINTS = {
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 20, "messages": HELLO}),
    "chat": ("/v1/chat/completions", {"model": "m", "max_tokens": 20, "messages": HELLO}),
    "completions": ("/v1/completions", {"model": "m", "max_tokens": 20, "prompt": "hi"}),
    "responses": ("/v1/responses", {"model": "m", "max_output_tokens": 20, "input": "hi"}),
}


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=4096)


def make_client(engine, tokenizer, template, ping_interval_s: float = 5.0) -> TestClient:
    app = build_app(engine, tokenizer, model_name="tiny", chat_template=template,
                    ping_interval_s=ping_interval_s)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        yield c


def prompt_tokens(engine: ScriptedEngine) -> int:
    return len(engine.requests[-1].prompt_token_ids)


@pytest.mark.parametrize("api", ENDPOINTS)
def test_a_json_answer_says_what_was_cached_and_why_the_rest_was_not(client, engine, api):
    path, body = ENDPOINTS[api]
    engine.script("Hello there.", num_device_cached=16, uncached=WHY)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    n = prompt_tokens(engine)
    assert r.headers["x-deepinfer-cache"] == f"cached=16; recomputed={n - 16}; {REPORT}"


@pytest.mark.parametrize("api", ENDPOINTS)
def test_a_stream_has_the_header_and_an_openai_one_ends_with_it(client, engine, api):
    path, body = ENDPOINTS[api]
    engine.script("Hello there.", num_device_cached=16, uncached=WHY)
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    header = f"cached=16; recomputed={prompt_tokens(engine) - 16}; {REPORT}"
    assert r.headers["x-deepinfer-cache"] == header
    comments = [line for line in r.text.split("\n") if line.startswith(": x-deepinfer-cache")]
    if api == "messages":  # every Anthropic event has its event line: no comment there
        assert comments == []
        return
    assert comments == [f": x-deepinfer-cache: {header}"]
    # before the closing events: the finish reason, usage, [DONE] / response.completed
    closing = r.text[r.text.index(comments[0]):]
    assert ("[DONE]" in closing) or ("response.completed" in closing)


def test_a_stream_opened_before_the_first_output_has_no_header(engine, tiny_tokenizer,
                                                               tiny_template):
    """Opened on a keep-alive while the request waited: the figures were not known, so
    no header rather than a guess; the closing comment has them."""
    engine.script("slow", delay_s=0.3, uncached=WHY)
    with make_client(engine, tiny_tokenizer, tiny_template, ping_interval_s=0.1) as c:
        r = c.post("/v1/chat/completions", json={**ENDPOINTS["chat"][1], "stream": True})
    assert r.status_code == 200 and ": ping" in r.text
    assert "x-deepinfer-cache" not in r.headers
    assert f": x-deepinfer-cache: cached=0; recomputed={prompt_tokens(engine)}; {REPORT}" \
        in r.text


def test_without_prefix_caching_the_counts_come_without_a_reason(client, engine):
    engine.script("Hi.")  # no reasons: the engine caches nothing
    r = client.post("/v1/completions", json=ENDPOINTS["completions"][1])
    assert r.headers["x-deepinfer-cache"] == f"cached=0; recomputed={prompt_tokens(engine)}"
    engine.script("Hi.")
    r = client.post("/v1/completions", json={**ENDPOINTS["completions"][1], "stream": True})
    assert "x-deepinfer-cache" not in r.headers  # never known while it ran
    assert f": x-deepinfer-cache: cached=0; recomputed={prompt_tokens(engine)}\n" in r.text


def test_the_sdks_read_the_streams_as_before(client, engine):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    engine.script("Hello there.", uncached=WHY)
    chunks = list(sdk.chat.completions.create(model="m", messages=HELLO, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello there."
    assert chunks[-1].usage.prompt_tokens == prompt_tokens(engine)
    engine.script("Hello there.", uncached=WHY)
    events = list(sdk.responses.create(model="m", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    engine.script("Hello there.", uncached=WHY)
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client,
                                 max_retries=0)
    with claude.messages.stream(model="m", max_tokens=20, messages=HELLO) as s:
        assert "".join(s.text_stream) == "Hello there."


def test_metrics_count_the_uncached_tokens_by_reason():
    """deepinfer_prompt_tokens_uncached_total{reason}: the scheduler's counters (a real
    scheduler and cache, no ranks), through the shim's /metrics exposition."""
    sched = make(num_blocks=20)
    serve(sched, "a", HISTORY, session="s")
    edited = list(HISTORY)
    edited[100] = 999
    serve(sched, "b", edited, session="s")
    for i in range(2):
        serve(sched, f"other{i}", list(range(300 + 150 * i, 450 + 150 * i)))
    serve(sched, "c", HISTORY, session="s")
    text = Metrics().render(snapshot(sched)).decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "deepinfer_prompt_tokens_uncached"]
    got = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    stats = sched.cache.stats
    assert got == {r: getattr(stats, f"num_uncached_{r}_tokens") for r in got}
    assert set(got) == {"evicted", "diverged", "compaction", "salt", "no_room", "no_state",
                        "new", "block_remainder"}
    assert got["new"] > 0 and got["diverged"] > 0 and got["evicted"] > 0
    assert sum(got.values()) == stats.num_queried_tokens - stats.num_device_hit_tokens


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_where_the_time_went_ends_a_stream_and_heads_a_json_answer(client, engine, api):
    """x-deepinfer-timing: the engine's queue and prefill seconds, and the decode as the
    shim saw it (a trace benchmark's slow turns are split by it)."""
    path, body = ENDPOINTS[api]
    engine.script("Hello there.", queue_s=1.25, prefill_s=0.5)
    r = client.post(path, json={**body, "stream": True})
    [line] = [x for x in r.text.split("\n") if x.startswith(": x-deepinfer-timing: ")]
    assert line.startswith(": x-deepinfer-timing: queue_s=1.250; prefill_s=0.500; decode_s=")
    engine.script("Hello there.", queue_s=2.0, prefill_s=0.25)
    r = client.post(path, json=body)
    assert r.headers["x-deepinfer-timing"].startswith("queue_s=2.000; prefill_s=0.250; ")


def test_the_engine_times_each_request_from_arrival_to_admission_and_first_token():
    from wire.client import GenerateRequest

    s = make(max_num_seqs=1)
    s.add_request(GenerateRequest("a", list(range(10, 30)), 3))
    s.add_request(GenerateRequest("b", list(range(40, 60)), 3))
    outs = {}
    while s.has_work():
        plan = s.schedule()
        outs.update({o.request_id: o for o in s.update(
            plan, [(c.seq_id, 7) for c in plan.batch() if c.sample]) if o.finished})
    assert outs["b"].queue_s > outs["a"].queue_s >= 0  # b waited for a's end
    assert outs["a"].prefill_s > 0 and outs["b"].prefill_s > 0
