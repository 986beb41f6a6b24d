"""Errors returned to HTTP clients, in OpenAI's shape or in Anthropic's.

Handlers raise one `ApiError`; the app renders it for the API the path belongs to:

    OpenAI     {"error": {"message", "type", "param", "code"}}
    Anthropic  {"type": "error", "error": {"type", "message"}}

Statuses differ where the clients expect them to: an overloaded engine is a 429 with
`retry-after` for OpenAI clients and a 529 `overloaded_error` for Anthropic ones (Claude
Code retries both with backoff). An engine that is not there (failed, restarting, not
connected yet) is a 503 with `retry-after` for both (`api_error` for Anthropic's, which
its SDKs retry as any 5xx).
"""

from __future__ import annotations

from typing import Any

# OpenAI error type -> (Anthropic error type, status override or None)
_ANTHROPIC_TYPES: dict[str, str] = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit_error": "rate_limit_error",
    "internal_error": "api_error",
    "service_unavailable": "api_error",
}


UNAVAILABLE_RETRY_AFTER_S = 5  # about how long a restart of the engine group takes


class ApiError(Exception):
    """An error to return to the client with an HTTP status (OpenAI type names)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's shape."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def anthropic_status(self) -> int:
        return 529 if self.code == "overloaded" else self.status

    @property
    def anthropic_type(self) -> str:
        if self.code == "overloaded":
            return "overloaded_error"
        return _ANTHROPIC_TYPES.get(self.type, "api_error" if self.status >= 500 else self.type)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape."""
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}


def engine_error(error_type: str | None, message: str | None) -> ApiError:
    """Map a scheduler's RequestOutput error to the HTTP error a client expects."""
    message = message or "the engine failed to serve the request"
    if error_type == "overloaded":
        # 429 (529 for Anthropic clients) + retry-after: agents back off and retry
        # instead of failing the task.
        return ApiError(message, status=429, type="rate_limit_error", code="overloaded",
                        headers={"retry-after": "1"})
    if error_type == "invalid_request":
        return ApiError(message, status=400)
    if error_type == "timeout":  # the request's own deadline (x-request-timeout)
        return ApiError(message, status=408, type="timeout_error", code="deadline_exceeded")
    if error_type == "unavailable":
        return unavailable_error(message)
    return ApiError(message, status=500, type="internal_error")


def unavailable_error(message: str, retry_after_s: int = UNAVAILABLE_RETRY_AFTER_S) -> ApiError:
    """503 + retry-after: the request was fine, the engine is not there to serve it now."""
    return ApiError(message, status=503, type="service_unavailable", code="unavailable",
                    headers={"retry-after": str(retry_after_s)})
