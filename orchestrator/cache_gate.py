"""The prefix-cache quality gate's requests and verdict (the `deepinfer-verify` command
line is tools/verify.py; `serve --self-check` runs the gate from the shim).

Three requests at temperature 0, after a small probe:

    probe   the question alone (max 1 token): how many prompt tokens follow the document
    cold    a long document (it opens with a fresh nonce, so nothing of it is cached) + Q1
    warm    the identical request again
    other   the same document + a different question Q2

It passes when
    1. the warm request reports at least (prompt tokens - one block) cached tokens,
    2. the warm answer is the cold one, text and token count,
    3. the other request is served from cache up to the end of the document: at most
       (what follows the document) + one block of its prompt is computed,
    4. the warm time to first token is at most `max_ttft_ratio` of the cold one.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

DEFAULT_BLOCK_SIZE = 16  # used when the server's model card does not say
CHARS_PER_TOKEN = 3.2  # the document is sized in characters; the report prints its tokens
QUESTIONS = ("Question: which function in this file returns a list? Answer briefly.",
             "Question: what does the last function compute? Answer briefly.")
_WORDS = ("buffer", "count", "index", "parse", "value", "table", "token", "cache", "block",
          "load", "merge", "split", "limit", "scale", "batch", "queue", "shard", "frame")


@dataclass
class GateConfig:
    url: str = "http://127.0.0.1:8000"
    api: str = "anthropic"  # or "openai" (/v1/chat/completions)
    api_key: str | None = None
    model: str | None = None  # default: the first model the server lists
    doc_tokens: int = 2048
    max_tokens: int = 24
    max_ttft_ratio: float = 0.5
    block_size: int | None = None  # default: the server's model card, else 16
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Answer:
    """One streamed response, as the client saw it."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    total_s: float


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class GateReport:
    url: str
    api: str
    model: str
    block_size: int
    answers: dict[str, Answer]
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "url": self.url, "api": self.api, "model": self.model,
                "block_size": self.block_size,
                "answers": {k: asdict(v) for k, v in self.answers.items()},
                "checks": [asdict(c) for c in self.checks], "reasons": self.reasons}


class EndpointError(Exception):
    """The endpoint could not be reached, or answered a request with an error."""


def make_document(doc_tokens: int, nonce: str) -> str:
    """Code-like text of about `doc_tokens` tokens, opening with `nonce` so that a gate
    run never finds an earlier run's document in the cache."""
    rng = random.Random(nonce)
    lines = [f"# module {nonce}: helpers generated for a cache check"]
    size = len(lines[0])
    i = 0
    while size < doc_tokens * CHARS_PER_TOKEN:
        a, b, c = rng.sample(_WORDS, 3)
        body = (f"def {a}_{b}_{i}(items, {c}={rng.randrange(100)}):\n"
                f"    # {b} every {a} by {c}\n"
                f"    return [x * {c} + {rng.randrange(1000)} for x in items if x > {i}]\n")
        lines.append(body)
        size += len(body)
        i += 1
    return "\n".join(lines)


# --- talking to the endpoint ---------------------------------------------------------


def _headers(cfg: GateConfig) -> dict[str, str]:
    h = {"content-type": "application/json", "anthropic-version": "2023-06-01", **cfg.headers}
    if cfg.api_key:
        h["authorization"] = f"Bearer {cfg.api_key}"
        h["x-api-key"] = cfg.api_key
    return h


def server_model(client: httpx.Client, cfg: GateConfig) -> tuple[str, int]:
    """(model name, block size) from GET /v1/models; flags override both."""
    r = client.get(f"{cfg.url}/v1/models", headers=_headers(cfg))
    if r.status_code != 200:
        raise EndpointError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:300]}")
    card = (r.json().get("data") or [{}])[0]
    model = cfg.model or card.get("id") or "default"
    block = cfg.block_size or card.get("block_size") or DEFAULT_BLOCK_SIZE
    return model, int(block)


