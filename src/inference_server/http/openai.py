"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Conventions (see docs/api.md for every field):

* ``model`` must be a served name (``/v1/models``: ``SERVED_MODEL_NAME``'s aliases) or absent; anything else is
  404 ``model_not_found``. Responses report the first name.
* ``n`` choices (1..``MAX_N``) are ``n`` engine requests submitted together; with a ``seed``, choice ``j``
  uses ``seed + j`` (``SamplingParams.sample``, as the offline ``LLM``'s ``n``) so the choices differ and stay
  reproducible. A list of prompts gives ``len(prompts) * n`` choices, choice ``i * n + j`` being prompt ``i``'s
  ``j``-th.
* Session (fair-share scheduling): the ``X-Session-Id`` header, else the ``user`` field.
* vLLM's ``request_id``: the response's ``id`` is ``chatcmpl-<it>`` / ``cmpl-<it>`` (an ``X-Request-Id`` header
  wins over it, as in vLLM; neither: a fresh id), and it is the trace id unless a header names one. SGLang's
  ``rid`` (a string) is the response's ``id`` as sent, as SGLang's, and the trace id unless a header names one.
* Chat: ``max_completion_tokens`` (or the older ``max_tokens``; both given must agree); absent, the reply is
  capped at ``DEFAULT_MAX_TOKENS`` (never more than the rest of the context). The template's turn markers
  are stops (``models/chat_templates.ChatStops``). Message content is a string or a list of
  ``text`` parts (joined with newlines); roles ``system``, ``developer`` (as ``system``), ``user``,
  ``assistant``, ``tool``.
* ``echo`` (completions, streamed or not): each choice's text (its first chunk's, streamed) starts with its
  prompt (token ids are decoded without special tokens) and, with ``logprobs``,
  its ``logprobs`` start with the prompt's tokens (the first one's logprob and top dict ``null``), the
  prompt logprobs being computed in the request's prefill. ``max_tokens: 0`` with ``echo`` (or
  ``prompt_logprobs``) only scores the prompt. ``prompt_logprobs`` (vLLM) adds each choice's
  ``prompt_logprobs`` list (not streamed).
