"""What makes a request acceptable to the scheduler, checked before it is queued: a
clear message for the client instead of a failure later, in a step."""

from __future__ import annotations

from wire.client import GenerateRequest
from wire.lifecycle import EngineLimits

MAX_RETENTION_S = 24 * 3600.0  # a retention hint's longest TTL (Anthropic offers 1 h)


class RequestRejected(ValueError):
    def __init__(self, message: str, error_type: str = "invalid_request") -> None:
        super().__init__(message)
        self.error_type = error_type


def validate_request(req: GenerateRequest, limits: EngineLimits, block_size: int) -> None:
    """Raise RequestRejected naming what is wrong with ``req``."""
    n, limit = len(req.prompt_token_ids), limits.max_model_len
    if n == 0:
        raise RequestRejected("the prompt is empty")
    if n >= limit:
        raise RequestRejected(f"prompt is too long: {n} tokens > {limit - 1} maximum")
    ids, vocab = req.prompt_token_ids, limits.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # C-speed scan; find the culprit only if needed
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise RequestRejected(f"token id {bad} is outside the vocabulary [0, {vocab})")
    if req.max_tokens < 1:
        raise RequestRejected("max_tokens must be at least 1")
    if req.timeout_s is not None and not req.timeout_s > 0:
        raise RequestRejected("timeout_s must be > 0")
    span = req.thinking
    if span is not None and not (0 <= span.start_token_id < vocab
                                 and 0 <= span.end_token_id < vocab):
        raise RequestRejected("the thinking span's tag ids are outside the vocabulary")
    if span is not None and span.budget is not None and not (
            isinstance(span.budget, int) and span.budget >= 0):
        raise RequestRejected("the thinking budget must be an integer >= 0")
    for r in req.retention:
        if not (isinstance(r.num_tokens, int) and r.num_tokens >= 0
                and 0 < r.ttl_s <= MAX_RETENTION_S):
            raise RequestRejected(f"a retention hint needs num_tokens >= 0 and a TTL in "
                                  f"(0, {MAX_RETENTION_S:g}] s")
    if req.resumed_output is not None:
        n += _check_resumed(req, limits)
    if -(-n // block_size) > limits.num_device_blocks:
        # worded as for the context length: agents (Claude Code) compact on it
        raise RequestRejected(
            f"prompt is too long: {n} tokens > "
            f"{limits.num_device_blocks * block_size} maximum "
            "(the device KV cache can never hold it)")


def _check_resumed(req: GenerateRequest, limits: EngineLimits) -> int:
    """A continuation's output so far (it is recomputed with the prompt): tokens of the
    vocabulary, short of max_tokens and of the context. Returns its length."""
    out, vocab = req.resumed_output or [], limits.vocab_size
    if out and (min(out) < 0 or max(out) >= vocab):
        bad = next(t for t in out if not 0 <= t < vocab)
        raise RequestRejected(f"resumed output token id {bad} is outside the vocabulary "
                              f"[0, {vocab})")
    if len(out) >= req.max_tokens:
        raise RequestRejected(f"the resumed output holds {len(out)} tokens: max_tokens "
                              f"({req.max_tokens}) leaves nothing to generate")
    total = len(req.prompt_token_ids) + len(out)
    if total >= limits.max_model_len:
        raise RequestRejected(f"prompt and resumed output are too long: {total} tokens > "
                              f"{limits.max_model_len - 1} maximum")
    return len(out)
