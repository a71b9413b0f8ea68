"""Typed request errors: what a single request's input got wrong, as a value the HTTP edge maps once.

``RequestError`` is raised by validation (sampling parameters, prompts, limits) and travels to the caller
inside a ``Rejected`` record; it never crosses an actor boundary as an exception. ``param`` names the
offending field in the engine's terms (``prompt``, ``max_tokens``, ...); the HTTP layer renames fields
where its wire format differs (``errors.from_rejection``).
"""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "invalid_request",  # the request itself is wrong (a value out of range, an empty prompt, ...)
    "context_length_exceeded",  # prompt plus output does not fit the model's context
    "kv_capacity_exceeded",  # the request could never fit the KV cache, even alone
    "overloaded",  # the server is busy now (queue full, KV backlog): retry later
    "unavailable",  # the engine is starting, draining or failed
    "internal",  # a bug: reported, never a crash of the engine
]


class RequestError(ValueError):
    """One request's input is unusable; ``code`` says how the caller should react, ``param`` names the field.

    ``retry_after`` (seconds) is set for ``overloaded`` when the engine can estimate when to retry.
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None, *,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