* Chat, vLLM's extensions: ``prompt_logprobs`` (a top-level list, not streamed); ``continue_final_message``
  (the final message, the assistant's, stays open for the model to continue) with ``add_generation_prompt``
  (default: true unless continuing; both true is a 400); ``echo`` (the reply starts with the final message's
  content when that message is the assistant's).
* ``truncation_side`` (``left``/``right``) picks the end ``truncate_prompt_tokens`` cuts; ``min_characters``
  (top level or in ``stream_options``) holds streamed text until that many characters are buffered.
* ``stream_options`` needs ``stream: true`` (400 otherwise); ``continuous_usage_stats`` only counts together
  with ``include_usage`` (vLLM). ``response_format`` json_object / json_schema constrain the output
  (``constraint_fields``).
* vLLM's ``return_token_ids`` adds ``prompt_token_ids`` (per completion choice; top level in chat) and each
  choice's ``token_ids``; ``return_tokens_as_token_ids`` renders logprob tokens as ``token_id:N``.
* Tools and reasoning (``chat_tools``, ``chat_output``): ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` /
  ``chat_template_kwargs`` reach the chat template; replies are parsed into ``tool_calls`` (``finish_reason:
  tool_calls``) and ``reasoning_content`` by the served family's parsers (vLLM's ``include_reasoning: false``
  drops the reasoning, and with it the choices' ``logprobs`` and ``token_ids``, which would show it; SGLang's
  ``separate_reasoning: false`` leaves it in ``content`` as written, ``stream_reasoning: false`` streams it
  whole once its section closes);
  ``tool_choice`` required / named is forced by a ``Constraint.tool_calls`` grammar
  (``chat_tools.forced_call_constraint``).
* Not supported, with a 400 that says so: ``suffix``, ``best_of`` > 1, the legacy ``functions``, non-text
  content, vLLM's request-level ``chat_template`` and ``use_beam_search`` (``body_parser.UNSUPPORTED_FIELDS``);
  message keys and roles the server does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from quart import Response, g, request

from inference_server.http.chat_output import ChatOutputSpec
from inference_server.http.chat_tools import (
    ToolRequest,
    effort_template_kwargs,
    forced_call_constraint,
    message_extras,
    refuse_request_template,
    template_kwargs,
    tool_request,
    with_effort,
)
from inference_server.http.constraint_fields import after_reasoning, constraint_of
from inference_server.http.convert import (
    DEFAULT_MAX_TOKENS,
    SESSION_ID_HEADER,
    cache_salt,
    chat_prompt_flags,
    header_id,
    min_characters,
    refuse_obfuscation,
    refuse_service_tier,
    request_ids,
    sampling_params,
    sglang_rid,
    structured_fields,
    truncation_side,
)
from inference_server.http.errors import invalid_request
from inference_server.http.generation import Generation, admit
from inference_server.http.openai_format import (
    ChatEncoder,
    CompletionEncoder,
    OutputOptions,
    chat_response,
    completion_response,
    new_id,
)
from inference_server.http.responses import json_response, read_body, sse_response
from inference_server.http.schemas import (
    ChatCompletionRequest,
    ChatMessageInput,
    CompletionRequest,
    StreamOptions,
)
from inference_server.http.state import AppState
from inference_server.records.requests import ChatMessage, GenerationRequest
from inference_server.records.sampling_params import SamplingParams

Record = TypeVar("Record", CompletionRequest, ChatCompletionRequest)
OpenAIRecord = CompletionRequest | ChatCompletionRequest

MAX_N = 16
"""Most choices per prompt."""
MAX_CHOICES = 256
"""Most choices per request (prompts times ``n``)."""
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class OpenAIRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    # -- models --------------------------------------------------------------------------------------
    def _model_card(self, name: str) -> dict:
        """vLLM's card; ``root`` is the served model's name (SGLang's rule: the reported name), never where the
        weights lie on the server's disk (a client has no use for the server's file layout); ``parent`` null (a
        base model, not an adapter)."""
        state, info = self.state, self.state.engine.info
        return {"id": name, "object": "model", "created": state.started_at, "owned_by": "inference_server",
                "root": state.model_name, "parent": None, "max_model_len": info.max_model_len,
                "default_max_tokens": info.default_max_tokens}

    async def models(self) -> Response:
        """``GET /v1/models``: the served model, once per accepted name (the reported name first)."""
        return json_response({"object": "list", "data": [self._model_card(name) for name in self.state.model_names]})

    async def model(self, model: str) -> Response:
        """``GET /v1/models/<model>``."""
        self.state.check_model(model)
        return json_response(self._model_card(model))

    # -- completions ---------------------------------------------------------------------------------
    async def completions(self) -> Response:
        """``POST /v1/completions``."""
        body = await self._read(CompletionRequest)
        requests, n = self._completion_requests(body)
        generation = await admit(self.state.engine, requests, self.state.tracker)
        prompts = [self._prompt_text(r) for r in requests] if body.echo else None
        if body.stream:
            return await self._respond(generation, n, requests[0].params.logprobs is not None, body,
                                       CompletionEncoder, completion_response, "cmpl",
                                       stream_kwargs={"echo_prompts": prompts})
        if body.echo or body.prompt_logprobs is not None:
            results = await generation.successful_results(self.state.engine)
            return json_response(completion_response(
                self.state, _response_id("cmpl", body), results, generation.prompt_tokens, n,
                with_logprobs=body.logprobs is not None, echo_prompts=prompts,
                with_prompt_logprobs=body.prompt_logprobs is not None, options=_output_options(body, generation)))
        return await self._respond(generation, n, requests[0].params.logprobs is not None, body,
                                   CompletionEncoder, completion_response, "cmpl")

    def _prompt_text(self, engine_request: GenerationRequest) -> str:
        """What ``echo`` puts before a choice's text: the prompt as sent, or the decoded token ids without
        their special tokens (SGLang's rule: the echo of ``tokenizer.encode(text)``, BOS included, starts with
        ``text``)."""
        if engine_request.prompt is not None:
            return engine_request.prompt
        ids = engine_request.prompt_ids or ()
        tokenizer = self.state.engine.info.tokenizer
        if tokenizer is not None:
            return tokenizer.decode(ids, skip_special_tokens=True)
        return "".join(self.state.token_text(i) for i in ids)

    def _completion_requests(self, body: CompletionRequest) -> tuple[list[GenerationRequest], int]:
        if body.prompt_logprobs is not None and body.stream:
            raise invalid_request("prompt_logprobs is not supported with stream: true; send stream: false",
                                  "prompt_logprobs", "unsupported_parameter")
        if body.suffix:
            raise invalid_request("suffix is not supported", "suffix", "unsupported_parameter")
        if body.best_of not in (None, 1):
            raise invalid_request("best_of > 1 is not supported; use n", "best_of", "unsupported_parameter")
        prompts = _prompts(body.prompt)
        n = _choice_count(body.n, len(prompts))
        params = sampling_params(body, max_tokens=_or_default(body.max_tokens), logprobs=body.logprobs,
                                 prompt_logprobs=_engine_prompt_logprobs(body),
                                 vocab_size=self.state.engine.info.vocab_size)
        session = self._session(body.user)
        side, salt = truncation_side(body), cache_salt(body)
        requests = [
            GenerationRequest(params=params.sample(j), prompt=p if isinstance(p, str) else None,
                              prompt_ids=p if not isinstance(p, str) else None,
                              add_special_tokens=body.add_special_tokens is not False, session_id=session,
                              priority=body.priority or 0, trace_id=g.trace_id, cache_salt=salt,
                              truncate_prompt_tokens=body.truncate_prompt_tokens, truncation_side=side)
            for p in prompts for j in range(n)]
        return requests, n

    # -- chat ----------------------------------------------------------------------------------------
    async def chat_completions(self) -> Response:
        """``POST /v1/chat/completions``."""
        body = await self._read(ChatCompletionRequest)
        requests, n, renames, output = self._chat_requests(body)
        generation = await admit(self.state.engine, requests, self.state.tracker, renames=renames)
        echo = _chat_echo(body, requests[0])
        return await self._respond(generation, n, requests[0].params.logprobs is not None, body,
                                   ChatEncoder, chat_response, "chatcmpl", chat_output=output,
                                   stream_kwargs={"echo": echo},
                                   response_kwargs={"echo": echo,
                                                    "with_prompt_logprobs": body.prompt_logprobs is not None})

    def _tool_request(self, body: ChatCompletionRequest) -> ToolRequest:
        """The request's tools and parsers; ``required`` / a named tool are forced by the grammar."""
        state = self.state
        return tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_format,
                            state.reasoning_format)

    def _chat_requests(self, body: ChatCompletionRequest
                       ) -> tuple[list[GenerationRequest], int, dict[str, str], ChatOutputSpec]:
        messages = chat_messages(body.messages)
        tools = self._tool_request(body)
        kwargs = with_effort(template_kwargs(body.chat_template_kwargs),
                             effort_template_kwargs(body.reasoning_effort, "reasoning_effort"))
        refuse_service_tier(body.service_tier)
        refuse_request_template(body.chat_template)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_request("top_logprobs requires logprobs: true", "top_logprobs")
        if body.prompt_logprobs is not None and body.stream:
            raise invalid_request("prompt_logprobs is not supported with stream: true; send stream: false",
                                  "prompt_logprobs", "unsupported_parameter")
        add_generation_prompt, continue_final = chat_prompt_flags(
            body.add_generation_prompt, body.continue_final_message, messages[-1].role)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens, max_field = _chat_max_tokens(body)
        n = _choice_count(body.n, 1)
        # max_tokens None: min(DEFAULT_MAX_TOKENS, the rest of the context), resolved by admission once the
        # prompt is tokenised.
        forced = forced_call_constraint(tools)
        params = self.state.chat_stops.apply(sampling_params(body, max_tokens=max_tokens, logprobs=logprobs,
                                                             prompt_logprobs=body.prompt_logprobs,
                                                             vocab_size=self.state.engine.info.vocab_size,
                                                             constraint=forced))
        if forced is not None and constraint_of(structured_fields(body)) is not None:
            raise invalid_request("tool_choice required or a named tool cannot be combined with structured output "
                                  "(response_format, structured_outputs, guided_*)", "tool_choice")
        params = keep_marker_tokens(after_reasoning(params, tools.output.reasoning, kwargs), tools.output)
        session = self._session(body.user or body.safety_identifier)
        side, salt = truncation_side(body), cache_salt(body)
        requests = [
            GenerationRequest(params=params.sample(j), messages=messages, session_id=session,
                              priority=body.priority or 0, trace_id=g.trace_id, cache_salt=salt,
                              truncate_prompt_tokens=body.truncate_prompt_tokens, truncation_side=side,
                              add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
                              tools=tools.template_tools, chat_template_kwargs=kwargs)
            for j in range(n)]
        renames = {"logprobs": "top_logprobs", "max_tokens": max_field, "prompt": "messages"}
        output = tools.output.shown(include=body.include_reasoning, separate=body.separate_reasoning,
                                    stream=body.stream_reasoning)
        return requests, n, renames, output

    # -- shared --------------------------------------------------------------------------------------
    async def _read(self, record_type: type[Record]) -> Record:
        """The parsed body, once shutdown has not begun and its ``model`` is ours."""
        self.state.check_accepting()
        body = await read_body(record_type)
        self.state.check_model(body.model)
        _check_output_fields(body)
        rid = sglang_rid(body.rid, body.request_id)
        _, trace_id = request_ids(request.headers, rid if rid is not None else body.request_id,
                                  "rid" if rid is not None else "request_id")
        if trace_id is not None:  # before the engine requests are built: they carry it
            g.trace_id = trace_id
        return body

    async def _respond(self, generation: Generation, n: int, with_logprobs: bool, body: OpenAIRecord,
                       encoder_type: type[CompletionEncoder | ChatEncoder], build_response: Callable[..., dict],
                       id_prefix: str, *, chat_output: ChatOutputSpec | None = None,
                       stream_kwargs: dict | None = None, response_kwargs: dict | None = None) -> Response:
        """Stream ``generation`` through ``encoder_type``, or collect it into ``build_response``'s body (each
        given its route's own keyword arguments)."""
        state, response_id = self.state, _response_id(id_prefix, body)
        options = _output_options(body, generation)
        if chat_output is not None and chat_output.active:
            options = attrs.evolve(options, chat_output=chat_output)
        if body.stream:
            include_usage, continuous = _stream_usage(body.stream_options)
            encoder = encoder_type(state, response_id, generation.prompt_tokens, n, with_logprobs=with_logprobs,
                                   include_usage=include_usage, continuous_usage=continuous, options=options,
                                   min_characters=min_characters(body.min_characters, body.stream_options, True),
                                   **(stream_kwargs or {}))
            return sse_response(generation, encoder, coalesce=state.coalesce)
        results = await generation.successful_results(self.state.engine)
        return json_response(build_response(state, response_id, results, generation.prompt_tokens, n,
                                            with_logprobs=with_logprobs, options=options, **(response_kwargs or {})))

    # -- helpers -------------------------------------------------------------------------------------
    def _session(self, user: str | None) -> str | None:
        return header_id(request.headers.get(SESSION_ID_HEADER), SESSION_ID_HEADER) or user



def _response_id(prefix: str, body: OpenAIRecord) -> str:
    """SGLang's ``rid`` as sent (SGLang's response id is the request's id; it reads no header), else
    ``<prefix>-<id>``: vLLM's, the ``X-Request-Id`` header's or ``request_id``'s id when one was sent, else a
    fresh one."""
    if isinstance(body.rid, str):  # checked by ``_read``
        return body.rid
    base, _ = request_ids(request.headers, body.request_id)
    return f"{prefix}-{base}" if base is not None else new_id(prefix)


def _output_options(body: OpenAIRecord, generation: Generation) -> OutputOptions:
    """vLLM's output extensions the request asked for."""
    return OutputOptions(token_ids=bool(body.return_token_ids), tokens_as_ids=bool(body.return_tokens_as_token_ids),
                         prompt_token_ids=tuple(generation.prompt_token_ids))


def keep_marker_tokens(params: SamplingParams, output: ChatOutputSpec) -> SamplingParams:
    """Gemma 4 writes its call and thinking markers as special tokens: its parsers need them in the text."""
    formats = {fmt.name for fmt in (output.tools, output.reasoning) if fmt is not None}
    return attrs.evolve(params, skip_special_tokens=False) if "gemma4" in formats else params


def _or_default(max_tokens: int | None) -> int:
    return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The engine's ``prompt_logprobs`` for a completion: ``echo`` with ``logprobs`` (or with ``max_tokens:
    0``, scoring only) needs the prompt's logprobs with the same top-n; ``prompt_logprobs`` asks directly;
    both: the larger top-n serves both. Invalid values are passed on for the engine to name."""
    wanted = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        wanted.append(body.logprobs or 0)
    if not wanted:
        return None
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in wanted):
        return wanted[0]
    return max(wanted)


def _prompts(prompt: str | list) -> list[str | tuple[int, ...]]:
    """The completion prompt as a list of texts or token-id tuples."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [tuple(prompt)]
    return [p if isinstance(p, str) else tuple(p) for p in prompt]


def _choice_count(n: int | None, prompts: int) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise invalid_request(f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    if n * prompts > MAX_CHOICES:
        raise invalid_request(f"{prompts} prompts x n={n} exceeds the limit of {MAX_CHOICES} choices per request",
                              "prompt")
    return n


def _stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous usage): per-chunk usage only together with ``include_usage`` (vLLM)."""
    if options is None:
        return False, False
    include = bool(options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def _check_output_fields(body: OpenAIRecord) -> None:
    """``stream_options`` only with ``stream`` (vLLM's rule), ``min_characters`` valid; ``response_format``
    is read with the sampling fields (``constraint_fields``)."""
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options can only be set when stream is true", "stream_options")
    if body.stream_options is not None:
        refuse_obfuscation(body.stream_options.include_obfuscation)
    min_characters(body.min_characters, body.stream_options, body.stream)


def _chat_echo(body: ChatCompletionRequest, engine_request: GenerationRequest) -> str:
    """vLLM's chat ``echo``: the final message's content, when that message is the assistant's (the reply
    continues or follows it); otherwise nothing."""
    messages = engine_request.messages or ()
    if not body.echo or not messages or messages[-1].role != "assistant":
        return ""
    return messages[-1].content


def _chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The output cap and the field it came from."""
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise invalid_request("max_tokens and max_completion_tokens disagree; send one of them",
                              "max_completion_tokens")
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def chat_messages(inputs: Sequence[ChatMessageInput]) -> tuple[ChatMessage, ...]:
    """A chat request's messages as the chat template sees them (roles, text content, an agent loop's history);
    a 400 naming the field for an empty list or a message the server cannot render. The offline ``LLM.chat``
    reads its conversations through this too."""
    messages = tuple(_chat_message(m, i) for i, m in enumerate(inputs))
    if not messages:
        raise invalid_request("messages must not be empty", "messages")
    return messages


def _chat_message(message: ChatMessageInput, index: int) -> ChatMessage:
    role = CHAT_ROLES.get(message.role)
    if role is None:
        # vLLM passes any role to the template, but the served templates cannot honour one: Qwen3's drops the
        # message silently, the embedded Gemma 3 one renders it as a user turn, Gemma 4's writes a turn role
        # the model was never trained on. OpenAI and SGLang refuse it too.
        raise invalid_request(f"unknown role {message.role[:40]!r}: the served chat template renders only "
                              f"{', '.join(CHAT_ROLES)}", f"messages[{index}].role")
    return ChatMessage(role, _content_text(message.content, index), **message_extras(message, role, index))


def _content_text(content: str | Sequence | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part_index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid_request(f"content part of type {part.type!r} is not supported; only text parts are",
                                  f"messages[{index}].content[{part_index}]", "unsupported_parameter")
        texts.append(part.text)
    return "\n".join(texts)
