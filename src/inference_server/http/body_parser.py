"""Request bodies parsed into wire records (``schemas``, ``responses_schema``): strict JSON, then the one strict
converter.

Strictness, where plain ``json`` + cattrs would be lenient (every failure is an ``ApiError`` 400 whose
``param`` names the field, e.g. ``stream_options.include_usage`` or ``messages[0].content``):

* JSON: ``NaN``/``Infinity`` and numbers that overflow a float (``1e400``) are rejected; so are invalid
  UTF-8, integers of more than 4300 digits and nesting deep enough to exhaust recursion.
* Unicode: a string anywhere in the body (a value or a key, at any depth) holding an unpaired surrogate
  escape such as ``"\ud800"`` is a 400 ``invalid_unicode`` naming it, before anything else sees the body:
  such a string cannot be encoded (the tokenizer, the logs and the response writer would all raise).
* Types: no coercion. ``"stream": "yes"``, ``"max_tokens": 3.7`` and ``"prompt": 5`` are errors; a float
  field accepts an integer (``"temperature": 1``); a list field needs a JSON array (a string is not a list),
  an object field a JSON object (``expected an object, got "x"``); integers must fit in 64 bits.
* Unknown fields are errors naming the field. A few fields we know but do not support (``functions``, ...)
  get a message saying so; sent empty or null (or asking for what is served anyway: ``modalities: ["text"]``)
  they are ignored.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_mapping_structure_fn

from inference_server.http.errors import ApiError, invalid_request
from inference_server.http.schemas import (
    ContentInput,
    ContentPart,
    LogitBiasInput,
    PromptInput,
    StopInput,
)

Record = TypeVar("Record")

UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "the legacy functions field is not supported: send tools",
    "function_call": "the legacy function_call field is not supported: send tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    # vLLM's sampling extension this engine does not implement (docs/api.md says why):
    "use_beam_search": "beam search is not supported: sample n choices instead (n, with a seed to repeat them)",
}
"""Fields we recognise but cannot honour: an error that says so, unless sent empty (then ignored)."""
_EMPTY_VALUES: tuple[Any, ...] = (None, [], {}, "none", 0, False)
SERVED_VALUES: dict[str, tuple[Any, ...]] = {"modalities": (["text"],)}
"""Values of those fields that ask for what the server does anyway (``modalities: ["text"]``, OpenAI's
default): ignored like empty ones, where refusing them would refuse a request for exactly what is served."""


# -- the converter ----------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _strict(predicate: Callable[[Any], bool], expected: str) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if not predicate(value):
            raise TypeError(f"expected {expected}, got {_describe(value)}")
        return value

    return structure


INT_RANGE = (-(2**63), 2**64)
"""Integers must fit in 64 bits (seeds use the unsigned range): larger ones could only overflow later."""


def _is_int(value: Any) -> bool:
    return type(value) is int and INT_RANGE[0] <= value < INT_RANGE[1]


def _all_ints(values: list[Any]) -> bool:
    """``all(_is_int(v) for v in values)``, in C (types, min, max): a prompt of token ids is checked without
    a Python step per id."""
    return not values or (set(map(type, values)) <= {int} and INT_RANGE[0] <= min(values)
                          and max(values) < INT_RANGE[1])


def _structure_float(value: Any, _: Any) -> float:
    if not (type(value) is float or _is_int(value)) or not math.isfinite(value):
        raise TypeError(f"expected a number, got {_describe(value)}")
    return float(value)


def _structure_prompt(value: Any, _: Any) -> PromptInput:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value) or _all_ints(value):
            return value
        if all(isinstance(x, list) and _all_ints(x) for x in value):
            return value
    raise TypeError("expected a string, a non-empty list of strings, a list of token ids or a list of token-id "
                    f"lists, got {_describe(value)}")


def _structure_stop(value: Any, _: Any) -> StopInput:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return value
    raise TypeError(f"expected a string or a list of strings, got {_describe(value)}")


def _structure_logit_bias(value: Any, _: Any) -> LogitBiasInput:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected an object mapping token ids to numbers, got {_describe(value)}")
    problems = []
    for key, bias in value.items():
        try:
            _structure_float(bias, float)
        except TypeError as error:
            problems.append(f"the bias of token {key!r}: {error}")
    if problems:  # every bad entry, not only the first
        raise TypeError("; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))
    return {key: float(bias) for key, bias in value.items()}


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict(_is_int, "a 64-bit integer"))
    converter.register_structure_hook(bool, _strict(lambda v: type(v) is bool, "true or false"))
    converter.register_structure_hook(str, _strict(lambda v: type(v) is str, "a string"))
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(Any, lambda value, _: value)
    converter.register_structure_hook(PromptInput, _structure_prompt)
    converter.register_structure_hook(StopInput, _structure_stop)
    converter.register_structure_hook(LogitBiasInput, _structure_logit_bias)

    def structure_content(value: Any, _: Any) -> ContentInput:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            return converter.structure(value, list[ContentPart])
        raise TypeError(f"expected a string or a list of content parts, got {_describe(value)}")

    converter.register_structure_hook(ContentInput, structure_content)

    def list_factory(list_type: Any) -> Callable[[Any, Any], Any]:
        item_type = list_type.__args__[0]
        structure_item = converter.get_structure_hook(item_type)

        def structure_list(value: Any, _: Any) -> list[Any]:
            if not isinstance(value, list):
                raise TypeError(f"expected an array, got {_describe(value)}")
            errors, items = [], []
            for index, item in enumerate(value):
                try:
                    items.append(structure_item(item, item_type))
                except Exception as error:
                    error.__notes__ = [*getattr(error, "__notes__", []),
                                       cattrs.errors.IterableValidationNote(f"index {index}", index, item_type)]
                    errors.append(error)
            if errors:
                raise IterableValidationError(f"while structuring {list_type!r}", errors, list_type)
            return items

        return structure_list

    converter.register_structure_hook_factory(
        lambda t: getattr(t, "__origin__", None) is list and len(getattr(t, "__args__", ())) == 1, list_factory)

    def record_factory(record_type: type) -> Callable[[Any, Any], Any]:
        structure_fields: Callable[..., Any] = make_dict_structure_fn(
            record_type, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True)

        def structure_record(value: Any, _: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected an object, got {_describe(value)}")
            return structure_fields(value, record_type)

        return structure_record

    converter.register_structure_hook_factory(attrs.has, record_factory)

    def dict_factory(dict_type: Any) -> Callable[[Any, Any], Any]:
        structure_entries = make_mapping_structure_fn(dict_type, converter)

        def structure_dict(value: Any, _: Any) -> Any:
            if not isinstance(value, dict):  # cattrs alone: "'str' object has no attribute 'items'"
                raise TypeError(f"expected an object, got {_describe(value)}")
            return structure_entries(value, dict_type)

        return structure_dict

    converter.register_structure_hook_factory(lambda t: getattr(t, "__origin__", None) is dict, dict_factory)
    return converter


CONVERTER = _make_converter()
"""The one converter for wire records (strict: see the module docstring)."""


# -- parsing a body ---------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def load_json(raw: bytes) -> Any:
    """Strict ``json.loads`` (see the module docstring); raises ``ApiError`` 400 ``invalid_json``, or
    ``invalid_unicode`` for a string with an unpaired surrogate."""
    if not raw.strip():
        raise invalid_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise invalid_request("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, huge integers
        raise invalid_request(f"the request body is not valid JSON: {error}", code="invalid_json") from None
    check_unicode(value)
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate code point. ``json`` joins a valid ``\\uD83D\\uDE00`` pair into one code point, so
any surrogate left in a decoded string is an unpaired one."""


