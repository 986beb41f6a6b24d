"""OpenAI Completions API: request validation, response shapes, and the run of one request.

`http_server` reads the body, calls `prompt_input` and `parse_completion`, then drives a
`CompletionRun`. Validation is small explicit code rather than a schema library so that
types are strict (`"5"` and `true` are not integers) and every error is an `ApiError`
rendered in OpenAI's shape, never a framework's default.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from tokenizers import Tokenizer

from orchestrator.shim.errors import ApiError, engine_error, is_finite_number, is_int64
from orchestrator.shim.generation import Delivery, Generation, with_keepalive
from wire.client import GenerateRequest, SamplingParams

__all__ = ["ApiError", "engine_error"]  # re-exported: the API modules' shared errors
T = TypeVar("T")

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# --- field readers: strict types, OpenAI-shaped errors ----------------------------


_KINDS: dict[type, tuple[str, Any]] = {
    int: ("a 64-bit integer", is_int64),
    float: ("a finite number", is_finite_number),
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _opt(body: dict[str, Any], name: str, kind: type[T], default: T) -> T:
    """body[name] if present and not null, checked to be of `kind`; else `default`."""
    v = body.get(name)
    if v is None:
        return default
    what, check = _KINDS[kind]
    if not check(v):
        raise ApiError(f"'{name}' must be {what}, got {json.dumps(v)[:40]}", param=name)
    return kind(v)  # type: ignore[call-arg]


def _stop_strings(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise ApiError("'stop' must be a string or a list of strings", param="stop")


def _token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(is_int64(t) for t in v):
        raise ApiError(f"'{name}' must be a list of integers", param=name)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            f"token id {bad[0]} in '{name}' is out of range [0, {vocab_size})", param=name
        )
    return v


def prompt_input(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a request: a string or a list of token ids (not yet range-checked).

    OpenAI also accepts a batch (a list of strings or of id lists); one element is
    unwrapped, several are refused: one request, one sequence, one stream.
    """
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > 1:
            raise ApiError("several prompts in one request are not supported; send one "
                           "request per prompt", param="prompt", code="unsupported")
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(is_int64(t) for t in p):
        return p
    raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")


# --- the parsed request ---------------------------------------------------------


