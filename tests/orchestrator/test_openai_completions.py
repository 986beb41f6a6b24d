"""Request validation for /v1/completions: strict types, limits, OpenAI-shaped errors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.shim.errors import ApiError, engine_error
from orchestrator.shim.openai_request import DEFAULT_MAX_TOKENS, parse_completion, prompt_input

VOCAB = 100
MAX_LEN = 32


def parse(body: dict[str, Any], prompt: list[int] | None = None,
          **limits: Any) -> SimpleNamespace:
    """The parsed request's fields, the engine's (GenerateRequest) and the shim's
    (Delivery), in one view."""
    request, delivery = parse_completion(body, [1, 2, 3] if prompt is None else prompt,
                                         vocab_size=VOCAB, max_model_len=MAX_LEN, **limits)
    return SimpleNamespace(**vars(request), **vars(delivery))


def error(fn: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    err = info.value
    body = err.body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return err


# --- prompt ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", "hi"),
        ([1, 2], [1, 2]),
        (["hi"], "hi"),
        ([[1, 2]], [1, 2]),
    ],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert prompt_input({"prompt": prompt}) == expected


def test_several_prompts_are_refused() -> None:
    err = error(prompt_input, {"prompt": ["a", "b"]})
    assert (err.status, err.param, err.code) == (400, "prompt", "unsupported")
    assert error(prompt_input, {"prompt": [[1], [2]]}).code == "unsupported"


@pytest.mark.parametrize("prompt", [None, 5, {"a": 1}, [1.5], [True, 2], [1, "a"], [["a"]]])
def test_bad_prompt_types(prompt: Any) -> None:
    body = {} if prompt is None else {"prompt": prompt}
    err = error(prompt_input, body)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "prompt")


@pytest.mark.parametrize("ids", [[-1], [VOCAB], [5, 10**9]])
def test_token_ids_out_of_vocab(ids: list[int]) -> None:
    err = error(parse, {}, ids)
    assert err.status == 400 and err.param == "prompt"
    assert f"[0, {VOCAB})" in err.message


def test_prompt_too_long() -> None:
    err = error(parse, {}, [1] * (MAX_LEN + 5))
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert err.message.startswith(
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{MAX_LEN + 5} tokens in the prompt."
    )
    # Exactly the limit leaves no room to generate.
    assert error(parse, {}, [1] * MAX_LEN).code == "context_length_exceeded"


def test_empty_prompt() -> None:
    assert error(parse, {}, []).param == "prompt"


# --- max_tokens and sampling ----------------------------------------------------------------


def test_defaults() -> None:
    p = parse({})
    assert p.max_tokens == DEFAULT_MAX_TOKENS
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k) == (1.0, 1.0, 0)
    assert p.sampling.seed is None
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.stream, p.include_usage) == (
        [], [], False, False, False)


def test_max_tokens_is_clamped_to_the_room_left() -> None:
    assert parse({"max_tokens": 1000}, [1] * 10).max_tokens == MAX_LEN - 10
    assert parse({"max_tokens": 3}, [1] * 10).max_tokens == 3
    assert parse({"max_tokens": None}).max_tokens == DEFAULT_MAX_TOKENS


def test_max_tokens_is_capped_by_the_server() -> None:
    """--max-output-tokens applies to /v1/completions too, as it says: any request."""
    capped = parse({"max_tokens": 20}, [1, 2, 3], max_output_tokens=5)
    assert capped.max_tokens == 5
    assert parse({}, [1], max_output_tokens=100).max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("value", [-1, 0])
def test_max_tokens_below_one(value: int) -> None:
    err = error(parse, {"max_tokens": value})
    assert (err.status, err.param) == (400, "max_tokens")


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "5"),
        ("max_tokens", 5.0),
        ("max_tokens", True),
        ("temperature", "0"),
        ("temperature", False),
        ("top_p", [1]),
        ("top_k", 1.5),
        ("seed", "1"),
        ("stream", 1),
        ("ignore_eos", "yes"),
        ("model", 3),
        ("cache_salt", 7),
        ("stop", 3),
        ("stop", ["a", 1]),
        ("stop_token_ids", 3),
        ("stop_token_ids", ["1"]),
        ("stream_options", "yes"),
        # past 64 bits (msgpack cannot carry them) or not finite
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("top_k", 10**30),
        ("max_tokens", 2**63),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
    ],
)
def test_wrong_types(field: str, value: Any) -> None:
    err = error(parse, {field: value})
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", field)


def test_wrong_type_inside_stream_options() -> None:
    assert error(parse, {"stream_options": {"include_usage": "y"}}).param == "include_usage"


@pytest.mark.parametrize(
    "field, value", [("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2)]
)
def test_sampling_out_of_range(field: str, value: Any) -> None:
    assert error(parse, {field: value}).param == field


def test_sampling_and_extensions() -> None:
    p = parse({
        "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 7, "ignore_eos": True,
        "stop": "END", "stop_token_ids": [4, 5], "stream": True,
        "stream_options": {"include_usage": True}, "cache_salt": "s", "model": "x",
        "user": "ignored", "n": 1, "echo": False, "logprobs": None,
    })
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k, p.sampling.seed) == (
        0.0, 0.5, 0, 7)
    assert p.stop == ["END"] and p.stop_token_ids == [4, 5]
    assert p.ignore_eos and p.stream and p.include_usage and p.cache_salt == "s"


def test_stop_lists_drop_empty_strings() -> None:
    assert parse({"stop": ["a", "", "b"]}).stop == ["a", "b"]
    assert parse({"stop": ""}).stop == []


def test_stop_token_ids_out_of_vocab() -> None:
    assert error(parse, {"stop_token_ids": [VOCAB]}).param == "stop_token_ids"


@pytest.mark.parametrize(
    "field, value",
    [("n", 2), ("best_of", 3), ("echo", True), ("logprobs", 1), ("suffix", "x"),
     ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"1": 5})],
)
def test_unsupported_options_are_refused_not_ignored(field: str, value: Any) -> None:
    err = error(parse, {field: value})
    assert (err.status, err.param, err.code) == (400, field, "unsupported")


# --- errors reported by the engine -------------------------------------------------------


def test_engine_error_mapping() -> None:
    over = engine_error("overloaded", "queue full")
    assert over.status == 429 and over.headers["retry-after"].isdigit()
    assert over.body()["error"]["message"] == "queue full"
    assert engine_error("invalid_request", "bad").status == 400
    assert engine_error("internal", None).status == 500
    assert engine_error(None, "?").status == 500


def test_engine_unavailable_is_503_with_retry_after_in_both_shapes() -> None:
    """The engine failed mid-request (a rank died) or is restarting: the request was
    fine, so clients are told to retry, not that it was bad."""
    err = engine_error("unavailable", "engine failed: rank 1 (pid 7) died during step 3")
    assert (err.status, err.type, err.headers) == (503, "service_unavailable",
                                                   {"retry-after": "5"})
    assert err.body()["error"]["message"].endswith("died during step 3")
    assert (err.anthropic_status, err.anthropic_type) == (503, "api_error")
    assert err.anthropic_body()["error"]["type"] == "api_error"
