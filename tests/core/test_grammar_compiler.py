"""The Constraint record and its compiler: canonical equality (the cache key), errors that name the API field
and give llguidance's reason, the bounded LRU cache, the tool-call grammar, and the whitespace rule.

The compiler reads a byte-level vocabulary of 512 ids (ids 3..258 are single bytes), so every check below
feeds text byte by byte as decoding would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from inference_server.core.grammar_compiler import MASK_SLICES, GrammarCompiler, tool_calls_lark
from inference_server.records.constraints import Constraint, TaggedJson, json_schema_text
from inference_server.records.errors import RequestError
from inference_server.records.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

EOS = 1
TOKENIZER_JSON = byte_level_tokenizer_json(512)
TOKENIZER = Tokenizer.from_str(TOKENIZER_JSON)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER_JSON, 512, {EOS})


def accepts(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    """Whether ``text`` is a complete output of ``constraint`` (every token accepted, then EOS allowed)."""
    matcher = compiler.compile(constraint).matcher()
    return matcher.consume_tokens(TOKENIZER.encode(text).ids) and matcher.is_accepting()


def test_equal_constraints_are_equal_whatever_field_they_came_from() -> None:
    a = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, field="guided_json")
    b = Constraint.json_schema('{"type": "object",  "properties": {"a": {"type": "integer"}}}', field="x.schema")
    assert a == b and hash(a) == hash(b) and a.field != b.field
    reordered = Constraint.json_schema({"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert reordered != a  # key order is generation order: a different constraint
    assert Constraint.json_schema(True).schema == "true"


@pytest.mark.parametrize(("build", "field"), [
    (lambda: Constraint.json_schema("{bad", field="guided_json"), "guided_json"),
    (lambda: Constraint.json_schema([1], field="s"), "s"),
    (lambda: Constraint.regex("", field="regex"), "regex"),
    (lambda: Constraint.choice([], field="guided_choice"), "guided_choice"),
    (lambda: Constraint.choice(["a", 1], field="guided_choice"), "guided_choice"),  # type: ignore[list-item]
    (lambda: Constraint.from_grammar("", field="ebnf"), "ebnf"),
    (lambda: Constraint.tool_calls([], field="tool_choice"), "tool_choice"),
])
def test_malformed_sources_are_request_errors_naming_the_field(build, field: str) -> None:
    with pytest.raises(RequestError) as error:
        build()
    assert error.value.param == field and error.value.code == "invalid_request"


@pytest.mark.parametrize(("constraint", "reason"), [
    (Constraint.json_schema({"type": "nonsense"}, field="response_format.json_schema.schema"), "nonsense"),
    (Constraint.json_schema({"$ref": "#/$defs/missing"}), "missing"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}, strict=True), "uniqueItems"),
    (Constraint.regex("a(b", field="structured_outputs.regex"), "unclosed group"),
    (Constraint.from_grammar("root ::= (", field="ebnf"), "Expected"),
    (Constraint.from_grammar("start: nowhere", field="guided_grammar"), "nowhere"),
])
def test_invalid_constraints_name_the_field_and_the_reason(compiler: GrammarCompiler, constraint: Constraint,
                                                           reason: str) -> None:
    with pytest.raises(RequestError) as error:
        compiler.compile(constraint)
    assert error.value.param == constraint.field
    assert error.value.message.startswith(f"{constraint.field}: ") and reason in error.value.message
    assert "<state>" not in error.value.message and len(error.value.message) < 500


def test_a_non_strict_schema_drops_what_cannot_be_enforced(compiler: GrammarCompiler) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}
    lenient = Constraint.json_schema(schema, strict=False)
    assert accepts(compiler, lenient, "[1, 1]") and not accepts(compiler, lenient, "[1, 2, 3]")


@pytest.mark.parametrize(("constraint", "good", "bad"), [
    (Constraint.json_object(), '{"a": [1, {"b": null}]}', "[1]"),
    (Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                             "required": ["n"], "additionalProperties": False}), '{"n": 7}', '{"n": 17}'),
    (Constraint.regex(r"[0-9]{3}-[a-z]+"), "123-ab", "12-ab"),
    (Constraint.choice(["yes", "no", "maybe so"]), "maybe so", "maybe"),
    (Constraint.from_grammar('root ::= "a" [0-9]+ "z"'), "a12z", "az"),
    (Constraint.from_grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x42", "x"),
])
def test_each_kind_accepts_its_language_only(compiler: GrammarCompiler, constraint: Constraint, good: str,
                                            bad: str) -> None:
    assert accepts(compiler, constraint, good)
    assert not accepts(compiler, constraint, bad)


def test_json_has_no_free_whitespace(compiler: GrammarCompiler) -> None:
    """The whitespace rule: ", " and ": " exactly (json.dumps' layout), no newline or indentation anywhere
    outside strings, so a model cannot spend its tokens on whitespace."""
    constraint = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "array"}}})
    assert accepts(compiler, constraint, json.dumps({"a": [1, 2]}))
    for spaced in ('{"a":[1,2]}', '{ "a": [1, 2]}', '{"a": [1, 2] }', '{\n"a": [1, 2]}', '{"a":  [1, 2]}'):
        assert not accepts(compiler, constraint, spaced), spaced


def test_a_complete_grammar_allows_only_eos(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(Constraint.choice(["yes"])).matcher()
    assert matcher.consume_tokens(TOKENIZER.encode("yes").ids)
    words = memoryview(matcher.compute_bitmask()).cast("I")
    allowed = [i for i in range(512) if words[i // 32] >> (i % 32) & 1]
    assert allowed == [EOS] and matcher.is_stopped()


def test_the_cache_returns_the_same_compiled_grammar_and_stays_bounded() -> None:
    compiler = GrammarCompiler(TOKENIZER_JSON, 512, {EOS}, cache_size=2)
    first = compiler.compile(Constraint.regex("a+", field="regex"))
    assert compiler.compile(Constraint.regex("a+", field="guided_regex")) is first  # the field is not the key
    compiler.compile(Constraint.regex("b+"))
    compiler.compile(Constraint.regex("a+"))  # used again: now the most recent
    compiler.compile(Constraint.regex("c+"))  # evicts b+, the least recently used
    assert compiler.cached(Constraint.regex("a+")) and compiler.cached(Constraint.regex("c+"))
    assert not compiler.cached(Constraint.regex("b+"))
    # each request's matcher is its own copy of the start state
    one, two = first.matcher(), first.matcher()
    assert one.consume_tokens(TOKENIZER.encode("aaa").ids) and one.is_accepting()
    assert not two.is_accepting()  # still at the start: "a+" needs an "a"


def test_an_unreadable_tokenizer_refuses_constraints_with_a_400() -> None:
    words = json.loads(TOKENIZER_JSON)
    words["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    compiler = GrammarCompiler(json.dumps(words), 512, {EOS})
    with pytest.raises(RequestError) as error:
        compiler.compile(Constraint.json_object(field="response_format"))
    assert error.value.param == "response_format" and "tokenizer" in error.value.message


HERMES_CALL = TaggedJson(begin="<tool_call>\n", end="\n</tool_call>", schema=json_schema_text({
    "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}))
OTHER_CALL = TaggedJson(begin="CALL ", end="", schema=json_schema_text({"type": "array", "maxItems": 1}))
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(("low", "high", "calls", "ok"), [
    (1, 1, 1, True), (1, 1, 2, False), (1, 1, 0, False),
    (1, None, 3, True), (2, 3, 1, False), (2, 3, 3, True), (2, 3, 4, False),
])
def test_tool_calls_take_between_min_and_max_calls(compiler: GrammarCompiler, low: int, high: int | None,
                                                   calls: int, ok: bool) -> None:
    constraint = Constraint.tool_calls([HERMES_CALL], min_calls=low, max_calls=high)
    assert accepts(compiler, constraint, "\n".join([CALL_TEXT] * calls)) is ok


def test_tool_calls_choose_among_alternatives_and_validate_arguments(compiler: GrammarCompiler) -> None:
    constraint = Constraint.tool_calls([HERMES_CALL, OTHER_CALL], max_calls=2, separator=";")
    assert accepts(compiler, constraint, CALL_TEXT + ";CALL [7]")
    assert accepts(compiler, constraint, "CALL []")
    assert not accepts(compiler, constraint, CALL_TEXT.replace("get_weather", "get_time"))
    assert not accepts(compiler, constraint, CALL_TEXT.replace('"city"', '"town"'))
    assert not accepts(compiler, constraint, "CALL [1, 2]")
    assert "%json" in tool_calls_lark(constraint)


def test_min_tokens_cannot_be_combined_with_a_constraint() -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(min_tokens=2, constraint=Constraint.json_object()).validate()
    assert error.value.param == "min_tokens"
    assert SamplingParams(constraint=Constraint.json_object()).needs_token_history


# -- structural tags (xgrammar's / vLLM's response_format) ----------------------------------------------------

WEATHER_TAG = TaggedJson(begin="<function=get_weather>", end="</function>", schema=json_schema_text(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
TIME_TAG = TaggedJson(begin="<function=get_time>", end="</function>", schema=json_schema_text(
    {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}))


@pytest.mark.parametrize(("text", "valid"), [
    ("no call at all", True),
    ("", True),
    ('Sure: <function=get_weather>{"city": "Paris"}</function> and then', True),
    ('<function=get_time>{"zone": "CET"}</function><function=get_weather>{"city": "Rome"}</function>', True),
    ("a < b, and <functio", True),  # a trigger's prefix is text
    ('<function=get_time>{"zone": "PST"}</function>', False),  # the schema holds after the trigger
    ('<function=other>{"zone": "UTC"}</function>', False),  # a trigger must go on as one of its structures
    ('<function=get_weather>{"city": "Paris"} trailing', False),  # the end text is required
])
def test_structural_tag_free_text_with_enforced_structures(compiler: GrammarCompiler, text: str, valid: bool) -> None:
    constraint = Constraint.structural_tag([WEATHER_TAG, TIME_TAG], ["<function="])
    assert accepts(compiler, constraint, text) == valid


def test_structural_tag_record_checks_its_triggers() -> None:
    with pytest.raises(RequestError) as error:
        Constraint.structural_tag([WEATHER_TAG], ["<tool>"])
    assert error.value.param == "response_format.structures[0].begin"
    with pytest.raises(RequestError):
        Constraint.structural_tag([WEATHER_TAG], [])


def varied_tokenizer_json(vocab_size: int = 512) -> str:
    """``byte_level_tokenizer_json``'s layout with fillers of 2 to 31 characters, some holding a quote or a
    backslash, so that every slice of ``MASK_SLICES`` holds tokens and some tokens fall in none."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": EOS, "<bos>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        i = len(vocab)
        text = ("ab" * 16)[: 2 + i % 30] + str(i)
        vocab[text + ('"' if i % 7 == 0 else "\\\\" if i % 11 == 0 else "")] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return backend.to_str()


def test_the_mask_slices_change_no_mask() -> None:
    """The compiler's finer slices (``MASK_SLICES``) give the masks of llguidance's default slices, step by step
    along seeded random walks through strings with and without ``maxLength``."""
    import random

    import llguidance
    import numpy as np

    from inference_server.core.grammar_compiler import JSON_OPTIONS, MASK_SLICES

    text = varied_tokenizer_json()
    schema = {"type": "object", "properties": {
        "short": {"type": "array", "items": {"type": "string", "maxLength": 7}, "minItems": 3},
        "free": {"type": "string"}}, "required": ["short", "free"], "additionalProperties": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    fine = GrammarCompiler(text, 512, {EOS}).tokenizer
    default = llguidance.LLTokenizer(text, n_vocab=512, eos_token=[EOS])
    assert len(MASK_SLICES) > len(llguidance.LLTokenizer.general_slices())
    steps = 0
    for seed in range(6):
        rng = random.Random(seed)
        a, b = llguidance.LLMatcher(fine, grammar), llguidance.LLMatcher(default, grammar)
        while not a.is_stopped() and steps < 2000:
            mask = np.frombuffer(a.compute_bitmask(), dtype=np.uint8)
            assert np.array_equal(mask, np.frombuffer(b.compute_bitmask(), dtype=np.uint8)), steps
            allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little"))
            token = int(allowed[rng.randrange(len(allowed))])
            assert a.consume_token(token) and b.consume_token(token)
            steps += 1
    assert steps > 100


def test_a_tokenizer_text_function_is_called_once_at_the_first_use() -> None:
    """The server hands the compiler a function giving the tokenizer's JSON: nothing is read before
    ``ensure_tokenizer`` (the engine's start-up), then the text is read once."""
    calls: list[int] = []

    def text() -> str:
        calls.append(1)
        return TOKENIZER_JSON

    compiler = GrammarCompiler(text, 512, {EOS})
    assert calls == [] and not compiler.tokenizer_built
    compiler.ensure_tokenizer()  # what the server runs before the first time-bounded compile
    assert calls == [1] and compiler.tokenizer_built
    assert accepts(compiler, Constraint.regex("ab+", field="regex"), "abb")
    assert accepts(compiler, Constraint.choice(["yes", "no"], field="guided_choice"), "no")
    assert compiler.special_tokens == GrammarCompiler(TOKENIZER_JSON, 512, {EOS}).special_tokens
    assert calls == [1]


def test_a_tokenizer_llguidance_cannot_read_is_refused_by_compile_not_by_ensure_tokenizer() -> None:
    compiler = GrammarCompiler("{not a tokenizer", 512, {EOS})
    compiler.ensure_tokenizer()
    assert not compiler.tokenizer_built
    with pytest.raises(RequestError) as error:
        compiler.compile(Constraint.regex("a+", field="regex"))
    assert error.value.param == "regex" and "not available for this model's tokenizer" in error.value.message


def test_ensure_tokenizer_builds_the_special_token_table_too() -> None:
    """Everything a compile derives from the vocabulary exists once ``ensure_tokenizer`` returned (the engine runs
    it before it is ready): a constraint with a reasoning section, which needs the special tokens, reads no more."""
    calls: list[int] = []

    def special_tokens() -> dict[str, int]:
        calls.append(1)
        return {"<eos>": EOS}

    compiler = GrammarCompiler(TOKENIZER_JSON, 512, {EOS}, special_tokens=special_tokens)
    assert not compiler.ready
    compiler.ensure_tokenizer()
    assert compiler.ready and compiler.tokenizer_built and calls == [1]
    reasoning = Constraint.regex("ab+", field="regex").after_reasoning("<think>", "</think>")
    assert accepts(compiler, reasoning, "<think>x</think>abb")
    assert calls == [1] and compiler.special_tokens == {"<eos>": EOS}


def test_a_tokenizer_llguidance_cannot_read_is_tried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build is remembered: each attempt would parse the whole vocabulary again under the GIL."""
    import llguidance

    builds: list[int] = []
    real = llguidance.LLTokenizer

    def counted(*args: object, **kwargs: object) -> llguidance.LLTokenizer:
        builds.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llguidance, "LLTokenizer", counted)
    compiler = GrammarCompiler("{not a tokenizer", 512, {EOS})
    compiler.ensure_tokenizer()
    assert compiler.ready and not compiler.tokenizer_built
    for _ in range(2):
        with pytest.raises(RequestError, match="not available for this model's tokenizer"):
            compiler.compile(Constraint.regex("a+", field="regex"))
    assert builds == [1]


def test_a_given_tokenizer_builder_replaces_reading_the_json_text() -> None:
    """The server builds llguidance's tokenizer from a cached token table when it can
    (``models/grammar_tokenizer.py``): the compiler hands its mask slices to the builder and reads no JSON."""
    import llguidance

    slices_given: list[list[str]] = []

    def build(slices: list[str]) -> llguidance.LLTokenizer:
        slices_given.append(slices)
        return llguidance.LLTokenizer(TOKENIZER_JSON, n_vocab=512, eos_token=[EOS], slices=slices)

    def no_text() -> str:
        raise AssertionError("the JSON text is not read")

    compiler = GrammarCompiler(no_text, 512, {EOS}, special_tokens=dict, build_tokenizer=build)
    compiler.ensure_tokenizer()
    assert compiler.ready and slices_given == [MASK_SLICES]
    assert accepts(compiler, Constraint.regex("ab+", field="regex"), "abb")
