"""Every structured-output wire field to the one ``Constraint`` (``records/constraints.py``).

Fields, by API (a request sets at most one of them; two are a 400 naming both):

* OpenAI ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (``"text"`` is no constraint), and xgrammar's / vLLM's
  ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``; the
  Responses API's ``text.format``:
  ``{"type": "json_schema", "name", "schema", "strict"}`` or ``{"type": "json_object"}``.
* vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"grammar": ...}``, ``{"json_object": true}`` (exactly one key), and the older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``.
* SGLang's ``json_schema`` (an object or its JSON text), ``regex`` and ``ebnf``, on every route.

A bad value is an ``ApiError`` 400 naming the field (``response_format.json_schema.schema``, ...); a schema,
regex or grammar that does not compile is refused later, before admission, with the compiler's reason.

With a reasoning parser (chat and the Responses API), the constraint starts after the reasoning section
(``after_reasoning``): the output may open with the section (start marker, free text, end marker) and the
constraint applies to what follows; unless the request turned thinking off (``chat_template_kwargs:
{"enable_thinking": false}``, or ``reasoning.effort: "none"``), when the constraint covers the whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from inference_server.http.errors import invalid_request
from inference_server.http.reasoning_parsers import ReasoningFormat
from inference_server.http.schemas import ResponseFormat
from inference_server.records.constraints import Constraint, TaggedJson, json_schema_text
from inference_server.records.errors import RequestError
from inference_server.records.sampling_params import SamplingParams

STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _guard(build: Callable[[], Constraint]) -> Constraint:
    """Run a ``Constraint`` constructor, mapping its ``RequestError`` to the route's 400."""
    try:
        return build()
    except RequestError as error:
        raise invalid_request(error.message, error.param) from None


def from_response_format(fmt: ResponseFormat, field: str = "response_format") -> Constraint | None:
    """``response_format`` (chat, completions): ``text`` is None, ``json_object``, ``json_schema``,
    ``structural_tag``."""
    given = {name for name in ("json_schema", "structures", "triggers", "format") if getattr(fmt, name) is not None}
    allowed = {"json_schema": {"json_schema"}, "structural_tag": {"structures", "triggers"}}.get(fmt.type, set())
    if given - allowed:
        name = sorted(given - allowed)[0]
        if name == "format":
            raise invalid_request(f"{field}.format (xgrammar's newer structural-tag shape) is not supported: send "
                                  "structures and triggers", f"{field}.format", "unsupported_parameter")
        raise invalid_request(f"{field}.{name} is not allowed with type {fmt.type!r}", f"{field}.{name}")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object(field=field)
    if fmt.type == "json_schema":
        if not isinstance(fmt.json_schema, Mapping):
            raise invalid_request(f"{field}.json_schema must be an object with a \"schema\" (type json_schema)",
                                  f"{field}.json_schema")
        return _schema_object(fmt.json_schema, f"{field}.json_schema")
    if fmt.type == "structural_tag":
        return _structural_tag(fmt.structures, fmt.triggers, field)
    raise invalid_request(f"{field}.type must be \"text\", \"json_object\", \"json_schema\" or "
                          f"\"structural_tag\", got {fmt.type!r}", f"{field}.type")


def _structural_tag(structures: Any, triggers: Any, field: str) -> Constraint:
    """xgrammar's / vLLM's structural tag: ``structures`` (``{"begin", "schema", "end"}`` each) and
    ``triggers`` (strings; every ``begin`` starts with one)."""
    if not isinstance(structures, list) or not structures:
        raise invalid_request(f"{field}.structures must be a non-empty list of {{\"begin\", \"schema\", \"end\"}}",
                              f"{field}.structures")
    tags = []
    for index, item in enumerate(structures):
        where = f"{field}.structures[{index}]"
        if not isinstance(item, Mapping) or set(item) - {"begin", "schema", "end"} or "begin" not in item \
                or "end" not in item:
            raise invalid_request(f"{where} must be {{\"begin\", \"schema\", \"end\"}}", where)
        if not isinstance(item["begin"], str) or not isinstance(item["end"], str):
            raise invalid_request(f"{where}.begin and .end must be strings", f"{where}.begin")
        schema = item.get("schema", {"type": "object"})
        tags.append(TaggedJson(begin=item["begin"], schema=_schema_text(schema, f"{where}.schema"), end=item["end"]))
    if not isinstance(triggers, list):
        raise invalid_request(f"{field}.triggers must be a list of strings", f"{field}.triggers")
    return _guard(lambda: Constraint.structural_tag(tags, triggers, field=field))


