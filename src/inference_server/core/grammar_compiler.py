"""Constraints to grammar matchers, on llguidance (the choice and its figures: docs/architecture.md,
"Constrained decoding"): one compile per distinct ``Constraint``, cached.

``GrammarCompiler.compile`` turns a ``records.constraints.Constraint`` into a ``CompiledGrammar`` (an
llguidance matcher in its start state) or raises ``RequestError`` naming the constraint's API field and
llguidance's reason. It is thread-safe and blocking (the HTTP shell calls it in a worker thread before it
submits a request, with a time bound; the runner calls it again when the entry was evicted since, which
cannot fail then). Each request's decoding state is ``CompiledGrammar.matcher()``, a copy of that matcher.

Whitespace (the rule a small base model cannot loop on): JSON is generated without free whitespace, with
``", "`` between items and ``": "`` after keys (what ``json.dumps`` writes), as vLLM's
``disable_any_whitespace``. Whitespace is then possible only inside strings.

The llguidance tokenizer (its token trie over the whole vocabulary, with the mask slices) and the special-token
table are built once, by ``ensure_tokenizer``, before the engine reports ready: as a start-up phase of
``engine_factory`` (in whichever process runs the engine: the server's own, or the engine process of
``ENGINE_PROCESS=separate``), and by ``Engine.run`` for parts built elsewhere. llguidance holds the GIL for the
whole build (2.7 s for the 262k Gemma vocabulary on the 2-core dev machine, idle), so a build at the first
constrained request froze every stream of its process for that long, whatever thread ran it; at start-up nothing
streams yet. A tokenizer llguidance cannot read is tried once: every constraint is then refused with its reason.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import llguidance

from inference_server.records.constraints import Constraint
from inference_server.records.errors import RequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How every JSON value is generated (see the module docstring)."""

CACHE_SIZE = 512
"""Compiled constraints kept (least recently used first out); a compiled JSON schema is tens of kB."""


MAX_REASON = 400
"""Characters of llguidance's reason kept in a 400's message."""

STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
"""A JSON string's plain character (llguidance's ``general_slices`` use the same class)."""

MASK_SLICES = [r"[\x20\x0A\x0D\x09]+",
               *(f"{STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 30)),
               f"{STRING_CHAR}+"]
"""llguidance's token-mask slices: the vocabulary's tokens grouped by the regexes they match, and a group all of
whose tokens the lexer accepts is allowed whole instead of walking its token trie. llguidance's defaults
(``general_slices``: string characters up to 10, up to 30, any) leave every state of a string with fewer than 10
characters left (``maxLength``) to the full walk; the finer ladder covers them (their CPU cost: docs/architecture.md,
"Constrained decoding"). The masks are the same: a mask does not depend on its slices (``test_grammar_compiler``)."""


class CompiledGrammar:
    """One compiled constraint: ``matcher()`` gives a fresh decoding state (a copy of the start state)."""

    def __init__(self, constraint: Constraint, start: llguidance.LLMatcher) -> None:
        self.constraint = constraint
        self._start = start

    def matcher(self) -> llguidance.LLMatcher:
        return self._start.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer (its ``tokenizer.json`` text, or a function that gives it, called
    once, by ``ensure_tokenizer`` or the first compile); the model's logits have ``vocab_size`` columns (the
    bitmask's width); ``eos_token_ids`` end a complete output. ``special_tokens``, when given, returns the
    vocabulary's special tokens (text -> id) instead of their being read from the JSON text (parsing 12 MB of
    JSON holds the GIL for 0.5-0.9 s, where ``tokenizers`` has the table at hand). ``build_tokenizer``, when given,
    builds llguidance's tokenizer with the slices it is given (``models.grammar_tokenizer``: from a token table
    cached by an earlier start) instead of llguidance reading the JSON text."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, eos_token_ids: Collection[int], *,
                 special_tokens: Callable[[], Mapping[str, int]] | None = None,
                 build_tokenizer: Callable[[list[str]], llguidance.LLTokenizer] | None = None,
                 cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json_source = tokenizer_json
        self._tokenizer_json_text: str | None = tokenizer_json if isinstance(tokenizer_json, str) else None
        self._special_tokens_source = special_tokens
        self._build_tokenizer = build_tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._special_tokens: dict[str, int] | None = None
        self._cache: collections.OrderedDict[Constraint, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self._eos)

    @property
    def _tokenizer_json(self) -> str:
        if self._tokenizer_json_text is None:
            source = self._tokenizer_json_source
            self._tokenizer_json_text = source if isinstance(source, str) else source()
        return self._tokenizer_json_text

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built at the first use unless ``ensure_tokenizer`` ran: seconds for a 262k
        vocabulary, under the GIL). A tokenizer that llguidance cannot read (a decoder it does not know) refuses
        every constraint with a 400, from the one failed attempt (each would parse the whole vocabulary again)."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = (self._build_tokenizer(MASK_SLICES) if self._build_tokenizer is not None else
                                       llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                              eos_token=self._eos, slices=MASK_SLICES))
                except Exception as error:  # llguidance raises ValueError for what it cannot read
                    self._tokenizer_error = _reason(str(error))
            if self._tokenizer is None:
                raise RequestError("invalid_request", "structured outputs are not available for this model's "
                                   f"tokenizer: {self._tokenizer_error}")
            return self._tokenizer

    @property
    def tokenizer_built(self) -> bool:
        """Whether llguidance's tokenizer exists (``ensure_tokenizer`` then returns at once)."""
        return self._tokenizer is not None

    @property
    def ready(self) -> bool:
        """Whether ``ensure_tokenizer`` has nothing left to do: the tokenizer and the special-token table exist,
        or llguidance refused the tokenizer (no compile builds anything more)."""
        return self._tokenizer_error is not None or (self._tokenizer is not None and self._special_tokens is not None)

    def ensure_tokenizer(self) -> None:
        """Build llguidance's tokenizer and the special-token table now if they are not built yet (blocking,
        seconds under the GIL, once per compiler: the engine runs it before it reports ready, see the module
        docstring). A tokenizer llguidance cannot read is left for ``compile`` to refuse with the constraint's
        field."""
        with contextlib.suppress(RequestError):
            self.tokenizer  # noqa: B018 (the property builds it)
            self.special_tokens  # noqa: B018 (the property reads it)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The vocabulary's special tokens (``tokenizer.json``'s ``added_tokens`` marked special), text -> id."""
        if self._special_tokens is None:
            if self._special_tokens_source is not None:
                self._special_tokens = dict(self._special_tokens_source())
            else:
                added = json.loads(self._tokenizer_json).get("added_tokens") or []
                self._special_tokens = {t["content"]: t["id"] for t in added if t.get("special")}
        return self._special_tokens

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint in self._cache

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled constraint, from the cache or compiled now; ``RequestError`` when it is invalid."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        compiled = CompiledGrammar(constraint, self._matcher(constraint))
        with self._lock:
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = grammar_source(constraint)
        try:
            tokenizer = self.tokenizer
        except RequestError as error:
            raise RequestError("invalid_request", f"{constraint.field}: {error.message}", constraint.field) from None
        if constraint.reasoning is not None:
            grammar = after_reasoning_source(grammar, constraint.reasoning, self.special_tokens)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError("invalid_request", f"{constraint.field}: {_reason(matcher.get_error())}",
                               constraint.field)
        return matcher


def grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint (no tokenizer needed); ``RequestError`` when the source
    cannot even be read (bad JSON, a GBNF grammar that does not convert)."""
    kind, field = constraint.kind, constraint.field
    try:
        if kind == "json_schema":
            assert constraint.schema is not None
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.schema, defaults=JSON_OPTIONS, overrides={"lenient": not constraint.strict})
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            assert constraint.pattern is not None
            return llguidance.LLMatcher.grammar_from_regex(constraint.pattern)
        if kind == "choice":
            alternatives = " | ".join(_literal(c) for c in constraint.choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        if kind == "grammar":
            assert constraint.grammar is not None
            text = constraint.grammar
            if constraint.syntax == "gbnf":
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            return llguidance.LLMatcher.grammar_from_lark(text)
        if kind == "structural_tag":
            return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(constraint))
        return llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(constraint))
    except RequestError:
        raise
    except Exception as error:  # llguidance raises ValueError/RuntimeError/its own for unreadable sources
        raise RequestError("invalid_request", f"{field}: {_reason(str(error))}", field) from None


def tool_calls_lark(constraint: Constraint) -> str:
    """The Lark grammar of a ``tool_calls`` constraint: ``min_calls..max_calls`` calls joined by the
    separator, each one of the ``TaggedJson`` alternatives (begin text, ``%json`` value, end text)."""
    lines = [f"call_{i}: {_literal(c.begin)} %json {_json_arg(c.schema)} {_literal(c.end)}" if c.end else
             f"call_{i}: {_literal(c.begin)} %json {_json_arg(c.schema)}" for i, c in enumerate(constraint.calls)]
    lines.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(constraint.calls))))
    sep = f"{_literal(constraint.separator)} " if constraint.separator else ""
    more = f"({sep}call)"
    low, high = constraint.min_calls, constraint.max_calls
    repeats = " ".join([more] * (low - 1))
    if high is None:
        tail = f"{more}*"
    else:
        tail = " ".join([f"{more}?"] * (high - low))
    body = " ".join(part for part in ("call", repeats, tail) if part)
    return "\n".join([f"start: {body}", *lines]) + "\n"


def structural_tag_lark(constraint: Constraint) -> str:
    """The Lark grammar of a ``structural_tag`` constraint: segments of free text ending in a trigger, each
    followed by the rest of one of that trigger's structures, then optional free text without a trigger.

    A segment is one lexeme: text that holds a trigger only at its end (llguidance's ``&`` and ``~``), so
    the free text ends exactly where a trigger completes, and the structure is enforced from there."""
    alternatives = "|".join(_regex_literal(t) for t in constraint.triggers)
    lines = ["start: segment* FINAL?", "segment: " + " | ".join(f"SEG_{i} tail_{i}"
                                                              for i in range(len(constraint.triggers)))]
    for i, trigger in enumerate(constraint.triggers):
        tails = []
        for tag in constraint.calls:
            if not tag.begin.startswith(trigger):
                continue
            rest = tag.begin[len(trigger):]
            parts = [_literal(rest)] if rest else []
            parts.append(f"%json {_json_arg(tag.schema)}")
            if tag.end:
                parts.append(_literal(tag.end))
            tails.append(" ".join(parts))
        lines.append(f"SEG_{i}: /(?s:.*){_regex_literal(trigger)}/ & ~/(?s:.*({alternatives}).+)/")
        lines.append(f"tail_{i}: " + (" | ".join(tails) if tails else '""'))
    lines.append(f"FINAL: /(?s:.+)/ & ~/(?s:.*({alternatives}).*)/")
    return "\n".join(lines) + "\n"


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


REASONING_WHITESPACE = r"[ \t\r\n]"
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def after_reasoning_source(inner: str, markers: tuple[str, str], special_tokens: dict[str, int]) -> str:
    """``inner`` (llguidance's grammar text of a constraint) after an optional reasoning section: the start
    marker, free text, the end marker, whitespace (``Constraint.after_reasoning``).

    A marker's special tokens (``special_tokens``, e.g. Gemma 4's ``<|channel>``) are matched as those tokens
    (``<[id]>``), its other text as text. When the end marker is one special token the free text is any text
    (a special token cannot occur in it); when it is text, the free text and the end marker are one lexeme:
    text that holds the end marker once, at its end (llguidance's ``&`` and ``~``), then whitespace, so the
    section ends at the first end marker. The constrained part is ``inner`` as a nested grammar."""
    start, end = markers
    start_terms = " ".join(_marker_terms(start, special_tokens))
    if end in special_tokens:
        section = f"{start_terms} THOUGHT? <[{special_tokens[end]}]> WS?"
        tokens = f"THOUGHT: /(?s:.+)/\nWS: /{REASONING_WHITESPACE}+/\n"
    else:
        marker = _regex_literal(end)
        section = f"{start_terms} THOUGHT_END"
        tokens = (f"THOUGHT_END: /(?s:.*){marker}{REASONING_WHITESPACE}*/ & "
                  f"~/(?s:.*{marker}.*{marker}.*)/\n")
    constrained = {**_first_grammar(inner), "name": "constrained"}
    lark = f"start: reasoning? @constrained\nreasoning: {section}\n{tokens}"
    return json.dumps({"grammars": [{"name": "after_reasoning", "lark_grammar": lark}, constrained]})


def _first_grammar(source: str) -> dict[str, object]:
    """The grammar of llguidance's grammar text: a JSON ``{"grammars": [...]}`` (schemas, regexes) or Lark."""
    try:
        value = json.loads(source)
    except ValueError:
        return {"lark_grammar": source}
    return dict(value["grammars"][0]) if isinstance(value, dict) and value.get("grammars") else \
        {"lark_grammar": source}


def _marker_terms(text: str, special_tokens: dict[str, int]) -> list[str]:
    """Lark terms matching ``text``: its special tokens (longest first at each place) as ``<[id]>``, the
    text between them as string literals."""
    terms: list[str] = []
    plain = ""
    i = 0
    while i < len(text):
        match = max((t for t in special_tokens if t and text.startswith(t, i)), key=len, default=None)
        if match is None:
            plain += text[i]
            i += 1
            continue
        if plain:
            terms.append(_literal(plain))
            plain = ""
        terms.append(f"<[{special_tokens[match]}]>")
        i += len(match)
    if plain:
        terms.append(_literal(plain))
    return terms


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def _json_arg(schema: str) -> str:
    """``%json``'s argument: the schema with the JSON options of every other JSON value."""
    value = json.loads(schema)
    if isinstance(value, dict):
        value = {**value, "x-guidance": {**JSON_OPTIONS, **value.get("x-guidance", {})}}
    return json.dumps(value, ensure_ascii=False)


def _reason(message: str) -> str:
    """llguidance's message without its parser-state dump, on one line, at most ``MAX_REASON`` characters."""
    text = " ".join(message.split("<state>")[0].split())
    return (text[:MAX_REASON - 3] + "...") if len(text) > MAX_REASON else (text or "invalid")
