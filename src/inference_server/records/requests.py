"""Request records: a request as submitted to the engine, and what its caller receives back.

A caller (HTTP handler, offline API) submits a ``GenerationRequest`` and reads, through its
``RequestHandle``, first its admission (``Admitted``, or a ``Rejected`` carrying a typed error), then
``RequestUpdate`` s ending in exactly one terminal update (``finish_reason`` set).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from inference_server.records.errors import ErrorCode
from inference_server.records.hot_record import hot_record
from inference_server.records.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "timeout", "error"]


@attrs.frozen
class ChatMessage:
    """One chat message as the chat template sees it.

    ``tool_calls`` (an assistant's earlier calls, OpenAI's ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with ``arguments`` already decoded to an object where it was valid JSON, as vLLM and
    transformers hand them to templates), ``tool_call_id`` and ``name`` (a ``tool`` result) and
    ``reasoning_content`` (an assistant's earlier reasoning) are passed to the template only when set."""

    role: str
    content: str
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the template's ``messages`` entry: role and content, plus the optional keys set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        return out


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
    truncate_prompt_tokens: int | None = None
    """Keep only N prompt tokens (after tokenising / templating); -1 = the context length."""
    truncation_side: Literal["left", "right"] = "left"
    """Which end ``truncate_prompt_tokens`` cuts: ``left`` keeps the last N tokens, ``right`` the first N."""
    add_generation_prompt: bool = True
    """Chat: the template opens the reply's turn (its generation prompt)."""
    continue_final_message: bool = False
    """Chat: the final message is left open (no end-of-turn after it) for the model to continue (prefill)."""
    tools: tuple[Mapping[str, Any], ...] | None = None
    """Chat only: the tool definitions (OpenAI's ``{"type": "function", "function": {...}}``) passed to the
    chat template as ``tools=``, as transformers' ``apply_chat_template`` does; None: no ``tools`` variable."""
    chat_template_kwargs: Mapping[str, Any] | None = None
    """Chat only: extra variables for the chat template (``{"enable_thinking": false}``)."""
    tokenized_from: Literal["prompt", "messages"] | None = None
    """Set where a front process tokenised the prompt (or applied the chat template) itself and sends
    ``prompt_ids``: the field the client sent, which errors about the prompt name (docs/ipc.md)."""


@hot_record
class TokenOutput:
    """One generated token as it reaches a request's stream."""

    token_id: int
    text: str  # newly complete text (may be empty while a character or a stop string is pending)
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class PromptTokenLogprob:
    """One prompt token with its logprob given the tokens before it (None for the first prompt token)."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@hot_record
class RequestUpdate:
    """What one step changed for one request: new tokens and, at the end, exactly one finish."""

    request_id: int
    tokens: tuple[TokenOutput, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_logprobs: tuple[PromptTokenLogprob, ...] | None = None
    """Every prompt token's logprob, once, on the update that carries the first token (or the finish):
    set only for requests with ``SamplingParams.prompt_logprobs``."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def with_tokens(self, tokens: tuple[TokenOutput, ...], prompt_logprobs: tuple[PromptTokenLogprob, ...] | None,
                    cached_prompt_tokens: int | None = None) -> RequestUpdate:
        """This update with ``tokens`` and ``prompt_logprobs`` (and ``cached_prompt_tokens``, when given) instead of
        its own: ``attrs.evolve`` without its per-field introspection, which costs several times the record itself
        (held and coalesced tokens are merged this way on every stream's interval, and the front rewrites every
        update with its text). Positional, in the fields' order."""
        cached = self.cached_prompt_tokens if cached_prompt_tokens is None else cached_prompt_tokens
        return RequestUpdate(self.request_id, tokens, self.finish_reason, self.stop_reason, self.error,
                             self.prompt_tokens, self.completion_tokens, cached, prompt_logprobs)


@attrs.frozen
class Admitted:
    """First item of an accepted request's stream: it is queued and will end with one terminal update."""

    request_id: int
    prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt as the model sees it (after templating and truncation), for ``return_token_ids``."""


@attrs.frozen
class Rejected:
    """The only item of a refused request's stream; nothing was queued (or what was queued is gone)."""

    code: ErrorCode
    message: str
    param: str | None = None
    retry_after: float | None = None  # seconds, for ``overloaded`` when the engine can tell


@attrs.frozen
class Abort:
    """Ask the scheduler to end a request now (its caller closed the handle)."""

    request_id: int
    reason: FinishReason = "abort"


StreamItem = Admitted | Rejected | RequestUpdate
"""What a request's stream carries: ``Admitted`` then updates, or one ``Rejected``."""
