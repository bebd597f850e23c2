"""Every refusal as OpenAI's error: ``ApiError`` names the field (``param``) and says what would be accepted, in
the body OpenAI uses, so a client's own error handling works unchanged. The Messages family renders the same
error in Anthropic's shape (``messages.parse.error_body``). No MLX, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from neuron.engine.refusals import Overloaded, Unavailable
from neuron.engine.sequence import Failure
from neuron.grammar import TOO_COMPLEX
from neuron.server.common import limits

T = TypeVar("T")


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def openai_body(error: ApiError) -> dict[str, Any]:
    return error.body()


def not_ready(message: str, retry_after: int = 1) -> ApiError:
    """503 with Retry-After, so that clients (the OpenAI SDKs among them) come back rather than give up."""
    return ApiError(503, message, type="server_error", code="not_ready", headers={"retry-after": str(retry_after)})


def failure_error(failure: Failure) -> ApiError:
    if failure.kind == "unavailable":
        # A lost group (the leader restarts) or a failed probe (the next comes in 5 s): seconds either way.
        return not_ready(failure.message, retry_after=5)
    if failure.kind == "constraint" and failure.message.startswith(TOO_COMPLEX):
        return ApiError(400, failure.message, param="response_format", code="schema_too_complex")
    if failure.kind == "constraint":
        # This request's grammar alone failed; the rest of the batch went on.
        return ApiError(500, failure.message, type="server_error", code="constraint_failed")
    return ApiError(500, failure.message, type="server_error", code="step_failed")


def refused(error: Overloaded | Unavailable) -> ApiError:
    """The engine's refusal to queue a request: a full queue (429) or no ranks to run it (503)."""
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), type="server_error", code="queue_full", headers={"retry-after": "1"})
    return not_ready(str(error), retry_after=error.retry_after)


def no_answer() -> ApiError:
    return ApiError(500, "the engine ended the request without an answer", type="server_error")


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def within_limits(check: Callable[..., T], *args: Any) -> T:
    """``check(*args)``, a bound of ``limits`` passed answered as OpenAI's 400."""
    try:
        return check(*args)
    except limits.LimitError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None
