"""Incremental detokenization: streamed text equals the full decode, never shows a partial
UTF-8 character, and stops at stop strings that span tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from orchestrator.shim.detokenizer import Detokenizer, IncrementalDecoder, StopMatcher

TEXTS = [
    "Hello world",
    "héllo wörld — 😀 done",
    "日本語のテキスト and ASCII",
    "emoji 👩‍💻 sequence",
    "def main():\n    return 0\n",
]


def stream(tokenizer: Tokenizer, ids: list[int], chunk: int = 1, **kw) -> list[str]:
    detok = Detokenizer(tokenizer, **kw)
    deltas = [detok.add(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish().text)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_text_before_an_incomplete_character_is_not_held(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab😀c").ids
    dec = IncrementalDecoder(tokenizer)
    assert dec.add(ids[:4]) == "ab"  # "ab" + 2 of the emoji's 4 bytes in one output
    assert dec.add(ids[4:5]) == ""
    assert dec.add(ids[5:]) == "😀c"
    assert dec.flush() == ""


def test_multibyte_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀b").ids
    # The test tokenizer has no merges for non-ASCII: the emoji is 4 byte tokens.
    assert len(ids) == 6
    dec = IncrementalDecoder(tokenizer)
    assert dec.add(ids[:1]) == "a"
    assert [dec.add([t]) for t in ids[1:4]] == ["", "", ""]  # 3 of the emoji's 4 bytes
    assert dec.add(ids[4:5]) == "😀"
    assert dec.add(ids[5:]) == "b"
    assert dec.flush() == ""


def test_incomplete_character_at_end_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x😀").ids[:-1]  # the model stopped mid-character
    dec = IncrementalDecoder(tokenizer)
    assert dec.add(ids) == "x"
    assert dec.flush() == tokenizer.decode(ids)[1:]
    assert dec.flush() == ""


def test_invalid_bytes_mid_text_are_not_held_forever(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("😀").ids
    ids = emoji[:2] + tokenizer.encode("ok").ids  # broken UTF-8 followed by text
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1] == ""  # released as soon as later text showed it could not complete


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    end = tokenizer.token_to_id("<|end|>")
    ids = tokenizer.encode("Hello").ids + [end]
    assert "".join(stream(tokenizer, ids)) == "Hello"
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "Hello<|end|>"


def test_prompt_context_does_not_change_the_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The quick brown ").ids
    ids = tokenizer.encode("fox 😀 jumps").ids
    deltas = stream(tokenizer, ids, prompt_token_ids=prompt)
    assert "".join(deltas) == "fox 😀 jumps"


# --- stop strings ------------------------------------------------------------------------


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    text = "Hello world, hello there."
    ids = tokenizer.encode(text).ids
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "ld, he" not in pieces  # the stop string starts inside one token, ends in another
    detok = Detokenizer(tokenizer, stop=["ld, he"])
    out = []
    for t in ids:
        delta = detok.add([t])
        out.append(delta.text)
        if delta.stopped:
            break
    assert detok.stopped and detok.matcher.matched == "ld, he"
    assert "".join(out) == detok.text == "Hello wor"
    # After the match, nothing more comes out.
    assert detok.add(ids[-1:]).text == "" and detok.finish().text == ""


def test_stop_string_inside_a_multibyte_run(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc 😀😁 def").ids
    deltas = stream(tokenizer, ids, stop=["😁"])
    assert "".join(deltas) == "abc 😀"


def test_first_completed_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four").ids
    for chunk in (1, len(ids)):
        assert "".join(stream(tokenizer, ids, chunk, stop=["four", "two", "three"])) == "one "
        assert "".join(stream(tokenizer, ids, chunk, stop=["four", "e t"])) == "on"
        # "one two" starts first but "two" is complete first, whatever the chunking.
        assert "".join(stream(tokenizer, ids, chunk, stop=["one two three", "two"])) == "one "


def test_no_match_releases_everything_at_finish(tokenizer: Tokenizer) -> None:
    text = "Hello world, hello there."
    ids = tokenizer.encode(text).ids
    assert "".join(stream(tokenizer, ids, stop=["there!"])) == text
    assert "".join(stream(tokenizer, ids, stop=["."])) == "Hello world, hello there"


def test_hold_back_while_streaming() -> None:
    m = StopMatcher(["STOP", "END!"])
    assert m.feed("abc S") == "abc "  # "S" may begin STOP
    assert m.feed("T") == ""  # "ST"
    assert m.feed("ART") == "START"  # not STOP after all: released
    assert m.feed("EN") == ""  # may begin END!
    assert m.feed("D") == ""
    assert m.feed("ING") == "ENDING"
    assert m.feed(" xx STO") == " xx "
    assert m.feed("P and more") == ""
    assert m.stopped and m.matched == "STOP"
    assert m.feed("later") == "" and m.flush() == ""


def test_held_tail_is_released_at_finish() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("the end: STO") == "the end: "
    assert m.flush() == "STO"
    assert not m.stopped


def test_overlapping_prefixes_hold_the_longest_candidate() -> None:
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == "x"
    assert m.feed("a") == "a"  # "aaa": only the last "aa" may still begin "aab"
    assert m.feed("b") == ""
    assert m.stopped


def test_empty_stop_strings_are_ignored() -> None:
    m = StopMatcher(["", "Z"])
    assert m.feed("abc") == "abc"
    assert not m.stopped


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_gives_same_text_for_any_chunking(tokenizer: Tokenizer, chunk: int) -> None:
    text = "Hello world, hello there. The quick brown fox."
    ids = tokenizer.encode(text).ids
    got = "".join(stream(tokenizer, ids, chunk, stop=["the", "quick"]))
    assert got == "Hello world, hello "


# --- properties: any text, any chunking ---------------------------------------------------

ALPHABET = "ab .,\nSTOPé😀日"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_streaming_matches_one_shot_decode(
    tokenizer: Tokenizer, text: str, cuts: list[int], stop: list[str]
) -> None:
    """Streamed in any chunks, the output is the full decode cut at its first stop string,
    and no delta ever shows a replacement character."""
    ids = tokenizer.encode(text).ids
    detok = Detokenizer(tokenizer, stop=stop)
    deltas, i, k = [], 0, 0
    while i < len(ids) and not detok.stopped:
        n = cuts[k % len(cuts)]
        deltas.append(detok.add(ids[i : i + n]).text)
        i, k = i + n, k + 1
    deltas.append(detok.finish().text)
    full = tokenizer.decode(ids)
    # Cut before the stop string that a character-by-character stream completes first.
    hits = [(full.find(s) + len(s), full.find(s)) for s in stop if s in full]
    expected = full[: min(hits)[1]] if hits else full
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)