def _schema_text(schema: Any, field: str) -> str:
    try:
        return json_schema_text(schema, field)
    except RequestError as error:
        raise invalid_request(error.message, error.param) from None


def from_text_format(fmt: Mapping[str, Any], field: str = "text.format") -> Constraint | None:
    """The Responses API's ``text.format`` (its ``json_schema`` fields sit beside ``type``)."""
    fmt_type = fmt.get("type")
    if fmt_type == "json_schema":
        return _schema_object({k: v for k, v in fmt.items() if k != "type"}, field)
    if fmt_type in ("text", "json_object"):
        extra = sorted(set(fmt) - {"type"})
        if extra:
            raise invalid_request(f"{field}.{extra[0]} is only allowed with type \"json_schema\"",
                                  f"{field}.{extra[0]}")
        return None if fmt_type == "text" else Constraint.json_object(field=field)
    raise invalid_request(f"{field}.type must be \"text\", \"json_object\" or \"json_schema\", got {fmt_type!r}",
                          f"{field}.type")


def _schema_object(spec: Mapping[str, Any], field: str) -> Constraint:
    """OpenAI's json_schema object: ``schema`` (required), ``strict`` (default false), ``name``, ``description``."""
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise invalid_request(f"unknown field {field}.{unknown[0]}", f"{field}.{unknown[0]}")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid_request(f"{field}.name must be a string", f"{field}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request(f"{field}.strict must be a boolean", f"{field}.strict")
    if "schema" not in spec:
        raise invalid_request(f"{field}.schema is required", f"{field}.schema")
    schema = spec["schema"]
    return _guard(lambda: Constraint.json_schema(schema, strict=bool(strict), field=f"{field}.schema"))


def from_structured_outputs(value: Mapping[str, Any], field: str = "structured_outputs") -> Constraint:
    """vLLM's ``structured_outputs`` object: exactly one of ``STRUCTURED_OUTPUT_KEYS``."""
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise invalid_request(f"unknown field {field}.{unknown[0]} (supported: {', '.join(STRUCTURED_OUTPUT_KEYS)})",
                              f"{field}.{unknown[0]}")
    given = [k for k in STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid_request(f"{field} must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}", field)
    key = given[0]
    return _one(key, value[key], f"{field}.{key}")


def _one(key: str, value: Any, field: str) -> Constraint:
    if key == "json":
        return _guard(lambda: Constraint.json_schema(value, strict=False, field=field))
    if key == "json_object":
        if value is not True:
            raise invalid_request(f"{field} must be true", field)
        return Constraint.json_object(field=field)
    if key == "regex":
        return _guard(lambda: Constraint.regex(value, field=field))
    if key == "choice":
        if not isinstance(value, list):
            raise invalid_request(f"{field} must be a list of strings", field)
        return _guard(lambda: Constraint.choice(value, field=field))
    return _guard(lambda: Constraint.from_grammar(value, field=field))


def constraint_of(fields: Mapping[str, Any]) -> Constraint | None:
    """The one constraint of a request's structured-output fields (``name -> value``, absent ones None);
    None when none is set. ``response_format`` is given as its record."""
    found: list[tuple[str, Constraint]] = []
    for name, value in fields.items():
        if value is None:
            continue
        if name == "response_format":
            constraint = from_response_format(value)
        elif name == "structured_outputs":
            if not isinstance(value, Mapping):
                raise invalid_request("structured_outputs must be an object", name)
            constraint = from_structured_outputs(value)
        elif name in ("guided_json", "json_schema"):
            constraint = _one("json", value, name)
        elif name in ("guided_regex", "regex"):
            constraint = _one("regex", value, name)
        elif name == "guided_choice":
            constraint = _one("choice", value, name)
        elif name in ("guided_grammar", "ebnf"):
            constraint = _one("grammar", value, name)
        else:
            raise ValueError(f"not a structured-output field: {name}")
        if constraint is not None:
            found.append((name, constraint))
    if len(found) > 1:
        raise invalid_request(f"only one structured-output field may be set, got {found[0][0]} and {found[1][0]}",
                              found[1][0])
    return found[0][1] if found else None


def after_reasoning(params: SamplingParams, reasoning: ReasoningFormat | None,
                    template_kwargs: Mapping[str, Any] | None) -> SamplingParams:
    """``params`` with its constraint after the reasoning section (see the module docstring)."""
    if params.constraint is None or reasoning is None or (template_kwargs or {}).get("enable_thinking") is False:
        return params
    return attrs.evolve(params, constraint=params.constraint.after_reasoning(reasoning.start, reasoning.end))
