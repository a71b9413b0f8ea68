"""The grammar of a forced Gemma 4 tool call (``tool_choice`` ``required`` or a named function), in Gemma 4's
own call syntax, so that even a base model writes a call whose arguments validate against the tool's
``parameters``.

Gemma 4 writes ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (see ``tool_parsers``): bare keys, strings
between ``<|"|>`` quotes, numbers / booleans / null as in JSON, arrays ``[a,b]`` and objects ``{k:v}``, no
spaces, keys in sorted order (what the chat template writes for earlier calls). The markers and the quote are
special tokens, referenced by name in the Lark grammar (llguidance resolves them in the served vocabulary).

A tool's ``parameters`` (JSON Schema) becomes Lark rules. Supported keywords: ``type`` (one or a list),
``properties`` / ``required`` (required keys always written, optional ones may be), ``items``, ``minItems``,
``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf``, local ``$ref`` (``#/$defs/...``,
``#/definitions/...``; not recursive), ``pattern``, ``minLength`` / ``maxLength`` on strings; numbers,
integers, booleans and null are embedded JSON (``%json``), so ``minimum`` / ``maximum`` and their exclusive
forms hold too. ``additionalProperties`` is accepted: only the listed properties are written. Annotations
(``description``, ``title``, ``default``, ``examples``, ``format``) are ignored. Any other keyword is a 400
naming the tool: a forced call could not promise to honour it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from inference_server.http.errors import invalid_request
from inference_server.http.tool_parsers import GEMMA4, GEMMA4_QUOTE

ANNOTATIONS = frozenset({"description", "title", "default", "examples", "format", "$schema", "$id", "$comment",
                         "additionalProperties", "$defs", "definitions", "strict", "deprecated", "readOnly"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
SUPPORTED = frozenset({"type", "properties", "required", "items", "minItems", "maxItems", "enum", "const",
                       "anyOf", "oneOf", "$ref", "pattern", "minLength", "maxLength"}) | NUMBER_KEYWORDS | ANNOTATIONS
MAX_REF_DEPTH = 16
QUOTE = GEMMA4_QUOTE
"""Gemma 4's string quote, a special token referenced by name."""
STRING_CHARS = r"(?s:.)"
"""A string's characters: any (the closing quote is a special token, which text cannot hold)."""


