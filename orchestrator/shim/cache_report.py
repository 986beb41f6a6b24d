"""Why a request's prompt missed the cache, told to its client: the `x-deepinfer-cache`
response header on every generating endpoint, and at the end of a stream an SSE comment.

    x-deepinfer-cache: cached=1232; recomputed=56; reason=evicted; evicted=48;
        block_remainder=8; evicted_tier=host; evicted_age_s=340.2; evicted_by=write_back

(one line). `cached` and `recomputed` are prompt tokens (recomputed = prompt - cached);
`reason` is the main one, then the tokens of each reason that has some
(wire/client.py UNCACHED_REASONS, cache/miss_reasons.py), then the first evicted block's
tier, age and cause when some were evicted, or `diverged_at` (the first token unlike the
session's previous prompt) for diverged and compaction. With prefix caching off there is
no reason: `cached=0; recomputed=N`.

When the figures are known. The engine decides them at the request's admission, before
its prompt runs, and sends them with its first output (a long prefill's cached share, or
its first token). A JSON answer's headers go out with the whole answer: it always has
them. A stream's go out with its first event, which is the first output's, or a keep-alive
if `ping_interval_s` passes first (pipeline.sse_response): it has them then, unless it
opened on a keep-alive while the request still waited in the queue -- and then it has no
header rather than a guess. The OpenAI streams (chat, completions, Responses), whose
keep-alives are SSE comments already, end with the same line as a comment before their
closing events (`: x-deepinfer-cache: cached=...`), which SSE clients skip, and with
`x-deepinfer-timing` (`queue_s=...; prefill_s=...; decode_s=...`: where the request's
time went in the engine), which a JSON answer has as a header. An Anthropic
stream carries no comment: its keep-alive is a `ping` event and strict parsers expect an
`event:` line on every event; the scheduler's request_done line and `deepinfer-inspect
cache` have the figures of every request. The `usage` objects keep the APIs' shapes.
"""

from __future__ import annotations

from orchestrator.shim.generation import Generation

HEADER = "x-deepinfer-cache"
TIMING_HEADER = "x-deepinfer-timing"


def cache_report(gen: Generation, *, final: bool) -> str | None:
    """The header's value; None when not known yet (``final``: the request has ended, so
    the counts are whole even without the engine's reasons)."""
    u = gen.uncached
    if u is None and not final:
        return None
    cached = gen.num_cached
    parts = [f"cached={cached}", f"recomputed={gen.num_prompt_tokens - cached}"]
    if u is None:
        return "; ".join(parts)
    parts.append(f"reason={u.main_reason or 'none'}")
    parts += [f"{reason}={n}" for reason, n in u.by_reason().items() if n]
    if u.evicted:
        parts += [f"evicted_tier={u.evicted_tier}", f"evicted_age_s={u.evicted_age_s:.1f}",
                  f"evicted_by={u.evicted_by}"]
    if u.diverged_at >= 0:
        parts.append(f"diverged_at={u.diverged_at}")
    return "; ".join(parts)


def timing_report(gen: Generation) -> str | None:
    """`x-deepinfer-timing`: where an ended request's time went in the engine, in
    seconds: waiting in the queue, its prefill (admission to first token, swap-ins of its
    host and disk hits included), and its decode (first token to the end, as the shim
    saw it). None until the request has ended."""
    t = gen.timing
    if t is None:
        return None
    return f"queue_s={t.queue_s:.3f}; prefill_s={t.prefill_s:.3f}; decode_s={t.decode_s:.3f}"


def cache_headers(gen: Generation, *, final: bool) -> dict[str, str]:
    value = cache_report(gen, final=final)
    headers = {HEADER: value} if value is not None else {}
    timing = timing_report(gen) if final else None
    if timing is not None:
        headers[TIMING_HEADER] = timing
    return headers


def cache_comment(gen: Generation) -> list[str]:
    """The reports as SSE comments, for the end of a stream."""
    out = []
    for name, value in ((HEADER, cache_report(gen, final=True)),
                        (TIMING_HEADER, timing_report(gen))):
        if value is not None:
            out.append(f": {name}: {value}\n\n")
    return out
