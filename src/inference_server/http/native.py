"""``POST /generate``: the native generation route (text or token-id prompt, streamed or not).

Request: ``prompt`` (text) or ``prompt_token_ids``, every ``SamplingParams`` field, ``logprobs`` (top-n per
token, 0 = only the sampled token's), ``session_id`` (else the ``X-Session-Id`` header), ``priority``
(smaller runs first), ``trace_id`` (used when no ``X-Trace-Id`` header is sent), ``add_special_tokens``,
``cache_salt``, ``stream``, ``prompt_logprobs`` (vLLM's: the first event, or the whole response, carries
``prompt_logprobs``: ``null`` for the first prompt token, then ``{"token_id", "logprob", "top_logprobs"}``).

Streamed, each event is ``{"token_ids": [...], "text": "..."}`` (plus ``logprobs`` and ``top_logprobs``
when asked for), covering every token generated since the previous event; the last event adds ``id``,
``finish_reason``, ``stop_reason`` and ``usage`` (and ``error`` when the request failed), then
``data: [DONE]``. Not streamed, one object with the same fields for the whole output.
"""

from __future__ import annotations

import uuid
from typing import Any

from quart import Response, g, request

from inference_server.http.convert import (
    DEFAULT_MAX_TOKENS,
    SESSION_ID_HEADER,
    cache_salt,
    client_trace_id,
    header_id,
    sampling_params,
    truncation_side,
)
from inference_server.http.errors import ApiError, from_unsuccessful_finish, invalid_request
from inference_server.http.generation import admit
from inference_server.http.responses import json_response, read_body, sse_response
from inference_server.http.schemas import GenerateRequest
from inference_server.http.sse import event, json_string, raw_event
from inference_server.http.state import AppState
from inference_server.http.usage import usage
from inference_server.records.requests import GenerationRequest, RequestUpdate


class NativeRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def generate(self) -> Response:
        """``POST /generate``."""
        state = self.state
        state.check_accepting()
        body = await read_body(GenerateRequest)
        if (body.prompt is None) == (body.prompt_token_ids is None):
            raise invalid_request("send exactly one of 'prompt' (text) or 'prompt_token_ids'", "prompt")
        if client_trace_id(request.headers) is None and body.trace_id is not None:  # a header wins over the body
            g.trace_id = header_id(body.trace_id, "trace_id")
        params = sampling_params(body, max_tokens=_or_default(body.max_tokens), logprobs=body.logprobs,
                                 prompt_logprobs=body.prompt_logprobs, vocab_size=state.engine.info.vocab_size)
        engine_request = GenerationRequest(truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=truncation_side(body),
            params=params, prompt=body.prompt,
            prompt_ids=tuple(body.prompt_token_ids) if body.prompt_token_ids is not None else None,
            add_special_tokens=body.add_special_tokens is not False,
            session_id=header_id(body.session_id, "session_id")
            or header_id(request.headers.get(SESSION_ID_HEADER), SESSION_ID_HEADER),
            priority=body.priority or 0, trace_id=g.trace_id, cache_salt=cache_salt(body))
        generation = await admit(state.engine, [engine_request], state.tracker)
        encoder = NativeEncoder(f"gen-{uuid.uuid4().hex}", generation.prompt_tokens[0], params.logprobs is not None,
                                state)
        if body.stream:
            return sse_response(generation, encoder, coalesce=state.coalesce)
        (result,) = await generation.successful_results(state.engine)
        return json_response(encoder.payload(result, final=True))


def _or_default(max_tokens: int | None) -> int:
    return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens


class NativeEncoder:
    """Native SSE events and the non-streamed response (see the module docstring)."""

    def __init__(self, response_id: str, prompt_tokens: int, with_logprobs: bool, state: AppState) -> None:
        self.response_id = response_id
        self.prompt_tokens = prompt_tokens
        self.with_logprobs = with_logprobs
        self.state = state
        self.completion_tokens = 0

    def payload(self, update: RequestUpdate, *, final: bool) -> dict[str, Any]:
        tokens = update.tokens
        self.completion_tokens += len(tokens)
        payload: dict[str, Any] = {"token_ids": [t.token_id for t in tokens], "text": "".join(t.text for t in tokens)}
        if self.with_logprobs:
            payload["logprobs"] = [t.logprob for t in tokens]
            payload["top_logprobs"] = [[list(pair) for pair in t.top_logprobs] for t in tokens]
        if update.prompt_logprobs is not None:  # once: on the first event (or the whole response)
            payload["prompt_logprobs"] = [
                None if p.logprob is None else
                {"token_id": p.token_id, "logprob": p.logprob, "top_logprobs": [list(pair) for pair in p.top_logprobs]}
                for p in update.prompt_logprobs]
        if final:
            payload = {"id": self.response_id, **payload, "finish_reason": update.finish_reason,
                       "stop_reason": update.stop_reason,
                       "usage": usage(self.prompt_tokens, self.completion_tokens, update.cached_prompt_tokens)}
        return payload

    def opening(self) -> bytes:
        return b""

    def update(self, index: int, update: RequestUpdate) -> bytes:
        if update.finished or update.prompt_logprobs is not None or self.with_logprobs:
            return event(self.payload(update, final=update.finished))
        tokens = update.tokens
        if not tokens:
            return b""
        # The common event, spliced from pre-encoded parts (what ``payload`` + ``dumps`` would write).
        self.completion_tokens += len(tokens)
        ids = ",".join([str(t.token_id) for t in tokens])
        return raw_event('{"token_ids":[' + ids + '],"text":' + json_string("".join([t.text for t in tokens])) + "}")

    def failure(self, index: int, update: RequestUpdate) -> bytes:
        payload = self.payload(update, final=True)
        payload.update(from_unsuccessful_finish(update, engine_failed=self.state.engine.failed).body())
        return event(payload)

    def closing(self) -> bytes:
        return b""

    def error(self, error: ApiError) -> bytes:
        return event(error.body())
