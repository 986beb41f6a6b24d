"""The sampling fields of an OpenAI body, read by one function for every OpenAI endpoint
(`/v1/chat/completions`, `/v1/completions` and `/v1/responses`): the same fields, the same
limits, the same errors. The limits are OpenAI's: temperature in [0, 2], top_p in (0, 1],
the penalties in [-2, 2]; top_k (-1 or 0: off) and seed as vLLM takes them.

The engine applies no presence or frequency penalty and no logit bias. Their defaults (0,
and an empty or null map: what SDKs and frameworks send when not told otherwise) are
accepted; any other value is a 400 `unsupported`, never ignored, since ignoring it would
change what the user gets without a word. So is `n` past 1: one request, one choice.
"""

from __future__ import annotations

from typing import Any

from orchestrator.shim.errors import ApiError
from orchestrator.shim.validate import describe, is_int64, number
from wire.client import SamplingParams

TEMPERATURE_MAX = 2.0
PENALTY_LIMIT = 2.0
PENALTIES = ("presence_penalty", "frequency_penalty")


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """The body's sampling fields, checked; an ApiError (400, OpenAI's shape) names the
    first field that is wrong."""
    _refuse_choices(body)
    temperature = _number(body, "temperature", 1.0)  # OpenAI's default, not greedy
    if not 0 <= temperature <= TEMPERATURE_MAX:
        raise _out_of_range("temperature", temperature, f"[0, {TEMPERATURE_MAX:g}]")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _out_of_range("top_p", top_p, "(0, 1]")
    top_k = _integer(body, "top_k") or 0
    if top_k < -1:
        raise ApiError(f"'top_k' must be >= -1 (-1 or 0: no top-k), got {top_k}",
                       param="top_k")
    seed = _integer(body, "seed")
    for name in PENALTIES:
        penalty = _number(body, name, 0.0)
        if not -PENALTY_LIMIT <= penalty <= PENALTY_LIMIT:
            raise _out_of_range(name, penalty, f"[-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        if penalty != 0:
            raise _unsupported(name, body[name], "this engine applies no penalties "
                               "(0, the default, is accepted)")
    _check_logit_bias(body)
    return SamplingParams(temperature=float(temperature), top_p=float(top_p),
                          top_k=max(top_k, 0), seed=seed)


def _refuse_choices(body: dict[str, Any]) -> None:
    n = _integer(body, "n")
    if n is not None and n < 1:
        raise ApiError(f"'n' must be at least 1, got {n}", param="n")
    if n is not None and n > 1:
        raise _unsupported("n", n, "one choice per request (send one request per choice)")


def _check_logit_bias(body: dict[str, Any]) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases, got "
                       f"{describe(bias)}", param="logit_bias")
    if bias:
        raise _unsupported("logit_bias", bias, "this engine applies no logit bias ({}, the "
                           "default, is accepted)")


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """body[name]: a finite JSON number (an integer stays one, for the messages), or
    `default` where absent or null."""
    return number(body, name, default, "'{name}' must be a finite number, got {value}")


def _integer(body: dict[str, Any], name: str) -> int | None:
    """body[name]: an integer the engine's wire carries (64 bits), or None where absent
    or null."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int64(value):
        raise ApiError(f"'{name}' must be a 64-bit integer, got {describe(value)}", param=name)
    return value


def _out_of_range(name: str, value: float, limits: str) -> ApiError:
    return ApiError(f"'{name}' must be in {limits}, got {value}", param=name)


def _unsupported(name: str, value: Any, why: str) -> ApiError:
    return ApiError(f"'{name}' = {describe(value)} is not supported: {why}", param=name,
                    code="unsupported")