def parse_completion(
    body: dict[str, Any], prompt_token_ids: list[int], *, vocab_size: int, max_model_len: int,
    max_output_tokens: int = 0, request_id: str = "",
) -> tuple[GenerateRequest, Delivery]:
    """Validate a /v1/completions body whose prompt (see `prompt_input`) is already
    tokenized to `prompt_token_ids`: the request for the engine, and what the shim does
    with its output. Raises ApiError for anything the engine must not see.
    `max_output_tokens` > 0: the server's cap on any request's output (--max-output-tokens).
    """
    _opt(body, "model", str, "")  # any name is served (agents send their own); type only
    _refuse_unsupported(body)

    prompt_token_ids = _token_ids(prompt_token_ids, "prompt", vocab_size)
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise ApiError("the prompt is empty", param="prompt")
    if n_prompt >= max_model_len:
        tail = "" if n_prompt > max_model_len else ", which leaves no room for the completion"
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt} tokens in the prompt{tail}. Please reduce the length of "
            "the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = _opt(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    # Clamp, as vLLM does: a request for more than fits simply stops at the context end.
    max_tokens = min(max_tokens, max_model_len - n_prompt)
    if max_output_tokens > 0:
        max_tokens = min(max_tokens, max_output_tokens)

    temperature = _opt(body, "temperature", float, 1.0)  # OpenAI's default, not greedy
    top_p = _opt(body, "top_p", float, 1.0)
    top_k = _opt(body, "top_k", int, 0)
    if temperature < 0:
        raise ApiError("'temperature' must be >= 0", param="temperature")
    if not 0 < top_p <= 1:
        raise ApiError("'top_p' must be in (0, 1]", param="top_p")
    if top_k < -1:
        raise ApiError("'top_k' must be >= 0 (0 or -1: disabled)", param="top_k")
    seed: int | None = _opt(body, "seed", int, None)  # type: ignore[arg-type]

    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        stop_token_ids = _token_ids(stop_token_ids, "stop_token_ids", vocab_size)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")

    stop = _stop_strings(body)
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed
        ),
        stop_token_ids=stop_token_ids or [],
        ignore_eos=_opt(body, "ignore_eos", bool, False),
        cache_salt=_opt(body, "cache_salt", str, None),  # type: ignore[arg-type]
    )
    delivery = Delivery(
        stop=stop,
        stream=_opt(body, "stream", bool, False),
        include_usage=_opt(stream_options or {}, "include_usage", bool, False),
    )
    return request, delivery


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Options we do not implement are refused when set, never silently ignored."""
    unsupported = {
        "n": body.get("n") not in (None, 1),
        "best_of": body.get("best_of") not in (None, 1),
        "echo": body.get("echo") not in (None, False),
        "logprobs": body.get("logprobs") is not None,
        "suffix": body.get("suffix") is not None,
        "presence_penalty": body.get("presence_penalty") not in (None, 0),
        "frequency_penalty": body.get("frequency_penalty") not in (None, 0),
        "logit_bias": body.get("logit_bias") not in (None, {}),
    }
    for name, is_set in unsupported.items():
        if is_set:
            value = json.dumps(body[name])[:40]
            raise ApiError(f"'{name}' = {value} is not supported", param=name,
                           code="unsupported")


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


# --- one completion, from engine outputs to OpenAI JSON or SSE ----------------------


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_PING = ": ping\n\n"  # an SSE comment: keeps the connection busy; clients skip it


class CompletionRun:
    """Drives one /v1/completions request: a Generation, formatted as OpenAI's text
    completion (one JSON, or SSE chunks)."""

    def __init__(
        self,
        engine: Any,  # EngineClient, or anything with its generate/abort
        tokenizer: Tokenizer,
        request: GenerateRequest,
        delivery: Delivery,
        model_name: str,
    ) -> None:
        self.gen = Generation(engine, tokenizer, request, delivery)
        self.request_id = request.request_id
        self.delivery = delivery
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def token_ids(self) -> list[int]:
        return self.gen.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.gen.finish_reason

    def usage(self) -> dict[str, Any]:
        return usage(self.gen.num_prompt_tokens, len(self.gen.token_ids), self.gen.num_cached)

    def _response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices}

    def _choice(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason,
                "token_ids": token_ids}  # token_ids: extension, to compare outputs exactly

    async def collect(self) -> dict[str, Any]:
        """The non-streaming response."""
        text = "".join([p.text async for p in self.gen.pieces()])
        return {**self._response([self._choice(text, self.token_ids)]), "usage": self.usage()}

    async def sse_chunks(self, ping_interval_s: float) -> AsyncIterator[str]:
        """The streaming response, as SSE events. An engine error before the first
        chunk propagates (the caller can still answer with an HTTP error status); after
        it, it is sent as an error event. A comment goes out each `ping_interval_s`
        without output (queue, long prefill), for proxies with read timeouts."""
        keepalive = with_keepalive(self.gen.pieces(), ping_interval_s)
        started = False
        try:
            try:
                async for piece in keepalive:
                    started = True
                    if piece is None:
                        yield SSE_PING
                        continue
                    chunk = self._response([self._choice(piece.text, piece.token_ids)])
                    if self.delivery.include_usage:
                        chunk["usage"] = None  # as OpenAI: null on all chunks but the last
                    yield sse(chunk)
            except ApiError as err:
                self.log_done(finish_reason="error", error=err.message)
                if not started:
                    raise
                yield sse(err.body())
            else:
                if self.delivery.include_usage:
                    yield sse({**self._response([]), "usage": self.usage()})
            yield SSE_DONE
        finally:
            await keepalive.aclose()  # and the pieces with it
            self.log_done()

    def log_done(self, *, finish_reason: str | None = None, error: str | None = None) -> None:
        """One log line per request, whatever way it ended (only the first call logs)."""
        self.gen.log_done(finish_reason=finish_reason, error=error)
