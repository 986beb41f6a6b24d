"""The prefix tracker: a session's next prompt reuses the token ids of its previous
prompt and output where the text matches, and a prompt that does not extend them is
logged once (with where and what) and counted."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from orchestrator.shim.metrics import Metrics
from orchestrator.shim.prefix_tracker import PrefixTracker

EOS = 3
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def tracker(tiny_tokenizer: Tokenizer, metrics: Metrics) -> PrefixTracker:
    return PrefixTracker(tiny_tokenizer, on_break=metrics.count_prefix_break)


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def chars(tok: Tokenizer, text: str) -> list[int]:
    """`text` one byte-level token per character: a valid but non-canonical tokenization
    (what a model sampling freely may produce)."""
    ids = [tok.token_to_id("Ġ" if c == " " else c) for c in text]
    assert None not in ids and tok.decode(ids) == text
    return ids


def breaks(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("deepinfer_prefix_breaks_total") or 0.0


def test_output_that_retokenizes_differently_keeps_its_ids(tracker, tiny_tokenizer, metrics):
    tok = tiny_tokenizer
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n" + TURN.format("hi")
    prompt_ids = enc(tok, prompt)
    output = chars(tok, "hello world") + [EOS]
    tracker.record("s", prompt_ids, prompt, output)

    new = prompt + "hello world<|im_end|>\n" + TURN.format("more")
    canonical = enc(tok, new)
    assert canonical[: len(prompt_ids) + len(output)] != prompt_ids + output  # the trap
    base, rest = tracker.splice("s", new)
    assert base == prompt_ids + output
    assert rest == "\n" + TURN.format("more")
    with capture_logs() as logs:
        assert tracker.check("s", base + enc(tok, rest)) is None
    assert breaks(metrics) == 0 and not [e for e in logs if e["event"] == "prefix_break"]

    # The canonical tokenization is a break, reported where the output starts.
    with capture_logs() as logs:
        index = tracker.check("s", canonical)
    assert index is not None and len(prompt_ids) <= index < len(prompt_ids) + len(output)
    [event] = [e for e in logs if e["event"] == "prefix_break"]
    assert event["log_level"] == "warning"
    assert event["session"] == "s" and event["token_index"] == index and event["in_output"]
    assert breaks(metrics) == 1


def test_output_without_eos_and_the_next_turn(tracker, tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = TURN.format("count")
    output = chars(tok, "one two")  # stopped by max_tokens: no EOS
    tracker.record("s", enc(tok, prompt), prompt, output)
    base, rest = tracker.splice("s", prompt + "one two\n<tool_call>")
    assert base == enc(tok, prompt) + output and rest == "\n<tool_call>"


def test_edited_history_is_one_break_with_both_sides(tracker, tiny_tokenizer, metrics):
    tok = tiny_tokenizer
    prompt = "<|im_start|>system\nToday is Monday. Be brief.<|im_end|>\n" + TURN.format("hi")
    tracker.record("s", enc(tok, prompt), prompt, enc(tok, "Hello!") + [EOS])
    edited = prompt.replace("Monday", "Tuesday") + "Hello!<|im_end|>\n" + TURN.format("x")
    base, rest = tracker.splice("s", edited)
    assert base == [] and rest == edited
    with capture_logs() as logs:
        index = tracker.check("s", enc(tok, edited), request_id="msg_1")
    [event] = [e for e in logs if e["event"] == "prefix_break"]
    assert event["request_id"] == "msg_1" and not event["in_output"]
    assert event["token_index"] == index
    assert "Monday" in event["previous_after"] and "Tuesday" in event["new_after"]
    assert event["before"].endswith("Today is")
    assert breaks(metrics) == 1


def test_retry_and_unknown_session_are_not_breaks(tracker, tiny_tokenizer, metrics):
    tok = tiny_tokenizer
    prompt = TURN.format("hi")
    tracker.record("s", enc(tok, prompt), prompt, enc(tok, "Hey") + [EOS])
    assert tracker.check("s", enc(tok, prompt)) is None  # the same prompt again
    assert tracker.check("other", enc(tok, "anything")) is None
    assert tracker.splice("other", "anything") == ([], "anything")
    assert breaks(metrics) == 0


def test_output_cut_by_a_stop_string_reuses_the_prompt_only(tracker, tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = TURN.format("hi")
    tracker.record("s", enc(tok, prompt), prompt, enc(tok, "Hey STOP more"),
                   output_sent_whole=False)
    new = prompt + "Hey <|im_end|>\n"
    base, rest = tracker.splice("s", new)
    assert base == enc(tok, prompt) and rest == "Hey <|im_end|>\n"
    assert tracker.check("s", base + enc(tok, rest)) is None


def test_invalid_utf8_in_the_output_still_reuses_its_ids(tracker, tiny_tokenizer, metrics):
    """A random model writes bytes that are not UTF-8: the client got U+FFFD for them and
    sends U+FFFD back; the model's own ids still continue the prefix."""
    tok = tiny_tokenizer
    prompt = TURN.format("hi")
    euro = enc(tok, "€")
    assert len(euro) > 1 and "\ufffd" in tok.decode(euro[:-1])
    output = euro[:-1] + enc(tok, " ok") + euro[:-1]  # broken mid-text and at the end
    tracker.record("s", enc(tok, prompt), prompt, output)
    echoed = tok.decode(output)
    assert echoed.count("\ufffd") >= 2
    base, rest = tracker.splice("s", prompt + echoed + "<|im_end|>")
    assert base == enc(tok, prompt) + output and rest == "<|im_end|>"
    assert tracker.check("s", base + enc(tok, rest)) is None and breaks(metrics) == 0


def test_subagent_branches_alternate_without_breaks(tracker, tiny_tokenizer, metrics):
    """Main agent and a subagent share a session id: the subagent's first prompt is one
    break; after that each continues its own branch."""
    tok = tiny_tokenizer
    main = "<|im_start|>system\nMain agent.<|im_end|>\n" + TURN.format("task")
    sub = "<|im_start|>system\nSearch agent.<|im_end|>\n" + TURN.format("find")
    for turn in range(3):
        for text in (main, sub):
            base, rest = tracker.splice("s", text)
            ids = base + enc(tok, rest)
            tracker.check("s", ids)
            out = enc(tok, f"step {turn}") + [EOS]
            tracker.record("s", ids, text, out)
        main += f"step {turn}<|im_end|>\n" + TURN.format("go on")
        sub += f"step {turn}<|im_end|>\n" + TURN.format("go on")
    assert breaks(metrics) == 1


def test_least_recently_used_sessions_are_dropped(tiny_tokenizer):
    tracker = PrefixTracker(tiny_tokenizer, max_sessions=2)
    prompt = TURN.format("hi")
    ids = enc(tiny_tokenizer, prompt)
    for s in ("a", "b", "c"):
        tracker.record(s, ids, prompt, [EOS])
    assert tracker.num_sessions == 2
    assert tracker.splice("a", prompt) == ([], prompt)
    assert tracker.splice("c", prompt)[0] == ids
    small = PrefixTracker(tiny_tokenizer, max_tokens=len(ids) + 1)
    small.record("a", ids, prompt, [EOS])
    small.record("b", ids, prompt, [EOS])
    assert small.num_sessions == 1
