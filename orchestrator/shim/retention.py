"""`cache_control` markers -> retention hints: how much of the prompt the engine should
keep cached, and for how long (cache/retention.py does the keeping).

Claude Code marks the blocks it wants cached (`{"type": "ephemeral"}`, optionally with
`"ttl": "5m"` or `"1h"`): the system prompt, and the newest message or two. A marker
asks for the prompt up to the end of its block to stay cached for the TTL after its last
use. Markers never change the rendered prompt or a block hash; they only become
`Retention(num_tokens, ttl_s)` entries of the GenerateRequest.

Where a marker sits is kept at message granularity: "the conversation through the
converted message n" (a marker inside a message covers that whole message, which is at
most a few blocks more than asked). A marker on the last message covers the whole
prompt; one further back costs one more render of the conversation up to it, whose
length in tokens is read off the prompt's own token ids (the bytes of each token, from
the vocabulary: byte-level tokenizers spell a text as exactly its tokens' bytes).

The same hint on the OpenAI APIs: `cache_control` on a chat message or on one of its
content parts (OpenRouter's convention), or a top-level `cache_control` (also accepted
by the Messages API), which covers the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from orchestrator.shim.validate import invalid
from wire.client import Retention

TTLS = {"5m": 300.0, "1h": 3600.0}  # what Anthropic offers; 5 minutes by default
WHOLE_PROMPT = -1  # a mark's num_messages for "the whole prompt"


@dataclass(frozen=True)
class RetentionMark:
    num_messages: int  # the prompt up to the end of this many converted messages
    ttl_s: float


def ttl_of(marker: Any, where: str) -> float | None:
    """A block's `cache_control` -> its TTL in seconds; None where there is no marker."""
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        raise invalid(f"{where}.cache_control: Input should be an object with type "
                      "'ephemeral'")
    ttl = marker.get("ttl", "5m")
    if ttl not in TTLS:
        raise invalid(f"{where}.cache_control.ttl: Input should be '5m' or '1h', got {ttl!r}")
    return TTLS[ttl]


def _content_ttl(message: dict[str, Any], where: str) -> float | None:
    """The longest TTL marked on a message or on any of its content blocks."""
    ttls = [ttl_of(message.get("cache_control"), where)]
    content = message.get("content")
    if isinstance(content, list):
        ttls += [ttl_of(b.get("cache_control"), f"{where}.content.{i}")
                 for i, b in enumerate(content) if isinstance(b, dict)]
    found = [t for t in ttls if t is not None]
    return max(found) if found else None


def marks(body: dict[str, Any], messages: list[Any], num_system: int,
          num_converted: Callable[[list[Any]], int]) -> list[RetentionMark]:
    """The retention marks of a request body. ``messages``: the body's message list;
    ``num_system``: converted messages before them (a system prompt given apart);
    ``num_converted(messages[:i])``: how many messages the first i become."""
    out = []
    top = ttl_of(body.get("cache_control"), "body")
    if top is not None:
        out.append(RetentionMark(WHOLE_PROMPT, top))
    system, tools = body.get("system"), body.get("tools")
    ttls = []
    if isinstance(system, list):
        ttls += [ttl_of(b.get("cache_control"), f"system.{i}")
                 for i, b in enumerate(system) if isinstance(b, dict)]
    if isinstance(tools, list):  # chat templates render them with the system prompt
        ttls += [ttl_of(t.get("cache_control"), f"tools.{i}")
                 for i, t in enumerate(tools) if isinstance(t, dict)]
    found = [t for t in ttls if t is not None]
    if found and num_system:
        out.append(RetentionMark(num_system, max(found)))
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        ttl = _content_ttl(m, f"messages.{i}")
        if ttl is not None:
            last = i == len(messages) - 1
            out.append(RetentionMark(WHOLE_PROMPT if last
                                     else num_system + num_converted(messages[: i + 1]), ttl))
    return out


# --- marks -> prompt tokens ---------------------------------------------------------------

_token_bytes: dict[int, np.ndarray] = {}


def token_bytes(tokenizer: Tokenizer) -> np.ndarray:
    """int64 [vocab]: how many bytes of text each token spells (its byte-level form's
    length; added tokens, their content's), built once per tokenizer."""
    table = _token_bytes.get(id(tokenizer))
    if table is None:
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        table = np.array([len(tokenizer.id_to_token(i) or "") for i in range(n)],
                         dtype=np.int64)
        _token_bytes[id(tokenizer)] = table
    return table


def tokens_within(tokenizer: Tokenizer, token_ids: list[int], text: str, chars: int) -> int:
    """How many of the prompt's leading tokens spell text[:chars]."""
    table = token_bytes(tokenizer)
    ids = np.asarray(token_ids, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < len(table))]
    ends = np.cumsum(table[ids])
    return int(np.searchsorted(ends, len(text[:chars].encode("utf-8", "surrogatepass")),
                               side="right"))


def common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def retention(marks_: list[RetentionMark], num_messages: int, token_ids: list[int],
              text: str, render_upto: Callable[[int], str],
              tokenizer: Tokenizer) -> list[Retention]:
    """The engine's retention entries for a rendered, tokenized prompt: per TTL, the
    furthest mark (the engine keeps a block for the longest TTL that covers it)."""
    furthest: dict[float, int] = {}
    for m in marks_:
        if m.num_messages == WHOLE_PROMPT or m.num_messages >= num_messages:
            n = len(token_ids)
        else:
            n = tokens_within(tokenizer, token_ids, text,
                              common_prefix_len(render_upto(m.num_messages), text))
        furthest[m.ttl_s] = max(furthest.get(m.ttl_s, 0), n)
    return [Retention(n, ttl) for ttl, n in sorted(furthest.items()) if n > 0]
