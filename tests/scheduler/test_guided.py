"""Guided decoding on the real scheduler and model: the random-weight model's output,
which is otherwise never JSON, follows the request's grammar, greedy and sampled; the
mask touches only its own request; a grammar that does not compile is refused."""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import Tokenizer

from tests.scheduler.engine_harness import inprocess_engine, run_until_done, zmq_engine
from wire.client import GenerateRequest, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "units": {"enum": ["metric", "imperial"]}},
    "required": ["city", "days", "units"], "additionalProperties": False}
PROMPT = list(range(40, 90))


def grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": False})


def check_weather(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "days", "units"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert 1 <= value["days"] <= 9 and value["units"] in ("metric", "imperial")


def test_output_follows_the_schema(default_model) -> None:
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    core = inprocess_engine(default_model)
    requests = [
        GenerateRequest("free", PROMPT, max_tokens=24),
        GenerateRequest("greedy", PROMPT, max_tokens=200, grammar=grammar(SCHEMA)),
        *(GenerateRequest(f"sampled-{seed}", PROMPT, max_tokens=200, grammar=grammar(SCHEMA),
                          sampling=SamplingParams(temperature=1.0, seed=seed))
          for seed in range(3)),
    ]
    out = run_until_done(core, requests)
    for rid in ("greedy", "sampled-0", "sampled-1", "sampled-2"):
        assert out[rid]["finish_reason"] == "stop", out[rid]
        check_weather(tokenizer.decode(out[rid]["tokens"]))
    # the guided rows' masks left the free request's greedy tokens as they are alone
    alone = run_until_done(inprocess_engine(default_model),
                           [GenerateRequest("free", PROMPT, max_tokens=24)])
    assert out["free"]["tokens"] == alone["free"]["tokens"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(alone["free"]["tokens"]))
    # the mask went to the ranks with the sampled chunk only
    chunks = [c for plan in core.executor.plans for c in plan.batch()]
    assert all((c.allowed is not None) == c.sample for c in chunks if c.seq_id != 1)
    assert all(c.allowed is None for c in chunks if c.seq_id == 1)


def test_grammars_compile_off_the_loop_and_a_bad_one_fails_only_its_request(default_model):
    """A grammar compiles in a thread while its request waits in the queue; one that does
    not compile ends that request with an invalid_request error (a 400), and the engine
    goes on with the others."""
    core = inprocess_engine(default_model)
    bad = llguidance.LLMatcher.grammar_from_lark('start: "a" undefined_rule')
    core.scheduler.add_request(GenerateRequest("bad", PROMPT, max_tokens=5, grammar=bad))
    assert core.scheduler.sequence("bad").guide_pending is not None  # not compiled inline
    failed = [o for _ in range(3) for o in core.step().outputs if o.request_id == "bad"]
    assert [(o.finish_reason, o.error_type) for o in failed] == [("error", "invalid_request")]
    assert "grammar" in failed[0].error
    out = run_until_done(core, [GenerateRequest("good", PROMPT, max_tokens=200,
                                                grammar=grammar(SCHEMA))])
    assert out["good"]["finish_reason"] == "stop" and not core.scheduler.has_work()


def test_guided_across_ranks(default_model) -> None:
    """At world size 2 the mask rides in the plan every rank receives; rank 0 applies it."""
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    with zmq_engine(default_model, 2) as core:
        out = run_until_done(core, [GenerateRequest("g", PROMPT, max_tokens=200,
                                                    grammar=grammar(SCHEMA))])
    check_weather(tokenizer.decode(out["g"]["tokens"]))


def test_a_tokenizer_guided_decoding_cannot_read_refuses_the_request(tmp_path) -> None:
    """Not the engine: the scheduler answers that request with a 400 and goes on."""
    from scheduler.guided import GrammarError, GuideFactory

    with pytest.raises(GrammarError, match="unavailable for this model's tokenizer"):
        GuideFactory(str(tmp_path), 100, [3]).guide(grammar(SCHEMA))