class _Rules:
    """Lark rules built for one tool's schema."""

    def __init__(self, tool: str, root: Mapping[str, Any], namespace: str) -> None:
        self.tool = tool
        self.root = root
        self.namespace = namespace
        self.lines: list[str] = []
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.namespace}_{self.count}"

    def refuse(self, reason: str) -> None:
        raise invalid_request(f"tool_choice: the parameters of {self.tool!r} {reason}; a forced Gemma 4 call "
                              "cannot enforce that (send tool_choice auto)", "tool_choice", "unsupported_parameter")

    def value(self, schema: Any, depth: int = 0) -> str:
        """A Lark expression for one value matching ``schema``."""
        if schema is True or schema == {}:
            return "any_value"
        if not isinstance(schema, Mapping):
            self.refuse(f"hold a schema that is not an object ({str(schema)[:40]})")
        unknown = sorted(set(schema) - SUPPORTED)
        if unknown:
            self.refuse(f"use the keyword {unknown[0]!r}")
        if "$ref" in schema:
            return self.value(self._resolve(schema["$ref"], depth), depth + 1)
        if "const" in schema:
            return self._literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(self._literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + " | ".join(self.value(s, depth) for s in schema[key]) + ")"
        types = schema.get("type")
        if types is None:
            return "object_value" if "properties" in schema else "any_value"
        if isinstance(types, list):
            return "(" + " | ".join(self.value({**schema, "type": t}, depth) for t in types) + ")"
        if types == "object":
            return self._object(schema, depth)
        if types == "array":
            return self._array(schema, depth)
        if types == "string":
            return self._string(schema)
        if types in ("integer", "number", "boolean", "null"):
            kept = {k: v for k, v in schema.items() if k in NUMBER_KEYWORDS or k == "type"}
            return f"%json {json.dumps(kept)}"
        self.refuse(f"use the type {types!r}")
        raise AssertionError

    def _resolve(self, ref: Any, depth: int) -> Any:
        if depth > MAX_REF_DEPTH:
            self.refuse("are recursive ($ref)")
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                defs = self.root.get(prefix[2:-1]) or {}
                if ref[len(prefix):] in defs:
                    return defs[ref[len(prefix):]]
        self.refuse(f"use the reference {str(ref)[:60]!r}")
        raise AssertionError

    def _literal(self, value: Any) -> str:
        if isinstance(value, str):
            return f"{QUOTE} {_lark_string(value)} {QUOTE}" if value else f"{QUOTE} {QUOTE}"
        if isinstance(value, (dict, list)):
            self.refuse("use an object or array in enum/const")
        return _lark_string(json.dumps(value))

    def _string(self, schema: Mapping[str, Any]) -> str:
        name = self.fresh("STRING").upper()
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        optional = low == 0 and "pattern" not in schema  # a lexeme cannot be empty: the text is optional instead
        length = f"{STRING_CHARS}{{{max(low, 1) if optional else low},{'' if high is None else int(high)}}}"
        if "pattern" in schema:
            pattern = str(schema["pattern"]).removeprefix("^").removesuffix("$")
            body = f"/{_regex_body(pattern)}/" + (f" & /{length}/" if "minLength" in schema or high is not None
                                                   else "")
        else:
            body = f"/{length}/"
        self.lines.append(f"{name}: {body}")
        return f"{QUOTE} {name}{'?' if optional else ''} {QUOTE}"

    def _object(self, schema: Mapping[str, Any], depth: int) -> str:
        properties = schema.get("properties") or {}
        if not properties:
            return "object_value"
        required = set(schema.get("required") or ())
        members = [(f"{_lark_string(key)} \":\" {self.value(properties[key], depth)}", key in required)
                   for key in sorted(properties)]
        return f"\"{{\" {self._members(members)} \"}}\""

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """Members in order, required ones always, optional ones maybe, with commas only between members
        written (one rule per (position, whether a member came before))."""
        base = self.fresh("members")

        def rule(i: int, after: bool) -> str:
            return f"{base}_{i}_{int(after)}"

        for i in range(len(members) + 1):
            for after in (False, True):
                if i == len(members):
                    self.lines.append(f'{rule(i, after)}: ""')
                    continue
                term, needed = members[i]
                comma = '"," ' if after else ""
                written = f"{comma}{term} {rule(i + 1, True)}"
                self.lines.append(f"{rule(i, after)}: {written}" if needed else
                                  f"{rule(i, after)}: {written} | {rule(i + 1, after)}")
        return rule(0, False)

    def _array(self, schema: Mapping[str, Any], depth: int) -> str:
        item = self.value(schema.get("items", True), depth)
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < low:
            self.refuse("ask for maxItems below minItems")
        name = self.fresh("items")
        more = f'("," {name}_item)'
        if high is None:
            tail = f"{more}*"
        else:
            tail = " ".join([f"{more}?"] * (int(high) - max(low, 1)))
        first = " ".join([f"{name}_item", *[more] * (max(low, 1) - 1), tail]).strip()
        self.lines.append(f"{name}_item: {item}")
        return f'"[" ({first}){"" if low else "?"} "]"'


def _regex_body(pattern: str) -> str:
    return pattern.replace("/", "\\/")


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


GENERIC_RULES = f"""any_value: any_string | object_value | any_array | %json {{"type": ["number", "boolean", "null"]}}
any_array: "[" (any_value ("," any_value)*)? "]"
any_string: {QUOTE} ANY_TEXT? {QUOTE}
ANY_TEXT: /{STRING_CHARS}+/
object_value: "{{" (KEY ":" any_value ("," KEY ":" any_value)*)? "}}"
KEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/
"""


def gemma4_calls_lark(tools: list[dict[str, Any]], *, several: bool) -> str:
    """The Lark grammar of one forced call (``several``: one or more) to any of ``tools`` (chat-shaped
    definitions, ``{"type": "function", "function": {...}}``)."""
    lines = []
    calls = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        rules = _Rules(function["name"], function.get("parameters") or {}, str(index))
        parameters = function.get("parameters") or {"type": "object"}
        arguments = rules.value(parameters)
        if not (arguments.startswith('"{"') or arguments == "object_value"):
            rules.refuse("are not an object schema")
        lines.append(f"call_{index}: {GEMMA4.start} {_lark_string('call:' + function['name'])} {arguments} "
                     f"{GEMMA4.end}")
        lines.extend(rules.lines)
        calls.append(f"call_{index}")
    start = "start: call+" if several else "start: call"
    return "\n".join([start, "call: " + " | ".join(calls), *lines]) + "\n" + GENERIC_RULES
