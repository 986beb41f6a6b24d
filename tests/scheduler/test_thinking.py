"""The thinking span on the engine's side (scheduler/thinking.py): followed token by
token, counted, and ended by the engine when it reaches its budget. The random-weight
model never writes the end tag by itself, so every span here that ends was ended by
its budget."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from orchestrator.shim.structured_output import after_reasoning, json_grammar
from scheduler.scheduler import RequestRejected
from scheduler.thinking import ThinkingBudget
from tests.scheduler.engine_harness import inprocess_engine, run_until_done
from tests.scheduler.test_guided import SCHEMA, check_weather
from wire.client import GenerateRequest, ThinkingSpan

THINK, END = 6, 7  # the tiny tokenizer's <think> and </think>
PROMPT = list(range(40, 90))


def mask_tokens(mask: bytes) -> set[int]:
    """The tokens a mask allows."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def FREE() -> None:  # noqa: N802 -- the answer's mask: none (no grammar)
    return None


def ONLY_50() -> bytes:  # noqa: N802 -- the answer's mask: a grammar allowing token 50
    mask = bytearray(16)
    mask[50 // 8] |= 1 << (50 % 8)
    return bytes(mask)


def test_the_span_opens_with_the_first_token_counts_and_ends_at_its_budget() -> None:
    span = ThinkingBudget(ThinkingSpan(THINK, END, budget=2), vocab_size=100)
    assert span.mask(FREE) is None
    assert mask_tokens(span.mask(ONLY_50)) == {50, THINK}  # a grammar's, or the span
    assert span.accept(THINK)  # opens: the answer's first token
    for token in (50, 51):
        assert span.mask(ONLY_50) is None  # inside, the grammar waits
        assert span.accept(token)
    assert mask_tokens(span.mask(ONLY_50)) == {END} and span.num_tokens == 2
    assert span.accept(END)
    assert mask_tokens(span.mask(ONLY_50)) == {50}  # the answer: the grammar's alone
    for token in (THINK, 50, 51, 52):  # the span is over: a later tag is text
        assert not span.accept(token)
    assert span.mask(FREE) is None and span.num_tokens == 2


def test_a_start_tag_after_the_first_token_is_text_and_no_budget_only_counts() -> None:
    late = ThinkingBudget(ThinkingSpan(THINK, END, budget=1), vocab_size=100)
    assert not any(late.accept(token) for token in (50, THINK, 51, 52))
    assert late.mask(FREE) is None and late.num_tokens == 0
    assert mask_tokens(late.mask(ONLY_50)) == {50}
    uncapped = ThinkingBudget(ThinkingSpan(THINK, END, inside=True), vocab_size=100)
    for token in range(50, 90):
        uncapped.accept(token)
    assert uncapped.mask(FREE) is None and uncapped.num_tokens == 40


def test_the_engine_ends_a_span_at_its_budget(default_model) -> None:
    """Greedy: the capped request writes what the free one writes until its budget is
    spent, then the end tag, then goes on answering; reasoning tokens are reported."""
    core = inprocess_engine(default_model)
    requests = [
        GenerateRequest("free", PROMPT, max_tokens=12),
        GenerateRequest("capped", PROMPT, max_tokens=12,
                        thinking=ThinkingSpan(THINK, END, inside=True, budget=5)),
        GenerateRequest("counted", PROMPT, max_tokens=12,
                        thinking=ThinkingSpan(THINK, END, inside=True)),
    ]
    outputs: dict[str, list] = {}
    for req in requests:
        core.scheduler.add_request(req)
    while core.has_work():
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    tokens = {rid: [t for out in outs for t in out.token_ids] for rid, outs in outputs.items()}
    assert END not in tokens["free"]
    assert tokens["capped"][:5] == tokens["free"][:5] and tokens["capped"][5] == END
    assert len(tokens["capped"]) == 12 and END not in tokens["capped"][6:]
    assert tokens["counted"] == tokens["free"]  # counting alone changes nothing
    reported = {rid: outs[-1].num_reasoning_tokens for rid, outs in outputs.items()}
    assert reported == {"free": 0, "capped": 5, "counted": 12}
    # the mask went out once, with the sample after the fifth reasoning token
    masks = [mask_tokens(c.allowed) for plan in core.executor.plans for c in plan.batch()
             if c.allowed is not None]
    assert masks == [{END}]


def test_a_grammar_holds_the_answer_after_the_span(default_model) -> None:
    """A reasoning model asked for a format thinks first (here: until its budget), then
    answers in the format: the grammar (the shim's, which lets the answer start with
    the whitespace after a span) sees only the answer's tokens. A span the prompt did
    not open may open with the first token, or the answer starts at once."""
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    core = inprocess_engine(default_model)
    answer_grammar = after_reasoning(json_grammar(SCHEMA, "response_format"))
    requests = [GenerateRequest(f"inside={inside}", PROMPT, max_tokens=200,
                                grammar=answer_grammar,
                                thinking=ThinkingSpan(THINK, END, inside=inside, budget=4))
                for inside in (True, False)]
    out = run_until_done(core, requests)
    for rid, res in out.items():
        tokens = res["tokens"]
        assert res["finish_reason"] == "stop", (rid, res)
        if END in tokens:
            span = tokens.index(END)
            assert span == (4 if rid == "inside=True" else 5), (rid, tokens)
            tokens = tokens[span + 1:]
        check_weather(tokenizer.decode(tokens))
    # a stop token inside the span ends it, and is not reasoning
    capped = out["inside=True"]["tokens"]
    stop = run_until_done(inprocess_engine(default_model), [GenerateRequest(
        "stop", PROMPT, max_tokens=20, stop_token_ids=[capped[2]],
        thinking=ThinkingSpan(THINK, END, inside=True))])["stop"]
    assert stop["finish_reason"] == "stop" and stop["tokens"][-1] == capped[2]
    assert stop["reasoning"] == len(stop["tokens"]) - 1


def test_a_span_with_a_tag_outside_the_vocabulary_is_refused(default_model) -> None:
    core = inprocess_engine(default_model)
    bad = GenerateRequest("bad", PROMPT, max_tokens=2,
                          thinking=ThinkingSpan(THINK, 10**9, budget=1))
    with pytest.raises(RequestRejected, match="vocabulary"):
        core.scheduler.add_request(bad)
    assert run_until_done(core, [GenerateRequest("ok", PROMPT, max_tokens=2)])["ok"][
        "finish_reason"] == "length"
