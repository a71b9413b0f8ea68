"""Output constraints: one record behind every structured-output field of every API.

A request carries at most one ``Constraint`` (``SamplingParams.constraint``). The HTTP layer maps each wire
field onto it (``response_format`` json_schema / json_object, the Responses API's ``text.format``, vLLM's
``structured_outputs`` and ``guided_*``, SGLang's ``json_schema`` / ``regex`` / ``ebnf``, and the tool-call
constraint of ``tool_choice: required`` or a named function); ``core.grammar_compiler`` compiles it once
(llguidance), and the runner masks every sampled token of the request with it.

The record is plain data, hashable (the compile cache's key) and sync. Build it with the constructors
below, never field by field: they put each kind's source into its canonical form (a JSON schema as
compact JSON text), so that equal constraints compare and hash equal.

Tool calls (``tool_calls``): the output is one or more calls, each the literal ``begin`` text, one JSON
value that matches ``schema``, then the literal ``end`` text, separated by ``separator``. With several
``TaggedJson`` alternatives, each call may be any of them (one per tool). Example, Hermes style::

    call = TaggedJson(begin="<tool_call>\\n", schema=json_schema_text({...}), end="\\n</tool_call>")
    constraint = Constraint.tool_calls([call], min_calls=1, max_calls=None, separator="\\n")

Structural tags (``structural_tag``, xgrammar's and vLLM's ``response_format``): free text, in which each
occurrence of a trigger must go on as one of the ``TaggedJson`` structures whose ``begin`` starts with that
trigger (its begin, a JSON value matching its schema, its end), then free text again.

After reasoning (``after_reasoning``): any constraint may let the output start with a reasoning section, the
start marker, free text, the end marker and whitespace, before the constrained part (a thinking model's
``<think>…</think>``). The section is optional: an output that starts with the constrained part is valid too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from inference_server.records.errors import RequestError

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls", "structural_tag"]
GrammarSyntax = Literal["lark", "gbnf"]


def json_schema_text(schema: Mapping[str, Any] | bool | str, field: str = "json_schema") -> str:
    """A JSON schema as canonical text (compact; keys keep their order, which is the order an object's
    properties are generated in): a dict, ``True``/``False`` or JSON text.
    Raises ``RequestError`` naming ``field`` when it is not a JSON object or boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise RequestError("invalid_request", f"{field} is not valid JSON: {error}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError("invalid_request", f"{field} must be a JSON schema object, got "
                           f"{type(schema).__name__}", field)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@attrs.frozen
class TaggedJson:
    """One tool-call shape: literal ``begin`` text, one JSON value matching ``schema`` (canonical text, see
    ``json_schema_text``), literal ``end`` text. ``begin``/``end`` are matched as text (bytes), so a special
    token of the vocabulary cannot be written here: use ``Constraint.grammar`` (Lark ``<[id]>``) for those."""

    begin: str
    schema: str
    end: str


