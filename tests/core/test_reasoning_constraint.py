"""A constraint that starts after the reasoning section (``Constraint.after_reasoning``), on recorded outputs
fed token by token to the compiled matcher, as decoding would: the section (Qwen3's text markers
``<think>…</think>``, or Gemma 4's special-token markers) is free text, the constrained part after it is
enforced as without a section, and the section may be left out.

Vocabularies: the byte-level test vocabulary (every byte one token) with, for the special-token case, two
special tokens added in place of its last two fillers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.records.constraints import Constraint, TaggedJson, json_schema_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

EOS = 1
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
RECORDED_QWEN3 = '<think>\nThe user wants a city as JSON {"city": ...}. Paris.\n</think>\n\n{"city": "Paris"}'
"""A recorded Qwen3 reply under a json_schema constraint (its reasoning even holds JSON-like text)."""


def byte_compiler(specials: tuple[str, ...] = ()) -> tuple[GrammarCompiler, Tokenizer]:
    base = json.loads(byte_level_tokenizer_json(512 - len(specials)))
    tokenizer = Tokenizer.from_str(json.dumps(base))
    tokenizer.add_special_tokens(list(specials))
    text = tokenizer.to_str()
    return GrammarCompiler(text, 512, {EOS}), Tokenizer.from_str(text)


@pytest.fixture(scope="module")
def qwen3() -> tuple[GrammarCompiler, Tokenizer]:
    return byte_compiler()


def feed(compiler: GrammarCompiler, constraint: Constraint, ids: list[int]) -> tuple[bool, bool]:
    """(every token accepted, the output complete: EOS allowed)."""
    matcher = compiler.compile(constraint).matcher()
    accepted = matcher.consume_tokens(ids)
    return accepted, accepted and matcher.is_accepting()


def test_text_markers_free_reasoning_then_the_schema(qwen3: tuple[GrammarCompiler, Tokenizer]) -> None:
    compiler, tokenizer = qwen3
    constraint = Constraint.json_schema(SCHEMA).after_reasoning("<think>", "</think>")
    assert constraint != Constraint.json_schema(SCHEMA)  # a distinct cache entry
    ids = tokenizer.encode(RECORDED_QWEN3).ids
    assert feed(compiler, constraint, ids) == (True, True)
    assert feed(compiler, constraint, tokenizer.encode('{"city": "Rome"}').ids) == (True, True)  # no section
    answer_at = RECORDED_QWEN3.index("{\"city\": \"Paris\"}")
    assert feed(compiler, constraint, tokenizer.encode(RECORDED_QWEN3[:answer_at]).ids) == (True, False)
    for bad in ('<think>x</think>\n{"city": "Oslo"}', '<think>x</think> y</think>{"city": "Rome"}',
                'Sure! {"city": "Rome"}', '<think>x</think>{"city": "Rome"} and more'):
        assert feed(compiler, constraint, tokenizer.encode(bad).ids)[1] is False, bad
    # Without the section the same reply is refused at its first byte: the constraint is what changed.
    assert feed(compiler, Constraint.json_schema(SCHEMA), ids[:1]) == (False, False)


def test_after_the_end_marker_only_the_constrained_part_is_allowed(qwen3: tuple[GrammarCompiler, Tokenizer]) -> None:
    compiler, tokenizer = qwen3
    matcher = compiler.compile(Constraint.json_schema(SCHEMA).after_reasoning("<think>", "</think>")).matcher()
    assert matcher.consume_tokens(tokenizer.encode("<think>hm</think>\n").ids)
    allowed = {i for i in range(3, 259) if matcher.validate_tokens([i]) == 1}
    expected = {tokenizer.encode(c).ids[0] for c in "{ \t\r\n"}
    assert allowed == expected  # whitespace may go on; otherwise only the JSON's first byte


def test_special_token_markers_and_a_tool_call(qwen3: tuple[GrammarCompiler, Tokenizer]) -> None:
    del qwen3
    compiler, tokenizer = byte_compiler(("<|channel>", "<channel|>"))
    start, end = compiler.special_tokens["<|channel>"], compiler.special_tokens["<channel|>"]
    call = TaggedJson(begin="<tool_call>", schema=json_schema_text(SCHEMA), end="</tool_call>")
    constraint = Constraint.tool_calls([call]).after_reasoning("<|channel>thought", "<channel|>")
    thought = tokenizer.encode("thought\nNeed Paris, not </think> or {}.").ids
    answer = tokenizer.encode('<tool_call>{"city": "Paris"}</tool_call>').ids
    assert feed(compiler, constraint, [start, *thought, end, *answer]) == (True, True)
    assert feed(compiler, constraint, answer) == (True, True)
    assert feed(compiler, constraint, [start, *tokenizer.encode("thought").ids, end, *answer]) == (True, True)
    # The markers are the special tokens, not their text; and the section ends at the first end token.
    spelled = [tokenizer.encode(c).ids[0] for c in "<|channel>"]
    assert feed(compiler, constraint, [*spelled, *thought, end, *answer])[0] is False
    assert feed(compiler, constraint, [start, *thought, end, end, *answer])[0] is False
