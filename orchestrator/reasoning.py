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

from orchestrator.tool_parsers import partial_suffix
from scheduler.protocol import ThinkingSpan

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

    @property
    def inside(self) -> bool:
        return self._state == "inside"

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
        return ThinkSplitter(inside=prompt.rstrip().endswith(OPEN), strip_answer=strip_answer)
    raise ValueError(f"unknown reasoning parser {name!r} (choose from {REASONING_PARSERS})")


def thinking_span(tokenizer: Tokenizer, splitter: ThinkSplitter | NoReasoning,
                  budget: int | None) -> ThinkingSpan | None:
    """The span for the engine to follow, by token ids, before the splitter has read
    anything: the engine counts its tokens (`reasoning_tokens`) and ends it after
    `budget` of them (scheduler/thinking.py). None without reasoning, or where a tag is
    not a single token of the model's vocabulary (then nothing is counted or capped)."""
    if not isinstance(splitter, ThinkSplitter):
        return None
    start, end = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
    added = tokenizer.get_added_tokens_decoder()
    if start is None or end is None or any(
            added[i].special for i in (start, end) if i in added):
        return None  # a special tag is dropped from the text: the splitter would not see it
    return ThinkingSpan(start, end, inside=splitter.inside, budget=budget)