@attrs.frozen
class Constraint:
    """What a request's output must match. ``field`` (the API field it came from, for error messages) is
    not part of equality or the hash: the same constraint from two fields shares one compiled grammar."""

    kind: ConstraintKind
    schema: str | None = None
    """``json_schema``: the schema as canonical JSON text."""
    strict: bool = True
    """``json_schema``: True refuses a schema that uses a keyword the engine cannot enforce (a 400 naming it);
    False ignores such keywords (the rest is still enforced)."""
    pattern: str | None = None
    """``regex``: the whole output matches it."""
    choices: tuple[str, ...] = ()
    """``choice``: the output is exactly one of these strings."""
    grammar: str | None = None
    """``grammar``: the grammar text, in ``syntax``."""
    syntax: GrammarSyntax = "lark"
    """``grammar``: ``lark`` (llguidance's Lark, which may embed ``%json {schema}``) or ``gbnf`` (llama.cpp /
    xgrammar EBNF, ``root ::= ...``; converted to Lark when compiled)."""
    calls: tuple[TaggedJson, ...] = ()
    """``tool_calls``: the alternatives each call may take."""
    min_calls: int = 1
    max_calls: int | None = 1
    """``tool_calls``: how many calls (None: no upper bound)."""
    separator: str = "\n"
    """``tool_calls``: literal text between two calls."""
    triggers: tuple[str, ...] = ()
    """``structural_tag``: the texts that start a structure (``calls`` are the structures)."""
    reasoning: tuple[str, str] | None = None
    """The (start, end) markers of an optional reasoning section before the constrained output, as text;
    special tokens among them are matched as tokens (see ``core.grammar_compiler``). None: no section."""
    field: str = attrs.field(default="response_format", eq=False)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, *, strict: bool = True,
                    field: str = "response_format") -> Constraint:
        return cls("json_schema", schema=json_schema_text(schema, field), strict=strict, field=field)

    @classmethod
    def json_object(cls, *, field: str = "response_format") -> Constraint:
        """Any JSON object (OpenAI's ``json_object``)."""
        return cls("json_object", field=field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "regex") -> Constraint:
        _require_text(pattern, field, "a regular expression")
        return cls("regex", pattern=pattern, field=field)

    @classmethod
    def choice(cls, choices: Iterable[str], *, field: str = "choice") -> Constraint:
        values = tuple(choices)
        if not values or not all(isinstance(c, str) for c in values):
            raise RequestError("invalid_request", f"{field} must be a non-empty list of strings", field)
        return cls("choice", choices=values, field=field)

    @classmethod
    def from_grammar(cls, grammar: str, *, syntax: GrammarSyntax | None = None, field: str = "grammar") -> Constraint:
        """A Lark or GBNF grammar; ``syntax`` None: GBNF when the text has a ``::=`` rule, else Lark."""
        _require_text(grammar, field, "a grammar")
        return cls("grammar", grammar=grammar, syntax=syntax or ("gbnf" if "::=" in grammar else "lark"),
                   field=field)

    @classmethod
    def tool_calls(cls, calls: Iterable[TaggedJson], *, min_calls: int = 1, max_calls: int | None = 1,
                   separator: str = "\n", field: str = "tool_choice") -> Constraint:
        """Between ``min_calls`` and ``max_calls`` calls, each one of ``calls`` (see the module docstring)."""
        alternatives = tuple(calls)
        if not alternatives:
            raise RequestError("invalid_request", f"{field}: no tool to call", field)
        if min_calls < 1 or (max_calls is not None and max_calls < min_calls):
            raise ValueError(f"calls must satisfy 1 <= min_calls <= max_calls, got {min_calls}, {max_calls}")
        return cls("tool_calls", calls=alternatives, min_calls=min_calls, max_calls=max_calls,
                   separator=separator, field=field)


    @classmethod
    def structural_tag(cls, structures: Iterable[TaggedJson], triggers: Iterable[str], *,
                       field: str = "response_format") -> Constraint:
        """Free text with ``structures`` started by ``triggers`` (see the module docstring); every structure's
        ``begin`` starts with a trigger."""
        tags, starts = tuple(structures), tuple(triggers)
        if not tags:
            raise RequestError("invalid_request", f"{field}.structures must not be empty", f"{field}.structures")
        if not starts or not all(isinstance(t, str) and t for t in starts):
            raise RequestError("invalid_request", f"{field}.triggers must be a non-empty list of non-empty strings",
                               f"{field}.triggers")
        for index, tag in enumerate(tags):
            if not any(tag.begin.startswith(t) for t in starts):
                raise RequestError("invalid_request", f"{field}.structures[{index}].begin must start with one of "
                                   "the triggers", f"{field}.structures[{index}].begin")
        return cls("structural_tag", calls=tags, triggers=starts, field=field)

    def after_reasoning(self, start: str, end: str) -> Constraint:
        """This constraint, after an optional reasoning section between ``start`` and ``end`` (see the module
        docstring)."""
        _require_text(start, self.field, "a reasoning start marker")
        _require_text(end, self.field, "a reasoning end marker")
        return attrs.evolve(self, reasoning=(start, end))


def _require_text(value: object, field: str, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise RequestError("invalid_request", f"{field} must be {what} (a non-empty string)", field)