def ask(client: httpx.Client, cfg: GateConfig, model: str, text: str,
        max_tokens: int) -> Answer:
    """One streamed request with `text` as the user's message, at temperature 0."""
    if cfg.api == "anthropic":
        path = "/v1/messages"
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "messages": [{"role": "user", "content": text}]}
    else:
        path = "/v1/chat/completions"
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": text}]}
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", cfg.url + path, json=body, headers=_headers(cfg)) as r:
        if r.status_code != 200:
            r.read()
            raise EndpointError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event and event.get("type") in (None, "error"):
                raise EndpointError(f"POST {path}: error mid-stream: {event['error']}")
            piece, event_usage = _read_event(cfg.api, event)
            if piece is not None and first is None:
                first = time.perf_counter()
            pieces.append(piece or "")
            usage.update(event_usage)
    end = time.perf_counter()
    prompt, cached, output = usage_counts(cfg.api, usage)
    return Answer("".join(pieces), prompt, cached, output,
                  ttft_s=(first or end) - start, total_s=end - start)


def _read_event(api: str, event: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(new text or None, usage fields) of one SSE event."""
    if api == "anthropic":
        kind = event.get("type")
        if kind == "content_block_delta":
            return event["delta"].get("text", ""), {}
        if kind == "message_delta":
            return None, event.get("usage") or {}
        return None, {}
    usage = event.get("usage") or {}
    for choice in event.get("choices", []):
        content = (choice.get("delta") or {}).get("content")
        if content:
            return content, usage
    return None, usage


def usage_counts(api: str, usage: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, cached prompt tokens, output tokens)."""
    if api == "anthropic":  # the three input counts add up to the prompt
        cached = usage.get("cache_read_input_tokens") or 0
        prompt = (usage.get("input_tokens") or 0) + cached + (
            usage.get("cache_creation_input_tokens") or 0)
        return prompt, cached, usage.get("output_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    return (usage.get("prompt_tokens") or 0, details.get("cached_tokens") or 0,
            usage.get("completion_tokens") or 0)


# --- the gate ----------------------------------------------------------------------


def run_gate(cfg: GateConfig) -> GateReport:
    """Send the four requests and judge them. Raises EndpointError if it cannot."""
    with httpx.Client(timeout=cfg.timeout_s) as client:
        try:
            model, block = server_model(client, cfg)
        except httpx.TransportError as exc:
            raise EndpointError(f"{cfg.url}: {exc!r}") from None
        document = make_document(cfg.doc_tokens, secrets.token_hex(8))
        q1, q2 = (f"{document}\n\n{q}" for q in QUESTIONS)
        answers = {
            "probe": ask(client, cfg, model, QUESTIONS[1], 1),
            "cold": ask(client, cfg, model, q1, cfg.max_tokens),
            "warm": ask(client, cfg, model, q1, cfg.max_tokens),
            "other": ask(client, cfg, model, q2, cfg.max_tokens),
        }
    return GateReport(cfg.url, cfg.api, model, block, answers,
                      judge(answers, block, cfg.max_ttft_ratio))


def judge(a: dict[str, Answer], block: int, max_ttft_ratio: float) -> list[Check]:
    cold, warm, other = a["cold"], a["warm"], a["other"]
    want = warm.prompt_tokens - block
    # The question-only probe counts what follows the document (plus the template's
    # opening, a few tokens: slack in the engine's favour, far below a block's worth).
    tail = a["probe"].prompt_tokens
    computed = other.prompt_tokens - other.cached_tokens
    ratio = warm.ttft_s / cold.ttft_s if cold.ttft_s > 0 else float("inf")
    same = warm.text == cold.text and warm.output_tokens == cold.output_tokens
    return [
        Check("repeat served from cache", warm.cached_tokens >= want,
              f"{warm.cached_tokens} of {warm.prompt_tokens} prompt tokens cached "
              f"(want >= {want})"),
        Check("identical answer", same,
              f"{warm.output_tokens} tokens, same as the cold answer" if same else
              f"cold {cold.text[:60]!r} ({cold.output_tokens} tokens) != warm "
              f"{warm.text[:60]!r} ({warm.output_tokens} tokens)"),
        Check("document served from cache", computed <= tail + block,
              f"{computed} of {other.prompt_tokens} prompt tokens computed "
              f"(want <= {tail + block}: the {tail} after the document + one block)"),
        Check("warm TTFT", ratio <= max_ttft_ratio,
              f"{1000 * warm.ttft_s:.0f} ms warm vs {1000 * cold.ttft_s:.0f} ms cold "
              f"= {ratio:.2f} (want <= {max_ttft_ratio:g})"),
    ]
