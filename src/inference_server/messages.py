"""Frozen records that cross actor channels (and the core/runner boundary).

Engine records never reach JSON directly: the HTTP layer converts them to its own wire types.
"""

from __future__ import annotations

from typing import Literal

import attrs

from inference_server.core.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "timeout", "error"]


@attrs.frozen
class ScheduledSequence:
    """One sequence's work in a step: compute ``token_ids`` at positions ``cached_len ..``.

    ``block_tables[g]`` lists the sequence's blocks of KV block group g, covering every position up to
    ``cached_len + len(token_ids)`` that the group's layers can still read. ``sample`` is true when the chunk
    ends at the sequence's newest token, so the step samples its next token. ``reset`` marks the first chunk
    of a (re)started sequence: the runner forgets any state it had for the request.
    """

    request_id: int
    token_ids: tuple[int, ...]
    cached_len: int
    block_tables: tuple[tuple[int, ...], ...]
    sample: bool
    sampling: SamplingParams
    reset: bool = False
    prompt_len: int = 0  # tokens of the request's prompt (penalties treat prompt and output apart)


@attrs.frozen
class StepPlan:
    """Everything the executor needs for one forward step."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    finished_request_ids: tuple[int, ...] = ()  # the runner drops per-request state for these

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@attrs.frozen
class SampledToken:
    request_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...]
    num_computed_tokens: int
    seconds: float


# -- requests entering the engine and what their streams carry ------------------------------------------


@attrs.frozen
class ChatMessage:
    role: str
    content: str


@attrs.frozen
class GenerationRequest:
    """A request as submitted to the engine (HTTP or offline API), before validation and tokenisation.

    Exactly one of ``prompt`` (text), ``prompt_ids`` (token ids) or ``messages`` (chat) is set.
    """

    params: SamplingParams
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special_tokens: bool = True
    session_id: str | None = None
    priority: int = 0
    trace_id: str | None = None
    cache_salt: str | None = None


ErrorCode = Literal["invalid_request", "context_length_exceeded", "overloaded", "unavailable", "internal"]


@attrs.frozen
class Admitted:
    """First item of an accepted request's stream: it is queued and will end with one terminal update."""

    request_id: int
    prompt_tokens: int


@attrs.frozen
class Rejected:
    """The only item of a refused request's stream; nothing was queued."""

    code: ErrorCode
    message: str
    param: str | None = None


@attrs.frozen
class Abort:
    """Ask the scheduler to end a request (client gone)."""

    request_id: int
    reason: FinishReason = "abort"
