"""Admission checks: everything that can never run is refused before anything is queued.

``prepare`` validates a ``GenerationRequest`` against the engine's limits, applies the chat template,
tokenises, and returns the prompt token ids, or raises ``RequestError`` carrying an OpenAI-style code and
the offending parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from inference_server.messages import ErrorCode, GenerationRequest


class RequestError(ValueError):
    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.param = param


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]: ...


def tokenize(request: GenerationRequest, tokenizer: PromptTokenizer | None) -> tuple[int, ...]:
    """The prompt's token ids (text, ids or chat messages)."""
    given = [x for x in (request.prompt, request.prompt_ids, request.messages) if x is not None]
    if len(given) != 1:
        raise RequestError("invalid_request", "exactly one of prompt, prompt token ids or messages is required",
                           "prompt")
    if request.prompt_ids is not None:
        return tuple(request.prompt_ids)
    if tokenizer is None:
        raise RequestError("invalid_request", "this model has no tokenizer: send the prompt as token ids",
                           "prompt")
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # a template error is the request's problem, reported as such
            raise RequestError("invalid_request", f"cannot apply the chat template: {error}", "messages") from None
        return tuple(ids)
    try:
        ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    except Exception as error:  # whatever one prompt makes the tokenizer raise is that request's error alone
        raise RequestError("invalid_request", f"cannot tokenize the prompt: {error}", "prompt") from None
    return tuple(ids)


def prepare(request: GenerationRequest, tokenizer: PromptTokenizer | None, *, max_model_len: int,
            vocab_size: int) -> tuple[int, ...]:
    """Validated prompt token ids for ``request`` (raises ``RequestError``)."""
    try:
        request.params.validate()
    except ValueError as error:
        field = str(error).split(" ", 1)[0]
        raise RequestError("invalid_request", str(error), field) from None
    prompt_ids = tokenize(request, tokenizer)
    if not prompt_ids:
        raise RequestError("invalid_request", "the prompt is empty", "prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError("invalid_request", f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})",
                           "prompt")
    max_tokens = request.params.max_tokens
    if max_tokens > max_model_len - 1:
        raise RequestError("invalid_request", f"max_tokens={max_tokens} is too large: this model's context is "
                           f"{max_model_len} tokens", "max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            "messages" if request.messages is not None else "prompt",
        )
    return prompt_ids
