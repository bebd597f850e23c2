"""Why the engine refuses a request: at the door (``RequestError``, a 400 naming the field), or for now
(``Unavailable``: not ready, broken, shutting down; ``Overloaded``: the queue is full). A leaf of the engine: the
HTTP server reads these without loading a model, and every engine module may raise them.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request refused as given; the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code


class Unavailable(RuntimeError):
    """The engine cannot take requests now: not ready, broken, or shutting down."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds until it may take requests again, for Retry-After


class Overloaded(RuntimeError):
    """The waiting queue is full."""
