"""Wire records to engine records: sampling parameters, and the identifiers read from headers.

Defaults are ``SamplingParams``' own (the OpenAI API's), applied where a field is absent or ``null``.
Values are not checked here: the engine's admission validates them once, and a bad value comes back as a
``RequestError`` naming the engine's field, which ``errors.from_request_error`` maps to the wire name the
client used (chat's ``top_logprobs``, ``max_completion_tokens``).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from werkzeug.datastructures import Headers

from inference_server.http.constraint_fields import constraint_of
from inference_server.http.errors import invalid_request
from inference_server.http.schemas import LogitBiasInput, SamplingFields, StopInput, StreamOptions
from inference_server.records.constraints import Constraint
from inference_server.records.sampling_params import SamplingParams

DEFAULTS = SamplingParams()
DEFAULT_MAX_TOKENS = 16
"""Output cap of a completion that sets none (the OpenAI API's default for ``/v1/completions``)."""
MAX_HEADER_ID_LENGTH = 128
TRACE_ID_HEADER = "X-Trace-Id"
REQUEST_ID_HEADER = "X-Request-Id"
"""OpenAI's (and vLLM's) name for a request id: read as the trace id when no ``X-Trace-Id`` is sent, and echoed
with it (the OpenAI SDK's ``request_id`` reads it)."""
SESSION_ID_HEADER = "X-Session-Id"
MAX_NAMED_KEYS = 20
"""Most offending ``logit_bias`` keys an error lists by name (the rest are counted)."""

T = TypeVar("T")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def stop_strings(stop: StopInput) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def logit_bias_pairs(bias: LogitBiasInput, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; keys that are not decimal integers are a 400 naming
    every one of them, not only the first (ids outside the vocabulary are refused by admission, which knows
    its size)."""
    if not bias:
        return ()
    pairs, bad = [], []
    for key, value in bias.items():
        text = key.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()):
            bad.append(key)
            continue
        pairs.append((int(text), value))
    if bad:
        size = f" [0, {vocab_size}) (vocabulary size {vocab_size})" if vocab_size is not None else ""
        keys = ", ".join(repr(key) for key in bad[:MAX_NAMED_KEYS]) + (
            f" and {len(bad) - MAX_NAMED_KEYS} more" if len(bad) > MAX_NAMED_KEYS else "")
        raise invalid_request(f"logit_bias key{'s' if len(bad) > 1 else ''} {keys} "
                              f"{'are' if len(bad) > 1 else 'is'} not token ids: keys must be integers{size}",
                              "logit_bias")
    return tuple(sorted(pairs))


def structured_fields(fields: SamplingFields) -> dict[str, Any]:
    """The structured-output fields a wire record carries (``constraint_fields.constraint_of``'s input)."""
    found: dict[str, Any] = {name: getattr(fields, name) for name in (
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "json_schema", "regex", "ebnf")}  # the last three: SGLang's
    response_format = getattr(fields, "response_format", None)
    if response_format is not None:
        found["response_format"] = response_format
    return found


def keeps_stop(fields: SamplingFields) -> bool:
    """Whether the output keeps what stopped it: vLLM's ``include_stop_str_in_output`` or SGLang's
    ``no_stop_trim`` (chat and completions only), either true; one sent true and the other false is a 400
    naming ``no_stop_trim``. SGLang's rule differs in one case: it keeps the whole token that completed a stop
    string, text after the string included, where this server ends the output at the string's end (as vLLM)."""
    include, no_trim = fields.include_stop_str_in_output, getattr(fields, "no_stop_trim", None)
    if include is not None and no_trim is not None and include != no_trim:
        raise invalid_request("no_stop_trim (SGLang's) and include_stop_str_in_output (vLLM's) disagree; send one "
                              "of them", "no_stop_trim")
    return bool(include or no_trim)


def sampling_params(fields: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, vocab_size: int | None = None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """``SamplingParams`` from the shared wire fields plus the route's ``max_tokens`` (``None``: the rest of
    the context), ``logprobs`` and ``prompt_logprobs`` (``vocab_size`` only words the error for a non-integer
    ``logit_bias`` key).
    Values are validated once, by the engine's admission; its errors name the
    engine's fields, which the route maps to its own with ``admit(..., renames=...)``. ``constraint``: the
    route's own structured output (the Responses API's ``text.format``), else the one ``fields`` set."""
    params = SamplingParams(
        constraint=constraint or constraint_of(structured_fields(fields)),
        temperature=_or(fields.temperature, DEFAULTS.temperature),
        top_p=_or(fields.top_p, DEFAULTS.top_p),
        top_k=_or(fields.top_k, DEFAULTS.top_k),
        min_p=_or(fields.min_p, DEFAULTS.min_p),
        repetition_penalty=_or(fields.repetition_penalty, DEFAULTS.repetition_penalty),
        presence_penalty=_or(fields.presence_penalty, DEFAULTS.presence_penalty),
        frequency_penalty=_or(fields.frequency_penalty, DEFAULTS.frequency_penalty),
        seed=fields.seed,
        max_tokens=max_tokens,
        stop=stop_strings(fields.stop),
        stop_regex=stop_strings(fields.stop_regex),
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=bool(fields.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=keeps_stop(fields),
        logit_bias=logit_bias_pairs(fields.logit_bias, vocab_size),
        allowed_token_ids=tuple(fields.allowed_token_ids) if fields.allowed_token_ids is not None else None,
        bad_words=tuple(fields.bad_words or ()),
        min_tokens=_or(fields.min_tokens, DEFAULTS.min_tokens),
        skip_special_tokens=_or(fields.skip_special_tokens, DEFAULTS.skip_special_tokens),
    )
    return params


def client_trace_id(headers: Headers) -> str | None:
    """The trace id a client sent: ``X-Trace-Id``, else ``X-Request-Id`` (each held to ``header_id``'s rule)."""
    return (header_id(headers.get(TRACE_ID_HEADER), TRACE_ID_HEADER)
            or header_id(headers.get(REQUEST_ID_HEADER), REQUEST_ID_HEADER))


def request_ids(headers: Headers, request_id: str | None,
                field: str = "request_id") -> tuple[str | None, str | None]:
    """vLLM's ``request_id`` body field: ``(base of the response id, trace id)``, each None where the server
    picks its own. The response id's base is the ``X-Request-Id`` header, else ``request_id`` (vLLM's
    ``_base_request_id``: ``chatcmpl-<it>``); the trace id is ``request_id`` only when no ``X-Trace-Id`` /
    ``X-Request-Id`` header names one (a header wins, as over ``/generate``'s ``trace_id``). ``request_id`` is
    held to ``header_id``'s rule whether or not a header wins: it reaches logs and telemetry (``field``: the
    body field an error names, SGLang's ``rid`` where that carries the id)."""
    body_id = header_id(request_id, field)
    header = header_id(headers.get(REQUEST_ID_HEADER), REQUEST_ID_HEADER)
    trace = None if client_trace_id(headers) is not None else body_id
    return header or body_id, trace


def sglang_rid(rid: str | list[str] | None, request_id: str | None) -> str | None:
    """SGLang's ``rid`` on chat and completions: the request's id, which SGLang returns as the response's
    ``id`` as it was sent (no ``chatcmpl-`` prefix). One string, held to ``header_id``'s rule; SGLang's list form
    (one id per prompt of a batch) is a 400, since this server answers a request with one response and one id;
    sent with vLLM's ``request_id`` it is a 400 too (two names for one id, with different response ids)."""
    if rid is None:
        return None
    if isinstance(rid, list):
        raise invalid_request("rid as a list (SGLang's one id per prompt of a batch) is not supported: a request "
                              "gets one response with one id here; send rid as a string", "rid",
                              "unsupported_parameter")
    if request_id is not None:
        raise invalid_request("send one of request_id (vLLM's) and rid (SGLang's), not both", "rid")
    return header_id(rid, "rid")


def header_id(value: str | None, header: str) -> str | None:
    """A client-chosen identifier (``X-Session-Id`` / ``X-Trace-Id`` headers, ``/generate``'s ``session_id`` and
    ``trace_id`` fields): 1-128 visible ASCII characters, or a 400 naming ``header``. The one rule for all of
    them: such ids reach logs, telemetry and the scheduler's per-session counters."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_HEADER_ID_LENGTH or not all(33 <= ord(c) <= 126 for c in value):
        raise invalid_request(f"{header} must be 1 to {MAX_HEADER_ID_LENGTH} visible ASCII characters", header)
    return value



def cache_salt(fields: SamplingFields) -> str | None:
    """vLLM's ``cache_salt``: absent, or a non-empty string (an empty salt is a 400 naming it, as vLLM's)."""
    if fields.cache_salt == "":
        raise invalid_request("cache_salt must be a non-empty string", "cache_salt")
    return fields.cache_salt


def truncation_side(fields: SamplingFields) -> Literal["left", "right"]:
    """vLLM's ``truncation_side``: ``left`` (absent: the default) or ``right``, else a 400 naming it."""
    side = fields.truncation_side
    if side is None or side == "left":
        return "left"
    if side == "right":
        return "right"
    raise invalid_request(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")


def chat_prompt_flags(add_generation_prompt: bool | None, continue_final_message: bool | None,
                      last_role: str | None) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` of a chat prompt (chat and ``/tokenize``, vLLM's
    rules): ``continue_final_message`` leaves the final message open for the model to continue, so that
    message must be the assistant's and no generation prompt may follow it (both sent true: a 400);
    ``add_generation_prompt`` defaults to true unless ``continue_final_message`` is set."""
    continue_final = bool(continue_final_message)
    if continue_final and add_generation_prompt:
        raise invalid_request("continue_final_message and add_generation_prompt cannot both be true: the first "
                              "continues the final message, the second opens a new reply",
                              "continue_final_message")
    if continue_final and last_role != "assistant":
        raise invalid_request(f"continue_final_message needs the last message to be the assistant's, got role "
                              f"{last_role!r}", "continue_final_message")
    return (not continue_final if add_generation_prompt is None else add_generation_prompt), continue_final


def min_characters(body_value: int | None, options: StreamOptions | None, stream: bool | None) -> int:
    """The streamed-text buffer of a request (0: none): ``stream_options.min_characters`` or the top-level
    ``min_characters`` (both sent must agree); a non-negative integer, for streams only."""
    nested = options.min_characters if options is not None else None
    if body_value is not None and nested is not None and body_value != nested:
        raise invalid_request("min_characters and stream_options.min_characters disagree; send one of them",
                              "min_characters")
    value = nested if nested is not None else body_value
    field = "stream_options.min_characters" if nested is not None else "min_characters"
    if value is None:
        return 0
    if value < 0:
        raise invalid_request(f"{field} must be an integer >= 0, got {value}", field)
    if not stream:
        raise invalid_request(f"{field} applies to streamed responses only; send stream: true", field)
    return value


def refuse_obfuscation(include_obfuscation: bool | None, param: str = "stream_options.include_obfuscation") -> None:
    """OpenAI's ``stream_options.include_obfuscation``: this server never pads stream events with an
    ``obfuscation`` field, so ``false`` (or absent) is served and ``true`` is a 400 ``unsupported_parameter``:
    a client asking for the side-channel mitigation is told it is not there, rather than silently not given it."""
    if include_obfuscation:
        raise invalid_request("stream obfuscation is not supported: send include_obfuscation false or leave it out",
                              param, "unsupported_parameter")


SERVICE_TIERS = ("auto", "default")


def refuse_service_tier(service_tier: str | None) -> None:
    """OpenAI's ``service_tier``: this server has one tier, so ``auto`` and ``default`` (or absent) are served and
    any other (``flex``, ``priority``, ``scale``) is a 400 ``unsupported_parameter``: a client paying for a
    latency class is told it is not there, rather than silently not given it."""
    if service_tier is not None and service_tier not in SERVICE_TIERS:
        raise invalid_request(f"service_tier {service_tier[:40]!r} is not offered: this server has one tier "
                              "(send auto or default, or leave it out)", "service_tier", "unsupported_parameter")
