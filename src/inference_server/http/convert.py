"""Wire records to engine records: sampling parameters, and the identifiers read from headers.

Defaults are ``SamplingParams``' own (the OpenAI API's), applied where a field is absent or ``null``.
Values are not checked here: the engine's admission validates them once, and a bad value comes back as a
``RequestError`` naming the engine's field, which ``errors.from_request_error`` maps to the wire name the
client used (chat's ``top_logprobs``, ``max_completion_tokens``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from inference_server.http.constraint_fields import constraint_of
from inference_server.http.errors import invalid_request
from inference_server.http.schemas import LogitBiasInput, SamplingFields, StopInput
from inference_server.records.constraints import Constraint
from inference_server.records.sampling_params import SamplingParams

DEFAULTS = SamplingParams()
DEFAULT_MAX_TOKENS = 16
"""Output cap of a completion that sets none (the OpenAI API's default for ``/v1/completions``)."""
MAX_HEADER_ID_LENGTH = 128
TRACE_ID_HEADER = "X-Trace-Id"
SESSION_ID_HEADER = "X-Session-Id"

T = TypeVar("T")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def stop_strings(stop: StopInput) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def logit_bias_pairs(bias: LogitBiasInput, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; a key that is not a decimal integer is a 400 naming it
    (ids outside the vocabulary are refused by admission, which knows its size)."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        text = key.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()):
            size = f" [0, {vocab_size}) (vocabulary size {vocab_size})" if vocab_size is not None else ""
            raise invalid_request(f"logit_bias key {key!r} is not a token id: keys must be integers{size}",
                                  "logit_bias")
        pairs.append((int(text), value))
    return tuple(sorted(pairs))


def structured_fields(fields: SamplingFields) -> dict[str, Any]:
    """The structured-output fields a wire record carries (``constraint_fields.constraint_of``'s input)."""
    found: dict[str, Any] = {name: getattr(fields, name) for name in (
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")}
    for name in ("json_schema", "regex", "ebnf"):  # SGLang's, on /generate
        found[name] = getattr(fields, name, None)
    response_format = getattr(fields, "response_format", None)
    if response_format is not None:
        found["response_format"] = (response_format.type, response_format.json_schema)
    return found


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
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=bool(fields.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=bool(fields.include_stop_str_in_output),
        logit_bias=logit_bias_pairs(fields.logit_bias, vocab_size),
        allowed_token_ids=tuple(fields.allowed_token_ids) if fields.allowed_token_ids is not None else None,
        min_tokens=_or(fields.min_tokens, DEFAULTS.min_tokens),
    )
    return params


def header_id(value: str | None, header: str) -> str | None:
    """A client-chosen identifier from a header: 1-128 visible ASCII characters, or a 400."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_HEADER_ID_LENGTH or not all(33 <= ord(c) <= 126 for c in value):
        raise invalid_request(f"{header} must be 1 to {MAX_HEADER_ID_LENGTH} visible ASCII characters", header)
    return value

