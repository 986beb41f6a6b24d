"""Incremental detokenization and stop-string matching for streamed output.

Tokens arrive a few at a time; the text sent to the client must be exactly the text of
all tokens decoded at once, cut at the first stop string. Two things make that subtle:

- A byte-level BPE token can hold part of a UTF-8 character: decoding it alone gives
  U+FFFD. Such text is held back until the next tokens complete the character.
- A stop string can span tokens, and while streaming, the tail of the text may be the
  beginning of a stop string. That tail is held back until it either completes the stop
  string (then it is dropped) or can no longer be one (then it is sent).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens that seed the decode window: SentencePiece-style decoders strip a
# leading space at the start of a decode, so the first output token needs left context.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDecoder:
    """Turns token ids, fed a few at a time, into text deltas.

    Decodes a small window `ids[prefix_offset:]` and emits what it adds beyond the text
    of `ids[prefix_offset:read_offset]` (already emitted), so each step costs O(window),
    not O(output): 100K-token outputs are never re-decoded whole.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)  # the text of ids before this has been sent
        self._sent_in_window = 0  # chars sent beyond that, before an incomplete character
        self.num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the new text, never ending in a partial character."""
        self._ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the output: the text still held back (an incomplete character
        the model never completed is emitted as U+FFFD, as a full decode would)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD is (almost always) a character whose last bytes have not
        # arrived: send the text before it now, the character once it is complete.
        end = len(new_text) if final else len(new_text.rstrip(REPLACEMENT_CHAR))
        start = len(prefix_text) + self._sent_in_window
        if end <= start:
            return ""  # e.g. a skipped special token, or only bytes of a character so far
        delta = new_text[start:end]
        if end == len(new_text):
            # Everything decoded is complete: the next window starts here.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._sent_in_window = 0
        else:
            self._sent_in_window += len(delta)
        return delta


class StopMatcher:
    """Finds the first stop string in streamed text, across chunk boundaries."""

    def __init__(self, stop: list[str]) -> None:
        # An empty stop string would match everywhere; it means nothing, so it is dropped.
        self.stop = [s for s in stop if s]
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the part of `text` (after what was held) that is safe to send.

        After a match it returns the text before the stop string, sets `stopped`, and
        ignores all later input.
        """
        if self.stopped:
            return ""
        if not self.stop:
            return text
        buf = self._held + text
        # The match that ends first wins (ties: the one that starts first): that is the
        # one a token-by-token stream completes first, so the result does not depend on
        # how tokens were grouped into outputs. A match cannot start in text already
        # sent: any suffix that could begin a stop string was held.
        first: tuple[int, int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i != -1 and (first is None or (i + len(s), i) < first[:2]):
                first = (i + len(s), i, s)
        if first is not None:
            self.stopped = True
            self.matched = first[2]
            self._held = ""
            return buf[: first[1]]
        keep = self._partial_match_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the output, the held tail was never a stop string: send it."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: `text` ends just before it; nothing follows


class Detokenizer:
    """IncrementalDecoder + StopMatcher: token ids in, text safe to stream out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.decoder = IncrementalDecoder(
            tokenizer, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids
        )
        self.matcher = StopMatcher(stop or [])
        self.text = ""  # everything returned so far

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def add(self, token_ids: list[int]) -> TextDelta:
        if self.matcher.stopped:
            return TextDelta("", True)
        return self._emit(self.matcher.feed(self.decoder.add(token_ids)))

    def finish(self) -> TextDelta:
        """The output ended (EOS, length, ...): release everything held back."""
        if self.matcher.stopped:
            return TextDelta("", True)
        text = self.matcher.feed(self.decoder.flush())
        if not self.matcher.stopped:
            text += self.matcher.flush()
        return self._emit(text)

    def _emit(self, text: str) -> TextDelta:
        self.text += text
        return TextDelta(text, self.matcher.stopped)
