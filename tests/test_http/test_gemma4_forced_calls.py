"""Forced tool calls in Gemma 4's own call syntax (``tool_choice`` required / named under the ``gemma4`` parser).

The grammar is checked the way a model would meet it: random walks through the compiled matcher (each step a
random token among those the mask allows, over a byte-level vocabulary with Gemma 4's special tokens),
each finished output parsed by the ``gemma4`` parser, whose arguments must validate against the tool's
``parameters`` (``jsonschema``). Then the chat route: a server with the real Gemma 4 chat template admits
``required`` with that grammar, and refuses a schema keyword the grammar cannot enforce, naming ``tool_choice``."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from http_testkit import EOS_ID, FAKE_VOCAB_SIZE, byte_level_tokenizer_json
from tokenizers import Tokenizer as BackendTokenizer

from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.http.chat_output import ChatOutputSpec
from inference_server.http.gemma4_tool_grammar import gemma4_calls_lark
from inference_server.http.tool_parsers import GEMMA4, GEMMA4_QUOTE
from inference_server.models.tokenizer import Tokenizer
from inference_server.records.constraints import Constraint

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SPECIALS = [GEMMA4.start, GEMMA4.end, GEMMA4_QUOTE, "<|channel>", "<channel|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "exact": {"type": "boolean"}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "$defs": {"Zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"},
                                     "offset": {"anyOf": [{"type": "number", "minimum": -12, "maximum": 12},
                                                          {"type": "null"}]}},
    "required": ["zone", "offset"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def gemma_vocabulary() -> tuple[str, BackendTokenizer]:
    backend = BackendTokenizer.from_str(byte_level_tokenizer_json(FAKE_VOCAB_SIZE - len(SPECIALS)))
    backend.add_special_tokens(SPECIALS)
    return backend.to_str(), backend


@pytest.fixture(scope="module")
def compiler() -> tuple[GrammarCompiler, BackendTokenizer]:
    text, backend = gemma_vocabulary()
    return GrammarCompiler(text, FAKE_VOCAB_SIZE, {EOS_ID}), backend


def random_output(compiler: GrammarCompiler, constraint: Constraint, rng: random.Random, steps: int = 300
                  ) -> list[int] | None:
    """Token ids sampled uniformly among the allowed ones (EOS as soon as allowed); None if unfinished."""
    matcher = compiler.compile(constraint).matcher()
    out: list[int] = []
    for _ in range(steps):
        if matcher.is_accepting():
            return out
        allowed = [i for i in range(FAKE_VOCAB_SIZE) if i != EOS_ID and matcher.validate_tokens([i]) == 1]
        assert allowed, "the grammar never dead-ends"
        token = rng.choice(allowed)
        assert matcher.consume_token(token)
        out.append(token)
    return None


@pytest.mark.parametrize(("forced", "several"), [(TOOLS, True), ([WEATHER], False), ([TIME], False)])
def test_random_walks_are_valid_calls(compiler: tuple[GrammarCompiler, BackendTokenizer],
                                      forced: list[dict[str, Any]], several: bool) -> None:
    grammar, backend = compiler
    constraint = Constraint.from_grammar(gemma4_calls_lark(forced, several=several), syntax="lark",
                                         field="tool_choice")
    names = frozenset(t["function"]["name"] for t in forced)
    rng = random.Random(7)
    finished = 0
    for _ in range(20):
        ids = random_output(grammar, constraint, rng)
        if ids is None:
            continue
        finished += 1
        text = backend.decode(ids, skip_special_tokens=False)
        message = ChatOutputSpec(GEMMA4, names, True).processor().message(text)
        assert message["content"] is None, text
        calls = message["tool_calls"]
        assert calls and (several or len(calls) == 1), text
        for call in calls:
            assert call["function"]["name"] in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert finished >= 15


def test_a_recorded_call_is_accepted_and_a_bad_one_refused(compiler: tuple[GrammarCompiler, BackendTokenizer]
                                                           ) -> None:
    grammar, backend = compiler
    constraint = Constraint.from_grammar(gemma4_calls_lark([WEATHER], several=False), syntax="lark")
    q = GEMMA4_QUOTE
    good = f'<|tool_call>call:get_weather{{city:{q}Paris{q},days:3,tags:[{q}a{q}],unit:{q}celsius{q}}}<tool_call|>'
    for text, valid in [(good, True), (good.replace("days:3", "days:9"), False),
                        (good.replace(f"city:{q}Paris{q},", ""), False),  # a required key missing
                        (good.replace("get_weather", "get_time"), False)]:
        matcher = grammar.compile(constraint).matcher()
        accepted = matcher.consume_tokens(backend.encode(text).ids)
        assert (accepted and matcher.is_accepting()) == valid, text


@pytest.mark.parametrize(("parameters", "keyword"), [
    ({"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "string"}, "object"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}},
     "recursive"),
])
async def test_the_chat_route_forces_gemma4_calls(serve, tokenizer_folder: Path, tmp_path: Path,
                                                  parameters: dict[str, Any], keyword: str) -> None:
    folder = tmp_path / "gemma4"
    shutil.copytree(tokenizer_folder, folder)
    (folder / "chat_template.jinja").write_text((TEMPLATES / "gemma4.jinja").read_text())
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    text, _ = gemma_vocabulary()
    grammar = GrammarCompiler(text, FAKE_VOCAB_SIZE, {EOS_ID})
    messages = [{"role": "user", "content": "the weather ?"}]
    async with serve(tokenizer=tokenizer, grammar=grammar) as served:
        assert served.state.tool_format is GEMMA4
        response = await served.client.post("/v1/chat/completions", json={
            "messages": messages, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 5})
        assert response.status_code == 200, await response.get_json()
        # The template has Gemma 4's thinking channel: the call may follow a reasoning section.
        expected = Constraint.from_grammar(gemma4_calls_lark([WEATHER], several=True), syntax="lark"
                                           ).after_reasoning("<|channel>thought", "<channel|>")
        assert grammar.cached(expected)
        bad = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        response = await served.client.post("/v1/chat/completions", json={
            "messages": messages, "tools": bad, "tool_choice": "required", "max_tokens": 5})
        body = await response.get_json()
        assert response.status_code == 400 and body["error"]["param"] == "tool_choice", body
        assert keyword in body["error"]["message"]
