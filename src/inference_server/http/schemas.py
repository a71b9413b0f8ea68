"""Wire records of the request bodies (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, the utility
routes; ``responses_schema`` has the Responses API's): attrs classes that ``body_parser`` builds from JSON,
strictly (unknown fields, wrong types and bad JSON are 400s naming the field).

Optional fields are ``None`` when absent (or sent as ``null``); the routes apply the defaults, so a JSON
``null`` means "the default", as in the OpenAI API. Records are frozen, ``kw_only`` so that inheritance
can mix required and optional fields.
"""

from __future__ import annotations

from typing import Any

import attrs

PromptInput = str | list[str] | list[int] | list[list[int]]
"""``/v1/completions`` ``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
StopInput = str | list[str] | None
LogitBiasInput = dict[str, float] | None
"""OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) mapped to biases."""


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None
    """OpenAI's side-channel padding of stream events: never written, so ``false`` is what is served and ``true``
    a 400 (``convert.refuse_obfuscation``)."""
    min_characters: int | None = None
    """Hold a choice's streamed text until at least this many characters are buffered (the last chunk carries
    the rest); also accepted as the body's top-level ``min_characters``, as vLLM's tests send it."""


@attrs.frozen(kw_only=True)
class SamplingFields:
    """Sampling and stopping fields shared by every generation route (vLLM's names and ranges)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: StopInput = None
    stop_regex: StopInput = None
    """SGLang's: a pattern or a list of them; the output ends before the first match (``core/stop_regex.py``)."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    logit_bias: LogitBiasInput = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    """vLLM's: words the output never contains as tokens (``core/bad_words.py``)."""
    min_tokens: int | None = None
    truncate_prompt_tokens: int | None = None
    # Structured outputs (vLLM's); read by ``constraint_fields``, which checks their values.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # SGLang's structured outputs (``json_schema``: an object or its JSON text; ``ebnf``: a grammar), sent by
    # SGLang's clients on every route (``extra_body={"regex": ...}``).
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    truncation_side: str | None = None
    """vLLM's: with ``truncate_prompt_tokens``, ``left`` (the default) keeps the last tokens, ``right`` the
    first."""
    skip_special_tokens: bool | None = None
    """vLLM's and SGLang's: false keeps special tokens (other than stop tokens) in the output text."""
    cache_salt: str | None = None
    """vLLM's: keeps this request's prefix-cache entries apart from other salts' (a non-empty string)."""


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """``response_format``: ``text`` (the default), ``json_object``, ``json_schema``, or ``structural_tag`` with
    ``structures`` and ``triggers`` (``constraint_fields``)."""

    type: str
    json_schema: Any = None
    structures: Any = None
    triggers: Any = None
    format: Any = None
    """xgrammar's newer structural-tag shape: refused with a message (``constraint_fields``)."""


@attrs.frozen(kw_only=True)
class OpenAIOutputFields(SamplingFields):
    """Fields of both OpenAI routes: vLLM's token-id extensions and ``response_format``."""

    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    request_id: str | None = None
    """vLLM's: the request's id (1-128 visible ASCII characters): the response's ``id`` is the route's prefix
    and it (``chatcmpl-<request_id>``), and it is the trace id when no ``X-Trace-Id`` / ``X-Request-Id``
    header is sent (``convert.request_ids``)."""
    no_stop_trim: bool | None = None
    """SGLang's: true keeps the matched stop string or stop token's text at the end of the output, as
    ``include_stop_str_in_output`` (``convert.keeps_stop``)."""
    rid: str | list[str] | None = None
    """SGLang's request id: the response's ``id`` as sent (no prefix), and the trace id when no header names
    one (``convert.sglang_rid``); a list and ``rid`` with ``request_id`` are 400s."""
    min_characters: int | None = None
    """vLLM's tests send it here; the same as ``stream_options.min_characters``."""


@attrs.frozen(kw_only=True)
class GenerateRequest(SamplingFields):
    """``POST /generate`` (native)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stream: bool | None = None
    session_id: str | None = None
    trace_id: str | None = None
    add_special_tokens: bool | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(OpenAIOutputFields):
    """``POST /v1/completions``."""

    prompt: PromptInput
    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool | None = None
    prompt_logprobs: int | None = None
    user: str | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None


@attrs.frozen(kw_only=True)
class ContentPart:
    """One part of a chat message's content; only ``{"type": "text", "text": ...}`` is supported.

    ``cache_control`` (Anthropic's prompt-caching mark, ``{"type": "ephemeral"}``, which LiteLLM and other
    clients send on OpenAI-style parts) is accepted and ignored: the prefix cache needs no marks."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    cache_control: dict[str, Any] | None = None


ContentInput = str | list[ContentPart] | None


@attrs.frozen(kw_only=True)
class FunctionCallInput:
    """An earlier call's function: ``arguments`` is OpenAI's JSON text (an object is accepted too)."""

    name: str
    arguments: Any = None
    parsed_arguments: Any = None
    """The OpenAI SDK's parse of ``arguments`` (``.parse()`` and the stream helper keep it on the message a
    client appends to ``messages``): accepted and ignored, ``arguments`` is the call."""


@attrs.frozen(kw_only=True)
class ToolCallInput:
    """One of an assistant message's earlier ``tool_calls``."""

    function: FunctionCallInput
    id: str | None = None
    type: str | None = None
    index: int | None = None
    """The stream's call index, kept by the OpenAI SDK's stream helper on the calls it accumulates: ignored."""


@attrs.frozen(kw_only=True)
class ChatMessageInput:
    """A chat message. ``name`` (passed to the template for ``tool`` messages) and ``type`` are accepted (lm-eval
    and AIPerf send them); ``tool_calls``, ``tool_call_id`` and ``reasoning_content`` carry an agent loop's
    history to the chat template.

    ``refusal``, ``annotations``, ``parsed``, ``audio`` and ``function_call`` are the fields of a reply the
    OpenAI SDK writes back when a client appends ``completion.choices[0].message`` to ``messages`` (the
    ``.parse()`` and stream helpers' messages carry them all, mostly null): the first three are ignored, as
    vLLM does; ``audio`` and ``function_call`` are refused unless empty (``chat_tools.message_extras``)."""

    role: str
    content: ContentInput = None
    name: str | None = None
    type: str | None = None
    tool_calls: list[ToolCallInput] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """vLLM's newer name of ``reasoning_content`` (OpenRouter's too): the same, both sent must agree."""
    refusal: str | None = None
    annotations: Any = None
    parsed: Any = None
    audio: Any = None
    function_call: Any = None


@attrs.frozen(kw_only=True)
class FunctionDefinition:
    """A tool's function: ``parameters`` is a JSON Schema object (the arguments a call must match)."""

    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class ToolDefinition:
    """One of ``tools``: only ``{"type": "function", "function": {...}}``."""

    type: str
    function: FunctionDefinition | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(OpenAIOutputFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageInput]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Any = None
    reasoning_effort: str | None = None
    prompt_logprobs: int | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    include_reasoning: bool | None = None
    """vLLM's: false leaves the reasoning section out of the reply (``reasoning_content`` null, no reasoning
    deltas) and, with a reasoning parser, the choices' ``logprobs`` and ``token_ids`` too (they would show it)."""
    separate_reasoning: bool | None = None
    """SGLang's (default true): false runs no reasoning parser, so the reasoning section stays in ``content`` as
    the model wrote it (``ChatOutputSpec.shown``)."""
    stream_reasoning: bool | None = None
    """SGLang's (default true): false holds a stream's reasoning back until its section closes (or the output
    ends), then sends it in one ``reasoning_content`` delta; whole replies are unchanged."""
    chat_template: str | None = None
    """vLLM's request-level template: refused unless null (``chat_tools.refuse_request_template``)."""
    # OpenAI fields with nothing to change here (docs/api.md): nothing is stored, there is one service tier,
    # the prefix cache needs no key; ``safety_identifier`` (``user``'s successor) keys the session as ``user`` does.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# -- vLLM's utility routes (/tokenize, /detokenize) -------------------------------------------------------


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered with the served chat template (with
    ``tools`` and ``chat_template_kwargs`` as on chat, vLLM's fields). ``add_special_tokens`` defaults as
    vLLM's: true for a prompt, false for messages (the template writes them)."""

    prompt: str | None = None
    messages: list[ChatMessageInput] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: Any = None
    model: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    chat_template: str | None = None
    """As on chat: refused unless null."""


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """``POST /detokenize``: token ids back to text."""

    tokens: list[int]
    model: str | None = None