def _escaped(text: str) -> str:
    """``text`` with non-ASCII characters as JSON escapes (a lone surrogate cannot be written as UTF-8)."""
    return json.dumps(text)[1:-1]


_SCALAR_TYPES = frozenset({int, float, bool, type(None)})
"""What ``json`` decodes besides strings, dicts and lists."""


def check_unicode(value: Any) -> None:
    """Raise ``ApiError`` 400 ``invalid_unicode`` naming the first string (value or key, in document order)
    of decoded JSON that holds an unpaired surrogate. Iterative: any nesting ``json`` accepted is fine."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise invalid_request(f"{path or 'the body'} is not valid Unicode: the string "
                                      f"\"{_escaped(item)[:40]}\" holds an unpaired surrogate", path or None,
                                      code="invalid_unicode")
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                key_path = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    key_path = f"{path}.{_escaped(key)}" if path else _escaped(key)
                    raise invalid_request(f"the key \"{_escaped(key)[:40]}\" is not valid Unicode: it holds an "
                                          "unpaired surrogate", key_path, code="invalid_unicode")
                children.append((key_path, child))
            stack.extend(reversed(children))
        elif isinstance(item, list) and not _SCALAR_TYPES.issuperset(map(type, item)):
            # Only strings and containers can hold a surrogate: a long list of token ids is skipped in C.
            stack.extend(reversed([(f"{path}[{index}]", child) for index, child in enumerate(item)
                                   if isinstance(child, (str, dict, list))]))


def _first_leaf(error: BaseException, path: str) -> tuple[str, BaseException]:
    """The first failure inside a cattrs validation error and its path (``$.a.b[0]``)."""
    if isinstance(error, (ClassValidationError, IterableValidationError)):
        with_notes, without = error.group_exceptions()
        for inner, note in with_notes:
            step = f"[{note.index!r}]" if isinstance(note, IterableValidationNote) else f".{note.name}"
            return _first_leaf(inner, path + step)
        for inner in without:
            return _first_leaf(inner, path)
    return path, error


def _api_error(error: BaseException) -> ApiError:
    path, leaf = _first_leaf(error, "$")
    param = path.removeprefix("$").removeprefix(".") or None
    if isinstance(leaf, ForbiddenExtraKeysError):
        names = sorted(leaf.extra_fields)
        field = f"{param}.{names[0]}" if param else names[0]
        return invalid_request(f"unknown field {', '.join(repr(n) for n in names)}"
                               + (f" in {param!r}" if param else ""), field, code="unknown_field")
    if isinstance(leaf, KeyError):
        return invalid_request(f"{param!r} is required", param, code="missing_field")
    return invalid_request(f"invalid value for {param!r}: {leaf}" if param else str(leaf), param)


def _is_one_of(value: Any, candidates: tuple[Any, ...]) -> bool:
    """``value in candidates`` of the same type (``0`` is not ``False``, ``1.0`` not ``1``)."""
    return any(value == candidate and type(value) is type(candidate) for candidate in candidates)


def check_unsupported(name: str, value: Any, param: str) -> None:
    """Raise the 400 ``unsupported_parameter`` for ``UNSUPPORTED_FIELDS[name]`` (at ``param``) unless
    ``value`` is empty (one of the values that mean "not used") or one of ``SERVED_VALUES[name]``."""
    if not _is_one_of(value, _EMPTY_VALUES) and not _is_one_of(value, SERVED_VALUES.get(name, ())):
        raise invalid_request(UNSUPPORTED_FIELDS[name], param, code="unsupported_parameter")


def _reject_unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """Drop recognised-but-unsupported fields sent empty; raise for the others."""
    for name in [key for key in body if key in UNSUPPORTED_FIELDS]:
        check_unsupported(name, body[name], name)
        body = {key: value for key, value in body.items() if key != name}
    return body


def structure(body: Any, record_type: type[Record]) -> Record:
    """Build a wire record from decoded JSON; raises ``ApiError`` 400 naming the offending field."""
    if not isinstance(body, dict):
        raise invalid_request(f"the request body must be a JSON object, got {_describe(body)}", code="invalid_json")
    try:
        return CONVERTER.structure(_reject_unsupported(body), record_type)
    except ApiError:
        raise
    except (ClassValidationError, IterableValidationError, TypeError, ValueError, KeyError) as error:
        raise _api_error(error) from None


def parse_body(raw: bytes, record_type: type[Record]) -> Record:
    """``load_json`` then ``structure``."""
    return structure(load_json(raw), record_type)
