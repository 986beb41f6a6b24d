"""Reasoning in model output: the `<think>...</think>` span that Qwen3, QwQ and the
DeepSeek-R1 family write before their answer, split from the streamed text so the
client gets it as reasoning (Anthropic `thinking` blocks, OpenAI `reasoning_content`)
and the answer alone goes on to the tool-call parser.

    think        <think> reasoning </think> answer
                 (the opening tag may be in the prompt: R1's template ends its
                 generation prompt with it, and then the output starts inside)
    none         no reasoning: everything is answer

Like the tool parsers, a splitter holds back what may be the start of a tag, and never
fails: an unclosed reasoning span is reasoning to the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from orchestrator.shim.tool_parsers import partial_suffix

REASONING_PARSERS = ("none", "think", "qwen3", "deepseek_r1")  # the last two: vLLM's names
OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Reasoning:
    text: str


@dataclass
class Answer:
    text: str


class ThinkSplitter:
    """Streamed text -> Reasoning and Answer pieces."""

    def __init__(self, *, inside: bool = False, strip_answer: bool = False) -> None:
        # "start": the output may still open a span; "inside" it; "after_close": the
        # whitespace after it (dropped); "answer"
        self._state = "inside" if inside else "start"
        self._buf = ""
        # an answer without a span before it loses its leading whitespace too (a format's
        # grammar lets the answer start with what would follow a span)
        self._strip_answer = strip_answer

    def feed(self, text: str) -> list[Reasoning | Answer]:
        self._buf += text
        out: list[Reasoning | Answer] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._buf, self._state = head[len(OPEN):], "inside"
            elif OPEN.startswith(head):  # may still become the opening tag
                return out
            else:
                self._state = "answer"
                self._buf = head if self._strip_answer else self._buf
        if self._state == "inside":
            end = self._buf.find(CLOSE)
            if end < 0:
                cut = len(self._buf) - partial_suffix(self._buf, CLOSE)
                thought, self._buf = self._buf[:cut], self._buf[cut:]
                return out + ([Reasoning(thought)] if thought else [])
            thought, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
            self._state = "after_close"
            if thought:
                out.append(Reasoning(thought))
        if self._state == "after_close":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._state = "answer"
        rest, self._buf = self._buf, ""
        return out + ([Answer(rest)] if rest else [])

    def finish(self) -> list[Reasoning | Answer]:
        rest, self._buf = self._buf, ""
        if not rest or self._state == "after_close":
            return []
        return [Reasoning(rest) if self._state == "inside" else Answer(rest)]


class NoReasoning:
    def feed(self, text: str) -> list[Reasoning | Answer]:
        return [Answer(text)] if text else []

    def finish(self) -> list[Reasoning | Answer]:
        return []


def make_splitter(name: str, prompt: str, *,
                  strip_answer: bool = False) -> ThinkSplitter | NoReasoning:
    """The splitter for a `--reasoning-parser`; `prompt`: the text the output continues
    (a prompt ending in the opening tag starts the output inside the span)."""
    if name == "none":
        return NoReasoning()
    if name in ("think", "qwen3", "deepseek_r1"):
        return ThinkSplitter(inside=opens_in(prompt), strip_answer=strip_answer)
    raise ValueError(f"unknown reasoning parser {name!r} (choose from {REASONING_PARSERS})")


def think_tag_ids(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """<think> and </think> as token ids, for the engine to follow the span by (it counts
    its tokens and ends it at a budget: scheduler/thinking.py); None where a tag is not a
    single token, or is a special one, which the detokenizer drops from the text (the
    splitter would never see the span the engine follows)."""
    start, end = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
    added = tokenizer.get_added_tokens_decoder()
    if start is None or end is None or any(
            added[i].special for i in (start, end) if i in added):
        return None
    return start, end


def opens_in(prompt: str) -> bool:
    """The prompt opened the span (R1's template ends its generation prompt with the
    tag): the output starts inside it."""
    return prompt.rstrip().endswith(OPEN)
