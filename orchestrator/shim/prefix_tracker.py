"""Per-session prompt memory: keeps the prefix cache hitting, and says when it cannot.

An agent resends its whole conversation each step: the new prompt should be the
previous prompt, plus the model's output, plus new turns. Two things make it miss:

- the rendered text changed earlier (a timestamp, a reordered block, an edited
  message): nothing here can fix that, but it must not go unnoticed;
- the text is the same but tokenizes differently: the model's own tokens, decoded and
  re-encoded, need not come back as the same ids (BPE has many tokenizations of one
  string, and the boundary between prompt and output merges differently).

So for each session the tracker keeps the token ids of the last prompt and its output
(up to `BRANCHES` of them: subagents share a session with the main agent). A new
prompt whose text starts with one of those texts reuses its token ids and tokenizes
only the rest (`splice`): the prefix matches token for token, and a 450K-token prompt
is not re-tokenized each step. A prompt that extends none of them is a prefix break:
`check` logs one `prefix_break` warning with the session, the token index where the
new prompt leaves the old one and the text on both sides, and counts it.

Memory: ids as int32 arrays (4 bytes a token); texts are kept as length + digest only.
Least recently used sessions are dropped beyond `max_sessions` or `max_tokens`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog
from tokenizers import Tokenizer

log = structlog.get_logger()

BRANCHES = 4  # per session: main agent + subagents / side requests
CONTEXT_TOKENS = 12  # tokens shown on each side of a break
_CONTEXT_IDS = 5  # prompt tokens decoded with the output so leading spaces come out right


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class _Mark:
    """A token prefix of an entry whose text is known: text[:text_len] has this digest."""

    num_tokens: int
    text_len: int
    digest: bytes
    retokenizes: bool = True  # encode(text of the output part) gives back the same ids


@dataclass
class _Entry:
    ids: np.ndarray  # int32: prompt + output
    num_prompt: int
    marks: list[_Mark] = field(default_factory=list)  # longest first


class PrefixTracker:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        on_break: Callable[..., None] | None = None,
        max_sessions: int = 1024,
        max_tokens: int = 32 * 1024 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.on_break = on_break
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._num_tokens = 0
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        self._special_ids = {tokenizer.token_to_id(t) for t in special} - {None}
        self.num_breaks = 0

    # --- before the request ------------------------------------------------------------

    def splice(self, session: str, text: str) -> tuple[list[int], str]:
        """(ids to reuse, text left to tokenize): the longest stored token prefix of this
        session whose text `text` starts with; ([], text) if none."""
        entries = self._sessions.get(session)
        if not entries:
            return [], text
        self._sessions.move_to_end(session)
        best: tuple[_Entry, _Mark] | None = None
        for entry in entries:
            for mark in entry.marks:
                if best is not None and mark.num_tokens <= best[1].num_tokens:
                    break
                if mark.text_len <= len(text) and _digest(text[: mark.text_len]) == mark.digest:
                    best = (entry, mark)
                    break
        if best is None:
            return [], text
        entry, mark = best
        if not mark.retokenizes:
            log.info("output_tokens_reused", session=session,
                     num_tokens=mark.num_tokens - entry.num_prompt,
                     reason="the output re-tokenizes differently; its own ids keep the prefix")
        return entry.ids[: mark.num_tokens].tolist(), text[mark.text_len:]

    def check(self, session: str, ids: list[int], *, request_id: str = "") -> int | None:
        """Log and count a prefix break if `ids` extends no stored prompt + output of the
        session (a prefix of one, e.g. a retry, is fine). Returns the break's token index.
        `on_break` is called with session, request_id, num_common_tokens,
        num_prompt_tokens and reason (Metrics.count_prefix_break)."""
        entries = self._sessions.get(session)
        if not entries:
            return None
        new = np.asarray(ids, dtype=np.int32)
        best_lcp, best = -1, entries[0]
        for entry in entries:
            lcp = _common_prefix(entry.ids, new)
            if lcp == min(len(entry.ids), len(new)):
                return None
            if lcp > best_lcp:
                best_lcp, best = lcp, entry
        self.num_breaks += 1
        in_output = best_lcp >= best.num_prompt
        reason = "diverged in the previous output" if in_output else \
            "diverged in the previous prompt"
        if self.on_break is not None:
            self.on_break(session=session, request_id=request_id, num_common_tokens=best_lcp,
                          num_prompt_tokens=len(new), reason=reason)
        lo, hi = max(0, best_lcp - CONTEXT_TOKENS), best_lcp + CONTEXT_TOKENS
        log.warning(
            "prefix_break",
            session=session,
            request_id=request_id,
            token_index=best_lcp,
            previous_tokens=len(best.ids),
            previous_prompt_tokens=best.num_prompt,
            new_tokens=len(new),
            in_output=in_output,
            before=self._decode(new[lo:best_lcp]),
            previous_after=self._decode(best.ids[best_lcp:hi]),
            new_after=self._decode(new[best_lcp:hi]),
        )
        return best_lcp

    # --- after the request ---------------------------------------------------------------

    def record(self, session: str, prompt_ids: list[int], prompt_text: str,
               output_ids: list[int], *, output_sent_whole: bool = True) -> None:
        """Remember a served prompt and its output. `output_sent_whole`: the client got
        the text of every output token (False after a stop string cut it)."""
        if not output_sent_whole:
            output_ids = []
        ids = np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int32)
        entry = _Entry(ids, len(prompt_ids))
        entry.marks = self._marks(prompt_ids, prompt_text, output_ids)
        entries = self._sessions.setdefault(session, [])
        self._sessions.move_to_end(session)
        # Replace the branch this prompt continues (it extends that branch's prompt),
        # else start a new one, dropping the least recently used.
        for i, old in enumerate(entries):
            if _common_prefix(old.ids, ids) >= old.num_prompt:
                self._num_tokens -= len(old.ids)
                del entries[i]
                break
        entries.insert(0, entry)
        self._num_tokens += len(ids)
        while len(entries) > BRANCHES:
            self._num_tokens -= len(entries.pop().ids)
        while self._sessions and (len(self._sessions) > self.max_sessions
                                  or self._num_tokens > self.max_tokens):
            _, dropped = self._sessions.popitem(last=False)
            self._num_tokens -= sum(len(e.ids) for e in dropped)

    def _marks(self, prompt_ids: list[int], prompt_text: str, output_ids: list[int]) -> list[_Mark]:
        marks = [_Mark(len(prompt_ids), len(prompt_text), _digest(prompt_text))]
        # The output with and without its trailing special tokens (the EOS the client
        # never sees as text; the template renders its own end-of-turn marker).
        n = len(output_ids)
        while n and output_ids[n - 1] in self._special_ids:
            n -= 1
        ctx = list(prompt_ids[-_CONTEXT_IDS:])
        ctx_text = self._decode(ctx)
        for k in sorted({n, len(output_ids)} - {0}):
            # Bytes that are not valid UTF-8 decode to U+FFFD here exactly as they did
            # for the client, so its echo of them still reuses the model's own ids.
            out_text = self._decode(ctx + list(output_ids[:k]))[len(ctx_text):]
            text = prompt_text + out_text
            same = self.tokenizer.encode(out_text, add_special_tokens=False).ids == \
                list(output_ids[:k])
            marks.append(_Mark(len(prompt_ids) + k, len(text), _digest(text), same))
        marks.sort(key=lambda m: -m.num_tokens)
        return marks

    def _decode(self, ids: np.ndarray | list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
